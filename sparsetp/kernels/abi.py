"""The kernels' ABI: argument orders, input checks and launch descriptions both frontends use.

Nothing here imports torch or jax. A frontend turns its arrays into a :class:`KernelCall` with
one of :func:`fwd_call`, :func:`bwd_dq_call`, :func:`bwd_dkdv_call`, then launches
``call.kernel`` its own way (``backends/torch/launch.py``, ``backends/jax/launch.py``).
The kernel signature is always

    (*call.args, *<one pointer per call.outputs entry>, **call.constexprs)

i.e. input pointers, then scalars (the scale as two fp32 parts, see :func:`scale_args`; N, N_KV,
H, GROUP, every stride, including the strides of the outputs), then the output pointers, then
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
``call.args``; only ``.shape`` is read. ``q`` (and ``out``, ``d_out``, ``dq``) is
``[B, H, N, D]``; ``k`` and ``v`` (and ``dk``, ``dv``) are ``[B, H_kv, N_kv, D]`` with
``H % H_kv == 0`` (GQA/MQA: query head ``h`` reads kv head ``h // (H // H_kv)``; K and V are
never repeated in memory) and ``N_kv`` keys (``layout.kv_len``; the layout aligns the
diagonal to the end of the keys). The layout, and so ``meta``, has one row per *query* head
(H rows), for every kernel: the dK/dV launch runs one program per (key tile, b, kv head),
which walks the key-major lists of the query heads of its group in a fixed order (no atomics,
deterministic; the portable kernel one head after another, the sm_90 one over the group's
lists merged, ``hopper.group_key_lists``) - so a per-head pattern keeps one mask per query
head.
``meta`` is a mapping with the int32 arrays of
:meth:`sparsetp.core.layout.BlockLayout.metadata` (``q_count``, ``q_partial``, ``q_index``,
``q_mask_id``, ``q_order``, ``k_count``, ``k_partial``, ``k_index``, ``k_mask_id``, ``k_order``,
``masks``), already on
the device and **C-contiguous** (their strides are computed from their shapes), and optionally
the layout's Python ints ``q_head_group`` / ``k_head_group`` (how launches order heads, see
:func:`sparsetp.kernels.schedule.grid_group`; missing means all heads interleaved). ``strides`` maps
tensor names to element strides; a name left out means C-contiguous. Names: ``q k v out lse``
(forward), ``q k v d_out out lse d_lse dq`` (dQ; its output ``delta`` shares the ``lse``
strides), ``q k v d_out lse dk dv`` (dK/dV; ``delta`` as in dQ). ``lse`` and ``delta`` are
``[B, H, N]`` in :func:`stats_dtype` (float32, or float64 for float64 inputs). ``scale`` is the
softmax scale (default ``D ** -0.5`` is the frontend's job). All scalars are Python ints/floats
(``jax_triton`` only recognises those as scalars).

Supported head dims, dtypes and block sizes: :mod:`sparsetp.kernels.tiles` (float64 too, for
gradcheck: within 1e-10 of the float64 oracle, not a fast path).

Example::

    >>> import numpy as np
    >>> from sparsetp.core import make_layout, patterns as P
    >>> q = np.zeros((1, 2, 128, 32), np.float32)
    >>> call = fwd_call(q, q, q, make_layout(P.causal(), 128, 2, 64).metadata(), scale=0.2,
    ...                 dtype="float32", device_kind="interpreter")
    >>> call.name, call.grid, [o.name for o in call.outputs]
    ('fwd', (2, 2, 1), ['out', 'lse'])
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparsetp.core.layout import check_tables
from sparsetp.kernels import attention as _k
from sparsetp.kernels import options as _options
from sparsetp.kernels.schedule import grid_group, list_grid
from sparsetp.kernels.tiles import (
    DEVICE_KINDS,
    KERNEL_NAMES,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    TileConfig,
    check_dtype,
    check_head_dim,
    tile_config,
)

__all__ = [
    "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "SUPPORTED_BLOCK_SIZES", "DEVICE_KINDS",
    "KERNEL_NAMES", "OutputSpec", "KernelCall", "kernel", "check_head_dim", "check_dtype",
    "check_attention_shapes", "check_scale", "scale_args", "stats_dtype", "dot_precision",
    "dot_upcast",
    "mask_words", "aligned", "contiguous_strides", "head_dim_padded", "fwd_call",
    "bwd_dq_call", "bwd_dkdv_call", "unlaunchable", "first_diagnostic",
]

_KERNELS = {
    "fwd": _k._attn_fwd_kernel,
    "bwd_dq": _k._attn_bwd_dq_kernel,
    "bwd_dkdv": _k._attn_bwd_dkdv_kernel,
}


def kernel(name: str) -> Any:
    """The ``@triton.jit`` kernel object called ``name`` (one of :data:`KERNEL_NAMES`)."""
    try:
        return _KERNELS[name]
    except KeyError:
        raise ValueError(f"kernel must be one of {KERNEL_NAMES}, got {name!r}") from None


# Kernel parameter types as Triton's CUDA launcher packs them (triton/backends/nvidia/driver.py,
# 3.6-3.9): one cell each, little-endian, read by cuLaunchKernel at the parameter's size.
_INT_BITS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64,
             "u1": 8, "u8": 8, "u16": 16, "u32": 32, "u64": 64}


def pack_cell(ty: str, value) -> int:
    """The bits (a non-negative int) of a kernel parameter of Triton type ``ty`` as its CUDA
    launcher packs them, for the library's C++ launchers (torch's native node, JAX's FFI
    handler). Raises ValueError for a type they do not pack.

        >>> pack_cell("i32", -1), pack_cell("bf16", 1.0), pack_cell("fp32", 0.5)
        (4294967295, 16256, 1056964608)
    """
    if ty in _INT_BITS:
        return int(value) & ((1 << _INT_BITS[ty]) - 1)
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    if ty == "fp16":
        return struct.unpack("<H", struct.pack("<e", float(value)))[0]
    if ty == "bf16":  # Triton truncates the float32 bits
        return struct.unpack("<I", struct.pack("<f", float(value)))[0] >> 16
    raise ValueError(f"no native packing for kernel parameter type {ty!r}")


def unlaunchable(metadata) -> list[str]:
    """What a compiled Triton kernel (its ``metadata``) asks of its launch that the library's
    own C++ launchers (torch's native path, JAX's FFI handler) do not set up: they launch one
    CTA per program without launch attributes, pass null scratch pointers and pack exactly the
    kernel's declared parameters. Empty where they can launch it.

        >>> import types
        >>> unlaunchable(types.SimpleNamespace(num_ctas=2, launch_pdl=True))
        ['thread-block clusters', 'programmatic dependent launch']
    """
    md = metadata
    asks = {"scratch memory": (getattr(md, "global_scratch_size", 0)
                               or getattr(md, "profile_scratch_size", 0)),
            # Triton's instrumentation (e.g. 3.9's GSan) appends parameters of its own.
            "instrumentation parameters": getattr(md, "instrumentation_mode", ""),
            "thread-block clusters": getattr(md, "num_ctas", 1) != 1,
            "a cooperative grid": getattr(md, "launch_cooperative_grid", False),
            "programmatic dependent launch": getattr(md, "launch_pdl", False)}
    return [what for what, asked in asks.items() if asked]


def cache_dir() -> str:
    """Where the library keeps what it builds at run time (the C++ launchers of both
    frameworks): ``$SPARSETP_CACHE_DIR``, else ``$XDG_CACHE_HOME/sparsetp``, else
    ``~/.cache/sparsetp``; created if missing."""
    base = os.environ.get("SPARSETP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "sparsetp")
    os.makedirs(base, exist_ok=True)
    return base


def cached_build(name: str, source: str, key) -> str:
    """The path in :func:`cache_dir` of the library ``name`` built from the C++ file
    ``source`` under ``key`` (the versions and compiler settings the binary depends on): one
    file per source text and key, so an edit or an upgrade builds a new one.

        >>> a = cached_build("x", __file__, ("torch 1",))
        >>> a == cached_build("x", __file__, ("torch 1",)) != cached_build("x", __file__, 2)
        True
    """
    with open(source, "rb") as f:
        tag = hashlib.sha256(f.read() + repr(key).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"{name}-{tag}.so")


def first_diagnostic(text: str) -> str:
    """The line of a failed C++ build's output (the library builds two launchers: torch's
    native extension, JAX's FFI handler) that says why: the compiler's first diagnostic
    (``file:line[:col]: [fatal ]error: ...``) or the linker's "undefined reference", which say
    more than the last line ("compilation terminated", "ninja: build stopped: subcommand
    failed."); else the first line naming an error, else the last line.

        >>> first_diagnostic("x.cc:3:10: fatal error: cuda.h: No such file\\n"
        ...                  "compilation terminated.")
        'x.cc:3:10: fatal error: cuda.h: No such file'
    """
    lines = text.strip().splitlines()
    for pattern in (r":\d+(:\d+)?: (fatal )?error: |undefined reference", r"\berror\b"):
        hit = next((line for line in lines if re.search(pattern, line, re.IGNORECASE)), None)
        if hit:
            return hit.strip()
    return lines[-1].strip() if lines else "(no output)"


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


def check_attention_shapes(q_shape, k_shape, v_shape, layout, scale) -> float:
    """The framework-neutral input checks both frontends share (one place, one wording):
    q/k/v shapes (q ``[B, H, N, D]``, k and v ``[B, H_kv, N_kv, D]``, ``H % H_kv == 0``), the
    layout's query and key lengths and head count, batch, scale and head dim. ``layout`` is
    anything with ``seq_len``, ``num_heads`` and optionally ``kv_len`` (default ``seq_len``);
    one that also has ``metadata()`` and ``block_size`` (``BlockLayout``, JAX ``LayoutArrays``)
    must have tables of its own geometry (:func:`sparsetp.core.layout.check_tables`).

    ``scale`` is None (``D ** -0.5``) or a real Python number whose float32 value is finite:
    NaN, +-inf and values beyond float32's range are refused (they give NaN outputs). Zero and
    negative scales are accepted: they are well-defined softmaxes (zero: the mean of the
    allowed values; negative: the lowest scores weigh most), and the kernels scale the scores
    before their running max, so both are computed exactly like positive ones.
    Returns the softmax scale."""
    q_shape = tuple(q_shape)
    if len(q_shape) != 4:
        raise ValueError(f"q must have shape [B, H, N, D], got {q_shape}")
    k_shape = tuple(k_shape)
    for name, shape in (("k", k_shape), ("v", tuple(v_shape))):
        if (len(shape) != 4 or shape[0] != q_shape[0] or shape[3] != q_shape[3]
                or shape != k_shape):
            raise ValueError(f"{name} has shape {shape} but q has {q_shape}; k and v must share "
                             "one [B, H_kv, N_kv, D] shape with q's B and D")
    b, h, n, d = q_shape
    h_kv, n_kv = k_shape[1], k_shape[2]
    if hasattr(layout, "metadata") and hasattr(layout, "block_size"):
        check_tables(layout)
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"k has {h_kv} heads (H_kv) but q has H={h}: H must be a multiple of "
                         "H_kv (grouped-query attention)")
    if layout.seq_len != n:
        raise ValueError(f"layout is for seq_len={layout.seq_len} but q has N={n}")
    kv_len = getattr(layout, "kv_len", None) or layout.seq_len
    if kv_len != n_kv:
        raise ValueError(f"layout is for kv_len={kv_len} but k has N_kv={n_kv} keys (build the "
                         "layout with make_layout(..., kv_len=N_kv))")
    if layout.num_heads != h:
        raise ValueError(f"layout is for num_heads={layout.num_heads} but q has H={h}")
    if b == 0:
        raise ValueError("q has batch size 0")
    rows = getattr(layout, "batch", None)
    if rows and rows != b:
        raise ValueError(f"layout is per-batch-row for batch={rows} but q has B={b}: a per-row "
                         "pattern (per_batch_row, documents with one list per row) needs one "
                         "entry per batch row")
    check_scale(scale)
    check_head_dim(d, "q")
    return (d ** -0.5) if scale is None else float(scale)


def check_scale(scale) -> None:
    """ValueError naming ``scale`` unless it is None or a real Python number (int or float, not
    bool) that is finite in float32 (the kernels take it as fp32 parts, :func:`scale_args`, so
    1e39 would be inf there). Zero and negative scales are allowed (see
    :func:`check_attention_shapes`).

    >>> check_scale(float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: scale must be finite (in float32, as the kernels take it), got nan
    """
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python float or None, got {type(scale).__name__}")
    with np.errstate(over="ignore"):
        finite = math.isfinite(float(np.float32(scale)))
    if not finite:
        raise ValueError(f"scale must be finite (in float32, as the kernels take it), got "
                         f"{scale!r}")


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


def aligned(seq_len: int, strides: Mapping[str, tuple[int, ...]],
            kv_len: int | None = None) -> bool:
    """Whether the kernels may assume 16-divisible ints (the ``ALIGNED`` constexpr).

    True when ``seq_len`` and ``kv_len`` are multiples of 16 and every tensor's last stride is 1
    and its other strides are multiples of 16 (contiguous [B, H, N, D] inputs with N % 16 == 0
    and D % 16 == 0 always are). Both frontends decide it from the same shapes and strides, so
    torch's launcher (which marks such ints divisible itself) and jax_triton 0.3.1 (which marks
    none) compile the same code.
    """
    if int(seq_len) % 16 or (kv_len is not None and int(kv_len) % 16):
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


def head_dim_padded(head_dim: int) -> int:
    """The ``HEAD_DIM_PAD`` constexpr: the head dim rounded up to a power of two (``tl.arange``
    needs one); the kernels mask the extra columns (``attention._cols_ok``).

    >>> head_dim_padded(64), head_dim_padded(80), head_dim_padded(192)
    (64, 128, 256)
    """
    return 1 << (int(head_dim) - 1).bit_length()


def _constexprs(block_size, d, dtype, device_kind, cfg: TileConfig, sub_name: str,
                is_aligned: bool):
    return {"BLOCK": block_size, sub_name: cfg.sub, "HEAD_DIM": d,
            "MASK_WORDS": mask_words(block_size), "DOT_PRECISION": dot_precision(dtype),
            "DOT_UPCAST": dot_upcast(dtype, device_kind),
            "ORDERED": _options.current().work_order != "natural", "ALIGNED": is_aligned,
            "HEAD_DIM_PAD": head_dim_padded(d)}


def _block_size(meta) -> int:
    return int(_shape(meta["masks"])[1])


_KV_NAMES = ("k", "v", "dk", "dv")


def _all_strides(strides, names4, names3, shape, lse_shape, kv_shape=None):
    st = {nm: _strides(strides, nm, kv_shape if kv_shape and nm in _KV_NAMES else shape)
          for nm in names4}
    st.update({nm: _strides(strides, nm, lse_shape) for nm in names3})
    return st


def _kv(q, k) -> tuple[int, int, tuple[int, ...]]:
    """(N_kv, GROUP = H // H_kv, k's shape), checking the GQA head ratio."""
    kv_shape = _shape(k)
    h, h_kv = _shape(q)[1], kv_shape[1]
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"k has {h_kv} heads but q has {h}: H must be a multiple of H_kv")
    return kv_shape[2], h // h_kv, kv_shape


def fwd_call(q, k, v, meta: Mapping[str, Any], *, scale: float, dtype: str, device_kind: str,
             strides: Mapping[str, Any] | None = None) -> KernelCall:
    """Forward launch: outputs ``out`` [B, H, N, D] (input dtype) and ``lse`` [B, H, N]."""
    bs = _block_size(meta)
    b, h, n, d, dtype, cfg = _common(q, bs, dtype, device_kind, "fwd")
    n_kv, group, kv_shape = _kv(q, k)
    tiles = -(-n // bs)
    arrays, meta_strides = _check_meta(meta, "q", h, tiles, bs)
    shape, lse_shape = (b, h, n, d), (b, h, n)
    st = _all_strides(strides, ("q", "k", "v", "out"), ("lse",), shape, lse_shape, kv_shape)
    args = (q, k, v, *arrays, *scale_args(scale), n, n_kv, h, group, *st["q"], *st["k"],
            *st["v"], *st["out"], *st["lse"], *meta_strides)
    return KernelCall("fwd", kernel("fwd"), list_grid(b, h, tiles, grid_group(meta, "q", b, h)),
                      args,
                      (OutputSpec("out", shape, dtype),
                       OutputSpec("lse", lse_shape, stats_dtype(dtype))),
                      _constexprs(bs, d, dtype, device_kind, cfg, "SUB_N",
                                  aligned(n, st, n_kv)),
                      cfg.num_warps, cfg.num_stages)


def _bwd_list_call(name, major, tensors, names4, names3, out_names, sub_name, q, k, meta,
                   scale, dtype, device_kind, strides, unaligned=(), extra=None) -> KernelCall:
    """The dQ and dK/dV launches: the input ``tensors``, the ``major`` ("q"/"k") lists, the
    scalars, the strides of the inputs ``names4`` ([B, H(_kv), N(_kv), D]) and ``names3``
    ([B, H, N]), the metadata strides, those of the [B, H, N, D] outputs; outputs
    ``out_names`` (q's shape for dq, k's for dk and dv, in the input dtype; ``delta`` in the
    stats dtype, sharing the ``lse`` strides). dQ runs a program per (query tile, b, query
    head), dK/dV one per (key tile, b, kv head); both read the layout's per-query-head lists.
    ``ALIGNED`` ignores the strides of ``unaligned`` (the kernel never assumes them 16-divisible);
    ``extra``: more constexprs.
    """
    bs = _block_size(meta)
    b, h, n, d, dtype, cfg = _common(q, bs, dtype, device_kind, name)
    n_kv, group, kv_shape = _kv(q, k)
    tiles = -(-(n if major == "q" else n_kv) // bs)
    arrays, meta_strides = _check_meta(meta, major, h, tiles, bs)
    shape, lse_shape = (b, h, n, d), (b, h, n)
    outs4 = [o for o in out_names if o != "delta"]
    st = _all_strides(strides, (*names4, *outs4), names3, shape, lse_shape, kv_shape)
    args = (*tensors, *arrays, *scale_args(scale), n, n_kv, h, group,
            *(x for nm in (*names4, *names3) for x in st[nm]), *meta_strides,
            *(x for o in outs4 for x in st[o]))
    heads = h if major == "q" else h // group  # the programs' heads: query or kv heads
    constexprs = _constexprs(bs, d, dtype, device_kind, cfg, sub_name,
                             aligned(n, {nm: x for nm, x in st.items() if nm not in unaligned},
                                     n_kv))
    if major == "k":
        constexprs["GROUPED"] = group > 1
    constexprs.update(extra or {})
    outputs = tuple(OutputSpec(o, lse_shape, stats_dtype(dtype)) if o == "delta" else
                    OutputSpec(o, kv_shape if o in _KV_NAMES else shape, dtype)
                    for o in out_names)
    return KernelCall(name, _KERNELS[name],
                      list_grid(b, heads, tiles, grid_group(meta, major, b, heads)), args,
                      outputs, constexprs, cfg.num_warps, cfg.num_stages)


def bwd_dq_call(q, k, v, d_out, lse, out, d_lse, meta: Mapping[str, Any], *, scale: float,
                dtype: str, device_kind: str,
                strides: Mapping[str, Any] | None = None) -> KernelCall:
    """dQ launch (query-major lists): outputs ``dq`` [B, H, N, D] in the input dtype and
    ``delta`` [B, H, N] = rowsum(d_out * out) - d_lse (d_lse only on rows with a finite lse),
    which :func:`bwd_dkdv_call` reads; ``delta`` shares the ``lse`` strides (allocate it
    alike). ``d_lse``, the LSE cotangent (any strides), may be None: its slot then carries
    ``lse``, never read."""
    return _bwd_list_call("bwd_dq", "q", (q, k, v, d_out, lse, out,
                                          lse if d_lse is None else d_lse),
                          ("q", "k", "v", "d_out", "out"), ("lse", "d_lse"), ("dq", "delta"),
                          "SUB_N", q, k, meta, scale, dtype, device_kind, strides,
                          unaligned=("d_lse",), extra={"HAS_DLSE": d_lse is not None})


def bwd_dkdv_call(q, k, v, d_out, lse, delta, meta: Mapping[str, Any], *, scale: float,
                  dtype: str, device_kind: str,
                  strides: Mapping[str, Any] | None = None) -> KernelCall:
    """dK/dV launch (key-major lists): outputs ``dk``, ``dv`` [B, H_kv, N_kv, D] in the input
    dtype (GQA: summed over each kv head's group of query heads, in the kernel). ``delta`` is
    :func:`bwd_dq_call`'s, with the ``lse`` strides."""
    return _bwd_list_call("bwd_dkdv", "k", (q, k, v, d_out, lse, delta),
                          ("q", "k", "v", "d_out"), ("lse",), ("dk", "dv"), "SUB_M", q, k, meta,
                          scale, dtype, device_kind, strides)
