"""Question: in the seed grid's host-bound cells (N=1024, B=1, H=16, D=128, bf16, block 64),
which eager torch path runs and how does each compare with dense SDPA on the same machine?
(Issue #30, S1.) Per pattern: the C++ autograd node (``native_autograd`` on) and the Python
``autograd.Function`` path, three ``do_bench`` medians each and a 100-call wall-clock loop, and
dense ``scaled_dot_product_attention`` fwd+bwd timed right after; then, per pattern, the GPU time
of each kernel of one fwd+bwd (``torch.profiler``, 20 calls, synchronised) for the C++ path and
dense, to tell a host-bound cell from a GPU-bound one. CUDA only. Believe it only if
``python -m pytest -q tests/torch_native_test.py`` passes::

    PYTHONPATH=$PWD python benchmarks/native_seed_probe.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from sparsetp.backends.torch import attention as tattn
from sparsetp.backends.torch import native
from sparsetp.bench.attention import bench_pattern
from sparsetp.core import make_layout
from sparsetp.kernels import options, schedule

PATTERNS = ("random:0.5", "random:0.25", "fixed_density:0.5", "window_density:0.1",
            "window_density:0.5")


def main():
    print("native extension:", native.wait())
    n, h, d = 1024, 16, 128

    def leaves():
        return [torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)]

    dense_in, g = leaves(), torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)

    def dense():
        torch.nn.functional.scaled_dot_product_attention(*dense_in).backward(g)

    for spec in PATTERNS:
        lay = make_layout(bench_pattern(spec, n, 64, h).pattern, n, h, 64)
        for on in (True, False):
            with options.launch_options(native_autograd=on):
                ins = leaves()

                def fwd_bwd(ins=ins, lay=lay):
                    tattn.sparse_attention(*ins, lay).backward(g)

                fwd_bwd()
                fwd_bwd()  # the first backward builds the native plan
                torch.cuda.synchronize()
                node = type(tattn.sparse_attention(*ins, lay).grad_fn).__name__
                ms = [do_bench(fwd_bwd, grad_to_none=ins, return_mode="median") for _ in range(3)]
                t0 = time.perf_counter()
                for _ in range(100):
                    fwd_bwd()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 10
                dense_ms = do_bench(dense, grad_to_none=dense_in, return_mode="median")
                print(f"{spec:20s} native={on!s:5s} {node:28s} do_bench "
                      f"{' '.join(f'{m:.3f}' for m in ms)} ms, wall {wall:.3f} ms; "
                      f"dense {dense_ms:.3f} ms")

    print("GPU time per fwd+bwd by kernel (us; profiler, 20 synchronised calls):")
    for spec in PATTERNS:
        lay = make_layout(bench_pattern(spec, n, 64, h).pattern, n, h, 64)
        kl = schedule.kernel_layout(lay, "cuda", head_dim=d, dtype="bfloat16")
        ins = leaves()
        for name, fn in (("sparse", lambda ins=ins, lay=lay: tattn.sparse_attention(
                *ins, lay).backward(g)), ("dense", dense)):
            print(f"{spec:20s} {name:6s} " + _kernel_times(fn) + (
                f" (kernel block {kl.block_size}, {kl.nnz_blocks} tiles)"
                if name == "sparse" else ""))


def _kernel_times(fn, calls=20):
    """``total: name us, ...``: mean GPU time per call of each kernel ``fn`` runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time / calls
    return f"total {sum(times.values()):.1f}: " + ", ".join(
        f"{k} {t:.1f}" for k, t in sorted(times.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    main()
