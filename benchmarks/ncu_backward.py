"""Question: what do the hardware counters say about each of our causal attention kernels next to
FlexAttention's (GPU, Nsight Compute)?

Duration, SM and tensor-pipe throughput, issue-slot use, occupancy, L2/DRAM traffic and the warp
stall reasons per kernel, at ncu's fixed clocks (repeated runs agree to < 1 %, unlike boost-clock
timings; but a kernel at the board's power cap runs slower than its fixed-clock profile says).
Optionally per-instruction counters (``--source``), launch arms (``--arms``, the arm spec of
``attention_common.py``; an arm runs at its layout block, ``kernel_tile=layout`` unless it says
otherwise) and kernel versions (``--variants``, copies of ``sparsetp/kernels/attention.py``
launched by ``kernel_versions.py``).

Two modes:

* ``--impl=ours`` / ``--impl=flex``: the profiled program. It warms up (compiles) one causal
  fwd+bwd (bf16, B=1, H=16, D=128, block 128, N=``--n``), then runs one more between
  ``cudaProfilerStart`` and ``cudaProfilerStop``, so only that one is profiled.
* ``--drive`` (default): runs ``ncu`` on the programs (if an ``ncu`` is found), keeps each raw
  CSV report on the machine and writes a JSON summary of the chosen metrics to ``--out``. If
  there is no ``ncu`` or it may not read the counters, the JSON says so.

Believe it only if ``python -m pytest -q tests/torch_attention_test.py`` passes::

    python benchmarks/ncu_backward.py --out=$OUT/ncu_backward.json
    python benchmarks/ncu_backward.py --noflex --arms='t64:block=64;g4:block=64,head_group=4'
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
flags.DEFINE_list("variants", [], "copies of sparsetp/kernels/attention.py: profile each version "
                  "too (an A/B at ncu's fixed clocks)")
flags.DEFINE_string("variant", None, "internal: the kernels file the profiled program runs")
flags.DEFINE_bool("flex", True, "profile FlexAttention too")
flags.DEFINE_multi_string("arms", [], "launch arms to profile ours under (attention_common's "
                          "arm spec, ';'-separated or the flag repeated)")
flags.DEFINE_string("arm", None, "internal: the arm the profiled program runs")
flags.DEFINE_bool("source", False, "per-instruction counters of the backward kernels (CSV + "
                  "summary)")
flags.DEFINE_list("source_tags", ["ours", "flex"], "runs (tags) whose per-instruction counters "
                  "--source collects")
flags.DEFINE_string("variant_arm", None, "an arm the --variants run under")

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats",
            "Occupancy", "MemoryWorkloadAnalysis", "LaunchStats")
# Kernels of interest: ours by name; Flex's attention kernels are Inductor templates.
KERNEL_REGEX = {"ours": "regex:_attn_", "flex": "regex:triton_tem"}
# Kernels whose per-instruction counters ``--source`` exports (tag suffix -> name filter).
SOURCE_KERNELS = {"ours": {"dkdv": "regex:_attn_bwd_dkdv", "dq": "regex:_attn_bwd_dq"},
                  "flex": {"bwd": "regex:triton_tem_fused_flex_attention_backward"}}


def _arm(spec: str | None):
    """The arm a profiled program runs: at its layout block, pinned there unless it says
    otherwise (a profile is of one kernel tile)."""
    import attention_common as C

    if not spec:
        return C.Arm("default")
    arm = C.parse_arm(spec)
    return C.Arm(arm.name, arm.block, {"kernel_tile": "layout", **arm.options})


def program(impl: str, n: int) -> None:
    import torch

    h, d = 16, 128
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    for t in (q, k, v):  # all three: Flex drops the dK computation when k needs no gradient
        t.requires_grad_()
    if impl == "ours":
        from sparsetp.core import make_layout
        from sparsetp.core import patterns as P
        from sparsetp.torch import sparse_attention

        arm = _arm(FLAGS.arm)
        layout = make_layout(P.causal(), n, h, arm.block)
        if FLAGS.variant:
            import kernel_versions

            kernels = kernel_versions.load(FLAGS.variant)
            attn = lambda: kernel_versions.attention(q, k, v, layout, kernels)[0]
        else:
            attn = lambda: sparse_attention(q, k, v, layout)

        def step():
            with arm.context():
                attn().backward(do)
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
           "Avg. Active Threads Per Warp", "Theoretical Occupancy", "Block Limit Registers",
           "Block Limit Shared Mem", "Dynamic Shared Memory Per Block", "Grid Size",
           "Block Size")


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


def _num(x) -> float:
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


# The per-instruction warp-stall samples column of ``--page source`` (ncu 2025.3).
SAMPLES = "Warp Stall Sampling (All Samples)"


def summarise_source(text: str, top: int = 60) -> dict:
    """From ``ncu --page source --csv --print-source sass``: warp-stall samples and executed
    instructions by opcode, and the ``top`` instructions by samples (address, SASS, counts),
    so that the hot spots of two kernels can be compared without the GUI."""
    start = text.find('"Address"')
    rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
    needed = {"Source", SAMPLES, "Instructions Executed"}
    if not rows or not needed <= set(rows[0]):
        return {"error": f"no source rows with the columns {sorted(needed)}",
                "head": text[:2000]}
    by_op: dict = {}
    for r in rows:
        words = [w for w in r["Source"].split() if not w.startswith("@")]  # drop predicates
        name = words[0].split(".")[0] if words else "?"
        e = by_op.setdefault(name, {"samples": 0.0, "executed": 0.0, "static": 0})
        e["samples"] += _num(r[SAMPLES])
        e["executed"] += _num(r["Instructions Executed"])
        e["static"] += 1
    total = sum(e["samples"] for e in by_op.values()) or 1.0
    hot = sorted(rows, key=lambda r: -_num(r[SAMPLES]))[:top]
    return {"columns": list(rows[0]), "n_instructions": len(rows), "total_samples": total,
            "by_opcode": dict(sorted(by_op.items(), key=lambda kv: -kv[1]["samples"])),
            "hot": [{"address": r["Address"], "sass": r["Source"], "samples": _num(r[SAMPLES]),
                     "share": round(_num(r[SAMPLES]) / total, 4),
                     "executed": _num(r["Instructions Executed"])} for r in hot]}


def drive() -> None:
    out_dir = os.path.dirname(os.path.abspath(FLAGS.out))
    result = {"command": " ".join(sys.argv), "n": FLAGS.n, "runs": {}}
    ncu = find_ncu()
    result["ncu"] = ncu
    if ncu is None:
        result["error"] = "no ncu on this machine"
    else:
        # The two references first: if the call runs out of time, the comparisons lose first.
        runs = [("ours", None, None)] + ([("flex", None, None)] if FLAGS.flex else [])
        runs += [("ours", None, a) for entry in FLAGS.arms for a in entry.split(";") if a]
        runs += [("ours", v, FLAGS.variant_arm) for v in FLAGS.variants]
        tmp = tempfile.mkdtemp()
        for impl, variant, arm in runs:
            tag = impl if variant is None else os.path.splitext(os.path.basename(variant))[0]
            if arm:
                tag = (tag + "_" if variant else "") + _arm(arm).name
            tag = tag.lstrip(".")
            source = FLAGS.source and tag in FLAGS.source_tags
            report = os.path.join(tmp, tag)
            cmd = [ncu, "--profile-from-start", "off", "--target-processes", "all",
                   "-k", KERNEL_REGEX[impl], "-f", "-o", report]
            for sec in SECTIONS + (("SourceCounters",) if source else ()):
                cmd += ["--section", sec]
            cmd += ["--metrics", ",".join(METRICS)]
            cmd += [sys.executable, os.path.abspath(__file__), f"--impl={impl}",
                    f"--n={FLAGS.n}", "--out=/dev/null"]
            if variant:
                cmd.append(f"--variant={os.path.abspath(variant)}")
            if arm:
                cmd.append(f"--arm={arm}")
            env = dict(os.environ)
            if impl == "flex":  # a fresh Inductor/Triton cache: nothing stale is reused
                cache = tempfile.mkdtemp()
                env.update(TORCHINDUCTOR_CACHE_DIR=cache,
                           TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                   timeout=FLAGS.timeout_s)
                d = subprocess.run([ncu, "-i", report + ".ncu-rep", "--csv", "--page",
                                    "details"], capture_output=True, text=True, timeout=120)
                # Raw details stay on the machine (8 files come back from a device call).
                raw = os.path.join(tmp, f"ncu_backward_{tag}.csv")
                with open(raw, "w") as f:
                    f.write(d.stdout)
                run = {"rc": p.returncode, "stderr": (p.stderr + d.stderr)[-3000:],
                       "kernels": summarise(d.stdout)}
                if source:
                    run["source"] = {}
                    for part, regex in SOURCE_KERNELS[impl].items():  # ours: dkdv, dq
                        sp = subprocess.run([ncu, "-i", report + ".ncu-rep", "-k", regex,
                                             "--csv", "--page", "source", "--print-source",
                                             "sass"], capture_output=True, text=True,
                                            timeout=120)
                        with open(os.path.join(out_dir, f"ncu_source_{tag}_{part}.csv"),
                                  "w") as f:
                            f.write(sp.stdout)
                        run["source"][part] = {"rc": sp.returncode, "stderr": sp.stderr[-2000:],
                                               **summarise_source(sp.stdout)}
                result["runs"][tag] = run
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
