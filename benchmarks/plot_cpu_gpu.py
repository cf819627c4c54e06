"""Speed-up of block-sparse attention over dense SDPA against N, CPU and GPU side by side.

Reads the JSON of the bench tool's seed grid (issue #30's grid: fixed / strided / window /
random at tile density 0.5 / 0.25 / 0.1), one run on the CPU and, when given, one on the GPU::

    python -m sparsetp.bench attention --preset=seed --device=cpu --out_dir=/tmp/seed_cpu
    python -m sparsetp.bench attention --preset=seed --out_dir=/tmp/seed_gpu     # on the GPU
    python benchmarks/plot_cpu_gpu.py --cpu_json=/tmp/seed_cpu/attention.json \\
        [--gpu_json=/tmp/seed_gpu/attention.json] --out=docs/attention_cpu_vs_gpu.png

One panel per device: forward and forward + backward speed-up (``speedup_vs_dense``; the
forward + backward from the paired rounds where the run has them) of torch
``sparsetp`` per pattern family, the target density by colour; without ``--gpu_json`` the GPU
panel says so. Each panel's title names its device, shape and dense baseline.
"""

from __future__ import annotations

import json

from absl import app, flags

from sparsetp.bench.attention import SEED_DENSITIES, SEED_FAMILIES, _seed_cells, _seed_speedup

CPU_JSON = flags.DEFINE_string("cpu_json", None, "bench JSON of the seed grid on CPU",
                               required=True)
GPU_JSON = flags.DEFINE_string("gpu_json", "", "bench JSON of the seed grid on GPU (optional)")
OUT = flags.DEFINE_string("out", "attention_cpu_vs_gpu.png", "PNG to write")
IMPL = flags.DEFINE_string("impl", "sparsetp", "implementation to plot (sparsetp, sparsetp_jax)")

_MARKS = {"fixed_density": "o", "strided_density": "s", "window_density": "^", "random": "D"}


def series(result: dict, impl: str) -> dict:
    """``{(family, target density, metric): [(N, speed-up), ...]}`` from a bench result."""
    out = {}
    for key, by in _seed_cells(result["records"]).items():
        rec = by.get(impl)
        if rec is None or "speedup_vs_dense" not in rec:
            continue
        fam, want, n = key[:3]
        for metric in ("fwd", "fwd_bwd"):
            x = _seed_speedup(rec) if metric == "fwd_bwd" else rec["speedup_vs_dense"].get(metric)
            if x:
                out.setdefault((fam, want, metric), []).append((n, x))
    return {k: sorted(v) for k, v in out.items()}


def _title(result: dict, label: str) -> str:
    recs = [r for r in result["records"] if r.get("section") == "seed" and "fwd_ms" in r]
    dense = sorted({r["impl"] for r in recs if r["impl"].startswith("sdpa")})
    r0 = recs[0] if recs else {}
    device = result.get("versions", {}).get("device", result.get("device_kind", "?"))
    return (f"{label}: {device}\nB={r0.get('B')} H={r0.get('H')} D={r0.get('D')} "
            f"{r0.get('dtype')} block {r0.get('block')}; dense: {', '.join(dense) or '?'}")


def plot(cpu: dict, gpu: dict | None, path: str, impl: str = "sparsetp") -> str:
    """Write the two-panel figure to ``path`` and return it."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    colours = dict(zip(SEED_DENSITIES, plt.rcParams["axes.prop_cycle"].by_key()["color"],
                       strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, result, label in ((axes[0], cpu, "CPU"), (axes[1], gpu, "GPU")):
        if result is None:
            ax.text(0.5, 0.5, "GPU: no results given (--gpu_json)", ha="center",
                    va="center", transform=ax.transAxes)
            ax.set_title(label)
            ax.set_xticks([])
            continue
        for (fam, want, metric), pts in sorted(series(result, impl).items(),
                                               key=lambda kv: (SEED_FAMILIES.index(kv[0][0])
                                                               if kv[0][0] in SEED_FAMILIES
                                                               else 99, -(kv[0][1] or 0),
                                                               kv[0][2])):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=_MARKS.get(fam, "x"),
                    ms=4, color=colours.get(want), ls="-" if metric == "fwd_bwd" else ":",
                    label=f"{fam.removesuffix('_density')} {want:g} {metric}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("sequence length N")
        ax.set_title(_title(result, label), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    axes[0].set_ylabel(f"{impl} speed-up over dense SDPA (x); solid fwd+bwd, dotted fwd")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv):
    del argv
    with open(CPU_JSON.value) as f:
        cpu = json.load(f)
    gpu = None
    if GPU_JSON.value:
        with open(GPU_JSON.value) as f:
            gpu = json.load(f)
    print(plot(cpu, gpu, OUT.value, IMPL.value))


if __name__ == "__main__":
    app.run(main)
