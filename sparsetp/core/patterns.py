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
  structure only has to be *sound*, not tight; it is tight for every built-in constructor.

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
    "global_tokens", "block_local", "bigbird", "longformer", "per_head", "documents", "EMPTY",
    "PARTIAL", "FULL",
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
        k = _part(p, h, block_size, n)[qi, kj]
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


def _part(pattern, h, block_size, n):
    """Tile kinds of a part, computed once for every head with the same ``head_key`` (a union
    over 16 heads with one random part builds its window and global parts once)."""
    key = (pattern, pattern.head_key(h), block_size, n)
    out = _KINDS_CACHE.get(key)
    if out is None:
        if len(_KINDS_CACHE) >= 32:
            _KINDS_CACHE.clear()
        out = np.broadcast_to(pattern.block_kinds(h, block_size, n), (-(-n // block_size),) * 2)
        out.setflags(write=False)
        _KINDS_CACHE[key] = out
    return out


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
    return cls(tuple(parts))


_frozen = functools.partial(dataclasses.dataclass, frozen=True, slots=True)


@_frozen
class Dense(Pattern):
    def _token(self, h, i, j, n):
        return np.ones(np.broadcast_shapes(i.shape, j.shape), bool)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        nb = -(-n // block_size)
        return np.full((nb, nb), FULL, np.int8)

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
        lo_t, hi_t = _tile_bounds(block_size, n)
        dmin = lo_t[None, :] - hi_t[:, None]
        dmax = hi_t[None, :] - lo_t[:, None]
        return _band_kinds(dmin, dmax, *self._bounds())

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
        lo, hi = _tile_bounds(block_size, n)
        g_lo, g_hi = lo // self.size, hi // self.size
        # Group ranges of rows and columns are contiguous integer ranges: the tile is full when
        # both collapse to one equal group, empty when they do not meet.
        full = (g_lo[:, None] == g_hi[:, None]) & (g_lo[None, :] == g_hi[None, :]) & (
            g_lo[:, None] == g_lo[None, :])
        empty = (g_hi[:, None] < g_lo[None, :]) | (g_lo[:, None] > g_hi[None, :])
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
        # Closed form, as for block_diagonal with irregular groups: the documents a tile row or
        # column spans are the contiguous range doc(lo) .. doc(hi).
        lo, hi = _tile_bounds(block_size, n)
        g_lo, g_hi = self._doc(lo), self._doc(hi)
        one = g_lo == g_hi
        full = one[:, None] & one[None, :] & (g_lo[:, None] == g_lo[None, :])
        empty = (g_hi[:, None] < g_lo[None, :]) | (g_lo[:, None] > g_hi[None, :])
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
        col = _vector_kinds(self._col(h, np.arange(n, dtype=np.int64), n), block_size)
        return np.broadcast_to(col[None, :], (col.shape[0], col.shape[0])).copy()

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
        return _union_kinds([p.block_kinds(h, block_size, n) for p in self._parts()])

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

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        k = _vector_kinds(np.arange(n) < self.n_global, block_size)
        return _union_kinds([k[:, None], k[None, :]])

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
        lo, hi = _tile_bounds(block_size, n)
        r0, r1 = lo // self.block, hi // self.block
        return _band_kinds(r0[None, :] - r1[:, None], r1[None, :] - r0[:, None],
                           -self.left_blocks, self.right_blocks)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return _relative_classes(self.block, block_size, n, qi, kj)


@_frozen
class _Union(Pattern):
    parts: tuple

    def _token(self, h, i, j, n):
        return np.logical_or.reduce([p._token(h, i, j, n) for p in self.parts])

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return _union_kinds([_part(p, h, block_size, n) for p in self.parts])

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


@_frozen
class PerHead(Pattern):
    """Head ``h`` uses ``patterns[h % len(patterns)]`` (which still sees the true ``h``)."""

    patterns: tuple

    def __post_init__(self):
        if len(self.patterns) == 0:
            raise ValueError("patterns must not be empty")
        for p in self.patterns:
            if not isinstance(p, Pattern):
                raise ValueError(f"patterns must hold Pattern values, got {p!r}")

    def _pick(self, h):
        return self.patterns[h % len(self.patterns)]

    def _token(self, h, i, j, n):
        return self._pick(h)._token(h, i, j, n)

    def block_kinds(self, h, block_size, n) -> np.ndarray:
        return self._pick(h).block_kinds(h, block_size, n)

    def _tile_classes(self, h, block_size, n, qi, kj):
        return self._pick(h)._tile_classes(h, block_size, n, qi, kj)

    def head_key(self, h) -> Hashable:
        return (h % len(self.patterns), self._pick(h).head_key(h))

    def _validate(self, seq_len):
        for p in self.patterns:
            p._validate(seq_len)


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


def documents(lengths: Sequence[int]) -> Pattern:
    """Packed documents (sequence packing): token ``i`` may attend to token ``j`` iff both lie in
    the same document, the documents being ``lengths`` tokens long, end to end from token 0.
    The lengths must sum to the (key) sequence length and be positive; boundaries need not be
    block-aligned (tiles straddling one are partial, token-exact). Compose with ``&``:
    ``documents(l) & causal()`` is causal attention within each document. Block kinds are in
    closed form (no N x N pass); a new set of lengths is new layout *data*, never a new kernel.

    >>> p = documents([3, 5]) & causal()
    >>> bool(p.token_mask(0, 4, 2, n=8)), bool(p.token_mask(0, 4, 3, n=8))
    (False, True)
    """
    return Documents(tuple(lengths) if not isinstance(lengths, (str, bytes)) else lengths)


def per_head(patterns: Sequence[Pattern]) -> Pattern:
    """Head ``h`` uses ``patterns[h % len(patterns)]``.

    >>> p = per_head([causal(), local(64, 0)])
    """
    return PerHead(tuple(patterns))
