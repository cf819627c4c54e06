"""Named example patterns: the matrix the tests, the parity suite and the benchmarks share.

Each entry maps a name to a function ``(seq_len, block_size) -> Pattern`` so that one name
means a sensible pattern at any size (windows and strides scale with the block size).

>>> from sparsetp.core.examples import example_pattern
>>> p = example_pattern("bigbird", seq_len=256, block_size=32)
"""

from __future__ import annotations

from collections.abc import Callable

from sparsetp.core import patterns as P

__all__ = ["EXAMPLE_PATTERNS", "example_pattern"]

def _grid2(n: int) -> tuple[int, int]:
    """The most square ``(rows, cols)`` grid of exactly ``n`` tokens (``rows <= cols``; a prime
    ``n`` is one row)."""
    rows = max(r for r in range(1, int(n ** 0.5) + 1) if n % r == 0)
    return rows, n // rows


def _neighborhood_2d(n: int, causal_rows: bool = False) -> P.Pattern:
    """A 2-D neighbourhood on the grid of ``_grid2(n)``: kernel 5 x 4 (even along the
    columns), dilation 2 along the columns, clipped to what the grid holds."""
    rows, cols = _grid2(n)
    dil = 2 if cols >= 4 else 1
    return P.neighborhood((rows, cols), (min(5, rows), max(1, min(4, cols // dil))), (1, dil),
                          causal=(causal_rows, False))


EXAMPLE_PATTERNS: dict[str, Callable[[int, int], P.Pattern]] = {
    "dense": lambda n, b: P.dense(),
    "causal": lambda n, b: P.causal(),
    # A window that is not a multiple of the block: partial tiles on both edges.
    "local": lambda n, b: P.local(b + b // 2, b // 3),
    "block_diagonal": lambda n, b: P.block_diagonal(2 * b),
    "fixed": lambda n, b: P.fixed(2 * b, b // 4),
    "strided": lambda n, b: P.strided(3, b, offset=1),
    "strided_causal": lambda n, b: P.strided(4, b, per_head_offset=True) & P.causal()
    | P.local(b - 1, 0),
    # Plain intersection, no local band: query blocks off the stride get no diagonal tile, only
    # full earlier strided blocks; blocks on the stride get a causal (partial) diagonal tile.
    "strided_and_causal": lambda n, b: P.strided(4, b) & P.causal(),
    "random": lambda n, b: P.random_blocks(2, b, seed=7),
    "global": lambda n, b: P.global_tokens(b // 2 + 3),
    "bigbird": lambda n, b: P.bigbird(b, 3, 1, 1, seed=3),
    "longformer": lambda n, b: P.longformer(2 * b, b // 2),
    "per_head_mix": lambda n, b: P.per_head(
        [P.causal(), P.local(b, b), P.strided(2, b, per_head_offset=True) | P.global_tokens(5)]),
    # NATTEN-style neighbourhoods on a 2-D grid of the N tokens (row-major; seq_len 150 is
    # 10 x 15): tiles cut rows, so most tiles are partial; plus causal rows and global tokens.
    "neighborhood_2d": lambda n, b: _neighborhood_2d(n),
    "neighborhood_global": lambda n, b: _neighborhood_2d(n, causal_rows=True)
    | P.global_tokens(3),
    # Only key m = min(b, n-1) is allowed, causally: rows 0 .. m-1 attend to nothing, which
    # exercises the fully-masked-rows path (output 0, lse -inf, no NaN).
    "masked_rows": lambda n, b: P.causal() & P.strided(
        n + 1, 1, offset=(n + 1 - min(b, n - 1)) % (n + 1)),
}


def example_pattern(name: str, seq_len: int, block_size: int) -> P.Pattern:
    """The named example pattern for ``seq_len`` tokens and layout ``block_size``."""
    try:
        return EXAMPLE_PATTERNS[name](seq_len, block_size)
    except KeyError:
        raise ValueError(
            f"unknown pattern name {name!r}; known: {sorted(EXAMPLE_PATTERNS)}") from None
