"""Question: what does one jitted JAX call of the attention cost on the host, and does the
allocator, a torch runtime in the process, or the number of array arguments change it?

JAX only (torch too with ``--with_torch``): per case (bf16, B=1, H=16, D=128, block 128) the
forward's ms per call in the bench's wall-clock loops (``_time_wall``, 30 ms loops) and the host
microseconds to enqueue 200 calls; then a trivial jitted op (``x + 1``) with 0, 4, 11 and 16
extra array arguments, enqueued 500 times. Allocator and XLA flags come from the environment,
so compare variants run by run::

    export PYTHONPATH=/tmp/site:$PWD
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmarks/jax_dispatch_probe.py
    XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 python3 ... --with_torch
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 ...

GPU only. Believe it only if ``tests/jax_attention_test.py`` passes.
"""

from __future__ import annotations

import os

import attention_common as C
import jax
import jax.numpy as jnp
from absl import app, flags

from sparsetp.bench.attention import bench_pattern
from sparsetp.core import make_layout
from sparsetp.jax import layout_arrays, sparse_attention

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["strided_causal@8192", "window:1024@32768"], "pattern@N")
flags.DEFINE_bool("with_torch", False, "run a torch attention call on the GPU first")

H, D, BLOCK = 16, 128, 128


def main(argv):
    del argv
    if FLAGS.with_torch:
        import torch  # noqa: PLC0415

        from sparsetp.torch import sparse_attention as torch_attention  # noqa: PLC0415

        t = torch.randn(1, H, 8192, D, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            torch_attention(t, t, t, make_layout(
                bench_pattern("strided_causal", 8192, BLOCK, H).pattern, 8192, H, BLOCK))
        torch.cuda.synchronize()
    dev = jax.devices("gpu")[0]
    env = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                          "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS")}
    print(f"JAX {jax.__version__}, torch in process: {FLAGS.with_torch}, env {env}")
    for case in FLAGS.cases:
        spec, n = case.rsplit("@", 1)
        n = int(n)
        layout = make_layout(bench_pattern(spec, n, BLOCK, H).pattern, n, H, BLOCK)
        lay = jax.device_put(layout_arrays(layout, head_dim=D, dtype="bfloat16",
                                           static_widths=True), dev)
        key = jax.random.PRNGKey(0)
        q, k, v = (jax.device_put(jax.random.normal(jax.random.fold_in(key, i), (1, H, n, D),
                                                    jnp.bfloat16), dev) for i in range(3))
        fwd = jax.jit(lambda q, k, v, lay: sparse_attention(q, k, v, lay))

        def call(fwd=fwd, q=q, k=k, v=v, lay=lay):
            return fwd(q, k, v, lay)

        ms = C.wall_loop_ms(call, jax.block_until_ready, 30.0)
        print(f"{spec} N={n}: {ms * 1e3:.1f} us per call in 30 ms loops; enqueue "
              f"{C.enqueue_us(call, jax.block_until_ready, 200):.1f} us per call over 200 calls, "
              f"{C.enqueue_us(call, jax.block_until_ready, 50):.1f} over 50")
    x = jax.device_put(jnp.ones((1024,), jnp.float32), dev)
    extra = [jax.device_put(jnp.full((64,), i, jnp.int32), dev) for i in range(16)]
    for n_extra in (0, 4, 11, 16):
        op = jax.jit(lambda x, *rest: x + 1.0)

        def trivial(op=op, args=tuple(extra[:n_extra])):
            return op(x, *args)

        print(f"x + 1 with {n_extra} extra array arguments: enqueue "
              f"{C.enqueue_us(trivial, jax.block_until_ready, 500):.1f} us per call")


if __name__ == "__main__":
    app.run(main)
