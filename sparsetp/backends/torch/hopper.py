"""Launch the sm_90 forward and backward (:mod:`sparsetp.kernels.hopper`) on torch tensors.

:func:`choose` decides per plan (the rules are :func:`sparsetp.kernels.hopper.forward_choice`
and :func:`~sparsetp.kernels.hopper.backward_choice`); :class:`Sm90Kernels` holds what a launch
needs (the layout at block 128 on the device, grid, TMA box layouts) and launches; a launch that
fails to compile warns once and the plan falls back to the portable kernel
(``backends/torch/attention.py``), so a fast-path failure never gives a wrong answer or an
error.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch
import triton

from sparsetp.backends.torch import launch as _launch
from sparsetp.kernels import abi, hopper
from sparsetp.kernels import options as _options

__all__ = ["choose", "failed", "Sm90Kernels", "layout_128", "aligned", "tma_ready"]

layout_128 = hopper.layout_128  # the layout at block 128 (cached; kernels/hopper.py)


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
    kw = dict(batch_heads=q.shape[0] * q.shape[1], seq_len=q.shape[2],
              mean_tiles=0.0 if lay is None else float(lay.q_count.mean()))
    fwd = hopper._choice("fwd_kernel", why, **kw)
    bwd = hopper._choice("bwd_kernel", hopper._backward_why(why, q.shape[-1]), **kw)
    return fwd, bwd, (lay if "hopper" in (fwd.name, bwd.name) else None)


_THREAD = threading.local()


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _ensure_context(device_index: int) -> None:
    """Make the device's primary CUDA context current on this thread if none is. Triton encodes
    a launch's TMA descriptors (``cuTensorMapEncodeTiled``) before its launcher binds a context,
    and a thread may have made no CUDA runtime call yet: autograd's device thread at its first
    backward, when every tensor comes from the caching allocator. Checked once per thread."""
    if getattr(_THREAD, "bound", None) == device_index:
        return
    lib = _libcuda()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0:
        raise RuntimeError("cuCtxGetCurrent failed")
    if not ctx.value:
        dev = ctypes.c_int()
        if (lib.cuDeviceGet(ctypes.byref(dev), device_index)
                or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
                or lib.cuCtxSetCurrent(ctx)):
            raise RuntimeError(f"no CUDA context for cuda:{device_index} on this thread")
    _THREAD.bound = device_index


def failed(exc: BaseException, what: str = "forward") -> hopper.KernelChoice:
    """The choice a plan reports after its sm_90 ``what`` ("forward", "dQ pass", "dK/dV pass")
    failed and it fell back."""
    return hopper.KernelChoice("portable", f"the sm_90 {what} failed here and was dropped: "
                               f"{type(exc).__name__}: {exc}"[:500])


class Sm90Kernels:
    """One plan's sm_90 launches (forward, dQ and dK/dV passes): the block-128 metadata on q's
    device and the launches of :func:`sparsetp.kernels.hopper.launches` (the grids and work
    orders of the portable kernels for that layout), and the TMA box layouts."""

    __slots__ = ("meta", "launches", "values", "ordered", "box_layout", "compiled")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, lay, scale: float):
        from triton.experimental.gluon import language as gl  # noqa: PLC0415

        b, h, n, d = q.shape
        meta = self.meta = _launch.device_group_metadata(lay, h // k.shape[1], q.device)
        self.ordered = _options.current().work_order != "natural"
        self.launches = hopper.launches(meta, b, h, k.shape[1], n, k.shape[2], scale,
                                        self.ordered, d, skip_quarters=lay.skip_quarters,
                                        skip_halves=lay.skip_halves)
        # The direct launch's values: metadata as pointers (kept alive by ``meta``).
        self.values = {name: tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                                   for a in launch.args)
                       for name, launch in self.launches.items()}
        # Triton's compiled kernels by launch name, once the JIT entry has launched them.
        self.compiled: dict = {}
        gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
        self.box_layout = {rows: gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
                           for rows in (hopper.BLOCK // 2, hopper.BLOCK)}

    def _launch(self, name: str, tensors: dict) -> None:
        """Launch ``self.launches[name]`` on ``tensors`` (by operand name; the boxed ones
        contiguous and 16-byte aligned: :func:`tma_ready`).

        The first launch goes through Triton's JIT entry (which compiles; the compiled kernel
        is kept under ``name``); later ones call the compiled kernel directly, as
        ``launch.run`` does for the portable kernels: everything Triton specialised on is fixed
        by the plan (shapes, strides, dtypes, 16-byte alignment) and ``name``, and the launcher
        reads of a descriptor argument only its base pointer, shape, strides and padding
        (:class:`sparsetp.kernels.hopper.LaunchBox`), so the descriptors' checks and the JIT
        entry's binding are not paid per call."""
        launch = self.launches[name]
        boxed = [(tensors[n], rows) for n, rows in launch.boxes]
        pointers = [tensors[n] for n in launch.pointers]
        device = boxed[0][0].device
        _ensure_context(device.index)
        c = self.compiled.get(name)
        if (c is not None and _launch.direct_launch_enabled()
                and torch.cuda.current_device() == device.index
                and _launch._launch_hooks() is None):
            c.run(*launch.grid, _launch._current_stream(device.index), c.function,
                  c.packed_metadata, None, None, None,
                  *(hopper.LaunchBox(t.data_ptr(), t.numel() // t.shape[-1], t.shape[-1])
                    for t, _ in boxed), *self.values[name],
                  *(t.data_ptr() for t in pointers), *launch.constexprs.values(),
                  hopper.NUM_WARPS)
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
            self.compiled[name] = getattr(hopper, launch.kernel)[launch.grid](
                *descs, *launch.args, *pointers, **launch.constexprs,
                num_warps=hopper.NUM_WARPS)

    def run(self, q, k, v, out, lse) -> None:
        """Launch the forward on this call's tensors (contiguous, 16-byte aligned)."""
        self._launch("fwd", dict(q=q, k=k, v=v, out=out, lse=lse))

    def dq(self, q, k, v, out, lse, d_out, d_lse, dq, delta) -> None:
        """Launch the dQ pass (dQ and Delta) on this call's tensors: q, k, v, out, d_out, lse
        and d_lse (None: no LSE cotangent) contiguous and 16-byte aligned. Compiled once per
        ``d_lse is None``."""
        self._launch("dq" if d_lse is None else "dq_dlse",
                     dict(q=q, k=k, v=v, out=out, lse=lse, d_out=d_out, d_lse=d_lse, dq=dq,
                          delta=delta))

    def dkdv(self, q, k, v, lse, delta, d_out, dk, dv) -> None:
        """Launch the dK/dV pass on this call's tensors (as :meth:`dq`; ``delta`` is the dQ
        pass's)."""
        self._launch("dkdv", dict(q=q, k=k, v=v, lse=lse, delta=delta, d_out=d_out, dk=dk,
                                  dv=dv))


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
