"""Load another version of the attention kernels from a file and run it like the library does.

For benchmarks that compare kernel *versions* (``kernel_ab.py``, ``ncu_backward.py``,
``kernel_probe.py``, ``ptx_probe.py``): the library runs only its own kernels, so the loader and
the launches live here. A version is a copy of ``sparsetp/kernels/attention.py`` (for example
``git show <rev>:sparsetp/kernels/attention.py > /tmp/base.py``, or an edited copy) whose
kernels keep the tree's argument order (:mod:`sparsetp.kernels.abi`); a version with another
signature needs its own launcher.

:func:`attention` builds each launch with the library's ``abi.*_call`` (so metadata, kernel
tile, head groups, tile configs and :func:`sparsetp.kernels.options.launch_options` apply as for
the library) and swaps in the version's kernel with ``dataclasses.replace(call, kernel=...)``.
It launches through Triton's JIT entry point on CUDA (no launch-description cache, no direct
launch), and through Triton's interpreter on CPU tensors. A kernel A/B therefore runs every
arm, the tree's kernels included (:func:`tree`), through this same path, so host time is equal
between arms but higher than the library's.

Example (CPU, in the interpreter)::

    >>> import torch
    >>> from sparsetp.core import make_layout, patterns as P
    >>> lay = make_layout(P.causal(), 64, 1, 32)
    >>> q = k = v = torch.randn(1, 1, 64, 16)
    >>> out, lse = attention(q, k, v, lay, tree())
    >>> out.shape
    torch.Size([1, 1, 64, 16])
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping

import torch

from sparsetp.backends.torch import launch as tlaunch
from sparsetp.kernels import abi, interpreter

__all__ = ["load", "tree", "launch", "forward", "backward", "attention"]


def tree() -> dict:
    """The tree's kernels, by :data:`sparsetp.kernels.abi.KERNEL_NAMES` name."""
    return {name: abi.kernel(name) for name in abi.KERNEL_NAMES}


def load(path: str) -> dict:
    """The kernels, by :data:`~sparsetp.kernels.abi.KERNEL_NAMES` name, of the copy of
    ``sparsetp/kernels/attention.py`` at ``path``, imported as its own module (so Triton
    compiles and caches them apart from the tree's)."""
    name = os.path.splitext(os.path.basename(path))[0].lstrip(".")
    spec = importlib.util.spec_from_file_location(f"sparsetp_kernels_{name}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import a kernels file from {path!r}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {nm: getattr(mod, k.fn.__name__) for nm, k in tree().items()}


def launch(call: abi.KernelCall, kernels: Mapping, outputs, kind: str) -> None:
    """Launch ``call`` with ``kernels[call.name]`` instead of the tree's kernel."""
    call = dataclasses.replace(call, kernel=kernels[call.name])
    if kind == "interpreter":
        interpreter.launch(call.kernel, call.grid, (*call.args, *outputs), call.constexprs)
        return
    with torch.cuda.device(outputs[0].device):
        call.kernel[call.grid](*call.args, *outputs, **call.constexprs,
                               num_warps=call.num_warps, num_stages=call.num_stages)


def _outputs(call: abi.KernelCall, device) -> tuple:
    # The library's allocator, so that a test's NaN poisoning applies here too.
    return tuple(tlaunch.new_output(o.shape, getattr(torch, o.dtype), device)
                 for o in call.outputs)


def forward(q, k, v, layout, kernels: Mapping, scale: float):
    """(out, lse) of ``kernels`` on contiguous or strided ``q, k, v``."""
    kind = tlaunch.device_kind(q)
    meta = tlaunch.metadata(layout, q, kind)
    call = abi.fwd_call(q, k, v, meta, scale=scale, dtype=abi.check_dtype(q.dtype),
                        device_kind=kind,
                        strides={"q": q.stride(), "k": k.stride(), "v": v.stride()})
    outs = _outputs(call, q.device)
    launch(call, kernels, outs, kind)
    return outs


def backward(q, k, v, out, lse, d_out, d_lse, layout, kernels: Mapping, scale: float):
    """(dq, dk, dv) of ``kernels``: dQ (which writes Delta, the LSE cotangent folded in), then
    dK/dV."""
    kind = tlaunch.device_kind(q)
    dtype = abi.check_dtype(q.dtype)
    meta = tlaunch.metadata(layout, q, kind)
    lse = lse.contiguous()  # delta is written with lse's strides
    st = {"q": q.stride(), "k": k.stride(), "v": v.stride(), "d_out": d_out.stride(),
          "out": out.stride()}
    if d_lse is not None:
        st["d_lse"] = d_lse.stride()
    kw = dict(scale=scale, dtype=dtype, device_kind=kind, strides=st)
    dq_call = abi.bwd_dq_call(q, k, v, d_out, lse, out, d_lse, meta, **kw)
    dq, delta = _outputs(dq_call, q.device)
    launch(dq_call, kernels, (dq, delta), kind)
    dkdv_call = abi.bwd_dkdv_call(q, k, v, d_out, lse, delta, meta, **kw)
    dk, dv = _outputs(dkdv_call, q.device)
    launch(dkdv_call, kernels, (dk, dv), kind)
    return dq, dk, dv


class _VersionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, kernels, scale):
        out, lse = forward(q, k, v, layout, kernels, scale)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.kernels, ctx.scale = layout, kernels, scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dk, dv = backward(q, k, v, out, lse, d_out.contiguous(), d_lse, ctx.layout,
                              ctx.kernels, ctx.scale)
        return dq, dk, dv, None, None, None


def attention(q, k, v, layout, kernels: Mapping, scale: float | None = None):
    """(out, lse) of ``kernels`` (from :func:`load` or :func:`tree`), differentiable in q, k, v
    through autograd like :func:`sparsetp.torch.sparse_attention`."""
    scale = abi.check_attention_shapes(q.shape, k.shape, v.shape, layout, scale)
    return _VersionFn.apply(q, k, v, layout, kernels, scale)
