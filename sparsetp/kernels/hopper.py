"""The sm_90 (Hopper) fast paths of the forward and the backward, in Gluon, and the rules that
pick them.

:func:`_attn_fwd_kernel_sm90` computes what :func:`sparsetp.kernels.attention._attn_fwd_kernel`
computes, on the same layout metadata (the ELL lists of ``BlockLayout.metadata``, partial tiles
first) with the same grid and work order, but with FlashAttention-3's schedule, which
``tl.dot`` does not reach on Hopper (``benchmarks/KERNEL_NOTES.md``, "Session 21"):

* warp specialisation: a producer warp issues TMA loads of the listed K/V tiles into a
  three-stage shared-memory ring; two consumer warpgroups of 64 query rows each wait on
  per-stage "ready" mbarriers and free a stage by arriving on its "empty" mbarrier, so the
  warpgroups run independently (no CTA-wide barrier in the loop);
* intra-warpgroup overlap: while a consumer computes the softmax of key tile j, its
  asynchronous warpgroup MMAs ``S_{j+1} = Q K_{j+1}^T`` and ``O += P_j V_j`` run on the
  tensor cores (P stays in registers as the MMA's A operand).

The backward's two passes have sm_90 forms in the same schedule, deterministic as the portable
ones (no atomics):

* :func:`_attn_bwd_dq_kernel_sm90`, the query-major pass (dQ and Delta, as
  :func:`sparsetp.kernels.attention._attn_bwd_dq_kernel`): the producer loads Q and dO once
  and the listed K/V tiles into a two-stage ring; each consumer walks a key tile in two 64-key
  halves (S, dP, dS of 64 x 64 and the dQ accumulator fit its registers);
* :func:`_attn_bwd_dkdv_kernel_sm90`, the key-major pass (dK and dV, as
  :func:`sparsetp.kernels.attention._attn_bwd_dkdv_kernel`; GQA as MHA over each kv head's
  merged lists, :func:`group_key_lists`): K and V loaded once, Q and dO in 64-row steps
  through a ring, each consumer owning 64 keys in FA3's form (P and dS through shared memory).

Scope (else the portable kernel runs; :func:`forward_choice` and :func:`backward_choice` say
why; the same for both but the head dims): a CUDA device of compute capability 9.0, the
Triton versions in :data:`TESTED_TRITON`, bfloat16/float16, head dim 128 (the forward also
256, in 64-key steps), kernel tile 128 (the layout at block 128), sequence lengths that are
multiples of 128 (the TMA boxes are 128 rows of a ``[B * H * N, D]`` view), C-contiguous q,
k, v starting on 16-byte boundaries, a positive softmax scale. Both frontends launch the same
kernels from :func:`launches`' descriptions (jax_triton cannot: it passes no TMA descriptors
and launches ``num_warps`` warps, not the producer and consumer partitions).

This module imports neither torch nor jax; the launchers are
:mod:`sparsetp.backends.torch.hopper` and :mod:`sparsetp.backends.jax.hopper`.

Example (the rule, without a GPU)::

    >>> forward_choice(framework="torch", device_kind="cuda", capability=(9, 0),
    ...                triton_version="3.6.0", dtype="bfloat16", head_dim=128, seq_len=32768,
    ...                kv_len=32768, batch_heads=16, mean_tiles=9.0, layout_ok=True,
    ...                contiguous=True, scale=0.088).name
    'hopper'
    >>> forward_choice(framework="jax", device_kind="cuda", capability=(9, 0),
    ...                triton_version="3.6.0", dtype="bfloat16", head_dim=128, seq_len=32768,
    ...                kv_len=32768, batch_heads=16, mean_tiles=9.0, layout_ok=True,
    ...                contiguous=True, scale=0.088, launcher="no GPU torch").reason
    'no GPU torch'
"""

from __future__ import annotations

import dataclasses
import weakref

from sparsetp.core.layout import make_layout
from sparsetp.kernels import abi, schedule
from sparsetp.kernels import options as _options

try:  # Gluon ships with Triton >= 3.5; without it only the portable kernels exist
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    GLUON = True
except ImportError:  # pragma: no cover (every supported Triton has Gluon)
    GLUON = False

__all__ = ["FWD_KERNELS", "TESTED_TRITON", "BLOCK", "HEAD_DIMS", "DTYPES", "KernelChoice",
           "forward_choice", "backward_choice", "GLUON"]

FWD_KERNELS = ("portable", "hopper")
# Triton versions whose Gluon API (warp_specialize's signature, TMA and mbarrier builtins) this
# kernel was compiled and checked with on an H100/H200; the API moves between releases.
TESTED_TRITON = ((3, 6),)
BLOCK = 128  # query rows per program (two warpgroups x 64) and keys per K/V tile
HEAD_DIMS = (128, 256)  # the forward's; the backward's are BWD_HEAD_DIMS
BWD_HEAD_DIMS = (128,)
DTYPES = ("bfloat16", "float16")
STAGES = 3  # K/V ring: 32 KB of Q + 3 x 64 KB of K, V = 224 KB of the 227 KB of shared memory
# Head dim 256: a 128-key tile's K and V (128 KB) and its 64 x 128 fp32 scores beside the
# 64 x 256 accumulator do not fit, so the forward walks each tile in two 64-key steps through a
# 2-stage ring of 64-key boxes (64 KB of Q + 2 x 64 KB = 192 KB; 168 registers, no spills).
KV_BOX = {128: BLOCK, 256: BLOCK // 2}
FWD_STAGES = {128: STAGES, 256: 2}
CONSUMER_REGS = 232  # per thread, two consumer warpgroups; the producer warp keeps 24
PRODUCER_REGS = 24
# The dK/dV consumers take the most registers the pool allows: with its one loop of steps the
# pass spills nothing; 7-14% faster than the nested loop at 232 (KERNEL_NOTES, "Session 31:
# the dK/dV pass's spills").
DKDV_CONSUMER_REGS = 240
PINGPONG = True  # FA3's inter-warpgroup ping-pong: 1-4% faster on 9 of 10 cases (KERNEL_NOTES)
NUM_WARPS = 4  # the default partition (consumer 0); the kernel runs 4 + 4 + 1 warps
# dQ pass: Q and dO (64 KB) stay; 2 x 64 KB of K, V = 192 KB of shared memory
DQ_STAGES = 2
# dK/dV pass: K, V (64 KB) stay; 2 x 32 KB of Q, dO steps, 32 KB of P, dS = 160 KB. Two stages
# measured faster than three (1.03-1.19x the portable dK/dV against 0.87-1.04x; KERNEL_NOTES
# "Session 22"), likely the L1 left beside shared memory for the LSE, Delta and mask loads;
# issuing dP with S (EARLY_DP) 1.06-1.21x, at least as fast on 7 of 8 cases.
DKDV_STAGES = 2
DKDV_EARLY_DP = True
# "auto" takes the fast path where it measured faster than the portable kernels (H200, bf16,
# D=128, H=16; KERNEL_NOTES "Session 21"): from 1024 programs (N=8192 and up: 1.05-1.37x on
# window, BigBird, strided causal, causal and a per-head mix) or on long lists. At N=4096 (512
# programs) short lists went either way (0.84-1.14x, strided causal's partial tiles slowest)
# and causal's 16 tiles a row tied (0.98x), so those keep the portable kernels.
AUTO_MIN_PROGRAMS = 1024
AUTO_MIN_MEAN_TILES = 32.0


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Which kernel a call's forward (or backward) runs (``name`` in :data:`FWD_KERNELS`) and
    why."""

    name: str
    reason: str


def _version(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def _ineligible(*, framework, device_kind, capability, triton_version, dtype, head_dim,
                seq_len, kv_len, layout_ok, contiguous, scale,
                launcher: str | None = None) -> str | None:
    """Why the fast path cannot run this call, or None. ``launcher``: why the frontend
    cannot launch it here (None: it can)."""
    if framework not in ("torch", "jax"):
        return f"no sm_90 launcher for framework {framework!r}"
    if device_kind != "cuda":
        return f"the fast path is a CUDA kernel (device kind {device_kind!r})"
    if capability != (9, 0):
        return f"the fast path needs compute capability 9.0 (Hopper), got {capability}"
    if not GLUON or _version(triton_version) not in TESTED_TRITON:
        return (f"Triton {triton_version} is not one this kernel was checked with "
                f"({', '.join(f'{a}.{b}' for a, b in TESTED_TRITON)})")
    if dtype not in DTYPES:
        return f"dtype {dtype} (the fast path runs {', '.join(DTYPES)})"
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (the fast path runs {HEAD_DIMS})"
    if seq_len % BLOCK or kv_len % BLOCK:
        return f"sequence lengths {seq_len}, {kv_len} are not multiples of {BLOCK}"
    if not layout_ok:
        return f"the layout has no {BLOCK}-block form (built by hand at another block)"
    if not contiguous:
        return "q, k, v are not C-contiguous [B, H, N, D] tensors"
    if not scale > 0:
        # Masked scores are -inf before the scale multiplies them (one FMA into exp2): exact
        # for a positive scale only (0 * -inf is NaN, a negative scale flips the running max).
        return f"softmax scale {scale} is not positive"
    return launcher


def _choice(option: str, why: str | None, batch_heads: int, seq_len: int,
            mean_tiles: float) -> KernelChoice:
    """The kernel under ``LaunchOptions.<option>`` for a call the fast path cannot run for
    ``why`` (None: it can)."""
    mode = getattr(_options.current(), option)
    if mode == "portable":
        return KernelChoice("portable", f"LaunchOptions.{option}='portable'")
    if why is not None:
        if mode == "hopper":
            raise ValueError(f"LaunchOptions.{option}='hopper' cannot run this call: {why}")
        return KernelChoice("portable", why)
    if mode == "hopper":
        return KernelChoice("hopper", f"LaunchOptions.{option}='hopper'")
    programs = batch_heads * (seq_len // BLOCK)
    if programs >= AUTO_MIN_PROGRAMS or mean_tiles >= AUTO_MIN_MEAN_TILES:
        return KernelChoice("hopper", f"{programs} programs, {mean_tiles:.1f} key tiles a row")
    return KernelChoice("portable", f"short lists over few programs ({programs} programs, "
                        f"{mean_tiles:.1f} key tiles a row): the portable kernels measured "
                        "faster there")


def forward_choice(*, framework: str, device_kind: str, capability, triton_version: str,
                   dtype: str, head_dim: int, seq_len: int, kv_len: int, batch_heads: int,
                   mean_tiles: float, layout_ok: bool, contiguous: bool,
                   scale: float, launcher: str | None = None) -> KernelChoice:
    """The forward kernel of a call, under :attr:`LaunchOptions.fwd_kernel`.

    ``"auto"`` runs the fast path where it is eligible and measured faster (see
    :data:`AUTO_MIN_PROGRAMS`); ``"portable"`` always runs the portable kernel; ``"hopper"``
    runs the fast path wherever it is eligible and raises ``ValueError`` with the reason
    elsewhere. ``batch_heads`` is B * H of the launch, ``mean_tiles`` the mean number of listed
    key tiles per query tile of the block-128 layout; ``launcher`` why the frontend cannot
    launch the fast path here (None: it can; the JAX frontend's reasons are
    :func:`sparsetp.backends.jax.hopper.unavailable`).
    """
    why = _ineligible(framework=framework, device_kind=device_kind, capability=capability,
                      triton_version=triton_version, dtype=dtype, head_dim=head_dim,
                      seq_len=seq_len, kv_len=kv_len, layout_ok=layout_ok,
                      contiguous=contiguous, scale=scale, launcher=launcher)
    return _choice("fwd_kernel", why, batch_heads, seq_len, mean_tiles)


def backward_choice(*, framework: str, device_kind: str, capability, triton_version: str,
                    dtype: str, head_dim: int, seq_len: int, kv_len: int, batch_heads: int,
                    mean_tiles: float, layout_ok: bool, contiguous: bool,
                    scale: float, launcher: str | None = None) -> KernelChoice:
    """The backward kernels of a call, under :attr:`LaunchOptions.bwd_kernel`, by the
    forward's eligibility and rule (:func:`forward_choice`): ``"hopper"`` runs both passes on
    sm_90 (:func:`_attn_bwd_dq_kernel_sm90`, which also writes Delta, then
    :func:`_attn_bwd_dkdv_kernel_sm90`), ``"portable"`` the portable kernels.

    >>> backward_choice(framework="torch", device_kind="cuda", capability=(9, 0),
    ...                 triton_version="3.6.0", dtype="float32", head_dim=128, seq_len=8192,
    ...                 kv_len=8192, batch_heads=16, mean_tiles=9.0, layout_ok=True,
    ...                 contiguous=True, scale=0.088).reason
    'dtype float32 (the fast path runs bfloat16, float16)'
    """
    why = _ineligible(framework=framework, device_kind=device_kind, capability=capability,
                      triton_version=triton_version, dtype=dtype, head_dim=head_dim,
                      seq_len=seq_len, kv_len=kv_len, layout_ok=layout_ok,
                      contiguous=contiguous, scale=scale, launcher=launcher)
    return _choice("bwd_kernel", _backward_why(why, head_dim), batch_heads, seq_len,
                   mean_tiles)


def _backward_why(why: str | None, head_dim: int) -> str | None:
    """Why the backward's fast path cannot run a call the forward's rule gives ``why`` for."""
    if why is None and head_dim not in BWD_HEAD_DIMS:
        return f"head dim {head_dim} (the sm_90 backward runs {BWD_HEAD_DIMS})"
    return why


_LAYOUTS_128: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layout_128(layout):
    """``layout`` at block 128 (the same token mask in 128-tiles), or None when it has no
    pattern to lay out again. A head slice (tensor parallelism) is the same slice of its whole
    layout's block-128 form. Cached while ``layout`` lives."""
    if layout.block_size == BLOCK:
        return layout
    if layout in _LAYOUTS_128:
        return _LAYOUTS_128[layout]
    if getattr(layout, "source", None) is not None:
        whole = layout_128(layout.source)
        out = None if whole is None else whole.heads(layout.head_offset,
                                                     layout.head_offset + layout.num_heads)
    elif getattr(layout, "pattern", None) is None:
        out = None
    else:
        out = make_layout(layout.pattern, layout.seq_len, layout.num_heads, BLOCK,
                          kv_len=layout.kv_len)
    _LAYOUTS_128[layout] = out
    return out


@dataclasses.dataclass(frozen=True)
class Sm90Launch:
    """What one sm_90 kernel launch takes, framework-neutral (both frontends launch from it):
    ``kernel`` (its name in this module), ``grid``, ``boxes`` (the TMA descriptor operands and
    their box rows: inputs among q, k, v, d_out, then the outputs stored by TMA among out, dq,
    dk, dv), ``args`` (layout arrays and scalars, in the kernel's order), ``pointers`` (names of
    the pointer operands after them: inputs, then outputs) and ``constexprs`` (in the kernel's
    order; ``num_warps`` is :data:`NUM_WARPS`)."""

    kernel: str
    grid: tuple[int, int, int]
    boxes: tuple[tuple[str, int], ...]
    args: tuple
    pointers: tuple[str, ...]
    constexprs: dict


def skip_levels(skip_quarters: bool) -> tuple[int, int]:
    """The ``SKIP`` constexprs of the dQ and the dK/dV pass (0: compute every 64-row step;
    1: skip the steps with no key; 2: also, in each consumer warpgroup, the 64 x 64 quarters
    of its own with no pair) for a layout whose ``BlockLayout.skip_quarters`` is
    ``skip_quarters``. Off, both passes compile as if the skip did not exist.

    >>> skip_levels(True), skip_levels(False)
    ((2, 2), (0, 0))
    """
    return (2, 2) if skip_quarters else (0, 0)


GROUP_KEY_LISTS = ("kg_count", "kg_partial", "kg_index", "kg_mask_id", "kg_order")


def group_key_lists(xp, meta, group: int, q_tiles: int) -> dict:
    """GQA's key-major lists merged per kv head, for the sm_90 dK/dV pass: the lists of key
    tile ``j`` of query heads ``g * group .. g * group + group - 1`` as one list of kv head
    ``g`` over the group's ``group * N`` query rows (entry ``r * q_tiles + i`` is query tile
    ``i`` of the group's head ``r``: q ``[B, H, N, D]`` viewed as ``[B, H_kv, group * N,
    D]``), every head's partial entries first, then the full ones, each in head order. The
    pass then runs MHA's program over them (``GROUP`` 1), which is 3-10% faster than walking
    the heads of a group in turn (KERNEL_NOTES, "Session 39"). ``xp``: ``numpy`` or
    ``jax.numpy``; ``meta``: ``BlockLayout.metadata()`` form of either. Returns int32 arrays
    named by :data:`GROUP_KEY_LISTS` (``kg_index`` is ``[H_kv, tiles, group * W]``).

    >>> import numpy as np
    >>> from sparsetp.core import patterns as P, make_layout
    >>> g = group_key_lists(np, make_layout(P.causal(), 512, 2, 128).metadata(), 2, 4)
    >>> g["kg_index"][0, 2, :4].tolist(), int(g["kg_partial"][0, 2]), g["kg_order"].tolist()
    ([2, 6, 3, 7], 2, [[0, 1, 2, 3]])
    """
    heads, tiles, width = meta["k_index"].shape
    if group < 1 or heads % group:
        raise ValueError(f"group {group} must be >= 1 and divide the layout's {heads} heads")
    kv = heads // group

    def per_head(name):  # [kv, tiles, group]
        return xp.transpose(xp.reshape(meta[name], (kv, group, tiles)), (0, 2, 1))

    count, partial = per_head("k_count"), per_head("k_partial")
    full = count - partial
    p_end, f_end = xp.cumsum(partial, axis=-1), xp.cumsum(full, axis=-1)
    slot = xp.reshape(xp.arange(group * width, dtype=xp.int32), (1, 1, -1))
    n_part = p_end[..., -1:]
    in_part = slot < n_part
    f_slot = slot - n_part
    head = xp.zeros(slot.shape, xp.int32) + xp.zeros(n_part.shape, xp.int32)
    for r in range(group - 1):  # the head whose entries hold each slot
        head = head + xp.where(in_part, p_end[..., r:r + 1] <= slot,
                               f_end[..., r:r + 1] <= f_slot).astype(xp.int32)

    def at(a):  # a [kv, tiles, group] at each slot's head
        return xp.take_along_axis(a, head, axis=-1)

    pos = xp.where(in_part, slot - at(p_end - partial), at(partial) + f_slot - at(f_end - full))
    valid = slot < n_part + f_end[..., -1:]
    src = head * width + xp.where(valid, pos, 0)

    def gathered(name):
        a = xp.reshape(xp.transpose(xp.reshape(meta[name], (kv, group, tiles, width)),
                                    (0, 2, 1, 3)), (kv, tiles, group * width))
        return xp.take_along_axis(a, src, axis=-1)

    merged = xp.sum(count, axis=-1).astype(xp.int32)
    return {"kg_count": merged, "kg_partial": xp.sum(partial, axis=-1).astype(xp.int32),
            "kg_index": xp.where(valid, gathered("k_index") + head * q_tiles, 0).astype(xp.int32),
            "kg_mask_id": xp.where(valid, gathered("k_mask_id"), -1).astype(xp.int32),
            "kg_order": xp.argsort(-merged, axis=-1, stable=True).astype(xp.int32)}


def launches(meta, batch: int, heads: int, kv_heads: int, seq_len: int, kv_len: int,
             scale: float, ordered: bool, head_dim: int = 128, *,
             skip_quarters: bool, skip_halves: bool) -> dict[str, Sm90Launch]:
    """The forward's (``"fwd"``), dQ pass's (``"dq"``, without an LSE cotangent; with one:
    ``"dq_dlse"``) and dK/dV pass's (``"dkdv"``) launches on block-128 layout metadata
    ``meta`` (``BlockLayout.metadata()`` form, arrays of either framework, plus the head
    groups of :func:`sparsetp.kernels.schedule.head_groups`), for q ``[batch, heads, seq_len,
    head_dim]`` and k, v ``[batch, kv_heads, kv_len, head_dim]`` (for GQA, ``dkdv`` only where
    ``meta`` holds the merged lists of :func:`group_key_lists`); ``ordered``: the work order
    is not ``"natural"``. In the dQ pass's pointers ``d_lse`` is ``lse`` when there is no
    cotangent (never read). The backward's launches are for :data:`BWD_HEAD_DIMS` only.
    ``skip_quarters``: the layout's (``BlockLayout.skip_quarters``), whether the backward's
    launches compile the skip of empty quarter tiles (:func:`skip_levels`); ``skip_halves``:
    the layout's (``BlockLayout.skip_halves``), whether the forward computes its half entries
    two to a step (``PAIRS``; head dim 128 only, with K/V boxes of 64 rows)."""
    arrays, strides = abi._check_meta(meta, "q", heads, seq_len // BLOCK, BLOCK)
    qk_scale = float(scale) * 1.4426950408889634  # softmax in base 2 (exp2)
    group = heads // kv_heads
    k_meta = meta if group == 1 else {  # GQA: the group's merged lists (group_key_lists)
        "masks": meta["masks"], **{"k" + n[2:]: meta[n] for n in GROUP_KEY_LISTS if n in meta}}
    grid = schedule.list_grid(batch, heads, seq_len // BLOCK,
                              schedule.grid_group(meta, "q", batch, heads))
    kv_grid = schedule.list_grid(batch, kv_heads, kv_len // BLOCK,
                                 schedule.grid_group(meta, "k", batch, kv_heads))
    half, full = BLOCK // 2, BLOCK
    q_boxes = (("q", half), ("d_out", half), ("k", full), ("v", full))
    regs = {"CONSUMER_REGS": CONSUMER_REGS, "PRODUCER_REGS": PRODUCER_REGS}
    dkdv_regs = {"CONSUMER_REGS": DKDV_CONSUMER_REGS, "PRODUCER_REGS": PRODUCER_REGS}
    dq_args = (*arrays, meta["mask_quarters"], qk_scale, float(scale), seq_len, kv_len, heads,
               group, kv_heads, *strides)
    dq_skip, dkdv_skip = skip_levels(skip_quarters)
    pairs = bool(skip_halves) and KV_BOX[head_dim] == full
    kv_box = half if pairs else KV_BOX[head_dim]
    out = {"fwd": Sm90Launch(
        "_attn_fwd_kernel_sm90", grid,
        (("q", half), ("k", kv_box), ("v", kv_box), ("out", half)),
        (*arrays, meta["q_halves"], meta["mask_quarters"], qk_scale, seq_len, kv_len, heads,
         group, kv_heads, *strides), ("lse",),
        {"ORDERED": ordered, "STAGES": FWD_STAGES[head_dim], **regs, "PINGPONG": PINGPONG,
         "PAIRS": pairs})}
    for name, has_dlse in (("dq", False), ("dq_dlse", True)):
        out[name] = Sm90Launch(
            "_attn_bwd_dq_kernel_sm90", grid, (*q_boxes, ("dq", half)), dq_args,
            ("out", "lse", "d_lse" if has_dlse else "lse", "delta"),
            {"ORDERED": ordered, "STAGES": DQ_STAGES, "HAS_DLSE": has_dlse,
             "SKIP": dq_skip, **regs})
    if group > 1 and not all(n in meta for n in GROUP_KEY_LISTS):
        return out  # no dK/dV launch without the merged lists
    k_arrays, k_strides = abi._check_meta(k_meta, "k", kv_heads, kv_len // BLOCK, BLOCK)
    # MHA's program (GROUP 1); GQA's over its merged lists, q as [B, H_kv, group * N, D].
    out["dkdv"] = Sm90Launch(
        "_attn_bwd_dkdv_kernel_sm90", kv_grid, (*q_boxes, ("dk", full), ("dv", full)),
        (*k_arrays, meta["mask_quarters"], qk_scale, float(scale), group * seq_len, kv_len,
         kv_heads, *k_strides),
        ("lse", "delta"),
        {"ORDERED": ordered, "STAGES": DKDV_STAGES, "EARLY_DP": DKDV_EARLY_DP,
         "SKIP": dkdv_skip, **dkdv_regs})
    return out


# Triton's TMA element-type enum in compiled metadata -> the driver's CUtensorMapDataType
# (Triton's NVIDIA driver maps them the same way before encoding a descriptor).
TMA_DTYPE_TO_DRIVER = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}


@dataclasses.dataclass(frozen=True)
class TmaSpec:
    """One TMA descriptor a launch encodes from an operand's address: the ``[rows, d]`` view of
    operand ``name`` (contiguous), its box, and the driver's element type, size and swizzle
    (``cuTensorMapEncodeTiled``'s arguments)."""

    name: str
    rows: int
    d: int
    box_rows: int
    box_cols: int
    elem_type: int
    elem_size: int
    swizzle: int


def parameters(launch: Sm90Launch, compiled, rows: dict, head_dim: int):
    """``(params, specs)``: the kernel parameters of ``launch`` as Triton 3.6's launcher packs
    them for ``compiled`` (its CompiledKernel), which both C++ launchers (torch's native node,
    JAX's FFI handler) replay. ``params`` holds one ``(kind, value)`` per parameter:
    ``("lit32", bits)`` and ``("lit64", bits)`` literals, ``("pointer", operand name)``,
    ``("array", index into launch.args)`` (a layout array's address) and ``("tma", index into
    specs)``; a descriptor is followed by its shape (i32 x 2) and strides (i64 x 2), and the
    last two parameters are the null scratch pointers. ``rows``: each boxed operand's rows of
    its ``[rows, head_dim]`` view. Raises ValueError for a kernel these launchers cannot pass
    (:func:`sparsetp.kernels.abi.unlaunchable`, a parameter type they do not pack).

        >>> from types import SimpleNamespace as NS
        >>> launch = Sm90Launch("k", (1, 1, 1), (("q", 64),), (0.5, 7), ("out",), {})
        >>> md = NS(tensordesc_meta=[dict(block_size=[64, 128], elem_type=9, elem_size=2,
        ...                               swizzle=3)], name="k")
        >>> sig = {"q_desc": "tensordesc", "s": "fp32", "n": "i32", "out": "*bf16"}
        >>> params, specs = parameters(launch, NS(src=NS(signature=sig), metadata=md),
        ...                            {"q": 256}, 128)
        >>> params[:5], params[5:]
        ([('tma', 0), ('lit32', 256), ('lit32', 128), ('lit64', 128), ('lit64', 1)], \
[('lit32', 1056964608), ('lit32', 7), ('pointer', 'out'), ('lit64', 0), ('lit64', 0)])
        >>> specs[0].elem_type, specs[0].box_rows
        (8, 64)
    """
    md = compiled.metadata
    needs = abi.unlaunchable(md)
    if needs:
        raise ValueError(f"sm_90 {launch.kernel}: needs {', '.join(needs)}")
    values_of = ([("box", n) for n, _ in launch.boxes]
                 + [("arg", i) for i in range(len(launch.args))]
                 + [("ptr", n) for n in launch.pointers])
    # The kernel's parameters in order, each with its value; a value Triton specialised into
    # the binary (an int equal to 1) is "constexpr" there and passes nothing. The kernel's own
    # constexprs come after every value.
    signature = list(compiled.src.signature.items())
    if len(signature) < len(values_of):
        raise ValueError(f"sm_90 {launch.kernel}: {len(signature)} parameters, "
                         f"{len(values_of)} values")
    extra = [name for name, ty in signature[len(values_of):] if ty != "constexpr"]
    if extra:
        raise ValueError(f"sm_90 {launch.kernel}: parameters {extra} have no value")
    boxes = [ty for (_, ty), (what, _) in zip(signature, values_of, strict=False)
             if what == "box"]
    descs = list(getattr(md, "tensordesc_meta", None) or ())
    if (len(descs) != len(launch.boxes) or not all(str(ty).startswith("tensordesc")
                                                   for ty in boxes)
            or any(m.get("fp4_padded") for m in descs)):
        raise ValueError(f"sm_90 {launch.kernel}: its {len(launch.boxes)} TMA operands are not "
                         "device-side descriptors of the packing these launchers replay")
    params: list[tuple[str, object]] = []
    specs: list[TmaSpec] = []
    for (name, ty), (what, ref) in zip(signature, values_of, strict=False):
        if ty == "constexpr":
            continue
        if what == "box":  # descriptor, shape (i32 x 2), strides (i64 x 2)
            meta = descs[len(specs)]
            specs.append(TmaSpec(ref, rows[ref], head_dim, *meta["block_size"],
                                 TMA_DTYPE_TO_DRIVER[meta["elem_type"]], meta["elem_size"],
                                 meta["swizzle"]))
            params += [("tma", len(specs) - 1), ("lit32", rows[ref]), ("lit32", head_dim),
                       ("lit64", head_dim), ("lit64", 1)]
        elif what == "ptr":
            params.append(("pointer", ref))
        elif ty.startswith("*"):
            params.append(("array", ref))
        elif ty in ("fp32", "i32", "i64"):
            params.append(("lit64" if ty == "i64" else "lit32",
                           abi.pack_cell(ty, launch.args[ref])))
        else:
            raise ValueError(f"sm_90 {launch.kernel}: parameter {name} of type {ty}")
    return params + [("lit64", 0), ("lit64", 0)], specs  # scratch: none (abi.unlaunchable)


class LaunchBox:
    """What Triton's launcher reads of a host TMA descriptor argument (``make_tensordesc_arg``:
    base pointer, shape, strides, padding): the ``[rows, d]`` view of the contiguous buffer at
    ``ptr``. Both launchers pass these to a compiled kernel instead of a checked descriptor."""

    __slots__ = ("base", "shape", "strides")
    padding = "zero"

    def __init__(self, ptr: int, rows: int, d: int):
        self.base, self.shape, self.strides = _Pointer(ptr), [rows, d], [d, 1]


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


if GLUON:
    LN2 = gl.constexpr(0.6931471805599453)
    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _program(order, stride_ch, stride_cm, H, ranks, head_stride, ORDERED: gl.constexpr):
        """(tile, b * H + h) of this program: :func:`sparsetp.kernels.attention._program` (the
        same two grid forms and per-head work order; the work-order row of head ``h`` is ``h *
        head_stride``: the dK/dV pass's kv heads take their group's first query head's, 1
        elsewhere)."""
        if gl.num_programs(1) == 1:
            g = gl.program_id(0)
            off_bh = g // ranks
            rank = g % ranks
        else:
            off_bh = gl.program_id(2) * gl.num_programs(0) + gl.program_id(0)
            rank = gl.program_id(1)
        if ORDERED:
            tile = gl.load(order + (off_bh % H) * head_stride * stride_ch + rank * stride_cm)
        else:
            tile = rank
        return tile, off_bh

    @gluon.jit
    def _masked_scores(s, e, n_partial, q_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
                       stride_mw, row0, col0, s_layout: gl.constexpr, ROWS: gl.constexpr,
                       COLS: gl.constexpr):
        """Scores [ROWS, COLS] (rows ``row0 + [0, ROWS)``, keys ``col0 + [0, COLS)`` of a
        128-key tile) of list entry ``e``, -inf where the pair is not allowed: the bitmask row
        of a partial tile (entries before ``n_partial``; bit ``c % 32`` of word ``c // 32``).
        A full tile passes as it is, with no work per element: N and N_KV are multiples of 128
        on this path (:func:`forward_choice`), so no key of a listed tile lies past N_KV."""
        if e < n_partial:
            mid = gl.load(q_mask_id + row + e * stride_ik)
            c = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, s_layout))
            rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            words = gl.load(masks + mid * stride_mu + rows[:, None] * stride_mr
                            + (c[None, :] // 32) * stride_mw)
            s = gl.where(((words >> (c[None, :] % 32)) & 1) != 0, s, float("-inf"))
        return s

    @gluon.jit
    def _step_keys(e, sub, n_partial, mask_id, mask_quarters, SKIP: gl.constexpr):
        """Of the 64 query rows ``sub`` (0 or 1) of list entry ``e`` (its mask id at
        ``mask_id``): (whether they have an allowed key, whether keys ``[0, 64)`` hold one,
        whether keys ``[64, 128)`` do), from the ``mask_quarters`` entry of a partial tile (a
        full tile has all four quarters). ``SKIP`` (see :func:`skip_levels`): 0, every step
        is computed (constants True, so the callers' branches compile away); 1, only the
        first answer is read; 2, all three. Every party of a pass asks the same question of
        a step, so they skip it alike."""
        has_key = True
        left = True
        right = True
        if SKIP > 0:
            bits = 15
            if e < n_partial:
                bits = gl.load(mask_quarters + gl.load(mask_id))
            has_key = ((bits >> (2 * sub)) & 3) != 0
            if SKIP > 1:
                left = ((bits >> (2 * sub)) & 1) != 0
                right = ((bits >> (2 * sub + 1)) & 1) != 0
        return has_key, left, right

    @gluon.jit
    def _online_softmax(s, m_i, l_i, qk_scale):
        """One online-softmax step on raw scores ``s``: (p in fp32, alpha to rescale the
        accumulator by, the new running max, the new running sum), in base 2."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # A row with no allowed key so far keeps m = -inf; subtracting 0 instead keeps alpha
        # and p at exp2(-inf) = 0 rather than exp2(nan).
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s * qk_scale - m_safe[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _finish(acc, m_i, l_i, row_layout: gl.constexpr):
        """(out, LSE in natural log) of the final state. Rows with no allowed key (l = 0) give
        output 0 and LSE -inf, never 0/0."""
        has_key = l_i > 0.0
        l_safe = gl.where(has_key, l_i, 1.0)
        lse = gl.where(has_key, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        return acc / gl.convert_layout(l_safe, row_layout)[:, None], lse

    @gluon.jit
    def _kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, q_index, row,
                 count, kv_row0, stride_ik, TILE: gl.constexpr):
        """The producer's ring (forward and dQ pass): each listed ``TILE``-key tile, in steps
        of the boxes' rows (``TILE`` / rows steps a tile), into stage ``step % STAGES`` as
        soon as both consumers have freed it."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        SPLIT: gl.constexpr = TILE // BLOCK_N
        STAGES_: gl.constexpr = k_smem.shape[0]
        for e in range(count * SPLIT):
            s = e % STAGES_
            # A fresh mbarrier counts as completed for parity 1: the first STAGES waits pass.
            mbarrier.wait(kv_empty.index(s), ((e // STAGES_) & 1) ^ 1)
            r = (kv_row0 + gl.load(q_index + row + (e // SPLIT) * stride_ik) * TILE
                 + (e % SPLIT) * BLOCK_N)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [r, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [r, 0], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _fwd_loader(k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                    kv_empty, pairs, q_index, q_mask_id, mask_quarters, row, count, n_half,
                    q_row0, kv_row0, stride_ik):
        """Producer warp: both halves of the Q tile once, then the K/V ring (:func:`_kv_ring`;
        with paired half entries, ``pairs`` of length 2, :func:`_pair_ring`)."""
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row0 + q_desc.block_type.shape[0], 0],
                                        q_bar, q_smem.index(1))
        if pairs.shape[0] == 2:
            _pair_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, q_index,
                       q_mask_id, mask_quarters, row, count, n_half, kv_row0, stride_ik)
        else:
            _kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, q_index, row,
                     count, kv_row0, stride_ik, 2 * q_desc.block_type.shape[0])

    @gluon.jit
    def _half_side(mask_id, mask_quarters, HALF_N: gl.constexpr):
        """The first key of the half of a half entry's tile (its mask ``mask_id``) that holds
        its pairs: 0 or ``HALF_N`` (the other half has none, says ``mask_quarters``)."""
        return gl.where((gl.load(mask_quarters + mask_id) & 5) != 0, 0, HALF_N)

    @gluon.jit
    def _pair_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, q_index,
                   q_mask_id, mask_quarters, row, count, n_half, kv_row0, stride_ik):
        """The forward producer's ring over a list whose first ``n_half`` entries are half
        entries (one 64-key half of the tile holds all its pairs): step ``j <
        ceil(n_half / 2)`` loads the keys of half entries ``2j`` and ``2j + 1`` as the two
        halves of one stage (an odd last one twice; the consumers mask the copy), every later
        step one remaining tile whole. Boxes of 64 rows, two per stage."""
        BOX: gl.constexpr = k_desc.block_type.shape[0]
        STAGES_: gl.constexpr = k_smem.shape[0]
        TILE: gl.constexpr = k_smem.shape[1]
        n_pairs = (n_half + 1) // 2
        for j in range(count - n_half + n_pairs):
            s = j % STAGES_
            mbarrier.wait(kv_empty.index(s), ((j // STAGES_) & 1) ^ 1)
            if j < n_pairs:
                a = 2 * j
                b = gl.minimum(a + 1, n_half - 1)
                r0 = (kv_row0 + gl.load(q_index + row + a * stride_ik) * TILE
                      + _half_side(gl.load(q_mask_id + row + a * stride_ik), mask_quarters, BOX))
                r1 = (kv_row0 + gl.load(q_index + row + b * stride_ik) * TILE
                      + _half_side(gl.load(q_mask_id + row + b * stride_ik), mask_quarters, BOX))
            else:
                r0 = kv_row0 + gl.load(q_index + row + (j - n_pairs + n_half) * stride_ik) * TILE
                r1 = r0 + BOX
            mbarrier.expect(k_ready.index(s), 2 * k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [r0, 0], k_ready.index(s),
                                            k_smem.index(s).slice(0, BOX))
            tma.async_copy_global_to_shared(k_desc, [r1, 0], k_ready.index(s),
                                            k_smem.index(s).slice(BOX, BOX))
            mbarrier.expect(v_ready.index(s), 2 * v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [r0, 0], v_ready.index(s),
                                            v_smem.index(s).slice(0, BOX))
            tma.async_copy_global_to_shared(v_desc, [r1, 0], v_ready.index(s),
                                            v_smem.index(s).slice(BOX, BOX))

    @gluon.jit
    def _pair_scores(s, j, n_half, q_mask_id, mask_quarters, row, stride_ik, masks, stride_mu,
                     stride_mr, stride_mw, row0, s_layout: gl.constexpr, ROWS: gl.constexpr,
                     COLS: gl.constexpr):
        """Scores [ROWS, COLS] of pair step ``j`` (:func:`_pair_ring`), -inf where the pair is
        not allowed: keys ``[0, COLS/2)`` are half entry ``2j``'s, the rest ``2j + 1``'s
        (none, all -inf, when ``2j + 1`` is past ``n_half``), each masked by its tile's
        bitmask rows at its half's columns."""
        HALF_N: gl.constexpr = COLS // 2
        a = 2 * j
        has_b = a + 1 < n_half
        b = gl.where(has_b, a + 1, a)
        mid_a = gl.load(q_mask_id + row + a * stride_ik)
        mid_b = gl.load(q_mask_id + row + b * stride_ik)
        side_a = _half_side(mid_a, mask_quarters, HALF_N)
        side_b = _half_side(mid_b, mask_quarters, HALF_N)
        c = gl.arange(0, COLS, layout=gl.SliceLayout(0, s_layout))
        second = c >= HALF_N
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        # One load per half with a scalar base: the compiler then loads each word once per
        # thread, not once per element (a per-column mask id defeats that).
        word = masks + rows[:, None] * stride_mr + ((c % HALF_N) // 32)[None, :] * stride_mw
        words = gl.where(second[None, :],
                         gl.load(word + mid_b * stride_mu + (side_b // 32) * stride_mw),
                         gl.load(word + mid_a * stride_mu + (side_a // 32) * stride_mw))
        ok = (((words >> (c[None, :] % 32)) & 1) != 0) & (has_b | ~second)[None, :]
        return gl.where(ok, s, float("-inf"))

    @gluon.jit
    def _step_scores(s, e, PAIRS: gl.constexpr, SPLIT: gl.constexpr, n_pairs, n_half,
                     n_partial, q_mask_id, mask_quarters, row, stride_ik, masks, stride_mu,
                     stride_mr, stride_mw, row0, s_layout: gl.constexpr, ROWS: gl.constexpr,
                     COLS: gl.constexpr):
        """The forward's scores of ring step ``e``, masked: with ``PAIRS``, a pair step's
        (:func:`_pair_scores`) or, after the ``n_pairs`` of them, list entry ``e - n_pairs +
        n_half``'s; else part ``e % SPLIT`` of entry ``e // SPLIT`` (:func:`_masked_scores`)."""
        if PAIRS:
            if e < n_pairs:
                s = _pair_scores(s, e, n_half, q_mask_id, mask_quarters, row, stride_ik, masks,
                                 stride_mu, stride_mr, stride_mw, row0, s_layout, ROWS, COLS)
            else:
                s = _masked_scores(s, e - n_pairs + n_half, n_partial, q_mask_id, row,
                                   stride_ik, masks, stride_mu, stride_mr, stride_mw, row0, 0,
                                   s_layout, ROWS, COLS)
        else:
            s = _masked_scores(s, e // SPLIT, n_partial, q_mask_id, row, stride_ik, masks,
                               stride_mu, stride_mr, stride_mw, row0, (e % SPLIT) * COLS,
                               s_layout, ROWS, COLS)
        return s

    @gluon.jit
    def _fwd_consumer(HALF: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                      kv_empty, turn, pairs, count, n_half, n_partial, q_index, q_mask_id,
                      mask_quarters, row, stride_ik, masks, stride_mu, stride_mr, stride_mw,
                      qk_scale, N, N_KV, start_m, off_bh, o_desc, LSE):
        """Consumer warpgroup: rows ``[HALF * 64, +64)`` of the query tile. Tile sizes come
        from the buffers' shapes (constexpr arguments do not cross the partition boundary).
        A step is one ring stage: a whole 128-key tile, or (boxes of 64 keys, head dim 256,
        where a whole tile's K, V and scores do not fit) half of one; with paired half
        entries (``pairs`` of length 2), the first ``ceil(n_half / 2)`` steps hold two half
        entries each (:func:`_pair_ring`).

        Per step e >= 1: issue S_e = Q K_e^T and O += P_{e-1} V_{e-1} (async), wait for S_e
        only, mask it and compute its softmax while the P V MMA runs, then wait for that MMA,
        free ring stage e-1 and rescale O by the new running max.

        With two ``turn`` barriers (FA3's ping-pong), the warpgroups take turns to issue their
        MMAs: each waits for its turn, issues, and hands the turn to the other, so one
        warpgroup's softmax runs while the other's MMAs hold the tensor cores."""
        PINGPONG: gl.constexpr = turn.shape[0] == 2
        PAIRS: gl.constexpr = pairs.shape[0] == 2
        SUB_M: gl.constexpr = q_smem.shape[1]
        STAGES_: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]  # keys a step
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        TILE: gl.constexpr = 2 * SUB_M  # keys a listed tile
        SPLIT: gl.constexpr = TILE // BLOCK_N
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        # P as the A operand of O += P V, from registers (32 // 16 = 2 elements per k-step).
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        q = q_smem.index(HALF)
        row0 = HALF * SUB_M
        m_i = gl.full([SUB_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([SUB_M], gl.float32, layout=row_s)
        acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, layout=s_layout)
        p = gl.zeros([SUB_M, BLOCK_N], dtype, layout=p_layout)
        mbarrier.wait(q_bar, 0)
        if PINGPONG and HALF == 1:
            mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 issues first
        if PAIRS:
            n_pairs = (n_half + 1) // 2
            steps = count - n_half + n_pairs
        else:
            n_pairs = 0
            steps = count * SPLIT
        if steps > 0:
            mbarrier.wait(k_ready.index(0), 0)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), 0)
            s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            s = _step_scores(s, 0, PAIRS, SPLIT, n_pairs, n_half, n_partial, q_mask_id,
                             mask_quarters, row, stride_ik, masks, stride_mu, stride_mr,
                             stride_mw, row0, s_layout, SUB_M, BLOCK_N)
            pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
            p = gl.convert_layout(pf.to(dtype), p_layout)
        for e in range(1, steps):
            st = e % STAGES_
            pst = (e - 1) % STAGES_
            mbarrier.wait(k_ready.index(st), (e // STAGES_) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), e & 1)
            s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_ready.index(pst), ((e - 1) // STAGES_) & 1)
            o_tok = warpgroup_mma(p, v_smem.index(pst), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_e done; P V may still run
            s = _step_scores(s, e, PAIRS, SPLIT, n_pairs, n_half, n_partial, q_mask_id,
                             mask_quarters, row, stride_ik, masks, stride_mu, stride_mr,
                             stride_mw, row0, s_layout, SUB_M, BLOCK_N)
            pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(kv_empty.index(pst), count=1)  # K_{e-1} and V_{e-1} are read
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p = gl.convert_layout(pf.to(dtype), p_layout)
        if steps > 0:
            last = steps - 1
            mbarrier.wait(v_ready.index(last % STAGES_), (last // STAGES_) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), steps & 1)
            o_tok = warpgroup_mma(p, v_smem.index(last % STAGES_), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(kv_empty.index(last % STAGES_), count=1)
        out, lse = _finish(acc, m_i, l_i, row_o)
        # O leaves through this warpgroup's Q half (free once its last S has returned) and one
        # TMA store: stored from the MMA layout, 64 rows took 32 scattered 4-byte stores a
        # thread, a tenth of a short-row forward's time (KERNEL_NOTES, session 36).
        q.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_bh * N + start_m * 2 * SUB_M + row0, 0], q)
        rows_s = start_m * 2 * SUB_M + row0 + gl.arange(0, SUB_M, layout=row_s)
        gl.store(LSE + (off_bh * N).to(gl.int64) + rows_s, lse)
        tma.store_wait(0)  # the CTA's shared memory must outlive the store's reads

    @gluon.jit
    def _fwd_consumer0(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, pairs,
                       count, n_half, n_partial, q_index, q_mask_id, mask_quarters, row,
                       stride_ik, masks, stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV,
                       start_m, off_bh, o_desc, LSE):
        _fwd_consumer(0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, pairs,
                      count, n_half, n_partial, q_index, q_mask_id, mask_quarters, row,
                      stride_ik, masks, stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV,
                      start_m, off_bh, o_desc, LSE)

    @gluon.jit
    def _fwd_consumer1(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, pairs,
                       count, n_half, n_partial, q_index, q_mask_id, mask_quarters, row,
                       stride_ik, masks, stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV,
                       start_m, off_bh, o_desc, LSE):
        _fwd_consumer(1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, pairs,
                      count, n_half, n_partial, q_index, q_mask_id, mask_quarters, row,
                      stride_ik, masks, stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV,
                      start_m, off_bh, o_desc, LSE)

    @gluon.jit
    def _attn_fwd_kernel_sm90(q_desc, k_desc, v_desc, o_desc,
                              q_count, q_partial, q_index, q_mask_id, masks, q_order,
                              q_halves, mask_quarters, qk_scale, N, N_KV, H, GROUP, H_KV,
                              stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                              stride_mu, stride_mr, stride_mw,
                              LSE,
                              ORDERED: gl.constexpr, STAGES: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                              PINGPONG: gl.constexpr, PAIRS: gl.constexpr,
                              num_warps: gl.constexpr):
        """Forward on sm_90: Out, LSE as :func:`sparsetp.kernels.attention._attn_fwd_kernel`.

        q_desc, k_desc, v_desc, o_desc: TMA descriptors of the ``[B * H * N, D]`` (Q, Out) and
        ``[B * H_kv * N_KV, D]`` views, boxes of 64 query rows / 128 key rows (64 at head
        dim 256, and with ``PAIRS``); Out ``[B, H, N, D]`` and LSE ``[B, H, N]`` (float32)
        contiguous; ``qk_scale`` = scale * log2(e) (softmax in base 2). N and N_KV are
        multiples of 128. One program per (query tile, b, h) as the portable forward.
        ``PAIRS`` (head dim 128): the first ``q_halves`` entries of each list are half
        entries (``BlockLayout.q_halves``), computed two to a step (:func:`_pair_ring`)."""
        SUB_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        # Keys a K/V stage holds: with PAIRS a whole tile, in boxes of 64 keys.
        STAGE_N: gl.constexpr = 2 * SUB_M if PAIRS else BLOCK_N
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert((2 * SUB_M) % BLOCK_N == 0,
                         "two 64-row consumers per 128-row query tile; whole or half key tiles")
        gl.static_assert(not PAIRS or 2 * BLOCK_N == STAGE_N, "half entries take 64-key boxes")
        start_m, off_bh = _program(q_order, stride_ch, stride_cm, H, gl.cdiv(N, 2 * SUB_M), 1,
                                   ORDERED)
        off_b = off_bh // H
        off_h = off_bh % H
        q_row0 = off_bh * N + start_m * 2 * SUB_M
        kv_row0 = (off_b * H_KV + off_h // GROUP) * N_KV  # GQA: kv head h // GROUP
        count = gl.load(q_count + off_h * stride_ch + start_m * stride_cm)
        n_partial = gl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
        n_half = 0
        if PAIRS:
            n_half = gl.load(q_halves + off_h * stride_ch + start_m * stride_cm)
        row = off_h * stride_ih + start_m * stride_im

        q_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, STAGE_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, STAGE_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # The partitions read PINGPONG and PAIRS off these arrays' lengths (constexprs stay on
        # this side of the partition boundary).
        turn = gl.allocate_shared_memory(gl.int64, [2 if PINGPONG else 1, 1],
                                         mbarrier.MBarrierLayout())
        pairs = gl.allocate_shared_memory(gl.int64, [2 if PAIRS else 1, 1],
                                          mbarrier.MBarrierLayout())
        for i in gl.static_range(2 if PINGPONG else 1):
            mbarrier.init(turn.index(i), count=1)
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        cargs = (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, pairs, count,
                 n_half, n_partial, q_index, q_mask_id, mask_quarters, row, stride_ik, masks,
                 stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV, start_m, off_bh, o_desc,
                 LSE)
        gl.warp_specialize([
            (_fwd_consumer0, cargs),
            (_fwd_consumer1, cargs),
            (_fwd_loader, (k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                           v_ready, kv_empty, pairs, q_index, q_mask_id, mask_quarters, row,
                           count, n_half, q_row0, kv_row0, stride_ik)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qd_bar,
                   k_ready, v_ready, kv_empty, q_index, row, count, q_row0, kv_row0, stride_ik):
        """Producer warp of the dQ pass: both halves of Q and dO once, then the K/V ring
        (:func:`_kv_ring`)."""
        SUB_M: gl.constexpr = q_desc.block_type.shape[0]
        mbarrier.expect(qd_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
        for i in gl.static_range(2):
            tma.async_copy_global_to_shared(q_desc, [q_row0 + i * SUB_M, 0], qd_bar,
                                            q_smem.index(i))
            tma.async_copy_global_to_shared(do_desc, [q_row0 + i * SUB_M, 0], qd_bar,
                                            do_smem.index(i))
        _kv_ring(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, q_index, row, count,
                 kv_row0, stride_ik, 2 * SUB_M)

    @gluon.jit
    def _dq_consumer(HALF: gl.constexpr, q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready,
                     v_ready, kv_empty, count, n_partial, q_index, q_mask_id, row, stride_ik,
                     masks, stride_mu, stride_mr, stride_mw, qk_scale, scale, N, N_KV, start_m,
                     off_bh, dlse_flag, skip, mask_quarters, Out, LSE, DLSE, dq_desc, Delta):
        """Consumer warpgroup of the dQ pass: Delta and dQ of rows ``[HALF * 64, +64)`` of the
        query tile. Each key tile is walked in two 64-key halves: S and dP of 64 x 64 fp32,
        the dQ accumulator (64 x D fp32) and dS as an MMA operand fit the consumer's
        registers, where whole 128-key tiles would not. ``SKIP`` 2: a 64-key half whose
        quarter of the mask (``mask_quarters``) holds no pair in these rows is skipped, and a
        tile with neither, its stage still freed."""
        HAS_DLSE: gl.constexpr = dlse_flag.shape[0] == 2
        SKIP: gl.constexpr = skip.shape[0] - 1
        SUB_M: gl.constexpr = q_smem.shape[1]
        STAGES_: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        HALF_N: gl.constexpr = BLOCK_N // 2
        HEAD_DIM: gl.constexpr = k_smem.shape[2]
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout,
                                                      k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte rows
        row0 = HALF * SUB_M
        base = (off_bh * N).to(gl.int64)  # int64: B*H*N*D passes 2^31
        rows_t = start_m * 2 * SUB_M + row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, tile))
        cols_t = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, tile))
        o = gl.load(Out + base * HEAD_DIM + rows_t[:, None] * HEAD_DIM + cols_t[None, :])
        lse_t = gl.load(LSE + base + rows_t)
        mbarrier.wait(qd_bar, 0)
        q = q_smem.index(HALF)
        do = do_smem.index(HALF)
        # Delta = rowsum(dO * O) - dLSE in fp32 (dLSE only on rows with a finite LSE: a row
        # with no key has P = 0, and inf - inf must not reach the sums), as the portable dQ.
        delta_t = gl.sum(do.load(tile).to(gl.float32) * o.to(gl.float32), 1)
        if HAS_DLSE:
            d_lse = gl.load(DLSE + base + rows_t)
            finite = (lse_t > float("-inf")) & (lse_t < float("inf"))
            delta_t = delta_t - gl.where(finite, d_lse, 0.0)
        gl.store(Delta + base + rows_t, delta_t)
        delta = gl.convert_layout(delta_t, row_s)
        # Base-2 LSE; rows with no key get +inf, so P = exp2(s - inf) = 0 and their dQ is 0.
        lse2 = gl.convert_layout(
            gl.where(lse_t == float("-inf"), float("inf"), lse_t * LOG2E), row_s)
        s_zero = gl.zeros([SUB_M, HALF_N], gl.float32, layout=s_layout)
        dq = gl.zeros([SUB_M, HEAD_DIM], gl.float32, layout=dq_layout)
        for e in range(count):
            st = e % STAGES_
            # Waited even by a warpgroup that skips the tile: one that freed a stage without
            # waiting could free it twice before the other warpgroup freed it once.
            mbarrier.wait(k_ready.index(st), (e // STAGES_) & 1)
            has_key, left, right = _step_keys(e, HALF, n_partial,
                                              q_mask_id + row + e * stride_ik, mask_quarters,
                                              SKIP)
            if has_key:
                mbarrier.wait(v_ready.index(st), (e // STAGES_) & 1)
                for h in gl.static_range(2):
                    if left if h == 0 else right:
                        k_h = k_smem.index(st).slice(h * HALF_N, HALF_N, dim=0)
                        v_h = v_smem.index(st).slice(h * HALF_N, HALF_N, dim=0)
                        s_tok = warpgroup_mma(q, k_h.permute((1, 0)), s_zero, use_acc=False,
                                              is_async=True)
                        dp_tok = warpgroup_mma(do, v_h.permute((1, 0)), s_zero,
                                               use_acc=False, is_async=True)
                        s = warpgroup_mma_wait(1, deps=(s_tok, ))
                        s = _masked_scores(s, e, n_partial, q_mask_id, row, stride_ik, masks,
                                           stride_mu, stride_mr, stride_mw, row0, h * HALF_N,
                                           s_layout, SUB_M, HALF_N)
                        p = gl.exp2(s * qk_scale - lse2[:, None])
                        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
                        ds = p * (dp - delta[:, None])
                        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_layout), k_h,
                                           dq)
            mbarrier.arrive(kv_empty.index(st), count=1)  # K and V of this stage are read
        # dS is the gradient w.r.t. the natural-log scaled scores: scale, not qk_scale.
        dq = dq * scale
        # Out through this warpgroup's Q half and one TMA store, as the forward's O.
        q.store(dq.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dq_desc, [off_bh * N + start_m * 2 * SUB_M + row0, 0],
                                        q)
        tma.store_wait(0)

    @gluon.jit
    def _dq_consumer0(q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty,
                      count, n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu,
                      stride_mr, stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, dlse_flag,
                      skip, mask_quarters, Out, LSE, DLSE, dq_desc, Delta):
        _dq_consumer(0, q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty,
                     count, n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu,
                     stride_mr, stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, dlse_flag,
                     skip, mask_quarters, Out, LSE, DLSE, dq_desc, Delta)

    @gluon.jit
    def _dq_consumer1(q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty,
                      count, n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu,
                      stride_mr, stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, dlse_flag,
                      skip, mask_quarters, Out, LSE, DLSE, dq_desc, Delta):
        _dq_consumer(1, q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty,
                     count, n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu,
                     stride_mr, stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, dlse_flag,
                     skip, mask_quarters, Out, LSE, DLSE, dq_desc, Delta)

    @gluon.jit
    def _attn_bwd_dq_kernel_sm90(q_desc, do_desc, k_desc, v_desc, dq_desc,
                                 q_count, q_partial, q_index, q_mask_id, masks, q_order,
                                 mask_quarters, qk_scale, scale, N, N_KV, H, GROUP, H_KV,
                                 stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                                 stride_mu, stride_mr, stride_mw,
                                 Out, LSE, DLSE, Delta,
                                 ORDERED: gl.constexpr, STAGES: gl.constexpr,
                                 HAS_DLSE: gl.constexpr, SKIP: gl.constexpr,
                                 CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                 num_warps: gl.constexpr):
        """dQ and Delta on sm_90, as :func:`sparsetp.kernels.attention._attn_bwd_dq_kernel`.

        q_desc, do_desc: TMA descriptors of the ``[B * H * N, D]`` views, boxes of 64 rows;
        k_desc, v_desc: of ``[B * H_kv * N_KV, D]``, boxes of 128 rows; dq_desc: of dQ's
        ``[B * H * N, D]`` view, boxes of 64 rows; Out, dQ ``[B, H, N, D]`` and LSE, DLSE,
        Delta ``[B, H, N]`` (float32) contiguous; DLSE (the LSE cotangent)
        is read only with ``HAS_DLSE``. The forward's grid, lists and schedule
        (producer warp, K/V ring, two consumer warpgroups of 64 rows); with ``SKIP`` 2 (see
        :func:`skip_levels`), a warpgroup skips the 64-key halves whose ``mask_quarters`` bit
        says its rows have no key there."""
        SUB_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(2 * SUB_M == BLOCK_N, "two 64-row consumers per 128-row query tile")
        start_m, off_bh = _program(q_order, stride_ch, stride_cm, H, gl.cdiv(N, 2 * SUB_M), 1,
                                   ORDERED)
        off_b = off_bh // H
        off_h = off_bh % H
        q_row0 = off_bh * N + start_m * 2 * SUB_M
        kv_row0 = (off_b * H_KV + off_h // GROUP) * N_KV
        count = gl.load(q_count + off_h * stride_ch + start_m * stride_cm)
        n_partial = gl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
        row = off_h * stride_ih + start_m * stride_im
        q_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        qd_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # The consumers read HAS_DLSE off this array's length (as the forward's PINGPONG).
        dlse_flag = gl.allocate_shared_memory(gl.int64, [2 if HAS_DLSE else 1, 1],
                                              mbarrier.MBarrierLayout())
        # The partitions read SKIP off this array's length.
        skip = gl.allocate_shared_memory(gl.int64, [SKIP + 1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qd_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        cargs = (q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty, count,
                 n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
                 stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, dlse_flag, skip,
                 mask_quarters, Out, LSE, DLSE, dq_desc, Delta)
        gl.warp_specialize([
            (_dq_consumer0, cargs),
            (_dq_consumer1, cargs),
            (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                          qd_bar, k_ready, v_ready, kv_empty, q_index, row, count, q_row0,
                          kv_row0, stride_ik)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

    @gluon.jit
    def _dkdv_loader(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem,
                     k_smem, v_smem, kv_bar, out_bar, q_ready, q_empty, skip, k_count, k_partial,
                     k_index, k_mask_id, mask_quarters, stride_ch, stride_cm, stride_ih,
                     stride_im, stride_ik, N, H, off_b, off_g, start_n, kv_row0):
        """Producer warp: K and V once, then per listed query tile the Q and dO rows of its
        64-row steps (with ``SKIP``, those that have a key:
        :func:`_step_keys`), into ring stage ``t % NSTAGE``; last, once both consumers have
        left dK and dV in the K and V buffers (``out_bar``), their TMA stores."""
        NSTAGE: gl.constexpr = q_smem.shape[0]
        SUB_M: gl.constexpr = q_smem.shape[1]
        SKIP: gl.constexpr = skip.shape[0] - 1
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row0, 0], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [kv_row0, 0], kv_bar, v_smem)
        t = 0
        h = off_g
        count = gl.load(k_count + h * stride_ch + start_n * stride_cm)
        n_partial = gl.load(k_partial + h * stride_ch + start_n * stride_cm)
        row = h * stride_ih + start_n * stride_im
        q_row0 = (off_b * H + h) * N
        for it in range(2 * count):
            e = it // 2
            sub = it % 2
            has_key, _, _ = _step_keys(e, sub, n_partial, k_mask_id + row + e * stride_ik,
                                       mask_quarters, SKIP)
            if has_key:
                qb = gl.load(k_index + row + e * stride_ik)
                s = t % NSTAGE
                mbarrier.wait(q_empty.index(s), ((t // NSTAGE) & 1) ^ 1)
                r = q_row0 + qb * (2 * SUB_M) + sub * SUB_M
                mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes
                                + do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [r, 0], q_ready.index(s),
                                                q_smem.index(s))
                tma.async_copy_global_to_shared(do_desc, [r, 0], q_ready.index(s),
                                                do_smem.index(s))
                t += 1
        mbarrier.wait(out_bar, 0)
        tma.async_copy_shared_to_global(dk_desc, [kv_row0, 0], k_smem)
        tma.async_copy_shared_to_global(dv_desc, [kv_row0, 0], v_smem)
        tma.store_wait(0)  # the CTA's shared memory must outlive the stores' reads

    @gluon.jit
    def _dkdv_consumer(HALF: gl.constexpr, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem,
                         kv_bar, q_ready, q_empty, early, skip, k_count, k_partial, k_index,
                         k_mask_id, masks, mask_quarters, stride_ch, stride_cm, stride_ih,
                         stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, scale,
                         N, H, off_b, off_g, start_n, kv_row0, LSE, Delta, out_bar):
        """Consumer warpgroup of the dK/dV pass: keys ``[HALF * 64, +64)`` of the key tile, in
        FA3's form. Scores are not transposed (S = Q K^T is [64 queries, 64 keys], so a
        per-query vector costs 2 registers a thread, where transposed scores cost 16 and spill
        beside the 128 of the dK, dV accumulators); P and dS go through shared memory as the
        transposed A operands of dV += P^T dO and dK += dS^T Q. A partial tile's mask is two
        words a row (row vectors) expanded in registers, not a load per element.
        ``EARLY_DP``: issue dP = dO V^T with S (else after the softmax). ``SKIP`` 1: skip
        the steps with no key, as the producer does; 2: also free unread the steps whose
        quarter of this consumer's keys holds no pair."""
        EARLY_DP: gl.constexpr = early.shape[0] == 2
        SKIP: gl.constexpr = skip.shape[0] - 1
        NSTAGE: gl.constexpr = q_smem.shape[0]
        SUB_M: gl.constexpr = q_smem.shape[1]
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        KEYS: gl.constexpr = k_smem.shape[0] // 2
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KEYS, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        key0: gl.constexpr = HALF * KEYS
        k_h = k_smem.slice(key0, KEYS, dim=0)
        v_h = v_smem.slice(key0, KEYS, dim=0)
        p_buf = p_smem.index(HALF)
        ds_buf = ds_smem.index(HALF)
        c = key0 + gl.arange(0, KEYS, layout=col_s)  # key within the tile
        s_zero = gl.zeros([SUB_M, KEYS], gl.float32, layout=s_layout)
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(kv_bar, 0)
        t = 0
        h = off_g
        count = gl.load(k_count + h * stride_ch + start_n * stride_cm)
        n_partial = gl.load(k_partial + h * stride_ch + start_n * stride_cm)
        row = h * stride_ih + start_n * stride_im
        stats = (off_b * H + h).to(gl.int64) * N
        # One loop over 64-row steps, not entries x an unrolled pair of steps: the nested
        # form kept per-entry values live across both copies and spilled (KERNEL_NOTES).
        for it in range(2 * count):
            e = it // 2
            sub = it % 2
            has_key, left, right = _step_keys(e, sub, n_partial,
                                              k_mask_id + row + e * stride_ik,
                                              mask_quarters, SKIP)
            if has_key:
                st = t % NSTAGE
                if left if HALF == 0 else right:  # this consumer's keys have a query
                    qb = gl.load(k_index + row + e * stride_ik)
                    mid = gl.load(k_mask_id + row + e * stride_ik)
                    # The step's queries within the tile.
                    r = sub * SUB_M + gl.arange(0, SUB_M, layout=row_s)
                    lse = gl.load(LSE + stats + qb * (2 * SUB_M) + r)
                    delta = gl.load(Delta + stats + qb * (2 * SUB_M) + r)
                    mbarrier.wait(q_ready.index(st), (t // NSTAGE) & 1)
                    qs = q_smem.index(st)
                    dos = do_smem.index(st)
                    s_tok = warpgroup_mma(qs, k_h.permute((1, 0)), s_zero, use_acc=False,
                                          is_async=True)
                    if EARLY_DP:
                        dp_tok = warpgroup_mma(dos, v_h.permute((1, 0)), s_zero,
                                               use_acc=False, is_async=True)
                        s = warpgroup_mma_wait(1, deps=(s_tok, ))
                    else:
                        s = warpgroup_mma_wait(0, deps=(s_tok, ))
                    if e < n_partial:
                        w_row = (masks + mid * stride_mu + r * stride_mr
                                 + (key0 // 32) * stride_mw)
                        w0 = gl.load(w_row)
                        w1 = gl.load(w_row + stride_mw)
                        word = gl.where(c[None, :] < key0 + 32, w0[:, None], w1[:, None])
                        s = gl.where(((word >> (c[None, :] % 32)) & 1) != 0, s, float("-inf"))
                    # Rows with no key (LSE -inf) get +inf: P = 0 and no gradient.
                    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
                    p = gl.exp2(s * qk_scale - lse2[:, None])
                    if not EARLY_DP:
                        dp_tok = warpgroup_mma(dos, v_h.permute((1, 0)), s_zero,
                                               use_acc=False, is_async=True)
                    dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
                    ds = p * (dp - delta[:, None])
                    p_buf.store(p.to(dtype))
                    ds_buf.store(ds.to(dtype))
                    fence_async_shared()
                    dv = warpgroup_mma(p_buf.permute((1, 0)), dos, dv, is_async=True)
                    dk = warpgroup_mma(ds_buf.permute((1, 0)), qs, dk, is_async=True)
                    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                    mbarrier.arrive(q_empty.index(st), count=1)
                else:
                    # Waited before freeing, as the dQ pass's skipping warpgroup does.
                    mbarrier.wait(q_ready.index(st), (t // NSTAGE) & 1)
                    mbarrier.arrive(q_empty.index(st), count=1)
                t += 1
        dk = dk * scale
        # Out through this warpgroup's K and V halves (no MMA reads them any more); the
        # producer stores the tiles by TMA. Holding the descriptors here spilled beside the
        # MMAs (KERNEL_NOTES, session 36).
        k_h.store(dk.to(dtype))
        v_h.store(dv.to(dtype))
        fence_async_shared()
        mbarrier.arrive(out_bar, count=1)


    @gluon.jit
    def _dkdv_consumer0(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                          q_empty, early, skip, k_count, k_partial, k_index, k_mask_id, masks,
                          mask_quarters, stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                          stride_mu, stride_mr, stride_mw, qk_scale, scale, N, H, off_b,
                          off_g, start_n, kv_row0, LSE, Delta, out_bar):
        _dkdv_consumer(0, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                         q_empty, early, skip, k_count, k_partial, k_index, k_mask_id, masks,
                         mask_quarters, stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                         stride_mu, stride_mr, stride_mw, qk_scale, scale, N, H, off_b,
                         off_g, start_n, kv_row0, LSE, Delta, out_bar)


    @gluon.jit
    def _dkdv_consumer1(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                          q_empty, early, skip, k_count, k_partial, k_index, k_mask_id, masks,
                          mask_quarters, stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                          stride_mu, stride_mr, stride_mw, qk_scale, scale, N, H, off_b,
                          off_g, start_n, kv_row0, LSE, Delta, out_bar):
        _dkdv_consumer(1, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                         q_empty, early, skip, k_count, k_partial, k_index, k_mask_id, masks,
                         mask_quarters, stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                         stride_mu, stride_mr, stride_mw, qk_scale, scale, N, H, off_b,
                         off_g, start_n, kv_row0, LSE, Delta, out_bar)


    @gluon.jit
    def _attn_bwd_dkdv_kernel_sm90(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc,
                                   k_count, k_partial, k_index, k_mask_id, masks, k_order,
                                   mask_quarters, qk_scale, scale, N, N_KV, H,
                                   stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                                   stride_mu, stride_mr, stride_mw,
                                   LSE, Delta,
                                   ORDERED: gl.constexpr, STAGES: gl.constexpr,
                                   EARLY_DP: gl.constexpr, SKIP: gl.constexpr,
                                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                   num_warps: gl.constexpr):
        """dK, dV on sm_90, as :func:`sparsetp.kernels.attention._attn_bwd_dkdv_kernel`.

        H heads of N queries and N_KV keys; GQA runs as H_kv heads of ``group * N`` queries
        (q viewed as ``[B, H_kv, group * N, D]``) over its merged lists
        (:func:`group_key_lists`), so the group's dK, dV sum in one program in list order (no
        atomics), as fast as MHA's (walking the group's heads in turn ran 3-10% slower).
        q_desc, do_desc: TMA descriptors of the ``[B * H * N, D]`` views, boxes of 64 rows;
        k_desc, v_desc: of ``[B * H * N_KV, D]``, boxes of 128 rows; dk_desc, dv_desc: of
        dK's and dV's (``[B, H, N_KV, D]``, contiguous), boxes of 128 rows; LSE, Delta ``[B,
        H, N]`` (float32; Delta from the dQ pass) contiguous.
        One program per (key tile, b, head), the portable kernel's grid and work order: a
        producer warp loads K and V once and the Q and dO rows of each listed query tile in
        64-row steps into a ``STAGES`` ring (with ``SKIP``, see :func:`skip_levels`: only the steps
        that ``mask_quarters``, ``[U]``, says have a key; with ``SKIP`` 2 each consumer
        computing those where its keys have one); two consumer warpgroups
        (:func:`_dkdv_consumer`) own 64 keys each."""
        SUB_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(2 * SUB_M == BLOCK_N, "two 64-key consumers, 64-query steps")
        start_n, off_bh = _program(k_order, stride_ch, stride_cm, H, gl.cdiv(N_KV, BLOCK_N), 1,
                                   ORDERED)
        off_b = off_bh // H
        off_g = off_bh % H
        kv_row0 = off_bh * N_KV + start_n * BLOCK_N
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        pl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                rank=2)
        p_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, BLOCK_N // 2], pl)  # per consumer
        ds_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, BLOCK_N // 2], pl)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        out_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # The consumers read EARLY_DP off this array's length (as the forward's PINGPONG).
        early = gl.allocate_shared_memory(gl.int64, [2 if EARLY_DP else 1, 1],
                                          mbarrier.MBarrierLayout())
        # The partitions read SKIP off this array's length.
        skip = gl.allocate_shared_memory(gl.int64, [SKIP + 1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(out_bar, count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        cargs = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty,
                 early, skip, k_count, k_partial, k_index, k_mask_id, masks, mask_quarters,
                 stride_ch, stride_cm, stride_ih, stride_im, stride_ik, stride_mu, stride_mr,
                 stride_mw, qk_scale, scale, N, H, off_b, off_g, start_n, kv_row0, LSE,
                 Delta, out_bar)
        gl.warp_specialize([
            (_dkdv_consumer0, cargs),
            (_dkdv_consumer1, cargs),
            (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem,
                            k_smem, v_smem, kv_bar, out_bar, q_ready, q_empty, skip, k_count,
                            k_partial, k_index, k_mask_id, mask_quarters, stride_ch, stride_cm,
                            stride_ih, stride_im, stride_ik, N, H, off_b, off_g, start_n,
                            kv_row0)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
