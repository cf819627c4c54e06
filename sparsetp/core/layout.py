"""Block layouts: a pattern made concrete for one sequence length, head count and block size.

``make_layout(pattern, seq_len, num_heads, block_size)`` cuts the ``N x N`` score matrix of
each head into ``block_size`` tiles (the last row/column of tiles is ragged when ``block_size``
does not divide ``N``) and records, as numpy arrays, everything a kernel needs:

``block_mask[h, I, J]`` (int8)
    0 empty (never computed), 1 partial (computed under the element mask), 2 full (computed
    with no element mask). Only valid tokens (``< seq_len``) count when classifying.

Queries != keys (``kv_len``)
    ``make_layout(..., kv_len=N_k)`` lays out an ``N_q x N_k`` score matrix (``seq_len = N_q``
    queries; ``kv_len`` defaults to ``seq_len``). Rule (FlashAttention 2.1+, "bottom-right
    aligned"): queries and keys are the *last* tokens of one virtual sequence of
    ``L = max(N_q, N_k)`` tokens, so query ``i`` is virtual token ``i + L - N_q`` and key ``j``
    is virtual token ``j + L - N_k``, and the pattern is evaluated there with ``n = L``. For
    causal this reads: query ``i`` sees key ``j`` iff ``j <= i + N_k - N_q`` (decoding one query
    against a cache of ``N_k`` keys sees them all; with ``N_q > N_k`` the first ``N_q - N_k``
    queries see no key and give output 0). Every pattern (local windows, documents, global
    tokens, ...) is aligned the same way. Query-major arrays have ``ceil(N_q / bs)`` tiles,
    key-major ones ``ceil(N_k / bs)``.

Grouped-query attention (GQA/MQA)
    A layout has one row per *query* head (``num_heads = H``), whatever the number of key/value
    heads: kernels read kv head ``h // (H / H_kv)`` for query head ``h``, and the dK/dV program
    of kv head ``g`` walks the key-major lists of each query head of its group in turn (no
    atomics, deterministic). Keeping the layout per query head means a per-head pattern still
    gives every query head of a group its own mask; the layout never needs to know ``H_kv``.

Per-batch-row layouts (``batch``)
    A pattern that differs per batch row (:func:`~sparsetp.core.patterns.per_batch_row`, or
    ``documents`` with one list of lengths per row: each row its own packing) gives a layout
    with ``batch = B``: every table holds ``B * num_heads`` heads, row-major (table head
    ``r * num_heads + h`` is head ``h`` of batch row ``r``), and serves exactly a
    ``[B, H, N, D]`` call. The frontends fold batch into heads (``[B, H, N, D]`` ->
    ``[1, B * H, N, D]``, a view for contiguous inputs; kv heads fold alike, since
    ``(r * H + h) // G == r * H_kv + h // G``) and launch :meth:`BlockLayout.flat`, the same
    tables as an ordinary layout of ``B * num_heads`` heads: no kernel knows about rows, and a
    new set of per-row lengths is new table data, never a new kernel. ``batch`` is None for a
    layout every batch row shares.

        >>> from sparsetp.core import patterns as P
        >>> lay = make_layout(P.documents([[64, 192], [256]]) & P.causal(), 256, 2, 64)
        >>> lay.batch, lay.num_heads, lay.q_count.shape, lay.flat().num_heads
        (2, 2, (4, 4), 4)

Query-major lists (forward and dQ), padded ("ELL") so every array has a static shape:
    ``q_count[h, I]`` key tiles listed for query tile ``I``; ``q_partial[h, I]`` how many of them,
    listed *first*, are partial; ``q_index[h, I, k]`` the key tile; ``q_mask_id[h, I, k]`` the
    row of ``masks`` for partial entries (-1 for full entries and padding). Entries past
    ``q_count`` are padding (index 0) and must not be read. ``q_halves[h, I]``: how many of the
    partial entries, listed first among them, are *half entries*: tiles one of whose two key
    halves (``bs/2`` keys) holds no allowed pair for any of its rows (``mask_quarters``), so
    a kernel can compute two of them in one step (a 3-D neighbourhood's tiles often are).
    Each group (half entries, other partial entries, full entries) is in ascending key order.

Key-major lists (dK/dV): ``k_count``, ``k_partial``, ``k_index``, ``k_mask_id`` with the roles of
query and key tiles swapped (``k_index`` lists query tiles; ``k_mask_id`` still names the mask of
the tile as seen query-major, i.e. rows are queries).

Work order (both views): ``q_order[h, r]`` / ``k_order[h, r]`` (int32) is the tile that rank
``r`` of head ``h`` processes: tiles sorted by list length, longest first (stable, so equal
lengths keep tile order). Launching long rows first keeps them from forming the tail of the
launch (causal's last rows, BigBird's global rows). A permutation of ``range(num_blocks)``.
How a launch orders *heads* is a GPU-scheduling question, answered by
:mod:`sparsetp.kernels.schedule` from these counts.

``masks[u, r, w]`` (int32)
    The element mask of partial tiles as a compact bitmask: bit ``c % 32`` of word ``c // 32`` of
    row ``r`` says whether query ``I*bs + r`` may attend to key ``J*bs + c``. Identical masks are
    stored once (causal has one diagonal mask for every tile and head), so the table stays tiny.
    *Why a bitmask rather than per-pattern parameters:* unions, intersections and per-head mixes
    of arbitrary patterns reach the kernel through one mechanism, the kernel has one code path,
    and its cost (one int32 load per 32 columns of a tile row, expanded to bits in registers,
    for *partial* tiles only) is paid only where a mask is needed. Bits of tokens past
    ``seq_len`` are 0; kernels must still bound their loads by ``seq_len``: full tiles of the
    ragged last row/column carry no mask.

``mask_quarters[u]`` (int32)
    Bit ``2*r + c`` says whether query rows ``[r*bs/2, (r+1)*bs/2)`` and keys ``[c*bs/2,
    (c+1)*bs/2)`` of ``masks[u]`` hold an allowed pair: a kernel that walks a tile in half-tile
    steps skips a quarter with none instead of computing it masked (a 2-D or 3-D
    neighbourhood's partial tiles often have empty halves and quarters).

All metadata arrays have shapes that depend only on (heads, tiles, widest row rounded up to a
multiple of 16 — see ``_ELL_ALIGN`` —, distinct masks), never on values, so a frontend can pass
them to a kernel as tensors: a new pattern with the same shapes reuses the compiled kernel.

Example::

    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.causal(), seq_len=256, num_heads=2, block_size=64)
    >>> lay.block_mask[0].tolist()
    [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
    >>> round(lay.density, 3)
    0.625
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import numpy as np

from sparsetp.core.patterns import EMPTY, FULL, PARTIAL, Pattern, validate_batch_rows

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
_CHUNK_ELEMENTS = 1 << 24  # bound the temporary bool arrays while evaluating partial tiles
# False: every layout from the dense nb x nb kinds, never from Pattern._sparse_tiles (tests
# build layouts both ways and compare them field by field).
_USE_SPARSE_TILES = True

__all__ = ["BlockLayout", "make_layout", "check_tables", "block_kinds", "work_order",
           "layout_from_handle", "SUPPORTED_BLOCK_SIZES"]

# Every layout gets a process-unique string handle, so a frontend can name it inside a traced
# graph: torch.compile passes strings through as constants (an int could turn symbolic).
_HANDLES = itertools.count(1)
_BY_HANDLE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def mask_quarters(masks: np.ndarray) -> np.ndarray:
    """int32[U]: bit ``2*r + c`` set iff query rows ``[r*bs/2, (r+1)*bs/2)`` and keys
    ``[c*bs/2, (c+1)*bs/2)`` of mask ``u`` of ``masks`` (``[U, bs, words]``) allow a pair (see
    the module docstring).

    >>> m = np.zeros((2, 4, 1), np.int32)
    >>> m[0, 3, 0] = 1; m[1, 0, 0] = 0b1000; m[1, 2, 0] = 0b0001
    >>> mask_quarters(m)  # [0]: rows 2-3 x keys 0-1; [1]: rows 0-1 x keys 2-3, rows 2-3 x 0-1
    array([4, 6], dtype=int32)
    """
    u, bs = masks.shape[:2]
    rows = masks.reshape(u, 2, bs // 2, -1).view(np.uint32)  # [U, query half, rows, words]
    key = np.arange(rows.shape[-1] * 32).reshape(-1, 32)  # word w holds keys 32 w .. 32 w + 31
    bit = np.uint32(1) << np.arange(32, dtype=np.uint32)
    out = np.zeros(u, np.int32)
    for c in range(2):  # the bits of key half c, per word
        sel = (((key >= c * bs // 2) & (key < (c + 1) * bs // 2)) * bit).sum(1, np.uint32)
        hit = ((rows & sel) != 0).any(axis=(2, 3))  # [U, query half]
        out |= (hit[:, 0] << c | hit[:, 1] << (2 + c)).astype(np.int32)
    return out


def half_masks(quarters: np.ndarray) -> np.ndarray:
    """bool[U]: whether one key half of each mask (its :func:`mask_quarters` entry) holds no
    allowed pair for any row, the mask of a half entry (module docstring, ``q_halves``).

    >>> half_masks(np.array([4, 6, 15, 5], np.int32)).tolist()
    [True, False, False, True]
    """
    quarters = np.asarray(quarters)
    return ((quarters & 5) == 0) | ((quarters & 10) == 0)


def work_order(count: np.ndarray) -> np.ndarray:
    """int32[H, T]: per head, the tiles sorted by ``count`` descending (stable).

    >>> work_order(np.array([[1, 3, 2, 3]])).tolist()
    [[1, 3, 2, 0]]
    """
    count = np.asarray(count)
    return np.argsort(-count.astype(np.int64), axis=-1, kind="stable").astype(np.int32)


def _words(block_size: int) -> int:
    return -(-block_size // 32)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
    """A pattern's tiles for one ``(seq_len, num_heads, block_size)``; see the module docstring."""

    pattern: Pattern | None
    seq_len: int
    num_heads: int
    block_size: int
    block_mask: np.ndarray
    q_count: np.ndarray
    q_partial: np.ndarray
    q_index: np.ndarray
    q_mask_id: np.ndarray
    k_count: np.ndarray
    k_partial: np.ndarray
    k_index: np.ndarray
    k_mask_id: np.ndarray
    masks: np.ndarray
    # Derived from the counts and masks when not given (see the module docstring).
    q_order: np.ndarray | None = None
    k_order: np.ndarray | None = None
    mask_quarters: np.ndarray | None = None
    q_halves: np.ndarray | None = None
    # The layout a head slice (:meth:`heads`) was cut from, and the slice's first head in it;
    # None and 0 for a whole layout.
    source: BlockLayout | None = dataclasses.field(default=None, repr=False)
    head_offset: int = 0
    # Number of keys (``N_k``); None means ``seq_len`` (self-attention). See the module docstring.
    kv_len: int | None = None
    # Batch rows of a per-row layout (tables hold batch * num_heads heads, row-major); None: one
    # layout for every batch row. See the module docstring.
    batch: int | None = None
    # Process-unique id of this object (:func:`layout_from_handle`); not part of the value.
    handle: str = dataclasses.field(init=False, repr=False, compare=False, default="")

    def __post_init__(self):
        object.__setattr__(self, "handle", f"layout-{next(_HANDLES)}")
        _BY_HANDLE[self.handle] = self
        if self.kv_len is None:
            object.__setattr__(self, "kv_len", self.seq_len)
        for name in ("q_order", "k_order"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, work_order(getattr(self, name[0] + "_count")))
        if self.mask_quarters is None:
            object.__setattr__(self, "mask_quarters", mask_quarters(self.masks))
        if self.q_halves is None:  # the leading run of half entries of each list
            mid = self.q_mask_id
            lead = (mid >= 0) & half_masks(self.mask_quarters)[np.maximum(mid, 0)]
            object.__setattr__(self, "q_halves", np.logical_and.accumulate(
                lead, axis=-1).sum(-1, dtype=np.int32) if lead.shape[-1] else
                np.zeros(mid.shape[:-1], np.int32))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                v.setflags(write=False)
        # A hand-built (or dataclasses.replace'd) layout whose fields disagree with its tables
        # fails here, naming the geometry, not later in a kernel check naming a table.
        check_tables(self)

    @property
    def table_heads(self) -> int:
        """Heads the tables hold: ``batch * num_heads`` (``num_heads`` unless per-row)."""
        return self.num_heads * (self.batch or 1)

    def flat(self) -> BlockLayout:
        """The layout a launch runs for a per-row layout: the same tables as an ordinary
        layout of ``batch * num_heads`` heads (for ``[1, B * H, N, D]``, batch folded into
        heads); ``self`` when not per-row. One object per layout (kernel caches key on it)."""
        if self.batch is None:
            return self
        flat = self.__dict__.get("_flat")
        if flat is None:
            pattern = None if self.pattern is None else _BatchHeads(
                tuple(self.pattern._batch_row(r) for r in range(self.batch)), self.num_heads)
            flat = dataclasses.replace(self, pattern=pattern, num_heads=self.table_heads,
                                       batch=None, source=None, head_offset=0)
            object.__setattr__(self, "_flat", flat)
        return flat

    @property
    def num_blocks(self) -> int:
        """Query tiles (rows of ``block_mask``)."""
        return self.block_mask.shape[1]

    @property
    def num_kv_blocks(self) -> int:
        """Key tiles (columns of ``block_mask``); ``num_blocks`` unless ``kv_len != seq_len``."""
        return self.block_mask.shape[2]

    @property
    def density(self) -> float:
        """Fraction of tiles that are computed (partial or full)."""
        return float((self.block_mask != EMPTY).mean())

    @property
    def nnz_blocks(self) -> int:
        return int((self.block_mask != EMPTY).sum())

    @property
    def widest_row(self) -> int:
        """Most tiles any query-major list holds (at least 1): the meaningful prefix of the
        ``q_index`` / ``q_mask_id`` rows, whose width is padded to a multiple of 16."""
        return max(1, int(self.q_count.max(initial=0)))

    @property
    def skip_quarters(self) -> bool:
        """Whether skipping the empty quarters of partial tiles (:attr:`mask_quarters`) saves
        at least 1/20 of the computed quarters: kernels that can skip them compile the skip
        only then, so layouts with few (causal's one quarter of each diagonal tile) pay
        nothing for it."""
        ids = self.q_mask_id[self.q_mask_id >= 0]
        if not ids.size:
            return False
        empty = 4 * ids.size - int(np.bitwise_count(self.mask_quarters[ids]).sum())
        return bool(20 * empty >= 4 * int(self.q_count.sum()))

    @property
    def skip_halves(self) -> bool:
        """Whether the half entries (:attr:`q_halves`) are at least 1/20 of the listed tiles:
        kernels that can pack them two to a step (the sm_90 forward) compile that only then,
        so layouts with none run the binaries they would without it."""
        return bool(20 * int(self.q_halves.sum()) >= int(self.q_count.sum()) > 0)

    def metadata(self) -> dict[str, np.ndarray]:
        """The arrays a kernel launch needs, by name (all int32)."""
        names = ("q_count", "q_partial", "q_index", "q_mask_id", "k_count", "k_partial",
                 "k_index", "k_mask_id", "masks", "q_order", "k_order", "mask_quarters",
                 "q_halves")
        return {n: getattr(self, n) for n in names}

    def tile_mask(self, h: int, qi: int, kj: int) -> np.ndarray:
        """bool[bs, bs] element mask of one tile (rows queries), including padding as False;
        ``h`` is a table head (``r * num_heads + h`` for head ``h`` of row ``r``)."""
        bs = self.block_size
        kind = self.block_mask[h, qi, kj]
        rows = qi * bs + np.arange(bs) < self.seq_len
        cols = kj * bs + np.arange(bs) < self.kv_len
        if kind == EMPTY:
            return np.zeros((bs, bs), bool)
        if kind == FULL:
            return rows[:, None] & cols[None, :]
        k = int(np.flatnonzero(self.q_index[h, qi, : self.q_partial[h, qi]] == kj)[0])
        return _unpack(self.masks[self.q_mask_id[h, qi, k]], bs)

    def dense_mask(self) -> np.ndarray:
        """bool[H, N_q, N_k] expanded from the tiles (for tests and references; O(N^2));
        bool[rows, H, N_q, N_k] for a per-row layout."""
        h_n, nb, bs = self.table_heads, self.num_blocks, self.block_size
        nbk = self.num_kv_blocks
        out = np.zeros((h_n, nb * bs, nbk * bs), bool)
        view = out.reshape(h_n, nb, bs, nbk, bs)
        full = self.block_mask == FULL
        view[:] = full[:, :, None, :, None]
        hh, ii = np.nonzero(self.q_partial > 0)
        for h, i in zip(hh, ii, strict=True):
            for k in range(self.q_partial[h, i]):
                view[h, i, :, self.q_index[h, i, k], :] = _unpack(
                    self.masks[self.q_mask_id[h, i, k]], bs)
        out = out[:, :self.seq_len, :self.kv_len]
        return out.copy() if self.batch is None else out.reshape(self.batch, self.num_heads,
                                                                 *out.shape[1:]).copy()

    def heads(self, start: int, stop: int) -> BlockLayout:
        """The layout of heads ``[start, stop)`` (what one tensor-parallel rank holds).

        Equal to building the layout for those heads alone, except that list widths and the
        mask table stay those of the whole layout (so every rank launches the same shapes).
        A per-row layout keeps heads ``[start, stop)`` of every row.
        """
        if not (0 <= start < stop <= self.num_heads):
            raise ValueError(
                f"heads(start, stop) needs 0 <= start < stop <= num_heads={self.num_heads}, got "
                f"({start}, {stop})")
        rows = self.batch or 1

        def sl(a):  # heads [start, stop) of each row of a [rows * H, ...] table
            a = a.reshape(rows, self.num_heads, *a.shape[1:])[:, start:stop]
            return a.reshape(rows * (stop - start), *a.shape[2:])

        return dataclasses.replace(
            self,
            pattern=_HeadSlice(self.pattern, start) if self.pattern is not None else None,
            num_heads=stop - start,
            source=self.source if self.source is not None else self,
            head_offset=self.head_offset + start,
            **{name: sl(getattr(self, name)) for name in (
                "block_mask", "q_count", "q_partial", "q_index", "q_mask_id", "k_count",
                "k_partial", "k_index", "k_mask_id", "q_order", "k_order", "q_halves")})

    def __repr__(self):
        kv = "" if self.kv_len == self.seq_len else f"kv_len={self.kv_len}, "
        kv += "" if self.batch is None else f"batch={self.batch}, "
        return (f"BlockLayout(pattern={self.pattern!r}, seq_len={self.seq_len}, {kv}"
                f"num_heads={self.num_heads}, block_size={self.block_size}, "
                f"density={self.density:.4f}, masks={self.masks.shape[0]})")


def check_tables(layout) -> None:
    """ValueError unless ``layout``'s tables have the shapes its geometry gives.

    ``layout`` is a :class:`BlockLayout` or anything with ``seq_len``, ``kv_len``,
    ``num_heads``, ``block_size`` and ``metadata()`` (the JAX frontend's ``LayoutArrays``), and
    optionally ``batch`` (a per-batch-row layout's tables hold ``batch * num_heads`` heads):
    the query-major tables must be ``[num_heads, ceil(seq_len / block_size), ...]``, the
    key-major ones ``[num_heads, ceil(kv_len / block_size), ...]`` and the mask table
    ``[U, block_size, words]``. The frontends call it on every layout they are given, so a
    layout edited after :func:`make_layout` (another ``seq_len`` or ``block_size`` on old
    tables) is refused by name rather than as a mismatched internal table.
    """
    bs, n, heads = int(layout.block_size), int(layout.seq_len), int(layout.num_heads)
    batch = getattr(layout, "batch", None)
    h = heads * int(batch or 1)  # the tables' heads
    kv = int(getattr(layout, "kv_len", None) or n)
    nbq, nbk = -(-n // bs), -(-kv // bs)
    shapes = {name: tuple(int(x) for x in a.shape) for name, a in layout.metadata().items()}
    block_mask = getattr(layout, "block_mask", None)
    if block_mask is not None:
        shapes["block_mask"] = tuple(int(x) for x in block_mask.shape)
    want = {"q_count": (h, nbq), "q_partial": (h, nbq), "q_order": (h, nbq),
            "q_halves": (h, nbq),
            "k_count": (h, nbk), "k_partial": (h, nbk), "k_order": (h, nbk),
            "block_mask": (h, nbq, nbk)}
    bad = [f"{name} {shapes[name]}" for name, shape in want.items()
           if name in shapes and shapes[name] != shape]
    bad += [f"{name} {shapes[name]}" for name, rows in (
        ("q_index", (h, nbq)), ("q_mask_id", (h, nbq)), ("k_index", (h, nbk)),
        ("k_mask_id", (h, nbk))) if name in shapes and shapes[name][:2] != rows]
    masks = shapes.get("masks")
    if masks is not None and masks[1:] != (bs, _words(bs)):
        bad.append(f"masks {masks}")
    quarters = shapes.get("mask_quarters")
    if quarters is not None and masks is not None and quarters != masks[:1]:
        bad.append(f"mask_quarters {quarters}")
    if bad:
        raise ValueError(
            f"layout is inconsistent: it says seq_len={n}, kv_len={kv}, num_heads={heads}, "
            f"{'' if batch is None else f'batch={batch}, '}"
            f"block_size={bs} ({nbq} query tiles x {nbk} key tiles per head) but its tables "
            f"are for another geometry: {', '.join(bad)}. Build a layout for each sequence "
            "length and block size with make_layout (layout_arrays for JAX); do not edit the "
            "fields of a built one")


def layout_from_handle(handle: str) -> BlockLayout:
    """The live layout whose :attr:`BlockLayout.handle` is ``handle``.

    >>> from sparsetp.core import patterns as P
    >>> lay = make_layout(P.causal(), seq_len=64, num_heads=1, block_size=32)
    >>> layout_from_handle(lay.handle) is lay
    True
    """
    layout = _BY_HANDLE.get(handle)
    if layout is None:
        raise ValueError(f"no live BlockLayout has handle {handle!r}; keep the layout alive "
                         "while a graph that uses it runs")
    return layout


@dataclasses.dataclass(frozen=True, slots=True)
class _HeadSlice(Pattern):
    """The pattern seen by a slice of heads: local head ``h`` is global head ``start + h``."""

    base: Pattern
    start: int

    def _token(self, h, i, j, n):
        return self.base._token(h + self.start, i, j, n)

    def block_kinds(self, h, block_size, n):
        return self.base.block_kinds(h + self.start, block_size, n)

    def _sparse_tiles(self, h, block_size, n):
        return self.base._sparse_tiles(h + self.start, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        return self.base._kinds_at(h + self.start, block_size, n, qi, kj)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return self.base._tile_classes(h + self.start, block_size, n, qi, kj)

    def head_key(self, h):
        return self.base.head_key(h + self.start)

    def _validate(self, seq_len):
        self.base._validate(seq_len)

    @property
    def batch(self):
        return self.base.batch

    def _batch_row(self, r):
        return self if self.batch is None else _HeadSlice(self.base._batch_row(r), self.start)


@dataclasses.dataclass(frozen=True, slots=True)
class _BatchHeads(Pattern):
    """Per-row patterns as one pattern of ``len(row_patterns) * heads`` heads: head
    ``r * heads + h`` is head ``h`` of ``row_patterns[r]`` (what :meth:`BlockLayout.flat`
    runs)."""

    row_patterns: tuple
    heads: int

    def _at(self, h):
        return self.row_patterns[h // self.heads], h % self.heads

    def _token(self, h, i, j, n):
        p, hh = self._at(h)
        return p._token(hh, i, j, n)

    def block_kinds(self, h, block_size, n):
        p, hh = self._at(h)
        return p.block_kinds(hh, block_size, n)

    def _sparse_tiles(self, h, block_size, n):
        p, hh = self._at(h)
        return p._sparse_tiles(hh, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        p, hh = self._at(h)
        return p._kinds_at(hh, block_size, n, qi, kj)

    def _tile_classes(self, h, block_size, n, qi, kj):
        p, hh = self._at(h)
        return p._tile_classes(hh, block_size, n, qi, kj)

    def head_key(self, h):
        # Rows with equal patterns share their heads' masks; the row's value is the key.
        p, hh = self._at(h)
        return (p, p.head_key(hh))

    def _validate(self, seq_len):
        validate_batch_rows(self.row_patterns, seq_len)


def _unpack(words: np.ndarray, bs: int) -> np.ndarray:
    bits = np.unpackbits(words.astype("<i4").view(np.uint8), axis=-1, bitorder="little")
    return bits[:, :bs].astype(bool)


def _pack(tiles: np.ndarray) -> np.ndarray:
    """bool[P, bs, bs] -> int32[P, bs, words] (bit c%32 of word c//32)."""
    p, bs, _ = tiles.shape
    w = _words(bs)
    packed = np.packbits(tiles, axis=-1, bitorder="little")  # uint8[P, bs, bs/8]
    out = np.zeros((p, bs, w * 4), np.uint8)
    out[:, :, : packed.shape[-1]] = packed
    return out.view("<i4").astype(np.int32)


def _check_int(name, value, lo):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Query and key counts of a layout and where they sit in the virtual sequence of
    ``n = max(nq, nk)`` tokens the pattern is evaluated on (module docstring, "Queries != keys"):
    query ``i`` is virtual token ``i + sq``, key ``j`` is ``j + sk``."""

    nq: int
    nk: int

    @property
    def n(self) -> int:
        return max(self.nq, self.nk)

    @property
    def sq(self) -> int:
        return self.n - self.nq

    @property
    def sk(self) -> int:
        return self.n - self.nk


def _virtual_tiles(shift: int, count: int, bs: int):
    """First and last virtual tile (of the square tiling of the virtual sequence) that each of
    the ``ceil(count / bs)`` tiles of a shifted axis touches."""
    lo = shift + np.arange(-(-count // bs), dtype=np.int64) * bs
    hi = np.minimum(lo + bs, shift + count) - 1
    return lo // bs, hi // bs


def block_kinds(pattern: Pattern, h: int, bs: int, seq_len: int,
                kv_len: int | None = None) -> np.ndarray:
    """int8[ceil(seq_len/bs), ceil(kv_len/bs)]: the pattern's *structural* tile kinds (sound,
    maybe not tight) for ``seq_len`` queries and ``kv_len`` keys, aligned as in the module
    docstring. Square layouts use ``pattern.block_kinds``; shifted axes take, per tile, the
    kinds of the (at most 2 x 2) virtual tiles it overlaps: FULL if all are full, EMPTY if all
    are empty, else PARTIAL (sound: a tile is a subset of the virtual tiles it overlaps)."""
    g = _Geometry(seq_len, seq_len if kv_len is None else kv_len)
    kinds = np.asarray(pattern.block_kinds(h, bs, g.n))
    if g.sq == 0 and g.sk == 0:
        return kinds
    r0, r1 = _virtual_tiles(g.sq, g.nq, bs)
    c0, c1 = _virtual_tiles(g.sk, g.nk, bs)
    parts = [kinds[r][:, c] for r in (r0, r1) for c in (c0, c1)]
    full = np.logical_and.reduce([p == FULL for p in parts])
    empty = np.logical_and.reduce([p == EMPTY for p in parts])
    return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)


def _eval_tiles(pattern: Pattern, h: int, bs: int, g: _Geometry, qi: np.ndarray,
                kj: np.ndarray):
    """bool[P, bs, bs] element masks of tiles (qi, kj); tokens past nq / nk are False."""
    r = np.arange(bs, dtype=np.int64)
    out = np.empty((qi.size, bs, bs), bool)
    step = max(1, _CHUNK_ELEMENTS // (bs * bs))
    for s in range(0, qi.size, step):
        i = qi[s:s + step, None, None] * bs + r[None, :, None]
        j = kj[s:s + step, None, None] * bs + r[None, None, :]
        valid = (i < g.nq) & (j < g.nk)
        out[s:s + step] = pattern._token(h, np.minimum(i, g.nq - 1) + g.sq,
                                         np.minimum(j, g.nk - 1) + g.sk, g.n) & valid
    return out


def _head_tiles(pattern: Pattern, h: int, bs: int, g: _Geometry, mask_ids: dict):
    """Exact non-empty tiles of one head: ``(qi, kj, kind, mask_id)`` (mask_id -1 unless
    partial), in row-major tile order. From the pattern's sparse candidates when it lists them
    (``Pattern._sparse_tiles``, square layouts only), else from its dense :func:`block_kinds`."""
    nbq, nbk = -(-g.nq // bs), -(-g.nk // bs)
    square = g.sq == 0 and g.sk == 0
    sparse = pattern._sparse_tiles(h, bs, g.n) if square and _USE_SPARSE_TILES else None
    if sparse is None:
        kinds = np.asarray(block_kinds(pattern, h, bs, g.nq, g.nk), dtype=np.int8)
        if kinds.shape != (nbq, nbk):
            raise AssertionError(f"{pattern!r} returned block kinds of shape {kinds.shape}")
        qi, kj = np.nonzero(kinds != EMPTY)
        kind = kinds[qi, kj]
    else:
        qi, kj, kind = (np.asarray(a) for a in sparse)
        # One int64 key, stable: near-linear on lists that come sorted (lexsort is not).
        order = np.argsort(np.asarray(qi, np.int64) * nbk + kj, kind="stable")
        qi, kj, kind = qi[order], kj[order], kind[order].astype(np.int8)
    qi, kj = qi.astype(np.int64), kj.astype(np.int64)
    mid = np.full(qi.shape, -1, np.int32)
    part = np.nonzero(kind == PARTIAL)[0]
    if part.size:
        kind[part], mid[part] = _classify(pattern, h, bs, g, qi[part], kj[part], mask_ids)
    keep = kind != EMPTY
    return qi[keep], kj[keep], kind[keep], mid[keep]


def _classify(pattern: Pattern, h: int, bs: int, g: _Geometry, qi, kj, mask_ids: dict):
    """Exact kinds and mask ids of "maybe" tiles ``(qi, kj)``."""
    nbq, nbk = -(-g.nq // bs), -(-g.nk // bs)
    # Evaluate one representative tile per class of identical masks; tiles of the ragged last
    # row/column (different valid region) and patterns with no known classes go one by one.
    # Classes are those of the virtual square's tiles, so only for shifts that are whole tiles.
    classes = None
    if g.sq % bs == 0 and g.sk % bs == 0:
        classes = pattern._tile_classes(h, bs, g.n, qi + g.sq // bs, kj + g.sk // bs)
    if classes is None:
        cls = np.arange(qi.size, dtype=np.int64)
    else:
        cls = np.asarray(classes, np.int64)
        ragged = (((qi == nbq - 1) & (g.nq % bs != 0))
                  | ((kj == nbk - 1) & (g.nk % bs != 0)))
        cls = np.where(ragged, cls.max(initial=0) + 1 + np.arange(qi.size), cls)
    _, rep, inverse = np.unique(cls, return_index=True, return_inverse=True)
    tiles = _eval_tiles(pattern, h, bs, g, qi[rep], kj[rep])
    valid_rows = np.minimum(g.nq - qi[rep] * bs, bs)
    valid_cols = np.minimum(g.nk - kj[rep] * bs, bs)
    allowed = tiles.sum(axis=(1, 2))
    n_valid = valid_rows * valid_cols
    # Re-classify exactly: the structure may only have said "maybe".
    rep_kind = np.where(allowed == n_valid, FULL, np.where(allowed == 0, EMPTY, PARTIAL))
    rep_id = np.full(rep.size, -1, np.int32)
    packed = _pack(tiles)
    for t in np.nonzero(rep_kind == PARTIAL)[0]:
        rep_id[t] = mask_ids.setdefault(packed[t].tobytes(), len(mask_ids))
    return rep_kind[inverse].astype(np.int8), rep_id[inverse]


def _ell(rows, cols, kind, mid, nb: int, half=None):
    """Row lists of one head from its non-empty tiles: partial tiles first (those whose mask
    is a half mask, ``half[mask_id]``, first among them), then full tiles, each ascending; and
    per row the count of those half entries (zeros without ``half``)."""
    span = int(cols.max(initial=0)) + 1  # one stable int64 key: lexsort is several x slower
    group = np.where(kind == FULL, 2, 1)
    if half is not None:
        group[(kind == PARTIAL) & half[np.maximum(mid, 0)]] = 0
    order = np.argsort((rows * 3 + group) * span + cols, kind="stable")
    rows, cols, kind, mid, group = rows[order], cols[order], kind[order], mid[order], group[order]
    count = np.bincount(rows, minlength=nb).astype(np.int32)
    n_part = np.bincount(rows[kind == PARTIAL], minlength=nb).astype(np.int32)
    n_half = np.bincount(rows[group == 0], minlength=nb).astype(np.int32)
    width = max(1, int(count.max(initial=0)))
    index = np.zeros((nb, width), np.int32)
    mask_id = np.full((nb, width), -1, np.int32)
    start = np.cumsum(count, dtype=np.int64) - count
    pos = np.arange(rows.size) - start[rows]
    index[rows, pos] = cols
    mask_id[rows, pos] = mid
    return count, n_part, index, mask_id, n_half


# ELL widths are rounded up to a multiple of this. Triton specialises every integer kernel
# argument on "divisible by 16" (and on "== 1"), and the list strides are multiples of the width:
# with the exact width, patterns whose longest rows differ would compile different kernels
# (benchmarks/KERNEL_NOTES.md, "v1.1"). Padded, every pattern with the same (heads, tiles)
# presents the same specialisation. Padding entries are never read.
_ELL_ALIGN = 16


def _stack_padded(arrays, fill):
    width = max(a.shape[-1] for a in arrays)
    width = -(-width // _ELL_ALIGN) * _ELL_ALIGN
    # Each element written once: a row of global tokens lists every tile, so these tables can
    # be heads x nb x nb int32 (16 x 2048 x 2048 at N = 131072, block 64), and filling them
    # before copying would write them twice.
    out = np.empty((len(arrays), arrays[0].shape[0], width), np.int32)
    for h, a in enumerate(arrays):
        out[h, :, : a.shape[-1]] = a
        out[h, :, a.shape[-1]:] = fill
    return out


def make_layout(pattern: Pattern, seq_len: int, num_heads: int,
                block_size: int = 64, *, kv_len: int | None = None) -> BlockLayout:
    """Build the :class:`BlockLayout` of ``pattern`` for ``seq_len`` tokens and ``num_heads``.

    ``num_heads`` counts *query* heads (GQA: the kv heads are the kernels' business, see the
    module docstring). ``kv_len``: number of keys when it differs from the number of queries
    ``seq_len``; the pattern's diagonal is aligned to the end of the keys (module docstring).
    A per-row pattern (``pattern.batch = B``) gives a per-row layout of ``B`` rows of
    ``num_heads`` heads (module docstring, "Per-batch-row layouts").

    Cost is O(H' * nb^2) for the tile classification (``H'`` distinct head masks, ``nb`` tiles
    per side) plus O(bs^2) per class of partial tiles; no N x N array is ever built. A pattern
    that lists its candidate tiles sparsely (``Pattern._sparse_tiles``: neighbourhoods, narrow
    bands and few global tokens, unions of such and intersections with one) skips the nb^2
    classification: only ``block_mask`` itself is nb^2 (a memset and a scatter). Both ways
    give the same layout, bit for bit.

    >>> from sparsetp.core import patterns as P
    >>> make_layout(P.local(64, 0), seq_len=200, num_heads=1, block_size=64).q_count.tolist()
    [[1, 2, 2, 2]]
    >>> lay = make_layout(P.causal(), seq_len=64, num_heads=1, block_size=64, kv_len=192)
    >>> lay.block_mask.tolist()     # 64 queries at the end of 192 keys: 128 + i sees keys <= 128+i
    [[[2, 2, 1]]]
    """
    if not isinstance(pattern, Pattern):
        raise ValueError(f"pattern must be a sparsetp Pattern, got {type(pattern).__name__}")
    seq_len = _check_int("seq_len", seq_len, 1)
    kv_len = seq_len if kv_len is None else _check_int("kv_len", kv_len, 1)
    num_heads = _check_int("num_heads", num_heads, 1)
    # Type first: 64.0 == 64 would pass the membership test and fail later with a TypeError.
    if (isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer))
            or block_size not in SUPPORTED_BLOCK_SIZES):
        raise ValueError(
            f"block_size must be an int, one of {SUPPORTED_BLOCK_SIZES}, got {block_size!r}")
    block_size = int(block_size)
    geom = _Geometry(seq_len, kv_len)
    rows = pattern.batch
    # A per-row pattern is laid out as one pattern of rows * num_heads heads (row-major).
    flat = pattern if rows is None else _BatchHeads(
        tuple(pattern._batch_row(r) for r in range(rows)), num_heads)
    flat._validate(geom.n)
    mask_ids: dict[bytes, int] = {}
    by_key: dict = {}
    per_head = []
    nbq, nbk = -(-seq_len // block_size), -(-kv_len // block_size)
    for h in range(num_heads * (rows or 1)):
        key = flat.head_key(h)
        if key not in by_key:
            qi, kj, kind, mid = _head_tiles(flat, h, block_size, geom, mask_ids)
            kinds = np.zeros((nbq, nbk), np.int8)
            kinds[qi, kj] = kind
            by_key[key] = (kinds, (qi, kj, kind, mid))
        per_head.append(key)
    w = _words(block_size)
    if mask_ids:
        masks = np.frombuffer(b"".join(mask_ids), dtype="<i4").astype(np.int32)
        masks = masks.reshape(len(mask_ids), block_size, w)
    else:  # a valid pointer for kernels that never read it
        masks = np.zeros((1, block_size, w), np.int32)
    quarters = mask_quarters(masks)
    half = half_masks(quarters)  # the lists need every head's masks: built after them all
    for key, (kinds, (qi, kj, kind, mid)) in by_key.items():
        by_key[key] = (kinds, None, _ell(qi, kj, kind, mid, nbq, half),
                       _ell(kj, qi, kind, mid, nbk))
    per_head = [by_key[key] for key in per_head]
    return BlockLayout(
        pattern=pattern, seq_len=seq_len, kv_len=kv_len, num_heads=num_heads, batch=rows,
        block_size=block_size,
        block_mask=np.stack([p[0] for p in per_head]),
        q_count=np.stack([p[2][0] for p in per_head]),
        q_partial=np.stack([p[2][1] for p in per_head]),
        q_index=_stack_padded([p[2][2] for p in per_head], 0),
        q_mask_id=_stack_padded([p[2][3] for p in per_head], -1),
        k_count=np.stack([p[3][0] for p in per_head]),
        k_partial=np.stack([p[3][1] for p in per_head]),
        k_index=_stack_padded([p[3][2] for p in per_head], 0),
        k_mask_id=_stack_padded([p[3][3] for p in per_head], -1),
        masks=masks,
        mask_quarters=quarters,
        q_halves=np.stack([p[2][4] for p in per_head]),
    )
