"""Tensor-parallel collectives as small autograd Functions (Megatron's "mappings").

================================  ================================  ================================
function                          forward                           backward
================================  ================================  ================================
``copy_to_region``                identity                          all-reduce (sum)
``reduce_from_region``            all-reduce (sum)                  identity
``gather_from_region``            all-gather along the last dim     split the last dim (keep own)
``scatter_to_region``             split the last dim (keep own)     all-gather along the last dim
``all_gather_to_region``          all-gather along the sequence     reduce-scatter along the
                                  dim (-2)                          sequence dim
``reduce_scatter_from_region``    reduce-scatter along the          all-gather along the sequence
                                  sequence dim (-2)                 dim
``scatter_to_sequence_region``    split the sequence dim (keep      all-gather along the sequence
                                  own)                              dim
``gather_from_sequence_region``   all-gather along the sequence     split the sequence dim (keep
                                  dim                               own)
================================  ================================  ================================

``copy_to_region`` marks where a replicated activation enters a column-parallel region (every
rank's partial input gradient must be summed); ``reduce_from_region`` ends a row-parallel region.

Sequence parallelism (Megatron-LM, Korthikanti et al. 2022) keeps the activations *between*
the tensor-parallel regions (layer norms, residuals) split along the sequence dim instead of
replicated: ``all_gather_to_region`` enters a column-parallel region from sequence shards and
``reduce_scatter_from_region`` leaves a row-parallel region into them, so the all-reduce of
plain TP becomes an all-gather plus a reduce-scatter (the same bytes on a ring) and each rank
stores and normalises only ``N / tp`` tokens. Rank ``r`` holds the contiguous tokens
``[r * N / tp, (r + 1) * N / tp)``. ``scatter_to_sequence_region`` / ``gather_from_sequence_region``
move between a replicated full sequence and the shards (the backward of the latter assumes the
incoming gradient is the same on every rank, as ``gather_from_region``'s does).

Reduce-scatter and the flat all-gather use ``torch.distributed.reduce_scatter_single`` /
``all_gather_single`` (torch 2.13; ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` before
it, the same collectives under their old names). NCCL runs a real reduce-scatter. gloo (CPU)
has it too, but implements it as an all-reduce of the whole tensor followed by keeping this
rank's chunk (twice the traffic of a real reduce-scatter): a documented backend difference in
cost, not in the numbers (each rank gets the same sum of the same values).

``group=None`` means the default process group when ``torch.distributed`` is initialised and a
single process otherwise; on a group of size 1 every function is the identity (no collective).

Failures: every collective here runs under the process group's timeout (``timeout=`` of
``init_process_group`` / ``new_group``; BUILD.md). When one fails (a peer stalled past the
timeout, died, or took another code path) it raises :class:`CollectiveError`, a RuntimeError
whose message names the collective, the group size and this rank (gloo's own message is only
"Timed out waiting 5000ms for recv operation"), chained to the backend's error. Under
``torch.compile`` the traced functional collectives are left as they are.

>>> import torch
>>> x = torch.ones(2, 4, requires_grad=True)
>>> copy_to_region(x).shape    # single process: identity
torch.Size([2, 4])
>>> all_gather_to_region(x).shape   # likewise: one rank holds the whole sequence
torch.Size([2, 4])
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "group_size", "group_rank", "copy_to_region", "copy_many_to_region", "reduce_from_region",
    "gather_from_region",
    "scatter_to_region", "all_gather_dim", "all_reduce_", "all_reduce_async",
    "all_gather_to_region",
    "reduce_scatter_from_region", "scatter_to_sequence_region", "gather_from_sequence_region",
    "all_gather_seq", "reduce_scatter_seq", "split_seq", "ring_exchange", "p2p_all_gather",
    "SEQ_DIM",
    "CollectiveError",
]

SEQ_DIM = -2  # the sequence dim of ``[..., T, features]`` activations that SP splits


def _active(group) -> bool:
    if group is not None:
        return True
    return dist.is_available() and dist.is_initialized()


def group_size(group=None) -> int:
    """Size of ``group`` (1 when ``group`` is None and torch.distributed is not initialised)."""
    return dist.get_world_size(group) if _active(group) else 1


def group_rank(group=None) -> int:
    """This process's rank in ``group`` (0 when not distributed)."""
    return dist.get_rank(group) if _active(group) else 0


class CollectiveError(RuntimeError):
    """A collective of this module failed: timed out waiting for a peer, or the peer died.

    The message names the collective, the group size and this rank; ``__cause__`` is the
    backend's own error (gloo's timeout message names neither the collective nor the group).
    """


def _failed(name: str, group, err: BaseException) -> CollectiveError:
    world = group_size(group)
    return CollectiveError(
        f"{name} over a process group of {world} ranks failed on rank {group_rank(group)}: "
        f"{err}. A rank that never reaches the same collective (stalled, crashed, or on another "
        "code path) makes the others wait until the group's timeout; set it with "
        "init_process_group(timeout=datetime.timedelta(...)) (see BUILD.md)")


def _named(name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a torch.distributed collective, ``group=`` among the kwargs); a
    RuntimeError from it is re-raised as :class:`CollectiveError` naming ``name``. Compiled
    graphs trace the call as is (their collectives fail inside the compiled code, where this
    wrapper is not)."""
    group = kwargs.get("group")
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    try:
        work = fn(*args, **kwargs)
    except RuntimeError as err:
        raise _failed(name, group, err) from err
    return None if work is None else _NamedWork(work, name, group)


class _NamedWork:
    """An async collective's handle whose ``wait()`` raises :class:`CollectiveError`."""

    def __init__(self, work, name: str, group):
        self._work, self._name, self._group = work, name, group

    def wait(self):
        try:
            return self._work.wait()
        except RuntimeError as err:
            raise _failed(self._name, self._group, err) from err


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()  # never reduce into a tensor autograd (or the caller) still holds
    _named("all_reduce", dist.all_reduce, x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum all-reduce of ``x`` in place (no autograd, no copy); returns ``x``. ``x`` must be
    contiguous and owned by the caller (e.g. a GEMM's fresh output)."""
    if group_size(group) > 1:
        if not x.is_contiguous():
            raise ValueError("all_reduce_ needs a contiguous tensor")
        _named("all_reduce", dist.all_reduce, x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_async(x: torch.Tensor, group=None):
    """Start an in-place sum all-reduce of ``x`` (no autograd); returns the work handle to
    ``wait()`` on, or None on a group of size 1 (or under torch.compile, where it blocks).
    ``x`` must be contiguous and owned by the caller: it is overwritten with the sum once the
    handle completes."""
    if group_size(group) == 1:
        return None
    if not x.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor (it reduces in place)")
    # Blocking where overlap is off (_can_overlap): the reduction is then done, the handle None.
    return _named("all_reduce (async)", dist.all_reduce, x, op=dist.ReduceOp.SUM,
                  group=group, async_op=_can_overlap())


def _p2p(transfers, name: str, group) -> list:
    """Start ``transfers`` (``(dist.isend or dist.irecv, tensor, peer's rank in group)``) as one
    batched call (``batch_isend_irecv``: an NCCL group, so every rank's sends and receives pair
    up without the deadlock separate blocking calls would risk); the handles to ``wait()`` on.
    Point-to-point transfers take few SMs, so they can run under a GEMM."""
    ops = [dist.P2POp(op, t, q if group is None else dist.get_global_rank(group, q), group)
           for op, t, q in transfers]
    if not ops:
        return []
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as err:
        raise _failed(name, group, err) from err
    return [_NamedWork(w, name, group) for w in works]


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group=None) -> list:
    """Start sending ``send`` to the next rank of ``group`` and receiving ``recv`` from the
    previous one (ranks in a ring, ``r -> r + 1 mod world``); returns the handles to ``wait()``
    on (no autograd). ``send`` must stay untouched and ``recv`` unread until they complete."""
    world, rank = group_size(group), group_rank(group)
    return _p2p([(dist.isend, send, (rank + 1) % world), (dist.irecv, recv, (rank - 1) % world)],
                "ring send/recv", group)


def p2p_all_gather(send: torch.Tensor, recv: list, group=None) -> list:
    """Start sending ``send`` to every other rank of ``group`` and receiving rank q's into
    ``recv[q]`` (``recv[own rank]`` is left as it is); returns the handles to ``wait()`` on
    (no autograd). ``send`` stays untouched and the ``recv`` tensors unread until they
    complete."""
    world, rank = group_size(group), group_rank(group)
    return _p2p([t for q in range(world) if q != rank
                 for t in ((dist.isend, send, q), (dist.irecv, recv[q], q))],
                "all-gather (send/recv)", group)


def all_gather_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    _named("all_gather", dist.all_gather, parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    last = x.shape[-1]
    if last % world:
        raise ValueError(f"last dim {last} is not divisible by the group size {world}")
    size = last // world
    rank = group_rank(group)
    return x[..., rank * size:(rank + 1) * size].contiguous()


def _collective(name: str, old_name: str):
    """``dist.<name>``, or its pre-2.13 spelling ``dist.<old_name>`` (same collective; 2.13
    deprecates the old name with a FutureWarning). Looked up per call, not at import, so a test
    that wraps the ``torch.distributed`` functions sees every call."""
    fn = getattr(dist, name, None)
    return fn if fn is not None else getattr(dist, old_name)


def _seq_len(x: torch.Tensor, dim: int, world: int, name: str) -> tuple[int, int]:
    """(normalised dim, length per rank); ValueError naming ``name`` unless ``world`` divides
    the sequence length."""
    d = dim % x.dim()
    n = x.shape[d]
    if n % world:
        raise ValueError(f"sequence parallelism splits dim {dim} of {name} (length {n}) over the "
                         f"tensor-parallel size {world}, which does not divide it")
    return d, n // world


def _can_overlap() -> bool:
    """Whether a collective may run asynchronously here. torch.compile traces only blocking
    collectives (as functional collectives, which its scheduler may overlap by itself), so the
    hand-written overlap steps aside there; the handle is then None."""
    return not torch.compiler.is_compiling()


def _all_gather_seq_start(x: torch.Tensor, group, async_op: bool):
    """Start the flat all-gather of ``x`` into a rank-major buffer ``[world, *x.shape]``;
    returns ``(buffer, handle)`` (``handle`` None unless ``async_op``). One flat collective
    into one buffer, not ``world`` separate outputs and a ``cat`` (``all_gather_dim``)."""
    async_op = async_op and _can_overlap()
    x = x.contiguous()
    buf = torch.empty((group_size(group), *x.shape), dtype=x.dtype, device=x.device)
    # The collective wants the output as the inputs concatenated along dim 0 (gloo checks the
    # shape): the same memory as ``buf``, viewed [world * x.shape[0], ...].
    handle = _named("all_gather_single",
                    _collective("all_gather_single", "all_gather_into_tensor"),
                    buf.flatten(0, 1), x, group=group, async_op=async_op)
    return buf, (handle if async_op else None)


def _rank_major_to_seq(buf: torch.Tensor, dim: int) -> torch.Tensor:
    """``[world, ..., t, ...]`` -> ``[..., world * t, ...]``, rank r's block at [r t, (r+1) t).
    A view when every dim before ``dim`` has size 1 (Megatron's sequence-first layout, or
    batch 1 here); otherwise ``flatten`` copies once."""
    d = dim % (buf.dim() - 1)
    return buf.movedim(0, d).flatten(d, d + 1)


def all_gather_seq(x: torch.Tensor, dim: int = SEQ_DIM, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd); bitwise
    :func:`all_gather_dim`, through one flat collective."""
    if group_size(group) == 1:
        return x
    buf, _ = _all_gather_seq_start(x, group, async_op=False)
    return _rank_major_to_seq(buf, dim)


def _reduce_scatter_seq(x: torch.Tensor, dim: int, group, async_op: bool, name: str):
    async_op = async_op and _can_overlap()
    world = group_size(group)
    d, t = _seq_len(x, dim, world, name)
    # Rank r's output is the sum of every rank's chunk r of ``dim``; the collective takes chunk
    # r as the r-th contiguous slice of its input, so move the rank axis to the front (a copy
    # only when a dim before ``dim`` is larger than 1).
    # (reshape, not Tensor.unflatten: torch.compile cannot trace the latter's super() call)
    x_rank_major = x.reshape(*x.shape[:d], world, t, *x.shape[d + 1:]).movedim(d, 0).contiguous()
    out = torch.empty(x_rank_major.shape[1:], dtype=x.dtype, device=x.device)
    handle = _named("reduce_scatter_single",
                    _collective("reduce_scatter_single", "reduce_scatter_tensor"),
                    out, x_rank_major.flatten(0, 1), op=dist.ReduceOp.SUM, group=group,
                    async_op=async_op)
    return out, (handle if async_op else None)


def reduce_scatter_seq(x: torch.Tensor, dim: int = SEQ_DIM, group=None,
                       name: str = "x") -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's contiguous chunk of ``dim`` (no autograd).

    ``x [..., T, ...]`` -> ``[..., T / world, ...]``; ValueError (naming ``name``) unless the
    group size divides ``T``. On gloo the collective is an all-reduce plus a chunk inside
    torch (see the module docstring): the same numbers, twice the traffic.
    """
    if group_size(group) == 1:
        return x
    return _reduce_scatter_seq(x, dim, group, async_op=False, name=name)[0]


def split_seq(x: torch.Tensor, dim: int = SEQ_DIM, group=None, name: str = "x") -> torch.Tensor:
    """This rank's contiguous chunk of ``dim`` (no communication, no autograd);
    ValueError (naming ``name``) unless the group size divides the length."""
    world = group_size(group)
    if world == 1:
        return x
    d, t = _seq_len(x, dim, world, name)
    return x.narrow(d, group_rank(group) * t, t).contiguous()


# torch.compile before torch 2.13 (2.11 measured) traces the tensor-parallel autograd Functions
# into graphs whose gradients are wrong at TP > 1; there each Function runs outside the graph
# (a graph break, eager numbers) instead. torch 2.13 traces them exactly (tests/
# torch_compile_test.py, bitwise equal to eager).
TRACES_FUNCTIONS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def apply_function(fn, *args):
    """``fn.apply(*args)`` for the tensor-parallel autograd Functions (see above)."""
    return fn.apply(*args)


if not TRACES_FUNCTIONS:
    apply_function = torch.compiler.disable(apply_function)


def _region(fn, x: torch.Tensor, group, *args) -> torch.Tensor:
    """``fn.apply(x, *args, group)`` for a region Function; on one rank every region is the
    identity, so no Function is used (plain autograd, and plain tracing under compile)."""
    if group_size(group) == 1:
        return x
    return apply_function(fn, x, *args, group)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _CopyManyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        # One flat all-reduce per dtype: every gradient is in by now (autograd runs a node once
        # all its outputs' gradients are), so one collective replaces one per tensor.
        out = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            idx = [i for i, g in enumerate(grads) if g.dtype == dtype]
            flat = torch.cat([grads[i].reshape(-1) for i in idx])
            _named("all_reduce", dist.all_reduce, flat, op=dist.ReduceOp.SUM, group=ctx.group)
            for i, part in zip(idx, flat.split([grads[i].numel() for i in idx]), strict=True):
                # Own storage each: autograd keeps these as .grad, and views of one buffer
                # would tie the six gradients' lifetimes (and torch.save sizes) together.
                out[i] = part.view_as(grads[i]).clone()
        return (None, *out)


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, -1, ctx.group), None


class _AllGatherToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's full-sequence input gradient is partial (its heads / hidden columns
        # only): sum them and keep this rank's tokens in one collective.
        return reduce_scatter_seq(grad, ctx.dim, ctx.group, name="the gradient"), None, None


class _ReduceScatterFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_seq(x, dim, group, name="x")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.dim, ctx.group), None, None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_seq(x, dim, group, name="x")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_seq(grad, ctx.dim, ctx.group, name="the gradient"), None, None


def copy_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return _region(_CopyToRegion, x, group)


def copy_many_to_region(tensors, group=None) -> tuple[torch.Tensor, ...]:
    """:func:`copy_to_region` of several tensors in one collective: identity forward; backward
    sums their gradients over ``group`` in one all-reduce per dtype, once the last of them is
    known. For replicated parameters that each rank uses on its own tokens (layer norms and
    biases under sequence parallelism), so every rank's ``.grad`` is the full sum.

    Tensors that do not require grad are returned as they are (no all-reduce for them); one
    that requires grad but is not used gets a zero gradient, not None (all ranks reduce the
    same buffer either way).

    >>> w, b = copy_many_to_region([ln.weight, ln.bias], group)   # doctest: +SKIP
    >>> y = F.layer_norm(x_shard, ln.normalized_shape, w, b)      # doctest: +SKIP
    """
    tensors = tuple(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if group_size(group) == 1:
        return tensors
    grad = [i for i, t in enumerate(tensors) if t.requires_grad]
    if not grad:
        return tensors
    got = iter(apply_function(_CopyManyToRegion, group, *(tensors[i] for i in grad)))
    return tuple(next(got) if t.requires_grad else t for t in tensors)


def reduce_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return _region(_ReduceFromRegion, x, group)


def gather_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return _region(_GatherFromRegion, x, group)


def scatter_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return _region(_ScatterToRegion, x, group)


def all_gather_to_region(x: torch.Tensor, group=None, *, dim: int = SEQ_DIM) -> torch.Tensor:
    """Sequence shards in, the full sequence out (all-gather along ``dim``); backward
    reduce-scatters the gradient. The sequence-parallel :func:`copy_to_region`: it opens a
    column-parallel region.

    >>> import torch
    >>> all_gather_to_region(torch.randn(2, 5, 8)).shape   # single process
    torch.Size([2, 5, 8])
    """
    return _region(_AllGatherToRegion, x, group, dim)


def reduce_scatter_from_region(x: torch.Tensor, group=None, *,
                               dim: int = SEQ_DIM) -> torch.Tensor:
    """Partial sums over the full sequence in, this rank's summed tokens out (reduce-scatter
    along ``dim``); backward all-gathers the gradient. The sequence-parallel
    :func:`reduce_from_region`: it closes a row-parallel region. ValueError unless the group
    size divides the sequence length."""
    return _region(_ReduceScatterFromRegion, x, group, dim)


def scatter_to_sequence_region(x: torch.Tensor, group=None, *,
                               dim: int = SEQ_DIM) -> torch.Tensor:
    """A replicated full sequence in, this rank's contiguous tokens out; backward all-gathers
    the gradient. ValueError unless the group size divides the sequence length.

    Under torch.distributed with 2 ranks: ``x [B, 128, d]`` -> ``[B, 64, d]`` holding tokens
    ``[64 r, 64 (r + 1))``.
    """
    return _region(_ScatterToSequenceRegion, x, group, dim)


def gather_from_sequence_region(x: torch.Tensor, group=None, *,
                                dim: int = SEQ_DIM) -> torch.Tensor:
    """Sequence shards in, the full sequence (replicated) out; backward keeps this rank's
    tokens of the gradient, which is right when that gradient is the same on every rank (a loss
    computed identically everywhere), as for :func:`gather_from_region`."""
    return _region(_GatherFromSequenceRegion, x, group, dim)
