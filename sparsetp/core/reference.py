"""float64 numpy oracle for every sparsetp op.

Plain, obviously-correct implementations over dense masks (O(N^2) memory: for tests only).
Every function takes and returns numpy arrays and computes in float64 whatever the input dtype.

Conventions: attention tensors are ``[B, H, N, D]``; a row with no allowed key has output 0 and
log-sum-exp ``-inf`` and passes no gradient (never NaN). ``k`` and ``v`` may be
``[B, H_kv, N_k, D]``: grouped-query attention (``H % H_kv == 0``, query head ``h`` uses kv
head ``h // (H // H_kv)``; dK/dV sum over each group) and ``N_k`` keys for ``N_q`` queries
(the layout's ``kv_len``; its docstring states the bottom-right alignment). A per-row layout
(``layout.batch = B``, e.g. per-row packed documents) gives batch row ``b`` its own mask.

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
from sparsetp.core.model import check_tokens, join_block_params, split_block_params

__all__ = ["attention", "attention_grad"]


def _f64(*xs):
    return [np.asarray(x, dtype=np.float64) for x in xs]


def _t(x):
    """Swap the last two axes. The oracle's products are batched float64 matmuls (BLAS), not
    ``np.einsum`` (no BLAS without ``optimize``): the block oracle at N=1000 took over a minute
    in einsum on the GPU machine and outran the parity run's time limit."""
    return np.swapaxes(x, -1, -2)


def _group(q, k) -> int:
    return q.shape[1] // k.shape[1]


def _expand(x, group):
    """[B, H_kv, ...] -> [B, H_kv * group, ...]: kv head g serves query heads g*group ...
    (the oracle may repeat K, V; the kernels never do)."""
    return np.repeat(x, group, axis=1)


def _reduce(x, group):
    """[B, H, ...] -> [B, H / group, ...]: sum each group of query heads (dK, dV of GQA)."""
    b, h = x.shape[:2]
    return x.reshape(b, h // group, group, *x.shape[2:]).sum(axis=2)


def _probs(q, k, layout: BlockLayout, scale):
    mask = layout.dense_mask()  # [H, N_q, N_k], or [B, H, N_q, N_k] for a per-row layout
    mask = mask if layout.batch is not None else mask[None]
    s = q @ _t(k) * scale
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
    if (q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != q.shape[0]
            or k.shape[3] != q.shape[3]):
        raise ValueError(f"q must be [B, H, N, D] and k, v one [B, H_kv, N_k, D] shape, got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q has H={q.shape[1]} heads, not a multiple of H_kv={k.shape[1]}")
    if q.shape[1] != layout.num_heads or q.shape[2] != layout.seq_len:
        raise ValueError(f"layout is for H={layout.num_heads}, N={layout.seq_len}, got q of shape "
                         f"{q.shape}")
    if k.shape[2] != layout.kv_len:
        raise ValueError(f"layout is for kv_len={layout.kv_len}, got k of shape {k.shape}")
    if layout.batch is not None and layout.batch != q.shape[0]:
        raise ValueError(f"layout is per-batch-row for batch={layout.batch}, got q of shape "
                         f"{q.shape}")


def attention(q, k, v, layout: BlockLayout, scale: float | None = None):
    """Masked softmax attention: returns ``(out [B,H,N,D], lse [B,H,N])`` in float64."""
    q, k, v = _f64(q, k, v)
    _check(q, k, v, layout)
    g = _group(q, k)
    k, v = _expand(k, g), _expand(v, g)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    p, lse = _probs(q, k, layout, scale)
    return p @ v, lse


def attention_grad(q, k, v, layout: BlockLayout, d_out, scale: float | None = None):
    """Gradients ``(dq, dk, dv)`` of ``attention(...)[0]`` for the cotangent ``d_out``
    (``dk``, ``dv`` in k's ``[B, H_kv, N_k, D]`` shape)."""
    q, k, v, d_out = _f64(q, k, v, d_out)
    _check(q, k, v, layout)
    g = _group(q, k)
    k, v = _expand(k, g), _expand(v, g)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    p, _ = _probs(q, k, layout, scale)
    dv = _t(p) @ d_out
    dp = d_out @ _t(v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = ds @ k
    dk = _t(ds) @ q
    return dq, _reduce(dk, g), _reduce(dv, g)


# ---------------------------------------------------------------------------------------------
# Hybrid block oracle: layer norm, GELU (tanh), MLP and the pre-norm block, forward and a
# hand-written backward (checked against finite differences in tests/reference_test.py).

__all__ += ["layer_norm", "layer_norm_grad", "gelu_tanh", "gelu_tanh_grad", "mlp", "mlp_grad",
            "hybrid_block", "hybrid_block_grad", "hybrid_block_value_and_grad"]

_GELU_C = np.sqrt(2.0 / np.pi)  # GELU tanh approximation: 0.5 x (1 + tanh(c (x + a x^3)))
_GELU_A = 0.044715


def layer_norm(x, weight, bias, eps: float = 1e-5):
    """Layer norm over the last dim (biased variance, like torch and flax): float64."""
    x, weight, bias = _f64(x, weight, bias)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * weight + bias


def layer_norm_grad(x, weight, eps, dy):
    """``(dx, dweight, dbias)`` of ``layer_norm(x, weight, bias, eps)`` for cotangent ``dy``."""
    x, weight, dy = _f64(x, weight, dy)
    mu = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    red = tuple(range(x.ndim - 1))
    dweight = (dy * xhat).sum(red)
    dbias = dy.sum(red)
    g = dy * weight
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx, dweight, dbias


def gelu_tanh(x):
    """GELU, tanh approximation (``torch.nn.functional.gelu(approximate="tanh")``)."""
    (x,) = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * (x + _GELU_A * x ** 3)))


def gelu_tanh_grad(x, dy):
    """``dy * gelu_tanh'(x)``."""
    x, dy = _f64(x, dy)
    t = np.tanh(_GELU_C * (x + _GELU_A * x ** 3))
    d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * x * x)
    return dy * d


def _mlp_arrays(params_or_arrays):
    """(w1, b1, w2, b2) from a canonical dict (``mlp.fc1.weight`` ...) or a 4-sequence."""
    if isinstance(params_or_arrays, dict):
        p = params_or_arrays
        return (p["mlp.fc1.weight"], p.get("mlp.fc1.bias"), p["mlp.fc2.weight"],
                p.get("mlp.fc2.bias"))
    w1, b1, w2, b2 = params_or_arrays
    return w1, b1, w2, b2


def _linear(x, w, b):
    y = x @ np.asarray(w, np.float64)
    return y if b is None else y + np.asarray(b, np.float64)


def mlp(params_or_arrays, x):
    """``fc2(gelu_tanh(fc1(x)))``; weights ``[in, out]``; biases may be None. float64.

    ``params_or_arrays``: a canonical param dict or ``(w1, b1, w2, b2)``.
    """
    w1, b1, w2, b2 = _mlp_arrays(params_or_arrays)
    (x,) = _f64(x)
    return _linear(gelu_tanh(_linear(x, w1, b1)), w2, b2)


def _linear_grad(x, w, dy, has_bias):
    """(dx, dw, db) of ``x @ w + b`` over any leading dims."""
    dx = dy @ w.T
    dw = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])
    db = dy.reshape(-1, dy.shape[-1]).sum(0) if has_bias else None
    return dx, dw, db


def mlp_grad(params_or_arrays, x, dy):
    """``(dx, (dw1, db1, dw2, db2))`` of :func:`mlp` (db* None where the bias is None)."""
    w1, b1, w2, b2 = _mlp_arrays(params_or_arrays)
    x, dy, w1, w2 = _f64(x, dy, w1, w2)
    h = _linear(x, w1, b1)
    a = gelu_tanh(h)
    da, dw2, db2 = _linear_grad(a, w2, dy, b2 is not None)
    dh = gelu_tanh_grad(h, da)
    dx, dw1, db1 = _linear_grad(x, w1, dh, b1 is not None)
    return dx, (dw1, db1, dw2, db2)


def _block_layout(config, batch, seq_len, document_lengths=None):
    from sparsetp.core.config import with_documents  # local: keeps the module header untouched
    from sparsetp.core.layout import make_layout
    pattern = with_documents(config.pattern, document_lengths, batch=batch, seq_len=seq_len)
    return make_layout(pattern, seq_len, config.num_heads, config.block_size)


def _split_heads(qkv, config):
    """[B, N, d + 2kv] (group-major columns, see :mod:`sparsetp.core.config`) -> q [B, H, N, hd],
    k, v [B, H_kv, N, hd]."""
    b, n, _ = qkv.shape
    hk, g, hd = config.num_kv_heads, config.kv_group, config.head_dim
    t = qkv.reshape(b, n, hk, g + 2, hd).transpose(0, 2, 3, 1, 4)  # [B, Hk, G+2, N, hd]
    q = t[:, :, :g].reshape(b, hk * g, n, hd)
    return q, t[:, :, g], t[:, :, g + 1]


def _merge_qkv(dq, dk, dv, config):
    """Inverse of :func:`_split_heads`: [B, H, N, hd], [B, H_kv, N, hd] x 2 -> [B, N, d + 2kv]."""
    b, _, n, hd = dq.shape
    hk, g = config.num_kv_heads, config.kv_group
    t = np.concatenate([dq.reshape(b, hk, g, n, hd), dk[:, :, None], dv[:, :, None]], axis=2)
    return t.transpose(0, 3, 1, 2, 4).reshape(b, n, hk * (g + 2) * hd)


def _merge_heads(o):
    """[B, H, N, hd] -> [B, N, H*hd] (columns h*hd + e)."""
    b, h, n, hd = o.shape
    return o.transpose(0, 2, 1, 3).reshape(b, n, h * hd)


def _block_forward(params, x, config, document_lengths=None):
    """Forward with every intermediate the backward needs."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    (x,) = _f64(x)
    if x.ndim != 3 or x.shape[-1] != config.d_model:
        raise ValueError(f"x must be [B, N, d_model={config.d_model}], got {x.shape}")
    layout = _block_layout(config, x.shape[0], x.shape[1], document_lengths)
    scale = config.head_dim ** -0.5
    eps = config.norm_eps
    h1 = layer_norm(x, p["ln1.weight"], p["ln1.bias"], eps)
    qkv = _linear(h1, p["attn.qkv.weight"], p.get("attn.qkv.bias"))
    q, k, v = _split_heads(qkv, config)
    o, _ = attention(q, k, v, layout, scale=scale)
    o_m = _merge_heads(o)
    y1 = x + _linear(o_m, p["attn.out.weight"], p.get("attn.out.bias"))
    h2 = layer_norm(y1, p["ln2.weight"], p["ln2.bias"], eps)
    f = _linear(h2, p["mlp.fc1.weight"], p.get("mlp.fc1.bias"))
    a = gelu_tanh(f)
    y = y1 + _linear(a, p["mlp.fc2.weight"], p.get("mlp.fc2.bias"))
    return y, dict(p=p, x=x, layout=layout, scale=scale, h1=h1, q=q, k=k, v=v, o_m=o_m, y1=y1,
                   h2=h2, f=f, a=a)


def hybrid_block(params, x, config, document_lengths=None):
    """Pre-norm hybrid block ``y = y1 + MLP(LN2(y1))``, ``y1 = x + Attn(LN1(x))``, float64.

    ``params``: canonical unsharded dict (see :mod:`sparsetp.core.config`); ``x``: ``[B, N, d]``.
    Attention uses ``make_layout(config.pattern, N, num_heads, config.block_size)`` and scale
    ``head_dim ** -0.5``; with ``document_lengths`` (one list shared by the rows, or one list per
    row) the pattern is ``P.documents(lengths) & config.pattern`` (``core.config.with_documents``).
    """
    return _block_forward(params, x, config, document_lengths)[0]


def hybrid_block_grad(params, x, config, dy, document_lengths=None):
    """``(dx, dparams)`` of :func:`hybrid_block` for cotangent ``dy``, by hand (float64).

    ``dparams`` has the canonical names and unsharded shapes of ``params``.
    """
    return hybrid_block_value_and_grad(params, x, config, dy, document_lengths)[1:]


def hybrid_block_value_and_grad(params, x, config, dy, document_lengths=None):
    """``(y, dx, dparams)``: :func:`hybrid_block` and :func:`hybrid_block_grad` sharing one
    forward pass."""
    y, c = _block_forward(params, x, config, document_lengths)
    p, eps = c["p"], config.norm_eps
    (dy,) = _f64(dy)
    has_b = config.bias
    g = {}
    # y = y1 + fc2(gelu(fc1(ln2(y1))))
    da, g["mlp.fc2.weight"], db = _linear_grad(c["a"], p["mlp.fc2.weight"], dy, has_b)
    if has_b:
        g["mlp.fc2.bias"] = db
    df = gelu_tanh_grad(c["f"], da)
    dh2, g["mlp.fc1.weight"], db = _linear_grad(c["h2"], p["mlp.fc1.weight"], df, has_b)
    if has_b:
        g["mlp.fc1.bias"] = db
    dy1_ln, g["ln2.weight"], g["ln2.bias"] = layer_norm_grad(c["y1"], p["ln2.weight"], eps, dh2)
    dy1 = dy + dy1_ln
    # y1 = x + out(attn(split(qkv(ln1(x)))))
    do_m, g["attn.out.weight"], db = _linear_grad(c["o_m"], p["attn.out.weight"], dy1, has_b)
    if has_b:
        g["attn.out.bias"] = db
    b, n, _ = do_m.shape
    do = do_m.reshape(b, n, config.num_heads, config.head_dim).transpose(0, 2, 1, 3)
    dq, dk, dv = attention_grad(c["q"], c["k"], c["v"], c["layout"], do, scale=c["scale"])
    dqkv = _merge_qkv(dq, dk, dv, config)
    dh1, g["attn.qkv.weight"], db = _linear_grad(c["h1"], p["attn.qkv.weight"], dqkv, has_b)
    if has_b:
        g["attn.qkv.bias"] = db
    dx_ln, g["ln1.weight"], g["ln1.bias"] = layer_norm_grad(c["x"], p["ln1.weight"], eps, dh1)
    dx = dy1 + dx_ln
    return y, dx, {name: g[name] for name in params}


# ---------------------------------------------------------------------------------------------
# GPT oracle: embeddings, a stack of hybrid blocks, final layer norm, untied head, and the
# masked next-token cross-entropy, forward and a hand-written backward (float64).

__all__ += ["gpt_forward", "gpt_loss", "gpt_value_and_grad"]


def _gpt_parts(params, tokens, config):
    tokens = np.asarray(tokens)
    check_tokens(tokens.shape, tokens.dtype, config, values=tokens)
    outer, blocks = split_block_params(params, config)
    return tokens, {n: np.asarray(a, np.float64) for n, a in outer.items()}, blocks


def gpt_forward(params, tokens, config, document_lengths=None):
    """Logits ``[B, N, vocab_size]`` (float64) of the GPT of :mod:`sparsetp.core.model` on
    integer ``tokens [B, N]``: ``LN_f(blocks(embed[tokens] + pos[:N])) @ head``; every block
    gets ``document_lengths`` (:func:`hybrid_block`; positions stay absolute)."""
    tokens, o, blocks = _gpt_parts(params, tokens, config)
    x = o["embed.weight"][tokens] + o["pos.weight"][: tokens.shape[1]]
    for bp in blocks:
        x = hybrid_block(bp, x, config.block, document_lengths)
    h = layer_norm(x, o["ln_f.weight"], o["ln_f.bias"], config.block.norm_eps)
    return h @ o["head.weight"]


def _log_softmax(logits):
    m = logits.max(-1, keepdims=True)
    z = logits - m
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def gpt_loss(logits, targets, mask=None):
    """Masked mean next-token cross-entropy (float64): ``sum(mask * nll) / max(sum(mask), 1)``
    where ``nll[b, t] = -log softmax(logits[b, t])[targets[b, t]]``; ``mask`` (bool or 0/1,
    ``[B, N]``) defaults to every position. The frontends' ``loss`` helpers compute the same."""
    (logits,) = _f64(logits)
    targets = np.asarray(targets)
    mask = np.ones(targets.shape) if mask is None else np.asarray(mask, np.float64)
    logp = _log_softmax(logits)
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float((nll * mask).sum() / max(mask.sum(), 1.0))


def gpt_value_and_grad(params, tokens, targets, mask, config, document_lengths=None):
    """``(loss, grads)``: :func:`gpt_loss` of :func:`gpt_forward` and its gradient w.r.t. every
    canonical parameter (same names and shapes), by hand through
    :func:`hybrid_block_value_and_grad` (float64)."""
    tokens, o, blocks = _gpt_parts(params, tokens, config)
    targets = np.asarray(targets)
    mask = np.ones(targets.shape) if mask is None else np.asarray(mask, np.float64)
    n, eps = tokens.shape[1], config.block.norm_eps
    xs = [o["embed.weight"][tokens] + o["pos.weight"][:n]]
    for bp in blocks:
        xs.append(hybrid_block(bp, xs[-1], config.block, document_lengths))
    h = layer_norm(xs[-1], o["ln_f.weight"], o["ln_f.bias"], eps)
    logits = h @ o["head.weight"]
    loss = gpt_loss(logits, targets, mask)
    # d loss / d logits = (softmax - onehot) * mask / count
    dlogits = np.exp(_log_softmax(logits))
    np.put_along_axis(dlogits, targets[..., None],
                      np.take_along_axis(dlogits, targets[..., None], -1) - 1.0, -1)
    dlogits *= (mask / max(mask.sum(), 1.0))[..., None]
    g = {}
    dh, g["head.weight"], _ = _linear_grad(h, o["head.weight"], dlogits, False)
    dx, g["ln_f.weight"], g["ln_f.bias"] = layer_norm_grad(xs[-1], o["ln_f.weight"], eps, dh)
    block_grads = [None] * len(blocks)
    for i in reversed(range(len(blocks))):
        _, dx, block_grads[i] = hybrid_block_value_and_grad(blocks[i], xs[i], config.block, dx,
                                                            document_lengths)
    g["embed.weight"] = np.zeros_like(o["embed.weight"])
    np.add.at(g["embed.weight"], tokens.reshape(-1), dx.reshape(-1, dx.shape[-1]))
    g["pos.weight"] = np.zeros_like(o["pos.weight"])
    g["pos.weight"][:n] = dx.sum(0)
    return loss, join_block_params(g, block_grads)
