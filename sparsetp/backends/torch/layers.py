"""Megatron-style tensor-parallel layers for PyTorch.

Weights are stored ``[in, out]`` like the canonical parameters of :mod:`sparsetp.core.config`
(``y = x @ W + b``); each rank holds a contiguous shard:

* :class:`ColumnParallelLinear` splits the output features: ``weight_shard [in, out / tp]``.
  Forward ``copy_to_region`` (its backward all-reduces the input gradient), optional
  ``gather_from_region`` of the output. With ``overlap_comm`` (the default) forward and backward
  are one autograd Function that starts the input-gradient all-reduce asynchronously and
  computes the weight gradient while it runs (Megatron's
  ``LinearWithGradAccumulationAndAsyncCommunication``); the numbers are bitwise those of the
  plain path (``tests/torch_overlap_test.py``).
* :class:`RowParallelLinear` splits the input features: ``weight_shard [in / tp, out]``; partial
  products are summed by one in-place all-reduce and the (replicated) bias is added once, in
  rank 0's GEMM (:class:`_RowLinear`).
* :class:`ParallelMLP` = column fc1 -> GELU(tanh) -> row fc2: one all-reduce forward, one backward
  (overlapped with fc1's weight-gradient GEMM unless ``overlap_comm=False``).
* :class:`ParallelSparseAttention` = column qkv (whole heads per rank) -> block-sparse attention
  of the local heads -> row out projection.

Sequence parallelism (``sequence_parallel=True``, Megatron-LM's SP; off by default): activations
outside the parallel regions are split along the sequence dim (-2; rank ``r`` holds tokens
``[r T / tp, (r + 1) T / tp)``). The column layer all-gathers its input shard before the GEMM
(backward: reduce-scatter of the input gradient) and the row layer reduce-scatters its output
(backward: all-gather) instead of all-reducing it, then adds its replicated bias on the shard.
Same bytes on the wire as the all-reduce, but layer norms and residuals work on ``T / tp``
tokens and the activations between regions take ``1 / tp`` of the memory. With
``overlap_comm`` the column backward re-gathers the input (saving only the shard) and overlaps
the gather with the d(x) GEMM and the reduce-scatter with the d(W) GEMM
(:class:`_ColumnLinearSequenceParallel`; bitwise the plain SP path, ``tests/torch_sp_test.py``).

``load_unsharded`` takes FULL tensors (numpy or torch) in the canonical layout and keeps this
rank's shard; ``unsharded`` gathers them back (bitwise).

>>> import torch
>>> lin = ColumnParallelLinear(8, 16)          # single process: an ordinary linear layer
>>> lin(torch.randn(2, 8)).shape
torch.Size([2, 16])
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sparsetp.backends.torch.attention import (
    PatternModule,
    _as_pattern,
    cached_layout,
    pattern_attention,
    pattern_key,
)
from sparsetp.backends.torch.collective_matmul import (
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
    wait_all,
)
from sparsetp.backends.torch.comm import (
    SEQ_DIM,
    _all_gather_seq_start,
    _can_overlap,
    _rank_major_to_seq,
    _reduce_scatter_seq,
    all_gather_dim,
    all_gather_seq,
    all_gather_to_region,
    all_reduce_,
    all_reduce_async,
    apply_function,
    copy_to_region,
    gather_from_region,
    group_rank,
    group_size,
    p2p_all_gather,
    reduce_scatter_from_region,
    scatter_to_region,
)
from sparsetp.core.config import check_seed, document_lengths_key, with_documents
from sparsetp.core.layout import BlockLayout
from sparsetp.core.patterns import Pattern

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSparseAttention"]


def _check_dtype(dtype) -> None:
    """ValueError naming ``dtype`` unless it is None or a floating torch.dtype (parameters
    need one to require gradients)."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")


@torch.no_grad()
def _poison(module: nn.Module) -> None:
    """``seed=None``: parameters are NaN until loaded, so a forward before ``load_unsharded`` /
    ``load_params`` gives NaN rather than plausible numbers from uninitialised memory."""
    for p in module.parameters():
        p.fill_(float("nan"))


def _divide(name: str, value: int, world: int) -> int:
    if value % world:
        raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {world}")
    return value // world


def _as_tensor(a, name: str) -> torch.Tensor:
    if isinstance(a, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a))
    if isinstance(a, torch.Tensor):
        return a.detach()
    raise ValueError(f"{name} must be a numpy array or a torch tensor, got {type(a).__name__}")


def _matmul_bias(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``x @ W + b`` with the bias in the GEMM's epilogue (``addmm``), as ``nn.Linear`` does.

    A separate ``y + b`` is one more pass over the output (256 MiB per fc1 call at T=8192,
    ff/tp=16384 in bf16); on CUDA ``addmm`` with a 1-D bias adds it inside the cuBLASLt GEMM.
    """
    if bias is None:
        return torch.matmul(x, weight)
    y = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)
    return y.view(*x.shape[:-1], weight.shape[1])


def _autocast_forward(forward):
    """Record the autocast state a Function's forward runs under (device of its first input),
    for :func:`_autocast_backward`: what ``torch.amp.custom_fwd`` does, for any device type."""
    @functools.wraps(forward)
    def wrapper(ctx, x, *args):
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device),
                        torch.get_autocast_dtype(device))
        return forward(ctx, x, *args)
    return wrapper


def _autocast_backward(backward):
    """Run a Function's backward under its forward's autocast state (``custom_bwd``): autograd
    runs backwards with autocast off, so a bf16 ``dy`` would meet the fp32 master weight."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return backward(ctx, *grads)
    return wrapper


# Collective matmuls (``comm_chunks``, :mod:`.collective_matmul`): a GEMM split along its tokens
# so that point-to-point transfers of one piece run while the next piece multiplies. Each piece
# must stay a large GEMM: on 2 H200s splitting paid only from 2**39 FLOPs a piece (~0.8 ms) and
# lost up to 2x below it (d = 2048-4096; benchmarks/KERNEL_NOTES.md, "TP overlap").
MIN_PIECE_FLOPS = 2 ** 39
MAX_CHUNKS = 4
# A sequence-parallel ring's pieces are the tp token shards, so it adds no collective, only
# smaller GEMMs: it paid (0.4-1.1% fwd+bwd) for a whole GEMM of 2**39 FLOPs, pieces of 2**38,
# measured at TP=2 and 8192 tokens only (benchmarks/KERNEL_NOTES.md, "TP overlap", session 27).
MIN_SP_RING_FLOPS = 2 ** 39


def _check_comm_chunks(comm_chunks):
    if comm_chunks is not None and (isinstance(comm_chunks, bool)
                                    or not isinstance(comm_chunks, int) or comm_chunks < 1):
        raise ValueError(f"comm_chunks must be None (auto) or a positive int, got "
                         f"{comm_chunks!r}")
    return comm_chunks


def forward_chunks(comm_chunks: int | None, tokens: int, world: int, flops: float) -> int:
    """How many token pieces a layer's GEMM (``flops`` on this rank, over ``tokens`` tokens) is
    split into around its collective (1: one NCCL collective before or after the whole GEMM,
    the plain schedule; more: a collective matmul). ``comm_chunks=None`` (auto) gives one piece
    per :data:`MIN_PIECE_FLOPS`, at most :data:`MAX_CHUNKS`; never more pieces than tokens.
    Always 1 on one rank and under ``torch.compile`` (which traces blocking collectives only).

    The pieces' use: the row-parallel all-reduce runs in ``max(1, pieces // tp)`` waves of
    ``tp`` pieces each (:func:`.matmul_all_reduce`); a sequence-parallel layer with an explicit
    ``comm_chunks`` decomposes when it gets more than 1 (its ring has one piece per rank; auto:
    :func:`_sp_ring`)."""
    if world == 1 or not _can_overlap():
        return 1
    if comm_chunks is None:
        comm_chunks = int(min(MAX_CHUNKS, flops // MIN_PIECE_FLOPS))
    return max(1, min(comm_chunks, tokens))


def _gemm(layer, x: torch.Tensor, shards: int = 1) -> tuple[int, float]:
    """``(tokens, FLOPs)`` of ``layer``'s GEMM on input ``x`` (``shards``: its tokens are a
    sequence shard of that many)."""
    tokens = x.numel() // x.shape[-1] * shards
    return tokens, 2.0 * tokens * layer.weight.shape[0] * layer.weight.shape[1]


def _pieces(layer, x: torch.Tensor, shards: int = 1) -> int:
    """:func:`forward_chunks` of ``layer`` for input ``x``."""
    tokens, flops = _gemm(layer, x, shards)
    return forward_chunks(layer.comm_chunks, tokens, layer.world_size, flops)


def _sp_ring(layer, x: torch.Tensor, shards: int = 1) -> bool:
    """Whether sequence-parallel ``layer`` runs its collective as a ring under the GEMM
    (:mod:`.collective_matmul`). Auto: when the whole GEMM has at least
    :data:`MIN_SP_RING_FLOPS` (on 2 GPUs, 8192 tokens at ``d = 8192``, that takes in the
    attention output projection, whose reduce-scatter and backward all-gather were exposed);
    an explicit ``comm_chunks`` above 1 rings; never on one rank or under torch.compile."""
    if layer.comm_chunks is not None or layer.world_size == 1 or not _can_overlap():
        return _pieces(layer, x, shards) > 1
    return _gemm(layer, x, shards)[1] >= MIN_SP_RING_FLOPS


def _waves(layer, x: torch.Tensor) -> int:
    """Waves of :func:`.matmul_all_reduce` for ``layer``'s all-reduce on ``x``; 0: plain."""
    pieces = _pieces(layer, x)
    return max(1, pieces // layer.world_size) if pieces > 1 else 0


class _ColumnLinearAsyncGrad(torch.autograd.Function):
    """``y = x @ W + b`` whose backward overlaps the all-reduce of d(x) with d(W), d(b).

    ============================  =====================================================
    forward                       ``x @ W + b`` (no collective; ``x`` is replicated)
    backward                      ``dx = dy @ W^T``; start ``all_reduce(dx)`` (async);
                                  ``dW = x^T dy``, ``db = sum(dy)`` meanwhile; wait
    ============================  =====================================================

    The plain path (``copy_to_region`` then ``matmul``) lets autograd finish BOTH matmul
    gradients before ``copy_to_region``'s backward all-reduces d(x), so the link idles during the
    d(W) GEMM and the GEMM units idle during the all-reduce. Here d(x) is computed first and its
    reduction runs while the weight-gradient GEMM (as large as the d(x) one) executes.

    Numerics: the same GEMM calls on the same operands as autograd's matmul backward (2-D
    ``mm`` on the flattened token dim, ``x^T @ dy`` for d(W)), the bias gradient summed over the
    same leading dims as autograd's ``sum_to_size``, and the all-reduce of the same tensor, so
    the results are bitwise those of the plain path — only the order in time differs. (A
    collective matmul for d(x), :func:`.matmul_all_reduce` with its last all-gather under d(W),
    measured no faster on 2 H200s than this all-reduce under d(W).)

    On CUDA, Megatron runs this with ``CUDA_DEVICE_MAX_CONNECTIONS=1``: with one hardware work
    queue, the NCCL kernel launched before the d(W) GEMM is also *scheduled* before it and gets
    its SMs, instead of queueing behind the GEMM (``sparsetp.bench.tp`` sets it in its workers).
    """

    @staticmethod
    @_autocast_forward
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return _matmul_bias(x, weight, bias)

    @staticmethod
    @_autocast_backward
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = handle = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, weight.t())
            handle = all_reduce_async(dx, ctx.group)  # in place: dx is ours alone
        dw = db = None
        if ctx.needs_input_grad[1]:
            dw = x.reshape(-1, x.shape[-1]).t().mm(dy.reshape(-1, dy.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=tuple(range(dy.dim() - 1)))
        if handle is not None:
            handle.wait()
        return dx, dw, db, None


class _ColumnLinearSequenceParallel(torch.autograd.Function):
    """``y = all_gather(x_shard) @ W + b`` for a sequence-parallel input, Megatron's SP schedule.

    ============================  =====================================================
    forward                       all-gather ``x_shard`` along the sequence dim (-2);
                                  ``x @ W + b``; save only ``x_shard`` and ``W``
                                  (``decompose``: the gather runs under this rank's
                                  own shard's GEMM, :func:`.all_gather_matmul`)
    backward                      start ``all_gather(x_shard)`` (async);
                                  ``dx = dy @ W^T`` meanwhile; wait;
                                  start ``reduce_scatter(dx)`` (async);
                                  ``dW = x^T dy``, ``db = sum(dy)`` meanwhile; wait
    ============================  =====================================================

    Saving the shard and gathering it again costs one more all-gather per backward, but the
    full ``[T, in]`` input is not held from forward to backward (``1 / tp`` of that memory),
    and the gather hides behind the d(x) GEMM. The plain SP path (``all_gather_to_region``
    then ``matmul``) keeps the gathered input for autograd and finishes both GEMMs before the
    reduce-scatter, which then runs with nothing to overlap.

    Numerics: the same GEMM calls on the same operands as :class:`_ColumnLinearAsyncGrad`
    (itself bitwise autograd's), the re-gathered input is a copy of the same bits, and the
    reduce-scatter is the plain path's helper on the same tensor: bitwise equal results.
    With ``decompose`` the backward re-gathers by send/recv under a d(x) that is a ring
    reduce-scatter (:func:`.matmul_reduce_scatter`), and both GEMMs are split by ranks'
    tokens: equal within the dtype's rounding.
    """

    @staticmethod
    @_autocast_forward
    def forward(ctx, x_shard, weight, bias, group, decompose):
        ctx.save_for_backward(x_shard, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.decompose = decompose
        if decompose:
            return all_gather_matmul(x_shard, weight, bias, group)[0]
        return _matmul_bias(all_gather_seq(x_shard, SEQ_DIM, group), weight, bias)

    @staticmethod
    @_autocast_backward
    def backward(ctx, dy):
        if ctx.decompose:
            return _ColumnLinearSequenceParallel._decomposed_backward(ctx, dy)
        x_shard, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathered = gather = None
        if need_dw:
            gathered, gather = _all_gather_seq_start(x_shard, ctx.group, async_op=True)
        dx_shard = dx = reduce = None
        if need_dx:
            dx = torch.matmul(dy, weight.t())
        if gather is not None:
            gather.wait()  # before the reduce-scatter: one collective in flight at a time
        if need_dx:
            dx_shard, reduce = _reduce_scatter_seq(dx, SEQ_DIM, ctx.group, async_op=True,
                                                   name="the input gradient")
        dw = db = None
        if need_dw:
            x = _rank_major_to_seq(gathered, SEQ_DIM)
            dw = x.reshape(-1, x.shape[-1]).t().mm(dy.reshape(-1, dy.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=tuple(range(dy.dim() - 1)))
        if reduce is not None:
            reduce.wait()
        return dx_shard, dw, db, None, None

    @staticmethod
    def _decomposed_backward(ctx, dy):
        """Re-gather ``x`` by send/recv while d(x) runs as a ring reduce-scatter of its chunk
        GEMMs, then d(W) on the gathered input."""
        x_shard, weight = ctx.saved_tensors
        world, rank = group_size(ctx.group), group_rank(ctx.group)
        handles, gathered = [], None
        if ctx.needs_input_grad[1]:
            x2 = x_shard.reshape(-1, x_shard.shape[-1]).contiguous()
            gathered = torch.empty(world, *x2.shape, dtype=x2.dtype, device=x2.device)
            gathered[rank].copy_(x2)
            handles = p2p_all_gather(x2, list(gathered.unbind(0)), ctx.group)
        dx_shard = None
        if ctx.needs_input_grad[0]:
            dx_shard = matmul_reduce_scatter(dy, weight.t(), ctx.group, "the input gradient")
        wait_all(handles)
        dw = db = None
        if gathered is not None:
            x = _rank_major_to_seq(gathered.view(world, *x_shard.shape), SEQ_DIM)
            dw = x.reshape(-1, x.shape[-1]).t().mm(dy.reshape(-1, dy.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=tuple(range(dy.dim() - 1)))
        return dx_shard, dw, db, None, None


class _RowLinear(torch.autograd.Function):
    """``y = all_reduce(x_shard @ W_shard [+ b on rank 0])``: the row-parallel linear in one
    Function, so the all-reduce runs in place on the GEMM's fresh output and the bias rides in
    the GEMM's epilogue, as DTensor's RowwiseParallel does with its Partial output.

    ============  ===================================================================
    forward       ``addmm(b, x, W)`` on rank 0, ``x @ W`` elsewhere; one in-place
                  sum all-reduce (no copy: nothing else holds the GEMM's output);
                  with ``waves``, :func:`.matmul_all_reduce` (the reduction under
                  the GEMM's pieces, same bias placement)
    backward      no collective: ``dy`` is replicated, so ``dx = dy W^T`` and
                  ``dW = x^T dy`` are this rank's shards and ``db = sum(dy)`` is the
                  full bias gradient on every rank (replicas stay equal)
    ============  ===================================================================

    The plain composition (``reduce_from_region(x @ W) + b``) paid two more passes over the
    ``[T, out]`` output: ``reduce_from_region`` copies its input before reducing (it cannot
    know whether autograd holds it), and the bias add. At T=8192, d=8192 in bf16 those are
    256 MiB of traffic each. Numerics: the bias enters rank 0's fp32 GEMM accumulator before
    the cross-rank sum instead of being added to the bf16 sum after it (a different rounding
    of the same value).
    """

    @staticmethod
    @_autocast_forward
    def forward(ctx, x_local, weight, bias, group, bias_here, waves):
        ctx.save_for_backward(x_local, weight)
        ctx.has_bias = bias is not None
        if waves:  # adds the bias on rank 0 itself
            y, handles = matmul_all_reduce(x_local, weight, bias, group, waves)
            wait_all(handles)
            return y
        bias = bias if bias_here else None
        return all_reduce_(_matmul_bias(x_local, weight, bias).contiguous(), group)

    @staticmethod
    @_autocast_backward
    def backward(ctx, dy):
        x_local, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, weight.t())
        if ctx.needs_input_grad[1]:
            dw = x_local.reshape(-1, x_local.shape[-1]).t().mm(dy.reshape(-1, dy.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(dim=tuple(range(dy.dim() - 1)))
        return dx, dw, db, None, None, None


class _RowLinearSequenceParallel(torch.autograd.Function):
    """``y_shard = reduce_scatter(x_local @ W)`` with both directions' collectives under GEMMs.

    ============================  =====================================================
    forward                       ring of partial sums (:func:`.matmul_reduce_scatter`):
                                  each step's transfer runs under the next step's GEMM
    backward                      start the all-gather of ``dy_shard`` (send/recv);
                                  ``dx`` of this rank's tokens meanwhile; wait;
                                  ``dx`` of the other tokens, ``dW = x^T dy``
    ============================  =====================================================

    The plain SP path (``reduce_scatter_from_region(x @ W)``) runs the reduce-scatter after
    the whole GEMM and, backward, the all-gather of ``dy`` before both GEMMs, each with nothing
    to overlap. Numerics: equal to it within the dtype's rounding (the forward sums in ring
    order, the backward's d(x) GEMM is split by ranks' tokens); d(W) is bitwise.
    """

    @staticmethod
    @_autocast_forward
    def forward(ctx, x_local, weight, group):
        ctx.save_for_backward(x_local, weight)
        ctx.group = group
        return matmul_reduce_scatter(x_local, weight, group)

    @staticmethod
    @_autocast_backward
    def backward(ctx, dy_shard):
        x_local, weight = ctx.saved_tensors
        dx, dy = all_gather_matmul(dy_shard, weight.t(), None, ctx.group,
                                   keep_input=ctx.needs_input_grad[1])
        dw = None
        if dy is not None:
            dy = _rank_major_to_seq(dy.view(-1, *dy_shard.shape), SEQ_DIM)
            dw = x_local.reshape(-1, x_local.shape[-1]).t().mm(dy.reshape(-1, dy.shape[-1]))
        return (dx if ctx.needs_input_grad[0] else None), dw, None


class _ParallelLinear(nn.Module):
    """Shared parts: a weight shard split on ``_split_dim`` (0 rows, 1 columns) and a bias."""

    _split_dim: int
    _bias_split: bool

    def __init__(self, in_features, out_features, bias, group, dtype, device, seed):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        seed = check_seed(seed, allow_none=True)
        _check_dtype(dtype)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.world_size, self.rank = group_size(group), group_rank(group)
        full = (in_features, out_features)
        local = list(full)
        local[self._split_dim] = _divide(("in_features", "out_features")[self._split_dim],
                                         full[self._split_dim], self.world_size)
        kw = dict(dtype=dtype or torch.float32, device=device)
        self.weight = nn.Parameter(torch.empty(*local, **kw))
        if bias:
            n_bias = local[1] if self._bias_split else out_features
            self.bias = nn.Parameter(torch.empty(n_bias, **kw))
        else:
            self.register_parameter("bias", None)
        if seed is not None:
            self.reset_parameters(seed)
        else:
            _poison(self)

    def reset_parameters(self, seed: int = 0) -> None:
        """Draw the FULL weight ~ N(0, 1/in) and bias ~ N(0, 0.1^2) with
        ``numpy.random.default_rng(seed)`` and keep this rank's shard, so a layer built with the
        same seed is the same function at every tensor-parallel size. ``seed``: a non-negative
        int (``core.config.check_seed``)."""
        rng = np.random.default_rng(check_seed(seed))
        w = rng.standard_normal((self.in_features, self.out_features)) / math.sqrt(
            self.in_features)
        b = 0.1 * rng.standard_normal(self.out_features) if self.bias is not None else None
        self.load_unsharded(w.astype(np.float32), None if b is None else b.astype(np.float32))

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        size = full.shape[dim] // self.world_size
        return full.narrow(dim, self.rank * size, size)

    @torch.no_grad()
    def load_unsharded(self, weight, bias=None) -> None:
        """Copy this rank's shard of the FULL ``weight [in, out]`` (and ``bias [out]``)."""
        w = _as_tensor(weight, "weight")
        if tuple(w.shape) != (self.in_features, self.out_features):
            raise ValueError(f"weight must have the unsharded shape "
                             f"{(self.in_features, self.out_features)}, got {tuple(w.shape)}")
        if (bias is None) != (self.bias is None):
            raise ValueError("bias must be given exactly when the layer has a bias "
                             f"(has bias: {self.bias is not None})")
        self.weight.copy_(self._shard(w, self._split_dim))
        if bias is not None:
            b = _as_tensor(bias, "bias")
            if tuple(b.shape) != (self.out_features,):
                raise ValueError(f"bias must have shape {(self.out_features,)}, got "
                                 f"{tuple(b.shape)}")
            self.bias.copy_(self._shard(b, 0) if self._bias_split else b)

    @torch.no_grad()
    def unsharded(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The FULL ``(weight [in, out], bias [out] or None)``, gathered from every rank."""
        w = all_gather_dim(self.weight.detach(), self._split_dim, self.group)
        b = self.bias
        if b is not None:
            b = all_gather_dim(b.detach(), 0, self.group) if self._bias_split else b.detach()
        return w, b

    def extra_repr(self) -> str:
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.world_size}, rank={self.rank}{sp}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W + b`` with ``W [in, out]`` split by output columns over ``group``.

    Args:
      in_features, out_features: the UNSHARDED sizes (``out_features`` divisible by the TP size).
      bias: whether to add a (column-split) bias.
      gather_output: all-gather the output to ``[..., out]``; else each rank returns its
        ``[..., out / tp]`` slice (to feed a :class:`RowParallelLinear`).
      group: process group (None: default group if initialised, else single process).
      dtype, device: of the parameters.
      seed: :meth:`reset_parameters` seed, a non-negative int; None skips the draw (for a caller
        that will :meth:`load_unsharded`): the parameters are NaN until loaded.
      overlap_comm: overlap the backward all-reduce of the input gradient with the weight-gradient
        GEMM (:class:`_ColumnLinearAsyncGrad`); bitwise the same numbers as False. With
        ``sequence_parallel``, overlap the input re-gather and the gradient reduce-scatter
        (:class:`_ColumnLinearSequenceParallel`), also bitwise; as a collective matmul where
        ``comm_chunks`` says so.
      comm_chunks: with ``sequence_parallel`` (and ``overlap_comm``): None (auto,
        :func:`forward_chunks`: only GEMMs large enough to gain) or a positive int; above 1
        the forward all-gather runs under this rank's own tokens' GEMM and the backward
        re-gathers by send/recv under a ring reduce-scatter of d(x)
        (:mod:`.collective_matmul`; equal to 1 within the dtype's rounding); 1 is the plain
        schedule.
      sequence_parallel: the input is this rank's contiguous chunk of the sequence dim (-2) of
        ``[..., T, in]``; it is all-gathered to ``[..., T * tp, in]`` before the GEMM and the
        input gradient is reduce-scattered back to ``[..., T, in]``.

    Example (under torch.distributed with 2 ranks, each rank keeps 8 output columns)::

        fc = ColumnParallelLinear(16, 16, gather_output=True)
        fc.load_unsharded(w_full, b_full)
        sp = ColumnParallelLinear(16, 16, sequence_parallel=True)   # x_shard [B, T/2, 16]
        sp(x_shard).shape                                           # [B, T, 8]
    """

    _split_dim = 1
    _bias_split = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group=None, *, dtype: torch.dtype | None = None,
                 device=None, seed: int | None = 0, overlap_comm: bool = True,
                 sequence_parallel: bool = False, comm_chunks: int | None = None):
        self.gather_output, self.overlap_comm = gather_output, bool(overlap_comm)
        self.sequence_parallel = bool(sequence_parallel)
        self.comm_chunks = _check_comm_chunks(comm_chunks)
        super().__init__(in_features, out_features, bias, group, dtype, device, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            if self.overlap_comm and self.world_size > 1:
                decompose = _sp_ring(self, x, self.world_size)
                y_local = apply_function(_ColumnLinearSequenceParallel, x, self.weight,
                                         self.bias, self.group, decompose)
            else:
                y_local = _matmul_bias(all_gather_to_region(x, self.group), self.weight,
                                       self.bias)
        elif self.overlap_comm and self.world_size > 1:
            y_local = apply_function(_ColumnLinearAsyncGrad, x, self.weight, self.bias, self.group)
        else:
            x_local = copy_to_region(x, self.group)
            y_local = _matmul_bias(x_local, self.weight, self.bias)
        return gather_from_region(y_local, self.group) if self.gather_output else y_local


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W + b`` with ``W [in, out]`` split by input rows over ``group``.

    Args:
      in_features, out_features: the UNSHARDED sizes (``in_features`` divisible by the TP size).
      bias: whether to add the (replicated) bias: once, in rank 0's GEMM before the
        all-reduce (:class:`_RowLinear`); its gradient is the full ``sum(dy)`` on every rank.
      input_is_parallel: the input is already this rank's ``[..., in / tp]`` slice (the output
        of a :class:`ColumnParallelLinear`); else the full input is split here.
      group, dtype, device, seed: as :class:`ColumnParallelLinear`.
      sequence_parallel: reduce-scatter the output along the sequence dim (-2) instead of
        all-reducing it: ``[..., T, in / tp]`` in, this rank's ``[..., T / tp, out]`` out
        (ValueError unless ``tp`` divides ``T``); the bias is added on the shard. Needs
        ``input_is_parallel``.
      overlap_comm: run the forward collective under the GEMM as ``comm_chunks`` says; False
        is the plain schedule (one collective after the whole GEMM).
      comm_chunks: None (auto, :func:`forward_chunks`: only GEMMs large enough to gain) or a
        positive int. Without ``sequence_parallel`` the all-reduce becomes
        ``max(1, comm_chunks // tp)`` waves of ring reduce-scatters and send/recv all-gathers
        under the GEMM's pieces (:func:`.matmul_all_reduce`); with it, any value above 1 turns
        the reduce-scatter into a ring of partial sums under the GEMMs and the backward's
        all-gather runs under the d(x) GEMM (:class:`_RowLinearSequenceParallel`). 1 is
        bitwise the plain schedule; more pieces equal it within the dtype's rounding.
    """

    _split_dim = 0
    _bias_split = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, group=None, *,
                 dtype: torch.dtype | None = None, device=None, seed: int | None = 0,
                 sequence_parallel: bool = False, overlap_comm: bool = True,
                 comm_chunks: int | None = None):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (the input of "
                             "a sequence-parallel row layer is a column layer's output slice)")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = bool(sequence_parallel)
        self.overlap_comm = bool(overlap_comm)
        self.comm_chunks = _check_comm_chunks(comm_chunks)
        super().__init__(in_features, out_features, bias, group, dtype, device, seed)

    def forward(self, x: torch.Tensor, *, synced_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``synced_bias`` (sequence parallelism only): this layer's bias as returned by the
        caller's :func:`.copy_many_to_region`, which then sums its gradient over the group
        together with its other replicated parameters' (one all-reduce for all of them, as
        :class:`~sparsetp.backends.torch.block.HybridBlock` does); None: the layer does it."""
        self._check_synced_bias(synced_bias)
        if self.sequence_parallel:
            if self.overlap_comm and _sp_ring(self, x):
                y_shard = apply_function(_RowLinearSequenceParallel, x, self.weight, self.group)
            else:
                y_shard = reduce_scatter_from_region(torch.matmul(x, self.weight), self.group)
            if self.bias is None:
                return y_shard
            # Each rank adds the replicated bias to its own tokens only, so its gradient here
            # is a partial sum over T / tp tokens. copy_to_region (identity forward, all-reduce
            # backward) makes .grad the full sum on every rank, so replicas stay equal under any
            # optimizer without an extra call after backward (Megatron instead all-reduces such
            # "sequence-parallel" parameters in its training loop).
            # In y's dtype: under autocast y is bf16/fp16 while the bias stays fp32, and a
            # promoting add would hand fp32 activations on (the plain row layer's GEMM epilogue
            # adds the bias in the compute dtype too).
            bias = copy_to_region(self.bias, self.group) if synced_bias is None else synced_bias
            return y_shard + bias.to(y_shard.dtype)
        x_local = x if self.input_is_parallel else scatter_to_region(x, self.group)
        if self.world_size == 1:  # nothing to reduce: autograd's own linear backward
            return _matmul_bias(x_local, self.weight, self.bias)
        return apply_function(_RowLinear, x_local, self.weight, self.bias, self.group,
                              self.rank == 0, _waves(self, x_local) if self.overlap_comm else 0)


    def _check_synced_bias(self, synced_bias) -> None:
        """ValueError naming ``synced_bias`` unless it is None or stands for this layer's bias
        (a tensor of its shape and dtype, on a sequence-parallel layer that has a bias)."""
        if synced_bias is None:
            return
        if not self.sequence_parallel:
            raise ValueError("synced_bias is only for a sequence_parallel=True layer")
        if self.bias is None:
            raise ValueError("synced_bias was given but the layer has no bias (bias=False)")
        if not isinstance(synced_bias, torch.Tensor):
            raise ValueError(f"synced_bias must be a torch.Tensor, got "
                             f"{type(synced_bias).__name__}")
        if synced_bias.shape != self.bias.shape or synced_bias.dtype != self.bias.dtype:
            raise ValueError(f"synced_bias must have the bias's shape {tuple(self.bias.shape)} "
                             f"and dtype {self.bias.dtype}, got {tuple(synced_bias.shape)} "
                             f"{synced_bias.dtype}")


class ParallelMLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``: fc1 column-parallel, fc2 row-parallel (``d_ff`` split).

    One all-reduce forward (after fc2) and one backward (the input gradient, at fc1). With
    ``sequence_parallel=True`` input and output are this rank's sequence shard ``[..., T / tp,
    d_model]``: an all-gather (fc1) and a reduce-scatter (fc2) forward, their mirrors backward,
    plus the all-reduce of fc2's replicated-bias gradient (``d_model`` elements).

    >>> import torch
    >>> ParallelMLP(8, 32)(torch.randn(2, 3, 8)).shape
    torch.Size([2, 3, 8])
    """

    def __init__(self, d_model: int, d_ff: int, bias: bool = True, group=None, *,
                 dtype: torch.dtype | None = None, device=None, seed: int | None = 0,
                 overlap_comm: bool = True, sequence_parallel: bool = False,
                 comm_chunks: int | None = None):
        super().__init__()
        seed = check_seed(seed, allow_none=True)  # before seed + 1
        for name, v in (("d_model", d_model), ("d_ff", d_ff)):  # named as the caller knows them
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        kw = dict(group=group, dtype=dtype, device=device, sequence_parallel=sequence_parallel,
                  overlap_comm=overlap_comm, comm_chunks=comm_chunks)
        self.fc1 = ColumnParallelLinear(d_model, d_ff, bias, gather_output=False,
                                        seed=None if seed is None else seed, **kw)
        self.fc2 = RowParallelLinear(d_ff, d_model, bias, input_is_parallel=True,
                                     seed=None if seed is None else seed + 1, **kw)

    def load_unsharded(self, fc1_weight, fc1_bias, fc2_weight, fc2_bias) -> None:
        """FULL canonical ``mlp.fc1.*`` / ``mlp.fc2.*`` arrays (biases None without bias)."""
        self.fc1.load_unsharded(fc1_weight, fc1_bias)
        self.fc2.load_unsharded(fc2_weight, fc2_bias)

    def forward(self, x: torch.Tensor, *, synced_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``synced_bias``: fc2's, as :meth:`RowParallelLinear.forward` takes it."""
        self.fc2._check_synced_bias(synced_bias)  # before any collective
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"), synced_bias=synced_bias)


class ParallelSparseAttention(PatternModule):
    """Block-sparse multi-head self-attention with heads split contiguously over ``group``.

    ``qkv`` is column-parallel with the canonical group-major interleaved columns
    (:mod:`sparsetp.core.config`: per kv head, its ``G = num_heads / num_kv_heads`` query heads,
    its key and its value; ``h * 3 * hd + t * hd + e`` when ``G = 1``), so rank ``r`` of ``tp``
    holds whole kv groups: query heads ``[r * H / tp, (r + 1) * H / tp)`` with their kv heads,
    and attends with ``layout.heads(...)`` of those query heads (GQA in the kernels, k and v
    never repeated); ``out`` is row-parallel. Scale ``head_dim ** -0.5``.

    Args:
      d_model, num_heads: unsharded sizes (``num_heads`` divisible by the TP size).
      num_kv_heads: key/value heads (GQA; default ``num_heads``), divisible by the TP size.
      pattern: attention pattern, laid out per sequence length with ``block_size`` tiles.
      block_size, bias, group, dtype, device, seed: as above.
      overlap_comm, comm_chunks: passed to both linears (the forward and backward overlap).
      sequence_parallel: input and output are sequence shards (below); passed to both linears.

    Input ``x [B, N, d_model]`` (replicated), output ``[B, N, d_model]`` (replicated). With
    ``sequence_parallel``: input ``[B, N / tp, d_model]`` (rank r's tokens), qkv all-gathers it,
    the local heads attend over all ``N`` tokens, and ``out`` reduce-scatters back to
    ``[B, N / tp, d_model]``.

    ``forward(x, document_lengths=None)``: packed documents per call, one list of lengths
    shared by every batch row or one list per row (each summing to ``N``); the call attends
    with ``P.documents(document_lengths) & pattern`` (:func:`sparsetp.core.config.with_documents`),
    whose layout is cached per lengths (per-row lengths: a per-batch-row layout, this rank's
    heads of every row). Under ``torch.compile`` the lengths (Python ints) are constants of
    the graph: each new value is a new graph (Dynamo's guard), never a new kernel.
    """

    def __init__(self, d_model: int, num_heads: int, pattern: Pattern, block_size: int = 64,
                 bias: bool = True, group=None, *, dtype: torch.dtype | None = None,
                 device=None, seed: int | None = 0, overlap_comm: bool = True,
                 sequence_parallel: bool = False, num_kv_heads: int | None = None,
                 comm_chunks: int | None = None):
        super().__init__()
        if not isinstance(pattern, Pattern):
            raise ValueError(f"pattern must be a sparsetp Pattern, got {pattern!r}")
        seed = check_seed(seed, allow_none=True)  # before seed + 1
        for name, v in (("d_model", d_model), ("num_heads", num_heads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if num_heads < 1 or d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be a positive multiple of "
                             f"num_heads={num_heads}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        world = group_size(group)
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.num_kv_heads, self.kv_group = num_kv_heads, num_heads // num_kv_heads
        self.local_heads = _divide("num_heads", num_heads, world)
        self.local_kv_heads = _divide("num_kv_heads", num_kv_heads, world)
        self.pattern, self.block_size = pattern, block_size
        self.head_start = group_rank(group) * self.local_heads
        kw = dict(group=group, dtype=dtype, device=device, sequence_parallel=sequence_parallel,
                  overlap_comm=overlap_comm, comm_chunks=comm_chunks)
        qkv_width = d_model + 2 * num_kv_heads * self.head_dim
        self.qkv = ColumnParallelLinear(d_model, qkv_width, bias, gather_output=False,
                                        seed=seed, **kw)
        self.out = RowParallelLinear(d_model, d_model, bias, input_is_parallel=True,
                                     seed=None if seed is None else seed + 1, **kw)

    def _heads(self) -> tuple[int, int] | None:
        if self.local_heads == self.num_heads:
            return None
        return self.head_start, self.head_start + self.local_heads

    def local_layout(self, seq_len: int) -> BlockLayout:
        """This rank's heads of the pattern's layout for ``seq_len`` (cached)."""
        return cached_layout(self.pattern, seq_len, self.num_heads, self.block_size,
                             self._heads())

    def forward(self, x: torch.Tensor, document_lengths=None, *,
                synced_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``synced_bias``: the output projection's, as :meth:`RowParallelLinear.forward`
        takes it."""
        self.out._check_synced_bias(synced_bias)  # before any collective
        # [B, N, Hk_l * (G + 2) * hd] (under SP, gathered from N / tp tokens); group-major columns
        qkv_local = self.qkv(x)
        b, n, _ = qkv_local.shape
        g, hd = self.kv_group, self.head_dim
        qkv_local = qkv_local.view(b, n, self.local_kv_heads, g + 2, hd)
        q = qkv_local[:, :, :, :g].reshape(b, n, self.local_heads, hd).transpose(1, 2).contiguous()
        k, v = (qkv_local[:, :, :, t].transpose(1, 2).contiguous() for t in (g, g + 1))
        pattern = self._pattern_key
        if document_lengths is not None:
            pattern = _documents_pattern(self._pattern_key, document_lengths, b, n)
        o = pattern_attention(q, k, v, pattern, self.block_size, scale=hd ** -0.5,
                              num_heads=self.num_heads, heads=self._heads())
        o_local = o.transpose(1, 2).reshape(b, n, self.local_heads * self.head_dim)
        return self.out(o_local, synced_bias=synced_bias)


@torch.compiler.assume_constant_result
def _traced_documents_key(key: str, lengths: tuple, batch: int, seq_len: int) -> str:
    """:func:`_documents_pattern`'s pattern key, a constant of the traced graph."""
    return pattern_key(with_documents(_as_pattern(key), lengths, batch=batch, seq_len=seq_len))


def _documents_pattern(key: str, document_lengths, batch: int, seq_len: int):
    """``P.documents(document_lengths) & pattern`` of the pattern named ``key``: the pattern
    itself in eager calls (layouts are cached by its value; no key is kept per lengths), its
    :func:`pattern_key` under ``torch.compile`` (built while tracing)."""
    lengths = document_lengths_key(document_lengths)
    if torch.compiler.is_compiling():
        return _traced_documents_key(key, lengths, batch, seq_len)
    return with_documents(_as_pattern(key), lengths, batch=batch, seq_len=seq_len)
