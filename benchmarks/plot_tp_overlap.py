"""Plot the interleaved overlap A/B of ``python -m sparsetp.bench tp --tp_stages=torch_overlap_ab``:
per model (MLP, block; plain TP and sequence parallel) the fwd and fwd+bwd step time of the
default schedule (``comm_chunks`` auto: collective matmuls where a GEMM is large enough), the
plain one (``comm_chunks=1``) and no overlap at all, one panel per input JSON.

    python benchmarks/plot_tp_overlap.py --out=docs/tp_overlap_h200x2.png \\
        benchmarks/results/bench_tp_overlap_ab_h200x2_s16.json \\
        benchmarks/results/bench_tp_overlap_ab_d4096_h200x2_s16.json

Believe the numbers only when ``tests/torch_overlap_test.py`` passes (the schedules against the
plain path and the float64 oracle).
"""

from __future__ import annotations

import json
import sys

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_string("out", "tp_overlap.png", "Output PNG.")
FLAGS = flags.FLAGS
ARMS = ("auto", "plain", "no_overlap")


def main(argv):
    paths = argv[1:]
    if not paths:
        raise app.UsageError("give one or more tp.json files with a torch_overlap_ab stage")
    fig, axes = plt.subplots(1, len(paths), figsize=(6.5 * len(paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], paths, strict=True):
        with open(path) as f:
            res = json.load(f)
        spec = res["spec"]
        cases = res["stages"]["torch_overlap_ab"]["ranks"][0]["data"]
        labels, width = [], 0.27
        for i, case in enumerate(cases):
            for j, mode in enumerate(("fwd", "fwd_bwd")):
                x = 2 * i + j
                labels.append((x, f"{case['model']}{' SP' if case['sequence_parallel'] else ''}"
                                  f"\n{mode}"))
                auto = case[mode][f"auto_{mode}_ms"]
                for k, arm in enumerate(ARMS):
                    ms = case[mode].get(f"{arm}_{mode}_ms")
                    if ms is None:
                        continue
                    ax.bar(x + (k - 1) * width, ms / auto, width, color=f"C{k}",
                           label=arm if x == 0 else None)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks([x for x, _ in labels], [t for _, t in labels], fontsize=7)
        ax.set_ylabel("step time / default (auto) schedule")
        ax.set_ylim(0.9, 1.15)
        ax.set_title(f"TP={spec['world']}, T={spec['batch'] * spec['seq_len']}, "
                     f"d={spec['d_model']}, ff={spec['d_ff']}, {spec['dtype']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"torch TP overlap, interleaved A/B on {res['versions'].get('device_count')}x "
                 f"{res['versions'].get('device')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(FLAGS.out, dpi=120)
    print(f"wrote {FLAGS.out}")
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
