"""Launch the sm_90 forward and backward (:mod:`sparsetp.kernels.hopper`) from JAX.

jax_triton cannot launch these kernels (it passes no TMA descriptors and launches
``num_warps`` warps, not the producer and consumer partitions), so this launcher does what the
torch one does after its first call, inside XLA's computation:

* **compile ahead**, at trace time: :func:`compile_launch` binds and specialises the kernel's
  arguments exactly as Triton's JIT entry does (so torch and JAX run the same binary for the
  same call) and compiles it for sm_90; a failure warns and the call runs the portable kernels
  (:func:`failed` keeps the reason, which ``sparsetp.jax.forward_kernel`` reports);
* **launch** from an XLA FFI custom call (``sm90_launch.cc`` beside this file) on XLA's stream:
  the handler loads the cubin on each device once, encodes the TMA descriptors from the
  operands' addresses and calls ``cuLaunchKernelEx`` with Triton's parameter packing. No Python
  runs per launch (a Python callback cost more host time than the 0.13-0.17 ms kernels of a
  short forward: ``benchmarks/KERNEL_NOTES.md``, "JAX launches from C++"), and no torch is
  needed.

The handler is C++ built at run time, once per machine and source (a C++17 compiler: ``$CXX``,
else ``g++``, ``c++`` or ``clang++``; XLA's FFI headers from jaxlib and ``cuda.h`` from Triton's
NVIDIA backend, no CUDA toolkit), into ``$SPARSETP_CACHE_DIR`` (default
``~/.cache/sparsetp``). Where it cannot build, :func:`unavailable` gives the reason, a warning
says so once, and calls run the portable kernels (``forward_kernel`` reports why). Triton's
launch hooks (profilers) are not called for these launches.

Example (on any machine; a reason where the fast path cannot launch from JAX here):

    >>> from sparsetp.backends.jax import hopper
    >>> hopper.unavailable() is None or isinstance(hopper.unavailable(), str)
    True
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from sparsetp.backends.jax import compat
from sparsetp.kernels import abi, hopper

__all__ = ["unavailable", "capability", "compile_launch", "failed", "operand_order", "call",
           "warn_fallback"]

_LOCK = threading.Lock()
# Keyed as Triton's JIT cache is, by the kernel and its arguments' specialisation (types,
# "equals 1", "divisible by 16") and options, so new lengths or scales reuse a binary.
_COMPILED: dict = {}  # compile key -> CompiledKernel (or the exception it raised)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_launch.cc")
_TARGET = "sparsetp_sm90"  # the FFI target's name


@functools.cache
def unavailable() -> str | None:
    """Why this process cannot launch the sm_90 kernels from JAX, or None. Builds (or loads
    from the cache) the launcher's C++ handler on its first call; a failed build warns once."""
    if not hasattr(jax, "ffi") or not hasattr(jax.ffi, "ffi_call"):
        return "this JAX has no jax.ffi (JAX >= 0.4.35 has it)"
    try:
        _library()
    except Exception as exc:  # noqa: BLE001 (any build or load failure: reported, not raised)
        text = str(exc).strip().splitlines()
        why = f"the launcher's C++ handler did not build: {type(exc).__name__}: " + (
            text[0] if text else "")
        warnings.warn(f"sparsetp: {why}; JAX calls run the portable kernels on sm_90 "
                      "(sparsetp.backends.jax.hopper.unavailable() keeps the reason)",
                      RuntimeWarning, stacklevel=2)
        return why
    return None


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("no C++ compiler found ($CXX, g++, c++ or clang++)")


@functools.cache
def _library() -> ctypes.CDLL:
    """The handler's shared library (built once per source, jaxlib and compiler), its FFI
    target registered with XLA for CUDA."""
    import jaxlib  # noqa: PLC0415
    import triton  # noqa: PLC0415

    cxx = _compiler()
    includes = [jax.ffi.include_dir(),
                os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")]
    path = abi.cached_build("sm90_launch", _SOURCE, (jaxlib.__version__, cxx, includes))
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            cmd = [cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-w",
                   *(f"-I{i}" for i in includes), _SOURCE, "-o", tmp, "-ldl"]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"{abi.first_diagnostic(done.stderr)}\n{' '.join(cmd)} "
                                   f"failed:\n{done.stderr[-2000:]}")
            os.replace(tmp, path)  # atomic: concurrent builders each write a whole file
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    lib = ctypes.CDLL(path)
    lib.sparsetp_sm90_register.restype = ctypes.c_int32
    lib.sparsetp_sm90_register.argtypes = [
        ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    lib.sparsetp_sm90_plans.restype = ctypes.c_int64
    lib.sparsetp_sm90_modules.restype = ctypes.c_int64
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SparsetpSm90Launch),
                                platform="CUDA")
    return lib


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
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs),
                              target=target, options=options.__dict__)
    # Refused here, so the failure is kept and the call falls back with a warning.
    needs = abi.unlaunchable(compiled.metadata)
    if needs:
        raise NotImplementedError(f"sm_90 {compiled.metadata.name} needs {', '.join(needs)}, "
                                  "which the JAX launcher does not set up")
    return compiled


# Parameter kinds of a plan (sm90_launch.cc).
_KINDS = {"lit32": 0, "lit64": 1, "pointer": 2, "array": 2, "tma": 3}


def _plan(launch, compiled, operand: dict, array_operand: dict, rows: dict,
          head_dim: int) -> int:
    """Register ``launch``'s plan (``compiled``'s cubin, grid and parameters in Triton 3.6's
    packing, :func:`sparsetp.kernels.hopper.parameters`; operands by index: ``operand`` by
    name, ``array_operand`` by position in ``launch.args``) with the handler; returns its key,
    a hash of its contents."""
    md = compiled.metadata  # launchable here: _compile checked abi.unlaunchable
    params, specs = hopper.parameters(launch, compiled, rows, head_dim)
    kinds = [_KINDS[kind] for kind, _ in params]
    # The handler's cells are int64: a 64-bit literal's bits as a signed value.
    values = [operand[v] if kind == "pointer" else array_operand[v] if kind == "array"
              else v - (1 << 64) if v >= 1 << 63 else v for kind, v in params]
    tma = [[operand[t.name], t.rows, t.d, t.box_rows, t.box_cols, t.elem_type, t.elem_size,
            t.swizzle] for t in specs]
    cubin, name = compiled.asm["cubin"], md.name.encode()
    geometry = [*launch.grid, 32 * md.num_warps, md.shared]
    flat_tma = [x for t in tma for x in t]
    digest = hashlib.blake2b(cubin + name + repr((geometry, kinds, values, flat_tma)).encode(),
                             digest_size=8).digest()
    key = int.from_bytes(digest, "little", signed=True)
    _library().sparsetp_sm90_register(
        key, cubin, len(cubin), name, (ctypes.c_int64 * 5)(*geometry), len(kinds),
        (ctypes.c_int32 * len(kinds))(*kinds), (ctypes.c_int64 * len(values))(*values),
        len(tma), (ctypes.c_int64 * max(1, len(flat_tma)))(*flat_tma))
    return key


def operand_order(launch: hopper.Sm90Launch, outputs) -> tuple[list[str], list[int]]:
    """(names of ``launch``'s input operands: its boxes, then the input pointers, each once;
    positions in ``launch.args`` of its layout arrays). A launch's operands are those inputs,
    then the layout arrays, then ``outputs`` (a box may be one: the forward stores O by TMA)."""
    boxed = [n for n, _ in launch.boxes if n not in outputs]
    names = list(dict.fromkeys(boxed + [n for n in launch.pointers if n not in outputs]))
    return names, [i for i, a in enumerate(launch.args) if not isinstance(a, (int, float))]


def call(launch: hopper.Sm90Launch, dtype: str, head_dim: int, operands: dict,
         outputs: dict) -> dict:
    """Launch ``launch`` (compiled by :func:`compile_launch`, which must have succeeded) on
    ``operands`` (JAX arrays by operand name: its boxes and input pointers) inside XLA's
    computation; ``outputs`` the shapes and dtypes of the pointers it writes, by name. Returns
    the outputs by name, typed varying over the mesh axes any operand varies over."""
    compiled = compile_launch(launch, dtype, head_dim)
    in_names, array_pos = operand_order(launch, outputs)
    out_names = list(outputs)
    # Operand indices as the handler sees them: the inputs, the layout arrays, the outputs.
    operand = {n: i for i, n in enumerate(in_names)}
    operand.update({n: len(in_names) + len(array_pos) + i for i, n in enumerate(out_names)})
    array_operand = {pos: len(in_names) + j for j, pos in enumerate(array_pos)}
    rows = {n: math.prod((operands[n] if n in operands else outputs[n]).shape) // head_dim
            for n, _ in launch.boxes}
    key = _plan(launch, compiled, operand, array_operand, rows, head_dim)
    ins = [operands[n] for n in in_names] + [launch.args[i] for i in array_pos]
    outs = jax.ffi.ffi_call(_TARGET, [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype))
                                      for s in outputs.values()])(*ins, plan=np.int64(key))
    return dict(zip(out_names, compat.mark_varying_like(outs, ins), strict=True))


def warn_fallback(what: str, exc: BaseException) -> None:
    """The warning a failed sm_90 compile gives before the call runs the portable kernels."""
    warnings.warn(f"the sm_90 {what} failed to compile here and JAX runs the portable kernels "
                  f"for this call: {type(exc).__name__}: {exc}"[:500], RuntimeWarning,
                  stacklevel=3)
