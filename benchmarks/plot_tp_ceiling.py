"""Plot ``benchmarks/tp_block_ab.py``'s fwd+bwd efficiencies ``t1 / (2 t2)``: per case (MLP,
block; plain TP and sequence parallel) one bar per TP=2 arm, the ``nocomm`` arm (no
collectives: the ceiling of any schedule) hatched, the issue's target as a tick; where the run
recorded clocks, each arm's mean SM clock (rank 0's GPU, at the board's power cap) under its
efficiency.

    python benchmarks/plot_tp_ceiling.py --json=benchmarks/results/tp_block_ab_h200x2.json \\
        --out=docs/tp_ceiling_h200x2.png
"""

from __future__ import annotations

import json

import matplotlib
from absl import app, flags

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_string("json", None, "tp_block_ab.py output", required=True)
flags.DEFINE_string("out", "tp_ceiling.png", "Output PNG.")
FLAGS = flags.FLAGS
# Issue #26's fwd+bwd targets (torch).
TARGETS = {("mlp", False): 0.975, ("mlp", True): 0.96, ("block", False): 0.96,
           ("block", True): 0.96}


def main(argv):
    del argv
    with open(FLAGS.json) as f:
        res = json.load(f)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = 0.0
    ticks, labels = [], []
    for row in res["rows"]:
        key = (row["model"], row["sequence_parallel"])
        eff = row["fwd_bwd_efficiency"]
        clocks = row.get("clocks") or {}
        start = x
        for arm, e in eff.items():
            ax.bar(x, e, 0.8, color="0.75" if arm == "nocomm" else "C0",
                   hatch="//" if arm == "nocomm" else None, edgecolor="k", linewidth=0.5)
            mhz = f"\n{clocks[arm]['sm_mhz']:.0f} MHz" if arm in clocks else ""
            ax.text(x, e - 0.003, f"{arm}\n{e:.3f}{mhz}", ha="center", va="top", fontsize=7,
                    bbox=dict(facecolor="white", edgecolor="none", pad=1), zorder=3)
            x += 1
        ax.hlines(TARGETS[key], start - 0.45, x - 0.55, colors="C3", linestyles="--", zorder=4)
        ticks.append((start + x - 1) / 2)
        labels.append(f"{key[0]}{' + SP' if key[1] else ''}")
        x += 0.8
    ax.set_xticks(ticks, labels)
    ax.set_ylim(0.85, 1.01)
    ax.set_ylabel("fwd+bwd efficiency t1 / (2 t2)")
    ax.set_title(f"TP=2 against TP=1, {res.get('device', '')} x2, torch {res.get('torch', '')} "
                 "(red: issue #26 target; hatched: no communication)", fontsize=9)
    fig.tight_layout()
    fig.savefig(FLAGS.out, dpi=130)
    print("wrote", FLAGS.out)


if __name__ == "__main__":
    app.run(main)
