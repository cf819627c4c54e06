"""The sm_90 backward in Gluon: the library's dQ pass with the dK/dV variants. Lab (KERNEL_NOTES,
"Session 22").

Question (issue #34 backward at 0.61-0.76 of FA4; #23 GQA and packed-document backward at
0.99-1.07 of FlexAttention): does the forward's warp-specialised schedule carry over to the
deterministic key-major pass (dK/dV, 61% of the portable backward)? Per key tile of 128 keys
and (b, kv head), one program: a producer warp loads K and V once and each listed query tile in
two 64-row steps (Q and dO by TMA into a ring; GQA: the group's merged lists,
``hopper.group_key_lists``; a base commit before session 39 walks the group's heads in turn);
two consumer warpgroups own 64 keys each and keep their dK, dV accumulators (64 x 128 fp32) in
registers. The step is FA3's form (``n``, the
library's ``_attn_bwd_dkdv_kernel_sm90``): S = Q K^T [64 queries, 64 keys], P and dS through
shared memory as transposed A operands; ``EARLY_DP`` issues dP with S.

Measured and removed (KERNEL_NOTES, "Session 22"; its code is at commit 7ac2415): form ``t``,
transposed scores S^T = K Q^T [64 keys, 64 queries], P^T and dS^T as register operands of
dV += P^T dO and dK += dS^T Q (``s2``..``s4d``); it spills.

Measured and removed (KERNEL_NOTES, "Session 25"; their code is at commit a8a9c72): a
dQ pass with each half's dQ MMA under the next half's mask and exp (``n2e+dq_async``).
Measured and removed (KERNEL_NOTES, "Session 26" and "Session 27"; their code is at commit
26ff178): the one-pass backward (form ``f``: the ``n`` program also computes dQ and a writer
warp adds it by TMA in a fixed turn order; ``w2d``/``w2u``/``w2f``/``w2fu``).
Measured and removed (KERNEL_NOTES, "Session 30: the dK/dV consumer's waits and loads"; their
code is at commit e5b3f45): the library's consumer with its dV/dK MMAs left in flight and its
loads issued early (form ``m``).
``--gqa_merged`` (KERNEL_NOTES, "Session 39"): GQA's dK/dV pass on the library's merged lists
re-ordered (``--merged_orders``), on the library's grid, and MHA on the same queries in the same
rounds (session 39's recorded arms grouped their grid by the merged counts instead).
``--gqa_mha_form`` (KERNEL_NOTES, "Session 28: where GQA's causal backward loses"): GQA's
dK/dV pass as MHA's, a program per query head, the group's dK, dV summed after.
Measured and removed (KERNEL_NOTES, "Session 37"; its code is at commit 36b0a3d): form
``x``, form ``t``'s transposed scores with the library consumer's later habits (bitmasks
transposed, LSE/Delta at use, under the MMAs, first, or one query a thread spread by
``convert_layout``; ``x2``..``x3cq``): 0.78-1.01x of ``n2e``.

Compile for sm_90 without a GPU (Triton 3.6 beside the local one; ``--kv_heads=4`` for GQA's
binary, MHA's compiles GROUP = 1 as a constant)::

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/gluon_bwd.py --compile_only

On a Hopper GPU: check dQ, dK, dV against the portable backward, then time::

    PYTHONPATH=$PWD python benchmarks/gluon_bwd.py --out=/tmp/gluon_bwd.json

Another commit's backward beside this one's (form ``b``: its dQ pass and dK/dV kernel), e.g.
the nested loop before the one-loop form (KERNEL_NOTES, "Session 31")::

    git show 2eaea08:sparsetp/kernels/hopper.py > /tmp/base_hopper.py
    PYTHONPATH=$PWD python benchmarks/gluon_bwd.py --base_hopper=/tmp/base_hopper.py \
        --variants=b2e232,n2e232,b2e240,n2e

Nsight Compute of the variants' kernels (one call each, after a warm-up)::

    PYTHONPATH=$PWD ncu --profile-from-start off -k regex:dkdv --set full -o /tmp/dkdv \
        python benchmarks/gluon_bwd.py --ncu_once --variants=n2e232,n2e
"""

from __future__ import annotations

import functools
import itertools
import json

from absl import app, flags
from gluon_tools import (
    base_module,
    lab_pattern,
    list_args,
    output_args,
    run_cases,
    sm90_profile,
    stand_ins,
    tma_desc,
)

from sparsetp.kernels import hopper

FLAGS = flags.FLAGS
flags.DEFINE_bool("compile_only", False, "compile for sm_90 here and report registers/shared")
flags.DEFINE_list("patterns", ["causal", "window:1024", "bigbird", "strided_causal"],
                  "bench patterns (sparsetp.bench.attention), or documents "
                  "(gluon_tools.lab_pattern)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_list("variants", ["n2e"], "dK/dV variants (VARIANTS)")
flags.DEFINE_integer("heads", 16, "H")
flags.DEFINE_integer("kv_heads", 0, "H_kv (0: H)")
flags.DEFINE_integer("rounds", 3, "interleaved timing rounds")
flags.DEFINE_string("out", None, "write the records here as JSON")
flags.DEFINE_string("base_hopper", None, "another commit's sparsetp/kernels/hopper.py (`git "
                    "show REV:sparsetp/kernels/hopper.py > FILE`), for the 'b' variants")
flags.DEFINE_bool("ncu_once", False, "no check or timing: one call of each variant between "
                  "cudaProfilerStart/Stop, for `ncu --profile-from-start off`")
flags.DEFINE_integer("dkdv_skip", -1, "the 'n' dK/dV pass's SKIP level where the layout "
                     "skips quarters (-1: hopper.skip_levels')")
flags.DEFINE_bool("base_key_order", False, "the 'b' arms read lists whose partial entries "
                  "are in key order (as before session 35, which leads them with half entries)")
flags.DEFINE_bool("gqa_merged", False, "GQA: also time the dK/dV pass on the group's key "
                  "lists merged into one (MHA's binary, GROUP 1, over G * N query rows)")
flags.DEFINE_list("merged_orders", ["head"], "--gqa_merged: the merged lists' entry "
                  "orders (merged_lists), an arm each")
flags.DEFINE_bool("gqa_mha_form", False, "GQA: also time the dK/dV pass as MHA (one program "
                  "per query head on K, V repeated per head; the group's dK, dV summed after)")

BLOCK = 128
SUB = 64  # queries per step (one TMA box of Q and of dO)
# name: (form, ring stages, EARLY_DP[, consumer registers]); shared memory: K, V 64 KB +
# stages x 32 KB + 32 KB of P, dS
VARIANTS = {"n2": ("n", 2, False), "n3": ("n", 3, False), "n3e": ("n", 3, True),
            "n2e": ("n", 2, True), "n2e232": ("n", 2, True, 232),
            "b2e232": ("b", 2, True, 232), "b2e240": ("b", 2, True, 240)}


def _skip_flag(kernel, skip_quarters: bool, dkdv: bool = False, group: int = 1) -> dict:
    """The skip constexpr of ``kernel`` (the dQ pass, or with ``dkdv`` the dK/dV pass) for a
    layout whose ``skip_quarters`` is given: ``SKIP`` (:func:`hopper.skip_levels`;
    ``--dkdv_skip`` overrides the dK/dV pass's), a base commit's ``HALF_STEPS`` (8b23465; its
    64-row steps only), or none (a kernel before 8b23465)."""
    if "SKIP" in kernel.arg_names:
        level = hopper.skip_levels(skip_quarters)[int(dkdv)]
        if dkdv and group > 1 and "GROUP" in kernel.arg_names:
            level = min(level, 1)  # a base commit's group walk spilled at 2 (KERNEL_NOTES)
        if dkdv and skip_quarters and FLAGS.dkdv_skip >= 0:
            level = FLAGS.dkdv_skip
        return {"SKIP": level}
    return {"HALF_STEPS": skip_quarters} if "HALF_STEPS" in kernel.arg_names else {}


def _dkdv_launch(form: str, stages: int, flag: bool, regs: int = hopper.DKDV_CONSUMER_REGS,
                 skip_quarters: bool = True, group: int = 1):
    """(kernel, constexprs) of a variant: "n" the library's FA3-form kernel (flag: EARLY_DP)
    with ``regs`` registers a consumer, "b" the same kernel of ``--base_hopper`` (whose dQ
    pass the "b" arms run too); ``skip_quarters``: the layout's, ``group``: query heads per kv
    head (for a kernel that skips)."""
    if form == "b" and not FLAGS.base_hopper:
        raise ValueError("variants of form 'b' need --base_hopper")
    module = base_module(FLAGS.base_hopper) if form == "b" else hopper
    kernel = module._attn_bwd_dkdv_kernel_sm90
    return kernel, {"STAGES": stages, "EARLY_DP": flag,
                    **_skip_flag(kernel, skip_quarters, dkdv=True, group=group),
                    "CONSUMER_REGS": regs, "PRODUCER_REGS": hopper.PRODUCER_REGS}


def _key_lists(meta) -> tuple:
    """The key-major list arguments (as :func:`gluon_tools.list_args` for the query side)."""
    kc, ki, mk = meta["k_count"], meta["k_index"], meta["masks"]
    return ((kc, meta["k_partial"], ki, meta["k_mask_id"], mk, meta["k_order"]),
            (*kc.stride(), *ki.stride(), *mk.stride()))


def _skip_table(kernel, meta) -> tuple:
    """The step-skip table ``kernel`` takes: ``mask_quarters``; a base commit's
    ``mask_halves`` (bit r: query half r has a key, 7a3e0f8), derived from it; or none (a
    kernel before 8b23465 never skips)."""
    if "mask_quarters" in kernel.arg_names:
        return (meta["mask_quarters"],)
    if "mask_halves" in kernel.arg_names:
        q = meta["mask_quarters"]
        return ((((q & 3) != 0).int() | (((q >> 2) & 3) != 0).int() * 2).int(),)
    return ()


def key_order(layout) -> dict:
    """``q_index`` and ``q_mask_id`` of ``layout`` with each row's partial entries in key
    order, the rest in place: the query lists as they were before half entries led them."""
    import numpy as np  # noqa: PLC0415

    idx, mid = layout.q_index, layout.q_mask_id
    pos = np.arange(idx.shape[-1])
    key = np.where(pos < layout.q_partial[..., None], idx, (1 << 30) + pos)
    order = np.argsort(key, axis=-1, kind="stable")
    return {"q_index": np.take_along_axis(idx, order, -1),
            "q_mask_id": np.take_along_axis(mid, order, -1)}


def _dkdv_args(kernel, q, k, v, d_out, lse, delta, meta, scale, dk, dv, merged=None):
    """The dK/dV ``kernel``'s arguments. The library's kernel (no ``GROUP``) runs GQA as MHA:
    q, d_out, lse, delta viewed as ``H_kv`` heads of ``G * N`` rows over merged key lists
    (``merged``, ``k_*`` names, on the device; default the library's,
    :func:`hopper.group_key_lists` of ``meta``'s); a base commit's takes ``GROUP`` and walks
    each group."""
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    group = () if "GROUP" not in kernel.arg_names else (h // h_kv,)
    if not group and h_kv < h:
        import numpy as np  # noqa: PLC0415
        import torch  # noqa: PLC0415

        g = h // h_kv
        if merged is None:
            key = (meta["k_index"].data_ptr(), g)
            if key not in _MERGED:  # built once, outside the timed calls
                lists = hopper.group_key_lists(np, {n_: a.cpu().numpy() for n_, a in meta.items()
                                                    if n_.startswith("k_")}, g, n // BLOCK)
                _MERGED[key] = {"k" + n_[2:]: torch.from_numpy(a).to(meta["k_index"].device)
                                for n_, a in lists.items()}
            merged = _MERGED[key]
        meta = {**meta, **merged}
        q, d_out = (t.view(t.shape[0], h_kv, g * n, t.shape[-1]) for t in (q, d_out))
        lse, delta = (t.view(t.shape[0], h_kv, g * n) for t in (lse, delta))
        h, n = h_kv, g * n
    arrays, strides = _key_lists(meta)
    outs = output_args(kernel, {"dk": (dk, BLOCK), "dv": (dv, BLOCK)})
    return (tma_desc(q, SUB), tma_desc(d_out, SUB), tma_desc(k, BLOCK), tma_desc(v, BLOCK),
            *outs[0], *arrays, *_skip_table(kernel, meta), scale * 1.4426950408889634, scale, n,
            n_kv, h, *group, *strides, lse, delta, *outs[1])


_MERGED: dict = {}


def _dq_args(kernel, q, k, v, d_out, out, lse, meta, scale, dq, delta):
    """The sm_90 dQ pass ``kernel``'s arguments (no LSE cotangent: ``lse`` fills its slot,
    never read)."""
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    arrays, strides = list_args(meta)
    outs = output_args(kernel, {"dq": (dq, SUB)})
    return (tma_desc(q, SUB), tma_desc(d_out, SUB), tma_desc(k, BLOCK), tma_desc(v, BLOCK),
            *outs[0], *arrays, *_skip_table(kernel, meta), scale * 1.4426950408889634, scale, n,
            n_kv, h, h // h_kv, h_kv, *strides, out, lse, lse, *outs[1], delta)


def _dq_constexprs(kernel, skip_quarters: bool) -> dict:
    return {"STAGES": hopper.DQ_STAGES, "HAS_DLSE": False, **_skip_flag(kernel, skip_quarters),
            "CONSUMER_REGS": hopper.CONSUMER_REGS, "PRODUCER_REGS": hopper.PRODUCER_REGS}


def _compile_only():
    """Compile the library's dQ pass and each dK/dV variant for sm_90 with CPU stand-ins;
    print registers, spills, shared memory."""
    q, stats, meta = stand_ins(BLOCK)
    dq_kernel = hopper._attn_bwd_dq_kernel_sm90
    for skip_quarters in (False, True):
        prof = sm90_profile(dq_kernel, _dq_args(dq_kernel, q, q, q, q, q, stats, meta, 0.1, q,
                                                stats),
                            {"ORDERED": True, **_dq_constexprs(dq_kernel, skip_quarters)},
                            hopper.NUM_WARPS)
        print(json.dumps({"kernel": "library dQ", "skip_quarters": skip_quarters, **prof}))
    meta = {**meta, **{key.replace("q_", "k_"): val for key, val in meta.items()
                       if key.startswith("q_")}}
    group = FLAGS.heads // (FLAGS.kv_heads or FLAGS.heads)
    for name, skip_quarters in itertools.product(FLAGS.variants, (False, True)):
        kernel, constexprs = _dkdv_launch(*VARIANTS[name], skip_quarters=skip_quarters,
                                          group=group)
        skip = {k: v for k, v in constexprs.items() if k in ("SKIP", "HALF_STEPS")}
        if skip_quarters and not skip:
            continue
        args = list(_dkdv_args(kernel, q, q, q, q, stats, stats, meta, 0.1, q, q))
        one = {}
        if "GROUP" in kernel.arg_names:  # a base commit's group walk
            args[kernel.arg_names.index("GROUP")] = group
            # Its MHA launches pass GROUP = 1, which Triton compiles as a constant: another
            # binary with other spills than GQA's (KERNEL_NOTES, "Session 31").
            one = {"GROUP": 1} if group == 1 else {}
        prof = sm90_profile(kernel, args, {"ORDERED": True, **constexprs, **one}, 4)
        print(json.dumps({"variant": name, "group": group,
                          **skip,
                          **prof}))


def _kernel_ms(fn, reps=10):
    """Mean CUDA time per call of each attention kernel ``fn`` launches (torch profiler)."""
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.key_averages():
        total = getattr(ev, "device_time_total", None)
        if total is None:
            total = ev.cuda_time_total
        if "attn" in ev.key and total > 0:
            times[ev.key[:60]] = total / reps / 1e3
    return times


def _measure(spec, q, k, v, d_out):
    """Check the Gluon backward (the library's dQ, each dK/dV variant) against the portable
    backward, then time the whole backwards in interleaved rounds."""
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415

    from sparsetp.backends.torch import attention as tattn  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels import schedule  # noqa: PLC0415
    from sparsetp.kernels.options import launch_options  # noqa: PLC0415
    from sparsetp.torch import backward_kernel  # noqa: PLC0415

    b, h, n, d = q.shape
    h_kv = k.shape[1]
    scale = d ** -0.5
    layout = make_layout(lab_pattern(spec, n, BLOCK, h), n, h, BLOCK)
    meta = {key: torch.from_numpy(val.copy()).cuda() for key, val in layout.metadata().items()}
    base_meta = meta
    if FLAGS.base_key_order:
        base_meta = {**meta, **{key: torch.from_numpy(val).cuda()
                                for key, val in key_order(layout).items()}}
    q_group, k_group = schedule.head_groups(layout)
    q_grid = schedule.list_grid(b, h, n // BLOCK,
                                schedule.grid_group({"q_head_group": q_group}, "q", b, h))
    kv_grid = schedule.list_grid(b, h_kv, n // BLOCK,
                                 schedule.grid_group({"k_head_group": k_group}, "k", b, h_kv))
    with launch_options(fwd_kernel="portable", bwd_kernel="portable"):
        out, lse = tattn._forward(q, k, v, layout, scale)

    def diffs(got):  # largest |difference| of dQ, dK, dV from the portable backward
        return {name: float((a.float() - r.float()).abs().max())
                for name, a, r in zip(("dq", "dk", "dv"), got, ref, strict=True)}

    def gluon_bwd(variant):
        kernel, constexprs = _dkdv_launch(*VARIANTS[variant], skip_quarters=layout.skip_quarters,
                                          group=h // h_kv)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        # Form "b" is the other commit's whole backward: its dQ pass too.
        dq_module = base_module(FLAGS.base_hopper) if VARIANTS[variant][0] == "b" else hopper
        dq_kernel = dq_module._attn_bwd_dq_kernel_sm90
        lists = base_meta if VARIANTS[variant][0] == "b" else meta
        dq_kernel[q_grid](*_dq_args(dq_kernel, q, k, v, d_out, out, lse, lists, scale, dq, delta),
                          ORDERED=True, **_dq_constexprs(dq_kernel, layout.skip_quarters),
                          num_warps=hopper.NUM_WARPS)
        kernel[kv_grid](*_dkdv_args(kernel, q, k, v, d_out, lse, delta, meta, scale, dk, dv),
                        ORDERED=True, **constexprs, num_warps=4)
        return dq, dk, dv

    rec = {"pattern": spec, "N": n, "H": h, "H_kv": h_kv, "check": {}}
    if FLAGS.ncu_once:  # compiled and warm outside the capture, then one call of each
        for variant in FLAGS.variants:
            gluon_bwd(variant)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for variant in FLAGS.variants:
            gluon_bwd(variant)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return {**rec, "profiled": FLAGS.variants}
    with launch_options(fwd_kernel="portable", bwd_kernel="portable"):
        ref = tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)
    for variant in FLAGS.variants:
        got = gluon_bwd(variant)
        rec["check"][variant] = diffs(got)
        rec["check"][variant]["ref_max"] = max(float(r.float().abs().max()) for r in ref)

    def portable_bwd():
        with launch_options(fwd_kernel="portable", bwd_kernel="portable"):
            return tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)

    def library_bwd():  # as users get it: bwd_kernel="auto" (the sm_90 dQ where it runs)
        return tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)

    lib = library_bwd()
    rec["check"]["library"] = diffs(lib)
    rec["bwd_kernel"] = backward_kernel(q, k, v, layout).name
    arms = {"portable": portable_bwd, "library": library_bwd,
            **{v_: (lambda v_=v_: gluon_bwd(v_)) for v_ in FLAGS.variants}}
    if FLAGS.gqa_merged and h_kv < h:
        for order in FLAGS.merged_orders:
            arms["merged_" + order] = _merged_form(q, k, v, d_out, out, lse, meta, scale,
                                                   q_grid, kv_grid, layout, order)
            rec["check"]["merged_" + order] = diffs(arms["merged_" + order]())
        # MHA on the same queries (K, V repeated per query head), timed in the same rounds.
        k_x, v_x = (t.repeat_interleave(h // h_kv, dim=1).contiguous() for t in (k, v))
        arms["mha"] = lambda: tattn._backward(q, k_x, v_x, out, lse, d_out, None, layout, scale)
    if FLAGS.gqa_mha_form and h_kv < h:
        arms["mha_form"] = _mha_form(q, k, v, d_out, out, lse, meta, scale, q_grid, layout)
        rec["check"]["mha_form"] = diffs(arms["mha_form"]())
    times = {name: [] for name in arms}
    for _ in range(FLAGS.rounds):
        for name, fn in arms.items():
            times[name].append(triton.testing.do_bench(fn, warmup=25, rep=200))
    rec["ms"] = {k_: sorted(t)[len(t) // 2] for k_, t in times.items()}
    rec["kernel_ms"] = {name: _kernel_ms(fn) for name, fn in arms.items()}
    return rec


def _library_dq(q, k, v, d_out, out, lse, meta, scale, q_grid, layout):
    """The library's sm_90 dQ pass: (dQ, Delta)."""
    import torch  # noqa: PLC0415

    dq, delta = torch.empty_like(q), torch.empty_like(lse)
    dq_kernel = hopper._attn_bwd_dq_kernel_sm90
    dq_kernel[q_grid](*_dq_args(dq_kernel, q, k, v, d_out, out, lse, meta, scale, dq, delta),
                      ORDERED=True, **_dq_constexprs(dq_kernel, layout.skip_quarters),
                      num_warps=hopper.NUM_WARPS)
    return dq, delta


def _mha_form(q, k, v, d_out, out, lse, meta, scale, q_grid, layout):
    """The GQA backward with its dK/dV pass in MHA's form (question: is GQA's causal dK/dV
    pass slower than MHA's because a program walks its group's heads one after another?): the
    library's dQ pass, then the library's dK/dV kernel with one program per (key tile, query
    head) on K, V repeated per query head (made once, outside the timed call: a library form
    would read kv head h // G instead), then each group's dK, dV summed in float32 in head
    order (deterministic; the partials are rounded to bf16 first, the library's are not)."""
    import torch  # noqa: PLC0415

    from sparsetp.kernels import schedule  # noqa: PLC0415

    b, h, n, d = q.shape
    g = h // k.shape[1]
    k_x, v_x = (t.repeat_interleave(g, dim=1).contiguous() for t in (k, v))
    kernel, constexprs = _dkdv_launch(*VARIANTS["n2e"], skip_quarters=layout.skip_quarters)
    grid = schedule.list_grid(b, h, n // BLOCK, schedule.grid_group(
        {"k_head_group": schedule.head_groups(layout)[1]}, "k", b, h))

    def run():
        dq, delta = _library_dq(q, k, v, d_out, out, lse, meta, scale, q_grid, layout)
        dk_h, dv_h = torch.empty_like(q), torch.empty_like(q)
        kernel[grid](*_dkdv_args(kernel, q, k_x, v_x, d_out, lse, delta, meta, scale, dk_h,
                                 dv_h), ORDERED=True, **constexprs, num_warps=4)
        dk, dv = (t.view(b, h // g, g, n, d).float().sum(2).to(q.dtype) for t in (dk_h, dv_h))
        return dq, dk, dv
    return run


def merged_lists(layout, group: int, order: str = "head") -> dict:
    """The library's merged key lists of ``layout`` (:func:`hopper.group_key_lists`: per kv
    head and key tile, every query head's partial entries, then the full ones, head by head),
    as ``k_*`` arrays, with each run of partial and of full entries in ``order``: "head" (the
    library's), "tile" (by query tile, the heads of one tile together), "desc" (head by head,
    query tiles descending), "tile_desc"."""
    import numpy as np  # noqa: PLC0415

    m = hopper.group_key_lists(np, layout.metadata(), group, layout.num_blocks)
    idx, mid = m["kg_index"], m["kg_mask_id"]
    if order != "head":
        slot = np.arange(idx.shape[-1])
        full = slot >= m["kg_partial"][..., None]
        pad = slot >= m["kg_count"][..., None]
        head, tile = idx // layout.num_blocks, idx % layout.num_blocks
        sign = -1 if order.endswith("desc") else 1
        keys = (sign * tile, head) if order == "desc" else (head, sign * tile)  # minor first
        perm = np.lexsort((*keys, full, pad), axis=-1)
        idx, mid = (np.take_along_axis(a, perm, axis=-1) for a in (idx, mid))
    return {"k_count": m["kg_count"], "k_partial": m["kg_partial"], "k_index": idx,
            "k_mask_id": mid, "k_order": m["kg_order"], "masks": layout.masks,
            "mask_quarters": layout.mask_quarters}


def _merged_form(q, k, v, d_out, out, lse, meta, scale, q_grid, kv_grid, layout, order):
    """GQA's backward with the dK/dV pass on the merged lists in ``order``
    (:func:`merged_lists`): the library's dQ pass, then the library's dK/dV kernel on its
    grid."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    merged = {key: torch.from_numpy(np.ascontiguousarray(val)).cuda()
              for key, val in merged_lists(layout, q.shape[1] // k.shape[1], order).items()}
    kernel, constexprs = _dkdv_launch(*VARIANTS["n2e"], skip_quarters=layout.skip_quarters)

    def run():
        dq, delta = _library_dq(q, k, v, d_out, out, lse, meta, scale, q_grid, layout)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        kernel[kv_grid](*_dkdv_args(kernel, q, k, v, d_out, lse, delta, meta, scale, dk, dv,
                                    merged), ORDERED=True, **constexprs, num_warps=4)
        return dq, dk, dv
    return run


def main(argv):
    del argv
    if FLAGS.compile_only:
        _compile_only()
        return
    import torch  # noqa: PLC0415

    torch.manual_seed(0)
    h_kv = FLAGS.kv_heads or FLAGS.heads

    @functools.cache
    def inputs(n):  # q, k, v, d_out of one length, shared by its patterns
        q, d_out = (torch.randn(1, FLAGS.heads, n, 128, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
        k, v = (torch.randn(1, h_kv, n, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        return q, k, v, d_out

    run_cases(lambda spec, n: _measure(spec, *inputs(n)), FLAGS.seq_lens, FLAGS.patterns,
              FLAGS.out, {"device": torch.cuda.get_device_name()})


if __name__ == "__main__":
    app.run(main)
