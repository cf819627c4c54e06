"""Question: do the JAX frontend's GPU launches (jax_triton) compute what torch's launches of the
same kernels compute, right, and as fast?

Believe it only if ``tests/jax_attention_test.py`` and ``tests/jax_torch_interop_test.py`` pass
(the same kernels through the interpreter on CPU; JAX and torch bitwise equal there). On the GPU
machine, from the repo root (jax_triton travels as a wheel)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_jax_check.py --out=$OUT/jax.json

On CPU (the interpreter; a smoke test of this script)::

    python benchmarks/gpu_jax_check.py --cpu-smoke --out=/tmp/jax.json

1. Correctness: ``sparsetp.jax.sparse_attention`` (jit, jax_triton) forward, LSE and dq/dk/dv vs
   a dense float32 JAX reference (masked softmax from the layout's dense mask, HIGHEST precision)
   on the same bf16-rounded inputs, N up to 4096, D 64 and 128, bf16 (plus one float32 case,
   and the same op inside a 1-device ``shard_map``). Tolerance: the tests' table (bf16 atol 3e-2,
   gradients 6e-2; float32 2e-5 / 4e-5; rtol = atol / 10).
2. Torch after JAX in the same process (jax_triton's TRITON_CACHE_DIR side effect): the torch
   launch of the same kernel must run and agree with JAX.
3. Timing, same layout and inputs: JAX ``jit(sparse_attention)`` and ``jit(vjp)`` vs torch
   ``sparse_attention`` forward and forward+backward. Both timed the same way (median of
   ``--reps`` wall-clock timings of ``--iters`` back-to-back calls, synchronised with
   ``block_until_ready`` / ``torch.cuda.synchronize``); torch also with ``triton.testing.do_bench``.
   Ratio = JAX time / torch time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

ATOL = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 2e-5}


def _versions(with_jax_triton=True):
    import jax
    import torch
    import triton

    out = {"python": platform.python_version(), "jax": jax.__version__, "triton":
           triton.__version__, "torch": torch.__version__}
    try:
        import jaxlib
        out["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    if with_jax_triton:
        from sparsetp.backends.jax import compat
        out["jax_triton"] = compat.jax_triton().__version__
    out["device"] = str(jax.devices()[0].device_kind)
    return out


def _dense_reference(q, k, v, mask, scale):
    """float32 masked softmax attention (out, lse) in JAX, HIGHEST precision; rows with no key
    give 0 / -inf."""
    import jax
    import jax.numpy as jnp

    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhnd,bhmd->bhnm", q, k, precision=hi) * scale
    s = jnp.where(mask[None], s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    has = jnp.isfinite(m)
    m = jnp.where(has, m, 0.0)
    e = jnp.where(mask[None], jnp.exp(s - m), 0.0)
    den = e.sum(-1, keepdims=True)
    p = jnp.where(has, e / jnp.where(has, den, 1.0), 0.0)
    lse = jnp.where(has[..., 0], (m + jnp.log(jnp.where(has, den, 1.0)))[..., 0], -jnp.inf)
    return jnp.einsum("bhnm,bhmd->bhnd", p, v, precision=hi), lse


def _err(got, want, atol):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    fin = np.isfinite(want)
    same_inf = bool(np.array_equal(np.isfinite(got), fin)) and bool(
        np.array_equal(got[~fin], want[~fin]))
    diff = np.abs(got[fin] - want[fin])
    bad = diff > atol + atol / 10 * np.abs(want[fin])
    return {"max_abs_err": float(diff.max(initial=0.0)), "n_bad": int(bad.sum()),
            "nan": int(np.isnan(got).sum()), "inf_match": same_inf,
            "ok": bool(not bad.any() and same_inf and not np.isnan(got).any())}


def _layout(name, n, h, bs):
    from sparsetp.core import make_layout
    from sparsetp.core.examples import example_pattern

    return make_layout(example_pattern(name, n, bs), n, h, bs)


def correctness_case(name, n, h, d, bs, dtype, b=1, seed=0, shard_map=False):
    import jax
    import jax.numpy as jnp

    from sparsetp.backends.jax import attention as jattn
    from sparsetp.backends.jax.block import make_mesh

    layout = _layout(name, n, h, bs)
    rng = np.random.default_rng(seed)
    jd = jnp.dtype(dtype)
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, h, n, d)), jd) for _ in range(4))
    lay = jattn.layout_arrays(layout)
    scale = d ** -0.5

    def op(q, k, v, lay):
        return jattn.sparse_attention(q, k, v, lay, return_lse=True)

    if shard_map:
        from jax.sharding import PartitionSpec as P

        spec = P(None, "tp")
        op = jax.shard_map(op, mesh=make_mesh(1), in_specs=(spec,) * 3 +
                           (lay.partition_specs("tp"),), out_specs=(spec, spec))

    @jax.jit
    def run(q, k, v, do, lay):
        (out, lse), vjp = jax.vjp(lambda q, k, v: op(q, k, v, lay), q, k, v)
        return out, lse, *vjp((do, jnp.zeros_like(lse)))

    res = jax.block_until_ready(run(q, k, v, do, lay))
    mask = jnp.asarray(layout.dense_mask())
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]

    @jax.jit
    def ref(q, k, v, do):
        (out, lse), vjp = jax.vjp(lambda q, k, v: _dense_reference(q, k, v, mask, scale), q, k, v)
        return out, lse, *vjp((do, jnp.zeros_like(lse)))

    refs = jax.block_until_ready(ref(*f32))
    atol = ATOL[dtype]
    checks = {}
    for i, nm in enumerate(("out", "lse", "dq", "dk", "dv")):
        tol = atol * (2 if nm.startswith("d") else 1)  # the tests' table, LSE like outputs
        checks[nm] = _err(res[i].astype(jnp.float32), refs[i], tol)
    return {"pattern": name, "N": n, "H": h, "D": d, "block": bs, "dtype": dtype, "B": b,
            "shard_map_1dev": shard_map, "density": layout.density,
            "ok": all(c["ok"] for c in checks.values()), "checks": checks}


def _time_jax(fn, args, iters, reps):
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn(*args)
        jax.block_until_ready(r)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times)) * 1e3


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_torch(fn, iters, reps):
    fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync()
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times)) * 1e3


def timing_case(name, n, h, d, bs, dtype, iters, reps, b=1, seed=0, device="cuda"):
    import jax
    import jax.numpy as jnp
    import torch
    import triton

    from sparsetp.backends.jax import attention as jattn
    from sparsetp.backends.torch import attention as tattn

    layout = _layout(name, n, h, bs)
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(4)]
    jd = jnp.dtype(dtype)
    q, k, v, do = (jnp.asarray(x, jd) for x in host)
    lay = jattn.layout_arrays(layout)
    fwd = jax.jit(lambda q, k, v, lay: jattn.sparse_attention(q, k, v, lay))

    @jax.jit
    def fwd_bwd(q, k, v, do, lay):
        out, vjp = jax.vjp(lambda q, k, v: jattn.sparse_attention(q, k, v, lay), q, k, v)
        return out, *vjp(do)

    td = getattr(torch, dtype)
    dev = device
    tq, tk, tv, tdo = (torch.from_numpy(x).to(dev, td) for x in host)
    tq.requires_grad_(True)
    tk.requires_grad_(True)
    tv.requires_grad_(True)

    def t_fwd():
        with torch.no_grad():
            return tattn.sparse_attention(tq, tk, tv, layout)

    def t_fwd_bwd():
        out = tattn.sparse_attention(tq, tk, tv, layout)
        return torch.autograd.grad(out, (tq, tk, tv), tdo)

    # Same kernel, same inputs: the two frameworks must agree (bitwise expected).
    j_out = np.asarray(fwd(q, k, v, lay).astype(jnp.float32))
    t_out = t_fwd().float().cpu().numpy()
    j_g = [np.asarray(g.astype(jnp.float32)) for g in fwd_bwd(q, k, v, do, lay)[1:]]
    t_g = [g.float().cpu().numpy() for g in t_fwd_bwd()]
    agree = {"out_max_abs_diff": float(np.abs(j_out - t_out).max()),
             "grads_max_abs_diff": float(max(np.abs(a - c).max()
                                             for a, c in zip(j_g, t_g, strict=True))),
             "bitwise_equal": bool(np.array_equal(j_out, t_out) and all(
                 np.array_equal(a, c) for a, c in zip(j_g, t_g, strict=True)))}

    res = {"pattern": name, "N": n, "H": h, "D": d, "block": bs, "dtype": dtype, "B": b,
           "density": layout.density, "nnz_blocks": layout.nnz_blocks, "jax_vs_torch": agree}
    res["jax_fwd_ms"] = _time_jax(fwd, (q, k, v, lay), iters, reps)
    res["jax_fwd_bwd_ms"] = _time_jax(fwd_bwd, (q, k, v, do, lay), iters, reps)
    res["torch_fwd_ms"] = _time_torch(t_fwd, iters, reps)
    res["torch_fwd_bwd_ms"] = _time_torch(t_fwd_bwd, iters, reps)
    if dev == "cuda":
        res["torch_fwd_ms_do_bench"] = float(triton.testing.do_bench(t_fwd))
        res["torch_fwd_bwd_ms_do_bench"] = float(triton.testing.do_bench(t_fwd_bwd))
    res["ratio_fwd"] = res["jax_fwd_ms"] / res["torch_fwd_ms"]
    res["ratio_fwd_bwd"] = res["jax_fwd_bwd_ms"] / res["torch_fwd_bwd_ms"]
    # FLOPs on computed tiles (each tile is bs x bs; 4*bs*bs*d per tile fwd, 2.5x that bwd).
    tiles = layout.nnz_blocks * b
    flops_fwd = 4.0 * bs * bs * d * tiles
    res["jax_fwd_tflops"] = flops_fwd / (res["jax_fwd_ms"] * 1e-3) / 1e12
    res["torch_fwd_tflops"] = flops_fwd / (res["torch_fwd_ms"] * 1e-3) / 1e12
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="jax_gpu_check.json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smallest cases only")
    ap.add_argument("--timing-only", action="store_true", help="skip the correctness cases")
    ap.add_argument("--large", action="store_true",
                    help="timing at N = 16384 / 32768 (kernel time dominates host dispatch)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny cases through the interpreter on CPU, to check this script")
    a = ap.parse_args()
    if a.cpu_smoke:  # JAX arrays on the CPU, where the kernels run in Triton's interpreter
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax

    from sparsetp.backends.jax import launch as jlaunch

    result = {"command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "platform": jax.default_backend()}
    if not a.cpu_smoke:
        if jax.default_backend() != "gpu":
            raise SystemExit(f"needs a GPU JAX backend, got {jax.default_backend()}")
        if not jlaunch.gpu_path():
            raise SystemExit("the JAX launches would run in the interpreter on this GPU machine; "
                             "unset SPARSETP_INTERPRET / TRITON_INTERPRET")
    result["versions"] = _versions(with_jax_triton=not a.cpu_smoke)
    print(json.dumps(result["versions"]), flush=True)

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    corr_cases = [
        ("bigbird", 1024, 4, 64, 64, "bfloat16", False),
        ("causal", 1024, 4, 128, 64, "bfloat16", False),
        ("per_head_mix", 1000, 4, 64, 64, "bfloat16", False),   # ragged N
        ("masked_rows", 512, 2, 64, 64, "bfloat16", False),
        ("strided_causal", 2048, 4, 128, 128, "bfloat16", False),
        ("bigbird", 4096, 4, 64, 64, "bfloat16", False),
        ("longformer", 4096, 4, 128, 64, "bfloat16", False),
        ("bigbird", 4096, 4, 128, 128, "bfloat16", False),
        ("local", 1024, 2, 64, 64, "float32", False),
        ("bigbird", 1024, 4, 64, 64, "bfloat16", True),       # inside a 1-device shard_map
    ]
    if a.quick:
        corr_cases = corr_cases[:2]
    if a.timing_only:
        corr_cases = []
    if a.cpu_smoke:
        corr_cases = [("bigbird", 128, 2, 64, 64, "float32", False),
                      ("masked_rows", 100, 2, 16, 32, "bfloat16", True)]
    result["correctness"] = []
    for c in corr_cases:
        t0 = time.perf_counter()
        try:
            r = correctness_case(*c[:6], shard_map=c[6])
        except Exception as e:  # record and go on: one failure must not lose the rest
            r = {"case": list(c), "ok": False, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-3000:]}
        r["seconds"] = time.perf_counter() - t0
        result["correctness"].append(r)
        print(f"[correctness] {c}: ok={r['ok']} "
              + (r.get("error", "") or " ".join(f"{k}={v['max_abs_err']:.2e}"
                                                for k, v in r["checks"].items()))
              + f" ({r['seconds']:.1f}s)", flush=True)
        save()

    timing_cases = [
        ("bigbird", 4096, 16, 64, 64, "bfloat16"),
        ("bigbird", 4096, 16, 128, 64, "bfloat16"),
        ("causal", 4096, 16, 128, 128, "bfloat16"),
        ("strided_causal", 4096, 16, 64, 64, "bfloat16"),
    ]
    if a.large:
        timing_cases = [
            ("bigbird", 32768, 16, 128, 64, "bfloat16"),
            ("strided_causal", 32768, 16, 128, 64, "bfloat16"),
            ("causal", 16384, 16, 128, 128, "bfloat16"),
            ("causal", 16384, 16, 64, 64, "bfloat16"),
        ]
    if a.quick:
        timing_cases = timing_cases[:1]
    if a.cpu_smoke:
        timing_cases = [("bigbird", 128, 2, 64, 64, "float32")]
    result["timing"] = []
    for c in timing_cases:
        t0 = time.perf_counter()
        try:
            r = timing_case(*c, iters=a.iters, reps=a.reps,
                            device="cpu" if a.cpu_smoke else "cuda")
            msg = (f"jax fwd {r['jax_fwd_ms']:.3f} ms / torch {r['torch_fwd_ms']:.3f} ms "
                   f"(x{r['ratio_fwd']:.2f}); fwd+bwd {r['jax_fwd_bwd_ms']:.3f} / "
                   f"{r['torch_fwd_bwd_ms']:.3f} ms (x{r['ratio_fwd_bwd']:.2f}); "
                   f"agree {r['jax_vs_torch']}")
        except Exception as e:
            r = {"case": list(c), "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-3000:]}
            msg = r["error"]
        r["seconds"] = time.perf_counter() - t0
        result["timing"].append(r)
        print(f"[timing] {c}: {msg} ({r['seconds']:.1f}s)", flush=True)
        save()
    result["all_correct"] = all(r["ok"] for r in result["correctness"]) if corr_cases else None
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(f"all_correct={result['all_correct']}; wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
