"""TFLOP/s of ours, FlashAttention-4, cuDNN causal and Flex per pattern: the ``frontier`` preset.

Reads the bench tool's JSON of ``--preset=frontier`` (issue #34) and draws, per sequence length,
forward and backward TFLOP/s (on our layout's computed blocks; cuDNN causal on the causal
pairs) of each implementation per pattern, with the run's bf16 GEMM as a line::

    python -m sparsetp.bench attention --preset=frontier --out_dir=/tmp/frontier   # on the GPU
    python benchmarks/plot_frontier.py --json=/tmp/frontier/attention.json \\
        --out=docs/frontier_h200.png
"""

from __future__ import annotations

import json

from absl import app, flags

from sparsetp.bench import frontier

JSON = flags.DEFINE_string("json", "benchmarks/results/frontier_h200.json",
                           "bench JSON of the frontier preset")
OUT = flags.DEFINE_string("out", "docs/frontier_h200.png", "PNG to write")

IMPLS = (("sparsetp", "ours (torch)"), ("fa4", "FlashAttention-4"),
         ("cudnn_causal", "cuDNN causal"), ("flex", "FlexAttention"))


def main(argv):
    del argv
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    with open(JSON.value) as f:
        res = json.load(f)
    by = {(r["impl"], r["pattern"], r["N"]): r for r in res["records"]
          if "fwd_ms" in r and r.get("section", "").startswith("frontier")}
    ns = sorted({k[2] for k in by})
    gemm = (res.get("gemm_anchor") or {}).get("tflops")
    fig, axes = plt.subplots(len(ns), 2, figsize=(13, 3.6 * len(ns)), squeeze=False)
    width = 0.8 / len(IMPLS)
    for row, n in enumerate(ns):
        for col, mode in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            for i, (impl, label) in enumerate(IMPLS):
                xs, ys = [], []
                for j, p in enumerate(frontier.PATTERNS):
                    r = by.get((impl, p, n))
                    if r and r.get(f"{mode}_tflops"):
                        xs.append(j + (i - (len(IMPLS) - 1) / 2) * width)
                        ys.append(r[f"{mode}_tflops"])
                ax.bar(xs, ys, width, label=label)
            if gemm:
                ax.axhline(gemm, color="k", ls="--", lw=1, label=f"bf16 GEMM ({gemm:.0f})")
            ax.set_xticks(range(len(frontier.PATTERNS)))
            ax.set_xticklabels([p.replace("_", " ") for p in frontier.PATTERNS])
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{'forward' if mode == 'fwd' else 'backward'}, N={n}")
            if row == 0 and col == 0:
                ax.legend(fontsize=8, loc="upper right")
    v = res.get("versions", {})
    fig.suptitle(f"{v.get('device', '?')}, bf16, B=1, H=16, D=128, block 128; torch "
                 f"{v.get('torch', '?')}, triton {v.get('triton', '?')}; FA4 skips the per-head "
                 f"mix (no mask_mod for its tiles)", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT.value, dpi=100)
    print(f"wrote {OUT.value}")


if __name__ == "__main__":
    app.run(main)
