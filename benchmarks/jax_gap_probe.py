"""Where a JAX forward loop spends GPU time that torch's does not (issue #34 F3): the jitted
forward's optimised HLO, and CUPTI's kernel records (torch.profiler sees the whole process,
XLA's kernels too) of back-to-back JAX and torch calls: each kernel's duration and the idle gap
before it.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/jax_gap_probe.py \\
        --out=$OUT/jax_gap_probe.json
"""

from __future__ import annotations

import json
import os

from absl import app, flags

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

FLAGS = flags.FLAGS
flags.DEFINE_list("patterns", ["window:1024", "bigbird"], "bench patterns")
flags.DEFINE_integer("seq_len", 8192, "N")
flags.DEFINE_integer("calls", 30, "profiled calls per arm")
flags.DEFINE_string("out", None, "JSON output")


def _events(prof):
    """(name, start us, duration us) of the GPU kernels and memory ops, in time order."""
    out = []
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out.append((e.name, e.time_range.start, e.time_range.end - e.time_range.start))
    return sorted(out, key=lambda x: x[1])


def _summary(events):
    names, gaps = {}, []
    for i, (name, start, dur) in enumerate(events):
        s = names.setdefault(name[:60], [0, 0.0])
        s[0] += 1
        s[1] += dur
        if i:
            prev = events[i - 1]
            gaps.append(start - (prev[1] + prev[2]))
    gaps.sort()
    return {"kernels": {k: {"count": c, "mean_us": t / c} for k, (c, t) in names.items()},
            "gap_us_median": gaps[len(gaps) // 2] if gaps else None,
            "gap_us_p90": gaps[int(len(gaps) * 0.9)] if gaps else None,
            "span_us_per_call": (events[-1][1] + events[-1][2] - events[0][1]) / FLAGS.calls
            if events else None}


def _case(spec):
    import jax  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    from sparsetp import jax as sjax  # noqa: PLC0415
    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    n, h, d = FLAGS.seq_len, 16, 128
    layout = make_layout(bench_pattern(spec, n, 128, h).pattern, n, h, 128)
    ts = [torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    js = [jax.dlpack.from_dlpack(t) for t in ts]
    lay = sjax.layout_arrays(layout, head_dim=d, dtype="bfloat16")
    f = jax.jit(lambda q, k, v, lay: sjax.sparse_attention(q, k, v, lay))
    hlo = f.lower(*js, lay).compile().as_text()
    arms = {"jax": (lambda: f(*js, lay), jax.block_until_ready),
            "torch": (lambda: sparse_attention(*ts, layout), lambda r: torch.cuda.synchronize())}
    rec = {"pattern": spec, "N": n, "hlo": hlo[-6000:]}
    for name, (fn, sync) in arms.items():
        for _ in range(5):
            r = fn()
        sync(r)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(FLAGS.calls):
                r = fn()
            sync(r)
        rec[name] = _summary(_events(prof))
    return rec


def main(argv):
    del argv
    recs = []
    for spec in FLAGS.patterns:
        try:
            rec = _case(spec)
        except Exception as exc:  # noqa: BLE001
            rec = {"pattern": spec, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(json.dumps({k: v for k, v in rec.items() if k != "hlo"}), flush=True)
        recs.append(rec)
    if FLAGS.out:
        with open(FLAGS.out, "w") as fh:
            json.dump(recs, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
