"""Gluon forwards on Hopper (sm_90): the library's fast path and its variants, side by side.

Question (issue #34): is the gap to FlashAttention-4's forward the schedule? Triton's ``tl.dot``
pipeline runs S = Q K^T, the softmax and O += P V one after another; FA3 overlaps the softmax of
one key tile with the tensor-core work of the next. Arms, each checked against the portable
forward (output and LSE) before it is timed:

* ``plain``: that overlap by hand in one partition of 8 warps (two warpgroups of 64 rows, TMA
  K/V in a two-stage ring); its shared-memory hazards make the compiler put CTA-wide barriers
  in the loop, so the warpgroups run in lockstep.
* ``ws2`` / ``ws3``: the library's :func:`sparsetp.kernels.hopper._attn_fwd_kernel_sm90`
  (a producer warp, two consumer warpgroups, ready/empty mbarriers) with a 2- or 3-stage ring.
* ``p3pp`` / ``p2pp`` (session 24 lead, compiled for sm_90, **not yet run**): the library's
  kernel made persistent, one program per SM walking (query tile, b * H + h) items heads
  fastest in the longest-first order; the next item's Q and first K/V stages load under the
  current item's last MMAs and epilogue (3 or 2 ring stages, ping-pong on).
* ``h4pp`` / ``h6pp`` (session 24 lead, compiled, **not yet run**): 64-key K/V boxes and a
  per-tile step list (:func:`half_steps`) that leaves out partial tiles' empty 64-key halves
  (issue #32 3-D tiled: 83.3% of the halves kept; every other bench pattern keeps all, so
  there they measure what 64-key steps cost at head dim 128).
* ``portable`` (the portable forward), ``library`` (``sparse_attention`` as users call it, with
  its dispatch) and, on causal, cuDNN.

Run on a Hopper GPU::

    PYTHONPATH=$PWD python benchmarks/gluon_fwd.py --out=/tmp/gluon_fwd.json

Compile for sm_90 without a GPU (Triton 3.6 beside the local one, as ``ptx_probe.py``)::

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/gluon_fwd.py --compile_only
"""

from __future__ import annotations

import functools
import json
import time

from absl import app, flags
from gluon_tools import list_args, run_cases, sm90_profile, stand_ins, tma_desc
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sparsetp.kernels import hopper
from sparsetp.kernels.hopper import _finish, _masked_scores, _online_softmax, _program

FLAGS = flags.FLAGS
flags.DEFINE_bool("compile_only", False, "compile for sm_90 here and report registers/shared")
flags.DEFINE_list("variants", ["ws3pp", "p3pp", "p2pp"], "kernel variants (VARIANTS)")
flags.DEFINE_list("patterns", ["causal", "window:1024", "bigbird", "strided_causal",
                               "per_head_mix"], "bench patterns (sparsetp.bench.attention)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_integer("heads", 16, "H")
flags.DEFINE_integer("kv_heads", 0, "H_kv (0: H)")
flags.DEFINE_integer("head_dim", 128, "D")
flags.DEFINE_integer("rounds", 3, "interleaved timing rounds")
flags.DEFINE_string("out", None, "write the records here as JSON")

BLOCK = 128
NUM_WARPS = 8
STAGES = 2


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, q_index, row, e, count, kv_row0,
              stride_ik, BLOCK_N: gl.constexpr):
    """Start the TMA loads of list entry ``e``'s K and V tiles into ring stage ``e % 2``
    (nothing when ``e >= count``)."""
    s = e % 2
    ok = e < count
    kb = gl.load(q_index + row + gl.maximum(gl.minimum(e, count - 1), 0) * stride_ik)
    r = kv_row0 + kb * BLOCK_N
    mbarrier.expect(k_bar.index(s), k_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(k_desc, [r, 0], k_bar.index(s), k_smem.index(s), pred=ok)
    mbarrier.expect(v_bar.index(s), v_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(v_desc, [r, 0], v_bar.index(s), v_smem.index(s), pred=ok)


@gluon.jit
def _gluon_attn_fwd(q_desc, k_desc, v_desc,
                    q_count, q_partial, q_index, q_mask_id, masks, q_order,
                    qk_scale, N, N_KV, H, GROUP, H_KV,
                    stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                    stride_mu, stride_mr, stride_mw,
                    Out, LSE,
                    ORDERED: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    start_m, off_bh = _program(q_order, stride_ch, stride_cm, H, gl.cdiv(N, BLOCK_M), 1, ORDERED)
    off_b = off_bh // H
    off_h = off_bh % H
    q_row0 = off_bh * N + start_m * BLOCK_M
    kv_row0 = (off_b * H_KV + off_h // GROUP) * N_KV

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    count = gl.load(q_count + off_h * stride_ch + start_m * stride_cm)
    n_partial = gl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
    row = off_h * stride_ih + start_m * stride_im

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar, q_smem)
    _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, q_index, row, 0, count, kv_row0,
              stride_ik, BLOCK_N)
    _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, q_index, row, 1, count, kv_row0,
              stride_ik, BLOCK_N)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    p = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)
    mbarrier.wait(q_bar, 0)

    if count > 0:
        mbarrier.wait(k_bar.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        s = _masked_scores(s, 0, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                           stride_mu, stride_mr, stride_mw, N_KV, 0, 0, s_layout, BLOCK_M,
                           BLOCK_N, BLOCK_N)
        pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
        p = gl.convert_layout(pf.to(dtype), p_layout)

    for e in range(1, count):
        st = e % 2
        ph = (e // 2) & 1
        pst = (e - 1) % 2
        pph = ((e - 1) // 2) & 1
        mbarrier.wait(k_bar.index(st), ph)
        s_tok = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_bar.index(pst), pph)
        o_tok = warpgroup_mma(p, v_smem.index(pst), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        s = _masked_scores(s, e, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                           stride_mu, stride_mr, stride_mw, N_KV, 0, 0, s_layout, BLOCK_M,
                           BLOCK_N, BLOCK_N)
        pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        # Stage pst is free now (its K fed the previous S, its V the MMA just waited on).
        _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, q_index, row, e + 1, count,
                  kv_row0, stride_ik, BLOCK_N)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = gl.convert_layout(pf.to(dtype), p_layout)

    if count > 0:
        last = count - 1
        mbarrier.wait(v_bar.index(last % 2), (last // 2) & 1)
        o_tok = warpgroup_mma(p, v_smem.index(last % 2), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    out, lse = _finish(acc, m_i, l_i, row_o)
    rows_o = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    base = Out + (off_bh * N).to(gl.int64) * HEAD_DIM
    gl.store(base + rows_o[:, None] * HEAD_DIM + cols_o[None, :], out.to(dtype),
             mask=rows_o[:, None] < N)
    rows_s = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + (off_bh * N).to(gl.int64) + rows_s, lse, mask=rows_s < N)



# ---------------------------------------------------------------------------------------------
# Persistent variant (issue #34 F1/F2 short rows; lab): one CTA per SM walks work items (query
# tile, b * H + h) heads-fastest in the library's longest-first order, so the next item's Q load
# and first K/V stages run under this item's last MMAs and its epilogue instead of a new CTA's
# start-up. The ring's step counter, the Q buffer's phase and the ping-pong turns carry across
# items. Per-step work is the library consumer's (same helpers).


@gluon.jit
def _p_item(g, BH, H, q_order, stride_ch, stride_cm, ORDERED):
    """(tile, off_bh) of work item ``g`` (heads fastest, ranks longest first)."""
    rank = g // BH
    off_bh = g % BH
    if ORDERED != 0:
        tile = gl.load(q_order + (off_bh % H) * stride_ch + rank * stride_cm)
    else:
        tile = rank
    return tile, off_bh


@gluon.jit
def _p_loader(k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
              kv_empty, q_count, q_index, q_order, stride_ch, stride_cm, stride_ih, stride_im,
              stride_ik, N, N_KV, H, GROUP, H_KV, N_ITEMS, ORDERED):
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    TILE: gl.constexpr = 2 * SUB_M
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    SPLIT: gl.constexpr = TILE // BLOCK_N
    STAGES_: gl.constexpr = k_smem.shape[0]
    BH = N_ITEMS // gl.cdiv(N, TILE)
    step = 0
    qi = 0
    for g in range(gl.program_id(0), N_ITEMS, gl.num_programs(0)):
        tile, off_bh = _p_item(g, BH, H, q_order, stride_ch, stride_cm, ORDERED)
        off_h = off_bh % H
        count = gl.load(q_count + off_h * stride_ch + tile * stride_cm)
        if count > 0:
            # Q is free once both consumers have waited on their last S of the previous item.
            mbarrier.wait(q_empty, (qi & 1) ^ 1)
            q_row0 = off_bh * N + tile * TILE
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar, q_smem.index(0))
            tma.async_copy_global_to_shared(q_desc, [q_row0 + SUB_M, 0], q_bar,
                                            q_smem.index(1))
            qi += 1
            row = off_h * stride_ih + tile * stride_im
            kv_row0 = ((off_bh // H) * H_KV + off_h // GROUP) * N_KV
            for e in range(count * SPLIT):
                s = step % STAGES_
                mbarrier.wait(kv_empty.index(s), ((step // STAGES_) & 1) ^ 1)
                r = (kv_row0 + gl.load(q_index + row + (e // SPLIT) * stride_ik) * TILE
                     + (e % SPLIT) * BLOCK_N)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [r, 0], k_ready.index(s),
                                                k_smem.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [r, 0], v_ready.index(s),
                                                v_smem.index(s))
                step += 1


@gluon.jit
def _p_consumer(HALF: gl.constexpr, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                kv_empty, turn, q_count, q_partial, q_index, q_mask_id, q_order, masks,
                stride_ch, stride_cm, stride_ih, stride_im, stride_ik, stride_mu, stride_mr,
                stride_mw, qk_scale, N, N_KV, H, N_ITEMS, ORDERED, Out, LSE):
    """The library's ``_fwd_consumer`` over this CTA's work items, its step, Q-phase and turn
    counters carried across them."""
    PINGPONG: gl.constexpr = turn.shape[0] == 2
    SUB_M: gl.constexpr = q_smem.shape[1]
    STAGES_: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    TILE: gl.constexpr = 2 * SUB_M
    SPLIT: gl.constexpr = TILE // BLOCK_N
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q = q_smem.index(HALF)
    row0 = HALF * SUB_M
    s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, layout=s_layout)
    BH = N_ITEMS // gl.cdiv(N, TILE)
    if PINGPONG and HALF == 1:
        mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 issues first
    base = 0  # ring steps before this item
    qi = 0  # Q loads before this item
    t = 0  # MMA issues (turns) before this step
    for g in range(gl.program_id(0), N_ITEMS, gl.num_programs(0)):
        tile, off_bh = _p_item(g, BH, H, q_order, stride_ch, stride_cm, ORDERED)
        off_h = off_bh % H
        count = gl.load(q_count + off_h * stride_ch + tile * stride_cm)
        n_partial = gl.load(q_partial + off_h * stride_ch + tile * stride_cm)
        row = off_h * stride_ih + tile * stride_im
        m_i = gl.full([SUB_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([SUB_M], gl.float32, layout=row_s)
        acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, layout=o_layout)
        p = gl.zeros([SUB_M, BLOCK_N], dtype, layout=p_layout)
        steps = count * SPLIT
        if steps > 0:
            mbarrier.wait(q_bar, qi & 1)
            st0 = base % STAGES_
            mbarrier.wait(k_ready.index(st0), (base // STAGES_) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), t & 1)
            s_tok = warpgroup_mma(q, k_smem.index(st0).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            t += 1
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
            s = _masked_scores(s, 0, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                               stride_mu, stride_mr, stride_mw, N_KV, row0, 0, s_layout, SUB_M,
                               BLOCK_N, TILE)
            pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
            p = gl.convert_layout(pf.to(dtype), p_layout)
        for e in range(1, steps):
            gs = base + e
            st = gs % STAGES_
            pst = (gs - 1) % STAGES_
            mbarrier.wait(k_ready.index(st), (gs // STAGES_) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), t & 1)
            s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            mbarrier.wait(v_ready.index(pst), ((gs - 1) // STAGES_) & 1)
            o_tok = warpgroup_mma(p, v_smem.index(pst), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            t += 1
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            s = _masked_scores(s, e // SPLIT, n_partial, q_index, q_mask_id, row, stride_ik,
                               masks, stride_mu, stride_mr, stride_mw, N_KV, row0,
                               (e % SPLIT) * BLOCK_N, s_layout, SUB_M, BLOCK_N, TILE)
            pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(kv_empty.index(pst), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p = gl.convert_layout(pf.to(dtype), p_layout)
        if steps > 0:
            # Every S of this item is done: the producer may load the next item's Q while the
            # last P V and the epilogue run.
            mbarrier.arrive(q_empty, count=1)
            qi += 1
            last = base + steps - 1
            mbarrier.wait(v_ready.index(last % STAGES_), (last // STAGES_) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(HALF), t & 1)
            o_tok = warpgroup_mma(p, v_smem.index(last % STAGES_), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - HALF), count=1)
            t += 1
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            mbarrier.arrive(kv_empty.index(last % STAGES_), count=1)
        base += steps
        out, lse = _finish(acc, m_i, l_i, row_o)
        rows_o = tile * TILE + row0 + gl.arange(0, SUB_M, layout=row_o)
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        obase = Out + (off_bh * N).to(gl.int64) * HEAD_DIM
        gl.store(obase + rows_o[:, None] * HEAD_DIM + cols_o[None, :], out.to(dtype))
        rows_s = tile * TILE + row0 + gl.arange(0, SUB_M, layout=row_s)
        gl.store(LSE + (off_bh * N).to(gl.int64) + rows_s, lse)


@gluon.jit
def _p_consumer0(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, turn,
                 q_count, q_partial, q_index, q_mask_id, q_order, masks, stride_ch, stride_cm,
                 stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, N,
                 N_KV, H, N_ITEMS, ORDERED, Out, LSE):
    _p_consumer(0, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, turn,
                q_count, q_partial, q_index, q_mask_id, q_order, masks, stride_ch, stride_cm,
                stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, N,
                N_KV, H, N_ITEMS, ORDERED, Out, LSE)


@gluon.jit
def _p_consumer1(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, turn,
                 q_count, q_partial, q_index, q_mask_id, q_order, masks, stride_ch, stride_cm,
                 stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, N,
                 N_KV, H, N_ITEMS, ORDERED, Out, LSE):
    _p_consumer(1, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, turn,
                q_count, q_partial, q_index, q_mask_id, q_order, masks, stride_ch, stride_cm,
                stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, N,
                N_KV, H, N_ITEMS, ORDERED, Out, LSE)


@gluon.jit
def _attn_fwd_kernel_sm90_persistent(q_desc, k_desc, v_desc,
                                     q_count, q_partial, q_index, q_mask_id, masks, q_order,
                                     qk_scale, N, N_KV, H, GROUP, H_KV,
                                     stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                                     stride_mu, stride_mr, stride_mw,
                                     Out, LSE, N_ITEMS,
                                     ORDERED: gl.constexpr, STAGES: gl.constexpr,
                                     CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                     PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    """The library's sm_90 forward as a persistent kernel: grid (programs,), ``N_ITEMS`` = B *
    H * (N / 128) work items dealt round-robin (see :func:`_p_item`)."""
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    ordered = 1 if ORDERED else 0
    q_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2 if PINGPONG else 1, 1],
                                     mbarrier.MBarrierLayout())
    for i in gl.static_range(2 if PINGPONG else 1):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    cargs = (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, turn, q_count,
             q_partial, q_index, q_mask_id, q_order, masks, stride_ch, stride_cm, stride_ih,
             stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV, H,
             N_ITEMS, ordered, Out, LSE)
    gl.warp_specialize([
        (_p_consumer0, cargs),
        (_p_consumer1, cargs),
        (_p_loader, (k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                     v_ready, kv_empty, q_count, q_index, q_order, stride_ch, stride_cm,
                     stride_ih, stride_im, stride_ik, N, N_KV, H, GROUP, H_KV, N_ITEMS,
                     ordered)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])



# ---------------------------------------------------------------------------------------------
# Half-tile steps (issue #32 3-D; lab): K/V in 64-key boxes and, per query tile, a list of
# (entry, half) steps that leaves out a partial tile's 64-key half with no allowed pair (the
# tiling study's option (b): 3-D 16x32x32, kernel 7x15x15, tiles 2x8x8 computes 18.31% of the
# pairs instead of 21.97%). Otherwise the library's forward (ring, ping-pong, helpers).


def half_steps(meta: dict) -> tuple:
    """(q_steps [H, T, 2W] int32: per query tile the codes 2 * entry + half of its steps, in
    list order, empty halves of partial tiles left out; q_nsteps [H, T] int32) of block-128
    layout metadata (NumPy)."""
    import numpy as np  # noqa: PLC0415

    count, partial = meta["q_count"], meta["q_partial"]
    index, mask_id, masks = meta["q_index"], meta["q_mask_id"], meta["masks"]
    words = masks.shape[-1]
    # A half is non-empty if any of its words has a bit in any row.
    half_ok = np.stack([(masks[:, :, :words // 2] != 0).any((1, 2)),
                        (masks[:, :, words // 2:] != 0).any((1, 2))], -1)  # [M, 2]
    e = np.arange(index.shape[-1])[None, None, :, None]
    half = np.arange(2)[None, None, None, :]
    in_list = e < count[..., None, None]
    is_partial = e < partial[..., None, None]
    ok = half_ok[np.clip(mask_id, 0, len(half_ok) - 1)[..., None], half]
    valid = (in_list & (~is_partial | ok)).reshape(*count.shape, -1)
    codes = np.broadcast_to(2 * e + half, (*count.shape, index.shape[-1], 2)).reshape(
        *count.shape, -1)
    order = np.argsort(~valid, axis=-1, kind="stable")  # valid steps first, in list order
    steps = np.take_along_axis(codes, order, -1).astype(np.int32)
    return np.ascontiguousarray(steps), valid.sum(-1).astype(np.int32)


@gluon.jit
def _h_loader(k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
              kv_empty, q_index, row, nsteps, q_steps, srow, stride_sk, q_row0, kv_row0,
              stride_ik):
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    TILE: gl.constexpr = 2 * SUB_M
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES_: gl.constexpr = k_smem.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row0 + SUB_M, 0], q_bar, q_smem.index(1))
    for t in range(nsteps):
        s = t % STAGES_
        mbarrier.wait(kv_empty.index(s), ((t // STAGES_) & 1) ^ 1)
        code = gl.load(q_steps + srow + t * stride_sk)
        r = (kv_row0 + gl.load(q_index + row + (code // 2) * stride_ik) * TILE
             + (code % 2) * BLOCK_N)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [r, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [r, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _h_consumer(HALF: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                turn, nsteps, q_steps, srow, stride_sk, n_partial, q_index, q_mask_id, row,
                stride_ik, masks, stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV, start_m,
                off_bh, Out, LSE):
    """The library's ``_fwd_consumer``, its steps read off the list (``2 * entry + half``)."""
    PINGPONG: gl.constexpr = turn.shape[0] == 2
    SUB_M: gl.constexpr = q_smem.shape[1]
    STAGES_: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    TILE: gl.constexpr = 2 * SUB_M
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q = q_smem.index(HALF)
    row0 = HALF * SUB_M
    m_i = gl.full([SUB_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([SUB_M], gl.float32, layout=row_s)
    acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([SUB_M, BLOCK_N], gl.float32, layout=s_layout)
    p = gl.zeros([SUB_M, BLOCK_N], dtype, layout=p_layout)
    mbarrier.wait(q_bar, 0)
    if PINGPONG and HALF == 1:
        mbarrier.arrive(turn.index(0), count=1)
    if nsteps > 0:
        code = gl.load(q_steps + srow)
        mbarrier.wait(k_ready.index(0), 0)
        if PINGPONG:
            mbarrier.wait(turn.index(HALF), 0)
        s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        s = _masked_scores(s, code // 2, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                           stride_mu, stride_mr, stride_mw, N_KV, row0, (code % 2) * BLOCK_N,
                           s_layout, SUB_M, BLOCK_N, TILE)
        pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
        p = gl.convert_layout(pf.to(dtype), p_layout)
    for e in range(1, nsteps):
        st = e % STAGES_
        pst = (e - 1) % STAGES_
        code = gl.load(q_steps + srow + e * stride_sk)
        mbarrier.wait(k_ready.index(st), (e // STAGES_) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(HALF), e & 1)
        s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_ready.index(pst), ((e - 1) // STAGES_) & 1)
        o_tok = warpgroup_mma(p, v_smem.index(pst), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
        s = _masked_scores(s, code // 2, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                           stride_mu, stride_mr, stride_mw, N_KV, row0, (code % 2) * BLOCK_N,
                           s_layout, SUB_M, BLOCK_N, TILE)
        pf, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, qk_scale)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(kv_empty.index(pst), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = gl.convert_layout(pf.to(dtype), p_layout)
    if nsteps > 0:
        last = nsteps - 1
        mbarrier.wait(v_ready.index(last % STAGES_), (last // STAGES_) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(HALF), nsteps & 1)
        o_tok = warpgroup_mma(p, v_smem.index(last % STAGES_), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        acc = warpgroup_mma_wait(0, deps=(o_tok, ))
        mbarrier.arrive(kv_empty.index(last % STAGES_), count=1)
    out, lse = _finish(acc, m_i, l_i, row_o)
    rows_o = start_m * TILE + row0 + gl.arange(0, SUB_M, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    base = Out + (off_bh * N).to(gl.int64) * HEAD_DIM
    gl.store(base + rows_o[:, None] * HEAD_DIM + cols_o[None, :], out.to(dtype))
    rows_s = start_m * TILE + row0 + gl.arange(0, SUB_M, layout=row_s)
    gl.store(LSE + (off_bh * N).to(gl.int64) + rows_s, lse)


@gluon.jit
def _h_consumer0(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, nsteps,
                 q_steps, srow, stride_sk, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                 stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV, start_m, off_bh, Out, LSE):
    _h_consumer(0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, nsteps,
                q_steps, srow, stride_sk, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV, start_m, off_bh, Out, LSE)


@gluon.jit
def _h_consumer1(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, nsteps,
                 q_steps, srow, stride_sk, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                 stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV, start_m, off_bh, Out, LSE):
    _h_consumer(1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, nsteps,
                q_steps, srow, stride_sk, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                stride_mu, stride_mr, stride_mw, qk_scale, N, N_KV, start_m, off_bh, Out, LSE)


@gluon.jit
def _attn_fwd_kernel_sm90_halves(q_desc, k_desc, v_desc,
                                 q_count, q_partial, q_index, q_mask_id, masks, q_order,
                                 qk_scale, N, N_KV, H, GROUP, H_KV,
                                 stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                                 stride_mu, stride_mr, stride_mw,
                                 Out, LSE, q_steps, q_nsteps, stride_sh, stride_sm, stride_sk,
                                 ORDERED: gl.constexpr, STAGES: gl.constexpr,
                                 CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                 PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    """The library's sm_90 forward on 64-key boxes walking :func:`half_steps`' list
    (``q_nsteps`` has ``q_count``'s strides)."""
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_bh = _program(q_order, stride_ch, stride_cm, H, gl.cdiv(N, 2 * SUB_M), 1,
                               ORDERED)
    off_b = off_bh // H
    off_h = off_bh % H
    q_row0 = off_bh * N + start_m * 2 * SUB_M
    kv_row0 = (off_b * H_KV + off_h // GROUP) * N_KV
    nsteps = gl.load(q_nsteps + off_h * stride_ch + start_m * stride_cm)
    n_partial = gl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
    row = off_h * stride_ih + start_m * stride_im
    srow = off_h * stride_sh + start_m * stride_sm
    q_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2 if PINGPONG else 1, 1],
                                     mbarrier.MBarrierLayout())
    for i in gl.static_range(2 if PINGPONG else 1):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    cargs = (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, nsteps, q_steps,
             srow, stride_sk, n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu,
             stride_mr, stride_mw, qk_scale, N, N_KV, start_m, off_bh, Out, LSE)
    gl.warp_specialize([
        (_h_consumer0, cargs),
        (_h_consumer1, cargs),
        (_h_loader, (k_desc, v_desc, q_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                     kv_empty, q_index, row, nsteps, q_steps, srow, stride_sk, q_row0,
                     kv_row0, stride_ik)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# name -> (kernel, query rows per TMA box, constexprs, num_warps of the default partition)
_WS = {"CONSUMER_REGS": hopper.CONSUMER_REGS, "PRODUCER_REGS": hopper.PRODUCER_REGS,
       "PINGPONG": False}
VARIANTS = {
    "plain": ("_gluon_attn_fwd", BLOCK, {}, NUM_WARPS),
    "ws2": ("_attn_fwd_kernel_sm90", BLOCK // 2, {"STAGES": 2, **_WS}, hopper.NUM_WARPS),
    "ws3": ("_attn_fwd_kernel_sm90", BLOCK // 2, {"STAGES": 3, **_WS}, hopper.NUM_WARPS),
    "ws2pp": ("_attn_fwd_kernel_sm90", BLOCK // 2, {"STAGES": 2, **_WS, "PINGPONG": True},
              hopper.NUM_WARPS),
    "ws3pp": ("_attn_fwd_kernel_sm90", BLOCK // 2, {"STAGES": 3, **_WS, "PINGPONG": True},
              hopper.NUM_WARPS),
    # Persistent (grid: one program per SM): the library's configuration (ws3pp) otherwise.
    "p3pp": ("_attn_fwd_kernel_sm90_persistent", BLOCK // 2,
             {"STAGES": 3, **_WS, "PINGPONG": True}, hopper.NUM_WARPS),
    "p2pp": ("_attn_fwd_kernel_sm90_persistent", BLOCK // 2,
             {"STAGES": 2, **_WS, "PINGPONG": True}, hopper.NUM_WARPS),
}
PERSISTENT = ("_attn_fwd_kernel_sm90_persistent", )
# Half-tile steps: 64-key boxes, 4 or 6 ring stages (160 / 224 KB of shared memory).
VARIANTS["h4pp"] = ("_attn_fwd_kernel_sm90_halves", BLOCK // 2,
                    {"STAGES": 4, **_WS, "PINGPONG": True}, hopper.NUM_WARPS)
VARIANTS["h6pp"] = ("_attn_fwd_kernel_sm90_halves", BLOCK // 2,
                    {"STAGES": 6, **_WS, "PINGPONG": True}, hopper.NUM_WARPS)
HALVES = ("_attn_fwd_kernel_sm90_halves", )


def _kernel(name):
    return globals()[name] if name in globals() else getattr(hopper, name)


def _launch_args(q, k, v, meta, scale, out, lse, q_rows, kv_rows=BLOCK):
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    arrays, strides = list_args(meta)
    return (tma_desc(q, q_rows), tma_desc(k, kv_rows), tma_desc(v, kv_rows), *arrays,
            scale * 1.4426950408889634, n, n_kv, h, h // h_kv, h_kv, *strides, out, lse)


def _variant_args(name, q, k, v, meta, scale, out, lse, q_rows):
    """The launch arguments of kernel ``name`` (the persistent and half-step kernels take
    more; ``meta`` holds ``q_steps`` / ``q_nsteps`` for the latter)."""
    if name in HALVES:
        steps = meta["q_steps"]
        return (*_launch_args(q, k, v, meta, scale, out, lse, q_rows, BLOCK // 2), steps,
                meta["q_nsteps"], *steps.stride())
    args = _launch_args(q, k, v, meta, scale, out, lse, q_rows)
    if name in PERSISTENT:
        args = (*args, q.shape[0] * q.shape[1] * (q.shape[2] // BLOCK))
    return args


def gluon_forward(q, k, v, meta, grid, ordered, scale, variant="plain"):
    """Out, LSE of a Gluon forward variant (torch CUDA tensors; ``meta`` the layout's arrays on
    the device; ``grid`` and ``ordered`` as the portable kernel's launch)."""
    import torch  # noqa: PLC0415

    name, q_rows, consts, warps = VARIANTS[variant]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    args = _variant_args(name, q, k, v, meta, scale, out, lse, q_rows)
    if name in PERSISTENT:  # one program per SM over B * H * (N / 128) items
        grid = (min(args[-1], _sms(q.device)), )
    _kernel(name)[grid](*args, ORDERED=ordered, **consts, num_warps=warps)
    return out, lse


@functools.cache
def _sms(device) -> int:
    import torch  # noqa: PLC0415

    return torch.cuda.get_device_properties(device).multi_processor_count


def _compile_only():
    """Compile each variant for sm_90 with CPU stand-ins for the tensors; print registers,
    spills, shared memory and instruction counts."""
    q, stats, meta = stand_ins(BLOCK, FLAGS.head_dim)
    for variant in FLAGS.variants:
        name, q_rows, consts, warps = VARIANTS[variant]
        full = {**meta, "q_steps": meta["q_index"], "q_nsteps": meta["q_count"]}
        args = _variant_args(name, q, q, q, full, 0.1, q, stats, q_rows)
        prof = sm90_profile(_kernel(name), args, {"ORDERED": True, **consts}, warps)
        print(json.dumps({"variant": variant, **prof}))


def _measure(spec, q, k, v) -> dict:
    """Check every variant against the portable forward on one case, then time them (and the
    library's default dispatch, and cuDNN on causal) in interleaved rounds."""
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415

    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels import schedule  # noqa: PLC0415
    from sparsetp.kernels.options import launch_options  # noqa: PLC0415
    from sparsetp.torch import forward_kernel, sparse_attention  # noqa: PLC0415

    b, h, n, d = q.shape
    scale = d ** -0.5
    layout = make_layout(bench_pattern(spec, n, BLOCK, h).pattern, n, h, BLOCK)
    arrays = layout.metadata()
    steps, nsteps = half_steps(arrays)
    meta = {key: torch.from_numpy(val.copy()).cuda()
            for key, val in {**arrays, "q_steps": steps, "q_nsteps": nsteps}.items()}
    q_group, _ = schedule.head_groups(layout)
    grid = schedule.list_grid(b, h, n // BLOCK,
                              schedule.grid_group({"q_head_group": q_group}, "q", b, h))
    rec = {"pattern": spec, "N": n, "H": h, "H_kv": k.shape[1], "D": d,
           "density": float(layout.density), "grid": list(grid),
           "dispatch": forward_kernel(q, k, v, layout).name,
           # 64-key steps the half-step arms take / 64-key halves of the listed tiles
           "half_steps_fraction": float(nsteps.sum() / (2 * arrays["q_count"].sum()))}

    def portable():
        with launch_options(fwd_kernel="portable"):
            return sparse_attention(q, k, v, layout, scale=scale, return_lse=True)

    ref, ref_lse = portable()
    fin = torch.isfinite(ref_lse)
    fns = {"portable": portable,
           "library": functools.partial(sparse_attention, q, k, v, layout, scale=scale)}
    for variant in FLAGS.variants:
        out, lse = gluon_forward(q, k, v, meta, grid, True, scale, variant)
        torch.cuda.synchronize()
        err_o = float((out.float() - ref.float()).abs().max())
        err_l = float((lse[fin] - ref_lse[fin]).abs().max())
        inf_ok = bool(torch.equal(torch.isfinite(lse), fin))
        rec[f"check_{variant}"] = {"max_abs_out": err_o, "max_abs_lse": err_l,
                                   "lse_inf_match": inf_ok,
                                   "ok": err_o < 0.02 and err_l < 1e-2 and inf_ok}
        fns[variant] = functools.partial(gluon_forward, q, k, v, meta, grid, True, scale,
                                         variant)
    if spec == "causal":
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale)
        fns["cudnn"] = cudnn
    times = {name: [] for name in fns}
    host = {name: [] for name in fns}
    for _ in range(FLAGS.rounds):
        for name, fn in fns.items():
            times[name].append(triton.testing.do_bench(fn, warmup=50, rep=200))
            # Host time to enqueue a call (50 calls, no sync inside): where it exceeds the
            # kernel's time, do_bench's reading is the host's, not the GPU's.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            host[name].append((time.perf_counter() - t0) / 50 * 1e6)
            torch.cuda.synchronize()
    rec["ms"] = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    rec["host_us"] = {name: sorted(t)[len(t) // 2] for name, t in host.items()}
    flops = 4.0 * d * h * b * float(layout.density) * n * n
    rec["tflops"] = {name: flops / ms * 1e-9 for name, ms in rec["ms"].items()}
    return rec


def main(argv):
    del argv
    if FLAGS.compile_only:
        _compile_only()
        return
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415

    torch.manual_seed(0)
    h, d = FLAGS.heads, FLAGS.head_dim
    h_kv = FLAGS.kv_heads or h

    @functools.cache
    def inputs(n):  # q, k, v of one length, shared by its patterns
        q = torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, h_kv, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, h_kv, n, d, device="cuda", dtype=torch.bfloat16)
        return q, k, v

    run_cases(lambda spec, n: _measure(spec, *inputs(n)), FLAGS.seq_lens, FLAGS.patterns,
              FLAGS.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "triton": triton.__version__})


if __name__ == "__main__":
    app.run(main)
