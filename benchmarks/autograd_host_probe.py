"""Question: where does the host time of an eager forward + backward go inside autograd, next
to SDPA's? (Issue #30: forward + backward host time at most SDPA's.)

Causal N=1024, H=1, D=128, bf16, ``--calls`` back-to-back calls then one synchronize, µs per
call, ``--rounds`` rounds: the direct backward on the main thread and on another Python thread;
the forward while autograd records; forward + backward through autograd (ours, SDPA, a
do-nothing Python ``autograd.Function`` with and without allocations); the same with
``torch.autograd.set_multithreading_enabled(False)`` (backward on the calling thread); the time
inside ``_Plan.backward`` under autograd; then the time of each launch and of the output
allocations, inside autograd and called directly. CUDA only (host times mean nothing in the
interpreter)::

    PYTHONPATH=$PWD python benchmarks/autograd_host_probe.py --out=$OUT/autograd_host_probe.json
"""

import json
import threading
import time

import attention_common as C
import torch
from absl import app, flags

from sparsetp.backends.torch import attention as tattn
from sparsetp.backends.torch import launch as tl
from sparsetp.core import make_layout

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "autograd_host_probe.json", "where to write the JSON")
flags.DEFINE_integer("calls", 300, "back-to-back calls per measurement")
flags.DEFINE_integer("rounds", 3, "rounds")


def _nop_function(grad):
    """Autograd's Python floor: a Function that allocates its output, launches nothing, and
    returns ``grad(g)`` for each of its three inputs."""

    class Nop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, g):
            return grad(g), grad(g), grad(g)

    return Nop


_Nop = _nop_function(torch.empty_like)  # allocates three gradients
_Nop0 = _nop_function(lambda g: g)  # hands its incoming gradient on


def host_us(fn) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(FLAGS.calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / FLAGS.calls * 1e6


def in_thread(fn) -> float:
    res = []
    th = threading.Thread(target=lambda: res.append(host_us(fn)))
    th.start()
    th.join()
    return res[0]


def _mean_us(xs, skip=40) -> float:
    xs = xs[skip:]
    return sum(xs) / max(1, len(xs)) * 1e6


def main(argv):
    del argv
    n, h, d = 1024, 1, 128
    layout = make_layout(C.anchor_pattern("causal"), n, h, 128)
    q, k, v, qg, kg, vg, d_out = C.inputs(n, h, d, "bfloat16", "cuda", seed=4)
    scale = d ** -0.5
    out_, lse_ = tattn._forward(q, k, v, layout, scale)

    def direct_backward():
        tattn._backward(q, k, v, out_, lse_, d_out, None, layout, scale)

    arms = {
        "ours_fwd_bwd": lambda: tattn.sparse_attention(qg, kg, vg, layout).backward(d_out),
        "sdpa_fwd_bwd": lambda: torch.nn.functional.scaled_dot_product_attention(
            qg, kg, vg, is_causal=True).backward(d_out),
        "nop_function_fwd_bwd": lambda: _Nop.apply(qg, kg, vg).backward(d_out),
        "nop0_function_fwd_bwd": lambda: _Nop0.apply(qg, kg, vg).backward(d_out),
    }
    inside: list = []
    real_backward = tattn._Plan.backward

    def timed_backward(*a, **kw):
        t = time.perf_counter()
        r = real_backward(*a, **kw)
        inside.append(time.perf_counter() - t)
        return r

    rounds = []
    for rnd in range(FLAGS.rounds):
        r = {"direct_bwd_main_thread": host_us(direct_backward),
             "direct_bwd_other_thread": in_thread(direct_backward),
             "fwd_recording": host_us(lambda: tattn.sparse_attention(qg, kg, vg, layout))}
        r.update({name: host_us(fn) for name, fn in arms.items()})
        inside.clear()
        tattn._Plan.backward = timed_backward
        try:
            host_us(arms["ours_fwd_bwd"])
        finally:
            tattn._Plan.backward = real_backward
        r["inside_plan_backward"] = _mean_us(inside, 20)
        torch.autograd.set_multithreading_enabled(False)
        try:
            r.update({f"{name}_no_autograd_thread": host_us(arms[name])
                      for name in ("ours_fwd_bwd", "sdpa_fwd_bwd", "nop_function_fwd_bwd")})
        finally:
            torch.autograd.set_multithreading_enabled(True)
        print(rnd, {key: round(val, 1) for key, val in r.items()}, flush=True)
        rounds.append(r)

    phases: dict = {}
    real_run, real_new = tl.run, tl.new_output

    def timed_run(desc, *a):
        t = time.perf_counter()
        real_run(desc, *a)
        phases.setdefault(desc.call.name, []).append(time.perf_counter() - t)

    def timed_new(*a):
        t = time.perf_counter()
        o = real_new(*a)
        phases.setdefault("new_output", []).append(time.perf_counter() - t)
        return o

    tl.run, tl.new_output = timed_run, timed_new
    try:
        host_us(arms["ours_fwd_bwd"])
        in_autograd = {key: _mean_us(val) for key, val in phases.items()}
        phases.clear()
        host_us(direct_backward)
        direct = {key: _mean_us(val) for key, val in phases.items()}
    finally:
        tl.run, tl.new_output = real_run, real_new
    print("per launch / allocation, us, inside autograd:", in_autograd)
    print("per launch / allocation, us, backward called directly:", direct)
    with open(FLAGS.out, "w") as f:
        json.dump({"rounds": rounds, "phases_in_autograd_us": in_autograd,
                   "phases_direct_backward_us": direct,
                   "versions": {"torch": torch.__version__,
                                "device": torch.cuda.get_device_name()}}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
