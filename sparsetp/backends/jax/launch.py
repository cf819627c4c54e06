"""Launch the sparsetp Triton kernels (the same ``@triton.jit`` objects torch launches) from JAX.

One entry point, :func:`call_kernel`, with ``jax_triton.triton_call``'s calling convention:
``args`` are the kernel's runtime arguments in order (arrays and Python/NumPy scalars), one
buffer per ``out_shapes`` entry is appended after them, and ``constexprs`` are the kernel's
``tl.constexpr`` keywords. It picks one of two paths by the kernel object itself:

* **GPU** (a compiled ``triton.JITFunction``): ``jax_triton.triton_call``; an XLA custom call, so
  it works under ``jit`` and inside ``shard_map`` (not over plain jit-sharded arrays: jax-triton
  has no sharding rule), with no host round trip.
* **CPU** (``TRITON_INTERPRET=1``, set by :mod:`sparsetp._runtime` when there is no GPU, makes
  every ``@triton.jit`` an ``InterpretedFunction``): ``buffer_callback`` hands the operands to
  the host, wraps them as CPU torch tensors (``torch.from_numpy``) and runs Triton's interpreter
  on them. **This path is for correctness, not speed**: the interpreter executes every program of
  the grid in Python/NumPy (about 6 ms per 64x64 tile per pass on a 2-core machine). Interpreted
  launches are serialised with a process-wide lock, because the interpreter is not thread-safe and
  XLA calls back from one thread per CPU device when ``shard_map`` runs over several of them.
  Outputs are pre-filled with NaN (floats) or ``-2**31`` (ints), so an element the kernel fails
  to write shows up in tests instead of reading as stale memory.

Scalars: a Python ``float`` is passed as fp32 on both paths (jax-triton would otherwise type it
fp64 while torch's launcher types it fp32, compiling a different kernel); ints are i32 (i64 when
they do not fit), like torch's launcher.

Inside ``shard_map`` the outputs of both paths are typed as not varying over the mesh even when
their inputs are; :func:`call_kernel` marks them varying over every axis any operand varies over
(GPU.md: a custom_vjp backward is otherwise rejected under ``check_vma=True``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from sparsetp import _runtime
from sparsetp.backends.jax import compat

__all__ = ["call_kernel", "is_interpreted", "INTERPRETER_LOCK"]

# Serialises every interpreted launch in the process, torch's included (see the module
# docstring): one lock for both frontends lives in sparsetp._runtime.
INTERPRETER_LOCK = _runtime.INTERPRETER_LOCK

_INT_POISON = -(2**31)


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was created under ``TRITON_INTERPRET=1`` (runs on the CPU path)."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415

    fn = kernel
    while not isinstance(fn, InterpretedFunction) and hasattr(fn, "fn"):
        fn = fn.fn  # Heuristics / Autotuner wrap the function
    return isinstance(fn, InterpretedFunction)


def _is_scalar(a) -> bool:
    return isinstance(a, (bool, int, float, np.integer, np.floating))


def _normalise_scalar(a):
    """Python/NumPy scalar -> the value handed to the launcher (floats as fp32, see docstring)."""
    if isinstance(a, bool):
        return a
    if isinstance(a, (int, np.integer)):
        return int(a)
    return np.float32(a)


def call_kernel(kernel, args: Sequence[Any], *, out_shapes: Sequence[jax.ShapeDtypeStruct],
                grid: tuple[int, ...], constexprs: Mapping[str, Any] | None = None,
                num_warps: int = 4, num_stages: int = 2, name: str = "") -> tuple[jax.Array, ...]:
    """Launch ``kernel`` over ``grid`` on ``args`` (+ appended outputs); return the outputs.

    Args:
      kernel: a ``@triton.jit`` function (compiled or interpreted).
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

        out, = call_kernel(add_kernel, [x, y, x.size],
                           out_shapes=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
                           grid=(pl.cdiv(x.size, 128),), constexprs={"BLOCK": 128})
    """
    constexprs = dict(constexprs or {})
    grid = tuple(int(g) for g in grid)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"grid must have 1 to 3 dims, got {grid}")
    out_shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes)
    args = [(_normalise_scalar(a) if _is_scalar(a) else jax.numpy.asarray(a)) for a in args]
    axes = frozenset().union(*(compat.varying_axes(a) for a in args if not _is_scalar(a)))
    if is_interpreted(kernel):
        outs = _call_interpreted(kernel, args, out_shapes, grid, constexprs)
    else:
        outs = compat.jax_triton().triton_call(
            *args, kernel=kernel, out_shape=out_shapes, grid=grid, name=name,
            num_warps=num_warps, num_stages=num_stages, **constexprs)
    return tuple(compat.mark_varying(o, axes) for o in outs)


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
        with INTERPRETER_LOCK:
            kernel[grid](*full, *outs, **constexprs)
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
