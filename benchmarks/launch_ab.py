"""Question: under which launch options do the library's kernels run the target patterns fastest?

An end-to-end A/B of *arms*, each a way of launching the tree's kernels
(``attention_common``'s arm spec: layout block, work order, head group, kernel tile, explicit
tile configs; :func:`sparsetp.kernels.options.launch_options`), never another kernel source
(that is ``kernel_ab.py``). For each N and pattern it times forward and forward+backward
through the public torch function (``triton.testing.do_bench`` medians), the arms interleaved
over ``--rounds`` rounds in one process, and reports the medians and ``reference / arm``
(> 1: the arm is faster), plus what each arm launched: kernel tile, head groups, row tiles and
computed elements (the inputs of ``schedule._TILE_MODEL``'s fit).

Before timing, every arm passes the float32-reference gate (causal and BigBird at N=2048, the
window at a ragged N, poisoned outputs), and arms that compute alike (same block, kernel tile
and tile configs as the first arm: they differ only in dispatch order) must give the first arm's
results bit for bit at every timed shape. Believe the numbers only if
``python -m pytest -q tests/torch_attention_test.py`` passes; a single difference under ~3 % is
within run-to-run noise (``benchmarks/KERNEL_NOTES.md``).

Presets: ``orders`` (the work orders and head groups 2, 4, 8) and ``tiles`` (the policy against
tiles 128 and 64 pinned)::

    python benchmarks/launch_ab.py --arms=tiles --out=$OUT/tile_ab.json
    python benchmarks/launch_ab.py --arms='auto;g2:head_group=2' --n=8192 --patterns=causal
    python benchmarks/launch_ab.py --arms='auto;t64:block=64,bwd=32/4/3' --head_dim=64
    python benchmarks/launch_ab.py --arms=tiles --heads=32 --kv_heads=8 --patterns=causal

On CPU (the interpreter; a smoke test of this script, not a measurement)::

    python benchmarks/launch_ab.py --device=cpu --n=256 --check_n=256 --head_dim=32 \\
        --heads=2 --rounds=1 --arms=orders --patterns=causal
"""

from __future__ import annotations

import sys

import attention_common as C
from absl import app, flags

from sparsetp.core import make_layout
from sparsetp.kernels import schedule

FLAGS = flags.FLAGS
C.define_target_flags(out="launch_ab.json", n=("8192", "32768"))
flags.DEFINE_multi_string("arms", ["tiles"], "arm specs or preset names (PRESETS), ';'-separated "
                          "or the flag repeated; the first arm is the reference of the ratios")
flags.DEFINE_string("dtype", "bfloat16", "input dtype")
flags.DEFINE_integer("rounds", 3, "interleaved rounds")
flags.DEFINE_integer("kv_heads", None, "H_kv of the timed inputs (GQA; default: --heads); the "
                     "float32 gate runs MHA")

PRESETS = {
    "orders": ["auto", "bh:work_order=longest_first_bh", "hm:work_order=longest_first",
               "g2:head_group=2", "g4:head_group=4", "g8:head_group=8"],
    "tiles": ["auto", "t128:kernel_tile=layout", "t64:block=64,kernel_tile=layout"],
}


def _launched(arm: C.Arm, layout) -> dict:
    """What the arm's launches run for ``layout`` (B=1): kernel tile, heads interleaved per group
    in the query-major and key-major launches, row tiles and computed elements."""
    kind = "cuda" if FLAGS.device == "cuda" else "interpreter"
    with arm.context():
        kl = schedule.kernel_layout(layout, kind, head_dim=FLAGS.head_dim, dtype=FLAGS.dtype)
        meta = dict(zip(("q_head_group", "k_head_group"), schedule.head_groups(kl), strict=True))
        groups = [schedule.grid_group(meta, m, 1, kl.num_heads) for m in ("q", "k")]
    return {"kernel_block": kl.block_size, "heads_per_group_q_k": groups,
            "row_tiles": kl.num_heads * kl.num_blocks,
            "computed_elements": int(kl.q_count.sum()) * kl.block_size ** 2}


def _case(rec, case, nm, n, tensors, ok, alike, ref) -> bool:
    """One (pattern, N): the bitwise check of the arms that compute alike, then the timings.
    False once past the budget."""
    if rec.over_budget(case):
        return False
    dev, h, (q, k, v, *_, d_out) = FLAGS.device, FLAGS.heads, tensors
    lays = {a.name: make_layout(C.anchor_pattern(nm), n, h, a.block) for a in ok.values()}
    if len(alike) > 1:
        C.bitwise_alike(rec, case, {a: ok[a].context for a in alike},
                        lambda a: C.run_with_grads(C.library_attention, q, k, v, lays[a], d_out))
    got = C.interleaved({a: ok[a].context for a in ok}, FLAGS.rounds,
                        lambda a: C.fwd_and_fwd_bwd_ms(C.library_attention, tensors, lays[a], dev,
                                                       FLAGS.rep_ms),
                        stop=lambda: rec.over_budget(case))
    if got is None:
        return False
    med, rows = got
    speed = {a: {"fwd": med[ref][0] / med[a][0], "fwd_bwd": med[ref][1] / med[a][1]} for a in ok}
    rec.data.setdefault("ab", {})[case] = {
        "medians_fwd_fwd_bwd_ms": med, f"{ref}_over_arm": speed, "raw": rows,
        "launched": {a: _launched(ok[a], lays[a]) for a in ok}}
    rec.log(f"{case} medians (fwd, fwd+bwd ms): {med}; {ref}/arm: {speed}")
    rec.save()
    return True


def main(argv):
    del argv
    rec = C.Record(FLAGS.out, FLAGS.budget_s)
    arms = C.parse_arms(FLAGS.arms, PRESETS)
    rec.data["arms"] = {a.name: {"block": a.block, "options": a.options} for a in arms}
    rec.log(f"env {rec.data['env']}; arms {rec.data['arms']}")
    dev, d, h = FLAGS.device, FLAGS.head_dim, FLAGS.heads
    ok = {}
    for a in arms:
        with a.context():
            if C.gate(rec, f"arm {a.name}", C.library_attention, a.block, dev, d=d,
                      n=FLAGS.check_n):
                ok[a.name] = a
    rec.save()
    ref = arms[0]
    if ref.name not in ok:
        rec.log(f"the reference arm {ref.name} failed its check; nothing timed")
        sys.exit(rec.finish())
    alike = [a.name for a in ok.values() if a.tiling() == ref.tiling()]
    for n in map(int, FLAGS.n):
        tensors = C.inputs(n, h, d, FLAGS.dtype, dev, seed=9, h_kv=FLAGS.kv_heads)
        for nm in FLAGS.patterns:
            if not _case(rec, f"{nm} N={n} D={d}", nm, n, tensors, ok, alike, ref.name):
                sys.exit(rec.finish())
    sys.exit(rec.finish())


if __name__ == "__main__":
    app.run(main)
