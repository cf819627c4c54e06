"""Native CPU path of block-sparse attention for torch tensors (no Triton).

CPU tensors run here by default (:mod:`sparsetp._runtime`, device kind ``"cpu"``);
``SPARSETP_INTERPRET=1`` sends them to the Triton kernels in the interpreter instead. The
numbers follow the kernels' contract on the *same* layout metadata, read as it is (no
``schedule.kernel_layout`` conversion):

* Query tile ``I`` of head ``h`` attends to the key tiles ``q_index[h, I, :q_count[h, I]]`` of kv
  head ``h // (H / H_kv)``; the first ``q_partial[h, I]`` of them under the bitmask row
  ``masks[q_mask_id[h, I, e]]`` (token exact), the others unmasked except for keys past
  ``N_kv`` in a ragged last tile.
* Scores, softmax and products accumulate in float32 for float16/bfloat16/float32 inputs, in
  float64 for float64; the LSE is the natural log-sum-exp of the scaled scores (float32, or
  float64), as the kernels return it. A row with no allowed key gives output 0, LSE ``-inf``
  and zero gradients.
* Backward recomputes the probabilities from the saved LSE (FlashAttention style); dQ is
  written per query tile, dK/dV are scatter-added (``index_add_``, sequential on CPU, so
  deterministic) over the gathered tiles and hence summed over each GQA group.

How: the query tiles are cut into chunks. For every head, a chunk's rows list key/value tiles:
a row of a band's interior lists consecutive tiles, so the chunk reads them as a strided view of
K and V (:meth:`_Tables.window`); other chunks gather them (``q_index`` padded to the chunk's
widest row). ATen's fused flash-attention kernel for CPU then runs each query tile against its
row as one short sequence, with an additive mask for partial tiles and padding: no score matrix
is materialised and the kernel threads over heads and tiles itself. A chunk holds whole rows, so
no softmax state crosses chunks; its size is bounded (:data:`CHUNK_ELEMENTS`), so extra memory
grows with the computed blocks of a chunk, never with ``N x N``. A backward with an LSE
cotangent, which the fused kernel has no input for, takes batched matmuls instead.

Example::

    >>> import torch
    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.causal(), seq_len=100, num_heads=2, block_size=32)
    >>> q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
    >>> out, lse = forward(q, k, v, lay, 0.25)
    >>> out.shape, lse.dtype
    (torch.Size([1, 2, 100, 16]), torch.float32)
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import weakref

import numpy as np
import torch

from sparsetp.core.layout import BlockLayout

__all__ = ["forward", "backward", "CHUNK_ELEMENTS"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)

# Elements of the largest per-chunk temporary (scores [B, H, tiles, bs, W*bs], or the gathered
# K/V tiles when D > bs): 2**22 fp32 = 16 MiB, small enough to stay cache-friendly and to
# bound memory, large enough that per-chunk Python overhead is noise.
CHUNK_ELEMENTS = 1 << 22

# Threads for the backward's chunks (None: torch.get_num_threads() up to POOL_MAX_THREADS, else
# 1: the caller's thread, whose ops use torch's own threads). Each worker runs its chunks' ops on
# one torch thread, while the caller adds finished chunks' dK/dV (index_add_, one thread) in
# order. The forward always runs on the caller.
WORKERS: int | None = None
# The most torch threads the worker pool stands in for. Measured (KERNEL_NOTES, "Native CPU
# path"): on 2 cores the pool ran the N=4096 window backward 1.3x faster than torch's threads
# (the caller's dK/dV adds overlap the workers' chunks), on 16 the caller won 2-3x; counts
# between 2 and 16 are untested.
POOL_MAX_THREADS = 4

# Work is split among the workers only into chunks of at least this many elements: a chunk's
# few ops and its hand-over cost ~0.3 ms, a 2**17-element chunk ~1 ms of work on one core.
MIN_SPLIT_ELEMENTS = 1 << 17
# Chunks per worker, so that the workers finish together when chunks differ in cost.
CHUNKS_PER_WORKER = 8

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# ATen's fused (flash) attention for CPU tensors: with the gathered tiles as its sequences and
# an additive mask it computes a chunk without materialising its scores, threaded inside.
_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Tables:
    """Per layout: the listed key tiles and, per entry, a row of an extended mask table."""

    def __init__(self, layout: BlockLayout):
        bs, n_k = layout.block_size, layout.kv_len
        w = layout.widest_row  # the ELL rows are padded to a multiple of 16: skip the padding
        count, partial = layout.q_count, layout.q_partial
        index = layout.q_index[..., :w].astype(np.int64)
        mask_id = layout.q_mask_id[..., :w]
        kt = -(-n_k // bs)
        ragged = n_k - (kt - 1) * bs  # valid keys in the last key tile
        words = np.ascontiguousarray(layout.masks.astype("<i4")).view(np.uint8)
        bits = np.unpackbits(words, axis=-1, bitorder="little")[..., :bs].astype(bool)
        n_masks = bits.shape[0]
        # Entries that are not partial get one of three extra rows: full, full but ragged (keys
        # past N_kv are zero padding and must not count), or empty (ELL padding).
        full = np.ones((1, bs, bs), bool)
        full_ragged = np.broadcast_to(np.arange(bs) < ragged, (1, bs, bs))
        table = np.concatenate([bits, full, full_ragged, np.zeros((1, bs, bs), bool)])
        e = np.arange(w)
        listed = e < count[..., None]
        full_id = np.where((index == kt - 1) & (ragged < bs), n_masks + 1, n_masks)
        ids = np.where(e < partial[..., None], mask_id,
                       np.where(listed, full_id, n_masks + 2)).astype(np.int64)
        self.index = torch.from_numpy(np.ascontiguousarray(index))
        self.ids_np = ids
        # Query rows that see no key at all, [H, NT * bs]: the fused kernel returns LSE 0 there
        # (its output is 0, as ours), so their LSE is set to -inf after the call.
        sees = np.concatenate([bits.any(-1), np.ones((2, bs), bool), np.zeros((1, bs), bool)])
        keyless = ~sees[ids].any(axis=2)  # [H, NT, bs]
        self.keyless = torch.from_numpy(keyless.reshape(keyless.shape[0], -1)) \
            if keyless.any() else None
        # bias[u, r, c]: 0 where query r of the tile may see key c, -inf where not; added to the
        # scores (a vectorised add: masked_fill_ with a bool mask is ~5x slower per element).
        self.bias = torch.where(torch.from_numpy(table), 0.0, float("-inf"))
        self.full_id, self.empty_id = n_masks, n_masks + 2
        self.widest = count.max(axis=0)  # [NT]: the widest row of each query tile, any head
        # Per query tile: how many leading entries need a bias (partial ones come first, then
        # full and ragged ones up to the last ragged), and a key for those entries' masks in
        # every head: tiles with equal keys can share one bias (see plan()).
        special = (ids != self.full_id) & (ids != self.empty_id)
        self.extent = (special * np.arange(1, w + 1)).max(axis=(0, 2), initial=0)
        self.signature = [(int(x), ids[:, t, :x].tobytes()) for t, x in enumerate(self.extent)]
        self.plans: dict = {}
        self.masks: dict = {}
        self.fused_masks: dict = {}
        self.count = count
        self.windows: dict = {}

    def chunk_mask(self, t0: int, t1: int, w: int):
        """How to mask the scores ``[B, H, t1 - t0, bs, w * bs]`` of a chunk, built once per
        chunk: ``(e, bias, ids, pads)``. The first ``e`` entries of every row get an additive
        bias: ``bias`` (``[H, 1, bs, e * bs]``, when every tile of the chunk has the same masks
        there), else the rows ``ids`` (int64 ``[H, ct, e]``) of the bias table, gathered per
        call (kept, they would hold an N x W x bs float per head). ``pads`` lists
        ``(start, rows)``: columns from tile ``start`` on are ELL padding (-inf) in the
        flattened (head, tile) rows ``rows``. Full tiles cost nothing."""
        key = (t0, t1, w)
        if key not in self.masks:
            ids = self.ids_np[:, t0:t1, :w]
            e = int(self.extent[t0:t1].max())
            head = np.ascontiguousarray(ids[..., :e])
            bias = ids_t = None
            bs = self.bias.shape[-1]
            if e and (head == head[:, :1]).all():
                rows = self.bias[torch.from_numpy(head[:, 0].reshape(-1))]  # [H*e, bs, bs]
                bias = rows.reshape(-1, 1, e, bs, bs).transpose(2, 3).reshape(-1, 1, bs, e * bs)
            elif e:
                ids_t = torch.from_numpy(head)
            # The listed entries come first: a row's padding starts at its count (or at e, when
            # the bias already covers the first padded entries).
            start = np.maximum((ids != self.empty_id).sum(-1), e).reshape(-1)
            pads = [(int(c), torch.from_numpy(np.flatnonzero(start == c)))
                    for c in np.unique(start) if c < w]
            self.masks[key] = (e, bias, ids_t, pads)
        return self.masks[key]

    def fused_mask(self, t0: int, t1: int, w: int, batch: int, dtype: torch.dtype,
                   windowed: bool = False):
        """The additive mask of chunk ``(t0, t1, w)`` for the fused kernel, broadcastable to its
        scores ``[B * H, t1 - t0, bs, w * bs]`` (0 where a query may see a key, -inf elsewhere),
        or None when every listed entry is a full tile; ``windowed``: its key tiles in the
        order of :meth:`window`, else of the rows' entries. A mask shared by the chunk's tiles
        is kept once per content (``[1, 1, ...]`` when the heads agree, else ``[H, 1, ...]``,
        repeated over a batch per call): a band's chunks share one. One that differs per tile
        is built per call (kept, it would hold an N x W x bs float per head)."""
        e, bias, ids, pads = self.chunk_mask(t0, t1, w)
        if not e and not pads:
            return None
        h, bs, ct = self.ids_np.shape[0], self.bias.shape[-1], t1 - t0
        order = self.window(t0, t1, w)[2] if windowed else None
        shared = ids is None and not pads
        key = None
        if shared:
            head = self.ids_np[:, t0, :e]
            key = (e, w, head.tobytes(), None if order is None else order.tobytes(), dtype)
            mask = self.fused_masks.get(key)
            if mask is not None:
                return mask if batch == 1 or mask.shape[0] == 1 else mask.repeat(batch, 1, 1, 1)
        mask = torch.zeros(h, 1 if shared else ct, bs, w * bs, dtype=dtype)
        if bias is not None:
            mask[..., :e * bs] = bias.reshape(h, 1, bs, e * bs)
        elif e:
            mask[..., :e * bs] = (self.bias.index_select(0, ids.reshape(-1)).to(dtype)
                                  .reshape(h, ct, e, bs, bs).transpose(2, 3)
                                  .reshape(h, ct, bs, e * bs))
        for start, which in pads:  # pads make the mask per tile
            mask.view(h * ct, bs, w * bs)[which, :, start * bs:] = float("-inf")
        if order is not None:  # entry e's columns go to tile order[e] of the run
            mask = mask.unflatten(-1, (w, bs)).index_select(
                -2, torch.from_numpy(np.argsort(order))).flatten(-2)
        if shared:
            if (head == head[:1]).all():
                mask = mask[:1].clone()  # one head's: broadcasts over B * H
            self.fused_masks[key] = mask
        return mask if batch == 1 or mask.shape[0] == 1 else mask.repeat(batch, 1, 1, 1)

    def window(self, t0: int, t1: int, w: int) -> tuple[int, int, np.ndarray] | None:
        """``(first, step, order)`` when every head's rows of chunk ``(t0, t1, w)`` list exactly
        the ``w`` consecutive key tiles from ``first + step * (t - t0)`` on (a band, block-
        diagonal runs), entry ``e`` being tile ``order[e]`` of that run in every row: then the
        chunk's K/V tiles are a strided view (:func:`_window`); else None."""
        key = (t0, t1, w)
        if key not in self.windows:
            found = None
            index = self.index.numpy()[:, t0:t1, :w]
            if w and (self.count[:, t0:t1] == w).all():
                starts = index.min(-1)  # [H, ct]
                step = int(starts[0, 1] - starts[0, 0]) if t1 - t0 > 1 else 0
                order = index[0, 0] - starts[0, 0]
                if (step >= 0 and (starts == starts[0, 0] + step * np.arange(t1 - t0)).all()
                        and np.array_equal(np.sort(order), np.arange(w))
                        and (index - starts[..., None] == order).all()):
                    found = (int(starts[0, 0]), step, order)
            self.windows[key] = found
        return self.windows[key]

    def per_tile(self, batch: int, head_dim: int) -> int:
        """Elements per listed entry of a query tile in a chunk's largest temporary (scores
        ``[B, H, ., bs, W*bs]``, or the gathered K/V tiles when D > bs)."""
        bs = self.bias.shape[-1]
        return batch * self.ids_np.shape[0] * bs * max(bs, head_dim)

    def plan(self, batch: int, head_dim: int, parts: int = 1) -> list[tuple[int, int, int]]:
        """Chunks ``(t0, t1, w)``: query tiles ``[t0, t1)`` padded to ``w`` listed tiles, each at
        most :data:`CHUNK_ELEMENTS` per temporary and at most ``1/parts`` of the whole (so that
        ``parts`` workers can share them) unless that is below :data:`MIN_SPLIT_ELEMENTS` (a
        single tile row may exceed any bound). A run of tiles with the same masks (a band's
        interior, every row of causal) is chunked on its own, so its chunks keep one small bias
        instead of gathering one per tile and call; tiles between such runs (a band's first
        rows, random patterns) share chunks."""
        key = (batch, head_dim, parts, CHUNK_ELEMENTS, MIN_SPLIT_ELEMENTS)
        if key not in self.plans:
            nt = self.ids_np.shape[1]
            per_tile = self.per_tile(batch, head_dim)
            limit = min(CHUNK_ELEMENTS,
                        max(MIN_SPLIT_ELEMENTS, -(-per_tile * int(self.widest.sum()) // parts)))
            sig = self.signature
            run_end = list(range(1, nt + 1))  # run_end[t]: end of the run of tiles like t
            for t in range(nt - 2, -1, -1):
                if sig[t] == sig[t + 1]:
                    run_end[t] = run_end[t + 1]
            chunks, t0 = [], 0
            while t0 < nt:
                uniform = run_end[t0] - t0 >= 2
                t1, w = t0 + 1, int(self.widest[t0])
                while t1 < nt and per_tile * (t1 + 1 - t0) * max(w, int(self.widest[t1])) \
                        <= limit:
                    if (t1 >= run_end[t0]) if uniform else (run_end[t1] - t1 >= 2):
                        break
                    w = max(w, int(self.widest[t1]))
                    t1 += 1
                chunks.append((t0, t1, w))
                t0 = t1
            self.plans[key] = chunks
        return self.plans[key]


def _tables(layout: BlockLayout) -> _Tables:
    tables = _TABLES.get(layout)
    if tables is None:
        tables = _TABLES[layout] = _Tables(layout)
    return tables


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """``exp`` in place, as ``exp2(x * log2 e)``: torch's CPU exp2 is about twice as fast as its
    exp, and the extra multiply is cheap. ``x`` is already shifted by the row's max (or LSE), so
    it is small and the product rounds no worse than exp would (scaling the raw scores by
    log2 e instead would round large scores: ~1e-5 relative error at |s| ~ 250)."""
    return x.mul_(LOG2E).exp2_()


def _tiles(t: torch.Tensor, n_tiles: int, bs: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, L, D]`` -> ``[B, H, n_tiles, bs, D]`` in ``dtype``, zero padded."""
    b, h, n, d = t.shape
    t = t.to(dtype)
    if t.stride(-1) != 1:  # ATen's fused kernel reads rows as contiguous (wrong numbers else)
        t = t.contiguous()
    if n_tiles * bs != n:  # pad copies even when it adds nothing (N=65536: 3 x 64 MiB)
        t = torch.nn.functional.pad(t, (0, 0, 0, n_tiles * bs - n))
    return t.reshape(b, h, n_tiles, bs, d)


def _operands(q, k, v, layout: BlockLayout):
    """What forward and backward share: the layout's tables, the compute dtype, the query and
    key tile counts, q/k/v as zero-padded tiles in that dtype, and each query head's kv head
    ``[H, 1, 1]`` (GQA)."""
    h, h_kv, bs = q.shape[1], k.shape[1], layout.block_size
    cdt = _compute_dtype(q.dtype)
    nt, kt_n = -(-q.shape[2] // bs), -(-k.shape[2] // bs)
    qt, kt, vt = _tiles(q, nt, bs, cdt), _tiles(k, kt_n, bs, cdt), _tiles(v, kt_n, bs, cdt)
    kv_head = (torch.arange(h) // (h // h_kv))[:, None, None]
    return _tables(layout), cdt, nt, kt_n, qt, kt, vt, kv_head


def _gather_tiles(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, T, bs, D]`` -> ``[B, len(rows), bs, D]``: tiles ``rows`` of the flattened
    (kv head, tile) axis. One ``index_select`` over the first axis of a 2-D view: whole rows
    copied as they are (over an inner axis of the 4-D view it is ~10x slower)."""
    b, h_kv, n_t, bs, d = t.shape
    if b > 1:
        rows = (torch.arange(b)[:, None] * (h_kv * n_t) + rows).reshape(-1)
    return t.reshape(b * h_kv * n_t, bs * d).index_select(0, rows).view(b, -1, bs, d)


def _gather_kv(tables: _Tables, kt, vt, kv_head, t0: int, t1: int, w: int,
               views: bool = True):
    """``(index [H, ct, w], k, v [B * H, ct, w * bs, D], windowed)``: the key/value tiles that
    query tiles ``[t0, t1)`` list, each row cut to ``w`` entries: a strided view of ``kt``/``vt``
    in the order of :meth:`_Tables.window` (``windowed``; with ``views`` and no GQA), else
    gathered in the rows' order; ``index``: the key tile of each column block."""
    b, h_kv, n_t, bs, d = kt.shape
    ct = t1 - t0
    window = tables.window(t0, t1, w) \
        if views and h_kv == kv_head.shape[0] and _viewable(kt) and _viewable(vt) else None
    if window is not None:  # no copy: the chunk's key tiles are one stride apart
        first, step, _ = window
        run = (first + step * torch.arange(ct)[:, None] + torch.arange(w)).expand(h_kv, ct, w)
        return run, _window(kt, first, step, ct, w), _window(vt, first, step, ct, w), True
    index = tables.index[:, t0:t1, :w]
    # One index_select of whole tiles over (kv head, tile) rows: a plain row copy, faster than
    # advanced indexing over two dims.
    rows = (kv_head * n_t + index).reshape(-1)  # [H*ct*W]
    shape = (b * kv_head.shape[0], ct, w * bs, d)
    return index, _gather_tiles(kt, rows).view(shape), _gather_tiles(vt, rows).view(shape), False


def _viewable(t: torch.Tensor) -> bool:
    """Whether :func:`_window` can view tiles ``[B, H, T, bs, D]``: rows one stride apart across
    tile boundaries, and batch and heads one axis (else the chunk gathers: e.g. a batch of
    ``[B, N, H, D].transpose(1, 2)`` views, or K/V expanded over the batch)."""
    b, h, _, bs, _ = t.shape
    sb, sh, st, sr, _ = t.stride()
    return st == bs * sr and (b == 1 or sb == h * sh)


def _window(t: torch.Tensor, first: int, step: int, ct: int, w: int) -> torch.Tensor:
    """``[B * H, ct, w * bs, D]`` view of tiles ``[B, H, T, bs, D]`` (:func:`_viewable`): for
    ``c < ct`` the ``w`` tiles from ``first + step * c`` on, as one run of rows."""
    b, h, _, bs, d = t.shape
    _, sh, st, sr, sd = t.stride()
    return t.as_strided((b * h, ct, w * bs, d), (sh, step * st, sr, sd),
                        t.storage_offset() + first * st)


def _fold(t: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """Tiles ``[t0, t1)`` of ``[B, H, NT, bs, ...]`` as ``[B * H, t1 - t0, bs, ...]`` (a view)."""
    return t[:, :, t0:t1].flatten(0, 1)


class _Chunk:
    """One chunk's gathered tiles and masked, scaled scores (the LSE-cotangent backward)."""

    def __init__(self, tables: _Tables, kt, vt, kv_head, q_c, t0, t1, w, scale):
        b, h, ct, bs, d = q_c.shape
        self.index, k, v, _ = _gather_kv(tables, kt, vt, kv_head, t0, t1, w, views=False)
        self.k = k.view(b, h, ct, w * bs, d)  # [B, H, ct, W*bs, D]
        self.v = v.view(b, h, ct, w * bs, d)
        # Scaling q (bs x D per tile) instead of the scores (bs x W*bs) is W*bs/D times less
        # work; the same product up to fp32 rounding.
        s = torch.matmul(q_c * scale, self.k.transpose(-1, -2))  # [B, H, ct, bs, W*bs]
        e, bias, ids, pads = tables.chunk_mask(t0, t1, w)
        if e:
            if bias is None:  # [H, ct, bs, e * bs]
                bias = (tables.bias.index_select(0, ids.reshape(-1))
                        .reshape(h, ct, e, bs, bs).transpose(2, 3).reshape(h, ct, bs, e * bs))
            s[..., :e * bs].add_(bias)
        rows = s.view(b, h * ct, bs, w * bs)
        for start, which in pads:
            rows[:, which, :, start * bs:] = float("-inf")
        self.s = s


def _map_chunks(fn, chunks, consume=None, parallel: bool = True) -> None:
    """``fn(chunk)`` for every chunk, on :func:`_workers` threads when there are several and
    ``parallel`` (else on the caller, on torch's threads: for small calls the hand-over to the
    workers costs more than it saves); ``consume(result)`` runs on the caller, in
    chunk order (so sums over chunks are deterministic), at most ``2 * workers`` results
    behind."""
    n = _workers()
    if n <= 1 or not parallel or len(chunks) <= 1:
        for c in chunks:
            r = fn(c)
            if consume is not None:
                consume(r)
        return
    grad = torch.is_grad_enabled()

    def run(c):  # grad mode is per thread: the caller's (off inside autograd Functions)
        with torch.set_grad_enabled(grad):
            return fn(c)

    pool, pending = _pool(n), collections.deque()
    for c in chunks:
        pending.append(pool.submit(run, c))
        if len(pending) >= 2 * n:
            r = pending.popleft().result()
            if consume is not None:
                consume(r)
    while pending:
        r = pending.popleft().result()
        if consume is not None:
            consume(r)


def _workers() -> int:
    """Worker threads for the chunks: :data:`WORKERS`, else torch's intra-op thread count when
    it is at most :data:`POOL_MAX_THREADS`, else 1 (the caller, on torch's threads)."""
    if WORKERS is not None:
        return WORKERS
    n = torch.get_num_threads()
    return n if n <= POOL_MAX_THREADS else 1


_POOL: dict = {}


def _single_threaded() -> None:
    torch.get_num_threads()  # this thread's lazy init first: the restore in _pool keeps its 1
    torch.set_num_threads(1)


def _pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
    """``n`` threads that run torch ops single-threaded. ``torch.set_num_threads`` also sets the
    count that threads started later begin with, so every worker is started here and the
    caller's count given back: the caller and the process's other threads are untouched. Made
    again after a fork, whose child has none of the threads."""
    key = (os.getpid(), n)
    if key not in _POOL:
        for old in _POOL.values():
            old.shutdown(wait=False)
        _POOL.clear()
        saved = torch.get_num_threads()
        pool = concurrent.futures.ThreadPoolExecutor(
            n, thread_name_prefix="sparsetp-cpu", initializer=_single_threaded)
        started = threading.Barrier(n, timeout=60)
        list(pool.map(lambda _: started.wait(), range(n)))  # one task per thread: all start
        torch.set_num_threads(saved)
        _POOL[key] = pool
    return _POOL[key]


def _plan(tables: _Tables, batch: int, head_dim: int) -> tuple[list, bool]:
    """The chunks of a call (cut for the workers), their masks and windows built on the caller
    (workers then only read them; were two to build one, each would make the same value), and
    whether the call is large enough (2 x :data:`MIN_SPLIT_ELEMENTS`) for the workers."""
    n = _workers()
    chunks = tables.plan(batch, head_dim, CHUNKS_PER_WORKER * n if n > 1 else 1)
    for c in chunks:
        tables.chunk_mask(*c)
        tables.window(*c)
    return chunks, tables.per_tile(batch, head_dim) * int(tables.widest.sum()) \
        >= 2 * MIN_SPLIT_ELEMENTS


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
            scale: float, *, new_output=_empty) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, N, D] in q's dtype, lse [B, H, N] float32/float64)``; see the module
    docstring. ``new_output(shape, dtype, device)`` allocates the two results (every element is
    written)."""
    b, h, n, d = q.shape
    bs = layout.block_size
    tables, cdt, nt, kt_n, qt, kt, vt, kv_head = _operands(q, k, v, layout)
    out = new_output((b, h, n, d), q.dtype, q.device)
    lse = new_output((b, h, n), cdt, q.device)

    def chunk(c):  # writes rows [t0 * bs, t1 * bs) of out and lse: chunks never share one
        t0, t1, w = c
        r0, r1 = t0 * bs, min(t1 * bs, n)
        if w == 0:  # no key anywhere in these rows
            out[:, :, r0:r1].zero_()
            lse[:, :, r0:r1].fill_(float("-inf"))
            return
        _, k_g, v_g, windowed = _gather_kv(tables, kt, vt, kv_head, t0, t1, w)
        o, m = _FUSED(_fold(qt, t0, t1), k_g, v_g,
                      attn_mask=tables.fused_mask(t0, t1, w, b, cdt, windowed), scale=scale)
        rows = r1 - r0
        out[:, :, r0:r1] = o.reshape(b, h, -1, d)[:, :, :rows]
        lse[:, :, r0:r1] = m.reshape(b, h, -1)[:, :, :rows]
        if tables.keyless is not None:
            lse[:, :, r0:r1].masked_fill_(tables.keyless[:, r0:r1], float("-inf"))

    # On the caller: the fused kernel threads itself, and the pool's single-threaded workers
    # lost to it (2 cores: 15.4 vs 9.3 ms at N=4096, KERNEL_NOTES "Native CPU path").
    # Cut as for the workers all the same: smaller chunks pad rows of unlike width less
    # (BigBird N=8192 forward 58 vs 78 ms on 2 cores).
    chunks, _ = _plan(tables, b, d)
    _map_chunks(chunk, chunks, parallel=False)
    return out, lse


def backward(q, k, v, out, lse, d_out, d_lse, layout: BlockLayout, scale: float, *,
             new_output=_empty) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes for the cotangents ``d_out`` (and ``d_lse``, or
    None) of :func:`forward`'s results."""
    b, h, n, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    bs = layout.block_size
    if d_lse is not None and not d_lse.any():
        # A zero LSE cotangent (compiled graphs materialise one) changes nothing: take the
        # fused kernel, so that compiled and eager gradients are the same bits.
        d_lse = None
    tables, cdt, nt, kt_n, qt, kt, vt, kv_head = _operands(q, k, v, layout)
    dot = _tiles(d_out, nt, bs, cdt)
    lse = lse.to(cdt)
    finite = torch.isfinite(lse)
    # Rows with no key have LSE -inf; +inf there makes every exp(s - lse) 0 (their scores are
    # -inf or finite), where -inf would give exp(-inf + inf) = NaN.
    lse_t = _tiles(torch.where(finite, lse, float("inf"))[..., None], nt, bs, cdt)
    if d_lse is None:
        ot = _tiles(out, nt, bs, cdt)
    else:
        # Delta_i = sum_d dO_id O_id (as the dQ kernel computes it); an LSE cotangent enters
        # dS = P * (dP - Delta) as Delta - d_lse (d lse_i / d s_ij = p_ij), zero on rows with
        # no key. The fused kernel has no place for it, so these chunks take matmuls.
        delta = (d_out.to(cdt) * out.to(cdt)).sum(-1) - torch.where(finite, d_lse.to(cdt), 0.0)
        delta_t = _tiles(delta[..., None], nt, bs, cdt)
    dq = new_output(q.shape, q.dtype, q.device)
    dk_t = torch.zeros(b, h_kv * kt_n, bs, d, dtype=cdt)
    dv_t = torch.zeros(b, h_kv * kt_n, bs, d, dtype=cdt)

    def fused(c):  # dq rows of its own; dK/dV contributions returned to add in chunk order
        t0, t1, w = c
        r0, r1 = t0 * bs, min(t1 * bs, n)
        if w == 0:
            dq[:, :, r0:r1].zero_()
            return None
        index, k_g, v_g, windowed = _gather_kv(tables, kt, vt, kv_head, t0, t1, w)
        # The kernel forms Delta = rowsum(dO * O) from the out it is given, as the dQ kernel.
        dq_c, dk_g, dv_g = _FUSED_BWD(
            _fold(dot, t0, t1), _fold(qt, t0, t1), k_g, v_g, _fold(ot, t0, t1),
            _fold(lse_t, t0, t1)[..., 0], 0.0, False,
            attn_mask=tables.fused_mask(t0, t1, w, b, cdt, windowed), scale=scale)
        dq[:, :, r0:r1] = dq_c.reshape(b, h, -1, d)[:, :, :r1 - r0]
        dest = (kv_head * kt_n + index).reshape(-1)                    # [H*ct*W] key tiles
        return dest, dk_g.reshape(b, -1, bs, d), dv_g.reshape(b, -1, bs, d)

    def chunk(c):  # as fused(), with Delta - d_lse in dS
        t0, t1, w = c
        r0, r1 = t0 * bs, min(t1 * bs, n)
        if w == 0:
            dq[:, :, r0:r1].zero_()
            return None
        q_c, do_c = qt[:, :, t0:t1], dot[:, :, t0:t1]
        c = _Chunk(tables, kt, vt, kv_head, q_c, t0, t1, w, scale)
        ct = t1 - t0
        p = _exp_(c.s.sub_(lse_t[:, :, t0:t1]))                        # [B, H, ct, bs, W*bs]
        dv_g = torch.matmul(p.transpose(-1, -2), do_c)                 # [B, H, ct, W*bs, D]
        dp = torch.matmul(do_c, c.v.transpose(-1, -2))
        ds = p.mul_(dp.sub_(delta_t[:, :, t0:t1]))                     # dS (in p's buffer)
        dq_c = torch.matmul(ds, c.k).mul_(scale)                       # [B, H, ct, bs, D]
        dk_g = torch.matmul(ds.transpose(-1, -2), q_c).mul_(scale)     # [B, H, ct, W*bs, D]
        dq[:, :, r0:r1] = dq_c.reshape(b, h, -1, d)[:, :, :r1 - r0]
        # Entries of a row past its count have P = 0, so they add exact zeros to tile 0.
        dest = (kv_head * kt_n + c.index).reshape(-1)                  # [H*ct*W] key tiles
        return dest, dk_g.reshape(b, h * ct * w, bs, d), dv_g.reshape(b, h * ct * w, bs, d)

    def add(r):
        if r is not None:
            dk_t.index_add_(1, r[0], r[1])
            dv_t.index_add_(1, r[0], r[2])

    chunks, parallel = _plan(tables, b, d)
    _map_chunks(chunk if d_lse is not None else fused, chunks, add, parallel)
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)
    dk.copy_(dk_t.reshape(b, h_kv, kt_n * bs, d)[:, :, :n_k])
    dv.copy_(dv_t.reshape(b, h_kv, kt_n * bs, d)[:, :, :n_k])
    return dq, dk, dv
