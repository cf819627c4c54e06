"""JAX launching the library's sm_90 Gluon forward through ``jax.experimental.buffer_callback``.
Lab probe, **not yet run on a GPU** (written in session 22 without device time; KERNEL_NOTES,
"Session 22").

Question (issue #34 F3, JAX within 5% of torch; 0 of 20 since the torch frontend runs the sm_90
kernels and JAX cannot): can a jitted JAX program launch the Gluon kernels itself? jax_triton
cannot (no TMA descriptors, ``num_warps`` warps only). ``buffer_callback`` (jax >= 0.7; 0.10.2
here, 0.11.2 on the GPU machine) calls a Python function inside the jitted computation with
XLA's device buffers (``__cuda_array_interface__``) and its stream (``ctx.stream``). Triton's
compiled kernel launches from raw pointers (``CompiledKernel.run``, as
``backends/torch/hopper.Sm90Kernels`` does after its first call), and its launcher builds a TMA
descriptor from a box's base pointer, shape and strides only. So: compile once, then launch from
the callback on XLA's stream. The probe compiles through the torch launcher (a shortcut: the
same compiled kernel, metadata already on the device); a library version would compile with
``triton.compile(GluonASTSource(...))`` as ``gluon_tools.sm90_profile`` does, without torch.

Per case: the JAX callback's output and LSE against the torch sm_90 forward on the same device
memory (must be bitwise equal: the same kernel on the same inputs) and against the portable JAX
forward (within bf16 rounding); then pipelined wall loops (one sync per loop, as the frontier's
F3): JAX portable, JAX callback, torch. Prediction: the callback adds tens of microseconds of
host time per call (Python under XLA's executor), so JAX reaches torch's forward at N = 32768 and
stays behind at short kernels.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/jax_gluon_probe.py \\
        --out=$OUT/jax_gluon_probe.json
"""

from __future__ import annotations

import os

from absl import app, flags

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

FLAGS = flags.FLAGS
flags.DEFINE_list("patterns", ["causal", "window:1024", "bigbird", "strided_causal"],
                  "bench patterns (sparsetp.bench.attention)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_integer("heads", 16, "H")
flags.DEFINE_string("out", None, "write the records here as JSON")


class _Ptr:
    """A device pointer with the ``data_ptr()`` Triton's launcher reads of a descriptor base."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Box:
    """What Triton's launcher reads of a host tensor descriptor: the ``[rows, d]`` view of a
    contiguous buffer (``backends/torch/hopper._Box``, on a raw pointer)."""

    padding = "zero"

    def __init__(self, ptr: int, shape, d: int):
        rows = 1
        for s in shape:
            rows *= int(s)
        self.base, self.shape, self.strides = _Ptr(ptr), [rows // d, d], [d, 1]


def _ptr(buf) -> int:
    return int(buf.__cuda_array_interface__["data"][0])


def _case(spec: str, n: int) -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from attention_common import wall_loop_ms  # noqa: PLC0415
    from jax.experimental.buffer_callback import buffer_callback  # noqa: PLC0415

    from sparsetp import jax as sjax  # noqa: PLC0415
    from sparsetp.backends.torch import attention as tattn  # noqa: PLC0415
    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels import hopper  # noqa: PLC0415
    from sparsetp.kernels.options import launch_options  # noqa: PLC0415
    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    h, d = FLAGS.heads, 128
    scale = d ** -0.5
    layout = make_layout(bench_pattern(spec, n, hopper.BLOCK, h).pattern, n, h, hopper.BLOCK)
    qt, kt, vt = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)
                  for _ in range(3))
    with launch_options(fwd_kernel="hopper"):
        sparse_attention(qt, kt, vt, layout)  # compiles through Triton's JIT entry
        ref_out, ref_lse = sparse_attention(qt, kt, vt, layout, return_lse=True)
        plan = tattn._plan(qt, kt, vt, layout, scale)
    sm = plan.sm90
    c = sm.compiled["fwd"]
    q, k, v = (jax.dlpack.from_dlpack(t) for t in (qt, kt, vt))  # the same device memory

    def launch(ctx, outs, q, k, v):
        out, lse = outs
        boxes = tuple(_Box(_ptr(b), b.shape, d) for b in (q, k, v))
        c.run(*sm.grid, ctx.stream, c.function, c.packed_metadata, None, None, None, *boxes,
              *sm.arg_values, _ptr(out), _ptr(lse), sm.ordered, hopper.STAGES,
              hopper.CONSUMER_REGS, hopper.PRODUCER_REGS, hopper.PINGPONG, hopper.NUM_WARPS)

    gluon = jax.jit(buffer_callback(
        launch, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))))
    portable = jax.jit(lambda q, k, v: sjax.sparse_attention(q, k, v, layout))
    out, lse = gluon(q, k, v)
    rec = {"pattern": spec, "N": n,
           "bitwise_vs_torch": bool(np.array_equal(np.asarray(out.astype(jnp.float32)),
                                                   ref_out.float().cpu().numpy())
                                    and np.array_equal(np.asarray(lse), ref_lse.cpu().numpy())),
           "max_abs_vs_jax_portable": float(jnp.abs(out.astype(jnp.float32) - portable(
               q, k, v).astype(jnp.float32)).max())}

    def jax_sync(r):
        jax.block_until_ready(r)

    def torch_sync(r):
        torch.cuda.synchronize()

    rec["wall_ms"] = {
        "jax_portable": wall_loop_ms(lambda: portable(q, k, v), jax_sync),
        "jax_callback": wall_loop_ms(lambda: gluon(q, k, v), jax_sync),
        "torch": wall_loop_ms(lambda: sparse_attention(qt, kt, vt, layout), torch_sync)}
    rec["jax_callback_over_torch"] = rec["wall_ms"]["jax_callback"] / rec["wall_ms"]["torch"]
    return rec


def main(argv):
    del argv
    from gluon_tools import run_cases  # noqa: PLC0415

    run_cases(_case, FLAGS.seq_lens, FLAGS.patterns, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
