"""Question: where does the GPU time of one forward+backward go, kernel by kernel?

Runs one forward+backward through the public torch function with every launch recorded (the
torch launcher's ``run``), then times each recorded launch alone (``do_bench`` median):
forward, dQ (with Delta), dK/dV, with the tile config each ran. Per pattern and per arm
(``attention_common``'s arm spec: layout block, kernel tile, tile configs, work order), so
per-kernel costs of tiles and configs can be compared without the other kernels' noise. Each
arm first passes the float32-reference gate (poisoned outputs).

Believe it only if ``python -m pytest -q tests/torch_attention_test.py`` passes::

    python benchmarks/bwd_kernels.py --out=$OUT/bwd_kernels.json \\
        --arms='auto;t128:kernel_tile=layout;t64:block=64,kernel_tile=layout' --n=32768

On CPU (the interpreter; a smoke test of this script, not a measurement)::

    python benchmarks/bwd_kernels.py --device=cpu --n=256 --check_n=256 --head_dim=32 \\
        --heads=2 --patterns=causal
"""

from __future__ import annotations

import sys
from unittest import mock

import attention_common as C
from absl import app, flags

from sparsetp.backends.torch import launch as tlaunch
from sparsetp.core import make_layout

FLAGS = flags.FLAGS
C.define_target_flags(out="bwd_kernels.json", n=("32768",))
flags.DEFINE_multi_string("arms", ["auto"], "arm specs, ';'-separated or the flag repeated")
flags.DEFINE_string("dtype", "bfloat16", "input dtype")


def recorded(fn) -> list:
    """``fn()`` with every launch of the torch launcher recorded, in order:
    [(description, tensors, outputs, kind)], ready to re-launch with ``tlaunch.run``."""
    launches = []
    real = tlaunch.run

    def record(desc, tensors, outputs, kind):
        launches.append((desc, tensors, outputs, kind))
        return real(desc, tensors, outputs, kind)

    with mock.patch.object(tlaunch, "run", record):
        fn()
    return launches


def time_kernels(rec: C.Record, arm: C.Arm, nm: str, n: int, tensors) -> None:
    """Time each launch of one forward+backward of pattern ``nm`` alone (under ``arm``)."""
    _, _, _, qg, kg, vg, d_out = tensors
    lay = make_layout(C.anchor_pattern(nm), n, FLAGS.heads, arm.block)
    launches = recorded(lambda: C.library_attention(qg, kg, vg, lay)[0].backward(d_out))
    e = {"arm": arm.name, "pattern": nm, "N": n, "kernels": {}}
    for desc, tensors_, outputs, kind in launches:
        call = desc.call
        e["kernels"][call.name] = {
            "ms": C.bench_ms(lambda d=desc, t=tensors_, o=outputs, k=kind: tlaunch.run(d, t, o, k),
                             FLAGS.device, rep_ms=FLAGS.rep_ms),
            "block": call.constexprs["BLOCK"],
            "sub": call.constexprs.get("SUB_N", call.constexprs.get("SUB_M")),
            "num_warps": call.num_warps, "num_stages": call.num_stages, "grid": call.grid}
    rec.data.setdefault("kernels", []).append(e)
    rec.log(f"{arm.name} {nm} N={n}: " + ", ".join(
        f"{kn} {x['ms']:.3f} ms" for kn, x in e["kernels"].items()))


def main(argv):
    del argv
    rec = C.Record(FLAGS.out, FLAGS.budget_s)
    arms = C.parse_arms(FLAGS.arms)
    dev, d, h = FLAGS.device, FLAGS.head_dim, FLAGS.heads
    rec.log(f"env {rec.data['env']}; arms {[a.name for a in arms]}")
    for arm in arms:
        with arm.context():
            if not C.gate(rec, f"arm {arm.name}", C.library_attention, arm.block, dev, d=d,
                          n=FLAGS.check_n):
                continue
            for n in map(int, FLAGS.n):
                tensors = C.inputs(n, h, d, FLAGS.dtype, dev, seed=5)
                for nm in FLAGS.patterns:
                    tag = f"{arm.name} {nm} N={n}"
                    if rec.over_budget(tag):
                        continue
                    try:
                        time_kernels(rec, arm, nm, n, tensors)
                    except Exception as ex:  # noqa: BLE001 - record, go on with the next case
                        rec.error(tag, ex)
                    rec.save()
    sys.exit(rec.finish())


if __name__ == "__main__":
    app.run(main)
