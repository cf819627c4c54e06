"""Block-sparse flash attention: Triton sources for the forward and backward passes.

This module holds ``@triton.jit`` functions only; it imports neither torch nor jax, so the torch
frontend (``kernel[grid](...)``) and the JAX frontend (``jax_triton.triton_call``, or the
interpreter on CPU) launch the *same* kernel objects. The argument order of every kernel and the
default tile configs live in :mod:`sparsetp.kernels.abi`; read its docstring before calling a
kernel by hand.

Conventions shared by the three kernels
--------------------------------------
* Tensors are ``[B, H, N, D]`` (Q, Out, dO, dQ) and ``[B, H / GROUP, N_KV, D]`` (K, V, dK,
  dV) with arbitrary strides (passed as ``stride_<tensor><dim>``); ``LSE`` and ``Delta`` are
  ``[B, H, N]`` float32 (float64 for float64 inputs). GROUP = H / H_kv (grouped-query
  attention; 1 for multi-head): query head ``h`` reads kv head ``h // GROUP``, K and V are never
  repeated. ``N`` counts queries, ``N_KV`` keys (the layout aligns the two, see
  :mod:`sparsetp.core.layout`).
* One program per (tile, batch, head): it owns query tile ``i`` (forward, dQ) of batch ``b``,
  query head ``h``, or key tile ``i`` (dK/dV) of batch ``b``, kv head ``g`` (which sums over
  the query heads of its group in a fixed order: no atomics). Program ids map through
  :func:`_program` (optionally a per-head longest-first work order, optionally head-fastest
  dispatch). The backward is two launches: dQ (which also writes ``Delta``, the softmax
  backward's row term) then dK/dV (which reads it).
* Block-sparse structure reaches the kernels as *tensors* (pointers + strides), never as
  constexprs: a new pattern with the same shapes reuses the compiled kernel. See the docstring of
  :mod:`sparsetp.core.layout`: per (head, tile) an ELL row lists ``count`` tiles, the first
  ``n_partial`` of which are partial (they carry a row of the ``masks`` bitmask table), the rest
  full (no element mask).
* The only constexprs are tile shape (``BLOCK`` = layout block size, ``HEAD_DIM``), the
  sub-tile walked per loop step (``SUB_N`` keys in forward/dQ, ``SUB_M`` queries in dK/dV),
  the number of int32 mask words per tile row (``MASK_WORDS``), the tl.dot input precision,
  ``DOT_UPCAST`` (an interpreter-only bf16 workaround, see :func:`_dot`), the work-order
  switch ``ORDERED`` (:func:`_program`), ``ALIGNED`` (:func:`_hint16`), ``HEAD_DIM_PAD`` (the
  head dim rounded up to a power of two, :func:`_cols_ok`), in dK/dV ``GROUPED``
  (GROUP > 1) and in dQ ``HAS_DLSE`` (an LSE cotangent to fold into Delta). None depends on the
  pattern's values, so a new pattern never recompiles. (How heads are interleaved, which the
  layout decides, is read off the grid's shape at run time: see :func:`_program`.)
* Every kernel bounds its loads by ``N`` (queries) and ``N_KV`` (keys): full tiles of the ragged
  last tile row/column carry no mask bits, so ``offs < N`` is always part of the validity mask.
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
    "_attn_bwd_dq_kernel",
    "_attn_bwd_dkdv_kernel",
]

# log2(e): folds the natural-exp softmax into exp2 (scores * sm_scale * LOG2E).
# ln(2):   converts the base-2 log-sum-exp back to natural log for LSE.
# Globals read inside @triton.jit must be constexprs.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
assert abs(LOG2E.value - 1 / math.log(2)) < 1e-15 and abs(LN2.value - math.log(2)) < 1e-15


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
def _stats_const(value: tl.constexpr, ref):
    """``value`` as a scalar of the statistics dtype of what ``ref`` points to: fp64 for fp64
    tensors, else fp32. Why not the literal: Triton types a Python float in a kernel as an fp32
    constant, so ``x * LOG2E`` on fp64 ``x`` would multiply by log2(e) rounded to
    fp32 (relative error 2e-8, and fp64 attention off the float64 oracle by ~1e-7). For the
    other dtypes this is the same fp32 constant the literal was."""
    if ref.dtype.element_ty == tl.float64:
        c = tl.full([], value, tl.float64)
    else:
        c = tl.full([], value, tl.float32)
    return c


@triton.jit
def _softmax_scale(sm_scale, sm_scale_lo, ref):
    """The softmax scale in the statistics dtype of what ``ref`` points to. Triton passes a
    Python float as fp32, so the launcher splits the scale into ``sm_scale`` = fp32(scale) and
    ``sm_scale_lo`` = fp32(scale - sm_scale) (``abi.scale_args``); fp64 kernels add the two
    back (the scale to ~1e-15), the others use ``sm_scale`` as before."""
    if ref.dtype.element_ty == tl.float64:
        s = tl.cast(sm_scale, tl.float64) + tl.cast(sm_scale_lo, tl.float64)
    else:
        s = sm_scale
    return s


@triton.jit
def _program(order, stride_ch, stride_cm, H, ranks, head_stride, ORDERED: tl.constexpr):
    """(tile, b * H + h) of this program, out of ``ranks`` per (batch, head).

    Two grid forms, told apart at run time so that the head order a layout asks for never
    costs a compile. (G, ranks, B*H / G) takes the heads in groups of G, one group after
    another, and within a group dispatches rank r of each of its G heads before rank r + 1 of
    any (G = B*H: "heads first", every head interleaved). The one-axis grid (B*H*ranks,) runs
    the heads one after another, ranks fastest (G = 1). With one rank per head the launcher
    always uses the one-axis grid (``schedule.list_grid``): rank 0 of head ``program_id(0)``.
    With ``ORDERED`` the rank is mapped through the layout's per-head work order
    (``order[h, rank]`` = tile, longest list first, so long rows start early instead of
    forming the tail of the launch); otherwise rank = tile. ``H`` heads per batch entry; the
    work order row of head ``h`` is ``h * head_stride`` (the dK/dV kernel's heads are kv heads,
    which take the order of their group's first query head; 1 elsewhere).
    """
    if tl.num_programs(1) == 1:
        g = tl.program_id(0)
        off_bh = g // ranks
        rank = g % ranks
    else:
        off_bh = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        rank = tl.program_id(1)
    if ORDERED:
        tile = tl.load(order + (off_bh % H) * head_stride * stride_ch + rank * stride_cm)
    else:
        tile = rank
    return tile, off_bh


@triton.jit
def _cols_ok(offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """bool [HEAD_DIM_PAD]: which of the padded head-dim columns are real. tl.arange needs a
    power of two, so a head dim like 192 runs as 256 columns whose loads are masked to 0 (zero
    columns add nothing to q.k or p.v) and whose stores are masked off. For a power-of-two
    head dim this is an all-true constant, which the compiler folds out of every mask."""
    if HEAD_DIM == HEAD_DIM_PAD:
        ok = tl.full([HEAD_DIM_PAD], 1, tl.int1)
    else:
        ok = offs_d < HEAD_DIM
    return ok


@triton.jit
def _hint16(x, ALIGNED: tl.constexpr):
    """``x`` with its divisibility by 16 visible to the compiler when ``ALIGNED``.

    Why not ``tl.multiple_of``: on a kernel argument it is a no-op (the attribute is set on the
    defining op, and a function argument has none). ``(x // 16) * 16`` equals ``x`` whenever the
    launcher promised x % 16 == 0, and axis analysis derives divisibility 16 from the multiply,
    so the jax_triton launch (which marks no int argument divisible) vectorises like torch's.
    """
    if ALIGNED:
        x = (x // 16) * 16
    return x


@triton.jit
def _mask_bits(masks, mask_id, row0, col0, stride_mu, stride_mr, stride_mw,
               R: tl.constexpr, C: tl.constexpr, TRANS: tl.constexpr):
    """Element mask of rows ``row0 + [0, R)`` x columns ``col0 + [0, C)`` of a partial tile.

    Rows are queries, columns keys: bit ``c % 32`` of word ``c // 32`` of row ``r`` of
    ``masks[mask_id]``. Returns bool ``[R, C]``, or ``[C, R]`` (keys first) when ``TRANS``.
    ``col0`` is a multiple of ``C``, and of 32 when ``C > 32``: a slice never straddles words
    unless it covers them whole.

    The words are loaded once per row ([R, C/32] loads, not one gathered load per element) and
    the bits expanded in registers: ``(words[:, :, None] >> arange(32)) & 1`` is [R, C/32, 32],
    whose row-major order is column order, so ``tl.reshape`` (can_reorder=False keeps the
    logical order) gives [R, C]. Slices of at most 32 columns shift one word instead.
    Arithmetic right shift of a signed word drags bit 31 in from the left, but ``& 1`` keeps
    only the wanted bit.
    """
    base = masks + mask_id * stride_mu
    offs_r = row0 + tl.arange(0, R)
    if TRANS:
        if C <= 32:
            word = tl.load(base + offs_r[None, :] * stride_mr + (col0 // 32) * stride_mw)
            bits = (word >> ((col0 % 32) + tl.arange(0, C))[:, None]) & 1  # [C, R]
        else:
            offs_w = col0 // 32 + tl.arange(0, C // 32)
            words = tl.load(base + offs_r[None, :] * stride_mr
                            + offs_w[:, None] * stride_mw)  # [C/32, R]
            bits = (words[:, None, :] >> tl.arange(0, 32)[None, :, None]) & 1  # [C/32, 32, R]
            bits = tl.reshape(bits, [C, R])
    else:
        if C <= 32:
            word = tl.load(base + offs_r[:, None] * stride_mr + (col0 // 32) * stride_mw)
            bits = (word >> ((col0 % 32) + tl.arange(0, C))[None, :]) & 1  # [R, C]
        else:
            offs_w = col0 // 32 + tl.arange(0, C // 32)
            words = tl.load(base + offs_r[:, None] * stride_mr
                            + offs_w[None, :] * stride_mw)  # [R, C/32]
            bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1  # [R, C/32, 32]
            bits = tl.reshape(bits, [R, C])
    return bits != 0


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k_base, v_base, kb, sub, offs_d, d_ok, N_KV, qk_scale,
              stride_kn, stride_kd, stride_vn, stride_vd,
              masks, mask_id, stride_mu, stride_mr, stride_mw,
              BLOCK: tl.constexpr, SUB_N: tl.constexpr, PARTIAL: tl.constexpr,
              DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One online-softmax step over sub-tile ``sub`` (keys ``[sub*SUB_N, +SUB_N)``) of key tile
    ``kb`` (shapes in :func:`_attn_fwd_kernel`)."""
    offs_n = kb * BLOCK + sub * SUB_N + tl.arange(0, SUB_N)
    k_t = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                  mask=(offs_n[None, :] < N_KV) & d_ok[:, None], other=0.0)  # [HEAD_DIM, SUB_N]
    qk = _dot(q, k_t, DOT_PRECISION, DOT_UPCAST) * qk_scale  # base-2 scores [BLOCK, SUB_N]
    valid = offs_n[None, :] < N_KV
    if PARTIAL:
        valid = valid & _mask_bits(masks, mask_id, 0, sub * SUB_N, stride_mu, stride_mr,
                                   stride_mw, BLOCK, SUB_N, False)
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
                mask=(offs_n[:, None] < N_KV) & d_ok[None, :], other=0.0)  # [SUB_N, HEAD_DIM]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V,
    q_count, q_partial, q_index, q_mask_id, masks, q_order,
    sm_scale, sm_scale_lo, N, N_KV, H, GROUP,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_ch, stride_cm,
    stride_ih, stride_im, stride_ik,
    stride_mu, stride_mr, stride_mw,
    Out, LSE,
    BLOCK: tl.constexpr, SUB_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_WORDS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ORDERED: tl.constexpr, ALIGNED: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Forward: Out = softmax(Q K^T * sm_scale, masked) V and LSE = logsumexp of the scores.

    Q, Out: [B, H, N, HEAD_DIM]; K, V: [B, H / GROUP, N_KV, HEAD_DIM] (query head h reads kv
    head h // GROUP: GQA/MQA without repeating K, V); LSE: [B, H, N] (fp32, or fp64 for fp64
    inputs);
    q_count, q_partial, q_order: int32[H, NT]; q_index, q_mask_id: int32[H, NT, W]; masks:
    int32[U, BLOCK, MASK_WORDS]. One program per (query tile, b, h), see :func:`_program`.
    The program keeps a [BLOCK, HEAD_DIM] query tile and walks each listed key tile in
    BLOCK // SUB_N sub-tiles of SUB_N keys; (entry, sub-tile) is flattened into one loop so the
    software pipeliner sees one simple loop (num_stages > 1 prefetches the next sub-tile's K, V).
    """
    tl.static_assert(BLOCK >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(SUB_N >= 16 and BLOCK % SUB_N == 0, "key sub-tiles: >= 16, divide BLOCK")
    tl.static_assert(MASK_WORDS * 32 >= BLOCK, "one bit per key column of a tile")
    tl.static_assert(HEAD_DIM >= 16, "tl.dot needs a head dim of at least 16")
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM, "padded head dim covers the head dim")
    start_m, off_bh = _program(q_order, stride_ch, stride_cm, H, tl.cdiv(N, BLOCK), 1, ORDERED)
    N = _hint16(N, ALIGNED)
    N_KV = _hint16(N_KV, ALIGNED)
    # int64 batch/head offsets: B*H*N*D overflows int32 from ~2^31 elements (e.g. B=8, H=32,
    # N=64k, D=128).
    off_b = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_h64 = off_h.to(tl.int64)
    off_hk64 = (off_h // GROUP).to(tl.int64)  # the kv head of this query head
    offs_m = start_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = _cols_ok(offs_d, HEAD_DIM, HEAD_DIM_PAD)

    q = tl.load(Q + off_b * _hint16(stride_qb, ALIGNED) + off_h64 * _hint16(stride_qh, ALIGNED)
                + offs_m[:, None] * _hint16(stride_qn, ALIGNED) + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < N) & d_ok[None, :], other=0.0)  # [BLOCK, HEAD_DIM]
    k_base = K + off_b * _hint16(stride_kb, ALIGNED) + off_hk64 * _hint16(stride_kh, ALIGNED)
    v_base = V + off_b * _hint16(stride_vb, ALIGNED) + off_hk64 * _hint16(stride_vh, ALIGNED)
    stride_kn = _hint16(stride_kn, ALIGNED)
    stride_vn = _hint16(stride_vn, ALIGNED)
    scale = _softmax_scale(sm_scale, sm_scale_lo, Q)
    # log2(e): softmax in base 2 (exp2)
    qk_scale = scale * _stats_const(LOG2E, Q)

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM_PAD], tl.float32)
    if Q.dtype.element_ty == tl.float64:  # fp64 inputs (gradcheck) accumulate in fp64
        m_i = m_i.to(tl.float64)
        l_i = l_i.to(tl.float64)
        acc = acc.to(tl.float64)

    count = tl.load(q_count + off_h * stride_ch + start_m * stride_cm)
    n_partial = tl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
    row = off_h * stride_ih + start_m * stride_im
    # Partial tiles first (element mask from the bitmask table), then full tiles (no mask).
    # it = entry * NSUB + sub-tile; NSUB = BLOCK // SUB_N is a power of two (shifts, not divides).
    for it in range(0, n_partial * (BLOCK // SUB_N)):
        e = it // (BLOCK // SUB_N)
        kb = tl.load(q_index + row + e * stride_ik)
        mid = tl.load(q_mask_id + row + e * stride_ik)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, kb, it % (BLOCK // SUB_N),
                                  offs_d, d_ok, N_KV, qk_scale, stride_kn, stride_kd, stride_vn,
                                  stride_vd, masks, mid, stride_mu, stride_mr, stride_mw,
                                  BLOCK, SUB_N, True, DOT_PRECISION, DOT_UPCAST)
    # The next key-tile index is loaded one step ahead so the next K/V address does not wait on
    # a global load (faster here, slower in dQ and dK/dV: KERNEL_NOTES.md, "v10").
    lo = n_partial * (BLOCK // SUB_N)
    hi = count * (BLOCK // SUB_N)
    kb_next = tl.load(q_index + row + n_partial * stride_ik, mask=lo < hi, other=0)
    for it in range(lo, hi):
        kb = kb_next
        kb_next = tl.load(q_index + row + (tl.minimum(it + 1, hi - 1) // (BLOCK // SUB_N))
                          * stride_ik)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, kb, it % (BLOCK // SUB_N),
                                  offs_d, d_ok, N_KV, qk_scale, stride_kn, stride_kd, stride_vn,
                                  stride_vd, masks, 0, stride_mu, stride_mr, stride_mw,
                                  BLOCK, SUB_N, False, DOT_PRECISION, DOT_UPCAST)

    # Rows with no allowed key (l = 0): divide by 1 so acc = 0 gives output 0, not 0/0 = NaN.
    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]
    # LSE in natural log: (m + log2 l) * ln(2); -inf where the row saw no key.
    ln2 = _stats_const(LN2, LSE)
    lse = tl.where(has_key, (m_i + tl.math.log2(l_safe)) * ln2, float("-inf"))
    tl.store(Out + off_b * _hint16(stride_ob, ALIGNED) + off_h64 * _hint16(stride_oh, ALIGNED)
             + offs_m[:, None] * _hint16(stride_on, ALIGNED) + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < N) & d_ok[None, :])
    tl.store(LSE + off_b * _hint16(stride_lb, ALIGNED) + off_h64 * _hint16(stride_lh, ALIGNED)
             + offs_m * stride_ln, lse.to(LSE.dtype.element_ty), mask=offs_m < N)


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_base, v_base, kb, sub, offs_d, d_ok, N_KV, qk_scale,
             stride_kn, stride_kd, stride_vn, stride_vd,
             masks, mask_id, stride_mu, stride_mr, stride_mw,
             BLOCK: tl.constexpr, SUB_N: tl.constexpr, PARTIAL: tl.constexpr,
             DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """dQ contribution of sub-tile ``sub`` (keys ``[sub*SUB_N, +SUB_N)``) of key tile ``kb``
    (shapes in :func:`_attn_bwd_dq_kernel`)."""
    offs_n = kb * BLOCK + sub * SUB_N + tl.arange(0, SUB_N)
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=(offs_n[:, None] < N_KV) & d_ok[None, :], other=0.0)  # [SUB_N, HEAD_DIM]
    v_t = tl.load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd,
                  mask=(offs_n[None, :] < N_KV) & d_ok[:, None], other=0.0)  # V^T
    qk = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK, SUB_N]
    # dP does not depend on P: issued here, its MMA can overlap the exp2s below (KERNEL_NOTES.md).
    dp = _dot(do, v_t, DOT_PRECISION, DOT_UPCAST)
    valid = offs_n[None, :] < N_KV
    if PARTIAL:
        valid = valid & _mask_bits(masks, mask_id, 0, sub * SUB_N, stride_mu, stride_mr,
                                   stride_mw, BLOCK, SUB_N, False)
    # Recompute P from the saved base-2 LSE. tl.where *selects*, so an overflowing exp2 of a
    # masked-out score never reaches the sums.
    p = tl.where(valid, tl.math.exp2(qk - lse2[:, None]), 0.0)
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(k.dtype), k, DOT_PRECISION, DOT_UPCAST)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, Out, DLSE,
    q_count, q_partial, q_index, q_mask_id, masks, q_order,
    sm_scale, sm_scale_lo, N, N_KV, H, GROUP,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_dlb, stride_dlh, stride_dln,
    stride_ch, stride_cm,
    stride_ih, stride_im, stride_ik,
    stride_mu, stride_mr, stride_mw,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    DQ, Delta,
    BLOCK: tl.constexpr, SUB_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_WORDS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ORDERED: tl.constexpr, ALIGNED: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """dQ = sm_scale * sum_j dS_ij K_j with dS = P * (dO V^T - Delta), over the query-major
    lists; also writes Delta for the dK/dV kernel.

    Q, DO, Out, DQ: [B, H, N, HEAD_DIM]; K, V: [B, H / GROUP, N_KV, HEAD_DIM] (kv head
    h // GROUP, as in the forward); LSE, Delta: [B, H, N] sharing strides stride_l*; DLSE: the
    LSE cotangent [B, H, N] (strides stride_dl*, any), read only when HAS_DLSE; q_* lists and
    masks as in :func:`_attn_fwd_kernel`. Delta = rowsum(dO * Out) - DLSE (DLSE only on rows
    with a finite LSE: a row with no key has P = 0, and inf - inf must not reach the sums),
    computed here because every query tile has exactly one dQ program (the grid covers all
    tiles), which saves the launch of a separate pass. The program keeps the [BLOCK, HEAD_DIM]
    tiles q, do and dq and walks each listed key tile in sub-tiles of SUB_N keys (one flattened
    loop, as in the forward), so only [SUB_N, HEAD_DIM] K and V tiles are live per step.
    """
    tl.static_assert(BLOCK >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(SUB_N >= 16 and BLOCK % SUB_N == 0, "key sub-tiles: >= 16, divide BLOCK")
    tl.static_assert(MASK_WORDS * 32 >= BLOCK, "one bit per key column of a tile")
    tl.static_assert(HEAD_DIM >= 16, "tl.dot needs a head dim of at least 16")
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM, "padded head dim covers the head dim")
    start_m, off_bh = _program(q_order, stride_ch, stride_cm, H, tl.cdiv(N, BLOCK), 1, ORDERED)
    N = _hint16(N, ALIGNED)
    N_KV = _hint16(N_KV, ALIGNED)
    off_b = (off_bh // H).to(tl.int64)
    off_h = off_bh % H
    off_h64 = off_h.to(tl.int64)
    off_hk64 = (off_h // GROUP).to(tl.int64)  # the kv head of this query head
    offs_m = start_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = _cols_ok(offs_d, HEAD_DIM, HEAD_DIM_PAD)
    row_ok = offs_m < N

    q = tl.load(Q + off_b * _hint16(stride_qb, ALIGNED) + off_h64 * _hint16(stride_qh, ALIGNED)
                + offs_m[:, None] * _hint16(stride_qn, ALIGNED) + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + off_b * _hint16(stride_dob, ALIGNED) + off_h64 * _hint16(stride_doh, ALIGNED)
                 + offs_m[:, None] * _hint16(stride_don, ALIGNED) + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    l_off = off_b * _hint16(stride_lb, ALIGNED) + off_h64 * _hint16(stride_lh, ALIGNED) \
        + offs_m * stride_ln
    lse = tl.load(LSE + l_off, mask=row_ok, other=float("-inf"))
    o = tl.load(Out + off_b * _hint16(stride_ob, ALIGNED) + off_h64 * _hint16(stride_oh, ALIGNED)
                + offs_m[:, None] * _hint16(stride_on, ALIGNED) + offs_d[None, :] * stride_od,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Accumulate in the Delta dtype (fp32 or fp64), never in fp16/bf16.
    delta = tl.sum(o.to(Delta.dtype.element_ty) * do.to(Delta.dtype.element_ty), 1)
    if HAS_DLSE:
        d_lse = tl.load(DLSE + off_b * stride_dlb + off_h64 * stride_dlh + offs_m * stride_dln,
                        mask=row_ok, other=0.0)
        finite = (lse > float("-inf")) & (lse < float("inf"))
        delta = delta - tl.where(finite, d_lse.to(delta.dtype), 0.0)
    tl.store(Delta + l_off, delta, mask=row_ok)
    # Base-2 LSE. Rows with no key (LSE = -inf) get +inf so that P = exp2(s - inf) = 0 and
    # their gradient is exactly 0 (exp2(s + inf) would be inf, and inf * 0 NaN).
    lse2 = tl.where(lse == float("-inf"), float("inf"),
                    lse * _stats_const(LOG2E, LSE))
    k_base = K + off_b * _hint16(stride_kb, ALIGNED) + off_hk64 * _hint16(stride_kh, ALIGNED)
    v_base = V + off_b * _hint16(stride_vb, ALIGNED) + off_hk64 * _hint16(stride_vh, ALIGNED)
    stride_kn = _hint16(stride_kn, ALIGNED)
    stride_vn = _hint16(stride_vn, ALIGNED)
    scale = _softmax_scale(sm_scale, sm_scale_lo, Q)
    qk_scale = scale * _stats_const(LOG2E, Q)  # log2(e), as in forward

    dq = tl.zeros([BLOCK, HEAD_DIM_PAD], tl.float32)
    if Q.dtype.element_ty == tl.float64:
        dq = dq.to(tl.float64)
    count = tl.load(q_count + off_h * stride_ch + start_m * stride_cm)
    n_partial = tl.load(q_partial + off_h * stride_ch + start_m * stride_cm)
    row = off_h * stride_ih + start_m * stride_im
    for it in range(0, n_partial * (BLOCK // SUB_N)):
        e = it // (BLOCK // SUB_N)
        kb = tl.load(q_index + row + e * stride_ik)
        mid = tl.load(q_mask_id + row + e * stride_ik)
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, kb, it % (BLOCK // SUB_N), offs_d,
                      d_ok, N_KV, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                      masks, mid, stride_mu, stride_mr, stride_mw,
                      BLOCK, SUB_N, True, DOT_PRECISION, DOT_UPCAST)
    for it in range(n_partial * (BLOCK // SUB_N), count * (BLOCK // SUB_N)):
        kb = tl.load(q_index + row + (it // (BLOCK // SUB_N)) * stride_ik)
        dq = _dq_step(dq, q, do, lse2, delta, k_base, v_base, kb, it % (BLOCK // SUB_N), offs_d,
                      d_ok, N_KV, qk_scale, stride_kn, stride_kd, stride_vn, stride_vd,
                      masks, 0, stride_mu, stride_mr, stride_mw,
                      BLOCK, SUB_N, False, DOT_PRECISION, DOT_UPCAST)
    # dS is the gradient w.r.t. the *natural* scaled scores, hence scale (not qk_scale).
    dq = dq * scale
    tl.store(DQ + off_b * _hint16(stride_dqb, ALIGNED) + off_h64 * _hint16(stride_dqh, ALIGNED)
             + offs_m[:, None] * _hint16(stride_dqn, ALIGNED) + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb, sub, offs_d, d_ok, N,
               qk_scale, stride_qn, stride_qd, stride_don, stride_dod, stride_ln,
               masks, mask_id, stride_mu, stride_mr, stride_mw,
               BLOCK: tl.constexpr, SUB_M: tl.constexpr, PARTIAL: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """dK/dV contribution of sub-tile ``sub`` (queries ``[sub*SUB_M, +SUB_M)``) of query tile
    ``qb`` (shapes in :func:`_attn_bwd_dkdv_kernel`).

    Works on transposed scores S^T [BLOCK keys, SUB_M queries] so that the accumulators keep
    the key tile's row order.
    """
    offs_m = qb * BLOCK + sub * SUB_M + tl.arange(0, SUB_M)  # query tokens (columns of S^T)
    col_ok = offs_m < N
    q_t = tl.load(q_base + offs_m[None, :] * stride_qn + offs_d[:, None] * stride_qd,
                  mask=col_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_DIM, SUB_M] = Q^T
    do = tl.load(do_base + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # [SUB_M, HEAD_DIM]
    lse = tl.load(lse_base + offs_m * stride_ln, mask=col_ok, other=float("-inf"))
    delta = tl.load(delta_base + offs_m * stride_ln, mask=col_ok, other=0.0)
    # As in the dQ kernel: -inf LSE (row with no key, or padding) -> +inf so P^T is 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"),
                    lse * _stats_const(LOG2E, lse_base))
    qk_t = _dot(k, q_t, DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK keys, SUB_M queries]
    valid = col_ok[None, :]
    if PARTIAL:
        # Mask rows are queries (axis 1 here), bits keys (axis 0 here): the transposed slice.
        valid = valid & _mask_bits(masks, mask_id, sub * SUB_M, 0, stride_mu, stride_mr,
                                   stride_mw, SUB_M, BLOCK, True)
    p_t = tl.where(valid, tl.math.exp2(qk_t - lse2[None, :]), 0.0)
    # dP^T before the dV update (as Flex orders them): dS^T's element-wise work then waits only
    # for dP^T's MMA and overlaps dV's (KERNEL_NOTES.md, "v9").
    dp_t = _dot(v, tl.trans(do), DOT_PRECISION, DOT_UPCAST)
    dv += _dot(p_t.to(do.dtype), do, DOT_PRECISION, DOT_UPCAST)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += _dot(ds_t.to(q_t.dtype), tl.trans(q_t), DOT_PRECISION, DOT_UPCAST)
    return dk, dv


@triton.jit
def _dkdv_head(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_h, start_n, offs_d, d_ok, N,
               qk_scale, k_count, k_partial, k_index, k_mask_id, masks,
               stride_qb, stride_qh, stride_qn, stride_qd,
               stride_dob, stride_doh, stride_don, stride_dod,
               stride_lb, stride_lh, stride_ln,
               stride_ch, stride_cm, stride_ih, stride_im, stride_ik,
               stride_mu, stride_mr, stride_mw,
               BLOCK: tl.constexpr, SUB_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
               DOT_UPCAST: tl.constexpr, ALIGNED: tl.constexpr):
    """dK/dV contributions of query head ``off_h`` to key tile ``start_n``: its key-major list
    (partial entries first, then full ones), in sub-tiles of SUB_M queries."""
    off_h64 = off_h.to(tl.int64)
    q_base = Q + off_b * _hint16(stride_qb, ALIGNED) + off_h64 * _hint16(stride_qh, ALIGNED)
    do_base = DO + off_b * _hint16(stride_dob, ALIGNED) + off_h64 * _hint16(stride_doh, ALIGNED)
    l_off = off_b * _hint16(stride_lb, ALIGNED) + off_h64 * _hint16(stride_lh, ALIGNED)
    lse_base = LSE + l_off
    delta_base = Delta + l_off
    stride_qn = _hint16(stride_qn, ALIGNED)
    stride_don = _hint16(stride_don, ALIGNED)
    count = tl.load(k_count + off_h * stride_ch + start_n * stride_cm)
    n_partial = tl.load(k_partial + off_h * stride_ch + start_n * stride_cm)
    row = off_h * stride_ih + start_n * stride_im
    for it in range(0, n_partial * (BLOCK // SUB_M)):
        e = it // (BLOCK // SUB_M)
        qb = tl.load(k_index + row + e * stride_ik)
        mid = tl.load(k_mask_id + row + e * stride_ik)
        dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb,
                            it % (BLOCK // SUB_M), offs_d, d_ok, N, qk_scale, stride_qn,
                            stride_qd, stride_don, stride_dod, stride_ln, masks, mid, stride_mu,
                            stride_mr, stride_mw, BLOCK, SUB_M, True, DOT_PRECISION, DOT_UPCAST)
    for it in range(n_partial * (BLOCK // SUB_M), count * (BLOCK // SUB_M)):
        qb = tl.load(k_index + row + (it // (BLOCK // SUB_M)) * stride_ik)
        dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, qb,
                            it % (BLOCK // SUB_M), offs_d, d_ok, N, qk_scale, stride_qn,
                            stride_qd, stride_don, stride_dod, stride_ln, masks, 0, stride_mu,
                            stride_mr, stride_mw, BLOCK, SUB_M, False, DOT_PRECISION, DOT_UPCAST)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta,
    k_count, k_partial, k_index, k_mask_id, masks, k_order,
    sm_scale, sm_scale_lo, N, N_KV, H, GROUP,
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
    BLOCK: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK_WORDS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ORDERED: tl.constexpr, ALIGNED: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """dV = sum_i P_i^T dO_i and dK = sm_scale * sum_i dS_i^T Q_i over the key-major lists.

    Q, DO: [B, H, N, HEAD_DIM]; K, V, DK, DV: [B, H / GROUP, N_KV, HEAD_DIM]; LSE, Delta:
    [B, H, N] sharing strides stride_l*; k_count, k_partial, k_order: int32[H, NT_KV]; k_index,
    k_mask_id: int32[H, NT_KV, W'] (per *query* head; k_index lists query tiles; k_mask_id
    names the query-major mask); masks: int32[U, BLOCK, MASK_WORDS].
    One program per (key tile, b, kv head) (no atomics: bitwise-deterministic). It keeps the
    [BLOCK, HEAD_DIM] k, v, dk, dv tiles and walks, for each query head of its group in turn
    (GQA: heads g * GROUP .. g * GROUP + GROUP - 1, each with its own layout row; GROUPED is
    GROUP > 1, so plain multi-head attention compiles exactly the one-head body), each listed
    query tile in sub-tiles of SUB_M queries (one flattened loop per head, as
    FlashAttention-2 / the Triton tutorial do), so only [SUB_M, HEAD_DIM] q and dO tiles are
    live per step. The sum over the group is in a fixed order: deterministic.
    """
    tl.static_assert(BLOCK >= 16, "tl.dot needs tiles of at least 16")
    tl.static_assert(SUB_M >= 16 and BLOCK % SUB_M == 0, "query sub-tiles: >= 16, divide BLOCK")
    tl.static_assert(MASK_WORDS * 32 >= BLOCK, "one bit per key column of a tile")
    tl.static_assert(HEAD_DIM >= 16, "tl.dot needs a head dim of at least 16")
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM, "padded head dim covers the head dim")
    H_KV = H // GROUP
    start_n, off_bh = _program(k_order, stride_ch, stride_cm, H_KV, tl.cdiv(N_KV, BLOCK), GROUP,
                               ORDERED)
    N = _hint16(N, ALIGNED)
    N_KV = _hint16(N_KV, ALIGNED)
    off_b = (off_bh // H_KV).to(tl.int64)
    off_g = off_bh % H_KV  # kv head
    off_g64 = off_g.to(tl.int64)
    offs_n = start_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = _cols_ok(offs_d, HEAD_DIM, HEAD_DIM_PAD)
    key_ok = offs_n < N_KV

    k = tl.load(K + off_b * _hint16(stride_kb, ALIGNED) + off_g64 * _hint16(stride_kh, ALIGNED)
                + offs_n[:, None] * _hint16(stride_kn, ALIGNED) + offs_d[None, :] * stride_kd,
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + off_b * _hint16(stride_vb, ALIGNED) + off_g64 * _hint16(stride_vh, ALIGNED)
                + offs_n[:, None] * _hint16(stride_vn, ALIGNED) + offs_d[None, :] * stride_vd,
                mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    # Padding keys (>= N_KV) load K = V = 0 and are never stored, so their scores need no mask.
    scale = _softmax_scale(sm_scale, sm_scale_lo, Q)
    qk_scale = scale * _stats_const(LOG2E, Q)  # log2(e), as in forward

    dk = tl.zeros([BLOCK, HEAD_DIM_PAD], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM_PAD], tl.float32)
    if Q.dtype.element_ty == tl.float64:
        dk = dk.to(tl.float64)
        dv = dv.to(tl.float64)
    if GROUPED:
        for j in range(0, GROUP):
            dk, dv = _dkdv_head(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_g * GROUP + j,
                                start_n, offs_d, d_ok, N, qk_scale, k_count, k_partial, k_index,
                                k_mask_id, masks, stride_qb, stride_qh, stride_qn, stride_qd,
                                stride_dob, stride_doh, stride_don, stride_dod,
                                stride_lb, stride_lh, stride_ln, stride_ch, stride_cm,
                                stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw,
                                BLOCK, SUB_M, DOT_PRECISION, DOT_UPCAST, ALIGNED)
    else:
        dk, dv = _dkdv_head(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_g,
                            start_n, offs_d, d_ok, N, qk_scale, k_count, k_partial, k_index,
                            k_mask_id, masks, stride_qb, stride_qh, stride_qn, stride_qd,
                            stride_dob, stride_doh, stride_don, stride_dod,
                            stride_lb, stride_lh, stride_ln, stride_ch, stride_cm,
                            stride_ih, stride_im, stride_ik, stride_mu, stride_mr, stride_mw,
                            BLOCK, SUB_M, DOT_PRECISION, DOT_UPCAST, ALIGNED)
    dk = dk * scale  # gradient w.r.t. natural scaled scores, as in dQ
    tl.store(DK + off_b * _hint16(stride_dkb, ALIGNED) + off_g64 * _hint16(stride_dkh, ALIGNED)
             + offs_n[:, None] * _hint16(stride_dkn, ALIGNED) + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=key_ok[:, None] & d_ok[None, :])
    tl.store(DV + off_b * _hint16(stride_dvb, ALIGNED) + off_g64 * _hint16(stride_dvh, ALIGNED)
             + offs_n[:, None] * _hint16(stride_dvn, ALIGNED) + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=key_ok[:, None] & d_ok[None, :])
