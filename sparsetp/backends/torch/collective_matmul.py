"""Collective matmuls: tensor-parallel GEMMs split so that their communication runs under them.

Megatron's plain schedule runs a layer's collective before or after its whole GEMM, so the GPU's
links idle during the GEMM and its tensor cores during the collective. Here the GEMM is split
by tokens and the pieces' data move by point-to-point transfers (``comm.ring_exchange``,
``comm.p2p_all_gather``; NCCL send/recv) while the next piece multiplies (Wang et al. 2023,
"Overlap communication with dependent computation via decomposition"; JAX's collective-matmul
guide). Point-to-point transfers rather than chunked NCCL collectives: on 2 H200s a chunked
all-reduce under the GEMM gained nothing (its kernels take SMs from the GEMM for as long as
they hide), while the send/recv ring made the sequence-parallel MLP forward 7% faster
(``benchmarks/KERNEL_NOTES.md``, "TP overlap").

=============================  ==================================================================
function                       schedule
=============================  ==================================================================
``all_gather_matmul``          start a direct all-gather of the token shards; multiply this rank's
                               own shard meanwhile; then the others' shards
``matmul_reduce_scatter``      ring of partial sums: step s multiplies chunk ``(r - 1 - s) mod p``,
                               adds the sum received for it, passes it on (under step s + 1)
``matmul_all_reduce``          ``waves`` groups of tokens, each a ring reduce-scatter followed by
                               a direct all-gather of the summed chunks that runs under the next
                               wave's GEMMs (the last one is returned still in flight)
=============================  ==================================================================

No autograd (the layers' Functions call these from their forward and backward). Each computes in
the autocast dtype where autocast is on (casting its operands as autocast would; the outputs are
written into slices of one buffer, which autocast does not support). Numerics: the same products
summed in another, fixed order (deterministic); within the dtype's rounding of the plain
schedule, not bitwise.
"""

from __future__ import annotations

import torch

from sparsetp.backends.torch.comm import (
    SEQ_DIM,
    _rank_major_to_seq,
    _seq_len,
    group_rank,
    group_size,
    p2p_all_gather,
    ring_exchange,
)

__all__ = ["compute_dtype", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
           "wait_all"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on ``x`` runs in: autocast's where it is on (it casts matmuls' operands
    to it), else ``x``'s."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _mm_into(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """``out[:] = a @ w (+ b)`` for 2-D ``a`` (``out`` may be a slice of a larger buffer)."""
    if b is None:
        return torch.mm(a, w, out=out)
    return torch.addmm(b, a, w, out=out)


def _split(m: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``[0, m)``, sizes differing by at most one."""
    return [(m * i // parts, m * (i + 1) // parts) for i in range(parts)]


def wait_all(handles) -> None:
    for h in handles:
        if h is not None:
            h.wait()


def _ring_reduce_scatter(partial, rows, out: torch.Tensor, group) -> torch.Tensor:
    """Rank r ends with ``out = sum over ranks of partial(r)``: ``partial(c, out=None)`` returns
    this rank's contribution to chunk c (a fresh tensor, or written into ``out``), whose dim 0
    has ``rows(c)`` entries (the receive buffer is allocated before that chunk's GEMM).

    Step s computes chunk ``(r - 1 - s) mod p`` (the last step: this rank's own, into ``out``),
    adds the running sum the left neighbour sent for it, and sends the result right; the
    transfer runs under the next step's GEMM.
    """
    world, rank = group_size(group), group_rank(group)
    pending, keep, recv = [], [], None
    for s in range(world):
        c = (rank - 1 - s) % world
        part = partial(c, out if s == world - 1 else None)
        wait_all(pending)
        if recv is not None:
            part.add_(recv)
        if s < world - 1:
            nxt = (c - 1) % world  # the chunk the left neighbour sends its running sum of
            recv = part.new_empty((rows(nxt), *part.shape[1:]))
            keep.append(part)  # the send reads it until its handle completes
            pending = ring_exchange(part, recv, group)
    return out


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias, group, *,
                      keep_input: bool = False):
    """``(all_gather_seq(x_shard) @ W + b, gathered)``: the gather under this rank's own GEMM.

    ``x_shard [..., t, in]`` (this rank's tokens) -> ``[..., p t, out]`` in token order; with
    ``keep_input`` also the gathered input, rank-major ``[p, rows, in]`` (else None). At TP = 2
    the gather hides under half of the GEMM; at TP = p it must fit under 1 / p of it.
    """
    world, rank = group_size(group), group_rank(group)
    dt = compute_dtype(x_shard)
    rows = x_shard.numel() // x_shard.shape[-1]
    x2 = x_shard.reshape(rows, x_shard.shape[-1]).contiguous()
    gathered = torch.empty(world, *x2.shape, dtype=x2.dtype, device=x2.device)
    handles = p2p_all_gather(x2, list(gathered.unbind(0)), group)
    with torch.autocast(x2.device.type, enabled=False):
        w = weight.to(dt)
        b = None if bias is None else bias.to(dt)
        y = torch.empty(world, rows, w.shape[1], dtype=dt, device=x2.device)
        _mm_into(y[rank], x2.to(dt), w, b)
        wait_all(handles)
        for lo, hi in ((0, rank), (rank + 1, world)):
            if hi > lo:
                _mm_into(y[lo:hi].flatten(0, 1), gathered[lo:hi].flatten(0, 1).to(dt), w, b)
    y = _rank_major_to_seq(y.view(world, *x_shard.shape[:-1], w.shape[1]), SEQ_DIM)
    if not keep_input:
        return y, None
    gathered[rank].copy_(x2)
    return y, gathered


def matmul_reduce_scatter(x_local: torch.Tensor, weight: torch.Tensor, group,
                          name: str = "x") -> torch.Tensor:
    """``reduce_scatter_seq(x_local @ W)``: ``[..., T, in / p]`` -> this rank's summed tokens
    ``[..., T / p, out]``, as a ring of partial sums under the chunk GEMMs. ValueError (naming
    ``name``) unless ``p`` divides ``T``."""
    d, t = _seq_len(x_local, SEQ_DIM, group_size(group), name)
    dt = compute_dtype(x_local)
    shape = (*x_local.shape[:d], t, weight.shape[1])
    with torch.autocast(x_local.device.type, enabled=False):
        w = weight.to(dt)

        def partial(c, out):
            return torch.matmul(x_local.narrow(d, c * t, t).to(dt), w, out=out)

        out = torch.empty(shape, dtype=dt, device=x_local.device)
        return _ring_reduce_scatter(partial, lambda c: shape[0], out, group)


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, bias, group, waves: int):
    """``(all_reduce(x @ W + b), handles)``: the tokens in ``waves`` groups, each reduced as a
    ring reduce-scatter under its chunk GEMMs, then all-gathered directly while the next wave
    multiplies. The last wave's all-gather is still in flight: ``wait_all(handles)`` before
    reading the output (a backward computes d(W) first). ``bias`` is added once, by rank 0.
    Needs at least ``p * waves`` tokens (fewer waves are used otherwise)."""
    world, rank = group_size(group), group_rank(group)
    dt = compute_dtype(x)
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    waves = max(1, min(waves, m // world))
    with torch.autocast(x.device.type, enabled=False):
        w = weight.to(dt)
        b = None if bias is None or rank != 0 else bias.to(dt)
        y = torch.empty(m, w.shape[1], dtype=dt, device=x.device)
        handles = []
        for lo, hi in _split(m, waves):
            chunks = [(lo + a, lo + z) for a, z in _split(hi - lo, world)]

            def partial(c, out, chunks=chunks):
                a, z = chunks[c]
                part = x2[a:z].to(dt)
                if out is None:
                    out = torch.empty(z - a, w.shape[1], dtype=dt, device=x.device)
                return _mm_into(out, part, w, b)

            a, z = chunks[rank]
            _ring_reduce_scatter(partial, lambda c, chunks=chunks: chunks[c][1] - chunks[c][0],
                                 y[a:z], group)
            wait_all(handles)  # one wave's gather in flight at a time
            handles = p2p_all_gather(y[a:z], [y[c0:c1] for c0, c1 in chunks], group)
    return y.view(*x.shape[:-1], w.shape[1]), handles
