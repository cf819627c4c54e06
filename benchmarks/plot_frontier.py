"""TFLOP/s of ours, FlashAttention-4, cuDNN causal and Flex per pattern: the ``frontier`` preset.

Reads the bench tool's JSON of ``--preset=frontier`` (issue #34) and draws, per sequence length,
forward and backward TFLOP/s (on our layout's computed blocks; cuDNN causal on the causal
pairs) of each implementation per pattern, with the run's bf16 GEMM as a line::

    python -m sparsetp.bench attention --preset=frontier --out_dir=/tmp/frontier   # on the GPU
    python benchmarks/plot_frontier.py --json=/tmp/frontier/attention.json \\
        --out=docs/frontier_h200.png

``--table`` prints the rows of ``docs/performance.md``'s frontier table instead.
"""

from __future__ import annotations

import json

from absl import app, flags

from sparsetp.bench import frontier

JSON = flags.DEFINE_string("json", "benchmarks/results/frontier_h200.json",
                           "bench JSON of the frontier preset")
OUT = flags.DEFINE_string("out", "docs/frontier_h200.png", "PNG to write")
TABLE = flags.DEFINE_bool("table", False, "print the markdown table rows, draw nothing")

IMPLS = (("sparsetp", "ours (torch)"), ("fa4", "FlashAttention-4"),
         ("cudnn_causal", "cuDNN causal"), ("flex", "FlexAttention"))


LABELS = {"causal": "causal", "window:1024": "window 1024", "bigbird": "BigBird",
          "strided_causal": "strided causal", "per_head_mix": "per-head mix"}


def _f(x, fmt):
    return "—" if x is None else format(x, fmt)


def table(res: dict) -> str:
    """Markdown rows (pattern, N, ours / FA4 / cuDNN / Flex ms fwd / bwd, ours TFLOP/s and
    fraction of the run's GEMM, peer / ours, JAX / torch as F3 reads it)."""
    by = frontier._by(res)
    gemm = (res.get("gemm_anchor") or {}).get("tflops")
    rows = []
    for n in sorted({k[2] for k in by}):
        for p in frontier.PATTERNS:
            o = by.get(("sparsetp", p, n))
            if not o:
                continue

            def ms(impl, o=o, p=p, n=n):
                r = by.get((impl, p, n))
                return "—" if not r else f"{r['fwd_ms']:.3f} / {r['bwd_ms']:.3f}"

            def ratio(impl, o=o, p=p, n=n):
                r = by.get((impl, p, n))
                return "—" if not r else (f"{r['fwd_ms'] / o['fwd_ms']:.2f} / "
                                          f"{r['bwd_ms'] / o['bwd_ms']:.2f}")
            tf = f"{o['fwd_tflops']:.0f} / {o['bwd_tflops']:.0f}"
            if gemm:
                tf += f" ({o['fwd_tflops'] / gemm:.2f} / {o['bwd_tflops'] / gemm:.2f})"
            jx = by.get(("sparsetp_jax", p, n)) or {}
            jax = (f"{_f(jx.get('jax_over_torch_fwd'), '.2f')} / "
                   f"{_f(jx.get('jax_over_torch_fwd_bwd'), '.2f')}")
            rows.append(f"| {LABELS.get(p, p)} | {n} | {ms('sparsetp')} | "
                        f"{tf} | {ms('fa4')} | {ms('cudnn_causal')} | {ms('flex')} | "
                        f"{ratio('fa4')} | {ratio('flex')} | {jax} |")
    return "\n".join(rows)


def main(argv):
    del argv
    if TABLE.value:
        with open(JSON.value) as f:
            print(table(json.load(f)))
        return
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    with open(JSON.value) as f:
        res = json.load(f)
    by = frontier._by(res)
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
