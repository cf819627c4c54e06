"""Triton kernels and their framework-neutral launch layer (no torch, no jax).

* :mod:`~sparsetp.kernels.attention`: the ``@triton.jit`` sources (one per pass).
* :mod:`~sparsetp.kernels.abi`: argument orders, input checks, launch descriptions.
* :mod:`~sparsetp.kernels.tiles`: tile configs and the heuristic that picks one.
* :mod:`~sparsetp.kernels.schedule`: head grouping, work order, the kernel-tile cost model.
* :mod:`~sparsetp.kernels.options`: the frozen launch options and how to change them.
* :mod:`~sparsetp.kernels.interpreter`: the same kernels in Triton's interpreter (CPU tensors).
"""

from sparsetp.kernels import abi, attention, interpreter, options, schedule, tiles

__all__ = ["abi", "attention", "interpreter", "options", "schedule", "tiles"]
