"""Question: can a Gluon kernel on sm_90 sum a tensor across the CTAs of a thread-block cluster
(distributed shared memory), with the GPU machine's Triton?

Why: issue #23's lead for GQA's causal backward (KERNEL_NOTES, "Session 28") is the dK/dV pass in
the per-query-head form with the group's float32 dK, dV summed in head order before one store:
the G programs of one (key tile, kv head) as a cluster, adding through distributed shared
memory. The cheapest form in Gluon is a tensor laid out across the cluster's CTAs
(``cga_layout``) reduced over that axis (``gl.sum``). This compiles that reduction alone for
sm_90 on a machine without a GPU and counts the cluster instructions in its PTX (``mapa``,
``ld.shared::cluster``, ``barrier.cluster``). It launches nothing; findings go to
``benchmarks/KERNEL_NOTES.md``.

    pip install --target /tmp/t36 --no-deps triton==3.6.0      # the GPU machine's Triton
    PYTHONPATH=/tmp/t36 python benchmarks/gluon_cluster_probe.py
    python benchmarks/gluon_cluster_probe.py                   # the Triton installed here
"""

from __future__ import annotations

import json

import triton
from absl import app, flags
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

FLAGS = flags.FLAGS
flags.DEFINE_integer("group", 2, "CTAs in the cluster (query heads of a kv head's group)")
flags.DEFINE_integer("rows", 64, "rows of each CTA's partial (keys of a consumer)")
flags.DEFINE_integer("cols", 32, "columns of each CTA's partial")

_COUNTED = ("mapa", "ld.shared::cluster", "st.shared::cluster", "barrier.cluster")


@gluon.jit
def _cluster_sum(X, Y, G: gl.constexpr, R: gl.constexpr, C: gl.constexpr,
                 layout: gl.constexpr):
    """Y[r, c] = sum over g of X[g, r, c], the g axis spread over the cluster's G CTAs."""
    g = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    r = gl.arange(0, R, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    x = gl.load(X + g[:, None, None] * R * C + r[None, :, None] * C + c[None, None, :])
    s = gl.sum(x, axis=0)
    r2 = gl.arange(0, R, layout=gl.SliceLayout(1, s.type.layout))
    c2 = gl.arange(0, C, layout=gl.SliceLayout(0, s.type.layout))
    gl.store(Y + r2[:, None] * C + c2[None, :], s)


def main(argv):
    del argv
    if FLAGS.group < 2 or FLAGS.group & (FLAGS.group - 1):
        raise app.UsageError("--group must be a power of two >= 2")
    sig = {"X": "*fp32", "Y": "*fp32", "G": "constexpr", "R": "constexpr", "C": "constexpr",
           "layout": "constexpr"}
    # One CTA per g: the CTA bases of the g axis (a power of two each).
    cga = [[1 << i, 0, 0] for i in range(FLAGS.group.bit_length() - 1)]
    layout = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [1, 4, 1], [2, 1, 0], cga_layout=cga)
    constexprs = {"G": FLAGS.group, "R": FLAGS.rows, "C": FLAGS.cols}
    result = {"triton": triton.__version__, **constexprs}
    constexprs["layout"] = layout
    try:
        compiled = triton.compile(
            GluonASTSource(_cluster_sum, sig, constexprs=constexprs, attrs={}),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4, "num_ctas": FLAGS.group})
    except Exception as exc:  # noqa: BLE001 (the answer to the question, reported)
        # The compiler's assertion goes to stderr; the exception only says the pass failed.
        result["compiled"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
    else:
        ptx = compiled.asm["ptx"]
        result["compiled"] = True
        result["num_ctas"] = compiled.metadata.num_ctas
        result["ptx_counts"] = {tok: ptx.count(tok) for tok in _COUNTED}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
