"""Launch the sm_90 forward and backward (:mod:`sparsetp.kernels.hopper`) on torch tensors.

:func:`choose` decides per plan (the rules are :func:`sparsetp.kernels.hopper.forward_choice`
and :func:`~sparsetp.kernels.hopper.backward_choice`); :class:`Sm90Kernels` holds what a launch
needs (the layout at block 128 on the device, grid, TMA box layouts) and launches; a launch that
fails to compile warns once and the plan falls back to the portable kernel
(``backends/torch/attention.py``), so a fast-path failure never gives a wrong answer or an
error.
"""

from __future__ import annotations

import weakref

import torch
import triton

from sparsetp.backends.torch import launch as _launch
from sparsetp.kernels import abi, hopper, schedule
from sparsetp.kernels import options as _options

__all__ = ["choose", "failed", "Sm90Kernels", "layout_128", "aligned", "tma_ready"]

_LAYOUTS_128: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layout_128(layout):
    """``layout`` at block 128 (the same token mask in 128-tiles), or None when it has no
    pattern to lay out again. A head slice (tensor parallelism) is the same slice of its whole
    layout's block-128 form. Cached while ``layout`` lives."""
    if layout.block_size == hopper.BLOCK:
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
        from sparsetp.core.layout import make_layout  # noqa: PLC0415 (numpy-only spec)

        out = make_layout(layout.pattern, layout.seq_len, layout.num_heads, hopper.BLOCK,
                          kv_len=layout.kv_len)
    _LAYOUTS_128[layout] = out
    return out


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, kind: str,
           scale: float) -> tuple[hopper.KernelChoice, hopper.KernelChoice, object]:
    """(the forward kernel of this call, its backward kernels, the block-128 layout when either
    is the fast path, else None). Checks the device and dtype first, so a call that cannot take
    the fast path builds no layout."""
    if kind == "cuda":
        capability = tuple(torch.cuda.get_device_capability(q.device))
    else:
        capability = None
    common = dict(framework="torch", device_kind=kind, capability=capability,
                  triton_version=triton.__version__, dtype=abi.check_dtype(q.dtype),
                  head_dim=q.shape[-1], seq_len=q.shape[2], kv_len=k.shape[2],
                  contiguous=all(t.is_contiguous() for t in (q, k, v)), scale=scale)
    lay = None
    why = hopper._ineligible(**common, layout_ok=True)
    opts = _options.current()
    if why is None and (opts.fwd_kernel, opts.bwd_kernel) != ("portable", "portable"):
        lay = layout_128(layout)
        if lay is None:
            why = hopper._ineligible(**common, layout_ok=False)
    # One reason for both passes (forward_choice and backward_choice would each re-derive it).
    kw = dict(why=why, batch_heads=q.shape[0] * q.shape[1], seq_len=q.shape[2],
              mean_tiles=0.0 if lay is None else float(lay.q_count.mean()))
    fwd, bwd = hopper._choice("fwd_kernel", **kw), hopper._choice("bwd_kernel", **kw)
    return fwd, bwd, (lay if "hopper" in (fwd.name, bwd.name) else None)


def failed(exc: BaseException, what: str = "forward") -> hopper.KernelChoice:
    """The choice a plan reports after its sm_90 ``what`` ("forward", "dQ pass", "dK/dV pass")
    failed and it fell back."""
    return hopper.KernelChoice("portable", f"the sm_90 {what} failed here and was dropped: "
                               f"{type(exc).__name__}: {exc}"[:500])


class Sm90Kernels:
    """One plan's sm_90 launches (forward, dQ and dK/dV passes): the block-128 metadata on q's
    device, the grids and work orders of the portable kernels for that layout, and the TMA box
    layouts."""

    __slots__ = ("meta", "args", "arg_values", "dq_args", "dq_values", "dkdv_args",
                 "dkdv_values", "grid", "kv_grid", "ordered", "box_layout", "qk_scale",
                 "compiled")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, lay, scale: float):
        from triton.experimental.gluon import language as gl  # noqa: PLC0415

        meta = self.meta = _launch.device_metadata(lay, q.device)
        b, h, n, d = q.shape
        h_kv, n_kv = k.shape[1], k.shape[2]
        arrays, strides = abi._check_meta(meta, "q", h, n // hopper.BLOCK, hopper.BLOCK)
        k_arrays, k_strides = abi._check_meta(meta, "k", h, n_kv // hopper.BLOCK, hopper.BLOCK)
        self.qk_scale = float(scale) * 1.4426950408889634  # softmax in base 2 (exp2)
        self.args = (*arrays, self.qk_scale, n, n_kv, h, h // h_kv, h_kv, *strides)
        self.dq_args = (*arrays, self.qk_scale, float(scale), n, n_kv, h, h // h_kv, h_kv,
                        *strides)
        self.dkdv_args = (*k_arrays, self.qk_scale, float(scale), n, n_kv, h, h // h_kv,
                          *k_strides)
        # The direct launch's values: metadata as pointers (kept alive by ``meta``).
        self.arg_values, self.dq_values, self.dkdv_values = (
            tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
            for args in (self.args, self.dq_args, self.dkdv_args))
        # Triton's compiled kernels, once the JIT entry has launched them: "fwd", "dkdv" and
        # ("dq", has an LSE cotangent).
        self.compiled: dict = {}
        self.grid = schedule.list_grid(b, h, n // hopper.BLOCK,
                                       schedule.grid_group(meta, "q", b, h))
        self.kv_grid = schedule.list_grid(b, h_kv, n_kv // hopper.BLOCK,
                                          schedule.grid_group(meta, "k", b, h_kv))
        self.ordered = _options.current().work_order != "natural"
        gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
        self.box_layout = {hopper.BLOCK // 2: gl.NVMMASharedLayout.get_default_for(
                               [hopper.BLOCK // 2, d], gdt),
                           hopper.BLOCK: gl.NVMMASharedLayout.get_default_for(
                               [hopper.BLOCK, d], gdt)}

    def _launch(self, slot, kernel: str, grid, boxed, args, values, pointers,
                constexprs: dict) -> None:
        """Launch ``hopper.<kernel>`` on ``boxed`` (``(tensor, box rows)`` pairs, its TMA
        descriptor arguments, contiguous and 16-byte aligned: :func:`tma_ready`), then
        ``args`` (``values`` as the direct launch passes them), then the ``pointers`` tensors,
        then ``constexprs`` (in the kernel's order).

        The first launch goes through Triton's JIT entry (which compiles; the compiled kernel
        is kept under ``slot``); later ones call the compiled kernel directly, as
        ``launch.run`` does for the portable kernels: everything Triton specialised on is fixed
        by the plan (shapes, strides, dtypes, 16-byte alignment) and ``slot``, and the launcher
        reads of a descriptor argument only its base pointer, shape, strides and padding
        (:class:`_Box`), so the descriptors' checks and the JIT entry's binding are not paid
        per call."""
        device = boxed[0][0].device
        c = self.compiled.get(slot)
        if (c is not None and _launch.direct_launch_enabled()
                and torch.cuda.current_device() == device.index
                and _launch._launch_hooks() is None):
            c.run(*grid, _launch._current_stream(device.index), c.function, c.packed_metadata,
                  None, None, None, *(_Box(t, t.shape[-1]) for t, _ in boxed), *values,
                  *(t.data_ptr() for t in pointers), *constexprs.values(), hopper.NUM_WARPS)
            return
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

        descs = []
        for t, rows in boxed:
            d = t.shape[-1]
            t2 = t.view(-1, d)
            descs.append(TensorDescriptor(t2, list(t2.shape), [d, 1], [rows, d],
                                          self.box_layout[rows]))
        _launch._restore_cache_dir()
        with torch.cuda.device(device):
            self.compiled[slot] = getattr(hopper, kernel)[grid](
                *descs, *args, *pointers, **constexprs, num_warps=hopper.NUM_WARPS)

    def run(self, q, k, v, out, lse) -> None:
        """Launch the forward on this call's tensors (contiguous, 16-byte aligned)."""
        self._launch("fwd", "_attn_fwd_kernel_sm90", self.grid,
                     ((q, hopper.BLOCK // 2), (k, hopper.BLOCK), (v, hopper.BLOCK)),
                     self.args, self.arg_values, (out, lse),
                     {"ORDERED": self.ordered, "STAGES": hopper.STAGES,
                      "CONSUMER_REGS": hopper.CONSUMER_REGS,
                      "PRODUCER_REGS": hopper.PRODUCER_REGS, "PINGPONG": hopper.PINGPONG})

    def dq(self, q, k, v, out, lse, d_out, d_lse, dq, delta) -> None:
        """Launch the dQ pass (dQ and Delta) on this call's tensors: q, k, v, out, d_out, lse
        and d_lse (None: no LSE cotangent) contiguous and 16-byte aligned. Compiled once per
        ``d_lse is None``."""
        has_dlse = d_lse is not None
        self._launch(("dq", has_dlse), "_attn_bwd_dq_kernel_sm90", self.grid,
                     ((q, hopper.BLOCK // 2), (d_out, hopper.BLOCK // 2), (k, hopper.BLOCK),
                      (v, hopper.BLOCK)), self.dq_args, self.dq_values,
                     # without a cotangent, lse fills its slot, never read
                     (out, lse, d_lse if has_dlse else lse, dq, delta),
                     {"ORDERED": self.ordered, "STAGES": hopper.DQ_STAGES, "HAS_DLSE": has_dlse,
                      "CONSUMER_REGS": hopper.CONSUMER_REGS,
                      "PRODUCER_REGS": hopper.PRODUCER_REGS})

    def dkdv(self, q, k, v, lse, delta, d_out, dk, dv) -> None:
        """Launch the dK/dV pass on this call's tensors (as :meth:`dq`; ``delta`` is the dQ
        pass's)."""
        self._launch("dkdv", "_attn_bwd_dkdv_kernel_sm90", self.kv_grid,
                     ((q, hopper.BLOCK // 2), (d_out, hopper.BLOCK // 2), (k, hopper.BLOCK),
                      (v, hopper.BLOCK)), self.dkdv_args, self.dkdv_values,
                     (lse, delta, dk, dv),
                     {"ORDERED": self.ordered, "STAGES": hopper.DKDV_STAGES,
                      "EARLY_DP": hopper.DKDV_EARLY_DP, "CONSUMER_REGS": hopper.CONSUMER_REGS,
                      "PRODUCER_REGS": hopper.PRODUCER_REGS})


class _Box:
    """What Triton's launcher reads of a host tensor descriptor (``make_tensordesc_arg``): the
    ``[rows, d]`` view of a contiguous tensor."""

    __slots__ = ("base", "shape", "strides")
    padding = "zero"

    def __init__(self, t: torch.Tensor, d: int):
        self.base, self.shape, self.strides = t, [t.numel() // d, d], [d, 1]


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it where it is not contiguous or not on a 16-byte
    boundary (what the sm_90 kernels' TMA boxes and vector loads need)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary (TMA descriptors need it)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


MISALIGNED = hopper.KernelChoice(
    "portable", "q, k or v does not start on a 16-byte boundary (TMA descriptors need it)")
