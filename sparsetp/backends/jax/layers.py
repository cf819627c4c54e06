"""Megatron-style tensor-parallel layers for use inside ``jax.shard_map`` (``check_vma=True``).

Weights are ``[in, out]`` (``y = x @ w + b``), as in :mod:`sparsetp.core.config`.

=============================  =====================================  ==========================
layer                          forward collective                     backward collective
=============================  =====================================  ==========================
``column_parallel_linear``     none (input replicated, output split)  all-reduce of d(input)
``row_parallel_linear``        all-reduce of the partial products     none (d(output) replicated)
``parallel_mlp``               one all-reduce (in fc2)                one all-reduce (of dx)
=============================  =====================================  ==========================

With ``sequence_parallel=True`` (Megatron's sequence parallelism) the activations *between* the
layers are split along the tokens instead of replicated: shard ``r`` of ``tp`` holds tokens
``[r*T/tp, (r+1)*T/tp)`` of the token dim (the second-to-last dim of ``x``, ``N`` of
``[B, N, d]``). The same bytes move, as all-gathers and reduce-scatters instead of all-reduces
(an all-reduce *is* a reduce-scatter followed by an all-gather), and whatever runs between the
layers (layer norms, residual adds) runs on ``1/tp`` of the tokens:

=============================  =====================================  ==========================
layer, ``sequence_parallel``   forward collective                     backward collective
=============================  =====================================  ==========================
``column_parallel_linear``     all-gather of the input's tokens       reduce-scatter of d(input)
``row_parallel_linear``        reduce-scatter of partial products     all-gather of d(output)
``parallel_mlp``               one all-gather, one reduce-scatter     one of each
=============================  =====================================  ==========================

No custom transpose rules are needed: under ``check_vma=True`` JAX types every value as
*varying* or *invariant* over the mesh axis. ``column_parallel_linear`` casts its replicated
(invariant) input to varying with ``pcast(..., to="varying")`` — Megatron's ``f`` — whose transpose
is an all-reduce (``psum``) of the input's cotangent: exactly one per column-parallel layer.
``row_parallel_linear`` reduces with ``psum`` — Megatron's ``g`` — whose transpose hands the
replicated cotangent to every shard with no communication. (With ``check_vma=False`` JAX cannot
tell the two cases apart and the input gradient of a probe came out wrong — GPU.md — so keep it
on.) ``tests/jax_tp_test.py`` counts the all-reduces in the backward jaxpr.

With ``axis_name=None`` the layers are plain dense layers (the unsharded path of
:func:`sparsetp.backends.jax.block.hybrid_block`).

fp32 matmuls use ``Precision.HIGHEST`` so a GPU does not silently drop to TF32 (torch's default
for fp32 matmul is full precision too); half-precision inputs accumulate in fp32.

Example (inside ``shard_map`` over a mesh axis ``"tp"``, ``x`` replicated)::

    y = parallel_mlp(x, w1_shard, b1_shard, w2_shard, b2, axis_name="tp")

and with sequence parallelism (``x_local``: this shard's tokens, ``in_specs`` ``P(None, "tp",
None)`` for ``[B, N, d]``; ``y_local`` likewise)::

    y_local = parallel_mlp(x_local, w1_shard, b1_shard, w2_shard, b2, axis_name="tp",
                           sequence_parallel=True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsetp.backends.jax import compat

__all__ = ["column_parallel_linear", "row_parallel_linear", "parallel_mlp", "gelu_tanh", "linear"]


def _matmul(x, w):
    """``x @ w`` in ``x``/``w``'s dtype, as torch's ``F.linear`` computes it.

    float32/float64: full-precision matmul (``Precision.HIGHEST``: no TF32 on GPUs, which the
    float32 tolerances do not allow for). bfloat16/float16: the GEMM accumulates in fp32 inside
    and rounds its output once to the input dtype (cuBLAS and XLA alike). The output is *not*
    requested in fp32: a fp32 output makes the backward's cotangents fp32, so every GEMM of the
    lowered fwd+bwd had fp32 operands or outputs (tests/jax_tp_test.py now checks the HLO), the
    row-parallel psum moved twice the bytes of torch's bf16 all-reduce, and on an H200 the bf16
    MLP's fwd+bwd ran 26x slower than its forward (76 TFLOP/s, fp32 GEMM speed).
    """
    dt = jnp.result_type(x, w)
    wide = dt in (jnp.float32, jnp.float64)
    return jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST if wide else None)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w + b`` over any leading dims, in ``x``/``w``'s dtype (see :func:`_matmul`)."""
    y = _matmul(x, w)
    if b is not None:
        y = y + b
    return y.astype(jnp.result_type(x, w))


@jax.checkpoint
def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (``torch.nn.functional.gelu(approximate="tanh")``),
    computed in at least fp32.

    ``jax.checkpoint``: the backward keeps only the input ``x`` (in its own dtype) and recomputes
    the tanh, as torch's ``gelu_backward`` kernel does. Without it autodiff saved five fp32
    ``[T, ff/tp]`` intermediates for the backward: 5 GiB of extra HBM traffic each way for the
    T=8192, ff=32768 MLP on one GPU (and five times its activation memory).
    """
    y = jax.nn.gelu(x.astype(jnp.promote_types(x.dtype, jnp.float32)), approximate=True)
    return y.astype(x.dtype)


def _check_replicated(x, axis_name: str, what: str):
    if axis_name in compat.varying_axes(x):
        raise ValueError(f"{what} must be replicated over mesh axis {axis_name!r} (pass it with "
                         f"PartitionSpec() / no {axis_name!r} in its in_spec); it varies over it")


def _check_sequence_parallel(x, axis_name: str | None, what: str):
    """``x [..., T_local, features]`` is a token shard: it varies over ``axis_name``."""
    if axis_name is None:
        raise ValueError("sequence_parallel=True needs an axis_name (the tensor-parallel mesh "
                         "axis the tokens are split over)")
    if x.ndim < 2:
        raise ValueError(f"sequence_parallel=True needs {what} with a token dim [..., T, "
                         f"features], got shape {x.shape}")
    if axis_name not in compat.varying_axes(x):
        raise ValueError(f"with sequence_parallel=True, {what} must be split along its tokens "
                         f"over mesh axis {axis_name!r} (e.g. in_spec P(None, {axis_name!r}, "
                         f"None) for [B, N, d]); it is replicated over it")


def column_parallel_linear(x: jax.Array, w_shard: jax.Array, b_shard: jax.Array | None, *,
                           axis_name: str | None, sequence_parallel: bool = False) -> jax.Array:
    """Column-parallel linear: ``x @ w_shard + b_shard`` with ``x`` replicated, output split.

    Args:
      x: ``[..., in]``, replicated over ``axis_name`` (invariant); with ``sequence_parallel``,
        ``[..., T / tp, in]``: this shard's tokens (varying over ``axis_name``).
      w_shard: ``[in, out / tp]``, this shard's contiguous columns.
      b_shard: ``[out / tp]`` or None.
      axis_name: the tensor-parallel mesh axis (None: plain dense layer).
      sequence_parallel: all-gather the tokens of ``x`` (dim ``-2``) first, in shard order.

    Returns ``[..., out / tp]`` (all ``T`` tokens with ``sequence_parallel``), varying over
    ``axis_name``. Backward: d(x) is all-reduced once (``sequence_parallel``: reduce-scattered
    over the tokens once).

    >>> y_shard = column_parallel_linear(x, w_shard, b_shard, axis_name="tp")  # doctest: +SKIP
    """
    if x.shape[-1] != w_shard.shape[0]:
        raise ValueError(f"x has {x.shape[-1]} input features but w_shard is {w_shard.shape}")
    if b_shard is not None and b_shard.shape != w_shard.shape[1:]:
        raise ValueError(f"b_shard must have shape {w_shard.shape[1:]}, got {b_shard.shape}")
    if sequence_parallel:
        _check_sequence_parallel(x, axis_name, "column_parallel_linear's input x")
        # Megatron's SP g-bar: all-gather fwd, reduce-scatter bwd (all_gather's transpose). The
        # gathered input stays varying: each shard multiplies it by its own columns.
        x = jax.lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
    elif axis_name is not None:
        _check_replicated(x, axis_name, "column_parallel_linear's input x")
        x = compat.mark_varying(x, (axis_name,))  # Megatron's f: identity fwd, all-reduce bwd
    return linear(x, w_shard, b_shard)


def row_parallel_linear(x_shard: jax.Array, w_shard: jax.Array, b: jax.Array | None, *,
                        axis_name: str | None, sequence_parallel: bool = False) -> jax.Array:
    """Row-parallel linear: ``psum(x_shard @ w_shard) + b``.

    Args:
      x_shard: ``[..., in / tp]``, this shard's features (varying over ``axis_name``).
      w_shard: ``[in / tp, out]``, this shard's contiguous rows.
      b: ``[out]`` replicated, added once after the all-reduce; or None.
      axis_name: the tensor-parallel mesh axis (None: plain dense layer).
      sequence_parallel: reduce-scatter the partial products over the tokens (dim ``-2``, whose
        size must be divisible by ``tp``) instead of all-reducing them; ``b`` is then added to
        this shard's tokens.

    Returns ``[..., out]``, replicated; with ``sequence_parallel``, ``[..., T / tp, out]``: this
    shard's tokens ``[r*T/tp, (r+1)*T/tp)`` (varying). Backward: no collective (the cotangent is
    replicated); with ``sequence_parallel``, an all-gather of d(output) over the tokens, and
    ``b``'s gradient is all-reduced (it is summed over every shard's tokens).

    >>> y = row_parallel_linear(x_shard, w_shard, b, axis_name="tp")  # doctest: +SKIP
    """
    if x_shard.shape[-1] != w_shard.shape[0]:
        raise ValueError(f"x_shard has {x_shard.shape[-1]} features but w_shard is "
                         f"{w_shard.shape}")
    if b is not None and b.shape != w_shard.shape[1:]:
        raise ValueError(f"b must have shape {w_shard.shape[1:]}, got {b.shape}")
    if sequence_parallel:
        if axis_name is None:
            raise ValueError("sequence_parallel=True needs an axis_name (the tensor-parallel "
                             "mesh axis the tokens are split over)")
        if x_shard.ndim < 2:
            raise ValueError(f"sequence_parallel=True needs x_shard with a token dim [..., T, "
                             f"in / tp], got shape {x_shard.shape}")
        tp = jax.lax.axis_size(axis_name)
        if x_shard.shape[-2] % tp:
            raise ValueError(f"sequence_parallel=True splits the {x_shard.shape[-2]} tokens of "
                             f"x_shard (dim -2) over mesh axis {axis_name!r} of size {tp}: not "
                             f"divisible")
    # Partial products in the compute dtype, all-reduced in it: what Megatron (and our torch
    # RowParallelLinear) does; a fp32 psum would double the bytes on the wire.
    y = _matmul(x_shard, w_shard)
    if axis_name is not None:
        if b is not None:
            _check_replicated(b, axis_name, "row_parallel_linear's bias b")
        if sequence_parallel:
            # Megatron's SP g: reduce-scatter fwd, all-gather bwd (psum_scatter's transpose).
            y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=y.ndim - 2, tiled=True)
        else:
            y = jax.lax.psum(y, axis_name)  # Megatron's g: all-reduce fwd, nothing bwd
    if b is not None:
        # With sequence_parallel, y varies and b does not: JAX casts b to varying here, whose
        # transpose all-reduces b's gradient over the token shards (no explicit psum needed).
        y = y + b
    return y.astype(jnp.result_type(x_shard, w_shard))


def parallel_mlp(x: jax.Array, w1_shard: jax.Array, b1_shard: jax.Array | None,
                 w2_shard: jax.Array, b2: jax.Array | None, *, axis_name: str | None,
                 sequence_parallel: bool = False) -> jax.Array:
    """``fc2(gelu_tanh(fc1(x)))`` with fc1 column-parallel and fc2 row-parallel.

    ``w1_shard [d, ff/tp]``, ``b1_shard [ff/tp]``, ``w2_shard [ff/tp, d]``, ``b2 [d]``;
    ``x [..., d]`` replicated; returns ``[..., d]`` replicated. One all-reduce forward, one
    backward (of dx).

    With ``sequence_parallel``, ``x [..., T/tp, d]`` is this shard's tokens and so is the
    result (``T`` divisible by ``tp``): one all-gather and one reduce-scatter forward, one of
    each backward, and no all-reduce of activations.

    >>> y_local = parallel_mlp(x_local, w1_shard, b1_shard, w2_shard, b2, axis_name="tp",
    ...                        sequence_parallel=True)                     # doctest: +SKIP
    """
    h = column_parallel_linear(x, w1_shard, b1_shard, axis_name=axis_name,
                               sequence_parallel=sequence_parallel)
    return row_parallel_linear(gelu_tanh(h), w2_shard, b2, axis_name=axis_name,
                               sequence_parallel=sequence_parallel)
