"""Question: does our weight layout cost cuBLAS time (issue #9)?

Our TP layers store weights [in, out] (y = x @ W, the canonical layout) while nn.Linear / DTensor
store [out, in] (y = x @ W^T): same math, different cuBLAS operand layouts. This times the three
GEMMs of a linear layer (forward, input gradient, weight gradient) both ways at the MLP shapes
of the TP bench at TP=2 (T=8192, d=8192, ff/2=16384, bf16). It times torch's GEMMs only, so no
library test gates it.

Usage (one GPU): python benchmarks/gemm_layout_probe.py --out=$OUT/gemm_layout.json
"""

from __future__ import annotations

import json

import torch
from absl import app, flags
from triton.testing import do_bench

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "gemm_layout.json", "where to write the JSON")
flags.DEFINE_integer("tokens", 8192, "T")
flags.DEFINE_list("shapes", ["8192x16384", "16384x8192"], "in x out of the local layers")


def _ops(x, dy, w_in_out, w_out_in) -> dict:
    return {
        # ours: weight [in, out]
        "ours fwd x@W": lambda: x @ w_in_out,
        "ours dgrad dy@W^T": lambda: dy @ w_in_out.t(),
        "ours wgrad x^T@dy": lambda: x.t() @ dy,
        # nn.Linear: weight [out, in]
        "linear fwd x@W^T": lambda: torch.nn.functional.linear(x, w_out_in),
        "linear dgrad dy@W": lambda: dy @ w_out_in,
        "linear wgrad dy^T@x": lambda: dy.t() @ x,
    }


def main(argv):
    del argv
    t = FLAGS.tokens
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "tokens": t,
           "cases": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in FLAGS.shapes:
        k, n = (int(s) for s in shape.split("x"))
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g)
        w_in_out = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g)
        w_out_in = w_in_out.t().contiguous()
        for name, fn in _ops(x, dy, w_in_out, w_out_in).items():
            ms = float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
            tflops = 2 * t * k * n / ms / 1e9
            res["cases"].append({"shape": shape, "op": name, "ms": ms, "tflops": tflops})
            print(f"{shape:12s} {name:22s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s", flush=True)
    with open(FLAGS.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    app.run(main)
