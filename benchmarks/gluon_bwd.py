"""The sm_90 backward in Gluon: the library's dQ pass with the dK/dV variants. Lab (KERNEL_NOTES,
"Session 22").

Question (issue #34 backward at 0.61-0.76 of FA4; #23 GQA and packed-document backward at
0.99-1.07 of FlexAttention): does the forward's warp-specialised schedule carry over to the
deterministic key-major pass (dK/dV, 61% of the portable backward)? Per key tile of 128 keys
and (b, kv head), one program: a producer warp loads K and V once and, for each query head of
the kv head's group in turn (GQA: a fixed order, no atomics), each listed query tile in two
64-row steps (Q and dO by TMA into a ring); two consumer warpgroups own 64 keys each and keep
their dK, dV accumulators (64 x 128 fp32) in registers. The step is FA3's form (``n``, the
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
``--gqa_mha_form`` (KERNEL_NOTES, "Session 28: where GQA's causal backward loses"): GQA's
dK/dV pass as MHA's, a program per query head, the group's dK, dV summed after.
Form ``x`` (KERNEL_NOTES, "Session 37"): form ``t``'s transposed scores again, with what
the library's consumer learnt since (one loop of steps, the quarter skip, the output through
the K/V buffers, two mask words a row: here the bitmasks transposed, :func:`transposed_masks`)
and LSE/Delta loaded at use (``x2``/``x3``), under the S^T/dP^T MMAs (``x2e``/``x3e``) or
before the ring wait (``x2q``); or loaded one query a thread and spread by ``convert_layout``
(``x2c`` at use, ``x2cq``/``x3cq`` first), so no 16-wide pointer vector is live.

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

if hopper.GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from sparsetp.kernels.hopper import _dkdv_loader, _program, _step_keys

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
flags.DEFINE_bool("gqa_mha_form", False, "GQA: also time the dK/dV pass as MHA (one program "
                  "per query head on K, V repeated per head; the group's dK, dV summed after)")

BLOCK = 128
SUB = 64  # queries per step (one TMA box of Q and of dO)
# name: (form, ring stages, EARLY_DP[, consumer registers]); shared memory: K, V 64 KB +
# stages x 32 KB + 32 KB of P, dS
VARIANTS = {"n2": ("n", 2, False), "n3": ("n", 3, False), "n3e": ("n", 3, True),
            "n2e": ("n", 2, True), "n2e232": ("n", 2, True, 232),
            "b2e232": ("b", 2, True, 232), "b2e240": ("b", 2, True, 240),
            # form "x" (session 37): transposed scores, P^T and dS^T as register operands,
            # the partial tiles' bitmasks transposed (:func:`transposed_masks`); no P, dS
            # buffers, so 3 stages fit
            "x2": ("x", 2, True), "x3": ("x", 3, True),
            # LSE and Delta loaded while S^T and dP^T run ("e") or before the ring wait ("q")
            "x2e": ("x", 2, "e"), "x3e": ("x", 3, "e"), "x2q": ("x", 2, "q"),
            "x2c": ("x", 2, "c"), "x2cq": ("x", 2, "cq"), "x3cq": ("x", 3, "cq")}


def _skip_flag(kernel, skip_quarters: bool, dkdv: bool = False, group: int = 1) -> dict:
    """The skip constexpr of ``kernel`` (the dQ pass, or with ``dkdv`` the dK/dV pass) for a
    layout whose ``skip_quarters`` is given: ``SKIP`` (:func:`hopper.skip_levels`;
    ``--dkdv_skip`` overrides the dK/dV pass's), a base commit's ``HALF_STEPS`` (8b23465; its
    64-row steps only), or none (a kernel before 8b23465)."""
    if "SKIP" in kernel.arg_names:
        level = hopper.skip_levels(skip_quarters, group)[int(dkdv)]
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
    kernel = (_attn_bwd_dkdv_kernel_sm90_x if form == "x"
              else module._attn_bwd_dkdv_kernel_sm90)
    if form == "x":  # EARLY_DP carries where the consumers load LSE and Delta
        flag = {True: 1, "e": 2, "q": 3, "c": 4, "cq": 5}[flag]
    return kernel, {"STAGES": stages, "EARLY_DP": flag,
                    **_skip_flag(kernel, skip_quarters, dkdv=True, group=group),
                    "CONSUMER_REGS": regs, "PRODUCER_REGS": hopper.PRODUCER_REGS}


def transposed_masks(masks):
    """The partial tiles' bitmasks with rows and bits swapped, numpy int32 ``[U, 128, 4]``:
    row = key, bit ``r % 32`` of word ``r // 32`` = query ``r`` (``masks``: row = query, bits
    over keys), so a transposed-score consumer reads two words per key row.

    >>> import numpy as np
    >>> m = np.zeros((1, 128, 4), np.int32); m[0, 5, 2] = 1 << 7  # query 5, key 71
    >>> t = transposed_masks(m); int(t[0, 71, 0]) == 1 << 5, int(np.count_nonzero(t))
    (True, 1)
    """
    import numpy as np  # noqa: PLC0415

    bits = np.unpackbits(masks.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    bits = bits.reshape(masks.shape[0], 128, 128).transpose(0, 2, 1)
    packed = np.packbits(np.ascontiguousarray(bits), axis=-1, bitorder="little")
    return packed.view("<u4").reshape(masks.shape).view(np.int32)


if hopper.GLUON:
    LOG2E = gl.constexpr(1.4426950408889634)

    @gluon.jit
    def _dkdv_consumer_x(HALF: gl.constexpr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready,
                         q_empty, early, skip, k_count, k_partial, k_index, k_mask_id, masks_t,
                         mask_quarters, stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                         stride_mu, stride_mr, stride_mw, qk_scale, scale, N, H, GROUP, off_b,
                         off_g, start_n, LSE, Delta, out_bar):
        """Consumer warpgroup of form "x": keys ``[HALF * 64, +64)``; S^T = K Q^T and dP^T =
        V dO^T [64 keys, 64 queries]; P^T and dS^T go to dV += P^T dO and dK += dS^T Q as
        register operands (no shared memory, no fence); per-query vectors (LSE, Delta) are
        loaded right before use (16 registers a thread in this layout); a partial tile's
        transposed mask is two words a key row."""
        SKIP: gl.constexpr = skip.shape[0] - 1
        LOAD_AT: gl.constexpr = early.shape[0]  # 1: at use, 2: under the MMAs, 3: first
        NSTAGE: gl.constexpr = q_smem.shape[0]
        SUB_M: gl.constexpr = q_smem.shape[1]
        HEAD_DIM: gl.constexpr = q_smem.shape[2]
        KEYS: gl.constexpr = k_smem.shape[0] // 2
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                      k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # keys
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # queries
        key0: gl.constexpr = HALF * KEYS
        k_h = k_smem.slice(key0, KEYS, dim=0)
        v_h = v_smem.slice(key0, KEYS, dim=0)
        c = key0 + gl.arange(0, KEYS, layout=row_s)  # key within the tile
        rr = gl.arange(0, SUB_M, layout=col_s)  # query within the step
        # The step's queries one per thread (LSE, Delta loaded compactly, then spread).
        rc = gl.arange(0, SUB_M, layout=gl.BlockedLayout([1], [32], [4], [0]))
        s_zero = gl.zeros([KEYS, SUB_M], gl.float32, layout=s_layout)
        dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
        mbarrier.wait(kv_bar, 0)
        t = 0
        for j in range(GROUP):
            h = off_g * GROUP + j
            count = gl.load(k_count + h * stride_ch + start_n * stride_cm)
            n_partial = gl.load(k_partial + h * stride_ch + start_n * stride_cm)
            row = h * stride_ih + start_n * stride_im
            stats = (off_b * H + h).to(gl.int64) * N
            for it in range(2 * count):
                e = it // 2
                sub = it % 2
                has_key, left, right = _step_keys(e, sub, n_partial,
                                                         k_mask_id + row + e * stride_ik,
                                                         mask_quarters, SKIP)
                if has_key:
                    st = t % NSTAGE
                    if left if HALF == 0 else right:
                        qb = gl.load(k_index + row + e * stride_ik)
                        stat = stats + qb * (2 * SUB_M) + sub * SUB_M + rr
                        stat_c = stats + qb * (2 * SUB_M) + sub * SUB_M + rc
                        if LOAD_AT == 5:
                            lse_c = gl.load(LSE + stat_c)
                            delta_c = gl.load(Delta + stat_c)
                        if LOAD_AT == 3:
                            lse = gl.load(LSE + stat)
                            delta = gl.load(Delta + stat)
                        mbarrier.wait(q_ready.index(st), (t // NSTAGE) & 1)
                        qs = q_smem.index(st)
                        dos = do_smem.index(st)
                        s_tok = warpgroup_mma(k_h, qs.permute((1, 0)), s_zero, use_acc=False,
                                              is_async=True)
                        dp_tok = warpgroup_mma(v_h, dos.permute((1, 0)), s_zero,
                                               use_acc=False, is_async=True)
                        if LOAD_AT == 2:
                            lse = gl.load(LSE + stat)
                            delta = gl.load(Delta + stat)
                        s = warpgroup_mma_wait(1, deps=(s_tok, ))
                        if e < n_partial:
                            mid = gl.load(k_mask_id + row + e * stride_ik)
                            w_row = (masks_t + mid * stride_mu + c * stride_mr
                                     + (2 * sub) * stride_mw)
                            w0 = gl.load(w_row)
                            w1 = gl.load(w_row + stride_mw)
                            word = gl.where(rr[None, :] < 32, w0[:, None], w1[:, None])
                            # Two shifts: the second by a constant per register (8 x the
                            # query's byte), so only rr % 8 is a register (2 values a thread).
                            bit = (word >> (rr[None, :] % 8)) >> ((rr[None, :] // 8) % 4 * 8)
                            s = gl.where((bit & 1) != 0, s, float("-inf"))
                        if LOAD_AT == 1:
                            lse = gl.load(LSE + stat)
                        if LOAD_AT == 4:
                            lse_c = gl.load(LSE + stat_c)
                        if LOAD_AT >= 4:
                            lse = gl.convert_layout(lse_c, col_s)
                        # Rows with no key (LSE -inf) get +inf: P = 0 and no gradient.
                        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
                        p = gl.exp2(s * qk_scale - lse2[None, :])
                        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
                        if LOAD_AT == 1:
                            delta = gl.load(Delta + stat)
                        if LOAD_AT == 4:
                            delta_c = gl.load(Delta + stat_c)
                        if LOAD_AT >= 4:
                            delta = gl.convert_layout(delta_c, col_s)
                        ds = p * (dp - delta[None, :])
                        p_op = gl.convert_layout(p.to(dtype), op_layout)
                        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
                        dv = warpgroup_mma(p_op, dos, dv, is_async=True)
                        dk = warpgroup_mma(ds_op, qs, dk, is_async=True)
                        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                        mbarrier.arrive(q_empty.index(st), count=1)
                    else:
                        mbarrier.wait(q_ready.index(st), (t // NSTAGE) & 1)
                        mbarrier.arrive(q_empty.index(st), count=1)
                    t += 1
        dk = dk * scale
        k_h.store(dk.to(dtype))
        v_h.store(dv.to(dtype))
        fence_async_shared()
        mbarrier.arrive(out_bar, count=1)

    @gluon.jit
    def _dkdv_consumer_x0(q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, early, skip,
                          k_count, k_partial, k_index, k_mask_id, masks_t, mask_quarters,
                          stride_ch, stride_cm, stride_ih, stride_im, stride_ik, stride_mu,
                          stride_mr, stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g,
                          start_n, LSE, Delta, out_bar):
        _dkdv_consumer_x(0, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, early,
                         skip, k_count, k_partial, k_index, k_mask_id, masks_t, mask_quarters,
                         stride_ch, stride_cm, stride_ih, stride_im, stride_ik, stride_mu,
                         stride_mr, stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g,
                         start_n, LSE, Delta, out_bar)

    @gluon.jit
    def _dkdv_consumer_x1(q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, early, skip,
                          k_count, k_partial, k_index, k_mask_id, masks_t, mask_quarters,
                          stride_ch, stride_cm, stride_ih, stride_im, stride_ik, stride_mu,
                          stride_mr, stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g,
                          start_n, LSE, Delta, out_bar):
        _dkdv_consumer_x(1, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, early,
                         skip, k_count, k_partial, k_index, k_mask_id, masks_t, mask_quarters,
                         stride_ch, stride_cm, stride_ih, stride_im, stride_ik, stride_mu,
                         stride_mr, stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g,
                         start_n, LSE, Delta, out_bar)

    @gluon.jit
    def _attn_bwd_dkdv_kernel_sm90_x(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc,
                                     k_count, k_partial, k_index, k_mask_id, masks, k_order,
                                     mask_quarters, qk_scale, scale, N, N_KV, H, GROUP,
                                     stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                                     stride_mu, stride_mr, stride_mw,
                                     LSE, Delta,
                                     ORDERED: gl.constexpr, STAGES: gl.constexpr,
                                     EARLY_DP: gl.constexpr, SKIP: gl.constexpr,
                                     CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                     num_warps: gl.constexpr):
        """The library's dK/dV kernel (same arguments, grid, loader and outputs) with form
        "x" consumers; ``masks`` must be :func:`transposed_masks` of the layout's."""
        SUB_M: gl.constexpr = q_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(2 * SUB_M == BLOCK_N, "two 64-key consumers, 64-query steps")
        H_KV = H // GROUP
        start_n, off_bh = _program(k_order, stride_ch, stride_cm, H_KV,
                                          gl.cdiv(N_KV, BLOCK_N), GROUP, ORDERED)
        off_b = off_bh // H_KV
        off_g = off_bh % H_KV
        kv_row0 = off_bh * N_KV + start_n * BLOCK_N
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        out_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        skip = gl.allocate_shared_memory(gl.int64, [SKIP + 1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(out_bar, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        fence_async_shared()
        # The consumers read where to load LSE and Delta off this array's length.
        early = gl.allocate_shared_memory(gl.int64, [EARLY_DP, 1], mbarrier.MBarrierLayout())
        cargs = (q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, early, skip, k_count,
                 k_partial, k_index, k_mask_id, masks, mask_quarters, stride_ch, stride_cm,
                 stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale,
                 scale, N, H, GROUP, off_b, off_g, start_n, LSE, Delta, out_bar)
        gl.warp_specialize([
            (_dkdv_consumer_x0, cargs),
            (_dkdv_consumer_x1, cargs),
            (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, q_smem,
                                   do_smem, k_smem, v_smem, kv_bar, out_bar, q_ready, q_empty,
                                   skip, k_count, k_partial, k_index, k_mask_id, mask_quarters,
                                   stride_ch, stride_cm, stride_ih, stride_im, stride_ik, N, H,
                                   GROUP, off_b, off_g, start_n, kv_row0)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


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


def _dkdv_args(kernel, q, k, v, d_out, lse, delta, meta, scale, dk, dv):
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    arrays, strides = _key_lists(meta)
    outs = output_args(kernel, {"dk": (dk, BLOCK), "dv": (dv, BLOCK)})
    return (tma_desc(q, SUB), tma_desc(d_out, SUB), tma_desc(k, BLOCK), tma_desc(v, BLOCK),
            *outs[0], *arrays, *_skip_table(kernel, meta), scale * 1.4426950408889634, scale, n,
            n_kv, h, h // h_kv, *strides, lse, delta, *outs[1])


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
        args[kernel.arg_names.index("GROUP")] = group
        # MHA's launches pass GROUP = 1, which Triton compiles as a constant: another binary
        # with other spills than GQA's (KERNEL_NOTES, "Session 31").
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
    meta_x = {**meta, "masks": torch.from_numpy(transposed_masks(layout.metadata()["masks"]))
              .cuda()}  # form "x" reads the bitmasks transposed
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
        kv_lists = meta_x if VARIANTS[variant][0] == "x" else meta
        kernel[kv_grid](*_dkdv_args(kernel, q, k, v, d_out, lse, delta, kv_lists, scale, dk,
                                    dv),
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
        dq, delta = torch.empty_like(q), torch.empty_like(lse)
        dk_h, dv_h = torch.empty_like(q), torch.empty_like(q)
        dq_kernel = hopper._attn_bwd_dq_kernel_sm90
        dq_kernel[q_grid](*_dq_args(dq_kernel, q, k, v, d_out, out, lse, meta, scale, dq, delta),
                          ORDERED=True, **_dq_constexprs(dq_kernel, layout.skip_quarters),
                          num_warps=hopper.NUM_WARPS)
        kernel[grid](*_dkdv_args(kernel, q, k_x, v_x, d_out, lse, delta, meta, scale, dk_h,
                                 dv_h), ORDERED=True, **constexprs, num_warps=4)
        dk, dv = (t.view(b, h // g, g, n, d).float().sum(2).to(q.dtype) for t in (dk_h, dv_h))
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
