"""The pattern vocabulary: which query token may attend to which key token.

A pattern is an immutable value. For head ``h``, query token ``i`` and key token ``j``
(0-based, self-attention, sequence length ``n``) it decides whether ``i`` may attend to ``j``.
Patterns compose with ``|`` (union) and ``&`` (intersection) and :func:`per_head`.

Every pattern answers two questions, both vectorised with numpy and never over an N x N grid:

* ``token_mask(h, i, j, n)``: the token-level truth for broadcastable index arrays ``i``, ``j``.
* ``block_kinds(h, block_size, n)``: a *structural* classification of every
  ``block_size x block_size`` tile: 0 surely empty, 2 surely full, 1 "maybe" (partial, or not
  provable from the structure alone). :func:`sparsetp.core.layout.make_layout` evaluates
  ``token_mask`` only inside the "maybe" tiles and re-classifies them exactly, so the
  structure only has to be *sound*, not tight; it is tight for every built-in constructor
  except :func:`neighborhood`, which calls every tile it lists "maybe".
* ``_sparse_tiles(h, block_size, n)`` (optional): the same answer as a sparse list of the tiles
  that may be non-empty, for patterns with 10^6 tiles of which few are ever computed
  (:func:`neighborhood`; global tokens and bounded bands when they cover at most
  ``_SPARSE_MAX_FRACTION`` of the tiles; a union whose every part lists its tiles, an
  intersection of which one part does); the layout then never classifies all ``nb x nb`` tiles.
* ``_kinds_at(h, block_size, n, qi, kj)``: ``block_kinds`` at the tiles ``(qi, kj)`` only
  (broadcastable index arrays), in closed form for every constructor but
  :func:`random_blocks` (its dense kinds, built once) and :func:`neighborhood` (a search in
  its listed tiles); what a union or intersection asks of its parts per listed tile.
  Closed-form patterns compute ``block_kinds`` through it, so the two agree by construction.

Grids: :func:`neighborhood` is NATTEN's neighbourhood attention on a 1-3 D grid flattened
row-major; :func:`grid_tiling` gives the token permutation to a tiled order (compact tiles)
and back, and ``neighborhood(..., tile_shape=...)`` is the same pattern in that order.

Tokens at or past ``n`` never count: a tile is "full" when every *valid* pair in it is allowed.

Example::

    >>> from sparsetp.core import patterns as P
    >>> p = P.strided(16, 64) & P.causal() | P.local(127, 0)
    >>> bool(p.token_mask(0, 130, 64, n=256))
    True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2

__all__ = [
    "Pattern", "dense", "causal", "local", "block_diagonal", "fixed", "strided", "random_blocks",
    "global_tokens", "block_local", "bigbird", "longformer", "neighborhood", "grid_tiling",
    "per_head", "per_batch_row", "documents", "EMPTY", "PARTIAL", "FULL",
]


def _positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    lo = 0 if allow_zero else 1
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return int(value)


def _tile_bounds(block_size: int, n: int):
    """First and last valid token of every tile: (lo[nb], hi[nb]) as int64."""
    nb = -(-n // block_size)
    lo = np.arange(nb, dtype=np.int64) * block_size
    hi = np.minimum(lo + block_size, n) - 1
    return lo, hi


def _band_kinds(dmin, dmax, lo, hi):
    """Kinds of tiles whose difference d = j - i spans every integer of [dmin, dmax]
    when the allowed differences are [lo, hi]."""
    full = (dmin >= lo) & (dmax <= hi)
    empty = (dmax < lo) | (dmin > hi)
    return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)


def _vector_kinds(ok: np.ndarray, block_size: int) -> np.ndarray:
    """Per-tile kind of a predicate of one index only (ok: bool[n])."""
    n = ok.shape[0]
    lo, _ = _tile_bounds(block_size, n)
    allowed = np.add.reduceat(ok.astype(np.int64), lo)
    valid = np.diff(np.append(lo, n))
    return np.where(allowed == valid, FULL, np.where(allowed == 0, EMPTY, PARTIAL)).astype(np.int8)


def _union_kinds(kinds: Sequence[np.ndarray]) -> np.ndarray:
    kinds = np.broadcast_arrays(*kinds)
    full = np.logical_or.reduce([k == FULL for k in kinds])
    empty = np.logical_and.reduce([k == EMPTY for k in kinds])
    return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)


def _intersection_kinds(kinds: Sequence[np.ndarray]) -> np.ndarray:
    kinds = np.broadcast_arrays(*kinds)
    empty = np.logical_or.reduce([k == EMPTY for k in kinds])
    full = np.logical_and.reduce([k == FULL for k in kinds])
    return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


# A pattern other than a neighbourhood lists its tiles (``_sparse_tiles``) only when they are at
# most this fraction of the nb x nb tiles: a listed tile costs several int64 passes and a sort,
# a dense one a few int8 passes, so past about 1/8 the dense classification is the cheaper.
_SPARSE_MAX_FRACTION = 0.125


def _few_tiles(count: int, nb: int) -> bool:
    return count <= _SPARSE_MAX_FRACTION * nb * nb


def _kinds_grid(pattern, h, block_size, n) -> np.ndarray:
    """int8[nb, nb] ``block_kinds`` of a closed-form pattern: its ``_kinds_at`` over every tile
    (broadcast index vectors, so the same numpy expressions as a dense formula)."""
    nb = -(-n // block_size)
    r = np.arange(nb, dtype=np.int64)
    kinds = pattern._kinds_at(h, block_size, n, r[:, None], r[None, :])
    # order="C": a broadcast column (stride 0 on rows) would otherwise come back F-ordered,
    # and every nb x nb pass over it (unions, intersections) strided.
    return np.broadcast_to(kinds, (nb, nb)).astype(np.int8, order="C")


def _relative_classes(block: int, block_size: int, n: int, qi, kj) -> np.ndarray:
    """Classes of a predicate of (i // block, j // block, j - i): determined by i0 % block and
    j0 - i0 (i0, j0 the tiles' first tokens)."""
    i0, j0 = qi * block_size, kj * block_size
    return (i0 % block) * (4 * n + 1) + (j0 - i0 + 2 * n)


def _parts_classes(parts, h, block_size, n, qi, kj) -> np.ndarray | None:
    """Classes of a union/intersection: a part whose tile is empty or full contributes a
    constant (its mask there is known), so only parts that are partial split the classes."""
    classes = []
    for p in parts:
        # The dense kinds where a dense build made them already, else the part's closed form.
        dense = _KINDS_CACHE.get((p, p.head_key(h), block_size, n))
        k = dense[qi, kj] if dense is not None else p._kinds_at(h, block_size, n, qi, kj)
        c = p._tile_classes(h, block_size, n, qi, kj) if (k == PARTIAL).any() else k
        if c is None:
            return None
        # Pair (kind, class): a class id may take any value, so no sentinel could be safe.
        classes += [k.astype(np.int64), np.where(k == PARTIAL, c, 0)]
    return _combine_classes(classes)


def _combine_classes(classes) -> np.ndarray | None:
    out = np.zeros(classes[0].shape, np.int64)
    for c in classes:
        _, inv = np.unique(c, return_inverse=True)
        out = out * (int(inv.max(initial=0)) + 1) + inv.reshape(c.shape)
        _, out = np.unique(out, return_inverse=True)  # keep ids small: no int64 overflow
        out = out.reshape(c.shape)
    return out


_KINDS_CACHE: dict = {}


def _cached(cache: dict, key, limit: int, make):
    """``cache[key]``, made by ``make()`` (an array or a tuple of arrays, stored read-only) on a
    miss; a cache holding ``limit`` entries is emptied first, so it stays bounded."""
    out = cache.get(key)
    if out is None:
        if len(cache) >= limit:
            cache.clear()
        out = make()
        for a in out if isinstance(out, tuple) else (out,):
            a.setflags(write=False)
        cache[key] = out
    return out


def _part(pattern, h, block_size, n):
    """Tile kinds of a part, computed once for every head with the same ``head_key`` (a union
    over 16 heads with one random part builds its window and global parts once)."""
    return _cached(_KINDS_CACHE, (pattern, pattern.head_key(h), block_size, n), 32,
                   lambda: np.broadcast_to(pattern.block_kinds(h, block_size, n),
                                           (-(-n // block_size),) * 2))


class Pattern:
    """Base class of all patterns (frozen, slotted dataclasses; equal values hash equal)."""

    __slots__ = ()

    def token_mask(self, h: int, i, j, n: int) -> np.ndarray:
        """Whether query ``i`` may attend to key ``j`` in head ``h`` of a length-``n`` sequence.

        ``i`` and ``j`` are broadcastable integer arrays (or ints) with ``0 <= i, j < n``.
        """
        return self._token(int(h), np.asarray(i, np.int64), np.asarray(j, np.int64), int(n))

    def _token(self, h: int, i: np.ndarray, j: np.ndarray, n: int) -> np.ndarray:
        raise NotImplementedError

    def block_kinds(self, h: int, block_size: int, n: int) -> np.ndarray:
        """int8[nb, nb]: EMPTY / FULL where provable from the structure, PARTIAL otherwise."""
        nb = -(-n // block_size)
        return np.full((nb, nb), PARTIAL, np.int8)

    def _sparse_tiles(self, h: int, block_size: int, n: int):
        """``(qi, kj, kinds)``: the tiles that may be non-empty, listed sparsely (int64, int64,
        int8 arrays; each tile once, in row-major order; kinds PARTIAL or FULL, exactly those
        of :meth:`block_kinds`, so a layout is the same bit for bit either way and compositions
        can merge lists), every other tile EMPTY; or ``None`` to use :meth:`block_kinds`. For
        patterns whose dense ``nb x nb`` kinds would dominate the build (neighbourhoods at 10^5
        tokens have 10^6 tiles and a few 10^4 candidates);
        :func:`~sparsetp.core.layout.make_layout` then never builds a per-tile-pair array
        except ``block_mask`` itself."""
        return None

    def _kinds_at(self, h: int, block_size: int, n: int, qi, kj) -> np.ndarray:
        """int8: ``block_kinds(h, block_size, n)[qi, kj]`` for broadcastable int64 tile index
        arrays, without the ``nb x nb`` array where the pattern has a closed form (this
        default builds it once per head key and indexes it)."""
        return _part(self, h, block_size, n)[qi, kj]

    def _tile_classes(self, h: int, block_size: int, n: int, qi, kj) -> np.ndarray | None:
        """int64[P] ids of the tiles ``(qi[p], kj[p])`` such that two *interior* tiles (not in
        the ragged last row or column) with equal ids have identical element masks; ``None`` if
        no such structure is known. Lets the layout evaluate one tile per class instead of every
        partial tile (causal: one diagonal tile instead of nb)."""
        return None

    def head_key(self, h: int) -> Hashable:
        """Heads with equal keys have identical masks (lets layouts build each mask once)."""
        return None

    def _validate(self, seq_len: int) -> None:
        """Raise ValueError if the pattern cannot be applied to ``seq_len`` tokens."""

    @property
    def batch(self) -> int | None:
        """Batch rows of a per-row pattern (:func:`per_batch_row`, nested :func:`documents`);
        None for a pattern every batch row shares."""
        return None

    def _batch_row(self, r: int) -> Pattern:
        """The pattern of batch row ``r`` (itself unless per-row)."""
        return self

    def __or__(self, other: Pattern) -> Pattern:
        return _combine(_Union, self, other)

    def __and__(self, other: Pattern) -> Pattern:
        return _combine(_Intersection, self, other)

    def __bool__(self):
        raise TypeError(
            "the truth value of a Pattern is ambiguous: use `a | b` for union and `a & b` for "
            "intersection, not `or`/`and`")


def _combine(cls, a, b):
    if not isinstance(a, Pattern) or not isinstance(b, Pattern):
        return NotImplemented
    parts = []
    for p in (a, b):
        parts.extend(p.parts if type(p) is cls else (p,))  # not isinstance: & subclasses |
    _common_rows(parts, "patterns combined with | or &")
    return cls(tuple(parts))


def _common_rows(parts, what: str) -> int | None:
    """The batch rows of ``parts`` (None when none is per-row); ValueError if they differ."""
    rows = {p.batch for p in parts} - {None}
    if len(rows) > 1:
        raise ValueError(f"{what} must be per-row for one number of batch rows, got "
                         f"{sorted(rows)} rows")
    return rows.pop() if rows else None


_frozen = functools.partial(dataclasses.dataclass, frozen=True, slots=True)


@_frozen
class Dense(Pattern):
    def _token(self, h, i, j, n):
        return np.ones(np.broadcast_shapes(i.shape, j.shape), bool)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        nb = -(-n // block_size)
        return np.full((nb, nb), FULL, np.int8)

    def _kinds_at(self, h, block_size, n, qi, kj):
        return np.full(np.broadcast_shapes(np.shape(qi), np.shape(kj)), FULL, np.int8)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return np.zeros(qi.shape, np.int64)


@_frozen
class Local(Pattern):
    """``i - left <= j <= i + right``; ``left``/``right`` may be ``None`` for unbounded."""

    left: int | None
    right: int | None

    def __post_init__(self):
        if self.left is not None:
            _positive_int("left", self.left, allow_zero=True)
        if self.right is not None:
            _positive_int("right", self.right, allow_zero=True)

    def _bounds(self):
        big = np.iinfo(np.int64).max // 4
        lo = -big if self.left is None else -self.left
        hi = big if self.right is None else self.right
        return lo, hi

    def _token(self, h, i, j, n):
        lo, hi = self._bounds()
        d = j - i
        return (d >= lo) & (d <= hi)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _kinds_grid(self, h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        lo_t, hi_t = _tile_bounds(block_size, n)
        return _band_kinds(lo_t[kj] - hi_t[qi], hi_t[kj] - lo_t[qi], *self._bounds())

    def _sparse_tiles(self, h, block_size, n):
        """The band's tiles row by row: per query tile, the key tiles from the first whose last
        token reaches ``i - left`` to the last whose first token is within ``i + right``."""
        lo, hi = self._bounds()
        lo_t, hi_t = _tile_bounds(block_size, n)
        first = np.searchsorted(hi_t, lo_t + lo, side="left")
        width = np.maximum(np.searchsorted(lo_t, hi_t + hi, side="right") - first, 0)
        if not _few_tiles(int(width.sum()), lo_t.size):
            return None
        qi = np.repeat(np.arange(lo_t.size, dtype=np.int64), width)
        kj = np.repeat(first, width) + _ranges(width)
        return qi, kj, self._kinds_at(h, block_size, n, qi, kj)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return kj - qi


@_frozen
class Causal(Local):
    """``j <= i``."""

    left: int | None = None
    right: int | None = 0


@_frozen
class BlockDiagonal(Pattern):
    size: int

    def __post_init__(self):
        _positive_int("size", self.size)

    def _token(self, h, i, j, n):
        return (i // self.size) == (j // self.size)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _kinds_grid(self, h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        lo, hi = _tile_bounds(block_size, n)
        g_lo, g_hi = lo // self.size, hi // self.size
        # Group ranges of rows and columns are contiguous integer ranges: the tile is full when
        # both collapse to one equal group, empty when they do not meet.
        full = (g_lo[qi] == g_hi[qi]) & (g_lo[kj] == g_hi[kj]) & (g_lo[qi] == g_lo[kj])
        empty = (g_hi[qi] < g_lo[kj]) | (g_lo[qi] > g_hi[kj])
        return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return _relative_classes(self.size, block_size, n, qi, kj)


@_frozen
class Documents(Pattern):
    """Packed documents: ``doc(i) == doc(j)``, documents of ``lengths`` tokens end to end."""

    lengths: tuple

    def __post_init__(self):
        if isinstance(self.lengths, (str, bytes)) or not hasattr(self.lengths, "__len__"):
            raise ValueError(f"lengths must be a sequence of ints, got {self.lengths!r}")
        if len(self.lengths) == 0:
            raise ValueError("lengths must hold at least one document length")
        for k, length in enumerate(self.lengths):
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
                raise ValueError(f"lengths[{k}] must be an int, got {length!r}")
            if length < 1:
                raise ValueError(f"lengths[{k}] must be >= 1 (a document of no token), got "
                                 f"{length}")
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))

    def _validate(self, seq_len):
        total = sum(self.lengths)
        if total != seq_len:
            raise ValueError(f"document lengths sum to {total} but the sequence has {seq_len} "
                             f"tokens: lengths must sum to the (key) sequence length")

    def _ends(self) -> np.ndarray:
        return np.cumsum(np.asarray(self.lengths, np.int64))

    def _doc(self, x) -> np.ndarray:
        """Document index of tokens ``x`` (O(log D) per token)."""
        return np.searchsorted(self._ends(), x, side="right")

    def _token(self, h, i, j, n):
        return self._doc(i) == self._doc(j)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _kinds_grid(self, h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        # Closed form, as for block_diagonal with irregular groups: the documents a tile row or
        # column spans are the contiguous range doc(lo) .. doc(hi).
        lo, hi = _tile_bounds(block_size, n)
        g_lo, g_hi = self._doc(lo), self._doc(hi)
        one = g_lo == g_hi
        full = one[qi] & one[kj] & (g_lo[qi] == g_lo[kj])
        empty = (g_hi[qi] < g_lo[kj]) | (g_lo[qi] > g_hi[kj])
        return np.where(full, FULL, np.where(empty, EMPTY, PARTIAL)).astype(np.int8)

    def _tile_classes(self, h, block_size, n, qi, kj):
        # A partial tile whose rows lie in one document d has the mask "columns in d", the same
        # for every such row tile: class (key tile, d). Likewise (query tile, d) for columns in
        # one document. Tiles with boundaries on both axes are classes of their own.
        lo, hi = _tile_bounds(block_size, n)
        d_lo, d_hi = self._doc(lo), self._doc(hi)
        row_one = d_lo[qi] == d_hi[qi]
        col_one = d_lo[kj] == d_hi[kj]
        kind = np.where(row_one, 0, np.where(col_one, 1, 2))
        a = np.where(row_one, kj, qi)
        b = np.where(row_one, d_lo[qi], np.where(col_one, d_lo[kj], kj))
        return _combine_classes([kind.astype(np.int64), a.astype(np.int64), b.astype(np.int64)])


@_frozen
class _Column(Pattern):
    """A predicate on the key index alone (used by fixed and strided)."""

    def _col(self, h, j, n):
        raise NotImplementedError

    def _token(self, h, i, j, n):
        return np.broadcast_to(self._col(h, j, n), np.broadcast_shapes(i.shape, j.shape))

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _kinds_grid(self, h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        col = _vector_kinds(self._col(h, np.arange(n, dtype=np.int64), n), block_size)
        return np.broadcast_to(col[kj], np.broadcast_shapes(np.shape(qi), np.shape(kj)))

    def _period(self) -> int | None:
        return None

    def _tile_classes(self, h, block_size, n, qi, kj):
        j0 = kj * block_size
        return j0 % self._period() if self._period() else j0


@_frozen
class Strided(_Column):
    """``(j // block + offset + (h if per_head_offset else 0)) % stride == 0``."""

    stride: int
    block: int
    offset: int = 0
    per_head_offset: bool = False

    def __post_init__(self):
        _positive_int("stride", self.stride)
        _positive_int("block", self.block)
        _positive_int("offset", self.offset, allow_zero=True)

    def _shift(self, h):
        return self.offset + (h if self.per_head_offset else 0)

    def _col(self, h, j, n):
        return (j // self.block + self._shift(h)) % self.stride == 0

    def _period(self):
        return self.block * self.stride

    def head_key(self, h) -> Hashable:
        return self._shift(h) % self.stride if self.per_head_offset else None


@_frozen
class _FixedGlobalColumns(_Column):
    local_size: int
    global_size: int

    def _col(self, h, j, n):
        return j % self.local_size >= self.local_size - self.global_size

    def _period(self):
        return self.local_size


@_frozen
class Fixed(Pattern):
    """``i // L == j // L  or  j % L >= L - G`` (Sparse Transformer "fixed")."""

    local_size: int
    global_size: int

    def __post_init__(self):
        _positive_int("local_size", self.local_size)
        _positive_int("global_size", self.global_size, allow_zero=True)
        if self.global_size > self.local_size:
            raise ValueError(
                f"global_size must be <= local_size, got {self.global_size} > {self.local_size}")

    def _parts(self):
        return (BlockDiagonal(self.local_size),
                _FixedGlobalColumns(self.local_size, self.global_size))

    def _token(self, h, i, j, n):
        a, b = self._parts()
        return a._token(h, i, j, n) | b._token(h, i, j, n)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _kinds_grid(self, h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        return _union_kinds([p._kinds_at(h, block_size, n, qi, kj) for p in self._parts()])

    def _tile_classes(self, h, block_size, n, qi, kj):
        return _parts_classes(self._parts(), h, block_size, n, qi, kj)


@_frozen
class GlobalTokens(Pattern):
    """``i < n_global or j < n_global``."""

    n_global: int

    def __post_init__(self):
        _positive_int("n", self.n_global, allow_zero=True)

    def _token(self, h, i, j, n):
        return (i < self.n_global) | (j < self.n_global)

    def _axis_kinds(self, block_size, n) -> np.ndarray:
        return _vector_kinds(np.arange(n) < self.n_global, block_size)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _kinds_grid(self, h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        k = self._axis_kinds(block_size, n)
        return _union_kinds([k[qi], k[kj]])

    def _sparse_tiles(self, h, block_size, n):
        """The ``t`` tile rows holding a global token (every key tile), then the ``t`` tile
        columns of every other row: ``t * (2 * nb - t)`` tiles, in row-major order."""
        k = self._axis_kinds(block_size, n)
        nb = k.size
        t = int(np.count_nonzero(k != EMPTY))  # the first t tiles (tokens 0 .. n_global - 1)
        if not _few_tiles(t * (2 * nb - t), nb):
            return None
        r = np.arange(nb, dtype=np.int64)
        qi = np.concatenate([np.repeat(r[:t], nb), np.repeat(r[t:], t)])
        kj = np.concatenate([np.tile(r, t), np.tile(r[:t], nb - t)])
        return qi, kj, np.maximum(k[qi], k[kj])  # union of the row and column kinds

    def _tile_classes(self, h, block_size, n, qi, kj):
        i0, j0 = qi * block_size, kj * block_size
        # Tiles wholly past the global tokens on an axis look alike along that axis.
        return np.where(i0 < self.n_global, i0, -1) * (2 * n + 1) + np.where(
            j0 < self.n_global, j0, -1)


@functools.lru_cache(maxsize=64)
def _random_chosen(per_row: int, block: int, seed: int, h: int, n: int) -> np.ndarray:
    """int64[nb, per_row]: the key blocks each query block of head h attends to (distinct per
    row, in draw order). O(nb * per_row) memory: never the nb x nb table, which is N x N when
    ``block == 1``.

    Documented draw (Floyd's sampling without replacement, vectorised over query blocks):
    ``rng = numpy.random.default_rng((seed, h))``; for step ``s = 0 .. per_row-1`` with
    ``j = nb - per_row + s``: ``t = rng.integers(0, j + 1, size=nb)`` (one draw per query block);
    each query block adds ``t`` to its set unless it already holds ``t``, in which case it adds
    ``j``. ``per_row`` calls of the generator per head, whatever ``nb``, keep layout building fast
    and the choice identical in every framework.
    """
    nblk = -(-n // block)
    rng = np.random.default_rng((seed, h))
    chosen = np.empty((nblk, per_row), np.int64)
    for s, j in enumerate(range(nblk - per_row, nblk)):
        t = rng.integers(0, j + 1, size=nblk)
        dup = (chosen[:, :s] == t[:, None]).any(axis=1)
        chosen[:, s] = np.where(dup, j, t)
    chosen.setflags(write=False)
    return chosen


def _cell_tiles(block: int, block_size: int, n: int):
    """Per pattern cell (``block`` tokens, the last one clipped at n): the first tile it touches
    and how many tiles it touches (int64[nb_cells] each)."""
    first = np.arange(-(-n // block), dtype=np.int64) * block
    last = np.minimum(first + block, n) - 1
    t0 = first // block_size
    return t0, last // block_size - t0 + 1


def _chosen_kinds(chosen: np.ndarray, block: int, block_size: int, n: int) -> np.ndarray:
    """Exact tile kinds of a pattern that allows the cells ``(r, chosen[r, k])`` of a grid of
    ``block x block`` cells: never builds the cell grid, only lists the chosen cells.

    A tile is FULL when every cell it touches (its valid tokens only) is chosen, EMPTY when none
    is. Cells are distinct per row, so counting the chosen cells a tile touches decides both.
    """
    lo, hi = _tile_bounds(block_size, n)
    nb = lo.shape[0]
    if block % block_size == 0:  # every tile lies inside one cell: look the cells up
        per = block // block_size
        kinds = np.zeros((nb, nb), np.int8)
        cols = chosen[lo // block][:, :, None] * per + np.arange(per)  # [nb, per_row, per]
        rows = np.broadcast_to(np.arange(nb)[:, None, None], cols.shape)
        keep = cols < nb
        kinds[rows[keep], cols[keep]] = FULL
        return kinds
    # Tiles touched by each chosen cell: a t_q x t_k rectangle starting at (q0, k0); when
    # block_size % block == 0 it is one tile (t_q = t_k = 1), a plain count per tile id.
    t0, span = _cell_tiles(block, block_size, n)
    rows = np.broadcast_to(np.arange(chosen.shape[0])[:, None], chosen.shape).ravel()
    cols = chosen.ravel()
    q0, k0 = t0[rows], t0[cols]
    ids = []
    for a in range(int(span.max())):
        for b in range(int(span.max())):
            sel = (a < span[rows]) & (b < span[cols])
            ids.append((q0[sel] + a) * nb + (k0[sel] + b))
    tile, count = np.unique(np.concatenate(ids), return_counts=True)
    qi, kj = np.divmod(tile, nb)
    # Cells a tile touches per axis (the ragged last tile touches fewer).
    cells = hi // block - lo // block + 1
    kinds = np.zeros((nb, nb), np.int8)
    kinds[qi, kj] = np.where(count == cells[qi] * cells[kj], FULL, PARTIAL)
    return kinds


@_frozen
class RandomBlocks(Pattern):
    per_row: int
    block: int
    seed: int

    def __post_init__(self):
        _positive_int("per_row", self.per_row)
        _positive_int("block", self.block)
        _positive_int("seed", self.seed, allow_zero=True)

    def _validate(self, seq_len):
        nblk = -(-seq_len // self.block)
        if self.per_row > nblk:
            raise ValueError(
                f"per_row={self.per_row} is larger than the number of key blocks "
                f"({nblk} blocks of {self.block} tokens for seq_len={seq_len})")

    def chosen(self, h: int, n: int) -> np.ndarray:
        """int64[nb, per_row] (read-only): the key blocks of every query block of head ``h``."""
        self._validate(n)
        return _random_chosen(self.per_row, self.block, self.seed, int(h), int(n))

    def table(self, h: int, n: int) -> np.ndarray:
        """bool[nb, nb]: the dense block table of head ``h`` (O(nb^2): for mask_mods and tests;
        layouts never build it)."""
        chosen = self.chosen(h, n)
        table = np.zeros((chosen.shape[0],) * 2, bool)
        np.put_along_axis(table, chosen, True, axis=1)
        return table

    def _token(self, h, i, j, n):
        chosen = self.chosen(h, n)
        ci, cj = chosen[i // self.block], j // self.block
        out = ci[..., 0] == cj
        for k in range(1, self.per_row):
            out |= ci[..., k] == cj
        return out

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _chosen_kinds(self.chosen(h, n), self.block, block_size, n)

    def _tile_classes(self, h, block_size, n, qi, kj):
        # A tile covering c x c whole cells is classed by the bits of those cells (bit a*c + b:
        # query cell qi*c + a, key cell kj*c + b, clipped to the last cell).
        c = block_size // self.block
        if block_size % self.block or c * c > 62:
            return None
        chosen = self.chosen(h, n)
        last = chosen.shape[0] - 1
        a = np.arange(c)
        rows = np.minimum(qi[:, None] * c + a[None, :], last)  # [P, c]
        cols = np.minimum(kj[:, None] * c + a[None, :], last)  # [P, c]
        hit = (chosen[rows][:, :, None, :] == cols[:, None, :, None]).any(-1)  # [P, c, c]
        bits = hit.reshape(qi.size, c * c).astype(np.int64)
        return bits @ (np.int64(1) << np.arange(c * c, dtype=np.int64))

    def head_key(self, h) -> Hashable:
        return h


@_frozen
class BlockLocal(Pattern):
    """``i // block - left_blocks <= j // block <= i // block + right_blocks``."""

    block: int
    left_blocks: int
    right_blocks: int

    def __post_init__(self):
        _positive_int("block", self.block)
        _positive_int("left_blocks", self.left_blocks, allow_zero=True)
        _positive_int("right_blocks", self.right_blocks, allow_zero=True)

    def _token(self, h, i, j, n):
        d = j // self.block - i // self.block
        return (d >= -self.left_blocks) & (d <= self.right_blocks)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _kinds_grid(self, h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        lo, hi = _tile_bounds(block_size, n)
        r0, r1 = lo // self.block, hi // self.block
        return _band_kinds(r0[kj] - r1[qi], r1[kj] - r0[qi], -self.left_blocks,
                           self.right_blocks)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return _relative_classes(self.block, block_size, n, qi, kj)


class _OfMembers(Pattern):
    """``batch`` / ``_batch_row`` of a pattern built from a tuple of patterns (its field
    ``_MEMBERS``): per-row when a member is, and rebuilt from the members' rows."""

    __slots__ = ()
    _MEMBERS = ""  # the field holding the members
    _WHAT = ""  # how errors name them

    @property
    def batch(self):
        return _common_rows(getattr(self, self._MEMBERS), self._WHAT)

    def _batch_row(self, r):
        if self.batch is None:
            return self
        return type(self)(tuple(p._batch_row(r) for p in getattr(self, self._MEMBERS)))


@_frozen
class _Union(_OfMembers):
    _MEMBERS, _WHAT = "parts", "patterns combined with | or &"
    parts: tuple

    def _token(self, h, i, j, n):
        return np.logical_or.reduce([p._token(h, i, j, n) for p in self.parts])

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _union_kinds([_part(p, h, block_size, n) for p in self.parts])

    def _kinds_at(self, h, block_size, n, qi, kj):
        return _union_kinds([p._kinds_at(h, block_size, n, qi, kj) for p in self.parts])

    def _sparse_tiles(self, h, block_size, n):
        """Every part's listed tiles, merged: a union's kind is the largest of its parts' kinds
        (EMPTY < PARTIAL < FULL, :func:`_union_kinds`), and a tile no part lists is EMPTY in
        all of them. ``None`` unless every part lists its tiles (each decided that listing is the
        cheaper: merging costs about what the parts spent listing)."""
        nb = -(-n // block_size)
        listed = []
        for p in self.parts:
            tiles = p._sparse_tiles(h, block_size, n)
            if tiles is None:
                return None
            listed.append(tiles)
        pair = np.concatenate([np.asarray(q, np.int64) * nb + k for q, k, _ in listed])
        kind = np.concatenate([np.asarray(c, np.int8) for _, _, c in listed])
        # Stable sort of sorted runs (each part lists in row-major order): timsort merges them.
        order = np.argsort(pair, kind="stable")
        pair, kind = pair[order], kind[order]
        start = np.flatnonzero(np.append(True, pair[1:] != pair[:-1]))
        if kind.size:
            pair, kind = pair[start], np.maximum.reduceat(kind, start)
        qi = pair // nb
        return qi, pair - qi * nb, kind

    def _tile_classes(self, h, block_size, n, qi, kj):
        return _parts_classes(self.parts, h, block_size, n, qi, kj)

    def head_key(self, h) -> Hashable:
        return tuple(p.head_key(h) for p in self.parts)

    def _validate(self, seq_len):
        for p in self.parts:
            p._validate(seq_len)


@_frozen
class _Intersection(_Union):
    def _token(self, h, i, j, n):
        return np.logical_and.reduce([p._token(h, i, j, n) for p in self.parts])

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _intersection_kinds([_part(p, h, block_size, n) for p in self.parts])

    def _kinds_at(self, h, block_size, n, qi, kj):
        return _intersection_kinds([p._kinds_at(h, block_size, n, qi, kj) for p in self.parts])

    def _sparse_tiles(self, h, block_size, n):
        """The shortest list of a part that lists its tiles (every tile outside it is EMPTY in
        that part, hence in the intersection), classified against every other part per listed
        tile (:meth:`_kinds_at`: the smallest kind, :func:`_intersection_kinds`); tiles found
        EMPTY are dropped. ``None`` when no part lists its tiles."""
        best = None
        for a, p in enumerate(self.parts):
            tiles = p._sparse_tiles(h, block_size, n)
            if tiles is not None and (best is None or tiles[0].size < best[1][0].size):
                best = a, tiles
        if best is None:
            return None
        a, (qi, kj, kind) = best
        qi, kj = np.asarray(qi, np.int64), np.asarray(kj, np.int64)
        kind = np.asarray(kind, np.int8)
        for b, p in enumerate(self.parts):
            if b != a:
                kind = np.minimum(kind, p._kinds_at(h, block_size, n, qi, kj))
        keep = np.flatnonzero(kind != EMPTY)
        return qi[keep], kj[keep], kind[keep]


@_frozen
class PerHead(_OfMembers):
    """Head ``h`` uses ``patterns[h % len(patterns)]`` (which still sees the true ``h``)."""

    _MEMBERS, _WHAT = "patterns", "per_head patterns"
    patterns: tuple

    def __post_init__(self):
        if len(self.patterns) == 0:
            raise ValueError("patterns must not be empty")
        for p in self.patterns:
            if not isinstance(p, Pattern):
                raise ValueError(f"patterns must hold Pattern values, got {p!r}")
        _ = self.batch  # members for different batch sizes raise here

    def _pick(self, h):
        return self.patterns[h % len(self.patterns)]

    def _token(self, h, i, j, n):
        return self._pick(h)._token(h, i, j, n)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return self._pick(h).block_kinds(h, block_size, n)

    def _sparse_tiles(self, h, block_size, n):
        return self._pick(h)._sparse_tiles(h, block_size, n)

    def _kinds_at(self, h, block_size, n, qi, kj):
        return self._pick(h)._kinds_at(h, block_size, n, qi, kj)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return self._pick(h)._tile_classes(h, block_size, n, qi, kj)

    def head_key(self, h) -> Hashable:
        return (h % len(self.patterns), self._pick(h).head_key(h))

    def _validate(self, seq_len):
        for p in self.patterns:
            p._validate(seq_len)


@_frozen
class PerBatchRow(Pattern):
    """Batch row ``r`` uses ``patterns[r]`` (:func:`per_batch_row`). Only a layout can evaluate it:
    :func:`~sparsetp.core.layout.make_layout` lays out each row's pattern (``_batch_row``)."""

    patterns: tuple

    def __post_init__(self):
        if len(self.patterns) == 0:
            raise ValueError("patterns must hold one pattern per batch row, got none")
        for r, p in enumerate(self.patterns):
            if not isinstance(p, Pattern):
                raise ValueError(f"patterns[{r}] must be a Pattern, got {p!r}")
            if p.batch is not None:
                raise ValueError(f"patterns[{r}] is itself per-row; per_batch_row does not nest")

    @property
    def batch(self):
        return len(self.patterns)

    def _batch_row(self, r):
        return self.patterns[r]

    def _token(self, *args):
        raise ValueError("a per-row pattern has no token mask of its own: lay it out with "
                         "make_layout (one row of heads per batch row), or take ._batch_row(r)")

    block_kinds = _sparse_tiles = _kinds_at = _tile_classes = _token

    def _validate(self, seq_len):
        validate_batch_rows(self.patterns, seq_len)


def validate_batch_rows(patterns, seq_len: int) -> None:
    """Each batch row's pattern validated for ``seq_len``; errors say which row."""
    for r, p in enumerate(patterns):
        try:
            p._validate(seq_len)
        except ValueError as e:
            raise ValueError(f"batch row {r}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Neighborhood attention (NATTEN semantics) over a 1-3 dimensional grid of tokens.


def _per_axis(name: str, value, ndim: int, *, allow_zero: bool = False) -> tuple:
    """An int (or bool for ``causal``) broadcast to every axis, or one per axis."""
    vals = tuple(value) if isinstance(value, (tuple, list)) else (value,) * ndim
    if len(vals) != ndim:
        raise ValueError(f"{name} must be an int or a tuple of {ndim} (one per grid axis), got "
                         f"{value!r}")
    if name == "causal":
        for v in vals:
            if not isinstance(v, (bool, np.bool_, int, np.integer)) or v not in (0, 1):
                raise ValueError(f"causal must be a bool or a tuple of bools, got {value!r}")
        return tuple(bool(v) for v in vals)
    return tuple(_positive_int(name, v, allow_zero=allow_zero) for v in vals)


def _grid_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (in elements) of ``shape``: the last axis is the fastest."""
    return tuple(int(np.prod(shape[a + 1:], dtype=np.int64)) for a in range(len(shape)))


def grid_tiling(grid, tile_shape) -> tuple[np.ndarray, np.ndarray]:
    """Index arrays ``(perm, inv)`` of the token permutation that makes every ``tile_shape``
    sub-grid of ``grid`` contiguous (what NATTEN calls token permutation).

    ``x_tiled = x[..., perm, :]`` puts the tokens in *tiled order*: tiles row-major over the grid
    of tiles, the tokens of a tile row-major inside it; ``x_tiled[..., inv, :]`` undoes it. Apply
    them with your framework's gather (``torch.index_select``, ``jnp.take``). A block-sparse
    layout over the tiled order has compact tiles (a ``4 x 16`` window of a 2-D grid is one
    64-token tile instead of parts of four rows), so a neighbourhood touches fewer, fuller tiles.
    :func:`neighborhood` with the same ``tile_shape`` is the row-major neighbourhood seen in tiled
    order, so ``attend(q[perm], k[perm], v[perm])[inv]`` equals row-major attention token by token.
    Every grid axis must be a multiple of its tile axis.

    >>> perm, inv = grid_tiling((4, 4), (2, 2))
    >>> perm.tolist()
    [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    >>> bool((perm[inv] == np.arange(16)).all())
    True
    """
    grid = _per_axis("grid", grid, len(grid) if isinstance(grid, (tuple, list)) else 1)
    tile = _tile_shape(grid, tile_shape)
    n = int(np.prod(grid))
    perm = _NeighborhoodIndex(grid, tile).rowmajor(np.arange(n, dtype=np.int64))
    inv = np.empty_like(perm)
    inv[perm] = np.arange(n, dtype=np.int64)
    return perm, inv


def _tile_shape(grid: tuple, tile_shape) -> tuple:
    tile = _per_axis("tile_shape", tile_shape, len(grid))
    for a, (length, t) in enumerate(zip(grid, tile, strict=True)):
        if length % t:
            raise ValueError(f"tile_shape[{a}]={t} must divide grid[{a}]={length}")
    return tile


@dataclasses.dataclass(frozen=True)
class _NeighborhoodIndex:
    """Sequence position <-> grid coordinates, row-major or tiled. The tiled order is row-major
    over the ``2 * D`` axes (tile coordinates, then coordinates inside the tile); row-major is
    the tiling with tiles of one token, so one code path serves both."""

    grid: tuple
    tile: tuple

    def coords(self, t: np.ndarray) -> list[np.ndarray]:
        """Grid coordinates (one int64 array per axis) of sequence positions ``t``."""
        d = len(self.grid)
        sizes = [g // s for g, s in zip(self.grid, self.tile, strict=True)] + list(self.tile)
        # Digits from the fastest; an axis of size 1 has digit 0 and costs nothing (row-major
        # has d of them), and the slowest non-trivial digit is the quotient left (t < n).
        digit: list = [0] * (2 * d)
        top = min((a for a in range(2 * d) if sizes[a] > 1), default=-1)
        rem = t
        for a in reversed(range(2 * d)):
            if a == top:
                digit[a] = rem
            elif sizes[a] > 1:
                quot = rem // sizes[a]
                digit[a] = rem - quot * sizes[a]
                rem = quot
        return [digit[a] * self.tile[a] + digit[d + a] if self.tile[a] > 1 else
                np.broadcast_to(digit[a] + digit[d + a], np.shape(t)) for a in range(d)]

    def rowmajor(self, t: np.ndarray) -> np.ndarray:
        """Row-major token index of sequence positions ``t``."""
        strides = _grid_strides(self.grid)
        return sum(c * s for c, s in zip(self.coords(t), strides, strict=True))


def _axis_window(p: np.ndarray, length: int, k: int, d: int, causal: bool):
    """First and last key coordinate of query coordinate(s) ``p`` on one axis (every key between
    them that is congruent to ``p`` mod ``d`` is a neighbour; see :func:`neighborhood`)."""
    r, pg = p % d, p // d
    if causal:
        lo_g, hi_g = np.maximum(pg - k + 1, 0), pg
    else:
        groups = (length - r + d - 1) // d  # L_g: coordinates congruent to p in [0, L)
        lo_g = np.minimum(np.maximum(pg - k // 2, 0), groups - k)
        hi_g = lo_g + k - 1
    return lo_g * d + r, hi_g * d + r


def _axis_ok(p, q, length, k, d, causal) -> np.ndarray:
    lo, hi = _axis_window(p, length, k, d, causal)
    return ((q - p) % d == 0) & (q >= lo) & (q <= hi)


def _axis_interior(length, k, d, causal) -> np.ndarray:
    """bool[L]: query coordinates whose neighbours on this axis depend only on ``q - p`` (the
    window is not clamped at an edge); causal windows never are (keys below 0 do not exist)."""
    p = np.arange(length, dtype=np.int64)
    if causal:
        return np.ones(length, bool)
    groups = (length - p % d + d - 1) // d
    start = p // d - k // 2
    return (start >= 0) & (start <= groups - k)


# _KEEP_BITS[a, b]: the bits (row-major over 4 x 4) of the first a + 1 rows and b + 1 columns.
_KEEP_BITS = ((np.arange(4)[:, None, None, None] >= np.arange(4)[None, None, :, None])
              & (np.arange(4)[None, :, None, None] >= np.arange(4)[None, None, None, :])
              ).reshape(4, 4, 16).astype(np.int64) @ (np.int64(1) << np.arange(16))


def _unique_inverse(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, return_inverse=True)`` of a 1-D int64 array; through a table of the
    key range instead of a sort when the keys are non-negative and the range is small (sorting
    10^5 per-pair keys was most of a neighbourhood's layout build)."""
    top = int(key.max(initial=-1)) + 1
    if key.size and top <= max(1 << 16, 4 * key.size) and key.min() >= 0:
        present = np.zeros(top, bool)
        present[key] = True
        ids = np.cumsum(present, dtype=np.int64) - 1
        return np.flatnonzero(present), ids[key]
    values, inverse = np.unique(key, return_inverse=True)
    return values, inverse.reshape(key.shape)


def _row_ids(rel: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """``np.unique(rows, axis=0, return_inverse=True)``-like ids of the rows of ``rel`` (per-tile
    relative coordinates), in the byte order of the rows as int32; the all-zero row (a tile on
    one coordinate, most tiles on slow axes) is the smallest and is not sorted."""
    rel = np.ascontiguousarray(rel, dtype=np.int32)
    ids = np.zeros(rel.shape[0], np.int64)
    some = np.flatnonzero(spread > 0)
    if some.size and (rel[some] == rel[some[0]]).all():  # one profile (full rows, say)
        ids[some] = int(some.size < rel.shape[0])
    elif some.size:
        _, inv = np.unique(rel[some].view(np.dtype((np.void, 4 * rel.shape[1]))).ravel(),
                           return_inverse=True)
        ids[some] = inv.ravel() + (some.size < rel.shape[0])
    return ids


# Neighbourhoods' listed tiles, per (pattern, block_size, n): layout_build.py clears it
# between timed builds, like _KINDS_CACHE.
_TILES_CACHE: dict = {}


@_frozen
class Neighborhood(Pattern):
    """NATTEN neighbourhood attention over ``grid`` (see :func:`neighborhood`)."""

    grid: tuple
    kernel_size: tuple
    dilation: tuple
    causal: tuple
    tile_shape: tuple | None = None

    def __post_init__(self):
        d = len(self.grid)
        if not 1 <= d <= 3:
            raise ValueError(f"grid must have 1 to 3 axes, got {self.grid!r}")
        for name in ("kernel_size", "dilation", "causal"):
            if len(getattr(self, name)) != d:
                raise ValueError(f"{name} must have one entry per grid axis ({d}), got "
                                 f"{getattr(self, name)!r}")
        for a, (length, k, dil) in enumerate(zip(self.grid, self.kernel_size, self.dilation,
                                                 strict=True)):
            if k * dil > length:
                raise ValueError(
                    f"kernel_size[{a}] * dilation[{a}] = {k} * {dil} = {k * dil} is larger than "
                    f"grid[{a}] = {length}")

    @property
    def seq_len(self) -> int:
        return int(np.prod(self.grid, dtype=np.int64))

    def _index(self) -> _NeighborhoodIndex:
        tile = self.tile_shape or (1,) * (len(self.grid) - 1) + (self.grid[-1],)
        return _NeighborhoodIndex(self.grid, tile)

    def _validate(self, seq_len):
        if seq_len != self.seq_len:
            raise ValueError(f"grid {self.grid} holds {self.seq_len} tokens, but seq_len is "
                             f"{seq_len}")

    def _axes(self):
        return zip(self.grid, self.kernel_size, self.dilation, self.causal, strict=True)

    def _token(self, h, i, j, n):
        idx = self._index()
        ok = None
        for p, q, (length, k, d, c) in zip(idx.coords(i), idx.coords(j), self._axes(),
                                           strict=True):
            axis = _axis_ok(p, q, length, k, d, c)
            ok = axis if ok is None else ok & axis
        return ok

    def _sparse_tiles(self, h, block_size, n):
        """Candidate tiles (every other tile is empty), all PARTIAL: per query tile, the boxes
        of grid coordinates it holds, the union of their windows per axis, and the key tiles
        that box touches. O(candidates), never O(nb^2). Kept for the next call (read-only):
        a union lists them, then classifies its tiles against them (:meth:`_kinds_at`)."""
        return _cached(_TILES_CACHE, (self, int(block_size), int(n)), 4,
                       lambda: self._list_tiles(block_size, n))

    def _kinds_at(self, h, block_size, n, qi, kj):
        qs, ks, kinds = self._sparse_tiles(h, block_size, n)
        nb = -(-n // block_size)
        listed = qs * nb + ks  # ascending (row-major, each tile once)
        pair = np.asarray(qi, np.int64) * nb + np.asarray(kj, np.int64)
        if not listed.size:
            return np.zeros(pair.shape, np.int8)
        at = np.minimum(np.searchsorted(listed, pair), listed.size - 1)
        return np.where(listed[at] == pair, kinds[at], EMPTY).astype(np.int8)

    def _list_tiles(self, block_size, n):
        self._validate(n)
        idx, bs, dims = self._index(), block_size, len(self.grid)
        nb = -(-n // bs)
        unit = int(np.prod(idx.tile))  # tokens of one grid tile: a contiguous sequence range
        # Query groups: the grid tiles each sequence tile touches (a superset box when the
        # sequence tile holds part of one).
        first = np.arange(nb, dtype=np.int64) * bs
        u0, u1 = first // unit, (np.minimum(first + bs, n) - 1) // unit
        per = u1 - u0 + 1
        q_tile = np.repeat(np.arange(nb, dtype=np.int64), per)
        q_unit = np.repeat(u0, per) + _ranges(per)
        base = idx.coords(q_unit * unit)
        if self.tile_shape is None:  # the unit is a row: its tokens of this tile only, exactly
            x0 = np.maximum(q_tile * bs, q_unit * unit) - q_unit * unit
            x1 = np.minimum(np.minimum(q_tile * bs + bs, n), q_unit * unit + unit) - 1 - (
                q_unit * unit)
            boxes = [(c, c) for c in base[:-1]] + [(x0, x1)]
        else:
            boxes = [(c, c + t - 1) for c, t in zip(base, idx.tile, strict=True)]
        # Key box per group and axis: the union of the windows of the box's coordinates. The
        # window ends are non-decreasing in p within one residue class mod d, so the extremes
        # are among the first (last) d coordinates of the box.
        key_lo, key_hi = [], []
        for (c0, c1), (length, k, d, c) in zip(boxes, self._axes(), strict=True):
            lo = hi = None
            for o in range(d):
                p_lo, p_hi = np.minimum(c0 + o, c1), np.maximum(c1 - o, c0)
                lo_o = _axis_window(p_lo, length, k, d, c)[0]
                hi_o = _axis_window(p_hi, length, k, d, c)[1]
                lo = lo_o if lo is None else np.minimum(lo, lo_o)
                hi = hi_o if hi is None else np.maximum(hi, hi_o)
            key_lo.append(lo)
            key_hi.append(hi)
        # Key units the box touches: all but the fastest unit axis enumerate; per unit, the
        # sequence range of the box's keys in it (exact on a row, the whole unit when tiled).
        t_lo = [lo // t for lo, t in zip(key_lo, idx.tile, strict=True)]
        t_hi = [hi // t for hi, t in zip(key_hi, idx.tile, strict=True)]
        span = [b - a + 1 for a, b in zip(t_lo, t_hi, strict=True)]
        count = np.prod(span, axis=0)
        g = np.repeat(np.arange(q_tile.size), count)
        rank = _ranges(count)
        ugrid = [length // t for length, t in zip(self.grid, idx.tile, strict=True)]
        ustrides = _grid_strides(ugrid)
        k_unit = sum(lo * s for lo, s in zip(t_lo, ustrides, strict=True))[g]
        rem = rank
        for a in reversed(range(dims)):
            if ugrid[a] == 1:  # one unit along the axis (row-major's last): digit 0
                continue
            s = span[a][g]
            quot = rem // s  # not np.divmod: several times slower here
            k_unit += (rem - quot * s) * ustrides[a]
            rem = quot
        if self.tile_shape is None:
            lo_tok = k_unit * unit + key_lo[-1][g]
            hi_tok = k_unit * unit + key_hi[-1][g]
        else:
            lo_tok, hi_tok = k_unit * unit, k_unit * unit + unit - 1
        j0, j1 = lo_tok // bs, hi_tok // bs
        width = j1 - j0 + 1
        rows = q_tile[g]
        if (width == 1).all():  # every key unit within one tile (row-major, rows <= block)
            cols = j0
        else:
            rows, cols = np.repeat(rows, width), np.repeat(j0, width) + _ranges(width)
        # Sort and drop repeats (faster than np.unique); rows ascend already and each row's
        # columns come in a few ascending runs, which the stable sort (timsort) exploits.
        pair = np.sort(rows * nb + cols, kind="stable")
        pair = pair[np.append(True, pair[1:] != pair[:-1])]
        qi = pair // nb
        kj = pair - qi * nb
        return qi, kj, np.full(qi.shape, PARTIAL, np.int8)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        nb = -(-n // block_size)
        kinds = np.zeros((nb, nb), np.int8)
        qi, kj, k = self._sparse_tiles(h, block_size, n)
        kinds[qi, kj] = k
        return kinds

    def _tile_classes(self, h, block_size, n, qi, kj):
        """Per axis, the tile's mask is ``M[cq[r], ck[c]]`` over the tiles' coordinates on that
        axis, and the whole mask is the AND over axes; so equal per-axis keys mean equal masks.
        A tile's coordinates are ``f + shape`` (``f`` the smallest, ``shape`` one of few row
        profiles). Key per axis: the two profiles and either the bits of ``M`` over the
        (at most 4 x 4) coordinates both tiles span, or ``f_J - f_I`` when every query
        coordinate is interior (window unclamped: ``M`` depends on ``q - p`` only), or both
        ``f`` (absolute)."""
        idx, bs = self._index(), block_size
        seen = np.zeros(-(-n // bs), bool)
        seen[qi] = seen[kj] = True
        tiles = np.nonzero(seen)[0]
        # int32 tokens and pair indices where they fit: half the memory to fault in (per-tile
        # values go back to int64 below, before any product).
        i32 = np.int32 if n < 2**31 else np.int64
        tok = np.minimum(tiles[:, None] * bs + np.arange(bs, dtype=i32), n - 1).astype(i32)
        where = np.empty(-(-n // bs), i32)
        where[tiles] = np.arange(tiles.size, dtype=i32)
        iq, ik = where[qi], where[kj]
        out = np.zeros(qi.shape, np.int64)
        fine, refined = [], False  # per axis: keys with clamped windows compared by mask
        for coord, (length, k, d, c) in zip(idx.coords(tok), self._axes(), strict=True):
            f = coord.min(axis=1).astype(np.int64)
            spread = coord.max(axis=1) - f
            prof = _row_ids(coord - f[:, None], spread)
            n_prof = int(prof.max(initial=0)) + 1
            inner = np.cumsum(np.append(0, _axis_interior(length, k, d, c)))
            interior = inner[f + spread + 1] - inner[f] == spread + 1
            # What decides a pair's mode and profiles is a small per-tile code on each side:
            # evaluate it once per distinct pair of codes, not once per pair.
            small = spread < 4
            combo, inv = _unique_inverse(((prof * 2 + small) * 2 + interior)[iq] * (2 * n_prof)
                                         + (prof * 2 + small)[ik])
            cq, ck = np.divmod(combo, 2 * n_prof)
            both_small = (cq // 2 % 2 == 1) & (ck % 2 == 1)
            mode = np.where(both_small, 0, np.where(cq % 2 == 1, 1, 2))[inv]
            head = ((np.where(both_small, 0, 2 - cq % 2) * n_prof + cq // 4) * n_prof
                    + ck // 2)
            fq, fk = f[iq], f[ik]
            payload = fq * length + fk
            if (mode == 1).any():
                payload = np.where(mode == 1, fk - fq + length, payload)
            if both_small.any():  # the bits of M over the 4 x 4 coordinates from (fq, fk)
                sel = np.flatnonzero(mode == 0) if not both_small.all() else slice(None)
                uniq, bits_of = _unique_inverse(payload[sel])
                uq, uk = np.divmod(uniq, length)
                r = np.arange(4)
                ok = _axis_ok(np.minimum(uq[:, None, None] + r[:, None], length - 1),
                              np.minimum(uk[:, None, None] + r[None, :], length - 1),
                              length, k, d, c)
                ok &= (uq[:, None, None] + r[:, None] < length) & (
                    uk[:, None, None] + r[None, :] < length)
                bits = ok.reshape(-1, 16).astype(np.int64) @ (np.int64(1) << np.arange(16))
                # Only the coordinates the tiles hold count: the first 1 + spread of each
                # (a profile's spread, at most 3 where it matters).
                top = np.zeros(n_prof, np.int64)
                top[prof] = np.minimum(spread, 3)
                keep = _KEEP_BITS[top[cq // 4], top[ck // 2]]
                payload[sel] = bits[bits_of] & keep[inv[sel]]
            # Rank the payloads first (rank order is value order), so the key stays small.
            payload = _unique_inverse(payload)[1]
            n_pay = int(payload.max(initial=0)) + 1
            key = _unique_inverse(head[inv] * n_pay + payload)[1]
            out = out * (int(key.max(initial=0)) + 1) + key
            window = _window_key(key, mode, coord, spread, prof, iq, ik, fk, length, k, d, c)
            fine.append(key if window is None else window)
            refined |= window is not None
        if not refined:
            return out
        merged = np.zeros(qi.shape, np.int64)
        for key in fine:
            merged = merged * (int(key.max(initial=0)) + 1) + key
        # Several absolute keys with equal masks: one class each, numbered by the smallest
        # absolute class of an interior tile in it (the layout gives tiles of a ragged last
        # row or column classes of their own). Masks are then met (and numbered) in the same
        # order as with the absolute classes: the layout is bit-identical, with fewer tiles
        # evaluated.
        group = _unique_inverse(merged)[1]
        nb = -(-n // bs)
        ragged = ((qi == nb - 1) | (kj == nb - 1)) & (n % bs != 0)
        big = np.iinfo(np.int64).max
        first = np.full(int(group.max(initial=0)) + 1, big)
        np.minimum.at(first, group, np.where(ragged, big, out))
        alone = np.full(first.size, big)  # groups of ragged tiles only: their own smallest
        np.minimum.at(alone, group, out)
        return np.where(first == big, alone, first)[group]


# Refine absolute per-axis keys (clamped windows) only past this many of them on an axis:
# fewer cost less to evaluate than to compare.
_WINDOW_KEYS_MIN = 64


def _window_key(key, mode, coord, spread, prof, iq, ik, fk, length, k, d, c):
    """Per-pair keys of one axis where the absolute ones (mode 2: a clamped window, keyed by
    both tiles' coordinates) become what decides the mask: per query position of the tile,
    its window ends relative to the key tile's first coordinate (clipped to the key tile's
    span) and its residue; plus the key tile's profile (``key`` otherwise). ``None`` when
    there are too few absolute keys to bother."""
    absolute = np.flatnonzero(mode == 2)
    if absolute.size <= _WINDOW_KEYS_MIN:
        return None
    keys, which = _unique_inverse(key[absolute])
    if keys.size <= _WINDOW_KEYS_MIN:
        return None
    rep = np.empty(keys.size, np.int64)
    rep[which] = absolute  # a pair of each key: equal keys, equal tiles' coordinates
    p = coord[iq[rep]].astype(np.int64)  # [U, bs]: query coordinates by position
    lo, hi = _axis_window(p, length, k, d, c)
    base, top = fk[rep][:, None], spread[ik[rep]][:, None] + 1
    rows = np.concatenate([np.clip(lo - base, -1, top), np.clip(hi - base, -1, top),
                           (p - base) % d], axis=1)
    rows = np.ascontiguousarray(np.concatenate([rows, prof[ik[rep]][:, None]], axis=1),
                                np.int32)
    # Rows as raw bytes: equal rows is all that matters (np.unique(axis=0) sorts field by
    # field, ~50 ms for 10^3 rows here).
    _, win = np.unique(rows.view(np.dtype((np.void, 4 * rows.shape[1]))).ravel(),
                       return_inverse=True)
    fine = key.copy()
    # Window classes above every other key of the axis (they only need to differ).
    fine[absolute] = key.max() + 1 + win.ravel()[which]
    return fine


def _ranges(count: np.ndarray) -> np.ndarray:
    """``concatenate([arange(c) for c in count])``, vectorised."""
    count = np.asarray(count, np.int64)
    ends = np.cumsum(count)
    return np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) - np.repeat(
        ends - count, count)


# ---------------------------------------------------------------------------------------------
# Public constructors (pure functions returning frozen values).


def dense() -> Pattern:
    """Every query attends to every key."""
    return Dense()


def causal() -> Pattern:
    """``j <= i``."""
    return Causal()


def local(left: int, right: int) -> Pattern:
    """Sliding window ``i - left <= j <= i + right``; ``local(w, 0)`` is a causal window.

    >>> bool(local(2, 0).token_mask(0, 5, 3, n=8))
    True
    """
    return Local(left, right)


def block_diagonal(size: int) -> Pattern:
    """``i // size == j // size``."""
    return BlockDiagonal(size)


def fixed(local_size: int, global_size: int) -> Pattern:
    """Sparse Transformer / DeepSpeed "fixed": ``i // L == j // L or j % L >= L - G``."""
    return Fixed(local_size, global_size)


def strided(stride: int, block: int, offset: int = 0, per_head_offset: bool = False) -> Pattern:
    """Vertical stride: ``(j // block + offset + (h if per_head_offset else 0)) % stride == 0``.

    >>> p = strided(16, 64) & causal()   # every 16th key block, causally
    """
    return Strided(stride, block, offset, per_head_offset)


def random_blocks(per_row: int, block: int, seed: int) -> Pattern:
    """``per_row`` distinct random key blocks (of ``block`` tokens) per query block and head.

    Head ``h`` draws with ``numpy.random.default_rng((seed, h))`` by Floyd's sampling over
    ``nb = ceil(seq_len / block)`` key blocks, vectorised over query blocks: for ``s`` in
    ``0 .. per_row-1`` and ``j = nb - per_row + s``, ``t = rng.integers(0, j + 1, size=nb)``, and
    each query block takes ``t`` unless it already has it, else ``j``. The choice depends on
    ``seq_len`` (it sets ``nb``) and on nothing else: no global RNG, no framework RNG, so every
    backend sees the same blocks.
    """
    return RandomBlocks(per_row, block, seed)


def global_tokens(n: int) -> Pattern:
    """Longformer/BigBird global tokens: ``i < n or j < n``."""
    return GlobalTokens(n)


def block_local(block: int, left_blocks: int, right_blocks: int) -> Pattern:
    """Block-aligned band: ``i//block - left_blocks <= j//block <= i//block + right_blocks``."""
    return BlockLocal(block, left_blocks, right_blocks)


def bigbird(block: int, window_blocks: int, global_blocks: int, random_per_row: int,
            seed: int) -> Pattern:
    """BigBird = ``block_local(block, w // 2, w // 2) | global_tokens(global_blocks * block)
    | random_blocks(random_per_row, block, seed)`` with ``w = window_blocks`` (odd: 3 means the
    query's own block and one on each side). Random blocks may coincide with window or global
    blocks (the union is what counts); ``random_per_row=0`` drops the random part.

    >>> p = bigbird(64, 3, 1, 2, seed=0)
    """
    _positive_int("window_blocks", window_blocks)
    if window_blocks % 2 == 0:
        raise ValueError(f"window_blocks must be odd (centred on the query block), got "
                         f"{window_blocks}")
    _positive_int("global_blocks", global_blocks, allow_zero=True)
    _positive_int("random_per_row", random_per_row, allow_zero=True)
    p = block_local(block, window_blocks // 2, window_blocks // 2)
    if global_blocks:
        p = p | global_tokens(global_blocks * block)
    if random_per_row:
        p = p | random_blocks(random_per_row, block, seed)
    return p


def longformer(window: int, global_n: int) -> Pattern:
    """Longformer = ``local(window // 2, window // 2) | global_tokens(global_n)``."""
    _positive_int("window", window, allow_zero=True)
    return local(window // 2, window // 2) | global_tokens(global_n)


def _is_sequence(x) -> bool:
    return hasattr(x, "__iter__") and not isinstance(x, (str, bytes, Pattern))


def documents(lengths: Sequence[int] | Sequence[Sequence[int]]) -> Pattern:
    """Packed documents (sequence packing): token ``i`` may attend to token ``j`` iff both lie in
    the same document, the documents being ``lengths`` tokens long, end to end from token 0.
    The lengths must sum to the (key) sequence length and be positive; boundaries need not be
    block-aligned (tiles straddling one are partial, token-exact). Compose with ``&``:
    ``documents(l) & causal()`` is causal attention within each document. Block kinds are in
    closed form (no N x N pass); a new set of lengths is new layout *data*, never a new kernel.

    >>> p = documents([3, 5]) & causal()
    >>> bool(p.token_mask(0, 4, 2, n=8)), bool(p.token_mask(0, 4, 3, n=8))
    (False, True)

    Per batch row: a sequence of ``B`` length lists (each row its own packing, every row
    summing to N; a 2-D numpy array works too) is ``per_batch_row([documents(l) for l in
    lengths])``; its layout holds ``B`` rows of heads and serves a ``[B, H, N, D]`` call:

    >>> documents([[3, 5], [8]]).batch
    2
    """
    # Only iterables become tuples; anything else reaches Documents' own check, which names
    # ``lengths`` (tuple(5) would raise Python's "'int' object is not iterable").
    if not _is_sequence(lengths):
        return Documents(lengths)
    lengths = list(lengths)
    nested = [_is_sequence(x) for x in lengths]
    if lengths and all(nested):
        return PerBatchRow(tuple(Documents(tuple(row)) for row in lengths))
    if any(nested):
        raise ValueError("lengths must be one list of document lengths or one list per batch "
                         f"row, not a mix: got {lengths!r}")
    return Documents(tuple(lengths))


def per_head(patterns: Sequence[Pattern]) -> Pattern:
    """Head ``h`` uses ``patterns[h % len(patterns)]``.

    >>> p = per_head([causal(), local(64, 0)])

    ``patterns`` must be a sequence (list or tuple) of patterns: a single pattern, or anything
    not iterable, raises TypeError naming ``patterns``.
    """
    if isinstance(patterns, (Pattern, str, bytes)) or not hasattr(patterns, "__iter__"):
        hint = " (wrap a single pattern in a list)" if isinstance(patterns, Pattern) else ""
        raise TypeError(f"patterns must be a sequence of Patterns, got "
                        f"{type(patterns).__name__}{hint}")
    return PerHead(tuple(patterns))


def per_batch_row(patterns: Sequence[Pattern]) -> Pattern:
    """Batch row ``r`` uses ``patterns[r]``: one ``sparse_attention`` call over ``[B, H, N, D]``
    with a different pattern per row (``B = len(patterns)``). Composes with ``&``, ``|`` and
    :func:`per_head` like any pattern (``per_batch_row(ps) & causal()`` is ``ps[r] & causal()`` in
    row ``r``). Its layout (:func:`~sparsetp.core.layout.make_layout`) has ``batch = B``.

    >>> p = per_batch_row([documents([3, 5]), documents([8])]) & causal()
    >>> p.batch, p._batch_row(1) == documents([8]) & causal()
    (2, True)
    """
    if isinstance(patterns, (Pattern, str, bytes)) or not hasattr(patterns, "__iter__"):
        raise TypeError(f"patterns must be a sequence of Patterns, one per batch row, got "
                        f"{type(patterns).__name__}")
    return PerBatchRow(tuple(patterns))


def neighborhood(grid, kernel_size, dilation=1, causal=False, tile_shape=None) -> Pattern:
    """Neighbourhood attention over a grid of tokens, with NATTEN 0.21's ``na1d/na2d/na3d``
    semantics.

    ``grid``: an int or a tuple of 1-3 ints; the sequence is the grid flattened row-major (last
    axis fastest), so ``seq_len`` must be ``prod(grid)``. ``kernel_size``, ``dilation`` (ints
    >= 1) and ``causal`` (bool) are one value for every axis or a tuple with one per axis.

    Per axis of length ``L``, query coordinate ``i`` and key coordinate ``j`` are neighbours iff
    ``i % d == j % d`` and, with ``p = i // d``, ``t = j // d`` and ``L_g`` the number of
    coordinates congruent to ``i`` mod ``d`` in ``[0, L)``: non-causal
    ``s = min(max(p - k // 2, 0), L_g - k)`` and ``s <= t < s + k`` (a window of ``k`` that
    shifts inward at the edges, so every query has exactly ``k`` neighbours per axis); causal
    ``p - k + 1 <= t <= p``. Tokens are neighbours iff they are along every axis.
    ``kernel_size * dilation <= L`` on every axis.

    ``tile_shape`` (optional, divides ``grid`` per axis): the same pattern on the sequence in
    the tiled order of :func:`grid_tiling` (its ``perm``), i.e. token ``i`` of the sequence is
    row-major token ``perm[i]``.

    The layout is built from per-axis windows in time linear in the listed tiles (a 3-D grid
    of 131072 tokens, kernel 7: 16-36 ms on a shared 2-core VM, ``benchmarks/KERNEL_NOTES.md``).
    It composes like any pattern, e.g. with global tokens (a union with global tokens or a narrow
    band, or an intersection with anything, keeps the sparse build):

    >>> p = neighborhood((8, 12), kernel_size=(3, 5), dilation=(1, 2)) | global_tokens(4)
    >>> nb = neighborhood((8, 12), 3)
    >>> bool(nb.token_mask(0, 0, 13, n=96)), bool(nb.token_mask(0, 0, 3, n=96))
    (True, False)
    """
    dims = len(grid) if isinstance(grid, (tuple, list)) else 1
    if not 1 <= dims <= 3:
        raise ValueError(f"grid must be an int or a tuple of 1 to 3 ints, got {grid!r}")
    grid = _per_axis("grid", grid, dims)
    tile = None if tile_shape is None else _tile_shape(grid, tile_shape)
    return Neighborhood(grid, _per_axis("kernel_size", kernel_size, dims),
                        _per_axis("dilation", dilation, dims), _per_axis("causal", causal, dims),
                        tile)
