"""GPU tensor-parallel check: the CPU tests' checks with NCCL on 2 GPUs, the demo, TP timings.

Believe these numbers only when ``tests/torch_tp_test.py`` passes: stages 1-2 re-run its rank
functions unchanged (``_check_layers``, ``_check_block``) with NCCL, one GPU per rank (the harness
makes ``cuda:<rank>`` the default device), so the GPU path is held to the same float64 oracle and
the same tolerances as CI.

Stages (each logged as soon as it ends, a failure recorded and the next stage still run):
  1. layers: collectives, Column/Row linears (fp32, fp64), MLP, bad sizes, on 2 ranks.
  2. block: HybridBlock vs the oracle (output, dx, every weight-grad shard) on 1 and 2 ranks,
     and TP=1 vs TP=2 agreement (atol 1e-5).
  3. demo: ``python -m sparsetp demo --backend torch --tp 2`` (GPU defaults, float32).
  4. timing: HybridBlock fwd+bwd, bf16, TP=1 vs TP=2 (median of 10 after 3 warm-ups).
  5. demo in bfloat16.

Usage (on the device, from the repo root; keep NVLink multicast off)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=.:tests python benchmarks/gpu_tp_check.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

import dist_utils  # noqa: E402
import torch_tp_test as T  # noqa: E402

TIMING = dict(batch=1, seq_len=8192, d_model=2048, num_heads=16, d_ff=8192, block_size=64)


def _time_block(rank, world, sizes, iters, warmup):
    import torch

    from sparsetp.backends.torch.block import HybridBlock
    from sparsetp.core import HybridConfig, init_params, make_layout
    from sparsetp.core import patterns as P

    pattern = P.bigbird(sizes["block_size"], 3, 1, 2, seed=0)
    cfg = HybridConfig(sizes["d_model"], sizes["num_heads"], sizes["d_ff"], pattern,
                       block_size=sizes["block_size"], dtype="bfloat16")
    block = HybridBlock.from_params(cfg, init_params(cfg, 0))
    g = torch.Generator(device=f"cuda:{rank}").manual_seed(0)
    shape = (sizes["batch"], sizes["seq_len"], cfg.d_model)
    x = torch.randn(shape, generator=g, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(shape, generator=g, dtype=torch.bfloat16)
    times = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        block(x).backward(dy)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    density = make_layout(pattern, sizes["seq_len"], cfg.num_heads, cfg.block_size).density
    return dict(median_ms=1e3 * float(np.median(times)), min_ms=1e3 * float(np.min(times)),
                density=density, max_mem_gib=torch.cuda.max_memory_allocated() / 2 ** 30)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--stages", default="layers,block,demo,timing,demo_bf16")
    opts = ap.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    log_path = os.path.join(opts.out, "gpu_tp_check.log")
    results: dict = {}

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    def save():
        with open(os.path.join(opts.out, "gpu_tp_check.json"), "w") as f:
            json.dump(results, f, indent=2)

    import torch
    import triton
    env = dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               nccl=".".join(map(str, torch.cuda.nccl.version())),
               python=sys.version.split()[0],
               nvls=os.environ.get("NCCL_NVLS_ENABLE"))
    results["env"] = env
    log(f"env {env}")

    def stage(name, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            results[name] = dict(ok=True, seconds=round(time.perf_counter() - t0, 1), result=out)
            log(f"{name}: PASS in {time.perf_counter() - t0:.1f} s: {out}")
        except BaseException as e:  # record and go on to the next stage
            results[name] = dict(ok=False, seconds=round(time.perf_counter() - t0, 1),
                                 error=f"{type(e).__name__}: {e}"[-4000:])
            log(f"{name}: FAIL in {time.perf_counter() - t0:.1f} s\n{traceback.format_exc()}")
        save()

    def layers():
        dist_utils.run_distributed(T._check_layers, 2, backend="nccl", timeout=180)
        return "collectives, column/row (fp32, fp64), MLP, bad sizes on 2 GPUs"

    def block():
        base = dist_utils.run_distributed(T._check_block, 1, True, backend="nccl",
                                          timeout=150)[0]
        two = dist_utils.run_distributed(T._check_block, 2, True, backend="nccl", timeout=150)
        diff = {}
        for rank, (y, dx) in enumerate(two):
            np.testing.assert_allclose(y, base[0], atol=1e-5, rtol=1e-6)
            np.testing.assert_allclose(dx, base[1], atol=2e-5, rtol=2e-6)
            diff[f"rank{rank}"] = dict(y=float(np.abs(y - base[0]).max()),
                                       dx=float(np.abs(dx - base[1]).max()))
        return dict(oracle="pass on TP=1 and TP=2", tp2_vs_tp1_max_abs=diff)

    def demo(dtype):
        def run():
            cmd = [sys.executable, "-m", "sparsetp", "demo", "--backend", "torch", "--tp", "2",
                   "--dtype", dtype]
            p = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=240)
            text = p.stdout[p.stdout.find("sparsetp demo:"):] if "sparsetp demo:" in \
                p.stdout else p.stdout[-3000:]
            with open(os.path.join(opts.out, f"demo_{dtype}.txt"), "w") as f:
                f.write(f"$ {' '.join(cmd)}\n{p.stdout}\n--- stderr ---\n{p.stderr[-6000:]}")
            if p.returncode:
                raise RuntimeError(f"demo exited {p.returncode}:\n{text}\n{p.stderr[-3000:]}")
            return text
        return run

    def timing():
        out = {}
        for world in (1, 2):
            r = dist_utils.run_distributed(_time_block, world, TIMING, 10, 3, backend="nccl",
                                           timeout=200)
            out[f"tp{world}"] = r[0]
            log(f"timing tp{world}: {r[0]}")
        out["sizes"] = dict(TIMING, dtype="bfloat16", pattern="bigbird(64, 3, 1, 2, seed=0)")
        out["speedup_tp2"] = out["tp1"]["median_ms"] / out["tp2"]["median_ms"]
        return out

    todo = {"layers": layers, "block": block, "demo": demo("float32"), "timing": timing,
            "demo_bf16": demo("bfloat16")}
    for name in opts.stages.split(","):
        stage(name, todo[name])
    return 0 if all(results[n]["ok"] for n in opts.stages.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
