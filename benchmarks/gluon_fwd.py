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
* ``ws3pp_k64`` / ``ws6pp_k64``: the library's kernel in 64-key steps at head dim 128 (what a
  64-key step costs against a 128-key one); ``ws3pp_pairs``: the library's kernel packing half
  entries two to a step (``PAIRS``), on any layout.
* ``portable`` (the portable forward), ``library`` (``sparse_attention`` as users call it, with
  its dispatch) and, on causal, cuDNN.

Measured and removed (KERNEL_NOTES, "Session 25"; their code is at commit a8a9c72): a
persistent form of the library's kernel (``p3pp``, ``p2pp``) and half-tile steps (``h4pp``,
``h6pp``); (KERNEL_NOTES, "Session 35"; branch ``lead/fwd-half-loop``) half entries as a
second loop of 64-key steps before the whole tiles. ``base_ws3pp_pairs``: the base commit's
kernel with its half entries paired, beside ``ws3pp_pairs``.

Run on a Hopper GPU::

    PYTHONPATH=$PWD python benchmarks/gluon_fwd.py --out=/tmp/gluon_fwd.json

Another commit's library kernel beside this one's (``base_ws3pp`` against ``ws3pp``)::

    git show REV:sparsetp/kernels/hopper.py > /tmp/base_hopper.py
    PYTHONPATH=$PWD python benchmarks/gluon_fwd.py --base_hopper=/tmp/base_hopper.py \
        --variants=base_ws3pp,ws3pp

Compile for sm_90 without a GPU (Triton 3.6 beside the local one, as ``ptx_probe.py``)::

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/gluon_fwd.py --compile_only
"""

from __future__ import annotations

import functools
import json
import time

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
flags.DEFINE_list("variants", ["ws3pp"], "kernel variants (VARIANTS)")
flags.DEFINE_list("patterns", ["causal", "window:1024", "bigbird", "strided_causal",
                               "per_head_mix"],
                  "bench patterns (sparsetp.bench.attention), or documents "
                  "(gluon_tools.lab_pattern)")
flags.DEFINE_list("seq_lens", ["8192", "32768"], "N")
flags.DEFINE_integer("heads", 16, "H")
flags.DEFINE_integer("kv_heads", 0, "H_kv (0: H)")
flags.DEFINE_integer("head_dim", 128, "D")
flags.DEFINE_integer("rounds", 3, "interleaved timing rounds")
flags.DEFINE_string("out", None, "write the records here as JSON")
flags.DEFINE_string("base_hopper", None, "another commit's sparsetp/kernels/hopper.py (`git "
                    "show REV:sparsetp/kernels/hopper.py > FILE`), for the base_ variants")

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
        s = _masked_scores(s, 0, n_partial, q_mask_id, row, stride_ik, masks, stride_mu,
                           stride_mr, stride_mw, 0, 0, s_layout, BLOCK_M, BLOCK_N)
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
        s = _masked_scores(s, e, n_partial, q_mask_id, row, stride_ik, masks, stride_mu,
                           stride_mr, stride_mw, 0, 0, s_layout, BLOCK_M, BLOCK_N)
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
    # The library's kernel walking 64-key steps (K/V boxes of 64 rows, its head dim 256 form)
    # at any head dim: what a 64-key step costs against half a 128-key one.
    "ws3pp_k64": ("_attn_fwd_kernel_sm90", BLOCK // 2, {"STAGES": 3, **_WS, "PINGPONG": True},
                  hopper.NUM_WARPS),
    "ws6pp_k64": ("_attn_fwd_kernel_sm90", BLOCK // 2, {"STAGES": 6, **_WS, "PINGPONG": True},
                  hopper.NUM_WARPS),  # as many K/V bytes in flight as ws3pp
    # The library's kernel computing the half entries (BlockLayout.q_halves) two to a step,
    # what it compiles where BlockLayout.skip_halves holds, on any layout.
    "ws3pp_pairs": ("_attn_fwd_kernel_sm90", BLOCK // 2,
                {"STAGES": 3, **_WS, "PINGPONG": True, "PAIRS": True}, hopper.NUM_WARPS),
    # The library's kernel as in --base_hopper (another commit's), beside this checkout's.
    "base_ws3pp": ("base:_attn_fwd_kernel_sm90", BLOCK // 2,
                   {"STAGES": 3, **_WS, "PINGPONG": True}, hopper.NUM_WARPS),
    "base_ws3pp_pairs": ("base:_attn_fwd_kernel_sm90", BLOCK // 2,
                         {"STAGES": 3, **_WS, "PINGPONG": True, "PAIRS": True},
                         hopper.NUM_WARPS),
}


# K/V rows per TMA box where not a whole tile (BLOCK).
KV_ROWS = {"ws3pp_k64": BLOCK // 2, "ws6pp_k64": BLOCK // 2, "ws3pp_pairs": BLOCK // 2,
           "base_ws3pp_pairs": BLOCK // 2}


def _kernel(name):
    if name.startswith("base:"):
        if not FLAGS.base_hopper:
            raise ValueError("base_ variants need --base_hopper")
        return getattr(base_module(FLAGS.base_hopper), name[len("base:"):])
    return globals()[name] if name in globals() else getattr(hopper, name)


def _launch_args(q, k, v, meta, scale, out, lse, variant):
    """The kernel arguments of ``variant``: its TMA boxes (query rows, K/V rows) and the lists."""
    q_rows, kv_rows = VARIANTS[variant][1], KV_ROWS.get(variant, BLOCK)
    h, n = q.shape[1], q.shape[2]
    h_kv, n_kv = k.shape[1], k.shape[2]
    arrays, strides = list_args(meta)
    kernel = _kernel(VARIANTS[variant][0])
    if "q_halves" in kernel.arg_names:
        arrays = (*arrays, meta["q_halves"], meta["mask_quarters"])
    descs = (tma_desc(q, q_rows), tma_desc(k, kv_rows), tma_desc(v, kv_rows))
    out_descs, out_ptrs = output_args(kernel, {"o": (out, q_rows)})
    return (*descs, *out_descs, *arrays, scale * 1.4426950408889634, n, n_kv, h, h // h_kv, h_kv,
            *strides, *out_ptrs, lse)


def _constexprs(variant) -> dict:
    """``variant``'s constexprs, with ``PAIRS`` off where its kernel takes one it does not
    set (a base commit's kernel may predate it)."""
    consts = VARIANTS[variant][2]
    if "PAIRS" in _kernel(VARIANTS[variant][0]).arg_names:
        return {"PAIRS": False, **consts}
    return consts


def gluon_forward(q, k, v, meta, grid, ordered, scale, variant="plain"):
    """Out, LSE of a Gluon forward variant (torch CUDA tensors; ``meta`` the layout's arrays on
    the device; ``grid`` and ``ordered`` as the portable kernel's launch)."""
    import torch  # noqa: PLC0415

    name, _, _, warps = VARIANTS[variant]
    consts = _constexprs(variant)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    _kernel(name)[grid](*_launch_args(q, k, v, meta, scale, out, lse, variant),
                          ORDERED=ordered, **consts, num_warps=warps)
    return out, lse


def _compile_only():
    """Compile each variant for sm_90 with CPU stand-ins for the tensors; print registers,
    spills, shared memory and instruction counts."""
    q, stats, meta = stand_ins(BLOCK, FLAGS.head_dim)
    for variant in FLAGS.variants:
        name, _, _, warps = VARIANTS[variant]
        consts = _constexprs(variant)
        args = _launch_args(q, q, q, meta, 0.1, q, stats, variant)
        prof = sm90_profile(_kernel(name), args, {"ORDERED": True, **consts}, warps)
        print(json.dumps({"variant": variant, **prof}))


def _measure(spec, q, k, v) -> dict:
    """Check every variant against the portable forward on one case, then time them (and the
    library's default dispatch, and cuDNN on causal) in interleaved rounds."""
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415

    from sparsetp.core import make_layout  # noqa: PLC0415
    from sparsetp.kernels import schedule  # noqa: PLC0415
    from sparsetp.kernels.options import launch_options  # noqa: PLC0415
    from sparsetp.torch import forward_kernel, sparse_attention  # noqa: PLC0415

    b, h, n, d = q.shape
    scale = d ** -0.5
    layout = make_layout(lab_pattern(spec, n, BLOCK, h), n, h, BLOCK)
    meta = {key: torch.from_numpy(val.copy()).cuda() for key, val in layout.metadata().items()}
    q_group, _ = schedule.head_groups(layout)
    grid = schedule.list_grid(b, h, n // BLOCK,
                              schedule.grid_group({"q_head_group": q_group}, "q", b, h))
    rec = {"pattern": spec, "N": n, "H": h, "H_kv": k.shape[1], "D": d,
           "density": float(layout.density), "grid": list(grid),
           "dispatch": forward_kernel(q, k, v, layout).name}

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
