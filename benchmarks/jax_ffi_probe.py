"""JAX launching the sm_90 kernels through an XLA FFI handler in C++ instead of a Python
``buffer_callback`` (issue #34 F3). Lab probe, **not yet run on a GPU** (written in session 23
without device time; KERNEL_NOTES, "Session 23").

Question: JAX's short forwards at N=8192 (0.13-0.17 ms kernels) are host-bound with the library's
callback launcher (F3 1.07-1.36 there). ``jax_ffi/sm90_ffi.cc`` launches the same compiled
kernel (the library's ``backends/jax/hopper.compile_launch``) from C++: the handler encodes the
TMA descriptors and calls ``cuLaunchKernelEx`` with Triton 3.6's parameter packing, so a call
costs XLA's dispatch only. It loads the cubin itself (``cuModuleLoadData``), so it would also
drop the fast path's need for torch beside JAX.

Per case (bf16, B=1, H=16, D=128, block 128): the FFI forward's output and LSE against the
library's (must be bitwise equal: the same kernel), then the bench's wall-clock loops in
alternating rounds (median of the rounds' ratios): torch, JAX callback, JAX FFI. Prediction:
the FFI forward reaches torch's at 8192 (<= 1.05) where the callback does not.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 benchmarks/jax_ffi_probe.py \\
        --out=$OUT/jax_ffi_probe.json
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import tempfile

from absl import app, flags

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

FLAGS = flags.FLAGS
flags.DEFINE_list("patterns", ["window:1024", "bigbird", "strided_causal", "causal"],
                  "bench patterns (sparsetp.bench.attention)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_integer("rounds", 5, "alternating timing rounds")
flags.DEFINE_string("out", None, "write the records here as JSON")

_HERE = os.path.dirname(os.path.abspath(__file__))
# Triton's TMA data type enum on the device side -> the host's (triton's nvidia driver.py).
_TMA_DTYPE_DEVICE_TO_HOST = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
_LIT32, _LIT64, _POINTER, _TMA = 0, 1, 2, 3
_LIB = None


def _library():
    """Build (once) and load ``jax_ffi/sm90_ffi.cc``; register its handler with XLA."""
    global _LIB
    if _LIB is None:
        import jax  # noqa: PLC0415
        import triton  # noqa: PLC0415

        out = os.path.join(tempfile.mkdtemp(prefix="sparsetp_ffi_"), "sm90_ffi.so")
        cuda_include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                    "include")
        subprocess.run(["g++", "-O2", "-std=c++17", "-fPIC", "-shared", "-w",
                        f"-I{jax.ffi.include_dir()}", f"-I{cuda_include}",
                        os.path.join(_HERE, "jax_ffi", "sm90_ffi.cc"), "-o", out, "-ldl"],
                       check=True)
        lib = ctypes.CDLL(out)
        lib.sparsetp_sm90_plan.restype = ctypes.c_int64
        jax.ffi.register_ffi_target("sparsetp_sm90", jax.ffi.pycapsule(lib.SparsetpSm90Launch),
                                    platform="CUDA")
        _LIB = lib
    return _LIB


def _plan(launch, compiled, in_names, out_names, array_pos, rows, head_dim) -> int:
    """The C++ plan of ``launch`` (operands: ``in_names``, then its layout arrays, then the
    outputs ``out_names``) with Triton 3.6's parameter packing."""
    kernel_names = list(compiled.src.signature)
    signature = compiled.src.signature
    operand = {n: i for i, n in enumerate(in_names)}
    n_in = len(in_names) + len(array_pos)
    operand.update({n: n_in + i for i, n in enumerate(out_names)})
    array_operand = {pos: len(in_names) + j for j, pos in enumerate(array_pos)}
    values = ([("box", n) for n, _ in launch.boxes] + [("arg", i) for i in range(len(launch.args))]
              + [("ptr", n) for n in launch.pointers])
    kinds, vals, tma = [], [], []
    metas = compiled.metadata.tensordesc_meta
    for name, (what, ref) in zip(kernel_names, values, strict=False):
        ty = signature[name]
        if ty == "constexpr":
            continue
        if what == "box":
            meta = metas[len(tma)]
            tma.append([operand[ref], rows[ref], head_dim, *meta["block_size"],
                        _TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["elem_size"],
                        meta["swizzle"]])
            kinds += [_TMA, _LIT32, _LIT32, _LIT64, _LIT64]
            vals += [len(tma) - 1, rows[ref], head_dim, head_dim, 1]
        elif what == "arg":
            a = launch.args[ref]
            if ty.startswith("*"):
                kinds.append(_POINTER)
                vals.append(array_operand[ref])
            elif ty == "fp32":
                kinds.append(_LIT32)
                vals.append(struct.unpack("<i", struct.pack("<f", float(a)))[0])
            elif ty == "i32":
                kinds.append(_LIT32)
                vals.append(int(a))
            elif ty == "i64":
                kinds.append(_LIT64)
                vals.append(int(a))
            else:
                raise ValueError(f"parameter {name} of type {ty}")
        else:
            kinds.append(_POINTER)
            vals.append(operand[ref])
    kinds += [_LIT64, _LIT64]  # global and profile scratch: none
    vals += [0, 0]
    md = compiled.metadata
    if md.global_scratch_size or md.profile_scratch_size:
        raise ValueError("the kernel needs scratch memory")
    cubin = compiled.asm["cubin"]
    geometry = (ctypes.c_int64 * 5)(*launch.grid, 32 * md.num_warps, md.shared)
    flat_tma = [x for t in tma for x in t]
    return _library().sparsetp_sm90_plan(
        cubin, len(cubin), md.name.encode(), geometry, len(kinds),
        (ctypes.c_int32 * len(kinds))(*kinds), (ctypes.c_int64 * len(vals))(*vals), len(tma),
        (ctypes.c_int64 * max(1, len(flat_tma)))(*flat_tma))


def ffi_call(launch, dtype: str, head_dim: int, operands: dict, outputs: dict) -> dict:
    """``backends/jax/hopper.call`` through the C++ handler."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415

    compiled = jhopper.compile_launch(launch, dtype, head_dim)
    in_names, array_pos = jhopper.operand_order(launch, outputs)
    rows = {n: operands[n].size // head_dim for n, _ in launch.boxes}
    plan = _plan(launch, compiled, in_names, list(outputs), array_pos, rows, head_dim)
    outs = jax.ffi.ffi_call("sparsetp_sm90", list(outputs.values()))(
        *[operands[n] for n in in_names], *[launch.args[i] for i in array_pos],
        plan=np.int64(plan))
    return dict(zip(outputs, outs, strict=True))


def _case(spec: str, n: int) -> dict:
    import statistics  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from attention_common import wall_loop_ms  # noqa: PLC0415

    from sparsetp import jax as sjax  # noqa: PLC0415
    from sparsetp.backends.jax import attention as jattn  # noqa: PLC0415
    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels import hopper  # noqa: PLC0415
    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    h, d = 16, 128
    layout = make_layout(bench_pattern(spec, n, 128, h).pattern, n, h, 128)
    ts = [torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (jax.dlpack.from_dlpack(t) for t in ts)
    lay = sjax.layout_arrays(layout, head_dim=d, dtype="bfloat16")

    def ffi_forward(q, k, v, lay):
        meta = jattn._with_order(lay.metadata(), (lay.q_head_group, lay.k_head_group))
        launch = hopper.launches(meta, 1, h, h, n, n, d ** -0.5, True, d)["fwd"]
        outs = ffi_call(launch, "bfloat16", d, dict(q=q, k=k, v=v), dict(
            out=jax.ShapeDtypeStruct(q.shape, q.dtype),
            lse=jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)))
        return outs["out"], outs["lse"]

    via_ffi = jax.jit(ffi_forward)
    via_callback = jax.jit(lambda q, k, v, lay: sjax.sparse_attention(q, k, v, lay,
                                                                      return_lse=True))
    a, b = via_ffi(q, k, v, lay), via_callback(q, k, v, lay)
    rec = {"pattern": spec, "N": n, "jax_forward_kernel": sjax.forward_kernel(q, k, v, lay).name,
           "bitwise_vs_callback": bool(all(np.array_equal(np.asarray(x.astype(jnp.float32)),
                                                          np.asarray(y.astype(jnp.float32)))
                                           for x, y in zip(a, b, strict=True)))}

    def jax_sync(r):
        jax.block_until_ready(r)

    def torch_sync(r):
        torch.cuda.synchronize()

    arms = {"torch": (lambda: sparse_attention(*ts, layout), torch_sync),
            "jax_callback": (lambda: via_callback(q, k, v, lay), jax_sync),
            "jax_ffi": (lambda: via_ffi(q, k, v, lay), jax_sync)}
    times = {name: [] for name in arms}
    for _ in range(FLAGS.rounds):
        for name, (fn, sync) in arms.items():
            times[name].append(wall_loop_ms(fn, sync, reps=1))
    rec["wall_ms"] = {name: statistics.median(t) for name, t in times.items()}
    rec["over_torch"] = {name: statistics.median(x / y for x, y in zip(t, times["torch"],
                                                                          strict=True))
                         for name, t in times.items()}
    return rec


def main(argv):
    del argv
    from gluon_tools import run_cases  # noqa: PLC0415

    run_cases(_case, FLAGS.seq_lens, FLAGS.patterns, FLAGS.out)


if __name__ == "__main__":
    app.run(main)
