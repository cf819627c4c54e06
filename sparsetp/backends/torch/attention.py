"""PyTorch frontend of block-sparse attention, plus two plain-PyTorch baselines.

* :func:`sparse_attention` - the Triton kernels behind one ``torch.autograd.Function``: compiled
  on CUDA tensors, the native CPU path (:mod:`sparsetp.backends.torch.cpu`, same layout
  metadata, same numbers) on CPU tensors, in one process (:mod:`sparsetp._runtime`; the
  launcher is :mod:`sparsetp.backends.torch.launch`; ``SPARSETP_INTERPRET=1`` runs the kernels
  in Triton's interpreter instead).
* :class:`SparseAttention` - an ``nn.Module`` holding a pattern and caching its layouts.
* :func:`naive_sparse_attention` - gather the listed tiles, softmax, scatter; autograd does the
  backward. The benchmark baseline for "block-sparse in plain PyTorch".
* :func:`dense_attention` - ``scaled_dot_product_attention`` with the layout's dense mask.

All take ``q`` of shape ``[B, H, N, D]``, ``k, v`` of shape ``[B, H_kv, N_kv, D]`` (``H_kv``
divides ``H``: grouped-query / multi-query attention, kv heads never repeated in memory; ``N_kv``
keys, ``N`` by default) and a :class:`~sparsetp.core.layout.BlockLayout` built for
``seq_len=N``, ``num_heads=H`` (query heads) and ``kv_len=N_kv``. A query row with no allowed
key gets output 0, LSE ``-inf`` and zero gradients, in every function here.

Example::

    >>> import torch
    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.causal(), seq_len=64, num_heads=2, block_size=32)
    >>> q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    >>> sparse_attention(q, k, v, lay).shape
    torch.Size([1, 2, 64, 16])
"""

from __future__ import annotations

import contextlib
import operator
import sys
import warnings
import weakref

import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad

from sparsetp import _runtime
from sparsetp.backends.torch import cpu as _cpu
from sparsetp.backends.torch import hopper as _hopper
from sparsetp.backends.torch import launch as _launch
from sparsetp.backends.torch import native as _native
from sparsetp.core.layout import (
    SUPPORTED_BLOCK_SIZES,
    BlockLayout,
    layout_from_handle,
    make_layout,
)
from sparsetp.core.patterns import Pattern
from sparsetp.kernels import abi
from sparsetp.kernels import options as _options

__all__ = ["sparse_attention", "SparseAttention", "pattern_attention", "cached_layout",
           "pattern_key", "PatternModule",
           "naive_sparse_attention", "dense_attention"]

_NAIVE_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- validation
def _check_inputs(q, k, v, layout, scale):
    """torch-specific checks (types, dtypes, devices); the shared ones live in launch."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if q.device.type == "meta":
        # Meta tensors have no data for the kernels to read (torch.compile's fake tensors
        # report their real device and take the registered fake implementation instead).
        raise ValueError("q is on the meta device; sparse_attention needs tensors with data "
                         "(cpu or cuda): materialise the module (e.g. to_empty + load) first")
    if q.dim() == 4 and not q.dtype.is_floating_point:
        raise ValueError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    scale = abi.check_attention_shapes(q.shape, k.shape, v.shape, layout, scale)
    abi.check_dtype(q.dtype)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    return scale


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return getattr(torch, abi.stats_dtype(dtype))


# ----------------------------------------------------------------------------- per-call plans
# Host time decides small-N calls (the GPU finishes first), so everything a call needs that
# depends only on the layout, q/k/v's shapes, strides, dtypes and devices, the scale and the
# launch options is checked and built once per such key: a repeated call looks its plan up and
# launches. Plans hang off the layout (weak keys), so a dropped layout frees them.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLANS_PER_LAYOUT = 64


class _Plan:
    """A checked call: the resolved ``scale``, the path ``kind``, and on the kernel paths the
    layout's device metadata and the launch descriptions (forward; backward per ``d_out``
    strides). Holds no reference to the layout (the cache's weak key) or to any tensor but the
    metadata."""

    __slots__ = ("scale", "kind", "meta", "fwd", "bwd", "native", "native_failed", "fwd_choice",
                 "bwd_choice", "sm90")

    def __init__(self, q, k, v, layout, scale: float):
        self.scale, self.kind = scale, _launch.device_kind(q)
        self.meta = None if self.kind == "cpu" else _launch.metadata(layout, q, self.kind)
        self.fwd = None
        # The forward and backward kernels (sparsetp.kernels.hopper.forward_choice,
        # backward_choice) and, where either is the sm_90 one, its launch state.
        self.fwd_choice, self.bwd_choice, lay128 = _hopper.choose(q, k, v, layout, self.kind,
                                                                  scale)
        self.sm90 = None if lay128 is None else _hopper.Sm90Kernels(q, k, lay128, scale)
        self.bwd: dict = {}
        # (the C++ call, its plan) once this key's kernels are compiled and the extension is
        # ready (:mod:`sparsetp.backends.torch.native`); None until then.
        self.native = None
        self.native_failed = False

    def forward(self, q, k, v, layout):
        kind, scale = self.kind, self.scale
        if kind == "cpu":
            # The native path picks its own precision (fp32 accumulation); an enclosing
            # autocast would recast its matmuls (and differently in eager and compiled graphs).
            with torch.autocast("cpu", enabled=False):
                return _cpu.forward(q, k, v, layout, scale, new_output=_launch.new_output)
        b, h, n, _ = q.shape
        out = _launch.new_output(q.shape, q.dtype, q.device)
        lse = _launch.new_output((b, h, n), _stats_dtype(q.dtype), q.device)
        sm90 = self.fwd_choice.name == "hopper"
        if sm90 and not _hopper.aligned(q, k, v, out, lse):
            # Alignment is per call (not in the plan's key): this call runs portable.
            if _options.current().fwd_kernel == "hopper":
                raise ValueError("LaunchOptions.fwd_kernel='hopper' cannot run this call: "
                                 + _hopper.MISALIGNED.reason)
        elif sm90:
            try:
                self.sm90.run(q, k, v, out, lse)
                return out, lse
            except Exception as exc:  # noqa: BLE001 (any compile or launch failure falls back)
                self.fwd_choice = _hopper.failed(exc)
                self.native = None  # rebuilt from the portable forward by the next backward
                warnings.warn(f"sparsetp: the sm_90 forward failed ({type(exc).__name__}: "
                              f"{exc}); this call and its plan run the portable forward",
                              RuntimeWarning, stacklevel=2)
        if self.fwd is None:
            self.fwd = _launch.describe(
                abi.fwd_call, (q, k, v), self.meta,
                {"q": q.stride(), "k": k.stride(), "v": v.stride(), "out": out.stride(),
                 "lse": lse.stride()},
                scale=scale, dtype=abi.check_dtype(q.dtype), device_kind=kind)
        _launch.run(self.fwd, (q, k, v), (out, lse), kind)
        return out, lse

    def backward(self, q, k, v, out, lse, d_out, d_lse, layout):
        kind, scale = self.kind, self.scale
        if kind == "cpu":
            with torch.autocast("cpu", enabled=False):  # as in forward
                return _cpu.backward(q, k, v, out, lse, d_out, d_lse, layout, scale,
                                     new_output=_launch.new_output)
        if not lse.is_contiguous():  # the kernels write delta with lse's strides
            lse = lse.contiguous()
        delta = _launch.new_output(lse.shape, lse.dtype, q.device)
        dq = _launch.new_output(q.shape, q.dtype, q.device)
        dk = _launch.new_output(k.shape, k.dtype, k.device)
        dv = _launch.new_output(v.shape, v.dtype, v.device)
        # q, k and v too: saved-tensor hooks (save_on_cpu) may give them back in other strides
        key = (q.stride(), k.stride(), v.stride(), d_out.stride(), out.stride(), lse.stride(),
               None if d_lse is None else d_lse.stride())
        sm90 = self.bwd_choice.name == "hopper"
        per_call_fallback = False
        if sm90:
            # The TMA boxes read 16-byte aligned [rows, D] views: copy what is not (a block's
            # transposed output gradient usually is not; the copy is small beside the kernels).
            out, d_out, lse = (_hopper.tma_ready(t) for t in (out, d_out, lse))
            d_lse = None if d_lse is None else _hopper.tma_ready(d_lse)
            if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
                    and _hopper.aligned(q, k, v)):  # the plan's key fixes their strides only
                if _options.current().bwd_kernel == "hopper":
                    raise ValueError("LaunchOptions.bwd_kernel='hopper' cannot run this call: "
                                     "q, k or v is not a contiguous tensor on a 16-byte "
                                     "boundary (TMA descriptors need it)")
                sm90 = False
                per_call_fallback = True  # not the plan's kernels: no native plan from it
            key = (q.stride(), k.stride(), v.stride(), d_out.stride(), out.stride(),
                   lse.stride(), None if d_lse is None else d_lse.stride())

        def portable():
            """The portable dQ and dK/dV descriptions (built, and their kernels compiled, on
            their first use: a plan whose sm_90 passes run never needs them)."""
            descs = self.bwd.get(key)
            if descs is None:
                descs = self.bwd[key] = self._backward_descriptions(
                    q, k, v, out, lse, d_out, d_lse, delta, dq, dk, dv)
            return descs

        descs = None
        # dQ also writes delta = rowsum(dO * O) - d_lse, which dK/dV reads.
        if sm90:
            sm90 = self._sm90_pass("dQ pass", self.sm90.dq, q, k, v, out, lse, d_out, d_lse,
                                   dq, delta)
        if not sm90:
            descs = portable()
            _launch.run(descs[0], (q, k, v, d_out, lse, out, lse if d_lse is None else d_lse),
                        (dq, delta), kind)
        if not (sm90 and self._sm90_pass("dK/dV pass", self.sm90.dkdv, q, k, v, lse, delta,
                                         d_out, dk, dv)):
            sm90_dq, sm90 = sm90, False
            descs = portable()
            _launch.run(descs[1], (q, k, v, d_out, lse, delta), (dk, dv), kind)
            if sm90_dq:  # this call mixed the paths (a failed sm_90 pass): no native plan yet
                return dq, dk, dv
        if self.native is None and kind == "cuda" and d_lse is None and not per_call_fallback:
            self._make_native(q, k, v, out, lse, d_out, None if sm90 else descs)
        return dq, dk, dv

    def _sm90_pass(self, what: str, launch, *tensors) -> bool:
        """Launch an sm_90 backward pass; False (the plan's backward turned portable, with a
        warning) if it fails to compile or launch. Each pass writes only its own outputs, so
        the portable pass that follows recomputes them from the same inputs."""
        try:
            launch(*tensors)
            return True
        except Exception as exc:  # noqa: BLE001 (any compile or launch failure falls back)
            self.bwd_choice = _hopper.failed(exc, what)
            self.native = None  # rebuilt from the portable passes by the next backward
            warnings.warn(f"sparsetp: the sm_90 {what} failed ({type(exc).__name__}: {exc}); "
                          "this call and its plan run the portable backward", RuntimeWarning,
                          stacklevel=3)
            return False

    def _make_native(self, q, k, v, out, lse, d_out, descs) -> None:
        """Hand this key's compiled kernels to the C++ extension, once it is built (a build
        starts in the background on the first call here): the backward passes this call ran
        (``descs``: the portable dQ and dK/dV descriptions, None: the sm_90 passes) and the
        plan's forward. The portable kernels were compiled for ``d_out``'s strides, so they are
        kept to output gradients with distinct elements; the sm_90 ones read a contiguous
        ``d_out`` (as ``tma_ready`` makes it here). The native backward copies any other
        gradient to the planned strides."""
        sm90_fwd = self.fwd_choice.name == "hopper"
        if (self.native_failed
                or not _options.current().native_autograd
                or not _launch.direct_launch_enabled()
                or (descs is not None and not _distinct_dense(d_out))
                # no forward of this plan has compiled yet (``_backward`` called alone)
                or (self.sm90.compiled.get("fwd") if sm90_fwd else self.fwd) is None):
            return
        module = _native.load()
        if module is None:
            return
        try:
            fwd = (self._native_sm90(module, "fwd", q, k) if sm90_fwd
                   else _native.portable_kernel(module, self.fwd))
            if fwd is None:  # compiled for other alignments only: no plan yet
                return
            if descs is None:
                bwd = [self._native_sm90(module, name, q, k) for name in ("dq", "dkdv")]
            else:
                bwd = [_native.portable_kernel(module, d) for d in descs]
            keep = [t for d in (self.fwd, *(descs or ())) if d is not None for t in d.tail
                    if isinstance(t, torch.Tensor)]
            if self.sm90 is not None:
                keep += [a for launch in self.sm90.launches.values() for a in launch.args
                         if isinstance(a, torch.Tensor)]
            plan = _native.make_plan(module, fwd, *bwd,
                                     lse_double=_stats_dtype(q.dtype) == torch.float64,
                                     d_out_strides=d_out.stride(),
                                     saved_strides=[t.stride() for t in (q, k, v, out, lse)],
                                     keep=keep)
        # Any failure (a kernel C++ cannot pass) is said once: this call's gradients are done.
        except Exception as exc:  # noqa: BLE001
            self.native_failed = True
            warnings.warn(f"sparsetp: this attention call keeps the Python autograd path: "
                          f"{exc}", RuntimeWarning, stacklevel=2)
            return
        if plan is not None:
            self.native = (module.attention, plan)

    def _native_sm90(self, module, name: str, q, k):
        """The C++ kernel of sm_90 launch ``name`` ("fwd", "dq", "dkdv"), or None before it
        has compiled (its first launch)."""
        compiled = self.sm90.compiled.get(name)
        if compiled is None:
            return None
        d = q.shape[-1]
        n_q, n_k = q.numel() // d, k.numel() // d
        rows = {"q": n_q, "d_out": n_q, "out": n_q, "dq": n_q, "k": n_k, "v": n_k, "dk": n_k,
                "dv": n_k}
        return _native.sm90_kernel(module, name, self.sm90.launches[name], compiled, rows, d)

    def _backward_descriptions(self, q, k, v, out, lse, d_out, d_lse, delta, dq, dk, dv):
        """The dQ and dK/dV descriptions, their kernels compiled together (in threads) on their
        first use."""
        kind, meta = self.kind, self.meta
        kw = dict(scale=self.scale, dtype=abi.check_dtype(q.dtype), device_kind=kind)
        strides = {"q": q.stride(), "k": k.stride(), "v": v.stride(), "d_out": d_out.stride(),
                   "lse": lse.stride()}
        dq_ins = (q, k, v, d_out, lse, out, lse if d_lse is None else d_lse)
        dq_desc = _launch.describe(
            _dq_call_without_dlse if d_lse is None else abi.bwd_dq_call, dq_ins, meta,
            {**strides, "out": out.stride(), "dq": dq.stride(),
             **({} if d_lse is None else {"d_lse": d_lse.stride()})}, **kw)
        dkdv_ins = (q, k, v, d_out, lse, delta)
        dkdv_desc = _launch.describe(abi.bwd_dkdv_call, dkdv_ins, meta,
                                     {**strides, "dk": dk.stride(), "dv": dv.stride()}, **kw)
        if not (dq_desc.compiled and dkdv_desc.compiled):
            _launch.compile_together(((dq_desc.with_tensors(dq_ins), (dq, delta)),
                                      (dkdv_desc.with_tensors(dkdv_ins), (dk, dv))), kind)
        return dq_desc, dkdv_desc


def _distinct_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span once each, in some dimension order."""
    expect = 1
    for i in sorted(range(t.dim()), key=t.stride):
        if t.size(i) != 1 and t.stride(i) != expect:
            return False
        expect *= t.size(i)
    return True


def _native_ready(q, k, v) -> bool:
    """Per-call conditions of the native path that a plan's key does not fix: the 16-byte
    alignment its kernels were compiled for, the current device (where the kernels were
    loaded), no Triton launch hook (a profiler would not see C++ launches), no compiled
    autograd (a C++ node has no support for it) and no ``torch.jit.trace`` (it cannot see the
    call)."""
    return (q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
            and torch.cuda.current_device() == q.device.index
            and _launch._launch_hooks() is None
            # a C++ node has no compiled-autograd support, and the tracer cannot see the call
            and not _compiled_autograd_on() and not torch.jit.is_tracing())


def _compiled_autograd_on() -> bool:
    """Whether compiled autograd is on (checked at forward time; it could still be switched on
    between a forward and its backward)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")  # imported only once used
    config = sys.modules.get("torch._dynamo.config")
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False)
                                   or getattr(config, "compiled_autograd", False))


def _dq_call_without_dlse(q, k, v, d_out, lse, out, lse_again, meta, **kw):
    """``abi.bwd_dq_call`` with no LSE cotangent, taking the tensors as launched (lse fills the
    cotangent's slot, so a cached description's tensors are the call's leading arguments)."""
    return abi.bwd_dq_call(q, k, v, d_out, lse, out, None, meta, **kw)


def _plan(q, k, v, layout, scale) -> _Plan:
    """The plan of this call, checked (:func:`_check_inputs`) and built on its key's first use.
    The key holds everything the checks read, so a hit needs no check: bad inputs miss and
    raise there."""
    try:
        key = (scale, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
               k.device, v.shape, v.stride(), v.dtype, v.device, _options.current().key(),
               _runtime.force_interpreter())
        plans = _PLANS.get(layout)
    except (AttributeError, TypeError):  # not tensors / not a layout: the checks name them
        key = plans = None
    plan = None if plans is None else plans.get(key)
    if plan is None:
        plan = _Plan(q, k, v, layout, _check_inputs(q, k, v, layout, scale))
        if key is not None:
            plans = _PLANS.setdefault(layout, {})
            if len(plans) >= _PLANS_PER_LAYOUT:
                plans.clear()
            plans[key] = plan
    return plan


def _forward(q, k, v, layout, scale):
    """``(out, lse)``: checks, then the forward on q's path (the plan's)."""
    return _plan(q, k, v, layout, scale).forward(q, k, v, layout)


def _backward(q, k, v, out, lse, d_out, d_lse, layout, scale):
    """``(dq, dk, dv)`` of the forward with these inputs (see :meth:`_Plan.backward`)."""
    return _plan(q, k, v, layout, scale).backward(q, k, v, out, lse, d_out, d_lse, layout)


class _SparseAttentionFn(torch.autograd.Function):
    """Forward: (q, k, v, layout, plan) -> (out, lse). Backward: (dq, dk, dv, None, None).

    The eager path: cheaper per call than the registered operator below, whose dispatch
    costs host time that matters at small N."""

    @staticmethod
    def forward(ctx, q, k, v, layout, plan):
        out, lse = plan.forward(q, k, v, layout)
        # An unused lse (return_lse=False) then reaches backward as None, not as a zeros tensor
        # that would cost three elementwise kernels per backward for nothing.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.plan = layout, plan
        ctx.options = _options.current()  # the backward launches as the forward did
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        if torch.is_grad_enabled():  # the kernels' gradients have no graph of their own
            raise RuntimeError("sparse_attention has no double backward (create_graph=True)")
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        # The forward's options (usually still current: then no generator-based context).
        same = ctx.options is _options.current()
        with contextlib.nullcontext() if same else _options.using(ctx.options):
            dq, dk, dv = ctx.plan.backward(q, k, v, out, lse, d_out, d_lse, ctx.layout)
        return dq, dk, dv, None, None


# ----------------------------------------------------------------------------- torch operators
# The same forward and backward as registered operators, for torch.compile: a traced graph
# holds the layout as its string handle (core.layout.layout_from_handle) and never traces into
# the launcher. A layout a graph was traced with stays referenced here, so a compiled backward
# never outlives it.
_TRACED_LAYOUTS: dict[str, BlockLayout] = {}
_LAYOUTS: dict = {}
_LAYOUTS_MAX = 256


def _traced_layout(handle: str) -> BlockLayout:
    layout = _TRACED_LAYOUTS.get(handle)
    if layout is None:
        layout = _TRACED_LAYOUTS[handle] = layout_from_handle(handle)
    return layout


def cached_layout(pattern: Pattern, seq_len: int, num_heads: int, block_size: int,
                  heads: tuple[int, int] | None = None, *,
                  kv_len: int | None = None) -> BlockLayout:
    """``make_layout(pattern, seq_len, num_heads, block_size, kv_len=kv_len)``, or its
    ``.heads(*heads)``, cached per value: modules with equal patterns share one layout (and its
    device metadata).

    >>> from sparsetp.core import patterns as P
    >>> cached_layout(P.causal(), 64, 2, 32) is cached_layout(P.causal(), 64, 2, 32)
    True
    """
    kv_len = seq_len if kv_len is None else kv_len
    key = (pattern, int(seq_len), int(num_heads), int(block_size), heads, int(kv_len))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if heads is None:
            layout = make_layout(pattern, seq_len, num_heads, block_size, kv_len=kv_len)
        else:
            layout = cached_layout(pattern, seq_len, num_heads, block_size,
                                   kv_len=kv_len).heads(*heads)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


_PATTERN_KEYS: dict[Pattern, str] = {}
_PATTERNS: dict[str, Pattern] = {}


def pattern_key(pattern: Pattern) -> str:
    """A string naming ``pattern`` (equal patterns share one), for code that torch.compile
    traces: a string is a constant there on every torch version, a pattern object is not.

    >>> from sparsetp.core import patterns as P
    >>> pattern_key(P.causal()) == pattern_key(P.causal())
    True
    """
    key = _PATTERN_KEYS.get(pattern)
    if key is None:
        key = _PATTERN_KEYS[pattern] = f"pattern-{len(_PATTERN_KEYS)}"
        _PATTERNS[key] = pattern
    return key


def _as_pattern(pattern: Pattern | str) -> Pattern:
    return _PATTERNS[pattern] if isinstance(pattern, str) else pattern


@torch.compiler.assume_constant_result
def _traced_layout_handle(pattern, seq_len, num_heads, block_size, heads, kv_len) -> str:
    """The handle of :func:`cached_layout`'s layout, as a constant of the traced graph (the
    layout is built at trace time, outside the graph, and kept for the graph's lifetime)."""
    layout = cached_layout(_as_pattern(pattern), seq_len, num_heads, block_size, heads,
                           kv_len=kv_len)
    _TRACED_LAYOUTS[layout.handle] = layout
    return layout.handle


@torch.compiler.assume_constant_result
def _traced_batch(pattern) -> int:
    """``pattern.batch`` (0 when shared by every row), a constant of the traced graph."""
    return _as_pattern(pattern).batch or 0


@torch.library.custom_op("sparsetp::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, _traced_layout(layout), scale)


@_attention_op.register_fake
def _(q, k, v, layout, scale):
    _check_inputs(q, k, v, _traced_layout(layout), scale)
    b, h, n, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, n), dtype=_stats_dtype(q.dtype))


@torch.library.custom_op("sparsetp::attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, d_out: torch.Tensor,
                           d_lse: torch.Tensor | None, layout: str, scale: float,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(q, k, v, out, lse, d_out.contiguous(), d_lse, _traced_layout(layout),
                     scale)


@_attention_backward_op.register_fake
def _(q, k, v, out, lse, d_out, d_lse, layout, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, layout, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.layout, ctx.scale = layout, scale


def _backward_rule(ctx, d_out, d_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(q, k, v, out, lse, d_out, d_lse, ctx.layout,
                                        ctx.scale)
    return dq, dk, dv, None, None


_attention_op.register_autograd(_backward_rule, setup_context=_setup_context)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                     *, scale: float | None = None, return_lse: bool = False,
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention ``softmax(q k^T * scale, masked by layout) v``.

    Args:
      q: ``[B, H, N, D]``; k, v: ``[B, H_kv, N_kv, D]`` with ``H % H_kv == 0`` (GQA/MQA:
        query head ``h`` attends with kv head ``h // (H // H_kv)``; dk, dv sum over the group,
        deterministically). One dtype (float16, bfloat16, float32; float64 works too, mainly
        for gradcheck), one device, any strides. Supported head dims ``D``: the multiples of
        16 from 16 to 256; others raise ``ValueError``.
      layout: a :class:`BlockLayout` for ``seq_len=N``, ``num_heads=H`` and ``kv_len=N_kv``
        (``make_layout(..., kv_len=N_kv)`` when ``N_kv != N``: causal and local patterns are
        then aligned to the end of the keys).
      scale: softmax scale, default ``D ** -0.5``: a real number, finite in float32 (NaN and
        inf raise ValueError); zero and negative scales are allowed and exact.
      return_lse: also return the log-sum-exp ``[B, H, N]`` (float32; differentiable).

    Bad inputs raise ValueError naming the argument (shapes, dtypes, devices, including the
    meta device, a layout for another geometry or with tables edited after ``make_layout``).

    Returns ``out`` (``[B, H, N, D]``, q's dtype), or ``(out, lse)``. Rows with no allowed key
    give 0 and ``-inf``. Differentiable in q, k, v (deterministic backward, no atomics).

    Under ``torch.autocast`` float32 inputs run in the autocast dtype, as
    ``scaled_dot_product_attention`` does. Under ``torch.compile`` the call is the operator
    ``torch.ops.sparsetp.attention`` (and its backward ``sparsetp.attention_backward``), so
    ``fullgraph=True`` traces it with no graph break; the layout must stay alive while the
    compiled function is in use.

    >>> import torch
    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.local(16, 0), seq_len=40, num_heads=1, block_size=16)
    >>> q = k = v = torch.randn(1, 1, 40, 32)
    >>> out, lse = sparse_attention(q, k, v, lay, return_lse=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 1, 40, 32]), torch.Size([1, 1, 40]))

    Grouped-query attention, 8 query heads sharing 2 kv heads, 16 new queries after 48 cached
    keys (``kv_len=64``)::

    >>> lay = make_layout(P.causal(), seq_len=16, num_heads=8, block_size=16, kv_len=64)
    >>> q, k, v = torch.randn(1, 8, 16, 32), torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)
    >>> sparse_attention(q, k, v, lay).shape
    torch.Size([1, 8, 16, 32])

    Per-row documents: a layout with ``batch = B`` (``P.documents`` with one list of lengths per
    batch row, or ``P.per_batch_row``) gives each row its own mask in one call; B must equal
    ``layout.batch``. Batch is folded into heads for the launch (``[B, H, N, D]`` ->
    ``[1, B * H, N, D]``, a view when ``stride(0) == H * stride(1)``, else a copy)::

    >>> lay = make_layout(P.documents([[10, 22], [32]]) & P.causal(), 32, 2, 16)
    >>> q = k = v = torch.randn(2, 2, 32, 16)
    >>> sparse_attention(q, k, v, lay).shape
    torch.Size([2, 2, 32, 16])
    """
    if getattr(layout, "batch", None) is not None:
        return _per_row_attention(q, k, v, layout, scale, return_lse)
    if torch.compiler.is_compiling():
        out, lse = _traced_attention(q, k, v, layout.handle, scale)
    else:
        q, k, v = _autocast(q, k, v)
        plan = _plan(q, k, v, layout, scale)
        # Under a forward-AD level the Function runs even without requires_grad: it refuses
        # tangents (no jvp), which the plain forward would drop silently.
        grad = (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                             or v.requires_grad)
                or getattr(_forward_ad, "_current_level", -1) >= 0)  # private in torch
        native = plan.native
        if native is not None and not (grad and return_lse) and _native_ready(q, k, v):
            out, lse = native[0](q, k, v, native[1])  # C++ node and launches, same kernels
        elif grad:
            out, lse = _SparseAttentionFn.apply(q, k, v, layout, plan)
        else:  # nothing to differentiate: the autograd Function's own host cost is saved
            out, lse = plan.forward(q, k, v, layout)
    return (out, lse) if return_lse else out


def forward_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                   *, scale: float | None = None) -> _hopper.hopper.KernelChoice:
    """Which forward kernel :func:`sparse_attention` runs for these arguments, and why.

    ``"hopper"``: the sm_90 Gluon forward (:mod:`sparsetp.kernels.hopper`), taken where it is
    eligible and measured faster; ``"portable"``: the portable Triton kernel (or the native CPU
    path on CPU tensors). Change it with ``LaunchOptions.fwd_kernel``
    (``sparsetp.kernels.options.launch_options(fwd_kernel="portable")``). The backward's
    kernels: :func:`backward_kernel`. Checks the arguments as :func:`sparse_attention` does.

    >>> import torch
    >>> from sparsetp.core import patterns as P, make_layout
    >>> q = torch.randn(1, 2, 64, 32)
    >>> forward_kernel(q, q, q, make_layout(P.causal(), 64, 2, 32)).name
    'portable'
    """
    return _choice(q, k, v, layout, scale, "fwd_choice")


def backward_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                    *, scale: float | None = None) -> _hopper.hopper.KernelChoice:
    """Which kernels run :func:`sparse_attention`'s backward for these arguments, and why.

    ``"hopper"``: the sm_90 Gluon dQ and dK/dV passes
    (:func:`sparsetp.kernels.hopper.backward_choice`), by the forward's eligibility and rule;
    ``"portable"``: the portable Triton kernels (or the native CPU path). Change it with
    ``LaunchOptions.bwd_kernel``. Checks the arguments as :func:`sparse_attention` does.

    >>> import torch
    >>> from sparsetp.core import patterns as P, make_layout
    >>> q = torch.randn(1, 2, 64, 32)
    >>> backward_kernel(q, q, q, make_layout(P.causal(), 64, 2, 32)).name
    'portable'
    """
    return _choice(q, k, v, layout, scale, "bwd_choice")


def _choice(q, k, v, layout, scale, which: str) -> _hopper.hopper.KernelChoice:
    """The plan's ``which`` ("fwd_choice" / "bwd_choice") for these arguments, with the
    per-call alignment rule."""
    if getattr(layout, "batch", None) is not None:
        _check_per_row(q, k, v, layout, scale)
        q, k, v, layout = _fold(q), _fold(k), _fold(v), layout.flat()
    q, k, v = _autocast(q, k, v)
    choice = getattr(_plan(q, k, v, layout, scale), which)
    if choice.name == "hopper" and not _hopper.aligned(q, k, v):
        return _hopper.MISALIGNED
    return choice


def _fold(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` -> ``[1, B * H, N, D]``: batch row ``b``'s head ``h`` becomes head
    ``b * H + h``, the table head a per-row layout gives it (GQA folds alike)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


@torch.compiler.assume_constant_result
def _flat_handle(handle: str) -> str:
    """The handle of the flat layout (:meth:`BlockLayout.flat`) of the layout ``handle``, a
    constant of the traced graph; the flat layout is kept for the graph's lifetime."""
    flat = layout_from_handle(handle).flat()
    _TRACED_LAYOUTS[flat.handle] = flat
    return flat.handle


# Per per-row layout, the (shapes, dtypes, devices, scale) keys already checked as given: the
# folded call's plan caches everything else, so a repeated call costs no check (host time).
_PER_ROW_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_per_row(q, k, v, layout, scale) -> None:
    """:func:`_check_inputs` on the call as given (B = ``layout.batch``), once per key."""
    try:
        key = (scale, q.shape, q.dtype, q.device, k.shape, k.dtype, k.device, v.shape,
               v.dtype, v.device)
        seen = _PER_ROW_CHECKED.setdefault(layout, set())
    except (AttributeError, TypeError):  # not tensors / not a layout: the checks name them
        key = seen = None
    if seen is None or key not in seen:
        _check_inputs(q, k, v, layout, scale)
        if seen is not None:
            if len(seen) >= _PLANS_PER_LAYOUT:
                seen.clear()
            seen.add(key)


def _per_row_attention(q, k, v, layout, scale, return_lse):
    """:func:`sparse_attention` with a per-row layout: checked as given (B = rows), then run
    on batch folded into heads with the layout's flat view, and unfolded."""
    if torch.compiler.is_compiling():
        out, lse = _traced_attention(_fold(q), _fold(k), _fold(v), _flat_handle(layout.handle),
                                     scale)
    else:
        _check_per_row(q, k, v, layout, scale)
        res = sparse_attention(_fold(q), _fold(k), _fold(v), layout.flat(), scale=scale,
                               return_lse=return_lse)  # no LSE asked: the native path may run
        out, lse = res if return_lse else (res, None)
    out = out.reshape(q.shape)
    return (out, lse.reshape(q.shape[:3])) if return_lse else out


def _traced_attention(q, k, v, handle: str, scale: float | None):
    """``(out, lse)`` under torch.compile: the registered operator on the layout named by
    ``handle`` (its fake implementation runs :func:`_check_inputs` while tracing)."""
    q, k, v = _autocast(q, k, v)
    return _attention_op(q, k, v, handle, q.shape[-1] ** -0.5 if scale is None else scale)


def pattern_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      pattern: Pattern | str, block_size: int, *, scale: float | None = None,
                      num_heads: int | None = None,
                      heads: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`sparse_attention` with the layout of ``pattern`` for q's and k's lengths (from
    :func:`cached_layout`), what the modules call: eager calls look the layout up, and under
    ``torch.compile`` it is built while tracing and enters the graph as a constant.
    ``num_heads``/``heads``: the whole layout's head count and the slice ``q`` holds (tensor
    parallelism); default ``q``'s heads. ``pattern`` may be its :func:`pattern_key`, what
    compiled modules pass (some torch versions cannot trace a pattern object)."""
    # operator.index, not int(): under torch.compile it specializes a symbolic length to the
    # constant the layout needs (with a guard), where int() would keep it symbolic.
    n, kv_len = operator.index(q.shape[2]), operator.index(k.shape[2])
    num_heads = operator.index(q.shape[1]) if num_heads is None else num_heads
    if torch.compiler.is_compiling():
        handle = _traced_layout_handle(pattern, n, num_heads, block_size, heads, kv_len)
        if _traced_batch(pattern):  # a per-row layout: batch folded into heads
            return _traced_attention(_fold(q), _fold(k), _fold(v), _flat_handle(handle),
                                     scale)[0].reshape(q.shape)
        return _traced_attention(q, k, v, handle, scale)[0]
    layout = cached_layout(_as_pattern(pattern), n, num_heads, block_size, heads, kv_len=kv_len)
    return sparse_attention(q, k, v, layout, scale=scale)


class PatternModule(torch.nn.Module):
    """Base of the modules that attend with a fixed ``pattern``: setting it also records its
    :func:`pattern_key`, which their compiled forward passes instead of the object."""

    @property
    def pattern(self) -> Pattern:
        return self._pattern

    @pattern.setter
    def pattern(self, value: Pattern) -> None:
        if not isinstance(value, Pattern):
            raise ValueError(f"pattern must be a sparsetp Pattern, got {type(value).__name__}")
        self._pattern = value
        self._pattern_key = pattern_key(value)


def _autocast(q, k, v):
    """q, k, v in the autocast dtype where autocast is on for their device (float32 only, as
    autocast casts for matmul-like ops)."""
    if not isinstance(q, torch.Tensor):
        return q, k, v
    device = q.device.type
    if device == "meta":  # no autocast there; _check_inputs refuses it by name
        return q, k, v
    if not torch.is_autocast_enabled(device) or q.dtype != torch.float32:
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                 else t for t in (q, k, v))


class SparseAttention(PatternModule):
    """Block-sparse attention with a fixed pattern; layouts cached per (seq_len, num_heads,
    kv_len) (``kv_len`` from k, which may also have fewer heads: GQA).

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
        # Type first: 64.0 == 64 would pass the membership test.
        if (isinstance(block_size, bool) or not isinstance(block_size, int)
                or block_size not in SUPPORTED_BLOCK_SIZES):
            raise ValueError(f"block_size must be an int, one of {SUPPORTED_BLOCK_SIZES}, got "
                             f"{block_size!r}")
        abi.check_scale(scale)  # at construction, not at the first call
        self.pattern = pattern
        self.block_size = block_size
        self.scale = scale

    def layout(self, seq_len: int, num_heads: int, kv_len: int | None = None) -> BlockLayout:
        """The pattern's layout for ``seq_len`` queries, ``num_heads`` query heads and
        ``kv_len`` keys (default ``seq_len``), cached."""
        return cached_layout(self.pattern, seq_len, num_heads, self.block_size, kv_len=kv_len)

    def forward(self, q, k, v, return_lse: bool = False):
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError("q must be a [B, H, N, D] torch.Tensor")
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise ValueError("k must be a [B, H_kv, N_kv, D] torch.Tensor")
        if return_lse:
            lay = self.layout(q.shape[2], q.shape[1], k.shape[2])
            return sparse_attention(q, k, v, lay, scale=self.scale, return_lse=True)
        return pattern_attention(q, k, v, self._pattern_key, self.block_size, scale=self.scale)

    def extra_repr(self) -> str:
        return f"pattern={self.pattern!r}, block_size={self.block_size}, scale={self.scale}"


# ----------------------------------------------------------------------------- baselines
def _naive_tables(layout: BlockLayout, device: torch.device):
    """Per layout: key-tile index [H, NT, W] and element mask [H, NT, bs, W*bs] (bool)."""
    per_layout = _NAIVE_CACHE.setdefault(layout, {})
    key = str(device)
    if key not in per_layout:
        bs, n = layout.block_size, layout.kv_len
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


def naive_sparse_attention(q, k, v, layout: BlockLayout,
                           scale: float | None = None) -> torch.Tensor:
    """Block-sparse attention in plain PyTorch: gather listed key tiles, masked softmax, matmul.

    Memory is ``O(B * H * N * W * bs * D)`` for the gathered tiles (``W`` = widest row of the
    layout); differentiable through autograd. Returns ``out`` only. A per-batch-row layout
    runs on batch folded into heads, as :func:`sparse_attention` does.
    """
    scale = _check_inputs(q, k, v, layout, scale)
    if layout.batch is not None:
        return naive_sparse_attention(_fold(q), _fold(k), _fold(v), layout.flat(),
                                      scale).reshape(q.shape)
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    b, h, n, d = q.shape
    bs = layout.block_size
    nt = -(-n // bs)
    index, elem = _naive_tables(layout, q.device)
    w = index.shape[-1]

    def tiles(t):
        t_n = -(-t.shape[2] // bs)
        return torch.nn.functional.pad(t, (0, 0, 0, t_n * bs - t.shape[2])).reshape(
            b, h, t_n, bs, d)

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


def _repeat_kv(q, t):
    """The baselines' GQA: kv heads repeated to q's head count (the kernels never do this)."""
    group = q.shape[1] // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def dense_attention(q, k, v, layout: BlockLayout, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the layout's dense ``[H, N, N_kv]`` mask.

    SDPA returns NaN for rows whose mask is all False; here those rows see every key inside
    SDPA and are then set to 0 (so forward and gradients stay finite: 0 output, 0 gradient).
    A per-batch-row layout runs on batch folded into heads, as :func:`sparse_attention` does.
    """
    scale = _check_inputs(q, k, v, layout, scale)
    if layout.batch is not None:
        return dense_attention(_fold(q), _fold(k), _fold(v), layout.flat(),
                               scale).reshape(q.shape)
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    mask = torch.from_numpy(layout.dense_mask()).to(q.device)  # [H, N, N_kv], True = attend
    has_key = mask.any(-1, keepdim=True)                        # [H, N, 1]
    safe_mask = mask | ~has_key
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=safe_mask[None], scale=scale)
    return torch.where(has_key[None], out, torch.zeros((), dtype=out.dtype, device=out.device))

