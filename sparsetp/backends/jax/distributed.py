"""Multi-process JAX without silent hangs: :func:`init_distributed` and :func:`deadline`.

What bounds a peer that stops (jax/jaxlib 0.10.2, measured in ``tests/jax_stall_test.py``):

* A peer that **dies** is bounded by JAX itself. A collective already in flight fails at once on
  gloo ("Gloo all-reduce failed: ... Connection closed by peer"); the coordination service marks
  the peer dead after ``heartbeat_timeout_seconds`` without a heartbeat and every other process
  then aborts ("Terminating process because the JAX distributed service detected fatal
  errors"), also one blocked at exit in the shutdown barrier. :func:`init_distributed` sets all
  of JAX's timeouts (connect, heartbeat, shutdown) to one ``timeout_s``.
* A peer that is **alive but stuck** (a hang, a deadlock, another code path) still sends
  heartbeats, so the coordination service never flags it, and XLA's cross-process collectives
  take no timeout from JAX: on CPU (gloo) the survivor waited more than 140 s in an all-reduce
  in our run (XLA's CPU runtime hard-codes 30 minutes); NCCL not tested. A blocked XLA call
  cannot be interrupted from Python, so :func:`deadline` is a watchdog: if the block has not
  finished after ``timeout_s`` it writes which step of which process was waiting to stderr and
  ends the process with ``os._exit`` (what torch's NCCL watchdog does on a timeout). The
  launcher (Slurm, Kubernetes, a test) sees a non-zero exit and a message instead of a hang.

>>> from sparsetp.backends.jax.distributed import deadline
>>> with deadline("a step that finishes", timeout_s=60):
...     pass
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import jax

__all__ = ["init_distributed", "deadline", "DEFAULT_TIMEOUT_S", "DEADLINE_EXIT_CODE"]

DEFAULT_TIMEOUT_S = 300  # as torch's init_distributed here: long enough for a slow compile
DEADLINE_EXIT_CODE = 3  # what a process ended by :func:`deadline` exits with

_timeout_s: float = DEFAULT_TIMEOUT_S  # set by init_distributed; deadline's default


def _check_timeout(timeout_s) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return timeout_s


def init_distributed(coordinator_address: str, num_processes: int, process_id: int, *,
                     timeout_s: int = DEFAULT_TIMEOUT_S, cpu_collectives: str | None = "gloo",
                     **kwargs) -> None:
    """``jax.distributed.initialize`` with every JAX timeout set to ``timeout_s`` seconds.

    ``initialization_timeout`` (connecting to the coordinator), ``heartbeat_timeout_seconds``
    (after this long without a heartbeat a process counts as dead and the others abort) and
    ``shutdown_timeout_seconds`` (the exit barrier) all become ``timeout_s``; it is also the
    default of :func:`deadline`, which bounds a peer that is alive but stuck.
    ``cpu_collectives`` sets ``jax_cpu_collectives_implementation`` first (CPU processes need
    gloo or mpi for cross-process collectives; None leaves it). Other keyword arguments go to
    ``jax.distributed.initialize``.

    Example (on every process, before any other JAX call)::

        init_distributed("HOST:1234", num_processes=2, process_id=ID, timeout_s=300)
    """
    global _timeout_s
    timeout_s = _check_timeout(timeout_s)
    seconds = max(1, int(round(timeout_s)))  # JAX takes whole seconds
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=seconds,
                               heartbeat_timeout_seconds=seconds,
                               shutdown_timeout_seconds=seconds, **kwargs)
    _timeout_s = seconds


@contextlib.contextmanager
def deadline(what: str, timeout_s: float | None = None) -> Iterator[None]:
    """End this process if the block has not finished after ``timeout_s`` (a stuck peer).

    Wrap the blocking part of a step, results included (``jax.block_until_ready``: dispatch is
    asynchronous, so a jitted call alone returns before its collectives run). On expiry it
    writes ``sparsetp: process P of N: <what> did not finish within T s ...`` to stderr and
    calls ``os._exit(DEADLINE_EXIT_CODE)``: a thread cannot interrupt a blocked XLA call, and
    a normal exit would wait in JAX's shutdown barrier for the stuck peer. An exception raised
    inside the block (e.g. gloo's error when a peer died) gets a note naming ``what`` and the
    process (Python >= 3.11) and propagates. ``timeout_s=None``: the ``init_distributed`` one
    (default 300 s).

    >>> import jax, jax.numpy as jnp
    >>> with deadline("train step", timeout_s=60):
    ...     y = jax.block_until_ready(jax.jit(jnp.sin)(1.0))
    """
    timeout_s = _check_timeout(_timeout_s if timeout_s is None else timeout_s)
    where = f"process {jax.process_index()} of {jax.process_count()}"
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s):
            return
        sys.stderr.write(
            f"sparsetp: {where}: {what} did not finish within {timeout_s:g} s: a peer process "
            f"is stuck (alive, not at the same collective) or died; exiting with code "
            f"{DEADLINE_EXIT_CODE} (sparsetp.backends.jax.distributed.deadline)\n")
        sys.stderr.flush()
        os._exit(DEADLINE_EXIT_CODE)

    threading.Thread(target=watch, name=f"sparsetp-deadline({what})", daemon=True).start()
    try:
        yield
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"sparsetp: {where}: raised during {what}")
        raise
    finally:
        done.set()
