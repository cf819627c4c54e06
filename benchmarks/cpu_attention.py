"""Native CPU path vs dense SDPA (and torch vs JAX) on CPU: the targets of issue #31.

Believe the numbers only once ``tests/cpu_attention_test.py`` and the native classes of
``tests/torch_attention_test.py`` / ``tests/jax_attention_test.py`` pass.

B=1, H=4, D=64, float32, block 64. Cases: ``P.causal() & P.local(256, 0)`` at each ``--n``
against ``scaled_dot_product_attention(is_causal=True)`` (more work: every causal key), and
BigBird (the bench tool's ``bigbird``) at ``--bigbird_n`` against non-causal SDPA. Every
implementation of a case is timed round-robin, rep after rep, so a change in the machine's
load hits them alike; each time is the median of ``--reps``. The load average is recorded
before and after each case. ``--memory``: the peak memory of a window-512 forward (the bench
tool's ``window:512``) at N=65536, in a fresh process::

    PYTHONPATH=. python benchmarks/cpu_attention.py --out=/tmp/cpu_attention.json
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

NS = flags.DEFINE_multi_integer("n", [4096, 16384], "sequence lengths, causal window 256")
BIGBIRD_N = flags.DEFINE_multi_integer("bigbird_n", [8192], "sequence lengths, BigBird")
REPS = flags.DEFINE_integer("reps", 7, "timed repetitions per measurement (median)")
MEMORY = flags.DEFINE_bool("memory", True, "measure the N=65536 window-512 forward's memory")
OUT = flags.DEFINE_string("out", "/tmp/cpu_attention.json", "JSON results")
PLOT = flags.DEFINE_string("plot", "", "speed-up plot (PNG); empty: none")
MEMORY_CHILD = flags.DEFINE_bool("memory_child", False, "internal: the memory measurement")

B, H, D, BS = 1, 4, 64, 64


def _layout(kind: str, n: int):
    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.core import patterns as P  # noqa: PLC0415

    pattern = P.causal() & P.local(256, 0) if kind == "local256" else \
        bench_pattern(kind, n, BS).pattern
    return make_layout(pattern, n, H, BS)


def _round_robin(fns: dict, reps: int) -> dict:
    """Median seconds of each callable, timed in turn rep after rep (one warm-up call each)."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def measure(kind: str, n: int, reps: int) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from sparsetp.backends.jax import attention as jattn  # noqa: PLC0415
    from sparsetp.backends.torch import attention as tattn  # noqa: PLC0415

    layout = _layout(kind, n)
    causal = kind == "local256"
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((B, H, n, D)).astype(np.float32) for _ in range(4))
    tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
    tdo = torch.from_numpy(do)
    lay = jattn.layout_arrays(layout, static_widths=True)  # one layout per case
    jq, jk, jv, jdo = (jnp.asarray(x) for x in (q, k, v, do))
    jfwd = jax.jit(lambda q, k, v, lay: jattn.sparse_attention(q, k, v, lay))
    jgrad = jax.jit(jax.grad(lambda q, k, v, lay: jnp.vdot(jattn.sparse_attention(q, k, v, lay),
                                                           jdo), argnums=(0, 1, 2)))

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    fns = {
        "torch_fwd": no_grad(lambda: tattn.sparse_attention(tq, tk, tv, layout)),
        "sdpa_fwd": no_grad(lambda: sdpa(tq, tk, tv, is_causal=causal)),
        "jax_fwd": lambda: jfwd(jq, jk, jv, lay).block_until_ready(),
        "torch_fwd_bwd": lambda: tattn.sparse_attention(tq, tk, tv, layout).backward(tdo),
        "sdpa_fwd_bwd": lambda: sdpa(tq, tk, tv, is_causal=causal).backward(tdo),
        "jax_fwd_bwd": lambda: jax.block_until_ready(jgrad(jq, jk, jv, lay)),
    }
    r = {"case": kind, "n": n, "density": float(layout.density),
         "dense": f"sdpa(is_causal={causal})", "load_before": os.getloadavg()}
    r.update({f"{name}_s": t for name, t in _round_robin(fns, reps).items()})
    r["load_after"] = os.getloadavg()
    r["jax_device"] = str(next(iter(jfwd(jq, jk, jv, lay).devices())))
    r["speedup_fwd_vs_sdpa"] = r["sdpa_fwd_s"] / r["torch_fwd_s"]
    r["speedup_fwd_bwd_vs_sdpa"] = r["sdpa_fwd_bwd_s"] / r["torch_fwd_bwd_s"]
    r["jax_speedup_fwd_vs_sdpa"] = r["sdpa_fwd_s"] / r["jax_fwd_s"]
    r["jax_speedup_fwd_bwd_vs_sdpa"] = r["sdpa_fwd_bwd_s"] / r["jax_fwd_bwd_s"]
    r["jax_over_torch_fwd"] = r["jax_fwd_s"] / r["torch_fwd_s"]
    r["jax_over_torch_fwd_bwd"] = r["jax_fwd_bwd_s"] / r["torch_fwd_bwd_s"]
    return r


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (kB there) in bytes."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def memory_child() -> dict:
    """Peak memory of one torch forward (no grad) of window 512 at N=65536, in this process:
    the peak RSS during the call (``VmHWM`` after resetting it through ``/proc/self/clear_refs``
    just before; ``ru_maxrss`` would not do: Linux keeps it across exec, so a child reports its
    parent's peak) and its growth over the RSS just before (inputs made, layout built, torch
    loaded)."""
    import torch  # noqa: PLC0415

    from sparsetp.backends.torch import attention as tattn  # noqa: PLC0415

    n = 65536
    layout = _layout("window:512", n)
    q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_bytes("VmRSS")
    with torch.no_grad():
        out = tattn.sparse_attention(q, k, v, layout)
    peak = _status_bytes("VmHWM")
    return {"case": "window:512", "n": n, "density": float(layout.density),
            "rss_before_bytes": before, "peak_bytes": peak,
            "forward_extra_peak_bytes": peak - before,
            "inputs_bytes": 3 * q.numel() * 4, "output_bytes": out.numel() * 4}


def main(argv):
    del argv
    if MEMORY_CHILD.value:
        print(json.dumps(memory_child()))
        return
    import jax  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from sparsetp.backends.torch import cpu as tcpu  # noqa: PLC0415

    results = []
    # JAX on its CPU device even on a GPU machine (layouts are then converted for the CPU too).
    with jax.default_device(jax.devices("cpu")[0]):
        for kind, ns in (("local256", NS.value), ("bigbird", BIGBIRD_N.value)):
            for n in ns:
                results.append(measure(kind, n, REPS.value))
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in results[-1].items()}), flush=True)
    memory = None
    if MEMORY.value:
        done = subprocess.run([sys.executable, __file__, "--memory_child"], check=True,
                              capture_output=True, text=True)
        memory = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(memory))
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "workers": tcpu._workers(),
            "torch": torch.__version__, "jax": jax.__version__,
            "shape": f"B={B} H={H} D={D} float32, block {BS}", "reps": REPS.value,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(OUT.value, "w") as f:
        json.dump({"meta": meta, "results": results, "memory": memory}, f, indent=1)
    if PLOT.value:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        rs = [r for r in results if r["case"] == "local256"]
        ns = [r["n"] for r in rs]
        plt.plot(ns, [r["speedup_fwd_vs_sdpa"] for r in rs], "o-", label="torch forward")
        plt.plot(ns, [r["speedup_fwd_bwd_vs_sdpa"] for r in rs], "s-", label="torch fwd+bwd")
        plt.plot(ns, [r["jax_speedup_fwd_vs_sdpa"] for r in rs], "o--", label="JAX forward")
        plt.plot(ns, [r["jax_speedup_fwd_bwd_vs_sdpa"] for r in rs], "s--", label="JAX fwd+bwd")
        plt.xscale("log", base=2)
        plt.xlabel("N")
        plt.ylabel("speed-up vs dense SDPA (causal)")
        plt.legend()
        plt.savefig(PLOT.value, dpi=100)


if __name__ == "__main__":
    app.run(main)
