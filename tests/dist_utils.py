"""A small multi-process harness for torch.distributed tests (NCCL on GPUs, gloo on CPU).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh processes (spawn start
method), each joining its OWN process group through a fresh rendezvous file, runs
``fn(rank, world_size, *args)`` in each and returns the per-rank results (rank order; they must
pickle).

Devices (the suite's rule, :func:`backend_for`): a run of ``world_size`` ranks uses NCCL with one
GPU per rank when torch sees at least ``world_size`` GPUs, else gloo with every rank on the CPU
(CPU tensors: the kernels run in Triton's interpreter). The rank functions create their tensors
on torch's default device, which the harness sets in each rank: ``cuda:<rank>`` under NCCL,
``cpu`` under gloo (explicitly, whatever the machine has). A test that compares runs of several
sizes picks one backend for all of them, ``backend_for(largest size)``, so that one device type
computes every number it compares. ``backend="nccl"`` with too few GPUs is an error, not a
silent fallback.

It never hangs and never leaks processes:

* a rank that raises sends its traceback; the harness kills the other ranks at once (they may
  be blocked in a collective waiting for it) and raises :class:`RankFailedError` with it;
* a rank that dies without a word (segfault, abort, os._exit) fails the run with its exit code;
* the whole run has a wall-clock ``timeout`` (:class:`RankTimeoutError`), and each rank's
  process group a ``pg_timeout`` (default: ``timeout``), after which a collective some rank
  never joins raises in the ranks that did (``comm.CollectiveError`` from the library's
  collectives), rather than blocking until the harness kills them;
* processes are terminated (then killed) in a ``finally``.

A rank that succeeded passes a barrier before ``destroy_process_group``: without it gloo
teardown aborted in about 1 of 4 otherwise passing runs.

``fn`` must be a module-level function (it is pickled by name). Each rank uses one intra-op
thread (several ranks share few cores).

Example::

    def _work(rank, world, n):
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t.numpy()

    results = run_distributed(_work, 2, 3)   # [array([1., 1., 1.]), array([1., 1., 1.])]

Spawning costs more than most checks on a CPU host (each rank imports torch and the library:
~4 s for 2 ranks on 2 cores), so a test class whose tests would each spawn the same process
group registers them in a :class:`SharedLaunches` instead: every check of one (world size,
backend) runs in ONE launch, in registration order, on the first test that needs one of them::

    launches = SharedLaunches()
    launches.add("mlp", 2, _check_mlp, "float32")     # at class set-up: nothing spawns yet
    launches.add("block", 2, _check_block, timeout=180)
    launches.result("block")                          # spawns 2 ranks running both; per-rank

A check that fails fails every test of its launch, with the check's name and the rank's
traceback (a rank that raises leaves the others blocked in collectives: the launch cannot go
on). Before each check, torch's global generator is reseeded to a fresh process's seed, so a
check draws what it drew in a launch of its own.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_lib
import shutil
import socket
import tempfile
import time
import traceback

__all__ = ["run_distributed", "backend_for", "gpu_count", "generator", "RankFailedError",
           "RankTimeoutError", "free_port", "SharedLaunches"]


class RankFailedError(AssertionError):
    """A rank raised (its traceback is in the message) or died with a non-zero exit code."""


class RankTimeoutError(AssertionError):
    """The ranks did not all finish within the timeout."""


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """GPUs torch sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_for(world_size: int) -> str:
    """The process-group backend a test of ``world_size`` ranks runs on: "nccl" (one GPU per
    rank) when torch sees ``world_size`` GPUs and has NCCL, else "gloo" (CPU ranks).

    >>> backend_for(2)        # "gloo" on a CPU machine or one with a single GPU
    """
    import torch.distributed as dist

    return "nccl" if gpu_count() >= world_size and dist.is_nccl_available() else "gloo"


def generator(seed: int):
    """A ``torch.Generator`` seeded ``seed`` on torch's default device: in a rank function, the
    rank's device (the same draws on every rank of one backend)."""
    import torch

    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def _worker(rank, world_size, init_method, backend, pg_timeout, fn, args, results):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":  # one GPU per rank; tensors the rank creates land on it
            torch.cuda.set_device(rank)
            torch.set_default_device(f"cuda:{rank}")
        else:  # CPU ranks, even where GPUs are visible
            torch.set_default_device("cpu")
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "done", None))
    except BaseException:  # report everything (incl. KeyboardInterrupt/SystemExit) to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0,
                    backend: str | None = None, pg_timeout: float | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; per-rank results.

    ``backend=None`` takes :func:`backend_for` ``(world_size)``; "gloo" runs CPU ranks anywhere;
    "nccl" needs ``world_size`` GPUs (ValueError otherwise, before any process starts).
    ``pg_timeout``: seconds, the ranks' ``init_process_group(timeout=...)`` (default
    ``timeout``)."""
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    if not pg_timeout > 0:
        raise ValueError(f"pg_timeout must be > 0 seconds, got {pg_timeout!r}")
    backend = backend or backend_for(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and gpu_count() < world_size:
        raise ValueError(f"backend='nccl' with {world_size} ranks needs {world_size} GPUs; "
                         f"torch sees {gpu_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # A file rendezvous, not a TCP port: a port found free here can be taken by another test
    # process before rank 0 binds it (EADDRINUSE under many xdist workers).
    store_dir = tempfile.mkdtemp(prefix="sparsetp-pg-")
    init_method = "file://" + os.path.join(store_dir, "store")
    procs = [ctx.Process(target=_worker, name=f"rank{r}", daemon=True,
                         args=(r, world_size, init_method, backend, pg_timeout, fn, args,
                               results))
             for r in range(world_size)]
    outputs: dict[int, object] = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(done) < world_size:
            try:
                msg = results.get(timeout=0.05)
            except queue_lib.Empty:
                msg = None
            if msg is None:
                if time.monotonic() > deadline:
                    raise RankTimeoutError(
                        f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f} s; "
                        f"ranks done: {sorted(done)}")
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if not dead:
                    continue
                try:  # a message put just before exiting may still be in the pipe
                    msg = results.get(timeout=1.0)
                except queue_lib.Empty:
                    raise RankFailedError(
                        f"rank {dead[0]} of {world_size} exited with code "
                        f"{procs[dead[0]].exitcode} without reporting (crash?) in "
                        f"{fn.__name__}") from None
            rank, kind, payload = msg
            if kind == "error":
                raise RankFailedError(
                    f"rank {rank} of {world_size} failed in {fn.__name__}:\n{payload}")
            if kind == "ok":
                outputs[rank] = payload
            else:
                done.add(rank)
        for r, p in enumerate(procs):
            p.join(max(1.0, deadline - time.monotonic()))
            if p.exitcode != 0:
                raise RankFailedError(
                    f"rank {r} of {world_size} reported success but exited with code "
                    f"{p.exitcode} in {fn.__name__}")
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        results.join_thread()
        shutil.rmtree(store_dir, ignore_errors=True)



def _run_checks(rank, world_size, checks):
    """Rank function of a :class:`SharedLaunches` launch: ``{name: fn(rank, world, *args)}``,
    each check started from a fresh process's torch generator state."""
    import torch

    seed = torch.initial_seed()  # a fresh process's default seed (this one is fresh)
    out = {}
    for name, fn, args in checks:
        torch.manual_seed(seed)
        try:
            out[name] = fn(rank, world_size, *args)
        except BaseException as err:
            raise RuntimeError(f"check {name!r} ({fn.__name__}) failed on rank {rank} of "
                               f"{world_size}") from err
    return out


class SharedLaunches:
    """Checks run together: one :func:`run_distributed` launch per (world size, backend).

    ``add(name, world, fn, *args, timeout=, backend=, pg_timeout=)`` registers
    ``fn(rank, world, *args)`` (``backend=None``: :func:`backend_for` ``(world)``, resolved at
    launch); ``result(name)`` returns its per-rank results, as ``run_distributed`` would, running
    the launch of its (world, backend) first if it has not run. A launch's timeout is the sum of
    its checks' timeouts, its ``pg_timeout`` the largest of theirs (each defaulting to its
    timeout, as in ``run_distributed``). A failed launch raises, for each of its checks, the
    harness's error (the failing check named in it)."""

    def __init__(self):
        self._checks: dict[str, tuple] = {}
        self._done: dict[tuple[int, str], object] = {}

    def add(self, name: str, world: int, fn, *args, timeout: float = 120.0,
            backend: str | None = None, pg_timeout: float | None = None) -> None:
        if name in self._checks:
            raise ValueError(f"check {name!r} is already registered")
        self._checks[name] = (world, backend, fn, args, timeout,
                              timeout if pg_timeout is None else pg_timeout)

    def _key(self, name: str) -> tuple[int, str]:
        world, backend = self._checks[name][:2]
        return world, backend or backend_for(world)

    def result(self, name: str) -> list:
        key = self._key(name)
        if key not in self._done:
            members = [n for n in self._checks if self._key(n) == key]
            specs = [self._checks[n] for n in members]
            try:
                self._done[key] = run_distributed(
                    _run_checks, key[0], [(n, s[2], s[3]) for n, s in zip(members, specs,
                                                                            strict=True)],
                    timeout=sum(s[4] for s in specs), backend=key[1],
                    pg_timeout=max(s[5] for s in specs))
            except (RankFailedError, RankTimeoutError) as err:
                self._done[key] = (type(err), f"shared launch of {members} on {key[0]} "
                                              f"{key[1]} ranks: {err}")
        done = self._done[key]
        if isinstance(done, tuple):
            raise done[0](done[1])
        return [per_rank[name] for per_rank in done]
