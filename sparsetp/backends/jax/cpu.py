"""Native CPU path of block-sparse attention for JAX: plain ``jax.numpy`` (no callback, no Triton).

The algorithm of :mod:`sparsetp.backends.torch.cpu` on the metadata *arrays* of a
:class:`~sparsetp.backends.jax.attention.LayoutArrays` (which may be tracers: nothing here reads
their values on the host), so ``jit``, ``vmap`` and ``shard_map`` see ordinary XLA operations.
:mod:`sparsetp.backends.jax.attention` calls it for CPU platforms by default and from its
``custom_vjp`` backward; ``SPARSETP_INTERPRET=1`` runs the Triton kernels in the interpreter
instead (:mod:`sparsetp._runtime`).

Semantics (the kernels'): query tile ``I`` of head ``h`` attends to the listed key tiles of kv
head ``h // (H / H_kv)``, partial ones under their bitmask row, full ones unmasked except keys
past ``N_kv``; float32 accumulation (float64 for float64 inputs); natural-log LSE; rows with no
key give 0, LSE ``-inf`` and zero gradients. The backward recomputes P from the LSE and
scatter-adds dK/dV over the gathered tiles (XLA's CPU scatter is sequential: deterministic).

Shapes are static, so each row is padded to ``widest`` listed tiles (the layout's widest row,
:attr:`LayoutArrays.widest_row`; the ELL width when unknown), only the leading partial entries
(:attr:`LayoutArrays.partial_row` of them) gather element masks (the others are full tiles, empty
padding or the ragged last tile: compares against the row's count and ``N_kv``), and the query
tiles are processed in steps of a ``fori_loop`` over static runs of tiles, at most
:data:`CHUNK_ELEMENTS` per temporary: memory grows with the computed blocks of a step, never
with ``N x N``.

Example::

    >>> import jax.numpy as jnp, numpy as np
    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.causal(), seq_len=100, num_heads=2, block_size=32)
    >>> meta = {n: jnp.asarray(a) for n, a in lay.metadata().items()}
    >>> q = k = v = jnp.asarray(np.random.randn(1, 2, 100, 16), jnp.float32)
    >>> out, lse = forward(q, k, v, meta, 0.25, widest=lay.widest_row)
    >>> out.shape, lse.dtype
    ((1, 2, 100, 16), dtype('float32'))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsetp.backends.jax import compat

__all__ = ["forward", "backward", "CHUNK_ELEMENTS"]

# Elements of the largest temporary of one loop step (2 MiB of fp32). Small, because XLA's CPU
# runtime takes a program's temporaries from malloc on every call, and a block over 32 MiB
# (glibc's largest mmap threshold) comes back as fresh pages the kernel faults in and zeroes,
# which cost more than the arithmetic; a loop's steps reuse one set of buffers, in cache.
CHUNK_ELEMENTS = 1 << 19

_HI = jax.lax.Precision.HIGHEST


def _compute_dtype(dtype):
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _bounds(widest) -> tuple[int, int | None, tuple | None]:
    """``widest``: the static row bound, or ``(widest, partial, widths)`` with the bound on the
    partial entries per row and the per-query-tile row bounds (either None: unknown)."""
    return tuple(widest) if isinstance(widest, tuple) else (widest, None, None)


def _tables(meta, n_k: int, widest):
    """(key tiles [H, NT, W], blocked-element table [U + 3, bs, bs], ids [H, NT, E] of the first
    E entries, counts [H, NT, 1], n_k): the masks of entries past E come from the counts and
    n_k."""
    index, masks = meta["q_index"], meta["masks"]
    widest, n_partial, _ = _bounds(widest)
    w = min(widest, index.shape[-1]) if widest else index.shape[-1]
    index, mask_id = index[..., :w], meta["q_mask_id"][..., :w]
    count, partial = meta["q_count"][..., None], meta["q_partial"][..., None]
    bs = masks.shape[1]
    kt = -(-n_k // bs)
    ragged = n_k - (kt - 1) * bs  # valid keys in the last key tile
    c = jnp.arange(bs)
    bits = (jnp.right_shift(masks[:, :, c // 32], c % 32) & 1).astype(bool)  # [U, bs, bs]
    n_masks = masks.shape[0]
    # Non-partial entries get an extra row: full, full but ragged (keys past N_kv are zero
    # padding), or empty (ELL padding past q_count).
    extra = jnp.stack([jnp.ones((bs, bs), bool),
                       jnp.broadcast_to(c < ragged, (bs, bs)),
                       jnp.zeros((bs, bs), bool)])
    blocked = ~jnp.concatenate([bits, extra])
    e = jnp.arange(w)
    full_id = jnp.where((index == kt - 1) & (ragged < bs), n_masks + 1, n_masks)
    ids = jnp.where(e < partial, mask_id, jnp.where(e < count, full_id, n_masks + 2))
    return index, blocked, ids[..., :w if n_partial is None else min(n_partial, w)], count, n_k


def _tiles(t, n_tiles: int, bs: int, dtype):
    b, h, n, d = t.shape
    t = jnp.pad(t.astype(dtype), ((0, 0), (0, 0), (0, n_tiles * bs - n), (0, 0)))
    return t.reshape(b, h, n_tiles, bs, d)


def _plan(b, h, nt, bs, d, w, widths):
    """Static runs ``(t0, t1, w_c, ct, hc)``: query tiles ``[t0, t1)`` padded to ``w_c``
    entries, computed ``ct`` tiles of ``hc`` heads per step (:func:`_steps`), each step's
    temporaries at most :data:`CHUNK_ELEMENTS` where a tile of one head fits; heads are split
    (``hc < h``, then ``ct = 1``) only for a row too wide for one step. With per-tile
    ``widths``, a run holds tiles within 2x of each other's width, so one wide row (a global
    token) widens only its own."""
    per_head = b * bs * max(bs, d)  # per listed entry of one tile of one head
    widths = [w] * nt if widths is None else [max(1, min(int(x), w)) for x in widths]
    runs, t0 = [], 0
    while t0 < nt:
        t1, lo, hi = t0 + 1, widths[t0], widths[t0]
        while t1 < nt and max(hi, widths[t1]) <= 2 * min(lo, widths[t1]):
            lo, hi = min(lo, widths[t1]), max(hi, widths[t1])
            t1 += 1
        fit = CHUNK_ELEMENTS // (per_head * hi)  # (tile, head) pairs per step
        hc = h if fit >= h else max(x for x in range(1, max(fit, 1) + 1) if h % x == 0)
        runs.append((t0, t1, hi, max(1, min(t1 - t0, fit // h)), hc))
        t0 = t1
    return runs


def _steps(runs, h: int, step, carry, operands):
    """``carry = step(carry, t0, ct, w_c, h0, hc)`` for query tiles ``[t0, t0 + ct)`` of heads
    ``[h0, h0 + hc)`` over every run: a ``fori_loop`` over a run's whole steps (starts traced:
    one small set of temporaries that every step reuses, where a program's large temporaries
    are mapped and zeroed afresh by each call), then one step of the rest. Inside
    ``shard_map`` the carry starts varying over every mesh axis an array of ``operands`` (a
    pytree) varies over, as the steps' results do: a loop's carry must keep its type."""
    carry = compat.mark_varying_like(carry, operands)
    for t0, t1, w_c, ct, hc in runs:
        groups, whole = h // hc, (t1 - t0) // ct

        def body(i, c, t0=t0, ct=ct, w_c=w_c, hc=hc, groups=groups):
            h0 = 0 if groups == 1 else (i % groups) * hc
            return step(c, t0 + (i // groups) * ct, ct, w_c, h0, hc)

        if whole * groups == 1:
            carry = step(carry, t0, ct, w_c, 0, hc)
        else:
            carry = jax.lax.fori_loop(0, whole * groups, body, carry)
        if t0 + whole * ct < t1:  # groups == 1 here: split heads come with ct = 1
            carry = step(carry, t0 + whole * ct, t1 - t0 - whole * ct, w_c, 0, hc)
    return carry


def _operands(q, k, v, meta, widest: int):
    """What forward and backward share: the tables, the compute dtype, the block size and the
    row width, the query and key tile counts, q/k/v as zero-padded tiles in that dtype, and
    each query head's kv head ``[H, 1, 1]`` (GQA)."""
    h, h_kv, n_k = q.shape[1], k.shape[1], k.shape[2]
    cdt = _compute_dtype(q.dtype)
    tables = _tables(meta, n_k, widest)
    bs, w = tables[1].shape[-1], tables[0].shape[-1]
    nt, kt_n = -(-q.shape[2] // bs), -(-n_k // bs)
    qt, kt, vt = _tiles(q, nt, bs, cdt), _tiles(k, kt_n, bs, cdt), _tiles(v, kt_n, bs, cdt)
    kv_head = (jnp.arange(h) // (h // h_kv))[:, None, None]
    return tables, cdt, bs, w, nt, kt_n, qt, kt, vt, kv_head


def _window(a, h0, hc: int, t0, ct: int, axis: int = 0):
    """``a`` cut to heads ``[h0, h0 + hc)`` along ``axis`` and query tiles ``[t0, t0 + ct)``
    along the next axis (starts an int or traced)."""
    starts, sizes = [0] * a.ndim, list(a.shape)
    starts[axis], starts[axis + 1], sizes[axis], sizes[axis + 1] = h0, t0, hc, ct
    return jax.lax.dynamic_slice(a, starts, sizes)


def _put(a, x, h0, t0):
    """``a`` [B, H, NT, ...] with ``x`` written at heads ``h0...``, query tiles ``t0...``."""
    return jax.lax.dynamic_update_slice(a, x, (0, h0, t0) + (0,) * (a.ndim - 3))


def _chunk(tables, kt, vt, kv_head, qt, t0, ct: int, w: int, h0, hc: int, scale):
    """For query tiles ``[t0, t0 + ct)`` of heads ``[h0, h0 + hc)`` (starts may be traced),
    their rows cut to their first ``w`` entries: the key tiles [hc, ct, W], the scaled q tiles
    [B, hc, ct, bs, D], the gathered K/V tiles [B, hc, ct, W*bs, D] and the masked, scaled
    scores [B, hc, ct, bs, W*bs]."""
    index, blocked, ids, count, n_k = tables
    b, _, _, bs, d = qt.shape
    idx = _window(index, h0, hc, t0, ct)[..., :w]
    # One take of whole tiles over the flattened (kv head, tile) axis, as the torch path does;
    # "clip" (the indices are in range) spares the out-of-range select "fill" would add.
    h_kv, n_t = kt.shape[1], kt.shape[2]
    rows = (_window(kv_head, h0, hc, 0, 1) * n_t + idx).reshape(-1)
    k_g = jnp.take(kt.reshape(b, h_kv * n_t, bs, d), rows, axis=1, mode="clip")
    v_g = jnp.take(vt.reshape(b, h_kv * n_t, bs, d), rows, axis=1, mode="clip")
    k_g, v_g = k_g.reshape(b, hc, ct, w * bs, d), v_g.reshape(b, hc, ct, w * bs, d)
    # Scaling q (bs x D per tile) instead of the scores (bs x W*bs): less work, same product up
    # to fp32 rounding. Contracting D of both operands: no transposed copy of the gathered K.
    q_c = _window(qt, h0, hc, t0, ct, axis=1) * scale
    s = jax.lax.dot_general(q_c, k_g, (((4,), (4,)), ((0, 1, 2), (0, 1, 2))), precision=_HI)
    e = min(ids.shape[-1], w)
    mask = blocked[_window(ids, h0, hc, t0, ct)[..., :e]].transpose(0, 1, 3, 2, 4)
    mask = mask.reshape(hc, ct, bs, e * bs)
    if e < w:  # the other entries: padding past the row's count, keys past N_kv
        pos = jnp.arange(e, w)[:, None]
        rest = (pos >= _window(count, h0, hc, t0, ct)[..., None]) | \
            (idx[..., e:, None] * bs + jnp.arange(bs) >= n_k)
        rest = jnp.broadcast_to(rest.reshape(hc, ct, 1, (w - e) * bs), (hc, ct, bs, (w - e) * bs))
        mask = jnp.concatenate([mask, rest], axis=-1)
    return idx, q_c, k_g, v_g, jnp.where(mask, -jnp.inf, s)


def forward(q, k, v, meta, scale: float, *, widest: int | tuple = 0):
    """``(out [B, H, N, D] in q's dtype, lse [B, H, N] float32/float64)`` for the layout
    metadata ``meta`` (the arrays of ``LayoutArrays.metadata()``); ``widest``: a static bound on
    the listed tiles per row (0: the ELL width), or ``(that, bound on the partial tiles per
    row, per-query-tile bounds)`` (``LayoutArrays.widest_row, partial_row, row_widths``)."""
    b, h, n, d = q.shape
    tables, cdt, bs, w, nt, kt_n, qt, kt, vt, kv_head = _operands(q, k, v, meta, widest)

    def step(carry, t0, ct, w_c, h0, hc):
        out, lse = carry
        _, _, _, v_g, s = _chunk(tables, kt, vt, kv_head, qt, t0, ct, w_c, h0, hc, scale)
        m = s.max(-1, keepdims=True)
        # A row with no allowed key has max -inf: shift by 0 instead, so exp gives 0s (not
        # NaN), the output 0 and log(0) = -inf the LSE.
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        denom = p.sum(-1, keepdims=True)
        o = jnp.matmul(p, v_g, precision=_HI) / jnp.where(denom > 0, denom, 1.0)
        return _put(out, o, h0, t0), _put(lse, (m + jnp.log(denom))[..., 0], h0, t0)

    out, lse = _steps(_plan(b, h, nt, bs, d, w, _bounds(widest)[2]), h, step,
                      (jnp.zeros((b, h, nt, bs, d), cdt), jnp.zeros((b, h, nt, bs), cdt)),
                      (q, k, v, meta))
    out = out.reshape(b, h, nt * bs, d)[:, :, :n]
    lse = lse.reshape(b, h, nt * bs)[:, :, :n]
    return out.astype(q.dtype), lse


def backward(q, k, v, out, lse, d_out, d_lse, meta, scale: float, *, widest: int | tuple = 0):
    """``(dq, dk, dv)`` in the inputs' dtypes for the cotangents ``d_out`` and ``d_lse`` (or
    None) of :func:`forward`'s results."""
    b, h, n, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    tables, cdt, bs, w, nt, kt_n, qt, kt, vt, kv_head = _operands(q, k, v, meta, widest)
    dot = _tiles(d_out, nt, bs, cdt)
    lse = lse.astype(cdt)
    finite = jnp.isfinite(lse)
    # Delta_i = sum_d dO_id O_id; an LSE cotangent enters dS = P * (dP - Delta) as Delta - d_lse
    # (zero on rows with no key, whose d_lse may meet an inf).
    delta = (d_out.astype(cdt) * out.astype(cdt)).sum(-1)
    if d_lse is not None:
        delta = delta - jnp.where(finite, d_lse.astype(cdt), 0.0)
    # LSE +inf on rows with no key makes every exp(s - lse) 0 (-inf would give NaN).
    lse_t = _tiles(jnp.where(finite, lse, jnp.inf)[..., None], nt, bs, cdt)
    delta_t = _tiles(delta[..., None], nt, bs, cdt)

    def step(carry, t0, ct, w_c, h0, hc):
        dq, dk_t, dv_t = carry
        idx, q_c, k_g, v_g, s = _chunk(tables, kt, vt, kv_head, qt, t0, ct, w_c, h0, hc, scale)
        do_c = _window(dot, h0, hc, t0, ct, axis=1)
        p = jnp.exp(s - _window(lse_t, h0, hc, t0, ct, axis=1))         # [B, hc, ct, bs, W*bs]
        dp = jax.lax.dot_general(do_c, v_g, (((4,), (4,)), ((0, 1, 2), (0, 1, 2))),
                                 precision=_HI)
        ds = p * (dp - _window(delta_t, h0, hc, t0, ct, axis=1))
        dq_c = jnp.matmul(ds, k_g, precision=_HI) * scale
        # dK^T = scale Q^T dS and dV^T = dO^T P [B, hc, ct, D, W*bs], the small operand
        # transposed: plain matmuls, which XLA's CPU backend gives its fast matmul library,
        # where dS^T Q (contracting the leading axis of both) takes a generic dot several times
        # slower. The tiles accumulate transposed.
        dkt_g = jnp.matmul(q_c.swapaxes(-1, -2), ds, precision=_HI)
        dvt_g = jnp.matmul(do_c.swapaxes(-1, -2), p, precision=_HI)

        def tiles(x):  # [B, hc, ct, D, W*bs] -> [B, hc*ct*W, D, bs]
            x = x.reshape(b, hc, ct, d, w_c, bs).transpose(0, 1, 2, 4, 3, 5)
            return x.reshape(b, hc * ct * w_c, d, bs)

        # Entries past a row's count have P = 0: they add exact zeros to key tile 0.
        dest = (_window(kv_head, h0, hc, 0, 1) * kt_n + idx).reshape(-1)
        return (_put(dq, dq_c, h0, t0), dk_t.at[:, dest].add(tiles(dkt_g)),
                dv_t.at[:, dest].add(tiles(dvt_g)))

    dq, dk_t, dv_t = _steps(_plan(b, h, nt, bs, d, w, _bounds(widest)[2]), h, step,
                            (jnp.zeros((b, h, nt, bs, d), cdt),
                             jnp.zeros((b, h_kv * kt_n, d, bs), cdt),
                             jnp.zeros((b, h_kv * kt_n, d, bs), cdt)),
                            (q, k, v, out, lse, d_out, d_lse, meta))
    dq = dq.reshape(b, h, nt * bs, d)[:, :, :n]
    dk = dk_t.swapaxes(-1, -2).reshape(b, h_kv, kt_n * bs, d)[:, :, :n_k]
    dv = dv_t.swapaxes(-1, -2).reshape(b, h_kv, kt_n * bs, d)[:, :, :n_k]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
