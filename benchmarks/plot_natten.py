"""Speed-up over cuDNN dense of each neighbourhood case: the ``natten`` preset (issue #32).

Reads the bench tool's JSON of ``--preset=natten`` and draws, for the forward and the backward,
each case's speed-up over dense attention at the same N (the preset's N1 / N2 figures: torch
against cuDNN through SDPA, JAX against its own dense anchor) for ours in torch and JAX and
for FlexAttention, with the issue's target of each case as a tick::

    python -m sparsetp.bench attention --preset=natten --out_dir=/tmp/natten   # on the GPU
    python benchmarks/plot_natten.py --json=/tmp/natten/attention.json --out=docs/natten_h200.png
"""

from __future__ import annotations

import json
import re

from absl import app, flags

from sparsetp.bench.attention import _save_figure

JSON = flags.DEFINE_string("json", "benchmarks/results/natten_h200.json",
                           "bench JSON of the natten preset")
OUT = flags.DEFINE_string("out", "docs/natten_h200.png", "PNG to write")

IMPLS = (("sparsetp", "ours (torch)"), ("sparsetp_jax", "ours (JAX)"),
         ("flex", "FlexAttention"))
# "N1: fwd speed-up vs dense, <impl>, <spec>, block <b>"
_NAME = re.compile(r"(fwd|bwd) speed-up vs dense, (\w+), (\S+), block (\d+)")


def _label(spec: str, block: int) -> str:
    """``neighborhood:16x32x32:7x15x15:tile2x8x8`` at block 64 -> a two-line axis label."""
    parts = spec.split(":")[1:]
    dims = len(parts[0].split("x"))
    tile = next((p[4:] for p in parts if p.startswith("tile")), None)
    order = f"tiled {tile}, block {block}" if tile else f"row-major, block {block}"
    return f"{dims}-D {parts[0]}\nkernel {parts[1]}\n{order}"


def speedups(res: dict) -> tuple[dict, dict, list]:
    """``({(impl, case, mode): x}, {(case, mode): target}, cases)`` from the N1 / N2 targets of
    a natten result; a case is ``(spec, block)``, in the order the preset ran them."""
    values, targets, cases = {}, {}, []
    for t in res.get("targets", ()):
        m = _NAME.search(t["name"])
        if t["id"] not in ("N1", "N2") or m is None or t.get("value") is None:
            continue
        mode, impl, spec, block = m.group(1), m.group(2), m.group(3), int(m.group(4))
        case = (spec, block)
        if case not in cases:
            cases.append(case)
        values[(impl, case, mode)] = float(t["value"])
        targets[(case, mode)] = float(t["threshold"])
    return values, targets, cases


def main(argv):
    del argv
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    with open(JSON.value) as f:
        res = json.load(f)
    values, targets, cases = speedups(res)
    if not cases:
        raise SystemExit(f"{JSON.value}: no N1 / N2 targets (not a natten preset result?)")
    fig, axes = plt.subplots(2, 1, figsize=(13, 8.5))
    width = 0.8 / len(IMPLS)
    for ax, mode in zip(axes, ("fwd", "bwd"), strict=True):
        for i, (impl, label) in enumerate(IMPLS):
            xs, ys = [], []
            for j, case in enumerate(cases):
                if (impl, case, mode) in values:
                    xs.append(j + (i - (len(IMPLS) - 1) / 2) * width)
                    ys.append(values[(impl, case, mode)])
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        for j, case in enumerate(cases):
            if (case, mode) in targets:
                ax.hlines(targets[(case, mode)], j - 0.45, j + 0.45, colors="k", lw=1.5,
                          label="target" if j == 0 else None)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([_label(*c) for c in cases], fontsize=8)
        ax.set_ylabel("speed-up over dense (x)")
        ax.set_title("forward" if mode == "fwd" else "backward")
    v = res.get("versions", {})
    title = (f"neighbourhood attention, {v.get('device', '?')}, bf16, B=1, H=16, D=128; torch "
             f"{v.get('torch', '?')}, triton {v.get('triton', '?')}, jax {v.get('jax', '?')}")
    print(f"wrote {_save_figure(plt, fig, axes, title, OUT.value)}")


if __name__ == "__main__":
    app.run(main)
