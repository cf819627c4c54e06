"""Ours against FlashAttention-4's deterministic backward (issue #34 F1). Lab (KERNEL_NOTES,
"Session 37").

Question: F1 compares our backward, deterministic (two passes, no atomics), with FA4's default
one, whose dQ is added by float32 atomics in whatever order the programs reach it. FA4 4.0.0b36
also has ``deterministic=True`` on sm_90 for causal and window layouts (dQ added in a fixed
order behind semaphores, as FA3's deterministic mode). Where do we stand against that, the
like-for-like anchor?

Each case runs the bench's own ``sparsetp`` and ``fa4`` preparations (``sparsetp.bench``:
rotating input sets, FA4's output checked against ours before it is timed) and ``fa4_det``,
the same FA4 call with ``deterministic=True``, in interleaved rounds; forward and forward +
backward by ``do_bench`` medians, backward = their difference, as the bench reports it. The
arms are also run twice on one input set and their gradients compared bitwise.

On the GPU machine, FA4 installed by ``../shared/peers/fa4.sh``::

    PYTHONPATH=$PWD python benchmarks/fa4_deterministic.py --out=$OUT/fa4_det.json
"""

from __future__ import annotations

import functools

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("patterns", ["causal", "window:1024"], "bench patterns FA4 runs natively")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_integer("rounds", 3, "interleaved timing rounds")
flags.DEFINE_string("out", None, "write the records here as JSON")


def _prepare(n: int, spec: str) -> tuple:
    """(rec, {arm: Prepared}, the frontier preset's config) of one case, through the bench's
    own preparations."""
    import flash_attn.cute as fa4  # noqa: PLC0415

    from sparsetp.bench import attention as bench  # noqa: PLC0415
    from sparsetp.bench import frontier  # noqa: PLC0415

    cfg = frontier.preset_config("cuda")
    case = bench._case(spec, n)
    bp, layout, _ = bench._Layouts().get(case)
    rec = {"pattern": spec, "N": n}
    arms = {"sparsetp": bench._prep_sparsetp(cfg, case, layout, bp, rec),
            "fa4": frontier.prep_fa4(cfg, case, layout, bp, rec)}
    default = fa4.flash_attn_func
    fa4.flash_attn_func = functools.partial(default, deterministic=True)
    try:  # prep_fa4 imports the function when it runs
        arms["fa4_det"] = frontier.prep_fa4(cfg, case, layout, bp, {})
    finally:
        fa4.flash_attn_func = default
    return rec, arms, cfg


def _bitwise_repeat(prep, n_sets: int) -> bool:
    """Forward + backward of ``prep`` twice on the same input set (its calls rotate through
    ``n_sets`` sets): bitwise equal gradients?"""
    import torch  # noqa: PLC0415

    def clear():
        for t in prep.grads:
            t.grad = None

    clear()
    prep.fwd_bwd()
    torch.cuda.synchronize()
    idx = [i for i, t in enumerate(prep.grads) if t.grad is not None]
    first = [prep.grads[i].grad.clone() for i in idx]
    clear()
    for _ in range(n_sets):  # the last of these reuses the first call's set
        prep.fwd_bwd()
    torch.cuda.synchronize()
    return all(torch.equal(g, prep.grads[i].grad) for g, i in zip(first, idx, strict=True))


def _measure(n: int, spec: str) -> dict:
    from sparsetp.bench.attention import _time_torch  # noqa: PLC0415

    rec, arms, cfg = _prepare(n, spec)
    rec["bitwise_repeat"] = {arm: _bitwise_repeat(prep, cfg.input_sets)
                             for arm, prep in arms.items()}
    times = {arm: {"fwd": [], "fwd_bwd": []} for arm in arms}
    for _ in range(FLAGS.rounds):
        for arm, prep in arms.items():
            for kind, fn in (("fwd", prep.fwd), ("fwd_bwd", prep.fwd_bwd)):
                grads = prep.grads if kind == "fwd_bwd" else None
                times[arm][kind].append(_time_torch(cfg, fn, grads)[0])
    med = {arm: {k: sorted(v)[len(v) // 2] for k, v in t.items()} for arm, t in times.items()}
    for m in med.values():
        m["bwd"] = m["fwd_bwd"] - m["fwd"]
    rec["ms"] = med
    ours = med["sparsetp"]["bwd"]
    rec["bwd_peer_over_ours"] = {arm: med[arm]["bwd"] / ours for arm in ("fa4", "fa4_det")}
    return rec


def main(argv):
    del argv
    import torch  # noqa: PLC0415
    from gluon_tools import run_cases  # noqa: PLC0415

    run_cases(lambda spec, n: _measure(n, spec), FLAGS.seq_lens, FLAGS.patterns, FLAGS.out,
              {"device": torch.cuda.get_device_name(), "rounds": FLAGS.rounds})


if __name__ == "__main__":
    app.run(main)
