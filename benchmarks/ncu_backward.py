"""Nsight Compute profile of our causal attention kernels next to FlexAttention's (issue #8).

Why: with the same tiles, warps, stages and (in TTGIR) the same main loop, Flex's causal backward
is ~11 % faster than our dQ + dK/dV (``benchmarks/KERNEL_NOTES.md``, "Per-kernel backward
timings"). Static resources (``kernel_resources.py``) did not explain it; this records what the
hardware counters say about each kernel: duration, SM and tensor-pipe throughput, issue-slot use,
occupancy, L2/DRAM traffic, and the warp stall reasons.

Two modes:

* ``--impl=ours`` / ``--impl=flex``: the profiled program. It warms up (compiles) one causal
  fwd+bwd (bf16, B=1, H=16, D=128, block 128, N=``--n``), then runs one more between
  ``cudaProfilerStart`` and ``cudaProfilerStop``, so only that one is profiled.
* ``--drive`` (default): runs ``ncu`` on both programs (if an ``ncu`` is found), writes each
  raw CSV report next to ``--out`` and a JSON summary of the chosen metrics to ``--out``. If
  there is no ``ncu`` or it may not read the counters, the JSON says so.

Usage (GPU machine, repo root on PYTHONPATH)::

    python benchmarks/ncu_backward.py --out=$OUT/ncu_backward.json
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "ncu_backward.json", "where to write the JSON summary")
flags.DEFINE_integer("n", 8192, "sequence length (a multiple of 128)")
flags.DEFINE_enum("impl", None, ["ours", "flex"], "run the profiled program of one impl")
flags.DEFINE_integer("timeout_s", 240, "limit per ncu run")
flags.DEFINE_list("variants", [], "variant copies of sparsetp/kernels/attention.py: profile ours "
                  "with each swapped in too (an A/B at ncu's fixed clocks)")
flags.DEFINE_string("variant", None, "internal: the variant file the profiled program swaps in")
flags.DEFINE_bool("flex", True, "profile FlexAttention too")

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats",
            "Occupancy", "MemoryWorkloadAnalysis", "LaunchStats")
# Kernels of interest: ours by name; Flex's attention kernels are Inductor templates.
KERNEL_REGEX = {"ours": "regex:_attn_", "flex": "regex:triton_tem"}


def program(impl: str, n: int) -> None:
    import torch

    h, d = 16, 128
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    for t in (q, k, v):  # all three: Flex drops the dK computation when k needs no gradient
        t.requires_grad_()
    if impl == "ours":
        from sparsetp.backends.torch import attention as tattn
        from sparsetp.core import make_layout
        from sparsetp.core import patterns as P
        from sparsetp.kernels import launch as L

        layout = make_layout(P.causal(), n, h, 128)
        kernels = L._load_kernels(FLAGS.variant) if FLAGS.variant else {}

        def step():
            with L._using_kernels(kernels):
                tattn.sparse_attention(q, k, v, layout).backward(do)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, hh, qi, ki: qi >= ki, 1, h, n, n, device="cuda",
                                 BLOCK_SIZE=128)
        fn = torch.compile(flex_attention)

        def step():
            fn(q, k, v, block_mask=mask).backward(do)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu",
                    "/usr/local/cuda*/nsight-compute*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


# Raw metrics on top of the sections: the stall reasons (warps stalled per issued instruction,
# by reason) and the busy share of each pipe (tensor, FMA, ALU, XU = MUFU's exp2, ...): is the
# kernel held up by the MMAs, by the element-wise work, or by waiting?
METRICS = ("regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio",
           "regex:sm__pipe_.*_cycles_active\\.avg\\.pct_of_peak_sustained_active",
           "regex:sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active")
# Metric names summarised per kernel (plus every stall and pipe row); the raw CSV keeps all.
SUMMARY = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L2 Hit Rate",
           "DRAM Throughput", "Issue Slots Busy", "Executed Ipc Active", "Achieved Occupancy",
           "Registers Per Thread", "No Eligible", "Warp Cycles Per Issued Instruction",
           "Avg. Active Threads Per Warp")


def summarise(text: str) -> list[dict]:
    """Per profiled kernel launch: the SUMMARY metrics and every stall-reason row, from ncu's
    ``--csv --page details`` output."""
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
    kernels: dict = {}
    for r in rows:
        key = (r.get("ID"), r.get("Kernel Name"))
        e = kernels.setdefault(key, {"id": r.get("ID"), "kernel": r.get("Kernel Name", "")[:120],
                                     "metrics": {}})
        name = r.get("Metric Name", "")
        if name in SUMMARY or "stall" in name.lower() or "pipe" in name:
            e["metrics"][name] = f"{r.get('Metric Value')} {r.get('Metric Unit', '')}".strip()
    return list(kernels.values())


def drive() -> None:
    out_dir = os.path.dirname(os.path.abspath(FLAGS.out))
    result = {"command": " ".join(sys.argv), "n": FLAGS.n, "runs": {}}
    ncu = find_ncu()
    result["ncu"] = ncu
    if ncu is None:
        result["error"] = "no ncu on this machine"
    else:
        runs = [("ours", None)] + [("ours", v) for v in FLAGS.variants]
        runs += [("flex", None)] if FLAGS.flex else []
        for impl, variant in runs:
            tag = impl if variant is None else os.path.splitext(os.path.basename(variant))[0]
            cmd = [ncu, "--profile-from-start", "off", "--target-processes", "all",
                   "-k", KERNEL_REGEX[impl], "--csv", "--page", "details"]
            for s in SECTIONS:
                cmd += ["--section", s]
            cmd += ["--metrics", ",".join(METRICS)]
            cmd += [sys.executable, os.path.abspath(__file__), f"--impl={impl}",
                    f"--n={FLAGS.n}", "--out=/dev/null"]
            if variant:
                cmd.append(f"--variant={os.path.abspath(variant)}")
            env = dict(os.environ)
            if impl == "flex":  # a fresh Inductor/Triton cache: nothing stale is reused
                cache = tempfile.mkdtemp()
                env.update(TORCHINDUCTOR_CACHE_DIR=cache,
                           TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                   timeout=FLAGS.timeout_s)
                raw = os.path.join(out_dir, f"ncu_backward_{tag.lstrip('.')}.csv")
                with open(raw, "w") as f:
                    f.write(p.stdout)
                result["runs"][tag] = {"rc": p.returncode, "stderr": p.stderr[-3000:],
                                        "kernels": summarise(p.stdout)}
            except subprocess.TimeoutExpired:
                result["runs"][tag] = {"error": f"timeout after {FLAGS.timeout_s} s"}
            print(json.dumps({tag: result["runs"][tag]}, indent=1)[:3000], flush=True)
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)


def main(argv):
    del argv
    if FLAGS.impl:
        program(FLAGS.impl, FLAGS.n)
    else:
        drive()


if __name__ == "__main__":
    app.run(main)
