"""Question: why is the JAX MLP's fwd+bwd slower than torch's on one GPU (issue #9)?

Times the bf16 MLP (T=8192, d=8192, ff=32768 by default) forward+backward on one device with
the library's layers, and with variants that keep XLA from fusing elementwise work into the
GEMMs, and lists the GEMM kinds in the compiled HLO (cuBLAS custom calls vs Triton GEMM
fusions). Believe it only if ``tests/jax_tp_test.py`` passes. Run each XLA-flag variant in its
own process:

    python benchmarks/jax_mlp_probe.py
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/jax_mlp_probe.py
    XLA_FLAGS=--xla_gpu_enable_cublaslt=true python benchmarks/jax_mlp_probe.py --variants=library
"""

from __future__ import annotations

import json
import os
import re
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from sparsetp.backends.jax import layers

flags.DEFINE_integer("t", 8192, "tokens")
flags.DEFINE_integer("d", 8192, "model width")
flags.DEFINE_integer("ff", 32768, "hidden width")
flags.DEFINE_integer("iters", 20, "timed iterations")
flags.DEFINE_list("variants", None, "variants to time (default: all)")
FLAGS = flags.FLAGS


def _barrier_gelu():
    @jax.custom_vjp
    def g(x):
        return layers.gelu_tanh(x)

    def fwd(x):
        return g(x), x

    def bwd(x, ct):
        _, vjp = jax.vjp(layers.gelu_tanh, x)
        return (jax.lax.optimization_barrier(vjp(ct)[0]),)

    g.defvjp(fwd, bwd)
    return lambda x: jax.lax.optimization_barrier(g(x))


def _mlp(gelu):
    def f(w1, b1, w2, b2, x):
        h = layers.linear(x, w1, b1)
        return layers.linear(gelu(h), w2, b2)
    return f


def main(_):
    t, d, ff = FLAGS.t, FLAGS.d, FLAGS.ff
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    bf = jnp.bfloat16
    args = ((jax.random.normal(k[0], (d, ff)) * d ** -0.5).astype(bf),
            (0.1 * jax.random.normal(k[1], (ff,))).astype(bf),
            (jax.random.normal(k[2], (ff, d)) * ff ** -0.5).astype(bf),
            (0.1 * jax.random.normal(k[3], (d,))).astype(bf),
            jax.random.normal(k[4], (1, t, d)).astype(bf))
    dy = jax.random.normal(k[5], (1, t, d)).astype(bf)
    out = dict(xla_flags=os.environ.get("XLA_FLAGS", ""), device=str(jax.devices()[0]),
               jax=jax.__version__, shapes=dict(t=t, d=d, ff=ff), variants={})
    variants = {"library": lambda w1, b1, w2, b2, x: layers.parallel_mlp(x, w1, b1, w2, b2,
                                                                         axis_name=None),
                "barrier_gelu": _mlp(_barrier_gelu()),
                "no_bias": lambda w1, b1, w2, b2, x: layers.parallel_mlp(x, w1, None, w2, None,
                                                                         axis_name=None),
                # Tokens as one 2-D [T, d] operand (no leading batch dim in the dot_generals).
                "x2d": lambda w1, b1, w2, b2, x: layers.parallel_mlp(
                    x.reshape(-1, x.shape[-1]), w1, b1, w2, b2, axis_name=None).reshape(x.shape)}
    if FLAGS.variants:
        variants = {n: variants[n] for n in FLAGS.variants}
    for name, f in variants.items():
        def fb(a, dy, f=f):
            y, vjp = jax.vjp(f, *a)
            return y, vjp(dy)
        for mode, fn, fa in (("fwd", jax.jit(lambda a, f=f: f(*a)), (args,)),
                             ("fwd_bwd", jax.jit(fb), (args, dy))):
            c = fn.lower(*fa).compile()
            hlo = c.as_text()
            if name == "library" and mode == "fwd_bwd" and os.environ.get("PROBE_HLO"):
                with open(os.environ["PROBE_HLO"], "w") as f:
                    f.write(hlo)
            kinds = dict(cublas=len(re.findall(r'custom_call_target="__cublas', hlo)),
                         triton_gemm=len(re.findall(r'"kind":"__triton_gemm"', hlo)),
                         fusions=len(re.findall(r"\bfusion\(", hlo)))
            for _ in range(3):
                jax.block_until_ready(c(*fa))
            ts = []
            for _ in range(FLAGS.iters):
                s = time.perf_counter()
                jax.block_until_ready(c(*fa))
                ts.append(1e3 * (time.perf_counter() - s))
            ts.sort()
            out["variants"].setdefault(name, {})[mode] = dict(
                median_ms=ts[len(ts) // 2], min_ms=ts[0], gemm_kinds=kinds)
            print(name, mode, out["variants"][name][mode], flush=True)
    if os.environ.get("PROBE_OUT"):
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
