"""What the benchmark commands share: output flags, versions, JSON, progress and timing.

Flags defined by :func:`define_flags` (shared by every command, so the command modules must not
redefine them): ``--out_dir`` (where JSON and plots go), ``--device`` (auto|cpu|cuda),
``--plots``. Commands define their flags when they run, not at import (see define_flags).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import queue as queue_lib
import subprocess
import sys
import time

from absl import flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define the shared flags (idempotent). Commands call this in ``main``, not at import:
    the test suite imports the bench modules next to ``tests/parity_test.py``, whose flags
    (``--device``, ``--patterns``, ...) share these generic names."""
    if "out_dir" not in FLAGS:
        flags.DEFINE_string("out_dir", "bench_results",
                            "Directory for the JSON results and the plots.")
    if "device" not in FLAGS:
        flags.DEFINE_enum("device", "auto", ["auto", "cpu", "cuda"],
                          "Where to run (auto: the cpu preset on CPU, the GPU presets on the "
                          "GPU if there is one).")
    if "plots" not in FLAGS:
        flags.DEFINE_bool("plots", True, "Draw plots (matplotlib) next to the JSON.")


def versions(device: str | None = None) -> dict:
    """Versions and device of this process, for every JSON result (frameworks only if imported
    or importable; nothing is initialised on their behalf except torch's CUDA query).

    ``device``: what the run computes on, "cpu" or "cuda" (None: the GPU if torch sees one).
    ``device`` in the result names it: a CPU run on a GPU machine says ``cpu (N cores)``, and
    ``gpus_visible`` how many GPUs it left alone. jax_triton's version comes from its package
    metadata: importing it starts JAX's CUDA backend and clears ``TRITON_CACHE_DIR`` (0.3.1).
    """
    out = {"python": platform.python_version(), "platform": platform.platform(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": sys.argv}
    for name in ("numpy", "triton", "torch", "jax"):
        try:
            mod = __import__(name)
        except Exception:  # noqa: BLE001
            continue
        out[name] = getattr(mod, "__version__", "?")
    try:
        out["jax_triton"] = importlib.metadata.version("jax-triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    if "torch" in sys.modules:
        import torch  # noqa: PLC0415

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and device != "cpu":
            out["device"] = torch.cuda.get_device_name()
            out["device_count"] = gpus
        else:
            out["device"] = f"cpu ({os.cpu_count()} cores)"
            out["gpus_visible"] = gpus
    return out


def write_json(path: str, obj) -> str:
    """Write ``obj`` as indented JSON (creating directories); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)  # a reader never sees half a file, even if the run is killed
    return path


def _json_default(o):
    import numpy as np  # noqa: PLC0415

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serialisable: {type(o)}")


def progress(iterable, desc: str, total: int | None = None):
    """A tqdm progress bar on stderr (benchmarks run for minutes)."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, dynamic_ncols=True)


def spawn_ranks(target, world: int, args: tuple, on_record, timeout: float, name: str,
                record_kind: str) -> None:
    """Run ``target(rank, *args, queue)`` in ``world`` spawned processes and wait for them.

    A rank puts ``(record_kind, who, payload)`` for each result (handed to
    ``on_record(who, payload)`` as it arrives), ``("done", rank, None)`` when it ends, or any
    other kind with a traceback when it fails (raised here as RuntimeError). TimeoutError past
    ``timeout`` seconds; RuntimeError naming a rank that died. Every process is ended on exit.
    """
    import multiprocessing as mp  # noqa: PLC0415

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, q), daemon=True, name=f"{name}{r}")
             for r in range(world)]
    done, end = set(), time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(done) < world:
            try:
                kind, who, payload = q.get(timeout=0.2)
            except queue_lib.Empty:
                if time.monotonic() > end:
                    raise TimeoutError(f"{name} ranks did not finish in {timeout:.0f} s") from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in done]
                if dead:
                    raise RuntimeError(f"{name} rank {dead[0]} died with exit code "
                                       f"{procs[dead[0]].exitcode}") from None
                continue
            if kind == record_kind:
                on_record(who, payload)
            elif kind == "done":
                done.add(who)
            else:
                raise RuntimeError(f"{name} rank {who} failed:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if len(done) == world else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()


def run_json_subprocess(cmd: list, env: dict, timeout: float, out: str) -> tuple[dict, str | None]:
    """Run ``cmd`` (a child that writes its results as JSON to ``out`` as it goes) within
    ``timeout`` seconds; returns ``(what it wrote, or {}; an error line or None)``: a nonzero
    exit (with the end of its stderr) or a timeout, while keeping whatever it wrote before."""
    err = None
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            err = f"JAX subprocess exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    except subprocess.TimeoutExpired as e:
        err = f"JAX subprocess timed out after {e.timeout:.0f} s"
    got = {}
    if os.path.exists(out):
        with open(out) as f:
            got = json.load(f)
    return got, err
