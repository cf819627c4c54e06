"""Framework-neutral spec layer: patterns, block layouts, configs, parameters, float64 oracle.

Imports numpy and the standard library only (never torch or jax), so both frontends share it.
"""

from sparsetp.core import patterns
from sparsetp.core.layout import SUPPORTED_BLOCK_SIZES, BlockLayout, make_layout

__all__ = ["patterns", "BlockLayout", "make_layout", "SUPPORTED_BLOCK_SIZES"]
