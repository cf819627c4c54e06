"""Question: where JAX's forward is slower than torch's in pipelined wall-clock loops (issue #34
target F3, issue #32's N4), is it the kernel or the launch?

Per case (bf16, B=1, H=16, D=128, block 128, the frontier preset's shapes): the forward in
wall-clock loops of back-to-back calls in both frameworks (one sync per loop, as the bench times
F3), torch's kernel time per call from a CUDA graph of 20 calls (no host in between), and JAX's
kernel time per call from ``jax.profiler`` (its GPU trace; run in a process where no torch
profiler holds CUPTI). Equal kernel times with a slower JAX wall time put the difference in JAX's
per-call launch, not in the kernel. GPU only. Believe it only if ``tests/jax_attention_test.py``
and ``tests/torch_attention_test.py`` pass::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/jax_launch_probe.py --out_dir=$OUT/jax_launch
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import attention_common as C  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app, flags  # noqa: E402

from sparsetp.bench.attention import bench_pattern  # noqa: E402
from sparsetp.core import make_layout  # noqa: E402
from sparsetp.jax import layout_arrays  # noqa: E402
from sparsetp.jax import sparse_attention as jax_attention  # noqa: E402
from sparsetp.torch import sparse_attention as torch_attention  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "/tmp/jax_launch", "where the JAX traces go")
flags.DEFINE_list("cases", ["window:1024@32768", "strided_causal@8192", "causal@8192"],
                  "pattern@N")
flags.DEFINE_integer("calls", 20, "calls per graph / trace")
flags.DEFINE_float("loop_ms", 30.0, "length of one wall-clock loop (the bench's jax_loop_ms)")

H, D, BLOCK = 16, 128, 128


def torch_graph_ms(fn, calls) -> float:
    """ms per call of ``calls`` calls of ``fn`` replayed as one CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def jax_trace_kernels_ms(fn, calls, log_dir) -> tuple[dict, float | None]:
    """``({kernel name: ms per call}, median idle us between consecutive kernels)`` from a
    ``jax.profiler`` trace of ``calls`` back-to-back calls."""
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(calls):
            r = fn()
        jax.block_until_ready(r)
    out, spans = {}, []
    for path in glob.glob(f"{log_dir}/**/*.trace.json.gz", recursive=True):
        with gzip.open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "GPU" in str(e["args"].get("name"))}
        for e in events:
            if e.get("ph") == "X" and e.get("pid") in gpu:
                out[e["name"]] = out.get(e["name"], 0.0) + e["dur"] / 1e3 / calls
                spans.append((float(e["ts"]), float(e["dur"])))
    spans.sort()
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(spans, spans[1:], strict=False)]
    return out, ((float(np.median(gaps)), float(np.mean(gaps))) if gaps else None)


def torch_sync(_):
    torch.cuda.synchronize()


def main(argv):
    del argv
    dev = jax.devices("gpu")[0]
    for case in FLAGS.cases:
        spec, n = case.rsplit("@", 1)
        n = int(n)
        layout = make_layout(bench_pattern(spec, n, BLOCK, H).pattern, n, H, BLOCK)
        q, k, v = (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

        def torch_call(q=q, k=k, v=v, layout=layout):
            return torch_attention(q, k, v, layout)

        with torch.no_grad():
            t_wall = C.wall_loop_ms(torch_call, torch_sync, FLAGS.loop_ms)
            t_kernel = torch_graph_ms(torch_call, FLAGS.calls)
            t_host = C.enqueue_us(torch_call, torch_sync, 50)
        lay = jax.device_put(layout_arrays(layout, head_dim=D, dtype="bfloat16",
                                           static_widths=True), dev)
        jq, jk, jv = (jax.device_put(jnp.asarray(t.float().cpu().numpy(), jnp.bfloat16), dev)
                      for t in (q, k, v))
        fwd = jax.jit(lambda q, k, v, lay: jax_attention(q, k, v, lay))

        def call(fwd=fwd, jq=jq, jk=jk, jv=jv, lay=lay):
            return fwd(jq, jk, jv, lay)

        j_wall = C.wall_loop_ms(call, jax.block_until_ready, FLAGS.loop_ms)
        j_host = C.enqueue_us(call, jax.block_until_ready, 50)
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        kernels, gap = jax_trace_kernels_ms(call, FLAGS.calls, tempfile.mkdtemp(
            prefix=f"{spec.replace(':', '_')}_{n}_", dir=FLAGS.out_dir))
        print(f"{spec} N={n}: wall torch {t_wall:.3f} ms, JAX {j_wall:.3f} ms "
              f"(JAX / torch {j_wall / t_wall:.3f}); kernel per call: torch {t_kernel:.3f} ms "
              f"(CUDA graph), JAX {kernels} (trace); JAX's GPU idle between calls (median, mean):"
              f" {gap} us; torch's wall - kernel: {(t_wall - t_kernel) * 1e3:.1f} us; host "
              f"per call: torch {t_host:.1f} us, JAX {j_host:.1f} us")


if __name__ == "__main__":
    app.run(main)
