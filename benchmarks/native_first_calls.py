"""Question: what do a process's first backwards cost while the native extension builds or
loads? A build *thread* in the user's process (how ``native.py`` built it until session 30,
``cpp_extension.load`` in a daemon thread) against the build *process* it uses now
(``native_build.py``), each with a cold cache (nothing built) and a warm one (built before).

Each arm is a fresh process (the point is a process's first calls): one forward to compile,
then forward + backward calls back to back, each synced, for ``--seconds``; per call its wall
time and ``native.status()``. Reported per arm: the median and worst call of the first
``--window_s`` seconds, the median of the last second, and when the extension became ready.
GPU only (a CUDA backward starts the build)::

    python benchmarks/native_first_calls.py --out=$OUT/native_first_calls.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "native_first_calls.json", "where to write the JSON")
flags.DEFINE_float("seconds", 4.0, "how long each arm calls forward + backward")
flags.DEFINE_float("window_s", 1.0, "the first calls' window")
flags.DEFINE_integer("n", 8192, "sequence length (GQA 32:8 heads, D=128, causal, bf16)")
flags.DEFINE_string("arm", None, "internal: run one arm in this process (thread|process)")

ARMS = [("thread", "cold"), ("process", "cold"), ("thread", "warm"), ("process", "warm")]


def _old_build():
    """The build thread as native.py had it: ``cpp_extension.load`` in this process."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    from sparsetp.backends.torch import native  # noqa: PLC0415

    try:
        module = cpp_extension.load(name="sparsetp_native", sources=[native._SOURCE],
                                    extra_cflags=list(native._CFLAGS), verbose=False)
    except Exception as exc:  # noqa: BLE001
        native._STATE["status"] = f"unavailable: {exc}"
        return
    native._STATE["module"] = module
    native._STATE["status"] = "ready"


def run_arm(arm: str) -> dict:
    import torch  # noqa: PLC0415

    from sparsetp.backends.torch import native  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.core import patterns as P  # noqa: PLC0415
    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    if arm == "thread":  # the old loader: no cache lookup, the build in a thread of this process
        native._build = _old_build
        native._target = lambda: os.path.join(tempfile.mkdtemp(), "absent.so")
    n, h, h_kv, d = FLAGS.n, 32, 8, 128
    layout = make_layout(P.causal(), n, h, 128)
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(heads, grad=True):
        t = torch.randn(1, heads, n, d, device="cuda", generator=g).to(torch.bfloat16)
        return t.requires_grad_(grad)

    q, k, v, d_out = make(h), make(h_kv), make(h_kv), make(h, False)
    sparse_attention(q, k, v, layout)
    torch.cuda.synchronize()
    calls, ready_s = [], None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < FLAGS.seconds:
        t = time.perf_counter()
        q.grad = k.grad = v.grad = None
        sparse_attention(q, k, v, layout).backward(d_out)
        torch.cuda.synchronize()
        status = native.status()
        calls.append((t - t0, (time.perf_counter() - t) * 1e3, status))
        if ready_s is None and status == "ready":
            ready_s = time.perf_counter() - t0
    first = [ms for at, ms, _ in calls if at < FLAGS.window_s]
    last = [ms for at, ms, _ in calls if at >= calls[-1][0] - 1.0]
    return {"calls": len(calls), "first_window_median_ms": statistics.median(first),
            "first_window_max_ms": max(first), "first_window_calls": len(first),
            "last_second_median_ms": statistics.median(last), "ready_after_s": ready_s,
            "status_at_end": calls[-1][2],
            "first_calls_ms": [round(ms, 2) for _, ms, _ in calls[:30]]}


def _wait_for_orphan_builds(limit_s: float = 180.0) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < limit_s:
        found = subprocess.run(["pgrep", "-f", "native_build.py|ninja"], capture_output=True,
                               check=False)
        if found.returncode:  # none left
            return
        time.sleep(0.5)


def main(argv):
    del argv
    if FLAGS.arm:
        print(json.dumps(run_arm(FLAGS.arm)))
        return
    import torch  # noqa: PLC0415

    rec = {"question": __doc__.split("\n\n")[0], "n": FLAGS.n, "seconds": FLAGS.seconds,
           "window_s": FLAGS.window_s, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "arms": []}
    with tempfile.TemporaryDirectory() as warm_sparsetp, \
            tempfile.TemporaryDirectory() as warm_torch:
        for arm, cache in ARMS:
            env = dict(os.environ)
            if cache == "cold":
                env["SPARSETP_CACHE_DIR"] = tempfile.mkdtemp()
                env["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp()
            else:
                env["SPARSETP_CACHE_DIR"], env["TORCH_EXTENSIONS_DIR"] = warm_sparsetp, warm_torch
                # both loaders' caches filled before the arm (and not timed)
                subprocess.run([sys.executable, "-c", "from torch.utils import cpp_extension;"
                                "from sparsetp.backends.torch import native;"
                                "native.wait();"
                                "cpp_extension.load(name='sparsetp_native', "
                                "sources=[native._SOURCE], extra_cflags=list(native._CFLAGS))"],
                               env=env, check=True)
            t = time.perf_counter()
            done = subprocess.run([sys.executable, __file__, f"--arm={arm}",
                                   f"--seconds={FLAGS.seconds}", f"--window_s={FLAGS.window_s}",
                                   f"--n={FLAGS.n}"], env=env, capture_output=True, text=True,
                                  check=False)
            if done.returncode:
                raise RuntimeError(f"arm {arm}/{cache} failed:\n{done.stderr[-3000:]}")
            _wait_for_orphan_builds()  # a cold arm's build outlives it; not in the next arm
            res = {"arm": arm, "cache": cache, "process_s": time.perf_counter() - t,
                   **json.loads(done.stdout.strip().splitlines()[-1])}
            rec["arms"].append(res)
            print(f"{arm:8s} {cache}: first {FLAGS.window_s:g} s median "
                  f"{res['first_window_median_ms']:.2f} ms (worst "
                  f"{res['first_window_max_ms']:.1f}, "
                  f"{res['first_window_calls']} calls); last second "
                  f"{res['last_second_median_ms']:.2f} ms; ready after {res['ready_after_s']}",
                  flush=True)
    with open(FLAGS.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    app.run(main)
