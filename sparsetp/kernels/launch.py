"""Framework-neutral launch logic for the block-sparse attention kernels.

Nothing here imports torch or jax. A frontend turns its arrays into a :class:`KernelCall` with
one of :func:`fwd_call`, :func:`bwd_preprocess_call`, :func:`bwd_dq_call`,
:func:`bwd_dkdv_call`, then launches ``call.kernel`` its own way. The kernel signature is always

    (*call.args, *<one pointer per call.outputs entry>, **call.constexprs)

i.e. input pointers, then scalars (the scale as two fp32 parts, see :func:`scale_args`; N, H,
every stride, including the strides of the outputs), then the output pointers, then
constexprs by keyword. That is exactly the order
``jax_triton.triton_call`` uses (it appends output pointers after all positional arguments).

Torch (compiled on CUDA, or Triton's interpreter on CPU)::

    call = fwd_call(q, k, v, meta, scale=s, dtype="bfloat16", device_kind="cuda",
                    strides={"q": q.stride(), "k": k.stride(), "v": v.stride(),
                             "out": out.stride(), "lse": lse.stride()})
    call.kernel[call.grid](*call.args, out, lse, **call.constexprs,
                           num_warps=call.num_warps, num_stages=call.num_stages)

JAX (GPU, through jax_triton; arrays are contiguous, so ``strides`` may be omitted)::

    call = fwd_call(q, k, v, meta, scale=s, dtype=q.dtype.name, device_kind="cuda")
    out, lse = jax_triton.triton_call(
        *call.args, kernel=call.kernel, grid=call.grid,
        out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in call.outputs],
        num_warps=call.num_warps, num_stages=call.num_stages, **call.constexprs)

JAX on CPU: wrap numpy buffers with ``torch.from_numpy`` (the interpreter runs on torch CPU
tensors) and launch as torch does, with ``device_kind="interpreter"``; serialise interpreted
launches with a lock (the interpreter is not thread-safe).

Arguments
---------
``q, k, v`` (and ``out``, ``d_out``, ``lse``, ``delta``) are passed through untouched into
``call.args``; only ``.shape`` is read. ``meta`` is a mapping with the int32 arrays of
:meth:`sparsetp.core.layout.BlockLayout.metadata` (``q_count``, ``q_partial``, ``q_index``,
``q_mask_id``, ``q_order``, ``k_count``, ``k_partial``, ``k_index``, ``k_mask_id``, ``k_order``,
``masks``), already on
the device and **C-contiguous** (their strides are computed from their shapes), and optionally
the layout's Python ints ``q_head_group`` / ``k_head_group`` (how launches order heads, see
:func:`grid_group`; missing means all heads interleaved). ``strides`` maps
tensor names to element strides; a name left out means C-contiguous. Names: ``q k v out lse``
(forward), ``out d_out delta`` (preprocess), ``q k v d_out lse dq`` (dQ; ``delta`` shares the
``lse`` strides), ``q k v d_out lse dk dv`` (dK/dV; same). ``lse`` and ``delta`` are
``[B, H, N]`` in :func:`stats_dtype` (float32, or float64 for float64 inputs). ``scale`` is the
softmax scale (default ``D ** -0.5`` is the frontend's job). All scalars are Python ints/floats
(``jax_triton`` only recognises those as scalars).

Supported: head dims :data:`SUPPORTED_HEAD_DIMS` (16, 32, 64, 128; ``tl.dot`` needs >= 16 and
a power of two for ``tl.arange``; larger dims would need a split accumulator), dtypes float16,
bfloat16, float32 (float64 too, for gradcheck: within 1e-10 of the float64 oracle in the
interpreter and on the GPU, ~1e-14 measured in the interpreter; not a fast path),
layout block sizes 16, 32, 64, 128 (the layout block is the kernel tile for now).

Example::

    >>> tile_config("fwd", head_dim=64, dtype="bfloat16", block_size=64, device_kind="cuda")
    TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, sub=64)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparsetp.core.patterns import EMPTY
from sparsetp.kernels import attention as _k

__all__ = [
    "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "SUPPORTED_BLOCK_SIZES", "DEVICE_KINDS",
    "KERNEL_NAMES", "WORK_ORDERS", "TileConfig", "OutputSpec", "KernelCall", "tile_config",
    "check_head_dim",
    "check_dtype", "stats_dtype", "dot_precision", "dot_upcast", "mask_words", "grid", "aligned",
    "contiguous_strides",
    "fwd_call", "bwd_preprocess_call", "bwd_dq_call", "bwd_dkdv_call", "kernel",
    "fwd_split_cap", "split_slots", "fwd_split_call", "fwd_merge_call", "kernel_layout",
]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
DEVICE_KINDS = ("cuda", "interpreter")
KERNEL_NAMES = ("fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv")

_KERNELS = {
    "fwd": _k._attn_fwd_kernel,
    "bwd_preprocess": _k._attn_bwd_preprocess_kernel,
    "bwd_dq": _k._attn_bwd_dq_kernel,
    "bwd_dkdv": _k._attn_bwd_dkdv_kernel,
    # Row splitting (issue #8, private option ``split_cap``): the forward's chunk and merge
    # kernels; they use the "fwd" and "bwd_preprocess" tile configs.
    "fwd_split": _k._attn_fwd_split_kernel,
    "fwd_merge": _k._attn_fwd_merge_kernel,
}


# Identifies the kernel objects in use: launch-description caches key on it, so swapping in
# another version of the kernels (benchmarks only, :func:`_using_kernels`) never reuses a
# description built around the previous objects.
_KERNELS_KEY = tuple(map(id, _KERNELS.values()))


def _load_kernels(path: str) -> dict:
    """The kernels, by :data:`_KERNELS` name, of a copy of ``sparsetp/kernels/attention.py`` at
    ``path`` (e.g. ``git show <rev>:sparsetp/kernels/attention.py``): for benchmarks that time
    kernel versions against each other. Use them with :func:`_using_kernels`."""
    import importlib.util
    import os

    name = os.path.splitext(os.path.basename(path))[0].lstrip(".")
    spec = importlib.util.spec_from_file_location(f"sparsetp_kernels_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {nm: getattr(mod, fn.fn.__name__) for nm, fn in _KERNELS.items()}


@contextlib.contextmanager
def _using_kernels(kernels: Mapping[str, Any]):
    """Temporarily launch ``kernels`` (name -> ``@triton.jit`` kernel, e.g. from
    :func:`_load_kernels`) instead of this package's. Not thread-safe (benchmarks only); like
    :func:`_override`, read when a call is built (at trace time under ``jax.jit``)."""
    global _KERNELS_KEY
    unknown = set(kernels) - set(_KERNELS)
    if unknown:
        raise ValueError(f"kernel names must be among {tuple(_KERNELS)}, got {sorted(unknown)}")
    saved = dict(_KERNELS)
    try:
        _KERNELS.update(kernels)
        _KERNELS_KEY = tuple(map(id, _KERNELS.values()))
        yield
    finally:
        _KERNELS.clear()
        _KERNELS.update(saved)
        _KERNELS_KEY = tuple(map(id, _KERNELS.values()))


def kernel(name: str):
    """The ``@triton.jit`` kernel object called ``name`` (one of :data:`KERNEL_NAMES`)."""
    try:
        return _KERNELS[name]
    except KeyError:
        raise ValueError(f"kernel must be one of {tuple(_KERNELS)}, got {name!r}") from None


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


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """An output buffer the launcher must allocate: name, shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """Everything needed to launch one kernel; see the module docstring for the order."""

    name: str
    kernel: Any
    grid: tuple[int, int, int]
    args: tuple
    outputs: tuple[OutputSpec, ...]
    constexprs: Mapping[str, Any]
    num_warps: int
    num_stages: int


def check_head_dim(head_dim: int, arg: str = "q") -> int:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        if isinstance(head_dim, int) and head_dim > max(SUPPORTED_HEAD_DIMS):
            raise ValueError(
                f"{arg} has head dim {head_dim}; head dims above {max(SUPPORTED_HEAD_DIMS)} are "
                f"not supported (supported: {SUPPORTED_HEAD_DIMS}): the kernels keep "
                f"[BLOCK, {head_dim}] fp32 accumulators in registers, which would not fit "
                "without a split-D accumulator")
        raise ValueError(f"{arg} has head dim {head_dim}; supported head dims are "
                         f"{SUPPORTED_HEAD_DIMS} (tl.dot needs >= 16 and a power of two)")
    return int(head_dim)


def check_attention_shapes(q_shape, k_shape, v_shape, layout, scale) -> float:
    """The framework-neutral input checks both frontends share (one place, one wording):
    q/k/v shapes, the layout's sequence length and head count, batch, scale and head dim.
    ``layout`` is anything with ``seq_len`` and ``num_heads``. Returns the softmax scale."""
    q_shape = tuple(q_shape)
    if len(q_shape) != 4:
        raise ValueError(f"q must have shape [B, H, N, D], got {q_shape}")
    for name, shape in (("k", tuple(k_shape)), ("v", tuple(v_shape))):
        if shape != q_shape:
            raise ValueError(f"{name} has shape {shape} but q has {q_shape}; "
                             "q, k and v must share one [B, H, N, D] shape")
    b, h, n, d = q_shape
    if layout.seq_len != n:
        raise ValueError(f"layout is for seq_len={layout.seq_len} but q has N={n}")
    if layout.num_heads != h:
        raise ValueError(f"layout is for num_heads={layout.num_heads} but q has H={h}")
    if b == 0:
        raise ValueError("q has batch size 0")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ValueError(f"scale must be a Python float or None, got {type(scale).__name__}")
    check_head_dim(d, "q")
    return (d ** -0.5) if scale is None else float(scale)


def scale_args(scale: float) -> tuple[float, float]:
    """The kernels' ``sm_scale, sm_scale_lo`` for a softmax ``scale``: fp32(scale) and the fp32
    of what that rounding left. Triton passes every Python float as fp32 (and the JAX launcher
    does the same, so both compile one kernel); fp64 kernels add the parts back, which gives
    the scale to ~1e-15 instead of fp32's 6e-8 (``attention._softmax_scale``). The first part
    is exactly the fp32 the kernels always received.

    >>> scale_args(0.125)
    (0.125, 0.0)
    >>> hi, lo = scale_args(128 ** -0.5)
    >>> abs(hi + lo - 128 ** -0.5) < 1e-16 < abs(hi - 128 ** -0.5)
    True
    """
    hi = float(np.float32(scale))
    return hi, float(np.float32(float(scale) - hi))


def check_dtype(dtype: str, arg: str = "q") -> str:
    name = str(dtype).replace("torch.", "")
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"{arg} has dtype {dtype}; supported dtypes are {SUPPORTED_DTYPES}")
    return name


def stats_dtype(dtype: str) -> str:
    """dtype name of the LSE and Delta buffers (softmax statistics)."""
    return "float64" if check_dtype(dtype) == "float64" else "float32"


def dot_precision(dtype: str) -> str:
    """tl.dot input precision: full IEEE for fp32/fp64 inputs (tf32 would cost ~1e-3 relative
    error and fail float32 tests); for fp16/bf16 the setting is moot and we pass the default."""
    return "ieee" if check_dtype(dtype) in ("float32", "float64") else "tf32"


def mask_words(block_size: int) -> int:
    """int32 words per tile row of the bitmask table (one bit per key column)."""
    return -(-block_size // 32)


def tile_config(kernel_name: str, *, head_dim: int, dtype: str, block_size: int,
                device_kind: str) -> TileConfig:
    """Default launch config: a heuristic of (kernel, head dim, dtype, block size, device).

    The kept tile equals the layout block; ``sub`` (the sub-tile walked per loop step) and
    warps/stages follow FlashAttention-2 and the Triton fused-attention tutorial on Hopper
    (comments in the body give the register / shared-memory arithmetic). The interpreter
    ignores warps and stages and gets ``sub = block`` (fewest Python-level loop steps).
    These are guesses until ``benchmarks/gpu_attention_check.py``'s sweep settles them.
    """
    if kernel_name not in KERNEL_NAMES:
        raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {kernel_name!r}")
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind must be one of {DEVICE_KINDS}, got {device_kind!r}")
    check_head_dim(head_dim)
    dtype = check_dtype(dtype)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size!r}")
    override = _OVERRIDES.get(kernel_name)
    if override is not None:
        if override.block_n != block_size:
            raise ValueError(f"tile config override for {kernel_name} has block "
                             f"{override.block_n}, but the layout block is {block_size}")
        return override
    if device_kind == "interpreter":
        # One sub-tile per tile: fewest (slow, Python-level) loop steps; warps/stages unused.
        return TileConfig(block_size, block_size, 1, 1)
    wide = dtype in ("float32", "float64")
    bs = block_size
    if kernel_name == "bwd_preprocess":
        return TileConfig(bs, bs, 4, 1)
    if kernel_name == "fwd":
        # A 128-query tile walked 64 keys at a time (FA2 / the Triton tutorial on Hopper): the
        # [128, 64] fp32 score tile plus the [128, D] accumulator stay in registers with 8 warps,
        # and 3 stages of K, V sub-tiles (3 * 2 * 64 * D * 2 B = 96 KB at D=128) fit in shared
        # memory. sm_90 cubins built locally (Triton 3.9, cuobjdump --dump-resource-usage), bf16,
        # D=128: sub 64 / 3 stages needs 200 B of stack per thread, sub 128 / 2 stages 712 B.
        if bs >= 128:
            return TileConfig(bs, bs, 8 if head_dim >= 64 else 4, 2 if wide else 3, sub=64)
        if bs == 64:
            return TileConfig(bs, bs, 4, 2 if wide else 3, sub=64)
        return TileConfig(bs, bs, 2 if bs == 16 else 4, 2 if wide else 3, sub=bs)
    # bwd_dq / bwd_dkdv keep four [BLOCK, D] tiles (k, v, dk, dv or q, do, dq, +K/V operands)
    # and stream 32-row sub-tiles of the other side (Triton tutorial: BLOCK_N1 = BLOCK_M2 =
    # 128 kept, 32 walked). The old whole-tile step (sub 128, 8 warps, 1 stage) needs 1528 B of
    # stack per thread in dK/dV (sm_90 cubin as above, D=128 bf16: spills); sub 32 with 8 warps
    # and 3 stages needs 288 B (dK/dV) and 16 B (dQ). 4 warps, as the tutorial uses at D=64,
    # cannot hold two [128, 128] fp32 accumulators (256 registers per thread): 8 warps at D>=64.
    # H200 sweep (session 3, bf16, D=128, N=32768, benchmarks/results/
    # gpu_attention_check_h200_run4.json): against 64-row sub-tiles with 2 stages, 16-row
    # sub-tiles lost 28-35% fwd+bwd and the whole-tile step 44-63%. The next sweeps (session 3
    # run5, its file lost; session 4 gpu_attention_check_h200_s4_run1.json) put 3 stages ahead
    # of 2 at sub 64: fwd+bwd causal 42.11 vs 44.80 ms, bigbird 2.85 vs 3.15, strided 4.42 vs
    # 4.73, window 3.66 vs 3.69 (4 stages: causal 41.44, the others equal or slower; 16 warps:
    # 1.6-2x slower, s4_run5). 3 stages of [64, 128] Q and dO tiles are 96 KB of shared memory,
    # within the H100/H200's 227 KB. FlexAttention's H100 default for D=128 is the same shape:
    # 64 x 128, 8 warps, 3 stages.
    if bs >= 128 and head_dim == 128 and not wide:
        return TileConfig(bs, bs, 8, 3, sub=64)
    if bs >= 128:
        return TileConfig(bs, bs, 8 if head_dim >= 64 else 4, 2 if wide else 3, sub=32)
    if bs == 64 and head_dim == 128 and not wide:
        # One warpgroup per program and two programs per SM (2 x 96 KB of shared memory with
        # 2 stages; 3 stages would fit one). At tile 128 the two warpgroups of a program meet
        # at a CTA barrier every step: ncu (session 7, causal N=8192, H200) put 10 % of dK/dV's
        # stall samples on the first shared load after it. Two independent programs overlap
        # instead: at ncu's fixed clocks dK/dV 1.56 -> 1.26 ms and dQ 0.97 -> 0.91 ms against
        # the tile-128 kernels, and against the sub-32 / 3-stage config below fwd+bwd is
        # 1-22 % faster on the issue-8 patterns (two tile A/Bs; benchmarks/KERNEL_NOTES.md, v10).
        return TileConfig(bs, bs, 4, 2, sub=64)
    if bs == 64:
        return TileConfig(bs, bs, 4, 2 if wide else 3, sub=32)
    return TileConfig(bs, bs, 2 if bs == 16 else 4, 2 if wide else 3, sub=bs)


# ----------------------------------------------------------------------------- private options
# Launch options the benchmarks and tests change through :func:`_override` (never a public API:
# they exist so one GPU run can measure alternatives, and so the interpreter can run
# non-default sub-tile configs).
#   work_order: "auto" (default)    per view (query-major: forward, dQ, split forward;
#                                   key-major: dK/dV), the layout's head groups
#                                   (``{q,k}_head_group`` in the metadata, see
#                                   sparsetp.core.layout.head_group), longest lists first;
#               "natural"           one-axis grid (B*H*tiles,), heads one after another, tile =
#                                   rank;
#               "longest_first"     one-axis grid, tile = layout.{q,k}_order[h, rank]: each
#                                   head's longest lists start first;
#               "longest_first_bh"  grid (B*H, tiles), same order, heads fastest: rank r of every
#                                   head is dispatched before rank r + 1 of any head.
#               (:func:`list_grid`; the kernels read the order off the grid's shape, so no order
#               compiles anything.)
#   head_group: None (default)      the work order's head groups (above);
#               G >= 1              groups of G heads in any work order (:func:`grid_group`;
#                                   ``gpu_attention_check.py --order_ab`` times them).
#   split_cap:  None (default)      the forward runs one program per query row;
#               C >= 1              rows with more than C list entries are split into chunks of
#                                   C entries (fwd_split_call + fwd_merge_call, issue #8). Off
#                                   by default until the GPU sweep measures it.
WORK_ORDERS = ("auto", "natural", "longest_first", "longest_first_bh")
# Heads fastest took BigBird's forward from 1.24 to 0.70 ms on the H200 (session-3 run4 sweep,
# N=32768: its global rows no longer trail at the end of the grid) and fwd+bwd from 5.36 to
# 3.02 ms, strided from 5.71 to 4.81; one head after another is faster where no list is long
# next to the whole launch (causal N=32768 forward 9.94 vs 10.63 ms on an H100, interleaved A/B;
# see sparsetp.core.layout.HEAD_MAJOR_TAIL). "auto" picks per view.
#   kernel_tile: "auto" (default)   :func:`kernel_layout`'s cost model on CUDA; the layout's
#                                   own block in the interpreter (CPU tests run every block);
#               "layout"            always the layout's own block;
#               16 / 32 / 64 / 128  that kernel tile wherever it is >= the layout block (tests
#                                   and benchmarks; the interpreter too).
_OPTIONS: dict[str, Any] = {"work_order": "auto", "split_cap": None,
                            "kernel_tile": "auto", "head_group": None}
_KEEP = object()
_OVERRIDES: dict[str, TileConfig] = {}


@contextlib.contextmanager
def _override(work_order: str | None = None, split_cap: Any = _KEEP,
              kernel_tile: Any = None, head_group: Any = _KEEP, **configs: TileConfig):
    """Temporarily change the work order, the forward's split cap (an int >= 1, or None for
    off), the kernel-tile policy (see :func:`kernel_layout`) and/or the tile config of kernels
    by name, e.g.
    ``with _override(work_order="natural", bwd_dkdv=TileConfig(64, 64, 4, 2, sub=16)): ...``.
    Not thread-safe (tests and benchmarks only). Under ``jax.jit`` the option is read at trace
    time: a function traced outside the ``with`` keeps the path it was traced with."""
    if work_order is not None and work_order not in WORK_ORDERS:
        raise ValueError(f"work_order must be one of {WORK_ORDERS}, got {work_order!r}")
    if split_cap is not _KEEP and split_cap is not None and (
            isinstance(split_cap, bool) or not isinstance(split_cap, int) or split_cap < 1):
        raise ValueError(f"split_cap must be None or an int >= 1, got {split_cap!r}")
    if head_group is not _KEEP and head_group is not None and (
            isinstance(head_group, bool) or not isinstance(head_group, int) or head_group < 1):
        raise ValueError(f"head_group must be None or an int >= 1, got {head_group!r}")
    if kernel_tile is not None and kernel_tile not in ("auto", "layout", *SUPPORTED_BLOCK_SIZES):
        raise ValueError(f"kernel_tile must be 'auto', 'layout' or one of "
                         f"{SUPPORTED_BLOCK_SIZES}, got {kernel_tile!r}")
    for name, cfg in configs.items():
        if name not in KERNEL_NAMES or not isinstance(cfg, TileConfig):
            raise ValueError(f"override needs kernel names {KERNEL_NAMES} -> TileConfig, got "
                             f"{name}={cfg!r}")
    saved = (dict(_OPTIONS), dict(_OVERRIDES))
    try:
        if work_order is not None:
            _OPTIONS["work_order"] = work_order
        if split_cap is not _KEEP:
            _OPTIONS["split_cap"] = split_cap
        if kernel_tile is not None:
            _OPTIONS["kernel_tile"] = kernel_tile
        if head_group is not _KEEP:
            _OPTIONS["head_group"] = head_group
        _OVERRIDES.update(configs)
        yield
    finally:
        _OPTIONS.clear()
        _OPTIONS.update(saved[0])
        _OVERRIDES.clear()
        _OVERRIDES.update(saved[1])


# ----------------------------------------------------------------------------- kernel tiles
# A layout is exact at token level (partial tiles carry their element masks), so the same pattern
# laid out at another block is the same attention computed in other tiles: the kernel tile may
# cover several layout blocks (issue #4), or, where it pays, split them. Small tiles skip empty
# score regions more finely and give short rows more programs; large tiles keep the tensor cores
# busier on long rows. The model: forward + backward time of a layout run at block ``bs`` is
#     a[bs] * (heads x row tiles) + b[bs] * computed elements (millions),
# in ms per batch element. Blocks 128 and 64: least-squares fit (relative error) to two tile A/Bs
# of session 7 (benchmarks/results/gpu_attention_check_h200_s7_run{2,9}_tile_ab.json: H200,
# bf16, B=1, H=16, D=128, N=8192 and 32768; window |i - j| < 512, causal, BigBird, strided
# causal; the mean of the two runs' medians of 3 interleaved rounds; the tile-64 backward at
# sub 64 / 4 warps / 2 stages). Measured fwd+bwd ms (model) at 128 / 64: causal 2.631 (2.636) /
# 2.517 (2.533) and 39.48 (39.15) / 39.20 (38.26); window 0.905 (0.862) / 0.737 (0.772) and
# 3.526 (3.519) / 3.018 (3.151); BigBird 0.698 (0.717) / 0.666 (0.664) and 2.774 (2.929) /
# 2.787 (2.715); strided 0.678 (0.639) / 0.594 (0.569) and 4.285 (4.365) / 4.094 (4.054). At
# N=32768 causal and BigBird measured equal at both tiles (t128/t64 1.007 and 0.995; the two
# runs disagree by 3-6 % there), where the model gives 64 a 2-7 % edge. Blocks 32 and 16
# (a taken as 0): session 4's window sweep (gpu_attention_check_h200_s4_run2.json; window 32:
# 7.42, 16: 10.17 ms), see benchmarks/KERNEL_NOTES.md ("kernel tiles").
_TILE_MODEL = {128: (0.2102e-3, 0.004440), 64: (0.0831e-3, 0.004367),
               32: (0.0, 0.013504), 16: (0.0, 0.018791)}
# A tile smaller than the layout block only as measured: 64 for a block-128 layout with bf16/fp16
# at D = 128 and D = 64. Larger tiles always count (a 16- or 32-token tile costs 2.7-3.8x a
# 64-token one per element, far beyond any plausible difference between dtypes or head dims).
# D = 64 uses the D = 128 model, which understates its gain: the tile A/B at D = 64 (session 8,
# benchmarks/results/gpu_attention_check_h200_s8_run5_tile_ab_d64.json; bf16, each tile's
# default config) measured tile 128 / tile 64 fwd+bwd 1.20 / 1.16 (causal N=8192 / 32768),
# 1.36 / 1.39 (window), 1.00 / 1.09 (BigBird), 0.96 / 1.24 (strided causal; N=8192 sits on the
# host floor), against 1.045 / 1.007, 1.23 / 1.17, 1.05 / 1.00, 1.14 / 1.05 at D = 128.
# Refining also needs a modelled gain of at least ``min_gain``: the fit's residuals are a few %,
# and a refined layout is a second layout to build and keep on a pattern's first call. Causal
# rows: modelled gain 3.9 % at N=8192 (4.5 % measured), 2.3 % at N=32768 (0.7 % measured),
# below 2 % from N=65536 (not measured), where the layout's own 128 stays.
_REFINE = {"from_block": 128, "to_block": 64, "head_dims": (64, 128),
           "dtypes": ("bfloat16", "float16"), "min_gain": 0.02}
_KERNEL_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _modelled_ms(pattern, seq_len: int, num_heads: int, block: int) -> float:
    """Modelled fwd+bwd ms of ``pattern`` run at ``block``, per batch element. Tile counts come
    from the pattern's structural block kinds (no element masks, no lists: ~20x cheaper than a
    layout; tiles only "maybe" partial count as computed), so a first call does not build
    layouts it will not run."""
    a, b = _TILE_MODEL[block]
    tiles_by_key: dict = {}
    tiles = 0
    for h in range(num_heads):
        key = pattern.head_key(h)
        if key not in tiles_by_key:
            tiles_by_key[key] = int(np.count_nonzero(
                np.asarray(pattern._block_kinds(h, block, seq_len)) != EMPTY))
        tiles += tiles_by_key[key]
    return a * num_heads * -(-seq_len // block) + b * tiles * block * block / 1e6


def kernel_layout(layout, device_kind: str, *, head_dim: int | None = None,
                  dtype: str | None = None):
    """The layout the kernels run for ``layout``: itself, or its pattern laid out at another
    block when :data:`_TILE_MODEL` says that is faster (same token mask, same attention).

    Policy (``_OPTIONS["kernel_tile"]``, default ``"auto"``): on CUDA, the block with the least
    modelled time among the layout's own, every larger one, and, for a block-128 layout with
    ``head_dim`` 64 or 128 and bfloat16/float16 (where tile 64 was measured), 64; in the
    interpreter the layout itself, so CPU tests run the kernels at every block. A layout
    without a pattern (built by hand) is launched as it is. Both frontends call this with the
    same arguments, so torch and JAX launch the same tiles. The other layouts are built once
    per layout (cached while it lives). A pattern whose chosen block has not run in this
    process yet compiles that block's kernels on its first call.

    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.local(511, 511), 4096, 2, 32)
    >>> kernel_layout(lay, "cuda").block_size, kernel_layout(lay, "interpreter").block_size
    (64, 32)
    """
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind must be one of {DEVICE_KINDS}, got {device_kind!r}")
    mode = _OPTIONS["kernel_tile"]
    if (mode == "layout" or (mode == "auto" and device_kind != "cuda")
            or getattr(layout, "pattern", None) is None):
        return layout
    if mode == "auto":
        blocks = [b for b in SUPPORTED_BLOCK_SIZES if b > layout.block_size]
        if (layout.block_size == _REFINE["from_block"] and head_dim in _REFINE["head_dims"]
                and dtype is not None and check_dtype(dtype) in _REFINE["dtypes"]):
            blocks.append(_REFINE["to_block"])
    else:
        blocks = [mode] if mode > layout.block_size else []
    if not blocks:
        return layout
    cache = _KERNEL_LAYOUTS.setdefault(layout, {})
    key = (mode, tuple(blocks))
    if key not in cache:
        best = layout.block_size
        if mode == "auto":
            args = (layout.pattern, layout.seq_len, layout.num_heads)
            cost = {b: _modelled_ms(*args, b) for b in blocks}
            a, b = _TILE_MODEL[layout.block_size]  # the layout's own: its exact tile counts
            cost[layout.block_size] = (a * layout.num_heads * layout.num_blocks
                                       + b * float(layout.q_count.sum())
                                       * layout.block_size ** 2 / 1e6)
            refined = _REFINE["to_block"]
            if (refined in cost and refined < layout.block_size
                    and cost[refined] > (1 - _REFINE["min_gain"]) * cost[layout.block_size]):
                del cost[refined]  # not enough modelled gain to refine (see _REFINE)
            best = min(cost, key=lambda b: (cost[b], b != layout.block_size))
        else:
            best = mode
        if best == layout.block_size:
            cache[key] = layout
        else:
            from sparsetp.core.layout import make_layout  # noqa: PLC0415 (numpy-only spec)

            cache[key] = make_layout(layout.pattern, layout.seq_len, layout.num_heads, best)
    return cache[key]


def grid(batch: int, heads: int, seq_len: int, block_size: int) -> tuple[int, int, int]:
    """Launch grid of the preprocess and merge kernels: (tiles along N, B * H, 1)."""
    tiles = -(-int(seq_len) // int(block_size))
    return (tiles, int(batch) * int(heads), 1)


def list_grid(batch: int, heads: int, ranks: int, group: int) -> tuple[int, int, int]:
    """Launch grid of the list kernels (forward, dQ, dK/dV, split forward), ``ranks`` programs
    per (batch, head), the B * H (batch, head) pairs taken in groups of ``group`` (clipped to
    B * H; it must divide B * H): (group, ranks, B * H / group) dispatches rank r of each pair
    in a group before rank r + 1 of any, one group after another (group = B * H: every head
    interleaved, "heads first"); group 1, or one rank per head, gives the one-axis grid
    (B * H * ranks, 1, 1), heads one after another. The kernels tell the forms apart at run
    time (``attention._program``), so the choice never recompiles them.

    >>> list_grid(2, 8, 32, 16), list_grid(2, 8, 32, 4), list_grid(2, 8, 32, 1)
    ((16, 32, 1), (4, 32, 4), (512, 1, 1))
    """
    bh, ranks, group = int(batch) * int(heads), int(ranks), min(int(group), int(batch) * int(heads))
    if group < 1 or bh % group:
        raise ValueError(f"head group {group} must be >= 1 and divide B * H = {bh}")
    if group == 1 or ranks == 1:
        return (bh * ranks, 1, 1)
    return (group, ranks, bh // group)


def aligned(seq_len: int, strides: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether the kernels may assume 16-divisible ints (the ``ALIGNED`` constexpr).

    True when ``seq_len`` % 16 == 0 and every tensor's last stride is 1 and its other strides
    are multiples of 16 (contiguous [B, H, N, D] inputs with N % 16 == 0 always are). Both
    frontends decide it from the same shapes and strides, so torch's launcher (which marks such
    ints divisible itself) and jax_triton 0.3.1 (which marks none) compile the same code.
    """
    if int(seq_len) % 16:
        return False
    return all(int(st[-1]) == 1 and all(int(x) % 16 == 0 for x in st[:-1])
               for st in strides.values())


def contiguous_strides(shape) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= int(s)
    return tuple(reversed(out))


def _strides(strides: Mapping[str, Any] | None, name: str, shape) -> tuple[int, ...]:
    st = None if strides is None else strides.get(name)
    st = contiguous_strides(shape) if st is None else tuple(int(x) for x in st)
    if len(st) != len(shape):
        raise ValueError(f"strides[{name!r}] has {len(st)} entries for a {len(shape)}-d tensor")
    return st


def _shape(x) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _check_meta(meta: Mapping[str, Any], major: str, heads: int, tiles: int, block: int):
    names = [f"{major}_count", f"{major}_partial", f"{major}_index", f"{major}_mask_id", "masks",
             f"{major}_order"]
    missing = [n for n in names if n not in meta]
    if missing:
        raise ValueError(f"meta is missing {missing}")
    cnt, part, idx, mid, masks, order = (_shape(meta[n]) for n in names)
    if cnt != (heads, tiles) or part != cnt or order != cnt:
        raise ValueError(f"meta[{names[0]!r}] has shape {cnt}, expected {(heads, tiles)}")
    if len(idx) != 3 or idx[:2] != (heads, tiles) or mid != idx:
        raise ValueError(f"meta[{names[2]!r}] / [{names[3]!r}] have shapes {idx} / {mid}, "
                         f"expected ({heads}, {tiles}, W)")
    if len(masks) != 3 or masks[1:] != (block, mask_words(block)):
        raise ValueError(f"meta['masks'] has shape {masks}, expected (U, {block}, "
                         f"{mask_words(block)})")
    return ([meta[n] for n in names],
            contiguous_strides(cnt) + contiguous_strides(idx) + contiguous_strides(masks))


def _common(q, block_size, dtype, device_kind, kernel_name):
    b, h, n, d = _shape(q)
    check_head_dim(d)
    dtype = check_dtype(dtype)
    cfg = tile_config(kernel_name, head_dim=d, dtype=dtype, block_size=block_size,
                      device_kind=device_kind)
    return b, h, n, d, dtype, cfg


def dot_upcast(dtype: str, device_kind: str) -> bool:
    """Whether kernels upcast tl.dot operands to fp32: bf16 in the interpreter only (Triton
    3.9's interpreter multiplies the raw uint16 storage of bf16; see ``attention._dot``)."""
    return device_kind == "interpreter" and check_dtype(dtype) == "bfloat16"


def grid_group(meta: Mapping[str, Any], major: str, batch: int, heads: int) -> int:
    """How many (batch, head) pairs a launch over the ``major`` ("q"/"k") lists interleaves per
    group (:func:`list_grid`). Under the default work order ``"auto"``: the layout's
    ``{major}_head_group`` G (:func:`sparsetp.core.layout.head_group`; all heads if the
    mapping lacks it or holds None); G >= ``heads`` (this launch may hold a tensor-parallel
    slice of the layout's heads) interleaves all B * H pairs, a smaller G groups gcd(G, heads)
    heads of one batch entry. "natural" and "longest_first" force 1, "longest_first_bh" all;
    the private option ``head_group`` (benchmarks) forces G in any order."""
    bh, order = int(batch) * int(heads), _OPTIONS["work_order"]
    group = _OPTIONS["head_group"]
    if group is None:
        group = (meta.get(f"{major}_head_group") if order == "auto"
                 else bh if order == "longest_first_bh" else 1)
    group = bh if group is None else int(group)
    return bh if group >= heads else math.gcd(group, int(heads))


def _constexprs(block_size, d, dtype, device_kind, cfg: TileConfig, sub_name: str,
                is_aligned: bool):
    return {"BLOCK": block_size, sub_name: cfg.sub, "HEAD_DIM": d,
            "MASK_WORDS": mask_words(block_size), "DOT_PRECISION": dot_precision(dtype),
            "DOT_UPCAST": dot_upcast(dtype, device_kind),
            "ORDERED": _OPTIONS["work_order"] != "natural", "ALIGNED": is_aligned}


def _block_size(meta) -> int:
    return int(_shape(meta["masks"])[1])


def _all_strides(strides, names4, names3, shape, lse_shape):
    st = {nm: _strides(strides, nm, shape) for nm in names4}
    st.update({nm: _strides(strides, nm, lse_shape) for nm in names3})
    return st


def fwd_call(q, k, v, meta: Mapping[str, Any], *, scale: float, dtype: str, device_kind: str,
             strides: Mapping[str, Any] | None = None) -> KernelCall:
    """Forward launch: outputs ``out`` [B, H, N, D] (input dtype) and ``lse`` [B, H, N]."""
    bs = _block_size(meta)
    b, h, n, d, dtype, cfg = _common(q, bs, dtype, device_kind, "fwd")
    tiles = -(-n // bs)
    arrays, meta_strides = _check_meta(meta, "q", h, tiles, bs)
    shape, lse_shape = (b, h, n, d), (b, h, n)
    st = _all_strides(strides, ("q", "k", "v", "out"), ("lse",), shape, lse_shape)
    args = (q, k, v, *arrays, *scale_args(scale), n, h, *st["q"], *st["k"], *st["v"], *st["out"],
            *st["lse"], *meta_strides)
    return KernelCall("fwd", _KERNELS["fwd"], list_grid(b, h, tiles, grid_group(meta, "q", b, h)),
                      args,
                      (OutputSpec("out", shape, dtype),
                       OutputSpec("lse", lse_shape, stats_dtype(dtype))),
                      _constexprs(bs, d, dtype, device_kind, cfg, "SUB_N", aligned(n, st)),
                      cfg.num_warps, cfg.num_stages)


def bwd_preprocess_call(out, d_out, *, block_size: int, dtype: str, device_kind: str,
                        strides: Mapping[str, Any] | None = None) -> KernelCall:
    """Backward preprocess: output ``delta`` [B, H, N] = rowsum(d_out * out)."""
    b, h, n, d, dtype, cfg = _common(out, block_size, dtype, device_kind, "bwd_preprocess")
    shape, lse_shape = (b, h, n, d), (b, h, n)
    st = _all_strides(strides, ("out", "d_out"), ("delta",), shape, lse_shape)
    args = (out, d_out, n, h, *st["out"], *st["d_out"], *st["delta"])
    return KernelCall("bwd_preprocess", _KERNELS["bwd_preprocess"], grid(b, h, n, block_size),
                      args, (OutputSpec("delta", lse_shape, stats_dtype(dtype)),),
                      {"BLOCK": block_size, "HEAD_DIM": d, "ALIGNED": aligned(n, st)},
                      cfg.num_warps, cfg.num_stages)


def _bwd_list_call(name, major, out_names, sub_name, q, k, v, d_out, lse, delta, meta, scale,
                   dtype, device_kind, strides) -> KernelCall:
    """The dQ and dK/dV launches: the same operands, the ``major`` ("q"/"k") lists, and one
    [B, H, N, D] output per ``out_names`` (in the input dtype), appended after the metadata."""
    bs = _block_size(meta)
    b, h, n, d, dtype, cfg = _common(q, bs, dtype, device_kind, name)
    arrays, meta_strides = _check_meta(meta, major, h, -(-n // bs), bs)
    shape, lse_shape = (b, h, n, d), (b, h, n)
    st = _all_strides(strides, ("q", "k", "v", "d_out", *out_names), ("lse",), shape, lse_shape)
    args = (q, k, v, d_out, lse, delta, *arrays, *scale_args(scale), n, h,
            *st["q"], *st["k"], *st["v"], *st["d_out"], *st["lse"], *meta_strides,
            *(x for o in out_names for x in st[o]))
    group = grid_group(meta, major, b, h)
    return KernelCall(name, _KERNELS[name], list_grid(b, h, -(-n // bs), group), args,
                      tuple(OutputSpec(o, shape, dtype) for o in out_names),
                      _constexprs(bs, d, dtype, device_kind, cfg, sub_name, aligned(n, st)),
                      cfg.num_warps, cfg.num_stages)


def bwd_dq_call(q, k, v, d_out, lse, delta, meta: Mapping[str, Any], *, scale: float,
                dtype: str, device_kind: str,
                strides: Mapping[str, Any] | None = None) -> KernelCall:
    """dQ launch (query-major lists): output ``dq`` [B, H, N, D] in the input dtype."""
    return _bwd_list_call("bwd_dq", "q", ("dq",), "SUB_N", q, k, v, d_out, lse, delta, meta,
                          scale, dtype, device_kind, strides)


def bwd_dkdv_call(q, k, v, d_out, lse, delta, meta: Mapping[str, Any], *, scale: float,
                  dtype: str, device_kind: str,
                  strides: Mapping[str, Any] | None = None) -> KernelCall:
    """dK/dV launch (key-major lists): outputs ``dk``, ``dv`` [B, H, N, D] in the input dtype."""
    return _bwd_list_call("bwd_dkdv", "k", ("dk", "dv"), "SUB_M", q, k, v, d_out, lse, delta,
                          meta, scale, dtype, device_kind, strides)


# ----------------------------------------------------------------------------- row splitting
def fwd_split_cap() -> int | None:
    """The forward's split cap C (list entries per program), or None when splitting is off.
    Frontends call :func:`fwd_split_call` + :func:`fwd_merge_call` instead of :func:`fwd_call`
    when it is set (private option, see :func:`_override`)."""
    return _OPTIONS["split_cap"]


def split_slots(width: int, cap: int) -> int:
    """Chunk slots per row, S = ceil(W / C) (at least 1): the ELL width W bounds every row's
    count, so the chunk list is implicit and its size depends on shapes only (see the
    row-splitting comment in :mod:`sparsetp.kernels.attention`)."""
    return max(1, -(-int(width) // int(cap)))


def fwd_split_call(q, k, v, meta: Mapping[str, Any], *, scale: float, dtype: str,
                   device_kind: str, cap: int,
                   strides: Mapping[str, Any] | None = None) -> KernelCall:
    """Chunk launch of the split forward: outputs the fp32 (fp64 for fp64) scratch ``acc_p``
    [B, H, S, N, D], ``m_p`` and ``l_p`` [B, H, S, N], S = :func:`split_slots` (W, cap).
    Scratch elements of slots past a row's last chunk are left unwritten (the merge never reads
    them). ``strides`` names: ``q k v``; the scratch is C-contiguous."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be an int >= 1, got {cap!r}")
    bs = _block_size(meta)
    b, h, n, d, dtype, cfg = _common(q, bs, dtype, device_kind, "fwd")
    tiles = -(-n // bs)
    arrays, meta_strides = _check_meta(meta, "q", h, tiles, bs)
    slots = split_slots(_shape(meta["q_index"])[2], cap)
    st = _all_strides(strides, ("q", "k", "v"), (), (b, h, n, d), (b, h, n))
    acc_shape, stat_shape = (b, h, slots, n, d), (b, h, slots, n)
    args = (q, k, v, *arrays, *scale_args(scale), n, h, int(cap), slots,
            *st["q"], *st["k"], *st["v"], *meta_strides, *contiguous_strides(acc_shape),
            *contiguous_strides(stat_shape))
    sd = stats_dtype(dtype)
    return KernelCall("fwd_split", _KERNELS["fwd_split"],
                      list_grid(b, h, tiles * slots, grid_group(meta, "q", b, h)), args,
                      (OutputSpec("acc_p", acc_shape, sd), OutputSpec("m_p", stat_shape, sd),
                       OutputSpec("l_p", stat_shape, sd)),
                      _constexprs(bs, d, dtype, device_kind, cfg, "SUB_N", aligned(n, st)),
                      cfg.num_warps, cfg.num_stages)


def fwd_merge_call(acc_p, m_p, l_p, meta: Mapping[str, Any], *, cap: int, dtype: str,
                   device_kind: str, strides: Mapping[str, Any] | None = None) -> KernelCall:
    """Merge launch of the split forward: reads the scratch of :func:`fwd_split_call` (same
    ``cap``, C-contiguous) and outputs ``out`` [B, H, N, D] (``dtype``) and ``lse`` [B, H, N],
    exactly as :func:`fwd_call` does. ``strides`` names: ``out lse``."""
    bs = _block_size(meta)
    b, h, slots, n, d = _shape(acc_p)
    dtype = check_dtype(dtype)
    cfg = tile_config("bwd_preprocess", head_dim=d, dtype=dtype, block_size=bs,
                      device_kind=device_kind)
    tiles = -(-n // bs)
    if _shape(meta["q_count"]) != (h, tiles):
        raise ValueError(f"meta['q_count'] has shape {_shape(meta['q_count'])}, expected "
                         f"{(h, tiles)}")
    if _shape(m_p) != (b, h, slots, n) or _shape(l_p) != (b, h, slots, n):
        raise ValueError(f"m_p / l_p have shapes {_shape(m_p)} / {_shape(l_p)}, expected "
                         f"{(b, h, slots, n)}")
    shape, lse_shape = (b, h, n, d), (b, h, n)
    st = _all_strides(strides, ("out",), ("lse",), shape, lse_shape)
    args = (acc_p, m_p, l_p, meta["q_count"], n, h, int(cap),
            *contiguous_strides(_shape(acc_p)), *contiguous_strides(_shape(m_p)),
            *contiguous_strides((h, tiles)), *st["out"], *st["lse"])
    return KernelCall("fwd_merge", _KERNELS["fwd_merge"], grid(b, h, n, bs), args,
                      (OutputSpec("out", shape, dtype),
                       OutputSpec("lse", lse_shape, stats_dtype(dtype))),
                      {"BLOCK": bs, "HEAD_DIM": d, "ALIGNED": aligned(n, st)},
                      cfg.num_warps, cfg.num_stages)
