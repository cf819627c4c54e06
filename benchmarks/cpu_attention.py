"""Native CPU path vs dense SDPA (and torch vs JAX) on CPU: forward and forward+backward.

Believe the numbers only once ``tests/cpu_attention_test.py`` and the native classes of
``tests/torch_attention_test.py`` / ``tests/jax_attention_test.py`` pass.

B=1, H=4, D=64, ``P.causal() & P.local(256, 0)`` at block 64, float32; the dense baseline is
``scaled_dot_product_attention(is_causal=True)`` (more work: every causal key). Ratios are taken
within one run (median of ``--reps`` timings each)::

    PYTHONPATH=. python benchmarks/cpu_attention.py --out=/tmp/cpu_attention.json
"""

from __future__ import annotations

import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import tqdm
from absl import app, flags

from sparsetp.backends.jax import attention as jattn
from sparsetp.backends.torch import attention as tattn
from sparsetp.core import make_layout
from sparsetp.core import patterns as P

FLAGS = flags.DEFINE_multi_integer("n", [1024, 2048, 4096], "sequence lengths (16384 optional)")
REPS = flags.DEFINE_integer("reps", 5, "timed repetitions per measurement (median)")
OUT = flags.DEFINE_string("out", "/tmp/cpu_attention.json", "JSON results")
PLOT = flags.DEFINE_string("plot", "", "speed-up plot (PNG); empty: none")


def _median_time(fn, reps):
    fn()  # warm-up (jit compile, caches)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(n, reps):
    b, h, d, bs = 1, 4, 64, 64
    layout = make_layout(P.causal() & P.local(256, 0), n, h, bs)
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4))
    tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
    tdo = torch.from_numpy(do)

    def sparse_fwd():
        with torch.no_grad():
            tattn.sparse_attention(tq, tk, tv, layout)

    def sparse_fwd_bwd():
        tattn.sparse_attention(tq, tk, tv, layout).backward(tdo)

    def dense_fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    def dense_fwd_bwd():
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).backward(tdo)

    lay = jattn.layout_arrays(layout)
    jq, jk, jv, jdo = (jnp.asarray(x) for x in (q, k, v, do))
    jfwd = jax.jit(lambda q, k, v, lay: jattn.sparse_attention(q, k, v, lay))
    jgrad = jax.jit(jax.grad(lambda q, k, v, lay: jnp.vdot(jattn.sparse_attention(q, k, v, lay),
                                                           jdo), argnums=(0, 1, 2)))
    r = {"n": n, "density": float(layout.density)}
    r["torch_fwd_s"] = _median_time(sparse_fwd, reps)
    r["torch_fwd_bwd_s"] = _median_time(sparse_fwd_bwd, reps)
    r["sdpa_fwd_s"] = _median_time(dense_fwd, reps)
    r["sdpa_fwd_bwd_s"] = _median_time(dense_fwd_bwd, reps)
    r["jax_fwd_s"] = _median_time(lambda: jfwd(jq, jk, jv, lay).block_until_ready(), reps)
    r["jax_fwd_bwd_s"] = _median_time(
        lambda: jax.block_until_ready(jgrad(jq, jk, jv, lay)), reps)
    r["speedup_fwd_vs_sdpa"] = r["sdpa_fwd_s"] / r["torch_fwd_s"]
    r["speedup_fwd_bwd_vs_sdpa"] = r["sdpa_fwd_bwd_s"] / r["torch_fwd_bwd_s"]
    r["jax_over_torch_fwd"] = r["jax_fwd_s"] / r["torch_fwd_s"]
    r["jax_over_torch_fwd_bwd"] = r["jax_fwd_bwd_s"] / r["torch_fwd_bwd_s"]
    return r


def main(argv):
    del argv
    results = [measure(n, REPS.value) for n in tqdm.tqdm(FLAGS.value, desc="N")]
    meta = {"machine": platform.processor() or platform.machine(),
            "cpus": torch.get_num_threads(), "torch": torch.__version__,
            "jax": jax.__version__, "shape": "B=1 H=4 D=64 float32, causal&local(256,0) bs64"}
    with open(OUT.value, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    for r in results:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    if PLOT.value:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        ns = [r["n"] for r in results]
        plt.plot(ns, [r["speedup_fwd_vs_sdpa"] for r in results], "o-", label="forward")
        plt.plot(ns, [r["speedup_fwd_bwd_vs_sdpa"] for r in results], "s-", label="fwd+bwd")
        plt.xscale("log", base=2)
        plt.xlabel("N")
        plt.ylabel("speed-up vs dense SDPA (causal)")
        plt.legend()
        plt.savefig(PLOT.value, dpi=100)


if __name__ == "__main__":
    app.run(main)
