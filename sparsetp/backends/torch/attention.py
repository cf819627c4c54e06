"""PyTorch frontend of block-sparse attention, plus two plain-PyTorch baselines.

* :func:`sparse_attention` - the Triton kernels behind one ``torch.autograd.Function``: compiled
  on CUDA tensors, Triton's interpreter on CPU tensors (see :mod:`sparsetp._runtime`).
* :class:`SparseAttention` - an ``nn.Module`` holding a pattern and caching its layouts.
* :func:`naive_sparse_attention` - gather the listed tiles, softmax, scatter; autograd does the
  backward. The benchmark baseline for "block-sparse in plain PyTorch".
* :func:`dense_attention` - ``scaled_dot_product_attention`` with the layout's dense mask.

All take ``q, k, v`` of shape ``[B, H, N, D]`` and a :class:`~sparsetp.core.layout.BlockLayout`
built for ``seq_len=N`` and ``num_heads=H``. A query row with no allowed key gets output 0,
LSE ``-inf`` and zero gradients, in every function here.

Example::

    >>> import torch
    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.causal(), seq_len=64, num_heads=2, block_size=32)
    >>> q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    >>> sparse_attention(q, k, v, lay).shape
    torch.Size([1, 2, 64, 16])
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from sparsetp import _runtime
from sparsetp.core.layout import BlockLayout, make_layout
from sparsetp.core.patterns import Pattern
from sparsetp.kernels import launch as L

import triton  # noqa: E402  (after sparsetp.kernels: _runtime decides the interpreter first)

__all__ = ["sparse_attention", "SparseAttention", "naive_sparse_attention", "dense_attention"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Triton's interpreter is not thread-safe (GPU.md): interpreted launches of both frontends
# hold one process-wide lock.
_INTERPRET_LOCK = _runtime.INTERPRETER_LOCK
# Per-layout device tensors; weak keys so a dropped layout frees its tensors.
_META_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NAIVE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- validation
def _check_inputs(q, k, v, layout, scale):
    """torch-specific checks (types, dtypes, devices); the shared ones live in launch."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if q.dim() == 4 and not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    scale = L.check_attention_shapes(q.shape, k.shape, v.shape, layout, scale)
    if q.dtype not in _DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; supported: {_DTYPES}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return scale


def _device_kind(t: torch.Tensor) -> str:
    interpret = _runtime.interpret_mode()
    if t.is_cuda:
        if interpret:
            raise ValueError("q is a CUDA tensor but this process runs Triton in interpreter "
                             "mode (SPARSETP_INTERPRET/TRITON_INTERPRET); unset it to use the GPU")
        return "cuda"
    if t.device.type == "cpu":
        if not interpret:
            raise ValueError("q is a CPU tensor but this process compiles Triton kernels for the "
                             "GPU; move q, k, v to CUDA or set SPARSETP_INTERPRET=1 before "
                             "importing sparsetp")
        return "interpreter"
    raise ValueError(f"q is on unsupported device {t.device}")


def _metadata(layout: BlockLayout, q: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """Device tensors of the layout the kernels run for ``q`` (``launch.kernel_layout``: the
    layout, or the same pattern at another kernel tile), cached per (kernel layout, device)."""
    device = q.device
    layout = L.kernel_layout(layout, kind, head_dim=q.shape[-1],
                             dtype=str(q.dtype).replace("torch.", ""))
    per_layout = _META_CACHE.setdefault(layout, {})
    key = str(device)
    if key not in per_layout:
        per_layout[key] = {
            **{name: torch.from_numpy(np.array(arr, dtype=np.int32, order="C")).to(device)
               for name, arr in layout.metadata().items()},
            "q_head_group": layout.q_head_group, "k_head_group": layout.k_head_group}
    return per_layout[key]


def _launch(call: L.KernelCall, outputs, device_kind: str):
    """Launch ``call`` through Triton's JIT entry point; returns Triton's compiled kernel (None
    in the interpreter)."""
    kern = call.kernel[call.grid]
    if device_kind == "interpreter":
        with _INTERPRET_LOCK:
            kern(*call.args, *outputs, **call.constexprs)
        return None
    # jax_triton 0.3.1 sets TRITON_CACHE_DIR="" for the whole process, which makes Triton fail
    # to create its cache; an empty value means "unset" to us.
    if os.environ.get("TRITON_CACHE_DIR", None) == "":
        del os.environ["TRITON_CACHE_DIR"]
    with torch.cuda.device(outputs[0].device):
        return kern(*call.args, *outputs, **call.constexprs, num_warps=call.num_warps,
                    num_stages=call.num_stages)


def _new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every kernel output buffer comes from here (tests patch it to pre-fill with NaN)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


# Launch descriptions, cached. Building one (argument list, strides, checks) takes tens of
# microseconds of host time, and at small N the host is what a call waits on (an H200 host spent
# ~230 us in the three-kernel backward at N=1024, most of it in the builders and Triton's launch;
# benchmarks/results/gpu_attention_check_h200_s4_run3.json, host_overhead). The key holds
# everything a description depends on: the builder, the metadata tensors (the entry keeps them
# alive, so their ids stay unique), each tensor's shape/stride/dtype/device, the strides and
# keyword arguments, the launch options and the kernel objects in use; a hit only swaps in this
# call's tensors.
_CALLS: dict = {}
_CALLS_MAX = 1024
# Direct launches (CUDA): after Triton's JIT entry point has run a description once, later calls
# hand the same argument values to the compiled kernel it returned, skipping the entry point's
# per-call work (binding ~50 arguments, specialising each, hashing the cache key, checking
# globals): about 40% of the backward's host time in the session-4 profile
# (benchmarks/results/gpu_attention_check_h200_s4_run4.json, profile_backward_x50). Safe because
# everything Triton specialises a kernel on is fixed by the description's key (dtypes, every
# int argument, the constexprs, warps and stages, the device), except the 16-byte alignment of
# the tensors swapped in per call, which is part of the direct path's own key. Tests and
# benchmarks set it False to compare the two paths.
_DIRECT_LAUNCH = True


def _current_stream(device: int) -> int:
    """The raw current CUDA stream of ``device``, as Triton's launcher obtains it."""
    global _STREAM_OF
    if _STREAM_OF is None:  # the driver initialises on first use: only on the CUDA path
        from triton.runtime import driver
        _STREAM_OF = driver.active.get_current_stream
    return _STREAM_OF(device)


_STREAM_OF = None


class _Description:
    """A cached launch description: the call as built (with the first caller's tensors), its
    arguments after the per-call tensors, its constexpr values in signature order, and the
    compiled kernels Triton returned for it, by the alignment of the per-call tensors."""

    __slots__ = ("call", "n_tensors", "tail", "constexpr_values", "compiled", "meta")

    def __init__(self, call: L.KernelCall, n_tensors: int, meta):
        self.call = call
        self.n_tensors = n_tensors
        self.tail = call.args[n_tensors:]
        names = call.kernel.arg_names[len(call.args) + len(call.outputs):]
        if sorted(names) != sorted(call.constexprs):
            raise AssertionError(f"{call.name}: constexprs {sorted(call.constexprs)} do not fill "
                                 f"the kernel's trailing parameters {names}")
        self.constexpr_values = tuple(call.constexprs[n] for n in names)
        self.compiled: dict = {}
        self.meta = meta  # keeps the metadata tensors (ids in the key) alive

    def with_tensors(self, tensors) -> L.KernelCall:
        return dataclasses.replace(self.call, args=(*tensors, *self.tail))


def _described(builder, tensors: tuple, meta, strides: dict, **kw) -> _Description:
    """``builder(*tensors[, meta], strides=strides, **kw)`` (a ``launch.*_call``), cached."""
    key = (builder, None if meta is None else tuple(map(id, meta.values())),
           tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors),
           tuple(strides.items()), tuple(kw.items()),
           tuple(L._OPTIONS.items()), tuple(L._OVERRIDES.items()), L._KERNELS_KEY)
    hit = _CALLS.get(key)
    if hit is None:
        call = builder(*tensors, *(() if meta is None else (meta,)), strides=strides, **kw)
        # Builders put their tensor arguments first, in order (launch's module docstring).
        assert all(a is t for a, t in zip(call.args, tensors, strict=False))
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = hit = _Description(call, len(tensors), meta)
    return hit


def _run(desc: _Description, tensors: tuple, outputs: tuple, device_kind: str) -> None:
    """Launch ``desc`` with this call's ``tensors`` (same shapes/strides/dtypes/device as the
    description's) writing ``outputs``: directly into the compiled kernel when Triton has
    compiled it for these alignments and the tensors' device is current, else through
    :func:`_launch` (which compiles on a miss)."""
    if device_kind == "cuda":
        align = tuple(t.data_ptr() % 16 == 0 for t in (*tensors, *outputs))
        compiled = desc.compiled.get(align)
        device = outputs[0].device.index
        if (compiled is not None and _DIRECT_LAUNCH
                and torch.cuda.current_device() == device):
            # What triton.runtime.jit.JITFunction.run does after its cache lookup (Triton 3.6
            # and 3.9 alike): the bound argument values, constexprs included, in signature order.
            args = (*tensors, *desc.tail, *outputs, *desc.constexpr_values)
            stream = _current_stream(device)
            enter = triton.knobs.runtime.launch_enter_hook
            leave = triton.knobs.runtime.launch_exit_hook
            grid = desc.call.grid
            metadata = None if enter is None else compiled.launch_metadata(grid, stream, *args)
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                         compiled.packed_metadata, metadata, enter, leave, *args)
            return
        compiled = _launch(desc.with_tensors(tensors), outputs, device_kind)
        if compiled is not None:
            desc.compiled[align] = compiled
        return
    _launch(desc.with_tensors(tensors), outputs, device_kind)


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(q, k, v, layout, scale):
    kind = _device_kind(q)
    dtype = str(q.dtype).replace("torch.", "")
    b, h, n, d = q.shape
    out = _new_output(q.shape, q.dtype, q.device)
    lse = _new_output((b, h, n), _stats_dtype(q.dtype), q.device)
    meta = _metadata(layout, q, kind)
    cap = L.fwd_split_cap()
    if cap is not None:
        # Row splitting (private launch option): chunks into an fp32 scratch, then a merge.
        call = L.fwd_split_call(q, k, v, meta, scale=scale, dtype=dtype, device_kind=kind,
                                cap=cap, strides={"q": q.stride(), "k": k.stride(),
                                                  "v": v.stride()})
        scratch = tuple(_new_output(o.shape, _stats_dtype(q.dtype), q.device)
                        for o in call.outputs)
        _launch(call, scratch, kind)
        call = L.fwd_merge_call(*scratch, meta, cap=cap, dtype=dtype, device_kind=kind,
                                strides={"out": out.stride(), "lse": lse.stride()})
        _launch(call, (out, lse), kind)
        return out, lse
    desc = _described(L.fwd_call, (q, k, v), meta,
                      {"q": q.stride(), "k": k.stride(), "v": v.stride(), "out": out.stride(),
                       "lse": lse.stride()}, scale=scale, dtype=dtype, device_kind=kind)
    _run(desc, (q, k, v), (out, lse), kind)
    return out, lse


# Cold start: the backward's three kernels compile together in threads the first time a
# (device, launch config) is seen, instead of one after another at their first launches.
# Triton's compile spends much of its time outside the GIL (MLIR passes, ptxas): on a 2-core
# CPU the dQ, dK/dV and forward kernels (bf16, D=128, sm_90) took 5.4 s in a row and 3.5 s in
# three threads. Tests patch _PARALLEL_COMPILE to measure the difference.
_PARALLEL_COMPILE = True
_COMPILED_TOGETHER: set = set()


def _compile_together(launches, device_kind: str) -> None:
    """Compile (not run) the kernels of ``launches`` [(call, outputs)] in parallel threads,
    once per (device, kernel configs); later launches find them in Triton's cache."""
    if device_kind != "cuda" or not _PARALLEL_COMPILE:
        return
    device = launches[0][1][0].device
    key = (str(device), *((c.name, c.num_warps, c.num_stages, tuple(sorted(c.constexprs.items())))
                          for c, _ in launches))
    if key in _COMPILED_TOGETHER:
        return
    if os.environ.get("TRITON_CACHE_DIR", None) == "":  # see _launch
        del os.environ["TRITON_CACHE_DIR"]

    def warm(launch):
        call, outputs = launch
        with torch.cuda.device(device):  # Triton keys its kernel cache by the current device
            compiled = call.kernel.warmup(*call.args, *outputs, grid=call.grid,
                                          **call.constexprs, num_warps=call.num_warps,
                                          num_stages=call.num_stages)
            # Load the module and build the launcher now too (Triton does it lazily at the
            # first launch, one kernel after another). Private in Triton 3.6 and 3.9 alike;
            # without it the kernels are still compiled, only not loaded.
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()

    with ThreadPoolExecutor(len(launches)) as pool:
        list(pool.map(warm, launches))  # list(): re-raise a compile error here
    _COMPILED_TOGETHER.add(key)


def _backward(q, k, v, out, lse, d_out, d_lse, layout, scale):
    kind = _device_kind(q)
    dtype = str(q.dtype).replace("torch.", "")
    b, h, n, d = q.shape
    meta = _metadata(layout, q, kind)
    delta = _new_output((b, h, n), lse.dtype, q.device)
    pre = _described(L.bwd_preprocess_call, (out, d_out), None,
                     {"out": out.stride(), "d_out": d_out.stride(), "delta": delta.stride()},
                     block_size=int(meta["masks"].shape[1]), dtype=dtype, device_kind=kind)
    strides = {"q": q.stride(), "k": k.stride(), "v": v.stride(), "d_out": d_out.stride(),
               "lse": lse.stride()}
    dq = _new_output(q.shape, q.dtype, q.device)
    dk = _new_output(k.shape, k.dtype, k.device)
    dv = _new_output(v.shape, v.dtype, v.device)
    kw = dict(scale=scale, dtype=dtype, device_kind=kind)

    def grad_descriptions(ins):
        return ((_described(L.bwd_dq_call, ins, meta, {**strides, "dq": dq.stride()}, **kw),
                 (dq,)),
                (_described(L.bwd_dkdv_call, ins, meta,
                            {**strides, "dk": dk.stride(), "dv": dv.stride()}, **kw), (dk, dv)))

    ins = (q, k, v, d_out, lse, delta)
    grads = grad_descriptions(ins)
    if not (pre.compiled and all(desc.compiled for desc, _ in grads)):
        _compile_together(((pre.with_tensors((out, d_out)), (delta,)),
                           *((desc.with_tensors(ins), outs) for desc, outs in grads)), kind)
    _run(pre, (out, d_out), (delta,), kind)
    if d_lse is not None:
        # d lse_i / d s_ij = p_ij, so an LSE cotangent enters dS = P * (dP - Delta) as
        # Delta - d_lse. Rows with no key have P = 0, so their (possibly inf) entries are moot;
        # mask them so no inf - inf NaN ever reaches the kernels.
        delta = delta - torch.where(torch.isfinite(lse), d_lse.to(delta.dtype), 0.0)
        ins = (q, k, v, d_out, lse, delta)
        grads = grad_descriptions(ins)
    for desc, outs in grads:
        _run(desc, ins, outs, kind)
    return dq, dk, dv


class _SparseAttentionFn(torch.autograd.Function):
    """Forward: (q, k, v, layout, scale) -> (out, lse). Backward: (dq, dk, dv, None, None)."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale):
        out, lse = _forward(q, k, v, layout, scale)
        # An unused lse (return_lse=False) then reaches backward as None, not as a zeros tensor
        # that would cost three elementwise kernels per backward for nothing.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dk, dv = _backward(q, k, v, out, lse, d_out, d_lse, ctx.layout, ctx.scale)
        return dq, dk, dv, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                     *, scale: float | None = None, return_lse: bool = False):
    """Block-sparse attention ``softmax(q k^T * scale, masked by layout) v``.

    Args:
      q, k, v: ``[B, H, N, D]`` tensors of one dtype (float16, bfloat16, float32; float64 works
        too, mainly for gradcheck) on one device, any strides. Supported head dims ``D`` are
        16, 32, 64 and 128; any other ``D`` raises ``ValueError`` (above 128 the fp32
        accumulators would not fit in registers).
      layout: a :class:`BlockLayout` for ``seq_len=N``, ``num_heads=H``.
      scale: softmax scale, default ``D ** -0.5``.
      return_lse: also return the log-sum-exp ``[B, H, N]`` (float32; differentiable).

    Returns ``out`` (``[B, H, N, D]``, q's dtype), or ``(out, lse)``. Rows with no allowed key
    give 0 and ``-inf``. Differentiable in q, k, v (deterministic backward, no atomics).

    >>> import torch
    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.local(16, 0), seq_len=40, num_heads=1, block_size=16)
    >>> q = k = v = torch.randn(1, 1, 40, 32)
    >>> out, lse = sparse_attention(q, k, v, lay, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 1, 40, 32]), torch.Size([1, 1, 40]))
    """
    scale = _check_inputs(q, k, v, layout, scale)
    out, lse = _SparseAttentionFn.apply(q, k, v, layout, scale)
    return (out, lse) if return_lse else out


class SparseAttention(torch.nn.Module):
    """Block-sparse attention with a fixed pattern; layouts cached per (seq_len, num_heads).

    >>> import torch
    >>> from sparsetp.core import patterns as P
    >>> attn = SparseAttention(P.causal(), block_size=32)
    >>> q = k = v = torch.randn(2, 4, 64, 16)
    >>> attn(q, k, v).shape
    torch.Size([2, 4, 64, 16])
    """

    def __init__(self, pattern: Pattern, block_size: int = 64, scale: float | None = None):
        super().__init__()
        if not isinstance(pattern, Pattern):
            raise ValueError(f"pattern must be a sparsetp Pattern, got {type(pattern).__name__}")
        if block_size not in L.SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {L.SUPPORTED_BLOCK_SIZES}, got "
                             f"{block_size!r}")
        self.pattern = pattern
        self.block_size = block_size
        self.scale = scale
        self._layouts: dict[tuple[int, int], BlockLayout] = {}

    def layout(self, seq_len: int, num_heads: int) -> BlockLayout:
        key = (int(seq_len), int(num_heads))
        if key not in self._layouts:
            self._layouts[key] = make_layout(self.pattern, seq_len, num_heads, self.block_size)
        return self._layouts[key]

    def forward(self, q, k, v, return_lse: bool = False):
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError("q must be a [B, H, N, D] torch.Tensor")
        lay = self.layout(q.shape[2], q.shape[1])
        return sparse_attention(q, k, v, lay, scale=self.scale, return_lse=return_lse)

    def extra_repr(self):
        return f"pattern={self.pattern!r}, block_size={self.block_size}, scale={self.scale}"


# ----------------------------------------------------------------------------- baselines
def _naive_tables(layout: BlockLayout, device: torch.device):
    """Per layout: key-tile index [H, NT, W] and element mask [H, NT, bs, W*bs] (bool)."""
    per_layout = _NAIVE_CACHE.setdefault(layout, {})
    key = str(device)
    if key not in per_layout:
        bs, n = layout.block_size, layout.seq_len
        # Only the widest row's entries: gathering the ELL padding (widths are padded to a
        # multiple of 16 for the kernels' sake) would only slow this baseline down.
        h_n, nt, _ = layout.q_index.shape
        w = layout.widest_row
        q_index, q_mask_id = layout.q_index[..., :w], layout.q_mask_id[..., :w]
        words = layout.masks.astype("<i4").view(np.uint8)
        unpacked = np.unpackbits(words, axis=-1, bitorder="little")[..., :bs].astype(bool)
        e = np.arange(w)
        listed = e[None, None, :] < layout.q_count[..., None]          # [H, NT, W]
        partial = e[None, None, :] < layout.q_partial[..., None]
        elem = np.where(partial[..., None, None],
                        unpacked[np.maximum(q_mask_id, 0)],
                        listed[..., None, None])                       # [H, NT, W, bs, bs]
        cols = q_index[..., None] * bs + np.arange(bs)                 # [H, NT, W, bs]
        elem &= (cols < n)[..., None, :]
        elem = elem.transpose(0, 1, 3, 2, 4).reshape(h_n, nt, bs, w * bs)
        per_layout[key] = (torch.from_numpy(q_index.astype(np.int64)).to(device),
                           torch.from_numpy(np.ascontiguousarray(elem)).to(device))
    return per_layout[key]


def naive_sparse_attention(q, k, v, layout: BlockLayout, scale: float | None = None):
    """Block-sparse attention in plain PyTorch: gather listed key tiles, masked softmax, matmul.

    Memory is ``O(B * H * N * W * bs * D)`` for the gathered tiles (``W`` = widest row of the
    layout); differentiable through autograd. Returns ``out`` only.
    """
    scale = _check_inputs(q, k, v, layout, scale)
    b, h, n, d = q.shape
    bs = layout.block_size
    nt = -(-n // bs)
    pad = nt * bs - n
    index, elem = _naive_tables(layout, q.device)
    w = index.shape[-1]

    def tiles(t):
        return torch.nn.functional.pad(t, (0, 0, 0, pad)).reshape(b, h, nt, bs, d)

    qt, kt, vt = tiles(q), tiles(k), tiles(v)
    heads = torch.arange(h, device=q.device)[:, None, None]
    k_g = kt[:, heads, index].reshape(b, h, nt, w * bs, d)  # [B, H, NT, W*bs, D]
    v_g = vt[:, heads, index].reshape(b, h, nt, w * bs, d)
    s = torch.matmul(qt, k_g.transpose(-1, -2)).float() * scale  # [B, H, NT, bs, W*bs]
    s = s.masked_fill(~elem, float("-inf"))
    has_key = elem.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~has_key, 0.0), dim=-1)
    p = torch.where(has_key, p, 0.0)  # rows with no key: output 0, no gradient, no NaN
    out = torch.matmul(p.to(q.dtype), v_g)
    return out.reshape(b, h, nt * bs, d)[:, :, :n]


def dense_attention(q, k, v, layout: BlockLayout, scale: float | None = None):
    """``scaled_dot_product_attention`` with the layout's dense ``[H, N, N]`` mask.

    SDPA returns NaN for rows whose mask is all False; here those rows see every key inside
    SDPA and are then set to 0 (so forward and gradients stay finite: 0 output, 0 gradient).
    """
    scale = _check_inputs(q, k, v, layout, scale)
    mask = torch.from_numpy(layout.dense_mask()).to(q.device)  # [H, N, N], True = attend
    has_key = mask.any(-1, keepdim=True)                        # [H, N, 1]
    safe_mask = mask | ~has_key
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=safe_mask[None], scale=scale)
    return torch.where(has_key[None], out, torch.zeros((), dtype=out.dtype, device=out.device))

