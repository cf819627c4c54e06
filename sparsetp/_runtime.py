"""Where the kernels run: the one rule, for both frontends.

* CUDA tensors (torch) / arrays on a GPU (JAX) run the compiled Triton kernels.
* CPU tensors / arrays run the native CPU path (device kind ``"cpu"``):
  :mod:`sparsetp.backends.torch.cpu` (batched torch matmuls over the gathered tiles) and
  :mod:`sparsetp.backends.jax.cpu` (the same algorithm in ``jax.numpy``, so ``jit``, ``grad``
  and ``vmap`` see plain XLA), on the same layout metadata with the kernels' semantics.
* The kernel sources themselves run on CPU data in Triton's interpreter
  (:mod:`sparsetp.kernels.interpreter`, device kind ``"interpreter"``) when
  ``SPARSETP_INTERPRET=1``: for checking the kernels without a GPU, not for speed.
* Both in one process, with no environment variable and no restart. JAX picks per platform
  of the computation (``jax.lax.platform_dependent``), so one jitted function works on CPU and
  GPU devices alike.
* ``SPARSETP_INTERPRET=1`` is a debugging override: every torch launch, CPU and CUDA, goes
  through the interpreter (JAX then stages only its CPU path, in the interpreter: use it with
  CPU arrays).
  ``TRITON_INTERPRET=1`` set before the process starts has the same effect on torch's CUDA
  launches (Triton then creates every kernel interpreted); CPU data stays native.

This module imports neither torch, jax nor triton.

Example::

    >>> device_kind("cpu")
    'cpu'
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
    """How data on ``platform`` runs: ``"cuda"`` (compiled kernels), ``"cpu"`` (the native CPU
    path, no Triton) or ``"interpreter"`` (the kernels in Triton's interpreter).

    Only ``"cuda"`` and ``"interpreter"`` are kernel device kinds
    (:data:`sparsetp.kernels.tiles.DEVICE_KINDS`): the native path runs a layout as it is."""
    if platform not in PLATFORMS:
        raise ValueError(f"sparsetp's kernels run on {PLATFORMS} data, got platform "
                         f"{platform!r}")
    if force_interpreter():
        return "interpreter"
    if platform == "cpu":
        return "cpu"
    from sparsetp.kernels import abi, interpreter  # noqa: PLC0415 (imports Triton)

    return "interpreter" if interpreter.is_interpreted(abi.kernel("fwd")) else "cuda"
