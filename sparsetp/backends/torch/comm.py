"""Tensor-parallel collectives as small autograd Functions (Megatron's "mappings").

===========================  ==============================  ==============================
function                     forward                         backward
===========================  ==============================  ==============================
``copy_to_region``           identity                        all-reduce (sum)
``reduce_from_region``       all-reduce (sum)                identity
``gather_from_region``       all-gather along the last dim   split the last dim (keep own)
``scatter_to_region``        split the last dim (keep own)   all-gather along the last dim
===========================  ==============================  ==============================

``copy_to_region`` marks where a replicated activation enters a column-parallel region (every
rank's partial input gradient must be summed); ``reduce_from_region`` ends a row-parallel region.

``group=None`` means the default process group when ``torch.distributed`` is initialised and a
single process otherwise; on a group of size 1 every function is the identity (no collective).

>>> import torch
>>> x = torch.ones(2, 4, requires_grad=True)
>>> copy_to_region(x).shape    # single process: identity
torch.Size([2, 4])
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "group_size", "group_rank", "copy_to_region", "reduce_from_region", "gather_from_region",
    "scatter_to_region", "all_gather_dim", "all_reduce_async",
]


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


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()  # never reduce into a tensor autograd (or the caller) still holds
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_async(x: torch.Tensor, group=None):
    """Start an in-place sum all-reduce of ``x`` (no autograd); returns the work handle to
    ``wait()`` on, or None on a group of size 1. ``x`` must be contiguous and owned by the
    caller: it is overwritten with the sum once the handle completes."""
    if group_size(group) == 1:
        return None
    if not x.is_contiguous():
        raise ValueError("all_reduce_async needs a contiguous tensor (it reduces in place)")
    return dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_gather_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd)."""
    world = group_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
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


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


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


def copy_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return _ScatterToRegion.apply(x, group)
