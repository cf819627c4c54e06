"""Question: how much energy does one attention call take, ours against FlexAttention's (GPU)?

At the board's power cap time follows energy per call, not cycles, so a kernel that does more
work per cycle may gain nothing end to end. For each (pattern, N, impl, pass) this runs the call
back to back for ``--seconds`` and reads the board's energy counter (NVML
``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded, read through ctypes: no
pynvml needed) before and after, with the SM clock and power sampled every 100 ms in between.
Output per row: ms per call, mJ per call, mean W and mean SM MHz; per case the ratios Flex / ours.
It times without an L2 flush and includes host time, so its ms differ from ``do_bench``'s.

Inputs as the targets' (bf16, B=1, H=16, D=128, block 128). ``fwd`` is the forward without
autograd, ``fwd_bwd`` one forward plus backward through autograd. ``--arms`` runs ours under
several launch arms (``attention_common``'s arm spec), e.g. an energy A/B of kernel tiles.
Believe it only if ``python -m pytest -q tests/torch_attention_test.py`` passes::

    python benchmarks/energy_probe.py --out=$OUT/energy.json --n=8192,32768
    python benchmarks/energy_probe.py \\
        --arms='t128:kernel_tile=layout;t64:block=64,kernel_tile=layout'
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "energy.json", "where to write the JSON")
flags.DEFINE_list("n", ["8192", "32768"], "sequence lengths")
flags.DEFINE_list("patterns", ["causal", "window"], "benchmark pattern specs")
flags.DEFINE_list("passes", ["fwd", "fwd_bwd"], "fwd and/or fwd_bwd")
flags.DEFINE_float("seconds", 4.0, "how long each (case, impl, pass) runs back to back")
flags.DEFINE_integer("rounds", 2, "rounds; the impls alternate order every round")
flags.DEFINE_multi_string("arms", ["default"], "launch arms of ours (attention_common's arm "
                          "spec), ';'-separated or the flag repeated")


class _Nvml:
    """The few NVML calls needed, through ctypes (no pynvml on the GPU machine). The device is
    found by the UUID torch reports, since NVML's indices ignore CUDA_VISIBLE_DEVICES."""

    def __init__(self):
        import ctypes

        import torch

        self._c = ctypes
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._ok(self.lib.nvmlInit_v2())
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self.handle)) != 0:
            print(f"NVML: no device {uuid}; taking NVML index 0", flush=True)
            self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)))

    def _ok(self, rc):
        if rc != 0:
            raise RuntimeError(f"NVML call failed with code {rc}")

    def energy_mj(self) -> int:
        v = self._c.c_ulonglong()
        self._ok(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, self._c.byref(v)))
        return v.value

    def power_w_and_sm_mhz(self) -> tuple[float, float]:
        mw, mhz = self._c.c_uint(), self._c.c_uint()
        self._ok(self.lib.nvmlDeviceGetPowerUsage(self.handle, self._c.byref(mw)))
        self._ok(self.lib.nvmlDeviceGetClockInfo(self.handle, 1, self._c.byref(mhz)))  # SM
        return mw.value / 1e3, float(mhz.value)


@functools.cache
def _nvml() -> _Nvml:
    return _Nvml()


def _measure(fn, seconds: float) -> dict:
    import threading

    import torch

    nvml = _nvml()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.1):
            samples.append(nvml.power_w_and_sm_mhz())

    sampler = threading.Thread(target=sample, daemon=True)
    e0 = nvml.energy_mj()
    t0 = time.perf_counter()
    sampler.start()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    e1 = nvml.energy_mj()
    stop.set()
    sampler.join()
    watts = [w for w, _ in samples]
    mhz = [m for _, m in samples]
    return {"calls": calls, "ms_per_call": elapsed / calls * 1e3,
            "mJ_per_call": (e1 - e0) / calls, "mean_W_counter": (e1 - e0) / 1e3 / elapsed,
            "mean_W_sampled": sum(watts) / max(1, len(watts)),
            "mean_sm_MHz": sum(mhz) / max(1, len(mhz)), "min_sm_MHz": min(mhz, default=None),
            "samples": len(samples)}


def _case(n: int, spec: str, tensors, flex, arms) -> list[dict]:
    """The interleaved measurements of one (N, pattern): every impl, pass and round."""
    import torch

    from sparsetp.bench import attention as B
    from sparsetp.core import make_layout
    from sparsetp.torch import sparse_attention

    q, k, v, qg, kg, vg, d_out = tensors
    bp = B.bench_pattern(spec, n, 128, 16)
    lay = make_layout(bp.pattern, n, 16, 128)
    bm = B.flex_block_mask(lay, bp, "cuda")
    impls = {}  # name -> (attention function, the context it runs under, backward included)
    for arm in arms:
        al = lay if arm.block == 128 else make_layout(bp.pattern, n, 16, arm.block)
        impls[_impl_name(arm, arms)] = (lambda a, b, c, al=al: sparse_attention(a, b, c, al),
                                        arm.context)
    impls["flex"] = (lambda a, b, c: flex(a, b, c, block_mask=bm), contextlib.nullcontext)

    def run(impl, which):
        fn, context = impl
        with context():
            if which == "fwd":
                with torch.no_grad():
                    fn(q, k, v)
            else:
                fn(qg, kg, vg).backward(d_out)
                qg.grad = kg.grad = vg.grad = None

    rows = []
    for r in range(FLAGS.rounds):
        order = list(impls) if r % 2 == 0 else list(impls)[::-1]
        for which in FLAGS.passes:
            for name in order:
                got = _measure(lambda f=impls[name], w=which: run(f, w), FLAGS.seconds)
                row = {"pattern": spec, "N": n, "impl": name, "pass": which, "round": r, **got}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _impl_name(arm, arms) -> str:
    return "sparsetp" if len(arms) == 1 else f"sparsetp[{arm.name}]"


def main(argv):
    del argv
    import attention_common as C
    import torch

    from sparsetp.bench import attention as B

    arms = C.parse_arms(FLAGS.arms)
    ours = [_impl_name(a, arms) for a in arms]
    flex = B._flex_fn()
    rows = []
    for n in map(int, FLAGS.n):
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, d_out = (torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16,
                                      generator=g) for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        for spec in FLAGS.patterns:
            rows += _case(n, spec, (q, k, v, qg, kg, vg, d_out), flex, arms)
    summary = {}
    for n in map(int, FLAGS.n):
        for spec in FLAGS.patterns:
            for which in FLAGS.passes:
                def med(impl, key, n=n, spec=spec, which=which):
                    xs = sorted(x[key] for x in rows if (x["N"], x["pattern"], x["pass"],
                                                         x["impl"]) == (n, spec, which, impl))
                    return xs[len(xs) // 2] if xs else None
                case = f"{spec} N={n} {which}"
                summary[case] = {key: {impl: med(impl, field) for impl in (*ours, "flex")}
                                 for key, field in (("ms", "ms_per_call"), ("mJ", "mJ_per_call"),
                                                    ("sm_MHz", "mean_sm_MHz"),
                                                    ("W", "mean_W_counter"))}
                for impl in ours:
                    summary[case][f"time_flex_over_{impl}"] = (summary[case]["ms"]["flex"]
                                                               / summary[case]["ms"][impl])
                    summary[case][f"energy_flex_over_{impl}"] = (summary[case]["mJ"]["flex"]
                                                                 / summary[case]["mJ"][impl])
                print(f"{case}: {json.dumps(summary[case])}", flush=True)
    import triton

    with open(FLAGS.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                   "versions": {"torch": torch.__version__, "triton": triton.__version__},
                   "summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
