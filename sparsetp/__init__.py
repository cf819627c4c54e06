"""sparsetp: block-sparse attention (Triton) and tensor parallelism, the same in PyTorch and JAX.

Import a frontend explicitly: ``sparsetp.torch`` or ``sparsetp.jax``; the framework-neutral
spec layer is ``sparsetp.core``. Importing ``sparsetp`` alone imports no framework.
"""

__version__ = "0.1.0"
