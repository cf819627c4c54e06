"""Where the kernels run: the one rule, for both frontends.

* CUDA tensors (torch) / arrays on a GPU (JAX) run the compiled Triton kernels.
* CPU tensors / arrays run the *same* kernel sources in Triton's interpreter
  (:mod:`sparsetp.kernels.interpreter`): for correctness, not speed.
* Both in one process, with no environment variable and no restart. JAX picks per platform
  of the computation (``jax.lax.platform_dependent``), so one jitted function works on CPU and
  GPU devices alike.
* ``SPARSETP_INTERPRET=1`` is a debugging override: every torch launch, CUDA included, goes
  through the interpreter (JAX then stages only its CPU path: use it with CPU arrays).
  ``TRITON_INTERPRET=1`` set before the process starts has the same effect for torch (Triton
  then creates every kernel interpreted).

This module imports neither torch, jax nor triton.

Example::

    >>> device_kind("cpu")
    'interpreter'
"""

from __future__ import annotations

import os

__all__ = ["PLATFORMS", "force_interpreter", "device_kind"]

PLATFORMS = ("cpu", "cuda")


def force_interpreter() -> bool:
    """Whether ``SPARSETP_INTERPRET`` asks for the interpreter everywhere (read per call)."""
    value = os.environ.get("SPARSETP_INTERPRET", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"SPARSETP_INTERPRET must be 1 or 0, got {value!r}")


def device_kind(platform: str) -> str:
    """``"cuda"`` (compiled kernels) or ``"interpreter"`` for data on ``platform``."""
    if platform not in PLATFORMS:
        raise ValueError(f"sparsetp's kernels run on {PLATFORMS} data, got platform "
                         f"{platform!r}")
    if platform == "cpu" or force_interpreter():
        return "interpreter"
    from sparsetp.kernels import abi, interpreter  # noqa: PLC0415 (imports Triton)

    return "interpreter" if interpreter.is_interpreted(abi.kernel("fwd")) else "cuda"
