"""Question (issue #34 F3): at N=8192 the JAX forward's wall-clock loop takes 10-15 us a call
more than torch's on the same sm_90 kernel (0.13-0.17 ms kernels: window 1024, BigBird,
strided causal). Is that GPU work JAX adds around the kernel (copies, fills, layout
transposes) or host time the loop does not hide?

Both frontends' forwards on the same inputs, the bench's own wall-clock loops
(``attention_common.wall_loop_ms``: back-to-back calls, one sync), then each under the torch
profiler (CUPTI sees every kernel of the process, XLA's too): the kernels of one call, name,
count and GPU time, and the GPU-busy time per call against the wall time per call. Also JAX's
optimized HLO of the jitted forward.

    python benchmarks/jax_fwd_probe.py --out=$OUT/jax_fwd_probe.json
"""

from __future__ import annotations

import collections
import json
import os

import attention_common as C
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "jax_fwd_probe.json", "where to write the JSON")
flags.DEFINE_list("patterns", ["window:1024", "bigbird", "strided_causal"], "bench patterns")
flags.DEFINE_integer("n", 8192, "sequence length (B=1, H=16, D=128, bf16, block 128)")
flags.DEFINE_float("loop_ms", 30.0, "wall-clock loop length (the bench's)")
flags.DEFINE_integer("input_sets", 1, "input sets the calls rotate through (the bench: 3)")


def _kernels(fn, sync, calls):
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    sync(fn())
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            r = fn()
        sync(r)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    first, last = spans[0][0], spans[-1][1]
    return ({k: {"per_call": v[0] / calls, "us_per_call": v[1] / calls}
             for k, v in sorted(per.items(), key=lambda kv: -kv[1][1])},
            (last - first) / calls)


def main(argv):
    del argv
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.jax import layout_arrays  # noqa: PLC0415
    from sparsetp.jax import sparse_attention as jattn  # noqa: PLC0415
    from sparsetp.torch import sparse_attention as tattn  # noqa: PLC0415

    b, h, n, d = 1, 16, FLAGS.n, 128
    out = {"n": n, "input_sets": FLAGS.input_sets, "cases": {}}
    for name in FLAGS.patterns:
        layout = make_layout(bench_pattern(name, n, 128, h).pattern, n, h, 128)
        rng = np.random.default_rng(0)
        dev = jax.devices("gpu")[0]
        tsets, jsets = [], []
        for _ in range(FLAGS.input_sets):
            x = [rng.standard_normal((b, h, n, d), np.float32) for _ in range(3)]
            tsets.append([torch.from_numpy(a).cuda().bfloat16() for a in x])
            jsets.append([jax.device_put(jnp.asarray(a, jnp.bfloat16), dev) for a in x])
        lay = jax.device_put(layout_arrays(layout, head_dim=d, dtype="bfloat16",
                                           static_widths=True), dev)
        fwd_j = jax.jit(lambda q, k, v, lay: jattn(q, k, v, lay))
        turn = {"t": 0, "j": 0}

        def tf(tsets=tsets, layout=layout, turn=turn):
            turn["t"] = (turn["t"] + 1) % len(tsets)
            with torch.no_grad():
                return tattn(*tsets[turn["t"]], layout)

        def jf(fwd_j=fwd_j, jsets=jsets, lay=lay, turn=turn):
            turn["j"] = (turn["j"] + 1) % len(jsets)
            return fwd_j(*jsets[turn["j"]], lay)

        def tsync(r):
            torch.cuda.synchronize()

        jsync = jax.block_until_ready
        rec = {"torch_wall_ms": C.wall_loop_ms(tf, tsync, FLAGS.loop_ms),
               "jax_wall_ms": C.wall_loop_ms(jf, jsync, FLAGS.loop_ms)}
        rec["torch_wall_ms_again"] = C.wall_loop_ms(tf, tsync, FLAGS.loop_ms)
        rec["torch_kernels"], rec["torch_span_us"] = _kernels(tf, tsync, 50)
        rec["jax_kernels"], rec["jax_span_us"] = _kernels(jf, jsync, 50)
        rec["jax_hlo_ops"] = [line.strip()[:200] for line in
                              fwd_j.lower(*jsets[0], lay).compile().as_text().splitlines()
                              if " = " in line and "ENTRY" not in line][:40]
        out["cases"][name] = rec
        print(name, {k: v for k, v in rec.items() if "wall" in k or "span" in k}, flush=True)
        for side in ("torch", "jax"):
            for k, v in list(rec[f"{side}_kernels"].items())[:6]:
                print(f"  {side}: {v['per_call']:.2f}/call {v['us_per_call']:8.1f} us  {k[:90]}")
    print("\n".join(out["cases"][FLAGS.patterns[0]]["jax_hlo_ops"]))
    with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
