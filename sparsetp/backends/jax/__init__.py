"""JAX frontend: the sparsetp Triton kernels through ``jax_triton`` (GPU) or ``buffer_callback`` +
Triton's interpreter (CPU), a ``custom_vjp`` attention op, and ``shard_map`` tensor parallelism.

Submodules: :mod:`.launch` (kernel launches), :mod:`.attention` (``sparse_attention``),
:mod:`.layers` (column/row-parallel linear, parallel MLP), :mod:`.block` (``hybrid_block``,
parameter sharding and interchange), :mod:`.demo`, :mod:`.compat` (version differences).
The public names are re-exported by :mod:`sparsetp.jax`.
"""
