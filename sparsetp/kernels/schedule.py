"""GPU scheduling: in which order programs take tiles and heads, and at which kernel tile.

Everything here is about how a launch maps onto the GPU, not about what it computes (the spec
layer, :mod:`sparsetp.core`, decides that):

* :func:`head_group` / :func:`head_groups`: how many heads a launch interleaves per group;
* :func:`grid`, :func:`list_grid`, :func:`grid_group`: launch grids;
* :func:`kernel_layout`: a cost model that may run a layout's pattern at another kernel tile.

The constants below were fitted on an H200 (bf16, H=16, D=128); the measurements behind them
are in ``benchmarks/KERNEL_NOTES.md`` (sections "v8", "v11" and "v5", "v6", "v12").

Example::

    >>> head_group(np.full((16, 256), 9), 132), list_grid(2, 8, 32, 4)
    (1, (4, 32, 4))
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparsetp.core.layout import SUPPORTED_BLOCK_SIZES
from sparsetp.core.layout import block_kinds as _block_kinds
from sparsetp.core.patterns import EMPTY
from sparsetp.kernels import options as _options
from sparsetp.kernels.tiles import (
    DEVICE_KINDS,
    LARGE_HEAD_DIM,
    LARGE_HEAD_DIM_MAX_BLOCK,
    check_dtype,
)

__all__ = ["CONCURRENT_PROGRAMS", "HEAD_MAJOR_TAIL", "head_group", "head_groups",
           "list_grid", "grid_group", "kernel_layout"]

# Head order of a launch. Heads one after another keep the programs running together on one
# head's K/V (or Q/dO), which L2 then serves; heads interleaved start every head's longest lists
# before anyone's short ones. Between the two, a launch takes the heads in groups of G: each
# group's heads interleaved, one group after another. The cost of grouping: the last group's
# longest list starts after about (H - G) / H of the work, so the launch ends about
#     tail(G) = L_max * P / W - G / H
# of its ideal time late (W: listed tiles over all heads, L_max: the longest list, P: programs
# running at once, CONCURRENT_PROGRAMS by kernel tile). The launch takes the smallest G (a
# divisor of H) whose tail is at most HEAD_MAJOR_TAIL.
# P: the tile-128 kernels run one program per SM (132 on an H100/H200), the tile-64 ones two;
# tiles 32 and 16 are taken as 64.
CONCURRENT_PROGRAMS = {16: 264, 32: 264, 64: 264, 128: 132}
HEAD_MAJOR_TAIL = 0.02


def head_group(count: np.ndarray, concurrent: int) -> int:
    """How many heads a launch over lists of lengths ``count[h, I]`` interleaves per group (see
    ``HEAD_MAJOR_TAIL`` above): the smallest divisor G of H with tail(G) <= HEAD_MAJOR_TAIL,
    else H; H when nothing is listed. 1 runs the heads one after another.

    >>> head_group(np.full((16, 256), 9), 132), head_group(np.full((16, 64), 9), 132)
    (1, 2)
    >>> head_group(np.full((16, 64), 9), 264), head_group(np.full((16, 8), 9), 264)
    (4, 16)
    """
    count = np.asarray(count)
    if count.ndim != 2:
        raise ValueError(f"count must be [H, tiles], got shape {count.shape}")
    heads, work = count.shape[0], float(count.sum())
    if work <= 0:
        return heads
    load = float(count.max()) * concurrent / work
    return next((g for g in range(1, heads + 1)
                 if heads % g == 0 and load - g / heads <= HEAD_MAJOR_TAIL), heads)


_HEAD_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_groups(layout) -> tuple[int, int]:
    """(query-major, key-major) head groups of ``layout``'s launches. A head slice
    (:meth:`BlockLayout.heads`) takes the whole layout's choice, so every tensor-parallel rank
    launches alike. Cached per layout.

    >>> from sparsetp.core import patterns as P, make_layout
    >>> head_groups(make_layout(P.causal(), 1024, 4, 64))    # 16 tiles: interleave all heads
    (4, 4)
    """
    whole = layout.source if layout.source is not None else layout
    hit = _HEAD_GROUPS.get(whole)
    if hit is None:
        p = CONCURRENT_PROGRAMS.get(whole.block_size, CONCURRENT_PROGRAMS[64])
        hit = _HEAD_GROUPS[whole] = (head_group(whole.q_count, p), head_group(whole.k_count, p))
    return hit


def list_grid(batch: int, heads: int, ranks: int, group: int) -> tuple[int, int, int]:
    """Launch grid of the list kernels (forward, dQ, dK/dV, split forward), ``ranks`` programs
    per (batch, head), the B * H (batch, head) pairs taken in groups of ``group`` (clipped to
    B * H; it must divide B * H): (group, ranks, B * H / group) dispatches rank r of each pair
    in a group before rank r + 1 of any, one group after another (group = B * H: every head
    interleaved, "heads first"); group 1, or one rank per head, gives the one-axis grid
    (B * H * ranks, 1, 1), heads one after another. The kernels tell the forms apart at run
    time (``attention._program``), so the choice never recompiles them.

    >>> list_grid(2, 8, 32, 16), list_grid(2, 8, 32, 4), list_grid(2, 8, 32, 1)
    ((16, 32, 1), (4, 32, 4), (512, 1, 1))
    """
    bh, ranks, group = int(batch) * int(heads), int(ranks), min(int(group), int(batch) * int(heads))
    if group < 1 or bh % group:
        raise ValueError(f"head group {group} must be >= 1 and divide B * H = {bh}")
    if group == 1 or ranks == 1:
        return (bh * ranks, 1, 1)
    return (group, ranks, bh // group)


def grid_group(meta: Mapping[str, Any], major: str, batch: int, heads: int) -> int:
    """How many (batch, head) pairs a launch over the ``major`` ("q"/"k") lists interleaves per
    group (:func:`list_grid`). Under the work order ``"auto"``: the mapping's
    ``{major}_head_group`` G (:func:`head_groups`; all heads if missing or None); G >= ``heads``
    (this launch may hold a tensor-parallel slice of the layout's heads) interleaves all B * H
    pairs, a smaller G groups gcd(G, heads) heads of one batch entry. "natural" and
    "longest_first" use 1, "longest_first_bh" all; :attr:`LaunchOptions.head_group` forces G."""
    opts = _options.current()
    bh = int(batch) * int(heads)
    group = opts.head_group
    if group is None:
        group = (meta.get(f"{major}_head_group") if opts.work_order == "auto"
                 else bh if opts.work_order == "longest_first_bh" else 1)
    group = bh if group is None else int(group)
    return bh if group >= heads else math.gcd(group, int(heads))


# ----------------------------------------------------------------------------- kernel tiles
# A layout is exact at token level (partial tiles carry their element masks), so the same pattern
# laid out at another block is the same attention computed in other tiles: the kernel tile may
# cover several layout blocks, or, where it pays, split them. Small tiles skip empty score
# regions more finely; large tiles keep the tensor cores busier on long rows. The model:
# forward + backward time of a layout run at block ``bs`` is
#     a[bs] * (heads x row tiles) + b[bs] * computed elements (millions),
# in ms per batch element, least-squares fitted to tile A/Bs on an H200 (bf16, H=16, D=128,
# N=8192 and 32768; window, causal, BigBird, strided causal). Fit, residuals and the D=64
# readings: KERNEL_NOTES.md ("v5", "v6", "v12").
_TILE_MODEL = {128: (0.2102e-3, 0.004440), 64: (0.0831e-3, 0.004367),
               32: (0.0, 0.013504), 16: (0.0, 0.018791)}
# A tile smaller than the layout block only where measured (64 for a block-128 layout in
# bf16/fp16 at D = 64 and 128), and only for a modelled gain of at least ``min_gain`` (the fit's
# residuals are a few %, and a refined layout is a second layout to build on a first call).
_REFINE = {"from_block": 128, "to_block": 64, "head_dims": (64, 128),
           "dtypes": ("bfloat16", "float16"), "min_gain": 0.02}
_KERNEL_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _modelled_ms(pattern, seq_len: int, num_heads: int, block: int,
                 kv_len: int | None = None) -> float:
    """Modelled fwd+bwd ms of ``pattern`` run at ``block``, per batch element. Tile counts come
    from the pattern's structural block kinds (no element masks, no lists: ~20x cheaper than a
    layout; tiles only "maybe" partial count as computed), so a first call does not build
    layouts it will not run."""
    a, b = _TILE_MODEL[block]
    tiles_by_key: dict = {}
    tiles = 0
    for h in range(num_heads):
        key = pattern.head_key(h)
        if key not in tiles_by_key:
            tiles_by_key[key] = int(np.count_nonzero(
                np.asarray(_block_kinds(pattern, h, block, seq_len, kv_len)) != EMPTY))
        tiles += tiles_by_key[key]
    return a * num_heads * -(-seq_len // block) + b * tiles * block * block / 1e6


def kernel_layout(layout, device_kind: str, *, head_dim: int | None = None,
                  dtype: str | None = None) -> Any:
    """The layout the kernels run for ``layout``: itself, or its pattern laid out at another
    block when :data:`_TILE_MODEL` says that is faster (same token mask, same attention).

    Policy (:attr:`LaunchOptions.kernel_tile`, default ``"auto"``): on CUDA, the block with the
    least modelled time among the layout's own, every larger one, and, for a block-128 layout with
    ``head_dim`` 64 or 128 and bfloat16/float16 (where tile 64 was measured), 64; for
    ``head_dim`` above 128, the layout's block if at most 64, else 64 (larger tiles do not fit,
    see :func:`sparsetp.kernels.tiles.tile_config`); in the
    interpreter the layout itself, so CPU tests run the kernels at every block; for
    ``device_kind="cpu"`` (the native CPU path, no kernels) always the layout itself. A layout
    without a pattern (built by hand) is launched as it is. Both frontends call this with the
    same arguments, so torch and JAX launch the same tiles. The other layouts are built once
    per layout (cached while it lives). A pattern whose chosen block has not run in this
    process yet compiles that block's kernels on its first call.

    >>> from sparsetp.core import patterns as P, make_layout
    >>> lay = make_layout(P.local(511, 511), 4096, 2, 32)
    >>> kernel_layout(lay, "cuda").block_size, kernel_layout(lay, "interpreter").block_size
    (64, 32)
    """
    if device_kind == "cpu":  # the native CPU path (sparsetp._runtime) runs layouts as they are
        return layout
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind must be one of {DEVICE_KINDS} or 'cpu', got "
                         f"{device_kind!r}")
    mode = _options.current().kernel_tile
    if (mode == "layout" or (mode == "auto" and device_kind != "cuda")
            or getattr(layout, "pattern", None) is None):
        return layout
    if getattr(layout, "source", None) is not None:
        # A head slice runs at its whole layout's tile (and keeps its head groups), so every
        # tensor-parallel rank launches alike.
        whole = kernel_layout(layout.source, device_kind, head_dim=head_dim, dtype=dtype)
        if whole is layout.source:
            return layout
        cache = _KERNEL_LAYOUTS.setdefault(layout, {})
        if whole not in cache:  # the slice of this whole, once (launch caches key on it)
            cache.clear()
            cache[whole] = whole.heads(layout.head_offset, layout.head_offset + layout.num_heads)
        return cache[whole]
    large_d = head_dim is not None and head_dim > LARGE_HEAD_DIM
    if mode == "auto" and large_d:
        # Head dims above 128 only fit tiles of at most 64 (tiles.tile_config): the layout's
        # own block when it is small enough, else the same pattern at 64.
        blocks = ([] if layout.block_size <= LARGE_HEAD_DIM_MAX_BLOCK
                  else [LARGE_HEAD_DIM_MAX_BLOCK])
    elif mode == "auto":
        blocks = [b for b in SUPPORTED_BLOCK_SIZES if b > layout.block_size]
        if (layout.block_size == _REFINE["from_block"] and head_dim in _REFINE["head_dims"]
                and dtype is not None and check_dtype(dtype) in _REFINE["dtypes"]):
            blocks.append(_REFINE["to_block"])
    else:
        blocks = [mode] if mode > layout.block_size else []
    if not blocks:
        return layout
    cache = _KERNEL_LAYOUTS.setdefault(layout, {})
    key = (mode, tuple(blocks), large_d)
    if key not in cache:
        best = layout.block_size
        if mode == "auto" and large_d:
            best = blocks[0]
        elif mode == "auto":
            args = (layout.pattern, layout.seq_len, layout.num_heads)
            cost = {b: _modelled_ms(*args, b, layout.kv_len) for b in blocks}
            a, b = _TILE_MODEL[layout.block_size]  # the layout's own: its exact tile counts
            cost[layout.block_size] = (a * layout.num_heads * layout.num_blocks
                                       + b * float(layout.q_count.sum())
                                       * layout.block_size ** 2 / 1e6)
            refined = _REFINE["to_block"]
            if (refined in cost and refined < layout.block_size
                    and cost[refined] > (1 - _REFINE["min_gain"]) * cost[layout.block_size]):
                del cost[refined]  # not enough modelled gain to refine (see _REFINE)
            best = min(cost, key=lambda b: (cost[b], b != layout.block_size))
        else:
            best = mode
        if best == layout.block_size:
            cache[key] = layout
        else:
            from sparsetp.core.layout import make_layout  # noqa: PLC0415 (numpy-only spec)

            cache[key] = make_layout(layout.pattern, layout.seq_len, layout.num_heads, best,
                                     kv_len=layout.kv_len)
    return cache[key]
