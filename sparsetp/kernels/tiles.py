"""Kernel tile configurations and the heuristic that picks one per launch.

A :class:`TileConfig` is the (query x key) tile a program owns, the sub-tile it walks per loop
step, and the compile options (warps, stages). :func:`tile_config` is the default: a function
of the kernel, head dim, dtype, layout block and device kind. Measurements behind each choice:
``benchmarks/KERNEL_NOTES.md`` (sections "v2", "v3", "v10", "v12").

Example::

    >>> tile_config("fwd", head_dim=64, dtype="bfloat16", block_size=64, device_kind="cuda")
    TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, sub=64)
"""

from __future__ import annotations

import dataclasses

from sparsetp.core.config import DTYPES
from sparsetp.core.layout import SUPPORTED_BLOCK_SIZES
from sparsetp.kernels import options as _options

__all__ = ["SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "SUPPORTED_BLOCK_SIZES", "KERNEL_NAMES",
           "DEVICE_KINDS", "TileConfig", "tile_config", "check_head_dim", "check_dtype"]

# Every multiple of 16 from 16 to 256 (tl.dot needs K >= 16 and multiples of 16). tl.arange needs
# a power of two, so the kernels run a head dim like 80 or 192 as HEAD_DIM_PAD = 128 / 256
# columns with the extra ones masked (abi.head_dim_padded, attention._cols_ok). Above 128 the
# [BLOCK, D] fp32 accumulators need the block-64 tiles picked below (schedule.kernel_layout
# runs a block-128 layout at block 64 there).
SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 16))
# The head dims above which the kernels need tiles of at most this block.
LARGE_HEAD_DIM = 128
LARGE_HEAD_DIM_MAX_BLOCK = 64
SUPPORTED_DTYPES = DTYPES
KERNEL_NAMES = ("fwd", "bwd_dq", "bwd_dkdv")
DEVICE_KINDS = ("cuda", "interpreter")


def check_head_dim(head_dim: int, arg: str = "q") -> int:
    """``head_dim`` as an int, or ``ValueError`` naming ``arg`` when the kernels lack it."""
    if isinstance(head_dim, bool) or head_dim not in SUPPORTED_HEAD_DIMS:
        if isinstance(head_dim, int) and head_dim > max(SUPPORTED_HEAD_DIMS):
            raise ValueError(
                f"{arg} has head dim {head_dim}; head dims above {max(SUPPORTED_HEAD_DIMS)} are "
                f"not supported: the kernels keep [BLOCK, {head_dim}] fp32 accumulators in "
                "registers, which would not fit without a split-D accumulator")
        raise ValueError(f"{arg} has head dim {head_dim}; supported head dims are the multiples "
                         f"of 16 from 16 to {max(SUPPORTED_HEAD_DIMS)} (tl.dot needs >= 16)")
    return int(head_dim)


def check_dtype(dtype, arg: str = "q") -> str:
    """The dtype's name (``torch.bfloat16`` and ``"bfloat16"`` alike), or ``ValueError``."""
    name = str(dtype).replace("torch.", "")
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"{arg} has dtype {dtype}; supported dtypes are {SUPPORTED_DTYPES}")
    return name


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch parameters of one kernel launch (validated on construction).

    ``block_m`` x ``block_n`` is the (query x key) tile a program owns; for now both equal the
    layout block. ``sub`` is the sub-tile the kernel walks per loop step along the *other*
    dimension: keys (``SUB_N``) in the forward and dQ kernels, queries (``SUB_M``) in dK/dV;
    ``None`` means the whole block. It must divide the block and be >= 16 (``tl.dot``).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    sub: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v not in SUPPORTED_BLOCK_SIZES:
                raise ValueError(f"TileConfig.{name} must be one of {SUPPORTED_BLOCK_SIZES}, "
                                 f"got {v!r}")
        if self.block_m != self.block_n:
            raise ValueError(f"TileConfig needs block_m == block_n (the layout block), got "
                             f"{self.block_m} x {self.block_n}")
        if self.sub is None:
            object.__setattr__(self, "sub", self.block_n)
        if (not isinstance(self.sub, int) or not _pow2(self.sub) or self.sub < 16
                or self.sub > self.block_n):
            raise ValueError(f"TileConfig.sub must be a power of two in [16, {self.block_n}], "
                             f"got {self.sub!r}")
        if not isinstance(self.num_warps, int) or not _pow2(self.num_warps) or self.num_warps > 16:
            raise ValueError(f"TileConfig.num_warps must be a power of two <= 16, got "
                             f"{self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"TileConfig.num_stages must be an int in [1, 8], got "
                             f"{self.num_stages!r}")



def tile_config(kernel_name: str, *, head_dim: int, dtype: str, block_size: int,
                device_kind: str) -> TileConfig:
    """The tile config of one launch: :attr:`LaunchOptions.tiles` if it names the kernel, else
    the heuristic below (FlashAttention-2 / the Triton fused-attention tutorial on Hopper, then
    measured; comments give the register and shared-memory arithmetic). The kept tile equals
    the layout block. The interpreter ignores warps and stages and gets ``sub = block`` (fewest
    Python-level loop steps)."""
    if kernel_name not in KERNEL_NAMES:
        raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {kernel_name!r}")
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind must be one of {DEVICE_KINDS}, got {device_kind!r}")
    check_head_dim(head_dim)
    dtype = check_dtype(dtype)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size!r}")
    override = _options.current().tiles.get(kernel_name)
    if override is not None:
        if override.block_n != block_size:
            raise ValueError(f"the tiles option for {kernel_name} has block "
                             f"{override.block_n}, but the layout block is {block_size}")
        return override
    if device_kind == "interpreter":
        # One sub-tile per tile: fewest (slow, Python-level) loop steps; warps/stages unused.
        return TileConfig(block_size, block_size, 1, 1)
    wide = dtype in ("float32", "float64")
    bs = block_size
    if head_dim > LARGE_HEAD_DIM:
        # D = 144..256 (padded to 256), FlashAttention-2's 64-row tiles. Half precision at
        # block 64, swept on an H200 (KERNEL_NOTES.md, "Session 14"): the forward walks 32 keys
        # a step with one warpgroup and 2 stages (2.7x the 8-warp, 1-stage start); the backward
        # walks 64 with 8 warps and 2 stages (2 x 2 x [64, 256] x 2 B = 128 KB of Q/dO or
        # K/V stages, within the 227 KB of shared memory; 2x the forward+backward of the start).
        # float32 doubles those bytes, so it keeps the start: 8 warps, 1 stage, sub-tiles of 32.
        if bs > LARGE_HEAD_DIM_MAX_BLOCK:
            raise ValueError(f"head dim {head_dim} needs a kernel block of at most "
                             f"{LARGE_HEAD_DIM_MAX_BLOCK}, got {bs} (schedule.kernel_layout "
                             "picks one from a BlockLayout; a JAX LayoutArrays needs "
                             "layout_arrays(layout, head_dim=...))")
        if bs == 64 and not wide:
            if kernel_name == "fwd":
                return TileConfig(bs, bs, 4, 2, sub=32)
            return TileConfig(bs, bs, 8, 2, sub=64)
        return TileConfig(bs, bs, 8 if bs == 64 else 4, 1, sub=min(bs, 32))
    if kernel_name == "fwd":
        # A 128-query tile walked 64 keys at a time: the [128, 64] fp32 score tile plus the
        # [128, D] accumulator stay in registers with 8 warps, and 3 stages of K, V sub-tiles
        # (3 * 2 * 64 * D * 2 B = 96 KB at D=128) fit in shared memory without spills.
        if bs >= 128:
            return TileConfig(bs, bs, 8 if head_dim >= 64 else 4, 2 if wide else 3, sub=64)
        if bs == 64:
            return TileConfig(bs, bs, 4, 2 if wide else 3, sub=64)
        return TileConfig(bs, bs, 2 if bs == 16 else 4, 2 if wide else 3, sub=bs)
    # bwd_dq / bwd_dkdv keep four [BLOCK, D] tiles and stream sub-tiles of the other side (the
    # Triton tutorial's 128 kept, 32 walked). The whole-tile step spills at D=128; two
    # [128, 128] fp32 accumulators need 8 warps at D >= 64. 3 stages of [64, 128] Q and dO
    # tiles are 96 KB of shared memory (within the H100/H200's 227 KB); FlexAttention's H100
    # default for D=128 is the same shape. Sweeps: KERNEL_NOTES.md ("v2", "v3").
    if bs >= 128 and head_dim == 128 and not wide:
        return TileConfig(bs, bs, 8, 3, sub=64)
    if bs >= 128:
        return TileConfig(bs, bs, 8 if head_dim >= 64 else 4, 2 if wide else 3, sub=32)
    if bs == 64 and head_dim == 128 and not wide:
        # One warpgroup per program, two programs per SM: at tile 128 the two warpgroups of a
        # program meet at a barrier every step; two independent programs overlap instead
        # (KERNEL_NOTES.md, "v10").
        return TileConfig(bs, bs, 4, 2, sub=64)
    if bs == 64:
        return TileConfig(bs, bs, 4, 2 if wide else 3, sub=32)
    return TileConfig(bs, bs, 2 if bs == 16 else 4, 2 if wide else 3, sub=bs)
