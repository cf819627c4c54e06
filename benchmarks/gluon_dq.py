"""A Gluon dQ for Hopper (sm_90), the first backward kernel in the forward's schedule. Lab
variant: compiled for sm_90 here, **not yet run on a GPU** (KERNEL_NOTES, "Session 21").

Question (issue #34, backward at 0.61-0.76 of FA4): does the forward's warp-specialised
schedule carry over to the deterministic dQ pass? Per query tile of 128 rows (two consumer
warpgroups of 64, as the sm_90 forward), a producer warp loads Q and dO once and the listed K/V
tiles by TMA into a 2-stage ring; each consumer computes Delta = rowsum(dO * O) (and stores it
for dK/dV, as the portable dQ does), then per key tile, in two 64-key halves (the register
budget: S and dP of 64 x 64 fp32, the dQ accumulator 64 x 128, dS as an MMA operand):
S = Q K^T and dP = dO V^T (asynchronous MMAs), P = exp2(S * qk_scale - LSE2), dS = P (dP -
Delta), dQ += dS K. No softmax/MMA overlap or ping-pong yet: first correctness and resources.

Compile for sm_90 without a GPU (Triton 3.6 beside the local one, as ``ptx_probe.py``)::

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/gluon_dq.py --compile_only

On a Hopper GPU: check against the portable backward's dQ and Delta, then time both::

    PYTHONPATH=$PWD python benchmarks/gluon_dq.py --out=/tmp/gluon_dq.json
"""

from __future__ import annotations

import json

from absl import app, flags
from gluon_tools import list_args, sm90_profile, stand_ins, tma_desc
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from sparsetp.kernels.hopper import _program

FLAGS = flags.FLAGS
flags.DEFINE_bool("compile_only", False, "compile for sm_90 here and report registers/shared")
flags.DEFINE_list("patterns", ["causal", "window:1024", "bigbird", "strided_causal"],
                  "bench patterns (sparsetp.bench.attention)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_integer("heads", 16, "H")
flags.DEFINE_integer("rounds", 3, "interleaved timing rounds")
flags.DEFINE_string("out", None, "write the records here as JSON")

BLOCK = 128
STAGES = gl.constexpr(2)  # Q and dO (64 KB) + 2 x 64 KB of K, V: 192 KB of shared memory
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _dq_loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qd_bar,
               k_ready, v_ready, kv_empty, q_index, row, count, q_row0, kv_row0, stride_ik):
    """Producer warp: both halves of Q and dO once, then the listed K/V tiles (ring)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    NSTAGE: gl.constexpr = k_smem.shape[0]
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(qd_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [q_row0 + i * SUB_M, 0], qd_bar, q_smem.index(i))
        tma.async_copy_global_to_shared(do_desc, [q_row0 + i * SUB_M, 0], qd_bar,
                                        do_smem.index(i))
    for e in range(count):
        s = e % NSTAGE
        mbarrier.wait(kv_empty.index(s), ((e // NSTAGE) & 1) ^ 1)
        r = kv_row0 + gl.load(q_index + row + e * stride_ik) * BLOCK_N
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [r, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [r, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _masked_half(s, e, h, n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu,
                 stride_mr, stride_mw, N_KV, row0, s_layout: gl.constexpr, ROWS: gl.constexpr,
                 HALF_N: gl.constexpr):
    """Scores of keys ``[h * HALF_N, +HALF_N)`` of list entry ``e``'s tile, -inf where not
    allowed (the partial tile's bitmask, keys past N_KV)."""
    kb = gl.load(q_index + row + e * stride_ik)
    c = h * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))
    cols = kb * (2 * HALF_N) + c
    if e < n_partial:
        mid = gl.load(q_mask_id + row + e * stride_ik)
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        words = gl.load(masks + mid * stride_mu + rows[:, None] * stride_mr
                        + (c[None, :] // 32) * stride_mw)
        ok = (((words >> (c[None, :] % 32)) & 1) != 0) & (cols[None, :] < N_KV)
        s = gl.where(ok, s, float("-inf"))
    elif kb * (2 * HALF_N) + 2 * HALF_N > N_KV:
        s = gl.where(cols[None, :] < N_KV, s, float("-inf"))
    return s


@gluon.jit
def _dq_consumer(HALF: gl.constexpr, q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready,
                 kv_empty, count, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                 stride_mu, stride_mr, stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh,
                 Out, LSE, DQ, Delta):
    """Consumer warpgroup: dQ of rows ``[HALF * 64, +64)`` of the query tile."""
    SUB_M: gl.constexpr = q_smem.shape[1]
    NSTAGE: gl.constexpr = k_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HALF_N: gl.constexpr = BLOCK_N // 2
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte rows
    row0 = HALF * SUB_M
    base = (off_bh * N).to(gl.int64)
    rows_t = start_m * 2 * SUB_M + row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, tile))
    cols_t = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, tile))
    o = gl.load(Out + base * HEAD_DIM + rows_t[:, None] * HEAD_DIM + cols_t[None, :])
    mbarrier.wait(qd_bar, 0)
    q = q_smem.index(HALF)
    do = do_smem.index(HALF)
    # Delta = rowsum(dO * O) in fp32 (the portable dQ's, without an LSE cotangent).
    delta_t = gl.sum(do.load(tile).to(gl.float32) * o.to(gl.float32), 1)
    gl.store(Delta + base + rows_t, delta_t)
    delta = gl.convert_layout(delta_t, row_s)
    rows_s = start_m * 2 * SUB_M + row0 + gl.arange(0, SUB_M, layout=row_s)
    lse = gl.load(LSE + base + rows_s)
    # Base-2 LSE; rows with no key get +inf, so P = exp2(s - inf) = 0 and their dQ is 0.
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    s_zero = gl.zeros([SUB_M, HALF_N], gl.float32, layout=s_layout)
    dq = gl.zeros([SUB_M, HEAD_DIM], gl.float32, layout=dq_layout)
    for e in range(count):
        st = e % NSTAGE
        mbarrier.wait(k_ready.index(st), (e // NSTAGE) & 1)
        mbarrier.wait(v_ready.index(st), (e // NSTAGE) & 1)
        for h in gl.static_range(2):
            k_h = k_smem.index(st).slice(h * HALF_N, HALF_N, dim=0)
            v_h = v_smem.index(st).slice(h * HALF_N, HALF_N, dim=0)
            s_tok = warpgroup_mma(q, k_h.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do, v_h.permute((1, 0)), s_zero, use_acc=False,
                                   is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
            s = _masked_half(s, e, h, n_partial, q_index, q_mask_id, row, stride_ik, masks,
                             stride_mu, stride_mr, stride_mw, N_KV, row0, s_layout, SUB_M,
                             HALF_N)
            p = gl.exp2(s * qk_scale - lse2[:, None])
            dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
            ds = p * (dp - delta[:, None])
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_layout), k_h, dq)
        mbarrier.arrive(kv_empty.index(st), count=1)
    # dS is the gradient w.r.t. the natural-log scaled scores: scale, not qk_scale.
    dq = dq * scale
    rows_o = start_m * 2 * SUB_M + row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, dq_layout))
    cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dq_layout))
    gl.store(DQ + base * HEAD_DIM + rows_o[:, None] * HEAD_DIM + cols_o[None, :], dq.to(dtype))


@gluon.jit
def _dq_consumer0(q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty, count,
                  n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
                  stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, Out, LSE, DQ, Delta):
    _dq_consumer(0, q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty, count,
                 n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
                 stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, Out, LSE, DQ, Delta)


@gluon.jit
def _dq_consumer1(q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty, count,
                  n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
                  stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, Out, LSE, DQ, Delta):
    _dq_consumer(1, q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty, count,
                 n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
                 stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, Out, LSE, DQ, Delta)


@gluon.jit
def _attn_bwd_dq_kernel_sm90(q_desc, do_desc, k_desc, v_desc,
                             q_count, q_partial, q_index, q_mask_id, masks, q_order,
                             qk_scale, scale, N, N_KV, H, GROUP, H_KV,
                             stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
                             stride_mu, stride_mr, stride_mw,
                             Out, LSE, DQ, Delta,
                             ORDERED: gl.constexpr, num_warps: gl.constexpr):
    """dQ and Delta as the portable dQ kernel (no LSE cotangent), on sm_90. q_desc, do_desc:
    TMA boxes of 64 rows of ``[B * H * N, D]``; k_desc, v_desc: 128 rows of ``[B * H_kv *
    N_KV, D]``; Out, DQ ``[B, H, N, D]`` and LSE, Delta ``[B, H, N]`` contiguous; N, N_KV
    multiples of 128. One program per (query tile, b, h)."""
    SUB_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    start_m, off_bh = _program(q_order, stride_ch, stride_cm, H, gl.cdiv(N, 2 * SUB_M), ORDERED)
    off_b = off_bh // H
    off_h = off_bh % H
    q_row0 = off_bh * N + start_m * 2 * SUB_M
    kv_row0 = (off_b * H_KV + off_h // GROUP) * N_KV
    count = gl.load(q_count + off_h * stride_ch + start_m * stride_cm)
    n_partial = gl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
    row = off_h * stride_ih + start_m * stride_im
    q_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, SUB_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    qd_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qd_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    cargs = (q_smem, do_smem, k_smem, v_smem, qd_bar, k_ready, v_ready, kv_empty, count,
             n_partial, q_index, q_mask_id, row, stride_ik, masks, stride_mu, stride_mr,
             stride_mw, qk_scale, scale, N, N_KV, start_m, off_bh, Out, LSE, DQ, Delta)
    gl.warp_specialize([
        (_dq_consumer0, cargs),
        (_dq_consumer1, cargs),
        (_dq_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qd_bar,
                      k_ready, v_ready, kv_empty, q_index, row, count, q_row0, kv_row0,
                      stride_ik)),
    ], [4, 1], [232, 24])


def _launch_args(q, k, v, d_out, out, lse, meta, scale, dq, delta):
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    arrays, strides = list_args(meta)
    return (tma_desc(q, BLOCK // 2), tma_desc(d_out, BLOCK // 2), tma_desc(k, BLOCK),
            tma_desc(v, BLOCK), *arrays, scale * 1.4426950408889634, scale, n, n_kv, h,
            h // h_kv, h_kv, *strides, out, lse, dq, delta)


def _compile_only():
    """Compile for sm_90 with CPU stand-ins; print registers, spills, shared memory."""
    q, stats, meta = stand_ins(BLOCK)
    args = _launch_args(q, q, q, q, q, stats, meta, 0.1, q, stats)
    print(json.dumps(sm90_profile(_attn_bwd_dq_kernel_sm90, args, {"ORDERED": True}, 4)))


def _measure(spec, q, k, v, d_out):
    """Check dQ and Delta against the portable backward's, then time both dQ passes."""
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415

    from sparsetp.backends.torch import attention as tattn  # noqa: PLC0415
    from sparsetp.bench.attention import bench_pattern  # noqa: PLC0415
    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels import schedule  # noqa: PLC0415
    from sparsetp.kernels.options import launch_options  # noqa: PLC0415

    b, h, n, d = q.shape
    scale = d ** -0.5
    layout = make_layout(bench_pattern(spec, n, BLOCK, h).pattern, n, h, BLOCK)
    meta = {key: torch.from_numpy(val.copy()).cuda() for key, val in layout.metadata().items()}
    q_group, _ = schedule.head_groups(layout)
    grid = schedule.list_grid(b, h, n // BLOCK,
                              schedule.grid_group({"q_head_group": q_group}, "q", b, h))
    with launch_options(fwd_kernel="portable"):
        out, lse = tattn._forward(q, k, v, layout, scale)
        ref_dq, _, _ = tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)

    def gluon_dq():
        dq = torch.empty_like(q)
        delta = torch.empty_like(lse)
        _attn_bwd_dq_kernel_sm90[grid](
            *_launch_args(q, k, v, d_out, out, lse, meta, scale, dq, delta), ORDERED=True,
            num_warps=4)
        return dq, delta

    dq, delta = gluon_dq()
    ref_delta = (out.float() * d_out.float()).sum(-1)
    rec = {"pattern": spec, "N": n, "max_abs_dq": float((dq.float() - ref_dq.float()).abs().max()),
           "max_abs_delta": float((delta - ref_delta).abs().max())}

    def portable_bwd():
        with launch_options(fwd_kernel="portable"):
            return tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)

    times = {"gluon_dq": [], "portable_dq_dkdv": []}
    for _ in range(FLAGS.rounds):
        times["gluon_dq"].append(triton.testing.do_bench(gluon_dq, warmup=25, rep=200))
        times["portable_dq_dkdv"].append(triton.testing.do_bench(portable_bwd, warmup=25,
                                                                 rep=200))
    rec["ms"] = {k_: sorted(t)[len(t) // 2] for k_, t in times.items()}
    return rec


def main(argv):
    del argv
    if FLAGS.compile_only:
        _compile_only()
        return
    import torch  # noqa: PLC0415

    torch.manual_seed(0)
    records = []
    for n in map(int, FLAGS.seq_lens):
        q, k, v, d_out = (torch.randn(1, FLAGS.heads, n, 128, device="cuda",
                                      dtype=torch.bfloat16) for _ in range(4))
        for spec in FLAGS.patterns:
            try:
                rec = _measure(spec, q, k, v, d_out)
            except Exception as exc:  # noqa: BLE001 (a failed case is recorded, not fatal)
                rec = {"pattern": spec, "N": n, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
