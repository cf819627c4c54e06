"""float64 numpy oracle for every sparsetp op.

Plain, obviously-correct implementations over dense masks (O(N^2) memory: for tests only).
Every function takes and returns numpy arrays and computes in float64 whatever the input dtype.

Conventions: attention tensors are ``[B, H, N, D]``; a row with no allowed key has output 0 and
log-sum-exp ``-inf`` and passes no gradient (never NaN).

>>> import numpy as np
>>> from sparsetp.core import patterns as P, make_layout, reference
>>> lay = make_layout(P.causal(), seq_len=8, num_heads=1, block_size=16)
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 1, 8, 4))
>>> out, lse = reference.attention(q, k, v, lay)
>>> out.shape, lse.shape
((1, 1, 8, 4), (1, 1, 8))
"""

from __future__ import annotations

import numpy as np

from sparsetp.core.layout import BlockLayout

__all__ = ["attention", "attention_grad"]


def _f64(*xs):
    return [np.asarray(x, dtype=np.float64) for x in xs]


def _probs(q, k, layout: BlockLayout, scale):
    mask = layout.dense_mask()[None]  # [1, H, N, N]
    s = np.einsum("bhnd,bhmd->bhnm", q, k) * scale
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    has_key = np.isfinite(m)
    m = np.where(has_key, m, 0.0)
    e = np.where(mask, np.exp(s - m), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    p = np.where(has_key, e / np.where(has_key, denom, 1.0), 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(has_key[..., 0], m[..., 0] + np.log(np.where(has_key, denom, 1.0))[..., 0],
                       -np.inf)
    return p, lse


def _check(q, k, v, layout):
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one [B, H, N, D] shape, got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if q.shape[1] != layout.num_heads or q.shape[2] != layout.seq_len:
        raise ValueError(f"layout is for H={layout.num_heads}, N={layout.seq_len}, got q of shape "
                         f"{q.shape}")


def attention(q, k, v, layout: BlockLayout, scale: float | None = None):
    """Masked softmax attention: returns ``(out [B,H,N,D], lse [B,H,N])`` in float64."""
    q, k, v = _f64(q, k, v)
    _check(q, k, v, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    p, lse = _probs(q, k, layout, scale)
    return np.einsum("bhnm,bhmd->bhnd", p, v), lse


def attention_grad(q, k, v, layout: BlockLayout, d_out, scale: float | None = None):
    """Gradients ``(dq, dk, dv)`` of ``attention(...)[0]`` for the cotangent ``d_out``."""
    q, k, v, d_out = _f64(q, k, v, d_out)
    _check(q, k, v, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    p, _ = _probs(q, k, layout, scale)
    dv = np.einsum("bhnm,bhnd->bhmd", p, d_out)
    dp = np.einsum("bhnd,bhmd->bhnm", d_out, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhnm,bhmd->bhnd", ds, k)
    dk = np.einsum("bhnm,bhnd->bhmd", ds, q)
    return dq, dk, dv
