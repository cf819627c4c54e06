"""Launch the sm_90 forward (:mod:`sparsetp.kernels.hopper`) on torch tensors.

:func:`choose` decides per plan (the rule is :func:`sparsetp.kernels.hopper.forward_choice`);
:class:`Sm90Forward` holds what a launch needs (the layout at block 128 on the device, grid,
TMA box layouts) and launches; a launch that fails to compile warns once and the plan falls back
to the portable kernel (``backends/torch/attention.py``), so a fast-path failure never gives a
wrong answer or an error.
"""

from __future__ import annotations

import weakref

import torch
import triton

from sparsetp.backends.torch import launch as _launch
from sparsetp.kernels import abi, hopper, schedule
from sparsetp.kernels import options as _options

__all__ = ["choose", "failed", "Sm90Forward", "layout_128", "aligned"]

_LAYOUTS_128: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_META_128: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
           scale: float) -> tuple[hopper.KernelChoice, object]:
    """(the forward kernel of this call, its block-128 layout or None). Checks the device and
    dtype first, so a call that cannot take the fast path builds no layout."""
    if kind == "cuda":
        capability = tuple(torch.cuda.get_device_capability(q.device))
    else:
        capability = None
    common = dict(framework="torch", device_kind=kind, capability=capability,
                  triton_version=triton.__version__, dtype=abi.check_dtype(q.dtype),
                  head_dim=q.shape[-1], seq_len=q.shape[2], kv_len=k.shape[2],
                  contiguous=all(t.is_contiguous() for t in (q, k, v)), scale=scale)
    lay = None
    probe = hopper._ineligible(**common, layout_ok=True)
    if probe is None and _options.current().fwd_kernel != "portable":
        lay = layout_128(layout)
    mean = 0.0 if lay is None else float(lay.q_count.mean())
    # Where the probe failed, its reason (not the unbuilt layout) is the one to report.
    choice = hopper.forward_choice(**common, batch_heads=q.shape[0] * q.shape[1],
                                   mean_tiles=mean, layout_ok=lay is not None or probe is not None)
    return choice, (lay if choice.name == "hopper" else None)


def failed(exc: BaseException) -> hopper.KernelChoice:
    """The choice a plan reports after its sm_90 forward failed and it fell back."""
    return hopper.KernelChoice("portable", f"the sm_90 forward failed here and was dropped: "
                               f"{type(exc).__name__}: {exc}"[:500])


class Sm90Forward:
    """One plan's sm_90 forward: the block-128 metadata on q's device, the grid and work order
    of the portable forward for that layout, and the TMA box layouts."""

    __slots__ = ("meta", "args", "arg_values", "grid", "ordered", "box_layout", "qk_scale",
                 "compiled")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, lay, scale: float):
        from triton.experimental.gluon import language as gl  # noqa: PLC0415

        per_device = _META_128.setdefault(lay, {})
        key = str(q.device)
        if key not in per_device:
            q_group, _ = schedule.head_groups(lay)
            per_device[key] = {**_launch._device_arrays(lay.metadata(), q.device),
                               "q_head_group": q_group}
        meta = self.meta = per_device[key]
        b, h, n, d = q.shape
        h_kv, n_kv = k.shape[1], k.shape[2]
        arrays, strides = abi._check_meta(meta, "q", h, n // hopper.BLOCK, hopper.BLOCK)
        self.qk_scale = float(scale) * 1.4426950408889634  # softmax in base 2 (exp2)
        self.args = (*arrays, self.qk_scale, n, n_kv, h, h // h_kv, h_kv, *strides)
        # The direct launch's values: metadata as pointers (kept alive by ``meta``).
        self.arg_values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                                for a in self.args)
        self.compiled = None  # Triton's compiled kernel, once the JIT entry has launched it
        self.grid = schedule.list_grid(b, h, n // hopper.BLOCK,
                                       schedule.grid_group(meta, "q", b, h))
        self.ordered = _options.current().work_order != "natural"
        gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
        self.box_layout = (gl.NVMMASharedLayout.get_default_for([hopper.BLOCK // 2, d], gdt),
                           gl.NVMMASharedLayout.get_default_for([hopper.BLOCK, d], gdt))

    def run(self, q, k, v, out, lse) -> None:
        """Launch on this call's tensors (contiguous, 16-byte aligned: :func:`aligned`).

        The first launch goes through Triton's JIT entry (which compiles); later ones call the
        compiled kernel directly, as ``launch.run`` does for the portable kernels: everything
        Triton specialised on is fixed by the plan (shapes, strides, dtypes, 16-byte
        alignment), and the launcher reads of a descriptor argument only its base pointer,
        shape, strides and padding (:class:`_Box`), so the descriptors' checks and the JIT
        entry's binding are not paid per call."""
        d = q.shape[-1]
        device = q.device.index
        if (self.compiled is not None and _launch.direct_launch_enabled()
                and torch.cuda.current_device() == device and _launch._launch_hooks() is None):
            c = self.compiled
            boxes = (_Box(q, d), _Box(k, d), _Box(v, d))
            c.run(*self.grid, _launch._current_stream(device), c.function, c.packed_metadata,
                  None, None, None, *boxes, *self.arg_values, out.data_ptr(), lse.data_ptr(),
                  self.ordered, hopper.STAGES, hopper.CONSUMER_REGS, hopper.PRODUCER_REGS,
                  hopper.PINGPONG, hopper.NUM_WARPS)
            return
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415

        q_box, kv_box = self.box_layout
        q2, k2, v2 = q.view(-1, d), k.view(-1, d), v.view(-1, d)
        descs = (TensorDescriptor(q2, list(q2.shape), [d, 1], [hopper.BLOCK // 2, d], q_box),
                 TensorDescriptor(k2, list(k2.shape), [d, 1], [hopper.BLOCK, d], kv_box),
                 TensorDescriptor(v2, list(v2.shape), [d, 1], [hopper.BLOCK, d], kv_box))
        _launch._restore_cache_dir()
        with torch.cuda.device(q.device):
            self.compiled = hopper._attn_fwd_kernel_sm90[self.grid](
                *descs, *self.args, out, lse, ORDERED=self.ordered, STAGES=hopper.STAGES,
                CONSUMER_REGS=hopper.CONSUMER_REGS, PRODUCER_REGS=hopper.PRODUCER_REGS,
                PINGPONG=hopper.PINGPONG, num_warps=hopper.NUM_WARPS)


class _Box:
    """What Triton's launcher reads of a host tensor descriptor (``make_tensordesc_arg``): the
    ``[rows, d]`` view of a contiguous tensor."""

    __slots__ = ("base", "shape", "strides")
    padding = "zero"

    def __init__(self, t: torch.Tensor, d: int):
        self.base, self.shape, self.strides = t, [t.numel() // d, d], [d, 1]


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor starts on a 16-byte boundary (TMA descriptors need it)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


MISALIGNED = hopper.KernelChoice(
    "portable", "q, k or v does not start on a 16-byte boundary (TMA descriptors need it)")
