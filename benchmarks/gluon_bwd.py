"""The sm_90 backward in Gluon: the library's dQ pass with the dK/dV variants. Lab (KERNEL_NOTES,
"Session 22").

Question (issue #34 backward at 0.61-0.76 of FA4; #23 GQA and packed-document backward at
0.99-1.07 of FlexAttention): does the forward's warp-specialised schedule carry over to the
deterministic key-major pass (dK/dV, 61% of the portable backward)? Per key tile of 128 keys
and (b, kv head), one program: a producer warp loads K and V once and, for each query head of
the kv head's group in turn (GQA: a fixed order, no atomics), each listed query tile in two
64-row steps (Q and dO by TMA into a ring); two consumer warpgroups own 64 keys each and keep
their dK, dV accumulators (64 x 128 fp32) in registers. Two forms of the step:

* ``t`` (this file, rejected: it spills): transposed scores S^T = K Q^T [64 keys, 64 queries],
  P^T and dS^T as register operands of dV += P^T dO and dK += dS^T Q; ``DEFER`` waits for a
  step's dV/dK only after the next step's S^T and dP^T are issued;
* ``n`` (FA3's form, the library's ``_attn_bwd_dkdv_kernel_sm90``): S = Q K^T [64 queries,
  64 keys], P and dS through shared memory as transposed A operands; ``EARLY_DP`` issues dP
  with S.

Measured and removed (KERNEL_NOTES, "Session 25"; their code is at commit a8a9c72): a
dQ pass with each half's dQ MMA under the next half's mask and exp (``n2e+dq_async``).

One pass (form ``f``, KERNEL_NOTES "Session 26"): the ``n`` program also computes dQ (the two
consumers exchange their dS halves) and a writer warp adds it to a float32 accumulator by TMA,
in a fixed turn order per query tile (deterministic; each arm is run twice and compared
bitwise). ``w2d`` (swizzled 64 x 64 pieces into ``[B*H*N, D]``) and ``w2u`` (the same without
turns) were measured and lose to the two passes; ``w2f`` / ``w2fu`` store each piece in the
MMA fragment's order (``FRAG_BASES``: 128-bit shared stores, one TMA message a piece, FA3's
``dQaccum`` layout) and undo the order in the cast; compiled, not yet run. The arms that lost
in session 26 are at commit 17876f4.

Compile for sm_90 without a GPU (Triton 3.6 beside the local one)::

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/gluon_bwd.py --compile_only

On a Hopper GPU: check dQ, dK, dV against the portable backward, then time::

    PYTHONPATH=$PWD python benchmarks/gluon_bwd.py --out=/tmp/gluon_bwd.json
"""

from __future__ import annotations

import functools
import json

import triton
import triton.language as tl
from absl import app, flags
from gluon_tools import list_args, run_cases, sm90_profile, stand_ins, tma_desc
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sparsetp.kernels import hopper
from sparsetp.kernels.hopper import _dkdv_loader, _program

FLAGS = flags.FLAGS
flags.DEFINE_bool("compile_only", False, "compile for sm_90 here and report registers/shared")
flags.DEFINE_list("patterns", ["causal", "window:1024", "bigbird", "strided_causal"],
                  "bench patterns (sparsetp.bench.attention)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_list("variants", ["n2e"], "dK/dV variants (VARIANTS)")
flags.DEFINE_integer("heads", 16, "H")
flags.DEFINE_integer("kv_heads", 0, "H_kv (0: H)")
flags.DEFINE_integer("rounds", 3, "interleaved timing rounds")
flags.DEFINE_string("out", None, "write the records here as JSON")

BLOCK = 128
SUB = 64  # queries per step (one TMA box of Q and of dO)
LOG2E = gl.constexpr(1.4426950408889634)
# name: (ring stages of Q/dO steps, DEFER); K, V 64 KB + stages x 32 KB of shared memory
# name: (form, ring stages, DEFER for "t" / EARLY_DP for "n"); shared memory: K, V 64 KB +
# stages x 32 KB (+ 32 KB of P, dS in FA3's form "n", the library's kernel)
VARIANTS = {"s2": ("t", 2, False), "s3": ("t", 3, False), "s4": ("t", 4, False),
            "s3d": ("t", 3, True), "s4d": ("t", 4, True),
            "n2": ("n", 2, False), "n3": ("n", 3, False), "n3e": ("n", 3, True),
            "n2e": ("n", 2, True),
            # one pass (form "f"; KERNEL_NOTES "Session 26"): descending key lists with turns
            # and TMA tensor adds of swizzled pieces ("swz"); the same without turns (not
            # deterministic); the pieces in the MMA fragment's order, unswizzled ("frag")
            "w2d": ("f", 2, "swz"), "w2u": ("f", 2, "swzfree"),
            "w2f": ("f", 2, "frag"), "w2fu": ("f", 2, "fragfree")}
WRITER_REGS = gl.constexpr(40)  # the dQ writer warp: loop counters, addresses


@gluon.jit
def _scores_t(s, e, sub, n_partial, k_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
              stride_mw, key0, s_layout: gl.constexpr, KEYS: gl.constexpr,
              SUB_M: gl.constexpr):
    """Transposed scores [KEYS keys, SUB_M queries] of list entry ``e``'s step ``sub``, -inf
    where the partial tile's bitmask (rows queries, bits keys) disallows the pair."""
    if e < n_partial:
        mid = gl.load(k_mask_id + row + e * stride_ik)
        c = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        r = sub * SUB_M + gl.arange(0, SUB_M, layout=gl.SliceLayout(0, s_layout))
        words = gl.load(masks + mid * stride_mu + r[None, :] * stride_mr
                        + (c[:, None] // 32) * stride_mw)
        s = gl.where(((words >> (c[:, None] % 32)) & 1) != 0, s, float("-inf"))
    return s


@gluon.jit
def _dkdv_consumer(HALF: gl.constexpr, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready,
                   q_empty, defer, k_count, k_partial, k_index, k_mask_id, masks, stride_ch,
                   stride_cm, stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw,
                   qk_scale, scale, N, H, GROUP, off_b, off_g, start_n, kv_row0, LSE, Delta,
                   DK, DV):
    """Consumer warpgroup: dK, dV of keys ``[HALF * 64, +64)`` of the key tile."""
    DEFER: gl.constexpr = defer.shape[0] == 2
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
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    key0: gl.constexpr = HALF * KEYS
    k_h = k_smem.slice(key0, KEYS, dim=0)
    v_h = v_smem.slice(key0, KEYS, dim=0)
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
        for e in range(count):
            qb = gl.load(k_index + row + e * stride_ik)
            for sub in gl.static_range(2):
                st = t % NSTAGE
                cols = qb * (2 * SUB_M) + sub * SUB_M + gl.arange(0, SUB_M, layout=col_s)
                mbarrier.wait(q_ready.index(st), (t // NSTAGE) & 1)
                qs = q_smem.index(st)
                dos = do_smem.index(st)
                s_tok = warpgroup_mma(k_h, qs.permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                dp_tok = warpgroup_mma(v_h, dos.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                if DEFER:
                    # The previous step's dV/dK (issued before S^T) finish with S^T.
                    s, dv, dk = warpgroup_mma_wait(1, deps=(s_tok, dv, dk))
                    if t > 0:
                        mbarrier.arrive(q_empty.index((t - 1) % NSTAGE), count=1)
                else:
                    s = warpgroup_mma_wait(1, deps=(s_tok, ))
                s = _scores_t(s, e, sub, n_partial, k_mask_id, row, stride_ik, masks,
                              stride_mu, stride_mr, stride_mw, key0, s_layout, KEYS, SUB_M)
                # Rows with no key (LSE -inf) get +inf: P = 0 and no gradient. Loaded late:
                # a column vector costs 16 registers a thread in this layout.
                lse = gl.load(LSE + stats + cols)
                lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
                p = gl.exp2(s * qk_scale - lse2[None, :])
                dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
                # dS^T before either MMA is issued: an issued MMA pins its register operand
                # until it completes, and the fp32 P^T and dP^T must be dead by then.
                ds = p * (dp - gl.load(Delta + stats + cols)[None, :])
                p_op = gl.convert_layout(p.to(dtype), op_layout)
                ds_op = gl.convert_layout(ds.to(dtype), op_layout)
                dv = warpgroup_mma(p_op, dos, dv, is_async=True)
                dk = warpgroup_mma(ds_op, qs, dk, is_async=True)
                if DEFER:
                    # Both stay in flight (two groups outstanding): this wait only gives the
                    # loop-carried values their tensor type; the next step's first wait ends them.
                    dv, dk = warpgroup_mma_wait(2, deps=(dv, dk))
                else:
                    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                    mbarrier.arrive(q_empty.index(st), count=1)
                t += 1
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    if DEFER:
        if t > 0:
            mbarrier.arrive(q_empty.index((t - 1) % NSTAGE), count=1)
    # dS is the gradient w.r.t. the natural-log scaled scores: scale, not qk_scale.
    dk = dk * scale
    rows = kv_row0 + key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    cols_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offs = rows.to(gl.int64)[:, None] * HEAD_DIM + cols_d[None, :]
    gl.store(DK + offs, dk.to(dtype))
    gl.store(DV + offs, dv.to(dtype))


@gluon.jit
def _dkdv_consumer0(q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, defer, k_count,
                    k_partial, k_index, k_mask_id, masks, stride_ch, stride_cm, stride_ih,
                    stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, scale, N,
                    H, GROUP, off_b, off_g, start_n, kv_row0, LSE, Delta, DK, DV):
    _dkdv_consumer(0, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, defer,
                   k_count, k_partial, k_index, k_mask_id, masks, stride_ch, stride_cm,
                   stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale,
                   scale, N, H, GROUP, off_b, off_g, start_n, kv_row0, LSE, Delta, DK, DV)


@gluon.jit
def _dkdv_consumer1(q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, defer, k_count,
                    k_partial, k_index, k_mask_id, masks, stride_ch, stride_cm, stride_ih,
                    stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, scale, N,
                    H, GROUP, off_b, off_g, start_n, kv_row0, LSE, Delta, DK, DV):
    _dkdv_consumer(1, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, defer,
                   k_count, k_partial, k_index, k_mask_id, masks, stride_ch, stride_cm,
                   stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale,
                   scale, N, H, GROUP, off_b, off_g, start_n, kv_row0, LSE, Delta, DK, DV)


@gluon.jit
def _attn_bwd_dkdv_kernel_sm90(q_desc, do_desc, k_desc, v_desc,
                               k_count, k_partial, k_index, k_mask_id, masks, k_order,
                               qk_scale, scale, N, N_KV, H, GROUP,
                               stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                               stride_mu, stride_mr, stride_mw,
                               LSE, Delta, DK, DV,
                               ORDERED: gl.constexpr, STAGES: gl.constexpr,
                               DEFER: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV as the portable dK/dV kernel, on sm_90. q_desc, do_desc: TMA boxes of 64 rows of
    ``[B * H * N, D]``; k_desc, v_desc: 128 rows of ``[B * H_kv * N_KV, D]``; LSE, Delta
    ``[B, H, N]`` and DK, DV ``[B, H_kv, N_KV, D]`` contiguous; N, N_KV multiples of 128. One
    program per (key tile, b, kv head)."""
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    H_KV = H // GROUP
    start_n, off_bh = _program(k_order, stride_ch, stride_cm, H_KV, gl.cdiv(N_KV, BLOCK_N),
                               GROUP, ORDERED)
    off_b = off_bh // H_KV
    off_g = off_bh % H_KV
    kv_row0 = off_bh * N_KV + start_n * BLOCK_N
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Carries DEFER across the partition boundary as its length (constexprs do not cross it).
    defer = gl.allocate_shared_memory(gl.int64, [2 if DEFER else 1, 1],
                                      mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    cargs = (q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, q_empty, defer, k_count,
             k_partial, k_index, k_mask_id, masks, stride_ch, stride_cm, stride_ih, stride_im,
             stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, scale, N, H, GROUP, off_b,
             off_g, start_n, kv_row0, LSE, Delta, DK, DV)
    gl.warp_specialize([
        (_dkdv_consumer0, cargs),
        (_dkdv_consumer1, cargs),
        (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                        kv_bar, q_ready, q_empty, k_count, k_index, stride_ch, stride_cm,
                        stride_ih, stride_im, stride_ik, N, H, GROUP, off_b, off_g, start_n,
                        kv_row0)),
    ], [4, 1], [232, 24])


# The one-pass backward's dQ pieces in the MMA fragment's order ("frag"): offset bit -> (step
# slot, row, column) of a consumer's [64 queries, 64 columns] float32 piece. Bits 0-1 are a
# thread's four values (its column pair in two rows 8 apart), 2-6 its lane, 7-8 its warp and
# 9-11 the 8-column group, so each warp stores 512 contiguous bytes at a time.
FRAG_BASES = [[0, 1], [8, 0], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [16, 0], [32, 0], [0, 8],
              [0, 16], [0, 32]]
FRAG_LAYOUT = gl.constexpr(gl.SharedLinearLayout(offset_bases=FRAG_BASES))
FLAT_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                rank=2))
FRAG_ROWS = gl.constexpr(32)  # a piece seen as [32, 128] float32 rows for its TMA add


@gluon.jit
def _fused_consumer(HALF: gl.constexpr, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem,
                    kv_bar, q_ready, q_empty, ds_ready, k_count, k_index, k_mask_id, k_flag,
                    masks, stride_ch, stride_cm, stride_ih, stride_im, stride_ik, stride_mu,
                    stride_mr, stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g, start_n,
                    kv_row0, LSE, Delta, DK, DV, dq_smem0, dq_smem1, dq_full, dq_empty):
    """Consumer warpgroup of the one-pass backward: the library's dK/dV step (FA3's form,
    dP issued with S) for keys ``[HALF * 64, +64)``, then this step's dQ for head-dim columns
    ``[HALF * D/2, +D/2)`` from both consumers' dS (exchanged through shared memory in two
    slots, so the consumers step together), handed to the writer warp (:func:`_dq_writer`)
    in ``dq_smem<HALF>`` (in whichever layout that buffer has). ``k_flag``: nonzero for a
    partial tile, so the key lists may come in any order."""
    NSTAGE: gl.constexpr = q_smem.shape[0]
    SUB_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    KEYS: gl.constexpr = k_smem.shape[0] // 2
    DQ_COLS: gl.constexpr = dq_smem0.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    if HALF == 0:
        dq_mine = dq_smem0
    else:
        dq_mine = dq_smem1
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KEYS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    key0: gl.constexpr = HALF * KEYS
    k_h = k_smem.slice(key0, KEYS, dim=0)
    v_h = v_smem.slice(key0, KEYS, dim=0)
    k_lo = k_smem.slice(0, KEYS, dim=0).slice(HALF * DQ_COLS, DQ_COLS, dim=1)
    k_hi = k_smem.slice(KEYS, KEYS, dim=0).slice(HALF * DQ_COLS, DQ_COLS, dim=1)
    p_buf = p_smem.index(HALF)
    c = key0 + gl.arange(0, KEYS, layout=col_s)  # key within the tile
    s_zero = gl.zeros([SUB_M, KEYS], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([SUB_M, DQ_COLS], gl.float32, layout=dq_layout)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    t = 0
    for j in range(GROUP):
        h = off_g * GROUP + j
        count = gl.load(k_count + h * stride_ch + start_n * stride_cm)
        row = h * stride_ih + start_n * stride_im
        stats = (off_b * H + h).to(gl.int64) * N
        for e in range(count):
            qb = gl.load(k_index + row + e * stride_ik)
            mid = gl.load(k_mask_id + row + e * stride_ik)
            for sub in gl.static_range(2):
                st = t % NSTAGE
                slot = t % 2
                r = sub * SUB_M + gl.arange(0, SUB_M, layout=row_s)  # query within the tile
                lse = gl.load(LSE + stats + qb * (2 * SUB_M) + r)
                delta = gl.load(Delta + stats + qb * (2 * SUB_M) + r)
                mbarrier.wait(q_ready.index(st), (t // NSTAGE) & 1)
                qs = q_smem.index(st)
                dos = do_smem.index(st)
                s_tok = warpgroup_mma(qs, k_h.permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                dp_tok = warpgroup_mma(dos, v_h.permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_tok, ))
                if gl.load(k_flag + row + e * stride_ik) != 0:  # a partial tile
                    w_row = masks + mid * stride_mu + r * stride_mr + (key0 // 32) * stride_mw
                    w0 = gl.load(w_row)
                    w1 = gl.load(w_row + stride_mw)
                    word = gl.where(c[None, :] < key0 + 32, w0[:, None], w1[:, None])
                    s = gl.where(((word >> (c[None, :] % 32)) & 1) != 0, s, float("-inf"))
                lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
                p = gl.exp2(s * qk_scale - lse2[:, None])
                dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
                ds = p * (dp - delta[:, None])
                ds_mine = ds_smem.index(2 * slot + HALF)
                p_buf.store(p.to(dtype))
                ds_mine.store(ds.to(dtype))
                fence_async_shared()
                dv = warpgroup_mma(p_buf.permute((1, 0)), dos, dv, is_async=True)
                dk = warpgroup_mma(ds_mine.permute((1, 0)), qs, dk, is_async=True)
                # Both halves of this step's dS are in shared memory once both consumers
                # arrive; slot t % 2 is free again: the other consumer waited for its dQ
                # MMAs of step t - 2 before it arrived at step t - 1.
                mbarrier.arrive(ds_ready.index(slot), count=1)
                mbarrier.wait(ds_ready.index(slot), (t // 2) & 1)
                dq = warpgroup_mma(ds_smem.index(2 * slot), k_lo, dq_zero, use_acc=False,
                                   is_async=True)
                dq = warpgroup_mma(ds_smem.index(2 * slot + 1), k_hi, dq, is_async=True)
                dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
                mbarrier.arrive(q_empty.index(st), count=1)
                mbarrier.wait(dq_empty.index(HALF), (t & 1) ^ 1)  # the writer has read it
                dq_mine.store(dq)
                fence_async_shared()
                mbarrier.arrive(dq_full.index(HALF), count=1)
                t += 1
    dk = dk * scale
    rows = kv_row0 + key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    cols_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offs = rows.to(gl.int64)[:, None] * HEAD_DIM + cols_d[None, :]
    gl.store(DK + offs, dk.to(dtype))
    gl.store(DV + offs, dv.to(dtype))


@gluon.jit
def _fused_consumer0(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                     q_empty, ds_ready, k_count, k_index, k_mask_id, k_flag, masks, stride_ch,
                     stride_cm, stride_ih, stride_im, stride_ik, stride_mu, stride_mr,
                     stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g, start_n, kv_row0,
                     LSE, Delta, DK, DV, dq_smem0, dq_smem1, dq_full, dq_empty):
    _fused_consumer(0, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                    q_empty, ds_ready, k_count, k_index, k_mask_id, k_flag, masks, stride_ch,
                    stride_cm, stride_ih, stride_im, stride_ik, stride_mu, stride_mr,
                    stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g, start_n, kv_row0,
                    LSE, Delta, DK, DV, dq_smem0, dq_smem1, dq_full, dq_empty)


@gluon.jit
def _fused_consumer1(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                     q_empty, ds_ready, k_count, k_index, k_mask_id, k_flag, masks, stride_ch,
                     stride_cm, stride_ih, stride_im, stride_ik, stride_mu, stride_mr,
                     stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g, start_n, kv_row0,
                     LSE, Delta, DK, DV, dq_smem0, dq_smem1, dq_full, dq_empty):
    _fused_consumer(1, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready,
                    q_empty, ds_ready, k_count, k_index, k_mask_id, k_flag, masks, stride_ch,
                    stride_cm, stride_ih, stride_im, stride_ik, stride_mu, stride_mr,
                    stride_mw, qk_scale, scale, N, H, GROUP, off_b, off_g, start_n, kv_row0,
                    LSE, Delta, DK, DV, dq_smem0, dq_smem1, dq_full, dq_empty)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of shared ``src`` into global at ``coord`` (cp.reduce.async.bulk; Gluon
    3.6 builds the op but exports no function for it)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _bulk_wait_all(dummy):
    """Wait until this thread's bulk async groups have completed, writes included (Gluon's
    ``store_wait`` waits for their shared-memory reads only)."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tmov.u32 $0, $1;", "=r,r",
                                     [dummy], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_writer(dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, turns, k_count, k_index, k_turn,
               stride_ch, stride_cm, stride_ih, stride_im, stride_ik, N, H, GROUP, off_b, off_g,
               start_n, SEM):
    """Writer warp of the one-pass backward: per listed query tile, waits for this key tile's
    turn (the tile's semaphore in ``SEM`` reaches its rank among the row's key tiles in launch
    order), adds the four dQ pieces of its two steps (one per consumer and step) to the
    float32 accumulator by TMA, waits for them to land, then passes the turn on. ``turns`` of
    length 1: no turns (not deterministic; measures what the order costs). Of width 2
    (``FRAG``): each piece goes whole, in fragment order, to its own 16 KB of the accumulator
    (``[pieces * 32, 128]``); else to its 64 x D/2 block of ``[B * H * N, D]``."""
    TURNS: gl.constexpr = turns.shape[0] == 2
    FRAG: gl.constexpr = turns.shape[1] == 2
    SUB_M: gl.constexpr = dq_smem0.shape[0]
    DQ_COLS: gl.constexpr = dq_smem0.shape[1]
    T_Q = N // (2 * SUB_M)
    t = 0
    for j in range(GROUP):
        h = off_g * GROUP + j
        count = gl.load(k_count + h * stride_ch + start_n * stride_cm)
        row = h * stride_ih + start_n * stride_im
        q_row0 = (off_b * H + h) * N
        for e in range(count):
            qb = gl.load(k_index + row + e * stride_ik)
            target = gl.load(k_turn + row + e * stride_ik)
            sem = SEM + (off_b * H + h) * T_Q + qb
            if TURNS:
                while gl.atomic_add(sem, 0, sem="acquire") < target:
                    pass
            for sub in gl.static_range(2):
                for half in gl.static_range(2):
                    if half == 0:
                        src = dq_smem0
                    else:
                        src = dq_smem1
                    mbarrier.wait(dq_full.index(half), t & 1)
                    if FRAG:
                        piece = ((q_row0 // SUB_M + qb * 2 + sub) * 2 + half) * FRAG_ROWS
                        flat = src._reinterpret(gl.float32,
                                                [FRAG_ROWS, SUB_M * DQ_COLS // FRAG_ROWS],
                                                FLAT_LAYOUT)
                        _tma_reduce_add(dq_desc, [piece, 0], flat)
                    else:
                        _tma_reduce_add(dq_desc, [q_row0 + qb * (2 * SUB_M) + sub * SUB_M,
                                                  half * DQ_COLS], src)
                tma.store_wait(0)  # both pieces read out of shared memory
                for half in gl.static_range(2):
                    mbarrier.arrive(dq_empty.index(half), count=1)
                t += 1
            if TURNS:
                t = _bulk_wait_all(t)  # the adds have landed before the turn passes on
                gl.atomic_add(sem, 1, sem="release")


@gluon.jit
def _attn_bwd_fused_kernel_sm90(q_desc, do_desc, k_desc, v_desc,
                                k_count, k_index, k_mask_id, masks, k_order, k_turn, k_flag,
                                qk_scale, scale, N, N_KV, H, GROUP,
                                stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                                stride_mu, stride_mr, stride_mw,
                                LSE, Delta, DK, DV, dq_desc, SEM,
                                ORDERED: gl.constexpr, STAGES: gl.constexpr,
                                TURNS: gl.constexpr, FRAG: gl.constexpr,
                                num_warps: gl.constexpr):
    """dQ, dK, dV in one pass (FA3's deterministic form): the library's dK/dV program (one per
    key tile, b, kv head; the library's loader) whose consumers also compute each step's dQ,
    which a writer warp adds by TMA to the zeroed, unscaled float32 accumulator behind
    ``dq_desc`` in the fixed turn order ``k_turn`` (int32, shaped as ``k_index``), serialised
    by ``SEM`` (int32 ``[B, H, N / 128]``, zeroed). ``FRAG``: the accumulator holds each piece
    in fragment order (:data:`FRAG_BASES`; ``[pieces * 32, 128]``, boxes of 32 rows), else
    ``[B * H * N, D]`` (boxes of 64 x D/2). Delta comes from a preprocess, dQ from a cast."""
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(2 * SUB_M == BLOCK_N, "two 64-key consumers, 64-query steps")
    H_KV = H // GROUP
    start_n, off_bh = _program(k_order, stride_ch, stride_cm, H_KV, gl.cdiv(N_KV, BLOCK_N),
                               GROUP, ORDERED)
    off_b = off_bh // H_KV
    off_g = off_bh % H_KV
    kv_row0 = off_bh * N_KV + start_n * BLOCK_N
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, SUB_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    pl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                            rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, BLOCK_N // 2], pl)  # per consumer
    ds_smem = gl.allocate_shared_memory(dtype, [4, SUB_M, BLOCK_N // 2], pl)  # 2 slots x 2
    if FRAG:  # per consumer
        dq_smem0 = gl.allocate_shared_memory(gl.float32, [SUB_M, HEAD_DIM // 2], FRAG_LAYOUT)
        dq_smem1 = gl.allocate_shared_memory(gl.float32, [SUB_M, HEAD_DIM // 2], FRAG_LAYOUT)
    else:
        dq_smem0 = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape,
                                             dq_desc.layout)
        dq_smem1 = gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape,
                                             dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # The writer reads TURNS and FRAG off this buffer's shape (constexprs do not cross into
    # the partitions).
    turns = gl.allocate_shared_memory(gl.int64, [2 if TURNS else 1, 2 if FRAG else 1],
                                      gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    fence_async_shared()
    cargs = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty,
             ds_ready, k_count, k_index, k_mask_id, k_flag, masks, stride_ch, stride_cm,
             stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw, qk_scale, scale,
             N, H, GROUP, off_b, off_g, start_n, kv_row0, LSE, Delta, DK, DV, dq_smem0, dq_smem1,
             dq_full, dq_empty)
    gl.warp_specialize([
        (_fused_consumer0, cargs),
        (_fused_consumer1, cargs),
        (_dkdv_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem,
                        kv_bar, q_ready, q_empty, k_count, k_index, stride_ch, stride_cm,
                        stride_ih, stride_im, stride_ik, N, H, GROUP, off_b, off_g, start_n,
                        kv_row0)),
        (_dq_writer, (dq_desc, dq_smem0, dq_smem1, dq_full, dq_empty, turns, k_count, k_index,
                      k_turn, stride_ch, stride_cm, stride_ih, stride_im, stride_ik, N, H,
                      GROUP, off_b, off_g, start_n, SEM)),
    ], [4, 1, 1], [hopper.CONSUMER_REGS, hopper.PRODUCER_REGS, WRITER_REGS])


def _dkdv_launch(form: str, stages: int, flag: bool):
    """(kernel, constexprs) of a variant: "t" the transposed lab kernel above (flag: DEFER),
    "n" the library's FA3-form kernel (flag: EARLY_DP)."""
    if form == "t":
        return _attn_bwd_dkdv_kernel_sm90, {"STAGES": stages, "DEFER": flag}
    if form == "f":  # flag: "swz" / "frag", "free" for no turns
        return _attn_bwd_fused_kernel_sm90, {"STAGES": stages, "TURNS": "free" not in flag,
                                             "FRAG": flag.startswith("frag")}
    return hopper._attn_bwd_dkdv_kernel_sm90, {
        "STAGES": stages, "EARLY_DP": flag, "CONSUMER_REGS": hopper.CONSUMER_REGS,
        "PRODUCER_REGS": hopper.PRODUCER_REGS}


def _key_lists(meta) -> tuple:
    """The key-major list arguments (as :func:`gluon_tools.list_args` for the query side)."""
    kc, ki, mk = meta["k_count"], meta["k_index"], meta["masks"]
    return ((kc, meta["k_partial"], ki, meta["k_mask_id"], mk, meta["k_order"]),
            (*kc.stride(), *ki.stride(), *mk.stride()))


def _dkdv_args(q, k, v, d_out, lse, delta, meta, scale, dk, dv):
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    arrays, strides = _key_lists(meta)
    return (tma_desc(q, SUB), tma_desc(d_out, SUB), tma_desc(k, BLOCK), tma_desc(v, BLOCK),
            *arrays, scale * 1.4426950408889634, scale, n, n_kv, h, h // h_kv, *strides,
            lse, delta, dk, dv)


def _fused_args(q, k, v, d_out, lse, delta, meta, scale, dk, dv, dq_acc, sem, frag: bool):
    """The one-pass kernel's arguments (``meta`` with :func:`key_lists` and ``k_turn``);
    ``dq_acc`` float32, ``[B, H, N, D]`` or (``frag``) the same size in fragment order."""
    h, n, d = q.shape[1], q.shape[2], q.shape[3]
    h_kv, n_kv = k.shape[1], k.shape[2]
    kc, ki, mk = meta["k_count"], meta["k_index"], meta["masks"]
    acc = (tma_desc(dq_acc, FRAG_ROWS.value, width=128, layout=FLAT_LAYOUT.value) if frag
           else tma_desc(dq_acc, SUB, d // 2))
    return (tma_desc(q, SUB), tma_desc(d_out, SUB), tma_desc(k, BLOCK), tma_desc(v, BLOCK),
            kc, ki, meta["k_mask_id"], mk, meta["k_order"], meta["k_turn"], meta["k_flag"],
            scale * 1.4426950408889634, scale, n, n_kv, h, h // h_kv, *kc.stride(),
            *ki.stride(), *mk.stride(), lse, delta, dk, dv, acc, sem)


def key_lists(meta: dict) -> dict:
    """The key-major lists for the one-pass kernel, numpy: ``k_index``, ``k_mask_id`` with
    each key tile's entries in descending query-tile order (so that on a band the tile
    launched first reaches each row first: in the layout's order a window serialises) and
    ``k_flag`` (1 for a partial tile)."""
    import numpy as np  # noqa: PLC0415

    k_count, k_partial = meta["k_count"], meta["k_partial"]
    index, mask_id = meta["k_index"], meta["k_mask_id"]
    e = np.arange(index.shape[-1])
    flag = (e[None, None, :] < k_partial[:, :, None]).astype(np.int32)
    valid = e[None, None, :] < k_count[:, :, None]
    perm = np.argsort(np.where(valid, -index, np.iinfo(np.int32).max), axis=-1, kind="stable")
    index, mask_id, flag = (np.take_along_axis(a, perm, -1) for a in (index, mask_id, flag))
    return {**meta, "k_index": index, "k_mask_id": mask_id, "k_flag": flag}


def turn_list(meta: dict, group: int):
    """``k_turn`` (int32, shaped as ``k_index``) for the one-pass kernel: entry (h, j, e) is
    key tile j's rank among the key tiles of query row ``k_index[h, j, e]``, ranked by the
    position of their programs in the launch (the work order ``k_order`` of the kv head's row
    ``(h // group) * group``). Each tile adds after every tile launched before it, so a
    program only waits on programs that started before it. numpy in, numpy out.

    >>> from sparsetp.core import make_layout, patterns as P
    >>> turn_list(make_layout(P.causal(), 384, 1, 128).metadata(), 1)[0, :, :3].tolist()
    [[0, 0, 0], [1, 1, 0], [2, 0, 0]]
    """
    import numpy as np  # noqa: PLC0415

    k_count, k_index, k_order = meta["k_count"], meta["k_index"], meta["k_order"]
    q_count, q_index = meta["q_count"], meta["q_index"]
    heads, t_k = k_count.shape
    turn = np.zeros(k_index.shape, np.int32)
    for h in range(heads):
        launch_rank = np.argsort(k_order[(h // group) * group])  # tile -> its rank
        turn_of = np.full((q_count.shape[1], t_k), -1, np.int64)
        for i in range(q_count.shape[1]):
            keys = q_index[h, i, :q_count[h, i]]
            turn_of[i, keys[np.argsort(launch_rank[keys], kind="stable")]] = np.arange(len(keys))
        for j in range(t_k):
            rows = k_index[h, j, :k_count[h, j]]
            turn[h, j, :len(rows)] = turn_of[rows, j]
    assert (turn >= 0).all(), "a key list entry missing from its query row's list"
    return turn


def frag_offsets():
    """(row, column) within its 64 x 64 piece of each of the 4096 float32 values of a
    fragment-order piece (:data:`FRAG_BASES`), numpy int32 ``[2, 4096]``.

    >>> frag_offsets()[:, :5].tolist()
    [[0, 0, 8, 8, 0], [0, 1, 0, 1, 2]]
    """
    import numpy as np  # noqa: PLC0415

    o = np.arange(1 << len(FRAG_BASES))
    out = np.zeros((2, o.size), np.int32)
    for bit, (r, c) in enumerate(FRAG_BASES):
        on = (o >> bit) & 1
        out[0] += on * r
        out[1] += on * c
    return out


def _dq_args(q, k, v, d_out, out, lse, meta, scale, dq, delta):
    """The library's sm_90 dQ pass (no LSE cotangent: ``lse`` fills its slot, never read)."""
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    arrays, strides = list_args(meta)
    return (tma_desc(q, SUB), tma_desc(d_out, SUB), tma_desc(k, BLOCK), tma_desc(v, BLOCK),
            *arrays, scale * 1.4426950408889634, scale, n, n_kv, h, h // h_kv, h_kv, *strides,
            out, lse, lse, dq, delta)


@triton.jit
def _attn_delta_kernel(Out, DO, Delta, D: tl.constexpr, ROWS: tl.constexpr):
    """Delta = rowsum(dO * O) in float32 for ``ROWS`` rows of ``[rows, D]`` (the one-pass
    backward's preprocess; the two-pass dQ kernel computes it itself)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(Out + offs).to(tl.float32)
    do = tl.load(DO + offs).to(tl.float32)
    tl.store(Delta + r, tl.sum(o * do, 1))


@triton.jit
def _attn_dq_cast_kernel(ACC, DQ, scale, D: tl.constexpr, ROWS: tl.constexpr):
    """dQ = scale * the float32 accumulator, in dQ's dtype."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = r.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(DQ + offs, (tl.load(ACC + offs) * scale).to(DQ.dtype.element_ty))


@triton.jit
def _attn_dq_frag_cast_kernel(ACC, Rows, Cols, DQ, scale, D: tl.constexpr):
    """dQ = scale * the fragment-order accumulator, one 64 x 64 piece a program (piece p: rows
    ``(p // 2) * 64 + Rows`` of ``[B * H * N, D]``, columns ``(p % 2) * 64 + Cols``)."""
    p = tl.program_id(0)
    o = tl.arange(0, 4096)
    acc = tl.load(ACC + p.to(tl.int64) * 4096 + o)
    rows = (p // 2).to(tl.int64) * 64 + tl.load(Rows + o)
    cols = (p % 2) * 64 + tl.load(Cols + o)
    tl.store(DQ + rows * D + cols, (acc * scale).to(DQ.dtype.element_ty))


DQ_CONSTEXPRS = {"STAGES": hopper.DQ_STAGES, "HAS_DLSE": False,
                 "CONSUMER_REGS": hopper.CONSUMER_REGS, "PRODUCER_REGS": hopper.PRODUCER_REGS}


def _compile_only():
    """Compile the library's dQ pass and each dK/dV variant for sm_90 with CPU stand-ins;
    print registers, spills, shared memory."""
    q, stats, meta = stand_ins(BLOCK)
    prof = sm90_profile(hopper._attn_bwd_dq_kernel_sm90,
                        _dq_args(q, q, q, q, q, stats, meta, 0.1, q, stats),
                        {"ORDERED": True, **DQ_CONSTEXPRS}, hopper.NUM_WARPS)
    print(json.dumps({"kernel": "library dQ", **prof}))
    meta = {**meta, **{key.replace("q_", "k_"): val for key, val in meta.items()
                       if key.startswith("q_")}}
    fused_meta = {**meta, "k_turn": meta["k_index"], "k_flag": meta["k_index"]}
    for name in FLAGS.variants:
        kernel, constexprs = _dkdv_launch(*VARIANTS[name])
        if VARIANTS[name][0] == "f":
            args = _fused_args(q, q, q, q, stats, stats, fused_meta, 0.1, q, q, q.float(),
                               meta["k_index"], constexprs["FRAG"])
        else:
            args = _dkdv_args(q, q, q, q, stats, stats, meta, 0.1, q, q)
        prof = sm90_profile(kernel, args, {"ORDERED": True, **constexprs}, 4)
        print(json.dumps({"variant": name, **prof}))


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
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from sparsetp.backends.torch import attention as tattn  # noqa: PLC0415
    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels import schedule  # noqa: PLC0415
    from sparsetp.kernels.options import launch_options  # noqa: PLC0415
    from sparsetp.torch import backward_kernel  # noqa: PLC0415

    b, h, n, d = q.shape
    h_kv = k.shape[1]
    scale = d ** -0.5
    layout = make_layout(bench_pattern(spec, n, BLOCK, h).pattern, n, h, BLOCK)
    meta = {key: torch.from_numpy(val.copy()).cuda() for key, val in layout.metadata().items()}
    q_group, k_group = schedule.head_groups(layout)
    q_grid = schedule.list_grid(b, h, n // BLOCK,
                                schedule.grid_group({"q_head_group": q_group}, "q", b, h))
    kv_grid = schedule.list_grid(b, h_kv, n // BLOCK,
                                 schedule.grid_group({"k_head_group": k_group}, "k", b, h_kv))
    with launch_options(fwd_kernel="portable", bwd_kernel="portable"):
        out, lse = tattn._forward(q, k, v, layout, scale)
        ref = tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)

    lists = key_lists(layout.metadata())
    lists["k_turn"] = turn_list(lists, h // h_kv)
    fused_meta = {**meta, **{key: torch.from_numpy(np.ascontiguousarray(lists[key])).cuda()
                             for key in ("k_index", "k_mask_id", "k_flag", "k_turn")}}
    frag_rows, frag_cols = (torch.from_numpy(x).cuda() for x in frag_offsets())

    def fused_bwd(variant):  # preprocess (Delta), the one pass, dQ cast and scaled
        kernel, constexprs = _dkdv_launch(*VARIANTS[variant])
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        rows = out.numel() // d
        _attn_delta_kernel[(rows // SUB, )](out, d_out, delta, D=d, ROWS=SUB)
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        sem = torch.zeros((b, h, n // BLOCK), device=q.device, dtype=torch.int32)
        kernel[kv_grid](*_fused_args(q, k, v, d_out, lse, delta, fused_meta, scale, dk, dv,
                                     dq_acc, sem, constexprs["FRAG"]),
                        ORDERED=True, **constexprs, num_warps=4)
        dq = torch.empty_like(q)
        if constexprs["FRAG"]:
            _attn_dq_frag_cast_kernel[(rows // SUB * 2, )](dq_acc, frag_rows, frag_cols, dq,
                                                          scale, D=d)
        else:
            _attn_dq_cast_kernel[(rows // SUB, )](dq_acc, dq, scale, D=d, ROWS=SUB)
        return dq, dk, dv

    def gluon_bwd(variant):
        if VARIANTS[variant][0] == "f":
            return fused_bwd(variant)
        kernel, constexprs = _dkdv_launch(*VARIANTS[variant])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        hopper._attn_bwd_dq_kernel_sm90[q_grid](
            *_dq_args(q, k, v, d_out, out, lse, meta, scale, dq, delta), ORDERED=True,
            **DQ_CONSTEXPRS, num_warps=hopper.NUM_WARPS)
        kernel[kv_grid](*_dkdv_args(q, k, v, d_out, lse, delta, meta, scale, dk, dv),
                        ORDERED=True, **constexprs, num_warps=4)
        return dq, dk, dv

    def diffs(got):  # max abs difference of dq, dk, dv from the portable backward
        return {name: float((a.float() - r.float()).abs().max())
                for name, a, r in zip(("dq", "dk", "dv"), got, ref, strict=True)}

    rec = {"pattern": spec, "N": n, "H": h, "H_kv": h_kv, "check": {}}
    for variant in FLAGS.variants:
        got = gluon_bwd(variant)
        rec["check"][variant] = diffs(got)
        rec["check"][variant]["ref_max"] = max(float(r.float().abs().max()) for r in ref)
        again = gluon_bwd(variant)
        rec["check"][variant]["bitwise_repeat"] = all(
            bool(torch.equal(x, y)) for x, y in zip(got, again, strict=True))

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
    times = {name: [] for name in arms}
    for _ in range(FLAGS.rounds):
        for name, fn in arms.items():
            times[name].append(triton.testing.do_bench(fn, warmup=25, rep=200))
    rec["ms"] = {k_: sorted(t)[len(t) // 2] for k_, t in times.items()}
    rec["kernel_ms"] = {name: _kernel_ms(fn) for name, fn in arms.items()}
    return rec


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
