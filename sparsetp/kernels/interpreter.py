"""Run the kernels in Triton's interpreter, beside their compiled versions, in one process.

Triton decides between compiled and interpreted kernels when each ``@triton.jit`` function is
created (``TRITON_INTERPRET``), for the whole process, its own library functions (``tl.sum``,
``tl.max``, ...) included. sparsetp wants both at once: CUDA tensors run the compiled kernels,
CPU tensors the same sources in the interpreter. :func:`launch` does that by wrapping a
kernel's Python function in Triton's ``InterpretedFunction`` and, for the duration of the
launch, letting calls of compiled-mode ``@triton.jit`` helpers inside it run interpreted too.

That relies on private pieces of Triton (``JITFunction.__call__`` and the interpreter's
``_patch_lang`` / ``_patch_lang_tensor``), so it is enabled only for the Triton versions it was
tested with (:data:`SIDE_BY_SIDE_TRITON`). With another Triton the public way still works: start the
process with ``TRITON_INTERPRET=1`` (every kernel is then created interpreted); otherwise a
CPU launch raises a ``RuntimeError`` that says so. ``tests/interpreter_test.py`` covers both.

The interpreter is not thread-safe: every interpreted launch in the process, from either
frontend, holds :data:`LOCK`.

Example::

    >>> import torch, triton, triton.language as tl
    >>> @triton.jit
    ... def twice(x_ptr, y_ptr, N: tl.constexpr):
    ...     offs = tl.arange(0, N)
    ...     tl.store(y_ptr + offs, tl.load(x_ptr + offs) * 2)
    >>> x, y = torch.arange(8.0), torch.empty(8)
    >>> launch(twice, (1,), (x, y), {"N": 8})
    >>> y.tolist()
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import triton
from triton.runtime import interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["LOCK", "SIDE_BY_SIDE_TRITON", "side_by_side", "is_interpreted", "launch"]

# Re-entrant, so a launch may nest inside another frontend's locked section.
LOCK = threading.RLock()
# [low, high) Triton versions whose private interpreter hooks this module uses (3.6 on the GPU
# machine and 3.9 in CI are tested; 3.7 and 3.8 have the same hooks).
SIDE_BY_SIDE_TRITON = ((3, 6), (3, 10))

_WRAPPED: dict = {}


def _version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def side_by_side() -> bool:
    """Whether interpreted launches may run in a process whose kernels are compiled."""
    low, high = SIDE_BY_SIDE_TRITON
    return (low <= _version() < high and "__call__" in vars(JITFunction)
            and hasattr(_interp, "_patch_lang") and hasattr(_interp, "_patch_lang_tensor"))


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was created interpreted (``TRITON_INTERPRET=1`` at its creation)."""
    fn = kernel
    while not isinstance(fn, InterpretedFunction) and hasattr(fn, "fn"):
        fn = fn.fn  # Heuristics / Autotuner wrap the function
    return isinstance(fn, InterpretedFunction)


def _interpreted(kernel) -> InterpretedFunction:
    if isinstance(kernel, InterpretedFunction):
        return kernel
    fn = kernel.fn
    hit = _WRAPPED.get(fn)
    if hit is None:
        hit = _WRAPPED[fn] = InterpretedFunction(fn)
    return hit


def _call_interpreted(self, *args, **kwargs):
    """``JITFunction.__call__`` during an interpreted launch: a device-function call, as
    ``InterpretedFunction.__call__`` makes it, except that the language patches it applies are
    undone afterwards. Triton leaves them in place (harmless when every kernel is interpreted,
    but a later compile would then build IR through the interpreter's semantics)."""
    scope = _interp._patch_lang(self.fn)
    try:
        return _interpreted(self).rewrite()(*args, **kwargs)
    finally:
        scope.restore()


def _patch_lang_tensor(tensor, scope):
    """Triton 3.6's interpreter converts loop bounds with ``int(array of shape (1,))``, which
    NumPy >= 2.3 refuses; 3.9 squeezes first. Same hook, squeezing."""
    _ORIG_PATCH_LANG_TENSOR(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


_ORIG_PATCH_LANG_TENSOR = getattr(_interp, "_patch_lang_tensor", None)


@contextlib.contextmanager
def _hooks(nested_calls: bool) -> Iterator[None]:
    """Triton's hooks for one launch, restored after it: the loop-bound fix where the hook
    exists, and with ``nested_calls`` compiled-mode device functions run interpreted."""
    saved_call = JITFunction.__call__
    if nested_calls:
        JITFunction.__call__ = _call_interpreted
    if _ORIG_PATCH_LANG_TENSOR is not None:
        _interp._patch_lang_tensor = _patch_lang_tensor
    try:
        yield
    finally:
        JITFunction.__call__ = saved_call
        if _ORIG_PATCH_LANG_TENSOR is not None:
            _interp._patch_lang_tensor = _ORIG_PATCH_LANG_TENSOR


def launch(kernel, grid: Sequence[int], args: Sequence[Any],
           constexprs: Mapping[str, Any]) -> None:
    """Run ``kernel[grid](*args, **constexprs)`` in Triton's interpreter (tensors of any
    device; Triton copies CUDA tensors to the host and back)."""
    grid = tuple(int(g) for g in grid)
    with LOCK:
        # A TRITON_INTERPRET=1 process on an untested Triton: the public path, kernel[grid].
        public = is_interpreted(kernel) and not side_by_side()
        if not public and not side_by_side():
            raise RuntimeError(
                f"Triton {triton.__version__} is not among the versions whose interpreter "
                f"sparsetp can run beside compiled kernels ({SIDE_BY_SIDE_TRITON[0]} to "
                f"{SIDE_BY_SIDE_TRITON[1]}, exclusive); start the process with "
                "TRITON_INTERPRET=1 to run every kernel in the interpreter")
        with _hooks(nested_calls=not public):
            (kernel if public else _interpreted(kernel))[grid](*args, **constexprs)
