"""Question: on the real-model cases of the GQA/documents/head-dim issue, how fast are our kernels
against FlexAttention, and what do grouped kv heads and head dim 256 cost?

Cases (B=1, bf16, block 128 on both sides; GPU only):

* ``gqa``: H=32 query heads, H_kv=8, D=128, causal and window-1024 (``|i-j| < 512``) at N=8192 and
  32768: sparsetp GQA, sparsetp MHA (k/v with 32 heads: the TFLOP/s it should match) and
  ``flex_attention(..., enable_gqa=True)`` with ``create_block_mask`` of the natural mask_mod;
* ``documents``: N=32768 packed as documents of 512-8192 tokens (seeded), causal within each,
  H=16, D=128: ``P.documents(lengths) & P.causal()`` against Flex's document mask_mod and, when
  ``flash_attn.cute`` is importable, FlashAttention-4's varlen path (``cu_seqlens``);
* ``head_dim``: causal N=8192, H=16, D=128 and D=256: TFLOP/s of each.

Times: ``--rounds`` interleaved rounds per case (``attention_common.interleaved``), the case's
arms (ours, Flex, and MHA or FA4's varlen where they apply) timed in turn within each round;
medians, each round's kept. TFLOP/s count computed elements (``sum over query heads of
computed tiles * block^2``): forward ``4 * D`` FLOPs per element, backward 2.5x that
(``sparsetp.bench.attention``'s convention).
Every sparsetp/Flex pair is checked against each other on its inputs first (max abs difference of
the outputs, recorded). Believe it only if ``tests/torch_attention_test.py`` passes::

    python benchmarks/real_models.py --out=$OUT/real_models.json
"""

from __future__ import annotations

import contextlib
import sys
import time

import attention_common as C
import numpy as np
import torch
from absl import app, flags

from sparsetp.bench.attention import _flex_fn
from sparsetp.core import make_layout
from sparsetp.core import patterns as P
from sparsetp.torch import sparse_attention

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "real_models.json", "where to write the JSON")
flags.DEFINE_list("sections", ["gqa", "documents", "head_dim"], "which sections to run")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N of the gqa section")
flags.DEFINE_float("rep_ms", 60.0, "do_bench repetition time per measurement")
flags.DEFINE_integer("rounds", 3, "interleaved rounds per case (medians are reported)")

BLOCK = 128
WINDOW = 1024


def _tensors(b, h, h_kv, n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def make(heads):
        return torch.randn(b, heads, n, d, device="cuda", generator=g).to(torch.bfloat16)

    q, k, v, d_out = make(h), make(h_kv), make(h_kv), make(h)
    return q, k, v, d_out


def _time(fn, q, k, v, d_out):
    """(forward ms, forward + backward ms) of ``fn(q, k, v) -> out``."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fwd = C.bench_ms(lambda: fn(q, k, v), "cuda", rep_ms=FLAGS.rep_ms)
    both = C.bench_ms(lambda: fn(*leaves).backward(d_out), "cuda", leaves, rep_ms=FLAGS.rep_ms)
    return fwd, both


def _rounds(arms: dict) -> dict:
    """Each arm's times over ``--rounds`` rounds of :func:`attention_common.interleaved` (the
    arms in turn within a round, so that a machine's drift hits every arm alike): ``{name:
    {"fwd_ms", "fwd_bwd_ms" (medians), "rounds_fwd_ms", "rounds_fwd_bwd_ms"}}``; an arm is
    ``(fn, (q, k, v), d_out)``."""
    med, rows = C.interleaved({name: contextlib.nullcontext for name in arms}, FLAGS.rounds,
                              lambda name: _time(arms[name][0], *arms[name][1], arms[name][2]))
    return {name: {"fwd_ms": med[name][0], "fwd_bwd_ms": med[name][1],
                   "rounds_fwd_ms": [r[0] for r in rows[name]],
                   "rounds_fwd_bwd_ms": [r[1] for r in rows[name]]} for name in arms}


def _times(layout, b, d, t: dict) -> dict:
    """A :func:`_rounds` entry with the backward (forward + backward minus forward) and
    TFLOP/s on the layout's computed elements."""
    fwd, both = t["fwd_ms"], t["fwd_bwd_ms"]
    return {"fwd_ms": fwd, "bwd_ms": both - fwd, "fwd_bwd_ms": both,
            "fwd_tflops": _tflops(layout, b, d, fwd),
            "bwd_tflops": _tflops(layout, b, d, both - fwd, backward=True),
            "rounds_fwd_ms": t["rounds_fwd_ms"], "rounds_fwd_bwd_ms": t["rounds_fwd_bwd_ms"]}


def _tflops(layout, b, d, ms, backward=False):
    elements = b * float(layout.q_count.sum()) * layout.block_size ** 2
    flops = 4 * d * elements * (2.5 if backward else 1.0)
    return flops / (ms * 1e-3) / 1e12


def _flex_mask(mask_mod, h, n):
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, BLOCK_SIZE=BLOCK,
                           device="cuda")
    return bm, time.perf_counter() - t0


def _pair(rec, name, layout, mask_mod, b, h, h_kv, n, d, seed, extra=None, more=None):
    """sparsetp and Flex on the same inputs: agreement, then times and TFLOP/s, with the
    arms of ``more`` (``{name: (fn, (q, k, v), d_out)}``, on this layout's work) in the same
    rounds."""
    q, k, v, d_out = _tensors(b, h, h_kv, n, d, seed)
    flex = _flex_fn()  # the bench tool's one compiled flex_attention
    bm, mask_s = _flex_mask(mask_mod, h, n)
    gqa = h_kv != h

    def ours(q, k, v):
        return sparse_attention(q, k, v, layout)

    def theirs(q, k, v):
        return flex(q, k, v, block_mask=bm, enable_gqa=gqa)

    t0 = time.perf_counter()
    diff = float((ours(q, k, v).float() - theirs(q, k, v).float()).abs().max())
    compile_s = time.perf_counter() - t0
    entry = {"case": name, "N": n, "H": h, "H_kv": h_kv, "D": d, "density": layout.density,
             "max_abs_diff_vs_flex": diff, "flex_block_mask_s": mask_s,
             "first_calls_s": compile_s, **(extra or {})}
    arms = {"sparsetp": (ours, (q, k, v), d_out), "flex": (theirs, (q, k, v), d_out),
            **(more or {})}
    for impl, t in _rounds(arms).items():
        entry[impl] = {**entry.get(impl, {}), **_times(layout, b, d, t)}
    entry["flex_over_ours"] = {p: entry["flex"][f"{p}_ms"] / entry["sparsetp"][f"{p}_ms"]
                               for p in ("fwd", "bwd", "fwd_bwd")}
    rec.data.setdefault("cases", []).append(entry)
    rec.log(f"{name} N={n}: diff {diff:.3g}, flex/ours {entry['flex_over_ours']}, ours "
            f"{entry['sparsetp']['fwd_tflops']:.0f}/{entry['sparsetp']['bwd_tflops']:.0f} "
            "TFLOP/s fwd/bwd")
    rec.save()
    return entry


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < WINDOW // 2


def gqa(rec):
    b, h, h_kv, d = 1, 32, 8, 128
    for n in (int(x) for x in FLAGS.seq_lens):
        for name, pattern, mod in (("causal", P.causal(), _causal),
                                   ("window", P.local(WINDOW // 2 - 1, WINDOW // 2 - 1),
                                    _window)):
            layout = make_layout(pattern, n, h, BLOCK)
            # MHA with the same query heads, in the same rounds: what GQA's TFLOP/s should
            # match.
            q, k, v, d_out = _tensors(b, h, h, n, d, seed=n + 1)
            mha = (lambda q, k, v, lay=layout: sparse_attention(q, k, v, lay), (q, k, v), d_out)
            entry = _pair(rec, f"gqa_{name}", layout, mod, b, h, h_kv, n, d, seed=n,
                          more={"sparsetp_mha": mha})
            entry["gqa_over_mha_tflops"] = {
                p: entry["sparsetp"][f"{p}_tflops"] / entry["sparsetp_mha"][f"{p}_tflops"]
                for p in ("fwd", "bwd")}
            rec.log(f"  GQA / MHA TFLOP/s (same query heads): {entry['gqa_over_mha_tflops']}")
            rec.save()


def documents(rec):
    b, h, d, n = 1, 16, 128, 32768
    lengths = C.document_lengths(n)
    t0 = time.perf_counter()
    layout = make_layout(P.documents(lengths) & P.causal(), n, h, BLOCK)
    build_s = time.perf_counter() - t0
    doc = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).to("cuda")

    def mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    info, arm = _fa4_varlen(layout, lengths, b, h, n, d, seed=7)
    entry = _pair(rec, "documents_causal", layout, mod, b, h, h, n, d, seed=7,
                  extra={"lengths": lengths, "our_layout_build_s": build_s,
                         "fa4_varlen": info},
                  more={"fa4_varlen": arm} if arm else None)
    if arm:
        entry["fa4_over_ours"] = {p: entry["fa4_varlen"][f"{p}_ms"] / entry["sparsetp"][f"{p}_ms"]
                                  for p in ("fwd", "bwd", "fwd_bwd")}
        rec.log(f"FA4 varlen: diff {info['max_abs_diff_vs_ours']:.3g}, fa4/ours "
                f"{entry['fa4_over_ours']}")
        rec.save()


def _fa4_varlen(layout, lengths, b, h, n, d, seed):
    """FlashAttention-4's varlen path (``cu_seqlens``, causal within each document) on the
    documents case's inputs (the same seed), when ``flash_attn.cute`` is importable
    (``../shared/peers/fa4.sh``): (its agreement with ours, its :func:`_rounds` arm), else
    (the reason, None)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: PLC0415
    except ImportError as e:
        return {"skipped": f"flash_attn.cute not importable: {e}"}, None
    q, k, v, d_out = _tensors(b, h, h, n, d, seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32,
                      device="cuda")
    longest = int(max(lengths))

    def fa4(q, k, v):  # FA's own layout, [total tokens, H, D]
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                     max_seqlen_q=longest, max_seqlen_k=longest, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def tokens_major(t):
        return t[0].transpose(0, 1).contiguous()

    qf, kf, vf, dof = (tokens_major(t) for t in (q, k, v, d_out))
    ours = sparse_attention(q, k, v, layout)
    diff = float((fa4(qf, kf, vf).float() - tokens_major(ours).float()).abs().max())
    return {"max_abs_diff_vs_ours": diff}, (fa4, (qf, kf, vf), dof)


def head_dim(rec):
    b, h, n = 1, 16, 8192
    layout = make_layout(P.causal(), n, h, BLOCK)
    arms = {}
    for d in (128, 256):
        q, k, v, d_out = _tensors(b, h, h, n, d, seed=d)
        arms[d] = (lambda q, k, v: sparse_attention(q, k, v, layout), (q, k, v), d_out)
    out = {d: _times(layout, b, d, t) for d, t in _rounds(arms).items()}
    for d in arms:
        rec.log(f"causal N={n} D={d}: {out[d]}")
    out["fwd_tflops_256_over_128"] = out[256]["fwd_tflops"] / out[128]["fwd_tflops"]
    rec.data["head_dim"] = {str(k): v for k, v in out.items()}
    rec.save()


def main(argv):
    del argv
    if not torch.cuda.is_available():
        raise app.UsageError("a GPU benchmark (FlexAttention is timed compiled on CUDA)")
    rec = C.Record(FLAGS.out)
    from sparsetp.backends.torch import native  # noqa: PLC0415

    # Time the eager path users get once warm: the C++ autograd node. Its build, started by
    # the first backward otherwise, would run beside the first case's timing.
    rec.data["torch_native"] = native.wait()
    for section in FLAGS.sections:
        try:
            {"gqa": gqa, "documents": documents, "head_dim": head_dim}[section](rec)
        except Exception as e:  # noqa: BLE001 - record and go on to the next section
            rec.data["errors"].append(f"{section}: {type(e).__name__}: {str(e)[:500]}")
            rec.log(f"{section} failed: {e}")
    rec.save()
    sys.exit(rec.finish())


if __name__ == "__main__":
    app.run(main)
