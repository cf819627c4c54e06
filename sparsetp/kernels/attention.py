"""Block-sparse flash attention: Triton sources for the forward and backward passes.

This module holds ``@triton.jit`` functions only; it imports neither torch nor jax, so the torch
frontend (``kernel[grid](...)``) and the JAX frontend (``jax_triton.triton_call``, or the
interpreter on CPU) launch the *same* kernel objects. The argument order of every kernel and the
default tile configs live in :mod:`sparsetp.kernels.launch`; read its docstring before calling a
kernel by hand.

Conventions shared by the four kernels
--------------------------------------
* Tensors are ``[B, H, N, D]`` with arbitrary strides (passed as ``stride_<tensor><dim>``);
  ``LSE`` and ``Delta`` are ``[B, H, N]`` float32 (float64 for float64 inputs).
* The grid is ``(num_tiles, B * H)``: program ``(i, b * H + h)`` owns query tile ``i`` (forward,
  dQ, preprocess) or key tile ``i`` (dK/dV) of batch ``b``, head ``h``.
* Block-sparse structure reaches the kernels as *tensors* (pointers + strides), never as
  constexprs: a new pattern with the same shapes reuses the compiled kernel. See the docstring of
  :mod:`sparsetp.core.layout`: per (head, tile) an ELL row lists ``count`` tiles, the first
  ``n_partial`` of which are partial (they carry a row of the ``masks`` bitmask table), the rest
  full (no element mask).
* The only constexprs are tile shape (``BLOCK`` = layout block size, ``HEAD_DIM``), the number of
  int32 mask words per tile row (``MASK_WORDS``), the tl.dot input precision and
  ``DOT_UPCAST`` (an interpreter-only bf16 workaround, see :func:`_dot`).
* Every kernel bounds its loads by ``N``: full tiles of the ragged last tile row/column carry no
  mask bits, so ``offs < N`` is always part of the validity mask.
* Softmax runs in fp32 (fp64 for fp64 inputs) in base 2: scores are multiplied by
  ``sm_scale * log2(e)`` so ``exp2`` replaces ``exp`` (one MUFU.EX2 instead of a multiply and
  an EX2). ``LSE`` is stored in natural log so that frontends and the oracle agree.
* A row with no allowed key has output 0, ``LSE = -inf`` and zero gradients, never NaN.
"""

import math

import triton
import triton.language as tl

__all__ = [
    "_attn_fwd_kernel",
    "_attn_bwd_preprocess_kernel",
    "_attn_bwd_dq_kernel",
    "_attn_bwd_dkdv_kernel",
]

# log2(e): folds the natural-exp softmax into exp2 (scores * sm_scale * LOG2E).
# ln(2):   converts the base-2 log-sum-exp back to natural log for LSE.
# Kernels inline the literals below (globals referenced from @triton.jit must be constexprs, and
# the literals keep the interpreter and both Triton versions on the same code path).
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
assert abs(LOG2E - 1 / math.log(2)) < 1e-15 and abs(LN2 - math.log(2)) < 1e-15


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with an fp32 accumulator (fp64 for fp64 operands).

    DOT_UPCAST (set by the launcher for bf16 in the interpreter only): Triton 3.9's interpreter
    feeds the raw uint16 storage of bf16 operands to numpy's matmul (its create_dot converts only
    fp8), which gives garbage. bf16 -> fp32 is exact and the GPU's bf16 MMA multiplies exactly
    and accumulates in fp32, so upcasting first computes the same thing the GPU does.
    """
    if DOT_UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _tile_bits(masks, mask_id, offs_r, offs_c, stride_mu, stride_mr, stride_mw):
    """Element mask of one partial tile, gathered from the bitmask table.

    ``offs_r`` (query rows inside the tile) and ``offs_c`` (key columns inside the tile) are
    broadcastable index tensors; the result has their broadcast shape. Bit ``c % 32`` of word
    ``c // 32`` of row ``r`` of ``masks[mask_id]`` says whether query row ``r`` sees key ``c``.
    """
    words = tl.load(masks + mask_id * stride_mu + offs_r * stride_mr + (offs_c // 32) * stride_mw)
    # Arithmetic right shift of a signed word: bit 31 drags ones in from the left, but the
    # "& 1" keeps only the bit we want, so the sign never leaks.
    return ((words >> (offs_c % 32)) & 1) != 0


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_base, v_base, kb, offs_t, offs_d, N, qk_scale,
              stride_kn, stride_kd, stride_vn, stride_vd,
              masks, mask_id, stride_mu, stride_mr, stride_mw,
              BLOCK: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              DOT_UPCAST: tl.constexpr):
    """One online-softmax step of the forward pass over key tile ``kb`` (shapes in the caller)."""
    offs_n = kb * BLOCK + offs_t
    k_t = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                  mask=offs_n[None, :] < N, other=0.0)  # [HEAD_DIM, BLOCK] = K^T
    qk = _dot(q, k_t, DOT_PRECISION, DOT_UPCAST) * qk_scale  # base-2 scores
    valid = offs_n[None, :] < N
    if PARTIAL:
        valid = valid & _tile_bits(masks, mask_id, offs_t[:, None], offs_t[None, :],
                                   stride_mu, stride_mr, stride_mw)
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row that has seen no allowed key yet has m_new = -inf; exp2(-inf - -inf) would be NaN.
    # Subtracting 0 instead gives alpha = exp2(-inf) = 0 and p = exp2(-inf) = 0: the row stays
    # at acc = 0, l = 0 and is finalised as output 0, LSE -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=offs_n[:, None] < N, other=0.0)  # [BLOCK, HEAD_DIM]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V,
    q_count, q_partial, q_index, q_mask_id, masks,
    sm_scale, N, H,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_ch, stride_cm,
    stride_ih, stride_im, stride_ik,
    stride_mu, stride_mr, stride_mw,
    Out, LSE,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_WORDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Forward: Out = softmax(Q K^T * sm_scale, masked) V and LSE = logsumexp of the scores.

    Q, K, V, Out: [B, H, N, HEAD_DIM]; LSE: [B, H, N] (fp32, or fp64 for fp64 inputs);
    q_count, q_partial: int32[H, NT]; q_index, q_mask_id: int32[H, NT, W]; masks:
    int32[U, BLOCK, MASK_WORDS]. Grid (NT, B*H), NT = cdiv(N, BLOCK).
    """
    tl.static_assert(BLOCK >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(MASK_WORDS * 32 >= BLOCK, "one bit per key column of a tile")
    tl.static_assert(HEAD_DIM >= 16, "tl.dot needs a head dim of at least 16")
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    # int64 batch/head offsets: B*H*N*D overflows int32 from ~2^31 elements (e.g. B=8, H=32,
    # N=64k, D=128).
    off_b = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    offs_t = tl.arange(0, BLOCK)
    offs_m = start_m * BLOCK + offs_t
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q + off_b * stride_qb + off_h.to(tl.int64) * stride_qh
                + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=offs_m[:, None] < N, other=0.0)  # [BLOCK, HEAD_DIM]
    k_base = K + off_b * stride_kb + off_h.to(tl.int64) * stride_kh
    v_base = V + off_b * stride_vb + off_h.to(tl.int64) * stride_vh
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): softmax in base 2 (exp2)

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    if Q.dtype.element_ty == tl.float64:  # fp64 inputs (gradcheck) accumulate in fp64
        m_i = m_i.to(tl.float64)
        l_i = l_i.to(tl.float64)
        acc = acc.to(tl.float64)

    count = tl.load(q_count + off_h * stride_ch + start_m * stride_cm)
    n_partial = tl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
    row = off_h * stride_ih + start_m * stride_im
    # Partial tiles first (element mask from the bitmask table), then full tiles (no mask).
    for e in range(0, n_partial):
        kb = tl.load(q_index + row + e * stride_ik)
        mid = tl.load(q_mask_id + row + e * stride_ik)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, kb, offs_t, offs_d, N,
                                  qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                                  masks, mid, stride_mu, stride_mr, stride_mw,
                                  BLOCK, True, DOT_PRECISION, DOT_UPCAST)
    for e in range(n_partial, count):
        kb = tl.load(q_index + row + e * stride_ik)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, k_base, v_base, kb, offs_t, offs_d, N,
                                  qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                                  masks, 0, stride_mu, stride_mr, stride_mw,
                                  BLOCK, False, DOT_PRECISION, DOT_UPCAST)

    # Rows with no allowed key (l = 0): divide by 1 so acc = 0 gives output 0, not 0/0 = NaN.
    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]
    # LSE in natural log: (m + log2 l) * ln(2); -inf where the row saw no key.
    lse = tl.where(has_key, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(Out + off_b * stride_ob + off_h.to(tl.int64) * stride_oh
             + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=offs_m[:, None] < N)
    tl.store(LSE + off_b * stride_lb + off_h.to(tl.int64) * stride_lh + offs_m * stride_ln,
             lse.to(LSE.dtype.element_ty), mask=offs_m < N)


@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, DO,
    N, H,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln,
    Delta,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Delta = rowsum(dO * O), the softmax-backward correction term.

    Out, DO: [B, H, N, HEAD_DIM]; Delta: [B, H, N] (fp32, or fp64 for fp64 inputs), strides
    stride_l*. Grid (cdiv(N, BLOCK), B*H).
    """
    tl.static_assert(HEAD_DIM >= 16, "head dims below 16 are not supported")
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = start_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_m[:, None] < N
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_on
                + offs_d[None, :] * stride_od, mask=in_range, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_don
                 + offs_d[None, :] * stride_dod, mask=in_range, other=0.0)
    # Accumulate in the Delta dtype (fp32 or fp64), never in fp16/bf16.
    delta = tl.sum(o.to(Delta.dtype.element_ty) * do.to(Delta.dtype.element_ty), 1)
    tl.store(Delta + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ln, delta,
             mask=offs_m < N)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, k_base, v_base, kb, offs_t, offs_d, N, qk_scale,
             stride_kn, stride_kd, stride_vn, stride_vd,
             masks, mask_id, stride_mu, stride_mr, stride_mw,
             BLOCK: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              DOT_UPCAST: tl.constexpr):
    """dQ contribution of key tile ``kb`` (shapes in :func:`_attn_bwd_dq_kernel`)."""
    offs_n = kb * BLOCK + offs_t
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=offs_n[:, None] < N, other=0.0)  # [BLOCK, HEAD_DIM]
    v_t = tl.load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd,
                  mask=offs_n[None, :] < N, other=0.0)  # [HEAD_DIM, BLOCK] = V^T
    qk = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale
    valid = offs_n[None, :] < N
    if PARTIAL:
        valid = valid & _tile_bits(masks, mask_id, offs_t[:, None], offs_t[None, :],
                                   stride_mu, stride_mr, stride_mw)
    # Recompute P from the saved base-2 LSE. tl.where *selects*, so an overflowing exp2 of a
    # masked-out score never reaches the sums.
    p = tl.where(valid, tl.math.exp2(qk - lse2[:, None]), 0.0)
    dp = _dot(do, v_t, DOT_PRECISION, DOT_UPCAST)
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta,
    q_count, q_partial, q_index, q_mask_id, masks,
    sm_scale, N, H,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln,
    stride_ch, stride_cm,
    stride_ih, stride_im, stride_ik,
    stride_mu, stride_mr, stride_mw,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    DQ,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_WORDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """dQ = sm_scale * sum_j dS_ij K_j with dS = P * (dO V^T - Delta), over the query-major lists.

    Q, K, V, DO, DQ: [B, H, N, HEAD_DIM]; LSE, Delta: [B, H, N] sharing strides stride_l*;
    q_* lists and masks as in :func:`_attn_fwd_kernel`. Grid (NT, B*H).
    """
    tl.static_assert(BLOCK >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(MASK_WORDS * 32 >= BLOCK, "one bit per key column of a tile")
    tl.static_assert(HEAD_DIM >= 16, "tl.dot needs a head dim of at least 16")
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_h64 = off_h.to(tl.int64)
    offs_t = tl.arange(0, BLOCK)
    offs_m = start_m * BLOCK + offs_t
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N

    q = tl.load(Q + off_b * stride_qb + off_h64 * stride_qh + offs_m[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h64 * stride_doh + offs_m[:, None] * stride_don
                 + offs_d[None, :] * stride_dod, mask=row_ok[:, None], other=0.0)
    l_off = off_b * stride_lb + off_h64 * stride_lh + offs_m * stride_ln
    lse = tl.load(LSE + l_off, mask=row_ok, other=float("-inf"))
    delta = tl.load(Delta + l_off, mask=row_ok, other=0.0)
    # Base-2 LSE. Rows with no key (LSE = -inf) get +inf so that P = exp2(s - inf) = 0 and
    # their gradient is exactly 0 (exp2(s + inf) would be inf, and inf * 0 NaN).
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    k_base = K + off_b * stride_kb + off_h64 * stride_kh
    v_base = V + off_b * stride_vb + off_h64 * stride_vh
    qk_scale = sm_scale * 1.4426950408889634  # log2(e), as in the forward pass

    dq = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    if Q.dtype.element_ty == tl.float64:
        dq = dq.to(tl.float64)
    count = tl.load(q_count + off_h * stride_ch + start_m * stride_cm)
    n_partial = tl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
    row = off_h * stride_ih + start_m * stride_im
    for e in range(0, n_partial):
        kb = tl.load(q_index + row + e * stride_ik)
        mid = tl.load(q_mask_id + row + e * stride_ik)
        dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, kb, offs_t, offs_d, N, qk_scale,
                      stride_kn, stride_kd, stride_vn, stride_vd,
                      masks, mid, stride_mu, stride_mr, stride_mw,
                      BLOCK, True, DOT_PRECISION, DOT_UPCAST)
    for e in range(n_partial, count):
        kb = tl.load(q_index + row + e * stride_ik)
        dq = _dq_tile(dq, q, do, lse2, delta, k_base, v_base, kb, offs_t, offs_d, N, qk_scale,
                      stride_kn, stride_kd, stride_vn, stride_vd,
                      masks, 0, stride_mu, stride_mr, stride_mw,
                      BLOCK, False, DOT_PRECISION, DOT_UPCAST)
    # dS is the gradient w.r.t. the *natural* scaled scores, hence sm_scale (not qk_scale).
    dq = dq * sm_scale
    tl.store(DQ + off_b * stride_dqb + off_h64 * stride_dqh + offs_m[:, None] * stride_dqn
             + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb, offs_t, offs_d, N,
               qk_scale, stride_qn, stride_qd, stride_don, stride_dod, stride_ln,
               masks, mask_id, stride_mu, stride_mr, stride_mw,
               BLOCK: tl.constexpr, PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              DOT_UPCAST: tl.constexpr):
    """dK/dV contribution of query tile ``qb`` (shapes in :func:`_attn_bwd_dkdv_kernel`).

    Works on transposed scores S^T [BLOCK keys, BLOCK queries] so that the accumulators keep
    the key tile's row order.
    """
    offs_m = qb * BLOCK + offs_t  # query tokens (columns of S^T)
    col_ok = offs_m < N
    q_t = tl.load(q_base + offs_m[None, :] * stride_qn + offs_d[:, None] * stride_qd,
                  mask=col_ok[None, :], other=0.0)  # [HEAD_DIM, BLOCK] = Q^T
    do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=col_ok[:, None], other=0.0)  # [BLOCK, HEAD_DIM]
    lse = tl.load(lse_base + offs_m * stride_ln, mask=col_ok, other=float("-inf"))
    delta = tl.load(delta_base + offs_m * stride_ln, mask=col_ok, other=0.0)
    # As in the dQ kernel: -inf LSE (row with no key, or padding) -> +inf so P^T is 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    qk_t = _dot(k, q_t, DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_keys, BLOCK_q]
    offs_n_tile = tl.arange(0, BLOCK)  # key rows inside the tile (bounded by the caller's N)
    valid = col_ok[None, :]
    if PARTIAL:
        # masks rows are queries: row index = query (axis 1 here), bit = key (axis 0 here).
        valid = valid & _tile_bits(masks, mask_id, offs_t[None, :], offs_n_tile[:, None],
                                   stride_mu, stride_mr, stride_mw)
    p_t = tl.where(valid, tl.math.exp2(qk_t - lse2[None, :]), 0.0)
    dv += _dot(p_t.to(do.dtype), do, DOT_PRECISION, DOT_UPCAST)
    dp_t = _dot(v, tl.trans(do), DOT_PRECISION, DOT_UPCAST)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q_t.dtype), tl.trans(q_t), DOT_PRECISION, DOT_UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta,
    k_count, k_partial, k_index, k_mask_id, masks,
    sm_scale, N, H,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_lb, stride_lh, stride_ln,
    stride_ch, stride_cm,
    stride_ih, stride_im, stride_ik,
    stride_mu, stride_mr, stride_mw,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    DK, DV,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_WORDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """dV = sum_i P_i^T dO_i and dK = sm_scale * sum_i dS_i^T Q_i over the key-major lists.

    Q, K, V, DO, DK, DV: [B, H, N, HEAD_DIM]; LSE, Delta: [B, H, N] sharing strides stride_l*;
    k_count, k_partial: int32[H, NT]; k_index, k_mask_id: int32[H, NT, W'] (k_index lists query
    tiles; k_mask_id names the query-major mask); masks: int32[U, BLOCK, MASK_WORDS].
    Grid (NT, B*H): one program per key tile, so no atomics and bitwise-deterministic results.
    """
    tl.static_assert(BLOCK >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(MASK_WORDS * 32 >= BLOCK, "one bit per key column of a tile")
    tl.static_assert(HEAD_DIM >= 16, "tl.dot needs a head dim of at least 16")
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_h64 = off_h.to(tl.int64)
    offs_t = tl.arange(0, BLOCK)
    offs_n = start_n * BLOCK + offs_t
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < N

    k = tl.load(K + off_b * stride_kb + off_h64 * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=key_ok[:, None], other=0.0)
    v = tl.load(V + off_b * stride_vb + off_h64 * stride_vh + offs_n[:, None] * stride_vn
                + offs_d[None, :] * stride_vd, mask=key_ok[:, None], other=0.0)
    # Padding keys (>= N) load K = V = 0 and are never stored, so their scores need no mask.
    q_base = Q + off_b * stride_qb + off_h64 * stride_qh
    do_base = DO + off_b * stride_dob + off_h64 * stride_doh
    lse_base = LSE + off_b * stride_lb + off_h64 * stride_lh
    delta_base = Delta + off_b * stride_lb + off_h64 * stride_lh
    qk_scale = sm_scale * 1.4426950408889634  # log2(e), as in the forward pass

    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    if Q.dtype.element_ty == tl.float64:
        dk = dk.to(tl.float64)
        dv = dv.to(tl.float64)
    count = tl.load(k_count + off_h * stride_ch + start_n * stride_cm)
    n_partial = tl.load(k_partial + off_h * stride_ch + start_n * stride_cm)
    row = off_h * stride_ih + start_n * stride_im
    for e in range(0, n_partial):
        qb = tl.load(k_index + row + e * stride_ik)
        mid = tl.load(k_mask_id + row + e * stride_ik)
        dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb, offs_t,
                            offs_d, N, qk_scale, stride_qn, stride_qd, stride_don, stride_dod,
                            stride_ln, masks, mid, stride_mu, stride_mr, stride_mw,
                            BLOCK, True, DOT_PRECISION, DOT_UPCAST)
    for e in range(n_partial, count):
        qb = tl.load(k_index + row + e * stride_ik)
        dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb, offs_t,
                            offs_d, N, qk_scale, stride_qn, stride_qd, stride_don, stride_dod,
                            stride_ln, masks, 0, stride_mu, stride_mr, stride_mw,
                            BLOCK, False, DOT_PRECISION, DOT_UPCAST)
    dk = dk * sm_scale  # gradient w.r.t. natural scaled scores, as in dQ
    tl.store(DK + off_b * stride_dkb + off_h64 * stride_dkh + offs_n[:, None] * stride_dkn
             + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + off_b * stride_dvb + off_h64 * stride_dvh + offs_n[:, None] * stride_dvn
             + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])
