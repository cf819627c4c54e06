"""Question: how much host time does one attention call cost where the GPU has almost nothing to
do, and where does it go?

At N=8192 the light patterns' forward+backward sits on the host floor, so the host's share
decides those rows. With a small problem (default: window, N=1024, one head, D=128, bf16) and
200 back-to-back calls then one synchronize, microseconds per call of:

* the forward; the forward while autograd records the graph; forward+backward through autograd;
* the frontend's backward called directly, and the same backward's time inside autograd
  (autograd runs CUDA backwards on its own thread);
* a trivial autograd forward+backward on the same leaves (autograd's own floor);
* dense causal ``scaled_dot_product_attention``, forward and forward+backward (the anchor);

for each arm (``attention_common``'s arm spec; default: the C++ autograd node and launches,
``sparsetp.backends.torch.native``, against the Python autograd Function, ``native_autograd=0``),
interleaved over ``--rounds``. Then a cProfile of 50 direct backward calls under
``--profile_arm`` (default: the first arm; the top functions by own time), and with ``--trace``
a Chrome trace of 20 forward+backward calls (``torch.profiler``, both threads, Python stacks).

Believe it only if ``python -m pytest -q tests/torch_attention_test.py tests/torch_native_test.py``
passes; host times move with the machine's load, so compare arms of one run only::

    python benchmarks/host_overhead.py --out=$OUT/host.json --trace=$OUT/host_trace.json \
        --plot=$OUT/host.png
    python benchmarks/host_overhead.py --from_json=host.json --plot=docs/host_overhead.png

On CPU (the interpreter; a smoke test of this script, not a measurement)::

    python benchmarks/host_overhead.py --device=cpu --n=128 --head_dim=32 --calls=2 --warmup=1
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from unittest import mock

import attention_common as C
import torch
from absl import app, flags

from sparsetp.backends.torch import attention as tattn
from sparsetp.core import make_layout

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "host_overhead.json", "where to write the JSON")
flags.DEFINE_multi_string("arms", ["native;python:native_autograd=0"],
                          "arm specs, ';'-separated")
flags.DEFINE_integer("n", 1024, "N")
flags.DEFINE_integer("heads", 1, "H")
flags.DEFINE_integer("head_dim", 128, "D")
flags.DEFINE_string("pattern", "window", "target pattern")
flags.DEFINE_integer("calls", 200, "back-to-back calls per measurement")
flags.DEFINE_integer("warmup", 20, "calls before each measurement")
flags.DEFINE_integer("rounds", 2, "interleaved rounds")
flags.DEFINE_string("trace", None, "write a Chrome trace of 20 fwd+bwd calls here")
flags.DEFINE_string("profile_arm", None, "the arm whose direct backward is profiled "
                    "(default: the first)")
flags.DEFINE_enum("device", "cuda", ["cuda", "cpu"], "cpu: the interpreter (smoke test only)")
flags.DEFINE_string("plot", None, "also draw the medians as a bar chart (PNG) here")
flags.DEFINE_string("from_json", None, "do not measure: draw --plot from this run's JSON")


KEYS = ("fwd_us", "fwd_recording_graph_us", "fwd_bwd_us", "direct_backward_us",
        "backward_inside_autograd_us", "trivial_autograd_fwd_bwd_us", "sdpa_fwd_us",
        "sdpa_fwd_bwd_us", "fwd_gpu_ms", "fwd_bwd_gpu_ms")


def host_us(fn, device) -> float:
    """Host microseconds per call over ``--calls`` back-to-back calls and one synchronize."""
    for _ in range(FLAGS.warmup):
        fn()
    C.sync(device)
    t0 = time.perf_counter()
    for _ in range(FLAGS.calls):
        fn()
    C.sync(device)
    return (time.perf_counter() - t0) / FLAGS.calls * 1e6


# (label, key) of the bar chart, our path's and SDPA's side by side where both exist.
_BARS = (("forward", "fwd_us", "sdpa_fwd_us"),
         ("forward, autograd recording", "fwd_recording_graph_us", None),
         ("forward + backward", "fwd_bwd_us", "sdpa_fwd_bwd_us"),
         ("backward called directly", "direct_backward_us", None),
         ("backward inside autograd", "backward_inside_autograd_us", None),
         ("autograd floor: trivial ops,\nno attention", "trivial_autograd_fwd_bwd_us", None))


def plot(data: dict, path: str) -> None:
    """Bar chart of a run's medians (microseconds per call), each arm beside dense SDPA."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    medians = data["medians"]
    arms = list(medians)
    width = 0.8 / (len(arms) + 1)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, arm in enumerate(arms):
        ax.bar([j + i * width for j in range(len(_BARS))], [medians[arm][k] for _, k, _ in _BARS],
               width, label=f"sparsetp ({arm})")
    sdpa = [medians[arms[0]][s] if s else 0.0 for _, _, s in _BARS]
    ax.bar([j + len(arms) * width for j in range(len(_BARS))], sdpa, width,
           label="dense SDPA (same process)", color="grey")
    ax.set_xticks([j + width * len(arms) / 2 for j in range(len(_BARS))],
                  [label for label, _, _ in _BARS], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("host microseconds per call")
    env = data.get("env", {})
    command = env.get("command", "").split(" --out")[0]
    ax.set_title(f"host time per call, {env.get('device', '?')} host, torch "
                 f"{env.get('torch', '?')}, triton {env.get('triton', '?')}\n{command}",
                 fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    del argv
    if FLAGS.from_json:
        import json  # noqa: PLC0415

        if not FLAGS.plot:
            raise app.UsageError("--from_json draws --plot; give both")
        with open(FLAGS.from_json) as f:
            plot(json.load(f), FLAGS.plot)
        return
    rec = C.Record(FLAGS.out)
    dev, n, h, d = FLAGS.device, FLAGS.n, FLAGS.heads, FLAGS.head_dim
    if dev == "cuda":  # arms with native_autograd on run the C++ node once it has built
        from sparsetp.backends.torch import native  # noqa: PLC0415

        rec.data["native"] = native.wait()
        rec.log(f"native extension: {rec.data['native']}")
    arms = C.parse_arms(FLAGS.arms)
    layout = make_layout(C.anchor_pattern(FLAGS.pattern), n, h, arms[0].block)
    if any(a.block != arms[0].block for a in arms):
        raise app.UsageError("host-overhead arms share one layout block")
    q, k, v, qg, kg, vg, d_out = C.inputs(n, h, d, "bfloat16", dev, seed=4)
    scale = d ** -0.5
    out_, lse_ = tattn._forward(q, k, v, layout, scale)

    def direct_backward():
        tattn._backward(q, k, v, out_, lse_, d_out, None, layout, scale)

    def attn(q, k, v):  # the common call: no LSE (an LSE output with gradients stays on Python)
        return tattn.sparse_attention(q, k, v, layout)

    def fwd_bwd():
        attn(qg, kg, vg).backward(d_out)

    inside: list = []
    real_backward = tattn._Plan.backward  # what the autograd Function's backward calls

    def timed_backward(*a, **kw):
        t = time.perf_counter()
        r = real_backward(*a, **kw)
        inside.append(time.perf_counter() - t)
        return r

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def measure(arm):
        inside.clear()
        with mock.patch.object(tattn._Plan, "backward", timed_backward):
            host_us(fwd_bwd, dev)
        e = {"fwd_us": host_us(lambda: attn(q, k, v), dev),
             "fwd_recording_graph_us": host_us(lambda: attn(qg, kg, vg), dev),
             "fwd_bwd_us": host_us(fwd_bwd, dev),
             "direct_backward_us": host_us(direct_backward, dev),
             # The Python backward's own time; NaN where the C++ node ran every backward.
             "backward_inside_autograd_us": (sum(inside[FLAGS.warmup:]) * 1e6
                                             / len(inside[FLAGS.warmup:])
                                             if inside[FLAGS.warmup:] else float("nan")),
             "trivial_autograd_fwd_bwd_us": host_us(
                 lambda: (qg * 1.0 + kg * 1.0 + vg * 1.0).backward(d_out), dev),
             "sdpa_fwd_us": host_us(lambda: sdpa(q, k, v), dev),
             "sdpa_fwd_bwd_us": host_us(lambda: sdpa(qg, kg, vg).backward(d_out), dev),
             "fwd_gpu_ms": C.bench_ms(lambda: attn(q, k, v), dev),
             "fwd_bwd_gpu_ms": C.bench_ms(fwd_bwd, dev, [qg, kg, vg])}
        rec.log(f"{arm}: {e}")
        assert tuple(e) == KEYS
        return tuple(e.values())

    med, rows = C.interleaved({a.name: a.context for a in arms}, FLAGS.rounds, measure)
    rec.data["medians"] = {a: dict(zip(KEYS, m, strict=True)) for a, m in med.items()}
    rec.data["raw"] = {a: [dict(zip(KEYS, r, strict=True)) for r in rs] for a, rs in rows.items()}
    rec.log(f"medians: {rec.data['medians']}")
    rec.save()
    if FLAGS.plot:
        plot(rec.data, FLAGS.plot)

    profiled = {a.name: a for a in arms}.get(FLAGS.profile_arm or arms[0].name)
    if profiled is None:
        raise app.UsageError(f"--profile_arm={FLAGS.profile_arm} names no arm")
    prof = cProfile.Profile()
    with profiled.context():
        prof.enable()
        for _ in range(50 if dev == "cuda" else 2):
            direct_backward()
        C.sync(dev)
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    rec.data["profile_direct_backward"] = buf.getvalue()[-6000:]
    print(rec.data["profile_direct_backward"], flush=True)
    if FLAGS.trace:
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        for _ in range(10):
            fwd_bwd()
        C.sync(dev)
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as tprof:
            for _ in range(20):
                fwd_bwd()
            C.sync(dev)
        tprof.export_chrome_trace(FLAGS.trace)
        rec.data["trace"] = FLAGS.trace
    sys.exit(rec.finish())


if __name__ == "__main__":
    app.run(main)
