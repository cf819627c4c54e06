"""Where JAX's sm_90 forward loses time against torch's in wall-clock loops (issue #34 F3).

JAX launches the Gluon kernels from ``buffer_callback`` (``sparsetp/backends/jax/hopper.py``):
a Python callback per launch inside XLA's computation. Per case (bf16, B=1, H=16, D=128, block
128), in one process on the same inputs:

* ms per call in the bench's wall-clock loops (``attention_common.wall_loop_ms``, one sync per
  loop) and host microseconds per call to enqueue 200 calls (``enqueue_us``): torch (its C++
  node), JAX with the callback run per call, JAX with the callback recorded into XLA's command
  buffers (``buffer_callback(command_buffer_compatible=True)``, patched in while tracing), and
  JAX's portable kernel;
* whether the command-buffer variant gives the per-call variant's bits on two input sets used
  in turn (the recorded launch must follow the buffers).

If a JAX loop's ms per call is its enqueue time, the loop is host-bound.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/jax_gluon_probe.py \\
        --out=$OUT/jax_gluon_probe.json
"""

from __future__ import annotations

import functools
import os
from unittest import mock

from absl import app, flags

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

FLAGS = flags.FLAGS
flags.DEFINE_list("patterns", ["window:1024", "bigbird", "strided_causal", "causal"],
                  "bench patterns (sparsetp.bench.attention)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_integer("heads", 16, "H")
flags.DEFINE_integer("calls", 200, "calls per enqueue timing")
flags.DEFINE_string("out", None, "write the records here as JSON")


def _case(spec: str, n: int) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from attention_common import enqueue_us, wall_loop_ms  # noqa: PLC0415
    from jax.experimental import buffer_callback  # noqa: PLC0415

    from sparsetp import jax as sjax  # noqa: PLC0415
    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels.options import launch_options  # noqa: PLC0415
    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    h, d = FLAGS.heads, 128
    layout = make_layout(bench_pattern(spec, n, 128, h).pattern, n, h, 128)
    ts = [torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    js = [jax.dlpack.from_dlpack(t) for t in ts]  # the same device memory
    lay = sjax.layout_arrays(layout, head_dim=d, dtype="bfloat16")

    def jitted(command_buffer: bool, portable: bool = False):
        mode = "portable" if portable else "auto"
        # The library's launcher imports buffer_callback at trace time.
        wrap = functools.partial(buffer_callback.buffer_callback,
                                 command_buffer_compatible=command_buffer)
        with launch_options(fwd_kernel=mode, bwd_kernel=mode), \
                mock.patch.object(buffer_callback, "buffer_callback", wrap):
            f = jax.jit(lambda q, k, v, lay: sjax.sparse_attention(q, k, v, lay))
            f(*js[:3], lay).block_until_ready()  # traced (and compiled) under these settings
        return f

    per_call, recorded, portable = jitted(False), jitted(True), jitted(False, portable=True)
    rec = {"pattern": spec, "N": n,
           "jax_forward_kernel": sjax.forward_kernel(*js[:3], layout).name}
    a = [np.asarray(per_call(*js[i:i + 3], lay).astype(jnp.float32)) for i in (0, 3)]
    b = [np.asarray(recorded(*js[i:i + 3], lay).astype(jnp.float32)) for i in (0, 3, 0, 3)]
    rec["command_buffer_bitwise"] = bool(all(np.array_equal(a[i % 2], b[i]) for i in range(4)))

    def jax_sync(r):
        jax.block_until_ready(r)

    def torch_sync(r):
        torch.cuda.synchronize()

    arms = {"torch": (lambda: sparse_attention(*ts[:3], layout), torch_sync),
            "jax_callback": (lambda: per_call(*js[:3], lay), jax_sync),
            "jax_command_buffer": (lambda: recorded(*js[:3], lay), jax_sync),
            "jax_portable": (lambda: portable(*js[:3], lay), jax_sync)}
    rec["wall_ms"] = {k: wall_loop_ms(fn, sync) for k, (fn, sync) in arms.items()}
    rec["enqueue_us"] = {k: enqueue_us(fn, sync, FLAGS.calls) for k, (fn, sync) in arms.items()}
    rec["wall_ms_again"] = {k: wall_loop_ms(fn, sync) for k, (fn, sync) in arms.items()}
    t = rec["wall_ms"]["torch"]
    rec["over_torch"] = {k: v / t for k, v in rec["wall_ms"].items()}
    return rec


def main(argv):
    del argv
    from gluon_tools import run_cases  # noqa: PLC0415

    run_cases(_case, FLAGS.seq_lens, FLAGS.patterns, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
