"""A GPT of :func:`hybrid_block` s in JAX, on the canonical parameters of
:mod:`sparsetp.core.model`.

``logits = LN_f(blocks(embed[tokens] + pos[:N])) @ head``: a pure function of the flat canonical
parameter dict, so ``jax.grad`` / optax work on the dict directly. With a ``mesh`` every block
runs tensor-parallel over ``axis_name`` (see :mod:`sparsetp.backends.jax.block`); the
embeddings, the final norm and the head are replicated (:func:`shard_gpt_params` places them).

>>> import numpy as np
>>> from sparsetp.core import GPTConfig, HybridConfig, init_gpt_params, patterns as P
>>> blk = HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=P.causal(), block_size=16)
>>> cfg = GPTConfig(vocab_size=50, num_layers=2, max_seq_len=64, block=blk)
>>> params = load_gpt_params(init_gpt_params(cfg, seed=0), cfg)
>>> gpt(params, np.zeros((2, 64), np.int32), cfg).shape
(2, 64, 50)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsetp.backends.jax.block import _layer_norm, hybrid_block, shard_params
from sparsetp.backends.jax.layers import linear
from sparsetp.core.model import (
    GPTConfig,
    check_gpt_params,
    check_tokens,
    gpt_param_shapes,
    join_block_params,
    split_block_params,
)

__all__ = ["gpt", "loss", "load_gpt_params", "shard_gpt_params", "export_gpt_params"]


def load_gpt_params(params: Mapping[str, Any], config: GPTConfig) -> dict[str, jax.Array]:
    """Canonical params (numpy, torch-exported, ...) as JAX arrays on the default device,
    checked against ``config``; values and dtypes kept bit for bit."""
    check_gpt_params(params, config)
    return {n: jnp.asarray(np.asarray(params[n])) for n in gpt_param_shapes(config)}


def shard_gpt_params(params: Mapping[str, Any], config: GPTConfig, mesh: jax.sharding.Mesh,
                     axis_name: str = "tp") -> dict[str, jax.Array]:
    """Place canonical params on ``mesh``: each block's arrays split as
    :func:`sparsetp.backends.jax.block.shard_params` splits them, the rest replicated."""
    outer, blocks = split_block_params(params, config)
    rep = NamedSharding(mesh, P())
    outer = {n: jax.device_put(np.asarray(a) if not isinstance(a, jax.Array) else a, rep)
             for n, a in outer.items()}
    return join_block_params(
        outer, [shard_params(b, config.block, mesh, axis_name) for b in blocks])


def export_gpt_params(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical unsharded numpy arrays (gathers sharded arrays), fresh writable copies."""
    return {n: np.array(jax.device_get(a)) for n, a in params.items()}


def _check_tokens(tokens, config: GPTConfig) -> None:
    if not hasattr(tokens, "shape") or not hasattr(tokens, "dtype"):
        raise ValueError(f"tokens must be an integer array [B, N], got {type(tokens).__name__}")
    # Concrete inputs (numpy, or JAX arrays outside jit) also get their ids checked; a traced
    # one cannot be read, and jnp.take would clamp an out-of-range id silently.
    concrete = not isinstance(tokens, jax.core.Tracer)
    check_tokens(tuple(tokens.shape), tokens.dtype, config,
                 values=np.asarray(tokens) if concrete else None)


def gpt(params: Mapping[str, Any], tokens, config: GPTConfig, *,
        mesh: jax.sharding.Mesh | None = None, axis_name: str = "tp",
        batch_axis: str | None = None, document_lengths=None, overlap_comm: bool = False,
        comm_chunks: int | None = None) -> jax.Array:
    """Logits ``[B, N, vocab_size]`` (in ``config.block.dtype``) of the GPT on ``tokens``.

    Args:
      params: the canonical flat dict (numpy or JAX arrays; :func:`shard_gpt_params` for a
        mesh); cast to ``config.block.dtype`` for compute.
      tokens: integer ``[B, N]`` ids, ``N <= max_seq_len``, ids in ``[0, vocab_size)`` (the
        range is checked when ``tokens`` is concrete, i.e. not under ``jit``).
      config: the :class:`~sparsetp.core.model.GPTConfig` (static under ``jit``).
      mesh, axis_name: passed to every :func:`hybrid_block` (tensor parallelism over
        ``axis_name``; None: one device).
      batch_axis: data parallelism, passed to every :func:`hybrid_block`: on a
        :func:`~sparsetp.backends.jax.block.make_2d_mesh` mesh the blocks split the batch over
        this axis (place ``tokens`` with :func:`~sparsetp.backends.jax.block.shard_batch` and
        the parameters with :func:`shard_gpt_params`, replicated over it); ``jax.grad`` of a
        loss over the global batch is the one-device gradient. Needs a ``mesh``.
      document_lengths: packed documents of this call, passed to every :func:`hybrid_block`
        (static under ``jit``: tuples; positions stay absolute).
      overlap_comm, comm_chunks: passed to every :func:`hybrid_block` (overlap the
        tensor-parallel all-reduces with the GEMMs; static under ``jit``).

    Bad input raises ValueError naming the argument. Differentiable w.r.t. ``params``.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    _check_tokens(tokens, config)
    outer, blocks = split_block_params(params, config)
    dtype = jnp.dtype(config.block.dtype)
    o = {n: jnp.asarray(a, dtype) for n, a in outer.items()}
    tokens = jnp.asarray(tokens)
    x = jnp.take(o["embed.weight"], tokens, axis=0) + o["pos.weight"][: tokens.shape[1]]
    for bp in blocks:
        x = hybrid_block(bp, x, config.block, mesh=mesh, axis_name=axis_name,
                         batch_axis=batch_axis, document_lengths=document_lengths,
                         overlap_comm=overlap_comm, comm_chunks=comm_chunks)
    h = _layer_norm(x, o["ln_f.weight"], o["ln_f.bias"], config.block.norm_eps)
    return linear(h, o["head.weight"])  # fp32: full precision (no TF32 on GPUs), as torch


def loss(logits: jax.Array, targets, mask=None) -> jax.Array:
    """Masked mean next-token cross-entropy, ``sum(mask * nll) / max(sum(mask), 1)`` (the
    oracle's :func:`sparsetp.core.reference.gpt_loss`), in float32 at least."""
    if logits.ndim != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits must be [B, N, V] and targets [B, N], got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if mask is not None and tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask must be [B, N] like targets, got {tuple(mask.shape)}")
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), -1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], -1)[..., 0]
    if mask is None:
        return nll.mean()
    m = jnp.asarray(mask, nll.dtype)
    return (nll * m).sum() / jnp.maximum(m.sum(), 1.0)
