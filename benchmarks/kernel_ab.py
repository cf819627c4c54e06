"""Question: is another version of the attention kernels faster than the tree's?

Each positional argument is a copy of ``sparsetp/kernels/attention.py`` (an edited variant, or
an older version: ``git show <rev>:sparsetp/kernels/attention.py > /tmp/.base.py``) with the
tree's kernel signatures. ``kernel_versions.py`` loads each as its own module and launches it
with the library's launch descriptions; the tree's kernels run as arm ``tree`` through the same
launcher, so every arm pays the same host time (more than the library's: no description cache,
no direct launch, which matters only where the host is the floor, N <= 8192 on light patterns).

Every variant first passes the float32-reference gate (causal and BigBird at N=2048, the window
at a ragged N, poisoned outputs); a variant whose file stem contains ``timing_only`` skips it (a
variant that is knowingly wrong somewhere, timed to bound a gain); one that fails or does not
compile is recorded and not timed. Then forward and forward+backward of the target patterns
(bf16, B=1, H=16, D=128, block 128, default launch options) are timed with the arms interleaved
over ``--rounds`` rounds; ratios are ``tree / arm`` (> 1: the variant is faster). The tree's
kernels loaded twice have differed by up to ~7 % in one round, so include a copy of the tree
(``cp sparsetp/kernels/attention.py /tmp/.same.py``) to read the noise of the run.

Believe it only if ``python -m pytest -q tests/torch_attention_test.py`` passes::

    python benchmarks/kernel_ab.py --out=$OUT/kernel_ab.json /tmp/.base.py /tmp/.variant.py

On CPU (the interpreter; a smoke test of this script, not a measurement)::

    python benchmarks/kernel_ab.py --device=cpu --n=256 --check_n=256 --head_dim=32 \\
        --heads=2 --rounds=1 --patterns=causal sparsetp/kernels/attention.py
"""

from __future__ import annotations

import contextlib
import os
import sys

import attention_common as C
import kernel_versions
from absl import app, flags

from sparsetp.core import make_layout

FLAGS = flags.FLAGS
C.define_target_flags(out="kernel_ab.json", n=("8192", "32768"))
flags.DEFINE_integer("block", 128, "layout block")
flags.DEFINE_integer("rounds", 3, "interleaved rounds")


def main(argv):
    paths = argv[1:]
    if not paths:
        raise app.UsageError("give at least one copy of sparsetp/kernels/attention.py")
    rec = C.Record(FLAGS.out, FLAGS.budget_s)
    dev, d, h, bs = FLAGS.device, FLAGS.head_dim, FLAGS.heads, FLAGS.block
    versions = {"tree": kernel_versions.tree()}
    for p in paths:
        name = os.path.splitext(os.path.basename(p))[0].lstrip(".")
        if name in versions:
            raise app.UsageError(f"two versions named {name!r}")
        try:
            versions[name] = kernel_versions.load(p)
        except Exception as e:  # noqa: BLE001 - a file that does not import is not timed
            rec.error(f"load {p}", e)
    rec.data["versions"] = {"tree": "sparsetp/kernels/attention.py",
                            **{os.path.splitext(os.path.basename(p))[0].lstrip("."): p
                               for p in paths}}
    rec.log(f"env {rec.data['env']}; versions {rec.data['versions']}")

    def attn_of(name):
        return lambda q, k, v, lay: kernel_versions.attention(q, k, v, lay, versions[name])

    timed = [v for v in versions if "timing_only" in v or C.gate(
        rec, f"version {v}", attn_of(v), bs, dev, d=d, n=FLAGS.check_n)]
    rec.save()
    if "tree" not in timed:
        rec.log("the tree's kernels failed the gate through this launcher; nothing timed")
        sys.exit(rec.finish())
    arms = dict.fromkeys(timed, contextlib.nullcontext)
    for n in map(int, FLAGS.n):
        tensors = C.inputs(n, h, d, "bfloat16", dev, seed=11)
        for nm in FLAGS.patterns:
            case = f"{nm} N={n}"
            lay = make_layout(C.anchor_pattern(nm), n, h, bs)
            got = C.interleaved(arms, FLAGS.rounds,
                                lambda a, lay=lay, t=tensors: C.fwd_and_fwd_bwd_ms(
                                    attn_of(a), t, lay, dev, FLAGS.rep_ms),
                                stop=lambda case=case: rec.over_budget(case))
            if got is None:
                sys.exit(rec.finish())
            med, rows = got
            speed = {a: {"fwd": med["tree"][0] / med[a][0],
                         "fwd_bwd": med["tree"][1] / med[a][1]} for a in arms}
            rec.data.setdefault("ab", {})[case] = {
                "medians_fwd_fwd_bwd_ms": med, "tree_over_arm": speed, "raw": rows}
            rec.log(f"{case} medians (fwd, fwd+bwd ms): {med}; tree/arm: {speed}")
            rec.save()
    sys.exit(rec.finish())


if __name__ == "__main__":
    app.run(main)
