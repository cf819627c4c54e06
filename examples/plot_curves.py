"""Plot the loss and accuracy curves the training examples wrote, one line per JSON record.

    python examples/plot_curves.py --inputs='examples/results/*.json' \
        --out=examples/results/curves.png

Left: training loss (masked next-token cross-entropy at the questions) per step; right: the
accuracy at the questions (a fresh batch every step, so it is held-out accuracy), with the
chance level dashed. Lines are labelled ``framework pattern``.
"""

from __future__ import annotations

import glob
import json

import matplotlib
import numpy as np
from absl import app, flags

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

flags.DEFINE_string("inputs", "examples/results/*.json", "Glob of the examples' JSON records.")
flags.DEFINE_string("out", "examples/results/curves.png", "Output PNG.")
FLAGS = flags.FLAGS


def _smooth(y, k: int):
    """Trailing mean over k steps (the per-step accuracy of a 4-sequence batch is noisy)."""
    y = np.asarray(y, float)
    if k <= 1 or len(y) < k:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    head = c[1:k] / np.arange(1, k)
    return np.concatenate([head, (c[k:] - c[:-k]) / k])


def main(argv):
    del argv
    paths = sorted(glob.glob(FLAGS.inputs))
    if not paths:
        raise app.UsageError(f"no JSON records match {FLAGS.inputs!r}")
    records = [json.load(open(p)) for p in paths]
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    # Colour = pattern, line = framework: torch wide and pale, JAX dashed on top, so curves
    # that coincide (same parameters, same data) stay visible as one line over the other.
    styles = {"torch": dict(ls="-", lw=3, alpha=0.45), "jax": dict(ls="--", lw=1.2)}
    colours = {}
    records.sort(key=lambda r: r["framework"] != "torch")
    for r in records:
        label = f"{r['framework']} {r['pattern']}"
        kw = dict(styles.get(r["framework"], {}),
                  color=colours.setdefault(r["pattern"], f"C{len(colours)}"))
        ax_l.plot(r["loss"], label=label, **kw)
        ax_a.plot(_smooth(r["accuracy"], 10), label=label, **kw)
    r0 = records[0]
    ax_a.axhline(r0["chance"], color="gray", ls=":", lw=1, label="chance")
    ax_l.set(xlabel="step", ylabel="loss at the questions", yscale="log")
    ax_a.set(xlabel="step", ylabel="accuracy (10-step mean)", ylim=(0, 1.02))
    fig.suptitle(f"Recall over N={r0['seq_len']} tokens, size={r0['size']}: local window vs "
                 "global/strided blocks")
    for ax in (ax_l, ax_a):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FLAGS.out, dpi=110)
    print(f"wrote {FLAGS.out} from {len(records)} records")


if __name__ == "__main__":
    app.run(main)
