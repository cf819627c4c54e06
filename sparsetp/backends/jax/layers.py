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

Communication/computation overlap (``overlap_comm=True``) decomposes the collectives so that each
piece of communication runs while a GEMM that does not need it does (the "collective matmul" of
JAX's shard_map guide). Off by default: on 2 H200s (T=8192, d=8192, bf16) XLA's own scheduling
of the plain path was as fast or faster (fwd+bwd, overlap/plain: MLP 1.03, SP MLP 0.99, block
1.02, SP block 1.01; ``benchmarks/KERNEL_NOTES.md``, "TP overlap"), unlike torch's eager
path. Results equal the plain path's up to the order of the sums (``tests/jax_overlap_test.py``);
``tp = 1`` and ``axis_name=None`` take the plain path. Rings pass to the left (shard ``r``
sends to ``r - 1``) with ``ppermute``, whose transpose is the reverse ``ppermute``, so autodiff
derives backward rings with no custom rule:

======================  ========================================  ================================
``overlap_comm=True``   forward                                   backward (autodiff)
======================  ========================================  ================================
column, SP              all-gather-matmul ring: ``tp`` GEMMs of   reduce-scatter ring of d(x)
                        ``T/tp`` tokens, ``tp - 1`` ppermutes of  accumulators (``tp - 1``
                        the token shard, each in flight during a  ppermutes), d(W) summed over the
                        GEMM; no all-gather                       ``tp`` token chunks
row, SP                 matmul-reduce-scatter ring: ``tp - 1``    all-gather ring of d(y)
                        ppermutes of ``[T/tp, out]`` partial      (``tp - 1`` ppermutes)
                        sums, each in flight during the next
                        chunk's GEMM; no reduce-scatter
row, not SP             ``comm_chunks`` all-reduces, one per      none (as plain)
                        token chunk: chunk ``c``'s in flight
                        during chunk ``c + 1``'s GEMM
column, not SP          unchanged                                 unchanged: the all-reduce of d(x)
                                                                  and the d(W) GEMM are
                                                                  independent (XLA schedules them)
======================  ========================================  ================================

(SP: ``sequence_parallel=True``.)

``parallel_mlp`` with ``sequence_parallel`` and ``overlap_comm`` chains the two rings without
putting fc1's output back in token order: fc1's ring leaves chunk ``k`` = the tokens of shard
``(r + k) % tp``, GELU runs per chunk, and fc2's ring (same direction) consumes chunk
``(s + 1) % tp`` at step ``s`` (fc2 can start after fc1's second GEMM); the single layers
place/slice the chunks with ``dynamic_(update_)slice`` instead.

Why chunked all-reduces (not a reduce-scatter ring plus an all-gather ring) for the plain row
layer: the all-gather half of such a ring has no GEMM left to hide behind (every chunk's sum is
ready only at the ring's last step), so half the all-reduce stays exposed, against ``1 /
comm_chunks`` of it here; the chunks keep the library's all-reduce (NCCL on GPUs) and the result
stays typed replicated (invariant) for ``check_vma``, which a ppermute ring cannot prove. Caveat:
XLA's all-reduce combiner may merge independent small all-reduces back into one (on GPU below
``--xla_gpu_all_reduce_combine_threshold_bytes``); the compiled HLO shows whether it did.

What the compiled HLO shows on CPU (jax 0.10.2, ``tests/jax_overlap_test.py`` checks the
first two; GPU HLO differs and is what counts: ``sparsetp.bench.tp`` records it):

* sequence-parallel MLP with ``overlap_comm``: ``2 (tp - 1)`` collective-permutes forward,
  ``4 (tp - 1)`` forward+backward, no all-gather or reduce-scatter, and one all-reduce (of fc2's
  ``[d]`` bias gradient); the block: ``4 (tp - 1)`` and ``8 (tp - 1)`` (plus the all-reduce of
  the replicated parameters' gradients). Each permute is independent of the GEMM beside it.
* plain and chunked all-reduces: the jaxpr has ``comm_chunks`` psums per row layer, but the CPU
  compiler's combiner merges them, and the backward's d(x) all-reduce, into one synchronous
  tuple all-reduce scheduled after fc1's d(W) GEMM: on CPU nothing overlaps (collectives are
  synchronous there). On GPU, all-reduces are async (``all-reduce-start``/``-done``) and XLA's
  latency-hiding scheduler places independent GEMMs between the two, e.g. d(W1) while d(x) is
  reduced; whether it did is read from the GPU HLO, not assumed.

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

and with the collectives overlapped (same values)::

    y_local = parallel_mlp(x_local, w1_shard, b1_shard, w2_shard, b2, axis_name="tp",
                           sequence_parallel=True, overlap_comm=True)
"""

from __future__ import annotations

import functools

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


def _check_token_dim(x, axis_name: str | None, what: str, features: str = "features"):
    """Sequence parallelism's first needs: a mesh axis, and ``x [..., T, features]``."""
    if axis_name is None:
        raise ValueError("sequence_parallel=True needs an axis_name (the tensor-parallel mesh "
                         "axis the tokens are split over)")
    if x.ndim < 2:
        raise ValueError(f"sequence_parallel=True needs {what} with a token dim [..., T, "
                         f"{features}], got shape {x.shape}")


def _check_sequence_parallel(x, axis_name: str | None, what: str):
    """``x [..., T_local, features]`` is a token shard: it varies over ``axis_name``."""
    _check_token_dim(x, axis_name, what)
    if axis_name not in compat.varying_axes(x):
        raise ValueError(f"with sequence_parallel=True, {what} must be split along its tokens "
                         f"over mesh axis {axis_name!r} (e.g. in_spec P(None, {axis_name!r}, "
                         f"None) for [B, N, d]); it is replicated over it")


def _check_comm_chunks(comm_chunks, overlap_comm: bool, sequence_parallel: bool):
    if comm_chunks is None:
        return
    if isinstance(comm_chunks, bool) or not isinstance(comm_chunks, int) or comm_chunks < 1:
        raise ValueError(f"comm_chunks must be a positive int (or None), got {comm_chunks!r}")
    if not overlap_comm:
        raise ValueError(f"comm_chunks={comm_chunks} needs overlap_comm=True (it splits the "
                         "overlapped all-reduce)")
    if sequence_parallel:
        raise ValueError(f"comm_chunks={comm_chunks} applies to sequence_parallel=False only "
                         "(the sequence-parallel overlap is a ring of tp steps)")


def _num_chunks(tokens: int, comm_chunks: int | None,
                what: str = "row_parallel_linear's x_shard (dim -2)") -> int:
    """Token chunks of the overlapped all-reduce: ``comm_chunks``, or by default the largest of
    4, 2, 1 that divides ``tokens``."""
    if comm_chunks is None:
        return max(c for c in (1, 2, 4) if tokens % c == 0)
    if tokens % comm_chunks:
        raise ValueError(f"comm_chunks={comm_chunks} must divide the {tokens} tokens of {what}")
    return comm_chunks


def _ring_perm(tp: int) -> list[tuple[int, int]]:
    """The rings' ``ppermute``: shard ``j`` sends to ``j - 1`` (receives from ``j + 1``)."""
    return [(j, (j - 1) % tp) for j in range(tp)]


def _ring_gather_matmul(x_local, w_shard, b_shard, axis_name: str) -> list[jax.Array]:
    """All-gather-matmul as a ring: ``linear(x_k, w_shard, b_shard)`` for k = 0 .. tp-1, where
    ``x_k`` is the token shard of shard ``(r + k) % tp`` (ring order; ``r`` this shard).

    Step ``k`` sends ``x_k`` on (to ``r - 1``, which needs it at its step ``k + 1``) before its
    GEMM, so the transfer and the GEMM run together. Autodiff's backward is the reverse ring:
    d(x_k) accumulates ``dy_k @ w^T`` and hops back, a reduce-scatter of d(x) whose every hop
    overlaps one chunk's GEMM; d(w) sums ``x_k^T dy_k`` over the chunks (the ``x_k`` received
    here are the residuals, as the gathered ``x`` is in the plain path). Those ``tp`` d(w)
    partial GEMMs are added in the compute dtype (bf16: ``tp`` roundings where the plain path's
    one GEMM has one), and the row ring's d(w) likewise. In a bf16 MLP at tp=4 on CPU the errors
    against the float64 oracle stayed of the plain path's order (d(W2): 0.56% of its largest
    value against 0.23%; the largest of all, d(b1): 1.1% against 1.6%)."""
    perm = _ring_perm(jax.lax.axis_size(axis_name))
    chunks, x_k = [], x_local
    for k in range(len(perm)):
        x_next = jax.lax.ppermute(x_k, axis_name, perm) if k + 1 < len(perm) else None
        chunks.append(linear(x_k, w_shard, b_shard))
        x_k = x_next
    return chunks


def _ring_matmul_reduce_scatter(chunks: list, w_shard, axis_name: str) -> jax.Array:
    """Matmul-reduce-scatter as a ring: ``sum over shards of x_r @ w_shard`` for this shard's
    own tokens, where ``chunks[k]`` holds the tokens of shard ``(r + k) % tp`` (ring order).

    Step ``s`` multiplies chunk ``(s + 1) % tp`` (the tokens of shard ``r + s + 1``), adds the
    accumulator received from ``r + 1`` (its step ``s - 1``: the same tokens) and passes it to
    ``r - 1``; after ``tp`` steps the accumulator holds the sum for shard ``r``'s tokens. Each
    hop is in flight while the next chunk's GEMM runs. Partial sums are in the compute dtype,
    as the plain reduce-scatter's (the same bytes on the wire). Autodiff's backward passes
    d(y) around the reverse ring: an all-gather whose every hop overlaps one chunk's GEMMs."""
    perm = _ring_perm(len(chunks))
    acc = _matmul(chunks[1 % len(chunks)], w_shard)
    for s in range(1, len(chunks)):
        acc = jax.lax.ppermute(acc, axis_name, perm) + _matmul(chunks[(s + 1) % len(chunks)],
                                                               w_shard)
    return acc


@functools.partial(jax.custom_vjp, nondiff_argnames=("axis_name", "n"))
def _chunked_psum_matmul(x_shard, w_shard, axis_name, n):
    """``psum(x_shard @ w_shard)`` as ``n`` token chunks (dim ``-2``), one GEMM and one psum
    each, so that chunk ``c``'s all-reduce can run while chunk ``c + 1``'s GEMM does.

    The backward is the plain row layer's, whole: ``d x = dy @ w^T`` and ``d w = x^T dy`` as one
    GEMM each (a psum's transpose needs no communication, so chunking it would gain nothing;
    autodiff of the chunks gave ``n`` d(w) GEMMs summed in the compute dtype and ``n`` d(x)
    chunks concatenated: extra passes over weight- and activation-sized arrays).

    XLA's all-reduce combiner merges independent all-reduces whose combined size stays under
    its threshold (GPU: ``--xla_gpu_all_reduce_combine_threshold_bytes``, 30 MiB by default;
    the CPU compiler merged every chunk of the tests' small shapes into one tuple all-reduce,
    which then waits for every GEMM). Chunks above the threshold (T=8192, d=8192 bf16 in 4
    chunks: 32 MiB each) stay apart. An ``optimization_barrier`` does not keep them apart:
    XLA removes barriers (``cse_barrier_expander``) before it combines.
    """
    dim = x_shard.ndim - 2
    return jnp.concatenate([jax.lax.psum(_matmul(c, w_shard), axis_name)
                            for c in jnp.split(x_shard, n, axis=dim)], axis=dim)


def _chunked_psum_matmul_fwd(x_shard, w_shard, axis_name, n):
    return _chunked_psum_matmul(x_shard, w_shard, axis_name, n), (x_shard, w_shard)


def _chunked_psum_matmul_bwd(axis_name, n, res, dy):
    x_shard, w_shard = res
    # dy is replicated (psum's output); d x and d w vary, as x_shard and w_shard do.
    dy = compat.mark_varying(dy, (axis_name,))
    wide = jnp.result_type(x_shard, w_shard) in (jnp.float32, jnp.float64)
    precision = jax.lax.Precision.HIGHEST if wide else None
    lead = tuple(range(x_shard.ndim - 1))
    dx = jnp.matmul(dy, w_shard.T, precision=precision).astype(x_shard.dtype)
    dw = jnp.tensordot(x_shard, dy, axes=(lead, lead), precision=precision)
    return dx, dw.astype(w_shard.dtype)


_chunked_psum_matmul.defvjp(_chunked_psum_matmul_fwd, _chunked_psum_matmul_bwd)


def _ring_slots(axis_name: str):
    """``slot(k)``: the token-shard index of ring chunk ``k`` on this shard, ``(r + k) % tp``."""
    tp, r = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    return lambda k: (r + k) % tp


def _overlap_on(axis_name: str | None, overlap_comm: bool) -> bool:
    return overlap_comm and axis_name is not None and jax.lax.axis_size(axis_name) > 1


def column_parallel_linear(x: jax.Array, w_shard: jax.Array, b_shard: jax.Array | None, *,
                           axis_name: str | None, sequence_parallel: bool = False,
                           overlap_comm: bool = False) -> jax.Array:
    """Column-parallel linear: ``x @ w_shard + b_shard`` with ``x`` replicated, output split.

    Args:
      x: ``[..., in]``, replicated over ``axis_name`` (invariant); with ``sequence_parallel``,
        ``[..., T / tp, in]``: this shard's tokens (varying over ``axis_name``).
      w_shard: ``[in, out / tp]``, this shard's contiguous columns.
      b_shard: ``[out / tp]`` or None.
      axis_name: the tensor-parallel mesh axis (None: plain dense layer).
      sequence_parallel: all-gather the tokens of ``x`` (dim ``-2``) first, in shard order.
      overlap_comm: with ``sequence_parallel``, no all-gather: a ring of ``tp`` GEMMs, one per
        token shard, each while the next shard's tokens arrive by ``ppermute`` (backward: a
        reduce-scatter ring of d(x); see the module docstring). Without ``sequence_parallel``
        nothing changes: the backward all-reduce of d(x) is already independent of the d(W)
        GEMM, for XLA's scheduler to overlap (on GPU; the module docstring says what the HLO
        shows).

    Returns ``[..., out / tp]`` (all ``T`` tokens with ``sequence_parallel``, in token order),
    varying over ``axis_name``. Backward: d(x) is all-reduced once (``sequence_parallel``:
    reduce-scattered over the tokens once).

    >>> y_shard = column_parallel_linear(x, w_shard, b_shard, axis_name="tp")  # doctest: +SKIP
    >>> y_shard = column_parallel_linear(x_local, w_shard, b_shard, axis_name="tp",
    ...                                  sequence_parallel=True,
    ...                                  overlap_comm=True)              # doctest: +SKIP
    """
    if x.shape[-1] != w_shard.shape[0]:
        raise ValueError(f"x has {x.shape[-1]} input features but w_shard is {w_shard.shape}")
    if b_shard is not None and b_shard.shape != w_shard.shape[1:]:
        raise ValueError(f"b_shard must have shape {w_shard.shape[1:]}, got {b_shard.shape}")
    if sequence_parallel:
        _check_sequence_parallel(x, axis_name, "column_parallel_linear's input x")
        if _overlap_on(axis_name, overlap_comm):
            chunks = _ring_gather_matmul(x, w_shard, b_shard, axis_name)
            # Put each chunk in its token slot (in place: one [..., T, out/tp] buffer).
            slot, t_local, dim = _ring_slots(axis_name), x.shape[-2], x.ndim - 2
            y = compat.mark_varying(jnp.zeros(x.shape[:-2] + (len(chunks) * t_local,)
                                              + chunks[0].shape[-1:], chunks[0].dtype),
                                    (axis_name,))
            for k, y_k in enumerate(chunks):
                y = jax.lax.dynamic_update_slice_in_dim(y, y_k, slot(k) * t_local, axis=dim)
            return y
        # Megatron's SP g-bar: all-gather fwd, reduce-scatter bwd (all_gather's transpose). The
        # gathered input stays varying: each shard multiplies it by its own columns.
        x = jax.lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
    elif axis_name is not None:
        _check_replicated(x, axis_name, "column_parallel_linear's input x")
        x = compat.mark_varying(x, (axis_name,))  # Megatron's f: identity fwd, all-reduce bwd
    return linear(x, w_shard, b_shard)


def _check_row_input(x_shard, w_shard, b, axis_name, sequence_parallel):
    if x_shard.shape[-1] != w_shard.shape[0]:
        raise ValueError(f"x_shard has {x_shard.shape[-1]} features but w_shard is "
                         f"{w_shard.shape}")
    if b is not None and b.shape != w_shard.shape[1:]:
        raise ValueError(f"b must have shape {w_shard.shape[1:]}, got {b.shape}")
    if sequence_parallel:
        _check_token_dim(x_shard, axis_name, "x_shard", "in / tp")
        tp = jax.lax.axis_size(axis_name)
        if x_shard.shape[-2] % tp:
            raise ValueError(f"sequence_parallel=True splits the {x_shard.shape[-2]} tokens of "
                             f"x_shard (dim -2) over mesh axis {axis_name!r} of size {tp}: not "
                             f"divisible")
    if axis_name is not None and b is not None:
        _check_replicated(b, axis_name, "row_parallel_linear's bias b")


def _row_finish(y, b, x_shard, w_shard):
    if b is not None:
        # With sequence_parallel, y varies and b does not: JAX casts b to varying here, whose
        # transpose all-reduces b's gradient over the token shards (no explicit psum needed).
        y = y + b
    return y.astype(jnp.result_type(x_shard, w_shard))


def row_parallel_linear(x_shard: jax.Array, w_shard: jax.Array, b: jax.Array | None, *,
                        axis_name: str | None, sequence_parallel: bool = False,
                        overlap_comm: bool = False, comm_chunks: int | None = None) -> jax.Array:
    """Row-parallel linear: ``psum(x_shard @ w_shard) + b``.

    Args:
      x_shard: ``[..., in / tp]``, this shard's features (varying over ``axis_name``).
      w_shard: ``[in / tp, out]``, this shard's contiguous rows.
      b: ``[out]`` replicated, added once after the all-reduce; or None.
      axis_name: the tensor-parallel mesh axis (None: plain dense layer).
      sequence_parallel: reduce-scatter the partial products over the tokens (dim ``-2``, whose
        size must be divisible by ``tp``) instead of all-reducing them; ``b`` is then added to
        this shard's tokens.
      overlap_comm: overlap the reduction with the GEMMs (module docstring). With
        ``sequence_parallel``: a ring of ``tp`` GEMMs, one per token chunk, passing partial-sum
        accumulators by ``ppermute`` (no reduce-scatter; backward an all-gather ring of
        d(output)). Without: the tokens (dim ``-2``) split into ``comm_chunks`` chunks, one
        GEMM and one all-reduce each, so chunk ``c``'s all-reduce can run during chunk
        ``c + 1``'s GEMM.
      comm_chunks: the chunks of the overlapped all-reduce (``overlap_comm`` without
        ``sequence_parallel`` only; must divide the tokens). None: 4, else 2, else 1, the
        largest that divides them.

    Returns ``[..., out]``, replicated; with ``sequence_parallel``, ``[..., T / tp, out]``: this
    shard's tokens ``[r*T/tp, (r+1)*T/tp)`` (varying). Backward: no collective (the cotangent is
    replicated); with ``sequence_parallel``, an all-gather of d(output) over the tokens, and
    ``b``'s gradient is all-reduced (it is summed over every shard's tokens).

    Raises ValueError for mismatched shapes, a bad ``comm_chunks`` (not a positive int, not
    dividing the tokens, given without ``overlap_comm`` or with ``sequence_parallel``), and the
    sequence-parallel input errors.

    >>> y = row_parallel_linear(x_shard, w_shard, b, axis_name="tp")  # doctest: +SKIP
    >>> y = row_parallel_linear(x_shard, w_shard, b, axis_name="tp", overlap_comm=True,
    ...                         comm_chunks=4)                        # doctest: +SKIP
    """
    _check_comm_chunks(comm_chunks, overlap_comm, sequence_parallel)
    _check_row_input(x_shard, w_shard, b, axis_name, sequence_parallel)
    if comm_chunks is not None:  # checked whether or not this call runs on several shards
        if x_shard.ndim < 2:
            raise ValueError(f"comm_chunks={comm_chunks} splits the tokens (dim -2) of "
                             f"x_shard, which has shape {x_shard.shape}")
        _num_chunks(x_shard.shape[-2], comm_chunks)
    if _overlap_on(axis_name, overlap_comm):
        if sequence_parallel:
            slot, tp = _ring_slots(axis_name), jax.lax.axis_size(axis_name)
            t_local = x_shard.shape[-2] // tp
            chunks = [jax.lax.dynamic_slice_in_dim(x_shard, slot(k) * t_local, t_local,
                                                   axis=x_shard.ndim - 2) for k in range(tp)]
            y = _ring_matmul_reduce_scatter(chunks, w_shard, axis_name)
        else:
            n = _num_chunks(x_shard.shape[-2], comm_chunks) if x_shard.ndim >= 2 else 1
            y = (_chunked_psum_matmul(x_shard, w_shard, axis_name, n) if n > 1
                 else jax.lax.psum(_matmul(x_shard, w_shard), axis_name))
        return _row_finish(y, b, x_shard, w_shard)
    # Partial products in the compute dtype, all-reduced in it: what Megatron (and our torch
    # RowParallelLinear) does; a fp32 psum would double the bytes on the wire.
    y = _matmul(x_shard, w_shard)
    if axis_name is not None:
        if sequence_parallel:
            # Megatron's SP g: reduce-scatter fwd, all-gather bwd (psum_scatter's transpose).
            y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=y.ndim - 2, tiled=True)
        else:
            y = jax.lax.psum(y, axis_name)  # Megatron's g: all-reduce fwd, nothing bwd
    return _row_finish(y, b, x_shard, w_shard)


def parallel_mlp(x: jax.Array, w1_shard: jax.Array, b1_shard: jax.Array | None,
                 w2_shard: jax.Array, b2: jax.Array | None, *, axis_name: str | None,
                 sequence_parallel: bool = False, overlap_comm: bool = False,
                 comm_chunks: int | None = None) -> jax.Array:
    """``fc2(gelu_tanh(fc1(x)))`` with fc1 column-parallel and fc2 row-parallel.

    ``w1_shard [d, ff/tp]``, ``b1_shard [ff/tp]``, ``w2_shard [ff/tp, d]``, ``b2 [d]``;
    ``x [..., d]`` replicated; returns ``[..., d]`` replicated. One all-reduce forward, one
    backward (of dx).

    With ``sequence_parallel``, ``x [..., T/tp, d]`` is this shard's tokens and so is the
    result (``T`` divisible by ``tp``): one all-gather and one reduce-scatter forward, one of
    each backward, and no all-reduce of activations.

    ``overlap_comm`` (module docstring): with ``sequence_parallel`` the all-gather and the
    reduce-scatter become two chained ``ppermute`` rings (fc1's output stays in ring order
    between them); without, fc2's all-reduce is split into ``comm_chunks`` token chunks (see
    :func:`row_parallel_linear`). Same values up to the order of the sums.

    >>> y_local = parallel_mlp(x_local, w1_shard, b1_shard, w2_shard, b2, axis_name="tp",
    ...                        sequence_parallel=True)                     # doctest: +SKIP
    >>> y_local = parallel_mlp(x_local, w1_shard, b1_shard, w2_shard, b2, axis_name="tp",
    ...                        sequence_parallel=True, overlap_comm=True)  # doctest: +SKIP
    """
    _check_comm_chunks(comm_chunks, overlap_comm, sequence_parallel)
    if sequence_parallel and _overlap_on(axis_name, overlap_comm):
        if x.shape[-1] != w1_shard.shape[0] or w1_shard.shape[1] != w2_shard.shape[0]:
            raise ValueError(f"x [..., {x.shape[-1]}], w1_shard {w1_shard.shape} and w2_shard "
                             f"{w2_shard.shape} do not chain")
        if b1_shard is not None and b1_shard.shape != w1_shard.shape[1:]:
            raise ValueError(f"b1_shard must have shape {w1_shard.shape[1:]}, got "
                             f"{b1_shard.shape}")
        _check_sequence_parallel(x, axis_name, "parallel_mlp's input x")
        if b2 is not None:
            if b2.shape != w2_shard.shape[1:]:
                raise ValueError(f"b2 must have shape {w2_shard.shape[1:]}, got {b2.shape}")
            _check_replicated(b2, axis_name, "parallel_mlp's bias b2")
        h = [gelu_tanh(h_k) for h_k in _ring_gather_matmul(x, w1_shard, b1_shard, axis_name)]
        y = _ring_matmul_reduce_scatter(h, w2_shard, axis_name)
        return _row_finish(y, b2, h[0], w2_shard)
    h = column_parallel_linear(x, w1_shard, b1_shard, axis_name=axis_name,
                               sequence_parallel=sequence_parallel, overlap_comm=overlap_comm)
    return row_parallel_linear(gelu_tanh(h), w2_shard, b2, axis_name=axis_name,
                               sequence_parallel=sequence_parallel, overlap_comm=overlap_comm,
                               comm_chunks=comm_chunks)
