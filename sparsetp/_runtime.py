"""Decide, without importing torch or jax, whether Triton kernels run compiled or interpreted.

Triton reads ``TRITON_INTERPRET`` when each ``@triton.jit`` function is *created*, i.e. when
:mod:`sparsetp.kernels.attention` is imported. :func:`configure` must therefore run before that
import; :mod:`sparsetp.kernels` calls it first thing, so ``import sparsetp.kernels`` is enough.

Rules, in order:

1. ``SPARSETP_INTERPRET=1`` forces the interpreter, ``SPARSETP_INTERPRET=0`` forces compiled
   kernels (an error at launch if there is no GPU).
2. An explicit ``TRITON_INTERPRET`` already in the environment is respected.
3. Otherwise a CUDA GPU is looked for through the driver API (``libcuda``: ``cuInit`` then
   ``cuDeviceGetCount``) with ctypes, which costs milliseconds and initialises no framework.
   No driver or no device -> ``TRITON_INTERPRET=1``.

Triton bakes the choice into its *own* ``@triton.jit`` library functions (``tl.sum``, ``tl.max``,
...) when ``triton.language`` is first imported. A process that imported Triton before sparsetp
chose the interpreter therefore cannot interpret our kernels (Triton's error would be "Cannot call
@triton.jit'd outside of the scope of a kernel"); :func:`configure` detects this and raises a
``RuntimeError`` that says what to do instead.

The decision is made once per process (Triton's choice is baked into the kernel objects), and
:func:`interpret_mode` reports it. Frontends pick the launch path per tensor device: CUDA tensors
need compiled kernels, CPU tensors need the interpreter.

Example::

    >>> from sparsetp import _runtime
    >>> isinstance(_runtime.interpret_mode(), bool)
    True
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

__all__ = ["configure", "interpret_mode", "cuda_available", "INTERPRETER_LOCK"]

# Triton's interpreter is not thread-safe (two JAX CPU devices calling back at once crashed a
# process, GPU.md): every interpreted launch in the process, from either frontend, holds this
# one lock. Re-entrant, so a launch may nest inside another frontend's locked section.
INTERPRETER_LOCK = threading.RLock()

_DECIDED: bool | None = None
_CUDA: bool | None = None


def cuda_available() -> bool:
    """True when the CUDA driver loads and reports at least one device (cached)."""
    global _CUDA
    if _CUDA is None:
        _CUDA = _probe_cuda()
    return _CUDA


def _probe_cuda() -> bool:
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return False
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return False
            return count.value > 0
        except AttributeError:
            return False
    return False


def _flag(value: str | None) -> bool | None:
    if value is None or value.strip() == "":
        return None
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"SPARSETP_INTERPRET must be 1 or 0, got {value!r}")


def configure() -> bool:
    """Set ``TRITON_INTERPRET`` for this process (once) and return whether kernels interpret."""
    global _DECIDED
    if _DECIDED is not None:
        return _DECIDED
    forced = _flag(os.environ.get("SPARSETP_INTERPRET"))
    if forced is None:
        triton_flag = os.environ.get("TRITON_INTERPRET")
        if triton_flag is not None and triton_flag.strip() != "":
            forced = triton_flag.strip() not in ("0", "")
    interpret = (not cuda_available()) if forced is None else forced
    if interpret:
        _check_triton_not_compiled_mode()
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    _DECIDED = interpret
    return interpret


def _check_triton_not_compiled_mode() -> None:
    standard = sys.modules.get("triton.language.standard")
    if standard is None:  # Triton's language not imported yet: the env var will take effect
        return
    kind = type(getattr(standard, "sum", None)).__name__
    if kind != "InterpretedFunction":
        raise RuntimeError(
            "sparsetp needs Triton's interpreter here (no CUDA GPU found, or "
            "SPARSETP_INTERPRET=1), but Triton was imported before sparsetp and built its "
            "library functions for compiled kernels. Import sparsetp (or sparsetp.torch / "
            "sparsetp.jax) before triton, or set TRITON_INTERPRET=1 in the environment before "
            "the process starts.")


def interpret_mode() -> bool:
    """Whether the kernels of this process run in Triton's interpreter."""
    return configure()
