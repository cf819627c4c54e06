"""Triton kernels (``attention``) and their framework-neutral launch logic (``launch``).

Importing this package first calls :func:`sparsetp._runtime.configure`, which sets
``TRITON_INTERPRET=1`` when no CUDA GPU is present (Triton reads it when the ``@triton.jit``
functions are created), so the same kernels run on CPU under Triton's interpreter.
"""

from sparsetp import _runtime

_runtime.configure()  # must precede the kernel imports below

from sparsetp.kernels import attention, launch  # noqa: E402

__all__ = ["attention", "launch"]
