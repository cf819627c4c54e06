"""Launch the sparsetp Triton kernels (the same ``@triton.jit`` objects torch launches) from JAX.

The torch twin is ``backends/torch/launch.py``. Two paths, picked per platform of the
computation (:mod:`sparsetp._runtime` states the rule for both frontends):

* **GPU**: ``jax_triton.triton_call``, an XLA custom call, so it works under ``jit`` and inside
  ``shard_map`` (not over plain jit-sharded arrays: jax-triton has no sharding rule).
* **CPU**: attention itself runs the native path (:mod:`sparsetp.backends.jax.cpu`, plain XLA;
  :func:`per_platform` picks it). A *kernel* launched on CPU data (``SPARSETP_INTERPRET=1``, or
  :func:`launch` called directly) goes through ``buffer_callback``, which hands the operands
  to the host, wraps them as CPU torch tensors (``torch.from_numpy``) and runs the kernel in
  Triton's interpreter (:mod:`sparsetp.kernels.interpreter`). **For correctness, not speed.**
  Interpreted launches are serialised with one process-wide lock (XLA calls back from one
  thread per CPU device). Outputs are pre-filled with NaN (floats) or ``-2**31`` (ints), so an
  element the kernel fails to write shows up in tests instead of reading as stale memory.

:func:`launch` takes a builder ``kind -> KernelCall`` and, in a process whose JAX has a GPU
backend, stages both paths with ``jax.lax.platform_dependent``: XLA lowers only the branch of
the platform it compiles for, so one jitted function runs on CPU and GPU devices alike. Called
eagerly (concrete operands), it picks the path by the operands' devices.
Without a GPU backend (or with ``SPARSETP_INTERPRET=1``) only the CPU path is staged.

Scalars: a Python ``float`` is passed as fp32 on both paths (jax-triton would otherwise type it
fp64 while torch's launcher types it fp32, compiling a different kernel); ints are i32 (i64 when
they do not fit), like torch's launcher.

Inside ``shard_map`` the outputs of both paths are typed as not varying over the mesh even when
their inputs are; the launchers mark them varying over every axis any operand varies over
(a custom_vjp backward is otherwise rejected under ``check_vma=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from sparsetp import _runtime
from sparsetp.backends.jax import compat
from sparsetp.kernels import abi, interpreter

__all__ = ["launch", "per_platform", "run_call", "call_kernel", "gpu_path",
           "layout_device_kind"]

_INT_POISON = -(2**31)
_GPU_BACKEND: bool | None = None


def _jax_has_gpu() -> bool:
    global _GPU_BACKEND
    if _GPU_BACKEND is None:
        try:
            _GPU_BACKEND = len(jax.devices("gpu")) > 0
        except RuntimeError:  # no GPU backend in this JAX
            _GPU_BACKEND = False
    return _GPU_BACKEND


def gpu_path() -> bool:
    """Whether launches stage the compiled GPU path beside the CPU one (see the docstring)."""
    return (_jax_has_gpu() and not _runtime.force_interpreter()
            and _runtime.device_kind("cuda") == "cuda")


def layout_device_kind() -> str:
    """The device kind whose kernel tile a layout is converted for (``layout_arrays``): that of
    ``jax.default_device`` if set, else the default backend's. The other platform's branch runs
    the same layout, token-exact."""
    if not gpu_path():
        return "interpreter"
    return "interpreter" if _default_platform() == "cpu" else "cuda"


def _platform(x) -> str:
    """The platform an eager operand is on (a NumPy array: where JAX would put it)."""
    return next(iter(x.devices())).platform if isinstance(x, jax.Array) else _default_platform()


def _default_platform() -> str:
    """Where JAX puts an array it is not told about: ``jax.default_device``, else the default
    backend."""
    device = jax.config.jax_default_device
    return jax.default_backend() if device is None else getattr(device, "platform", device)


def per_platform(run: Callable[[str], Sequence[jax.Array]], *operands: jax.Array,
                 ) -> tuple[jax.Array, ...]:
    """Outputs of ``run(kind)`` for the path the computation takes: ``kind`` is ``"cuda"``
    on a GPU and :func:`sparsetp._runtime.device_kind` of ``"cpu"`` on CPU (``"cpu"``, the
    native path, or ``"interpreter"`` under ``SPARSETP_INTERPRET=1``). Outside ``jit`` the
    ``operands``' devices pick it; under ``jit`` ``jax.lax.platform_dependent`` does."""
    cpu_kind = _runtime.device_kind("cpu")

    def on(kind):
        return lambda *_: tuple(run(kind))

    if not gpu_path():
        return on(cpu_kind)()
    if operands and not any(isinstance(o, jax.core.Tracer) for o in operands):
        # Eager: platform_dependent would pick the default backend's branch, whatever the
        # operands' devices; they say where this runs.
        platforms = {_platform(o) for o in operands}
        return on(cpu_kind if platforms == {"cpu"} else "cuda")()
    return tuple(jax.lax.platform_dependent(*operands, cpu=on(cpu_kind), default=on("cuda")))


def run_call(call: abi.KernelCall, kind: str, name: str = "") -> tuple[jax.Array, ...]:
    """Launch ``call`` on the path ``kind`` (``"cuda"`` or ``"interpreter"``)."""
    return call_kernel(call.kernel, call.args, device_kind=kind,
                       out_shapes=[jax.ShapeDtypeStruct(o.shape, jax.numpy.dtype(o.dtype))
                                   for o in call.outputs],
                       grid=call.grid, constexprs=call.constexprs,
                       num_warps=call.num_warps, num_stages=call.num_stages,
                       name=name or f"sparsetp_attn_{call.name}")


def launch(build: Callable[[str], abi.KernelCall], *operands: jax.Array,
           name: str = "") -> tuple[jax.Array, ...]:
    """Outputs of the kernel call ``build(kind)`` describes, ``kind`` being the path's kernel
    device kind (:func:`per_platform`; a kernel has no native CPU path, so CPU data runs it in
    the interpreter). ``operands`` are arrays the call reads: outside ``jit`` their devices
    pick the path.

    >>> outs = launch(lambda kind: abi.fwd_call(q, k, v, meta, scale=s, dtype="float32",
    ...                                         device_kind=kind), q)      # doctest: +SKIP
    """
    def run(kind):
        kind = "interpreter" if kind == "cpu" else kind
        return run_call(build(kind), kind, name)

    return per_platform(run, *operands)


def _is_scalar(a) -> bool:
    return isinstance(a, (bool, int, float, np.integer, np.floating))


def _normalise_scalar(a):
    """Python/NumPy scalar -> the value handed to the launcher (floats as fp32, see docstring)."""
    if isinstance(a, bool):
        return a
    if isinstance(a, (int, np.integer)):
        return int(a)
    return np.float32(a)


def call_kernel(kernel, args: Sequence[Any], *, device_kind: str,
                out_shapes: Sequence[jax.ShapeDtypeStruct], grid: tuple[int, ...],
                constexprs: Mapping[str, Any] | None = None, num_warps: int = 4,
                num_stages: int = 2, name: str = "") -> tuple[jax.Array, ...]:
    """Launch ``kernel`` over ``grid`` on ``args`` (+ appended outputs); return the outputs.

    Args:
      kernel: a ``@triton.jit`` function.
      device_kind: ``"cuda"`` (jax-triton) or ``"interpreter"`` (CPU callback).
      args: the kernel's runtime arguments in declaration order, outputs excluded: JAX/NumPy
        arrays (passed as pointers to contiguous row-major buffers) and scalars.
      out_shapes: shapes/dtypes of the buffers the kernel writes, which must be the kernel's
        last runtime arguments.
      grid: launch grid (up to 3 ints).
      constexprs: the kernel's ``tl.constexpr`` arguments by name.
      num_warps, num_stages: compile options (ignored by the interpreter).

    Works eagerly, under ``jit`` and inside ``shard_map``. Has no autodiff rule: wrap it in a
    ``custom_vjp`` (see :mod:`sparsetp.backends.jax.attention`).

    Example (any kernel ``add_kernel(x_ptr, y_ptr, n, out_ptr, BLOCK: tl.constexpr)``)::

        out, = call_kernel(add_kernel, [x, y, x.size], device_kind="cuda",
                           out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
                           grid=(pl.cdiv(x.size, 128),), constexprs={"BLOCK": 128})
    """
    constexprs = dict(constexprs or {})
    grid = tuple(int(g) for g in grid)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"grid must have 1 to 3 dims, got {grid}")
    out_shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes)
    args = [(_normalise_scalar(a) if _is_scalar(a) else jax.numpy.asarray(a)) for a in args]
    if device_kind == "interpreter":
        outs = _call_interpreted(kernel, args, out_shapes, grid, constexprs)
    else:
        outs = compat.jax_triton().triton_call(
            *args, kernel=kernel, out_shape=out_shapes, grid=grid, name=name,
            num_warps=num_warps, num_stages=num_stages, **constexprs)
    return compat.mark_varying_like(outs, [a for a in args if not _is_scalar(a)])


def _call_interpreted(kernel, args, out_shapes, grid, constexprs):
    # Import torch here, at trace time on the calling thread, never first inside ``host``: XLA runs
    # the callbacks of a sharded computation on several threads at once, and a first
    # ``import torch`` racing in four of them deadlocked (seen in CI with a 4-device mesh).
    import torch  # noqa: F401, PLC0415

    positions = [i for i, a in enumerate(args) if not _is_scalar(a)]
    arrays = [args[i] for i in positions]

    def host(ctx, out_buffers, *in_buffers):
        del ctx
        # The interpreter, like torch's launcher, takes Python floats (typed fp32).
        full = [float(a) if isinstance(a, np.floating) else a for a in args]
        for i, a in zip(positions, in_buffers, strict=True):
            full[i] = _to_torch(np.asarray(a))
        outs = [_poisoned(s) for s in out_shapes]
        interpreter.launch(kernel, grid, (*full, *outs), constexprs)
        for buf, o, s in zip(out_buffers, outs, out_shapes, strict=True):
            np.asarray(buf)[...] = _from_torch(o, s.dtype)

    # buffer_callback, not pure_callback: pure_callback's implementation device_puts the
    # operands onto CPU device 0 and waits for them, and with a 4-device mesh that wait could
    # queue behind device 0's own program, itself blocked in a collective on the other devices'
    # callbacks: an intermittent deadlock (1 run in 4 of the README mesh example, seen in CI).
    # buffer_callback hands the runtime's host buffers over directly.
    return tuple(compat.buffer_callback(host, out_shapes)(*arrays))


def _torch_dtype(dtype):
    import torch  # noqa: PLC0415  (CPU path only)

    name = np.dtype(dtype).name
    return {"bfloat16": torch.bfloat16}.get(name) or getattr(torch, name)


def _to_torch(a):
    import torch  # noqa: PLC0415

    a = np.asarray(a)
    if a.dtype.name == "bfloat16":  # ml_dtypes; torch.from_numpy does not know it
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16).copy()).view(torch.bfloat16)
    # The kernels only read inputs, but torch.from_numpy warns on (and would alias) read-only
    # buffers that XLA hands to callbacks: copy those (this path is for correctness, not speed).
    if not a.flags.writeable or not a.flags.c_contiguous:
        a = np.array(a, order="C")
    return torch.from_numpy(a)


def _poisoned(shape_dtype):
    import torch  # noqa: PLC0415

    dtype = np.dtype(shape_dtype.dtype)
    fill = float("nan") if dtype.kind == "f" or dtype.name == "bfloat16" else _INT_POISON
    return torch.full(tuple(shape_dtype.shape), fill, dtype=_torch_dtype(dtype))


def _from_torch(t, dtype):
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        import torch  # noqa: PLC0415

        return t.contiguous().view(torch.int16).numpy().view(dtype)
    return t.contiguous().numpy()
