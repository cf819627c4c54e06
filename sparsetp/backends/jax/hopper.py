"""Launch the sm_90 forward and backward (:mod:`sparsetp.kernels.hopper`) from JAX.

jax_triton cannot launch these kernels (it passes no TMA descriptors and launches
``num_warps`` warps, not the producer and consumer partitions), so this launcher does what the
torch one does after its first call, inside XLA's computation:

* **compile ahead**, at trace time: :func:`compile_launch` binds and specialises the kernel's
  arguments exactly as Triton's JIT entry does (so torch and JAX run the same binary for the
  same call) and compiles it for sm_90; a failure warns and the call runs the portable kernels
  (:func:`failed` keeps the reason, which ``sparsetp.jax.forward_kernel`` reports);
* **launch** from ``jax.experimental.buffer_callback`` on XLA's stream: the callback receives
  the operands' device buffers and calls the compiled kernel with their pointers (Triton's
  launcher builds the TMA descriptors from a base pointer, shape and strides).

Triton's CUDA driver, which loads and launches compiled kernels, runs on torch's CUDA runtime:
the fast path needs torch with CUDA beside JAX (:func:`unavailable` says so otherwise). Each
device loads the kernel once (the first launch on it). Triton's launch hooks (profilers) are
not called for these launches.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings

import jax
import jax.numpy as jnp

from sparsetp.backends.jax import compat
from sparsetp.kernels import hopper

__all__ = ["unavailable", "capability", "compile_launch", "failed", "operand_order", "call"]

_LOCK = threading.Lock()
# Keyed as Triton's JIT cache is, by the kernel and its arguments' specialisation (types,
# "equals 1", "divisible by 16") and options, so new lengths or scales reuse a binary.
_COMPILED: dict = {}  # compile key -> CompiledKernel (or the exception it raised)
_LOADED: dict = {}  # (compile key, device ordinal) -> CompiledKernel loaded there


@functools.cache
def unavailable() -> str | None:
    """Why this process cannot launch the sm_90 kernels from JAX, or None."""
    try:
        from jax.experimental.buffer_callback import buffer_callback  # noqa: F401, PLC0415
    except ImportError:
        return "this JAX has no jax.experimental.buffer_callback (JAX >= 0.7 has it)"
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return ("Triton's CUDA driver, which loads and launches the compiled kernels, needs "
                "torch (with CUDA) beside JAX")
    if not torch.cuda.is_available():
        return "torch beside JAX sees no CUDA device (Triton's CUDA driver runs on it)"
    return None


def capability(device=None) -> tuple[int, int] | None:
    """Compute capability of ``device`` (default: JAX's first GPU), or None without a GPU."""
    if device is None:
        try:
            device = jax.devices("gpu")[0]
        except RuntimeError:
            return None
    try:
        major, minor = str(device.compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):  # not a CUDA device (e.g. a ROCm "gfx90a")
        return None


class _Stand:
    """A pointer argument at bind time: what Triton's specialisation reads of a tensor (its
    dtype and a 16-byte-aligned address, as every launch's operands have)."""

    def __init__(self, dtype: str):
        self.dtype = dtype

    @staticmethod
    def data_ptr() -> int:
        return 256


_POINTER_DTYPES = {"out": None, "dq": None, "dk": None, "dv": None, "lse": "float32",
                   "d_lse": "float32", "delta": "float32"}


def compile_launch(launch: hopper.Sm90Launch, dtype: str, head_dim: int):
    """Triton's compiled kernel for ``launch`` on q of ``dtype`` and ``head_dim`` (sm_90),
    bound and specialised as ``JITFunction.run`` does for the same arguments (the torch
    launcher's first call), compiled once per process and specialisation. Raises what the
    compiler raised (kept: a failed specialisation is not compiled again)."""
    return _compiled(_bind(launch, dtype, head_dim))


def failed(launch: hopper.Sm90Launch, dtype: str, head_dim: int) -> Exception | None:
    """The exception compiling ``launch`` raised in this process, or None (not tried, or
    compiled)."""
    got = _COMPILED.get(_bind(launch, dtype, head_dim)[0])
    return got if isinstance(got, Exception) else None


def _compiled(bound):
    key = bound[0]
    with _LOCK:
        got = _COMPILED.get(key)
        if got is None:
            try:
                got = _compile(*bound[1:])
            except Exception as exc:  # noqa: BLE001 (kept, reported, re-raised per call)
                got = exc
            _COMPILED[key] = got
    if isinstance(got, Exception):
        raise got
    return got


def _bind(launch, dtype, head_dim):
    """(cache key, then what :func:`_compile` takes): ``launch``'s arguments bound and
    specialised as Triton's JIT entry does, on stand-ins typed like the real operands."""
    from triton import knobs  # noqa: PLC0415
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler.compiler import make_backend  # noqa: PLC0415
    from triton.experimental.gluon import language as gl  # noqa: PLC0415
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: PLC0415
    from triton.runtime.jit import create_function_from_signature  # noqa: PLC0415

    kernel = getattr(hopper, launch.kernel)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    gdt = {"bfloat16": gl.bfloat16, "float16": gl.float16}[dtype]
    descs = [TensorDescriptor(_Stand(dtype), [rows, head_dim], [head_dim, 1], [rows, head_dim],
                              gl.NVMMASharedLayout.get_default_for([rows, head_dim], gdt))
             for _, rows in launch.boxes]
    args = [a if isinstance(a, (int, float)) else _Stand("int32") for a in launch.args]
    pointers = [_Stand(_POINTER_DTYPES[n] or dtype) for n in launch.pointers]
    # What JITFunction.run adds to the caller's keywords before binding.
    kwargs = dict(launch.constexprs, num_warps=hopper.NUM_WARPS,
                  debug=kernel.debug or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*descs, *args, *pointers, **kwargs)
    key = (launch.kernel, repr(specialization), repr(sorted(options.items())))
    return key, kernel, backend, target, kwargs, bound, specialization, options


def _compile(kernel, backend, target, kwargs, bound, specialization, options):
    import triton  # noqa: PLC0415
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415

    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _ptr(buf) -> int:
    return int(buf.__cuda_array_interface__["data"][0])


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _device_of(ptr: int) -> int:
    """The device ordinal of the device buffer at ``ptr``."""
    value = ctypes.c_int()
    # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    err = _libcuda().cuPointerGetAttribute(ctypes.byref(value), 9, ctypes.c_uint64(ptr))
    if err:
        raise RuntimeError(f"cuPointerGetAttribute failed with CUDA error {err}")
    return value.value


def _loaded(compiled, key, ordinal: int):
    """``compiled`` loaded on device ``ordinal`` (Triton loads a kernel into the current
    device's context on its first launch; each device gets its own copy)."""
    c = _LOADED.get((key, ordinal))
    if c is None:
        import torch  # noqa: PLC0415
        from triton.compiler.compiler import CompiledKernel  # noqa: PLC0415

        with _LOCK:
            c = _LOADED.get((key, ordinal))
            if c is None:
                c = CompiledKernel(compiled.src, compiled.metadata_group, compiled.hash)
                with torch.cuda.device(ordinal):
                    c._init_handles()
                _LOADED[(key, ordinal)] = c
    return c


def operand_order(launch: hopper.Sm90Launch, outputs) -> tuple[list[str], list[int]]:
    """(names of ``launch``'s input operands: its boxes, then the input pointers, each once;
    positions in ``launch.args`` of its layout arrays). A launch's operands are those inputs,
    then the layout arrays, then ``outputs``."""
    boxed = [n for n, _ in launch.boxes]
    names = list(dict.fromkeys(boxed + [n for n in launch.pointers if n not in outputs]))
    return names, [i for i, a in enumerate(launch.args) if not isinstance(a, (int, float))]


def call(launch: hopper.Sm90Launch, dtype: str, head_dim: int, operands: dict,
         outputs: dict) -> dict:
    """Launch ``launch`` (compiled by :func:`compile_launch`, which must have succeeded) on
    ``operands`` (JAX arrays by operand name: its boxes and input pointers) inside XLA's
    computation; ``outputs`` the shapes and dtypes of the pointers it writes, by name. Returns
    the outputs by name, typed varying over the mesh axes any operand varies over."""
    bound = _bind(launch, dtype, head_dim)
    compiled, key = _compiled(bound), bound[0]
    in_names, array_pos = operand_order(launch, outputs)
    out_names = list(outputs)
    rows = {n: operands[n].size // head_dim for n, _ in launch.boxes}
    grid, constexprs = launch.grid, (*launch.constexprs.values(), hopper.NUM_WARPS)
    # The scalars; the layout arrays' slots filled per launch (no tracer kept here).
    static = [a if isinstance(a, (int, float)) else None for a in launch.args]

    def host(ctx, out_buffers, *in_buffers):
        ptrs = {n: _ptr(b) for n, b in zip(in_names, in_buffers, strict=False)}
        ptrs.update({n: _ptr(b) for n, b in zip(out_names, out_buffers, strict=True)})
        values = static[:]
        for i, b in zip(array_pos, in_buffers[len(in_names):], strict=True):
            values[i] = _ptr(b)
        # The kernel was compiled for 16-byte-aligned operands (as XLA allocates them).
        if any(p % 16 for p in ptrs.values()):
            raise ValueError(f"sm_90 {launch.kernel}: an operand is not 16-byte aligned "
                             f"({ {n: p % 16 for n, p in ptrs.items()} })")
        c = _loaded(compiled, key, _device_of(ptrs[in_names[0]]))
        c.run(*grid, ctx.stream, c.function, c.packed_metadata, None, None, None,
              *(hopper.LaunchBox(ptrs[n], rows[n], head_dim) for n, _ in launch.boxes),
              *values,
              *(ptrs[n] for n in launch.pointers), *constexprs)

    ins = [operands[n] for n in in_names] + [launch.args[i] for i in array_pos]
    axes = frozenset().union(*(compat.varying_axes(a) for a in ins))
    from jax.experimental.buffer_callback import buffer_callback  # noqa: PLC0415

    outs = buffer_callback(host, [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype))
                                  for s in outputs.values()])(*ins)
    return {n: compat.mark_varying(o, axes) for n, o in zip(out_names, outs, strict=True)}


def warn_fallback(what: str, exc: BaseException) -> None:
    """The warning a failed sm_90 compile gives before the call runs the portable kernels."""
    warnings.warn(f"the sm_90 {what} failed to compile here and JAX runs the portable kernels "
                  f"for this call: {type(exc).__name__}: {exc}"[:500], RuntimeWarning,
                  stacklevel=3)
