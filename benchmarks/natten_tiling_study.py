"""How low can the computed work of issue #32's neighbourhood cases go? (CPU layout study.)

No kernel runs here: every number comes from ``make_layout``'s tables (``block_mask``, and the
bitmask words ``masks`` of the partial tiles via ``q_mask_id`` / ``q_partial``); no N x N array
is built except in the small self-check. Options, per case of ``sparsetp.bench.natten.GPU_CASES``
(1-D 32768 kernel 2048, 2-D 128x128 kernel 31x31, 3-D 16x32x32 kernel 7x15x15):

(a) every ``tile_shape`` whose product is the layout block (64 or 128) and that divides the grid,
    plus row-major;
(b) skipping fully masked sub-tiles inside a listed tile: key sub-tiles of ``SUB_N`` keys (any
    allowed pair for any query row of the tile), query sub-tiles of ``SUB_M`` rows, and both
    (``SUB_M x SUB_N`` blocks);
(c) both: (b) on every tile shape of (a);
(d) (closed form, per axis) queries and keys tiled in different boxes (keys of 128 / 64 / 32
    tokens in their own tiled order): the best any box key tiling does for given query boxes;
(e) (closed form) each query box gathers exactly the keys of its window union, by index, in
    chunks of 64 / 32 (the per-key floor of (b) plus the padding of the last chunk).
The closed forms are checked against the tables (tile density, per-key floor) on every row where
both exist.

Per option: tile density (computed tiles / all tiles), computed fraction (area of the computed
(sub-)tiles / N^2), useful fraction (allowed pairs / computed area), the ceiling 1 / computed
fraction (forward speed-up over dense if a computed element cost what a dense one does), and a
MODEL speed-up: the measured per-computed-element efficiency of our kernel (forward speed-up x
tile density of the measured layout, ``benchmarks/results/natten_h100.json``, one H100) divided
by the computed fraction. The model is not a measurement: it assumes the per-element throughput
stays that of the anchor whatever the sparsity (masked partial sub-tiles cost more than full ones;
the fraction of computed area in partial sub-tiles is recorded beside it), and it has two
anchors: block 128 (the kernel walks 128 queries x 64 keys per step, so skipping 64-key
sub-tiles keeps that step) and block 64 (measured 23% lower per element in 3-D, 8% in 2-D; used
for every finer step: 64-row query sub-tiles, 32-key sub-tiles, block-64 layouts; optimistic for
32-key steps, which nothing measured). Option (e) at block 128 / chunk 64 is modelled at the
block-128 efficiency as if gathering K/V rows by index and masking every chunk cost nothing.

Believe these numbers only when ``python -m pytest tests/neighborhood_test.py tests/layout_test.py``
passes; the script also checks its sub-tile counts against ``dense_mask()`` on small grids.

    python benchmarks/natten_tiling_study.py --out=benchmarks/results/natten_tiling_study.json
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import time

import numpy as np
from absl import app, flags

from sparsetp.bench.natten import GPU_CASES, spec
from sparsetp.core import make_layout
from sparsetp.core import patterns as P

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/results/natten_tiling_study.json", "write JSON here")
flags.DEFINE_list("cases", ["1d", "2d", "3d"], "names in sparsetp.bench.natten.GPU_CASES")
flags.DEFINE_list("blocks", ["128", "64"], "layout blocks")
flags.DEFINE_list("sub_n", ["64", "32", "1"],
                  "key sub-tile widths to skip at (multiples of 32; 1: the per-key floor)")
flags.DEFINE_list("sub_m", ["64"], "query sub-tile heights to skip at")
flags.DEFINE_string("measured", "benchmarks/results/natten_h100.json",
                    "natten preset JSON whose forward speed-ups anchor the model")
flags.DEFINE_bool("self_check", True, "check the sub-tile counts against dense_mask() first")
flags.DEFINE_integer("keep_key_shapes", 3,
                     "option (d): key tile shapes kept in the JSON per query tile shape and size")
flags.DEFINE_integer("top", 3, "tile shapes per (case, block, sub-tile) kept in the printout")

FULL = P.FULL
# Anchors of the model: (case, block) -> the natten preset's spec of the measured arm.
ANCHORS = {("1d", 128): "neighborhood:32768:2048",
           ("2d", 128): "neighborhood:128x128:31x31:tile8x16",
           ("2d", 64): "neighborhood:128x128:31x31:tile8x8",
           ("3d", 128): "neighborhood:16x32x32:7x15x15:tile2x8x8",
           ("3d", 64): "neighborhood:16x32x32:7x15x15:tile2x8x8"}


def tile_shapes(grid: tuple, block: int) -> list[tuple]:
    """Every tuple of per-axis divisors of ``grid`` whose product is ``block``."""
    divs = [[d for d in range(1, g + 1) if g % d == 0] for g in grid]
    return [t for t in itertools.product(*divs) if int(np.prod(t)) == block]


def subtile_stats(lay, sub_m: int, sub_n: int) -> dict:
    """Computed work of ``lay`` (head 0) when a kernel skips the ``sub_m x sub_n`` sub-tiles
    of a listed tile that hold no allowed pair. From the tables only: a full tile has every
    sub-tile full; a partial tile's sub-tiles come from its bitmask words (bit c % 32 of word
    c // 32 is key c of the tile), popcounted per sub-tile, once per distinct mask."""
    bs, n, nk = lay.block_size, lay.seq_len, lay.kv_len
    if n % bs or nk % bs:
        raise ValueError("the study assumes N a multiple of the block (no ragged last tile)")
    if bs % sub_m or bs % sub_n or (sub_n % 32 and sub_n != 1):
        raise ValueError(f"sub-tiles {sub_m}x{sub_n} must divide block {bs}; sub_n must be 1 "
                         "or a multiple of 32")
    nq_s, nk_s = bs // sub_m, bs // sub_n
    n_full = int((lay.block_mask[0] == FULL).sum())
    n_tiles = int((lay.block_mask[0] != P.EMPTY).sum())
    width = lay.q_mask_id.shape[-1]
    listed = np.arange(width)[None, :] < lay.q_partial[0][:, None]
    mids = lay.q_mask_id[0][listed]
    uses = np.bincount(mids, minlength=lay.masks.shape[0]).astype(np.int64)  # tiles per mask
    words = lay.masks.view(np.uint32)  # [M, bs, bs / 32]
    m = len(words)
    popc = np.bitwise_count(words).astype(np.int64)
    if sub_n == 1:
        # Per key column: the OR (AND) over a query sub-tile's rows has a bit per key that
        # some (every) row allows; a floor no kernel reaches (tl.dot needs >= 16 keys), and
        # independent of the key order, so it bounds any key tiling for these query tiles.
        rows = words.reshape(m, nq_s, sub_m, -1)
        nonempty = np.bitwise_count(np.bitwise_or.reduce(rows, axis=2)).reshape(m, -1).sum(-1)
        full_sub = np.bitwise_count(np.bitwise_and.reduce(rows, axis=2)).reshape(m, -1).sum(-1)
        nonempty, full_sub = nonempty.astype(np.int64), full_sub.astype(np.int64)
    else:
        per_sub = popc.reshape(m, nq_s, sub_m, nk_s, sub_n // 32).sum(axis=(2, 4))
        nonempty = (per_sub > 0).reshape(m, -1).sum(-1)
        full_sub = (per_sub == sub_m * sub_n).reshape(m, -1).sum(-1)
    subs_per_tile = nq_s * nk_s
    computed = n_full * subs_per_tile + int(uses @ nonempty)
    full = n_full * subs_per_tile + int(uses @ full_sub)
    allowed = n_full * bs * bs + int(uses @ popc.reshape(len(popc), -1).sum(-1))
    area = computed * sub_m * sub_n
    hist = (np.bincount(nonempty, weights=uses, minlength=subs_per_tile + 1)
            if subs_per_tile <= 16 else None)
    return {
        "sub_m": sub_m, "sub_n": sub_n,
        "tiles": n_tiles, "tiles_full": n_full, "tiles_partial": int(mids.size),
        "tile_density": n_tiles / (n // bs * (nk // bs)),
        "subtiles_computed": computed, "subtiles_full": full,
        "computed_fraction": area / (n * nk),
        "useful_fraction": allowed / area,
        "partial_area_fraction": (computed - full) / computed,
        "allowed_pairs": allowed,
        "ceiling": n * nk / area,
        # Partial tiles by their number of non-empty sub-tiles (0 .. subs_per_tile).
        "partial_tiles_by_nonempty_subtiles": None if hist is None else [int(x) for x in hist],
    }


def _dense_stats(lay, sub_m: int, sub_n: int) -> tuple:
    """The same counts from ``dense_mask()`` (small layouts only): the self-check."""
    m = lay.dense_mask()[0]
    n, nk, bs = m.shape[0], m.shape[1], lay.block_size
    tiles = m.reshape(n // bs, bs, nk // bs, bs).any(axis=(1, 3))
    subs = m.reshape(n // sub_m, sub_m, nk // sub_n, sub_n).sum(axis=(1, 3))
    # only sub-tiles inside computed tiles count (a sub-tile of an EMPTY tile is empty anyway)
    return (int(tiles.sum()), int((subs > 0).sum()), int((subs == sub_m * sub_n).sum()),
            int(m.sum()))


def self_check() -> int:
    """Compare :func:`subtile_stats` with the dense mask on small grids; returns cases run."""
    cases = [((1024,), (64,), None, 128), ((1024,), (200,), None, 64),
             ((32, 32), (7, 7), (4, 16), 64), ((32, 32), (9, 5), (8, 16), 128),
             ((32, 32), (7, 7), None, 128), ((8, 8, 16), (3, 5, 5), (2, 4, 8), 64),
             ((8, 8, 16), (3, 5, 5), (1, 8, 16), 128), ((4, 16, 16), (3, 7, 5), None, 128)]
    runs = 0
    for grid, kernel, tile, bs in cases:
        pat = P.neighborhood(grid, kernel, tile_shape=tile)
        n = int(np.prod(grid))
        lay = make_layout(pat, n, 1, bs)
        for sm, sn in {(bs, bs), (bs, 64), (bs, 32), (64, 64), (64, 32), (32, 32), (bs, 1),
                       (64, 1)}:
            if bs % sm or bs % sn:
                continue
            got = subtile_stats(lay, sm, sn)
            want = _dense_stats(lay, sm, sn)
            have = (got["tiles"], got["subtiles_computed"], got["subtiles_full"],
                    got["allowed_pairs"])
            if have != want or got["allowed_pairs"] != n * int(np.prod(kernel)):
                raise AssertionError(f"self-check {grid} {kernel} {tile} bs={bs} {sm}x{sn}: "
                                     f"tables {have}, dense {want}")
            runs += 1
    return runs


def _axis_unions(length: int, k: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query tile of ``t`` coordinates along one axis (non-causal, dilation 1): the union
    ``[u0, u1)`` of its queries' windows (NATTEN's start ``min(max(i - k // 2, 0), L - k)`` is
    non-decreasing in ``i``, so the union is one interval)."""
    i = np.arange(length)
    start = np.minimum(np.maximum(i - k // 2, 0), length - k)
    first = np.arange(0, length, t)
    return start[first], start[first + t - 1] + k


def decoupled_fraction(grid, kernel, tq, tk) -> float:
    """Computed fraction when queries are tiled in ``tq`` boxes and keys in ``tk`` boxes (each
    its own tiled order). A query box's allowed keys are the product of its per-axis window
    unions, and a key box meets that product iff it meets every axis's interval, so the count
    of computed (query box, key box) pairs is the product over axes of per-axis sums."""
    pairs = 1
    for length, k, a, b in zip(grid, kernel, tq, tk, strict=True):
        u0, u1 = _axis_unions(length, k, a)
        pairs *= int(((u1 - 1) // b - u0 // b + 1).sum())
    n = int(np.prod(grid))
    return pairs * int(np.prod(tq)) * int(np.prod(tk)) / (n * n)


def gathered_fraction(grid, kernel, tq, chunk: int) -> float:
    """Computed fraction when each ``tq`` query box gathers exactly the keys of its window
    union (by index, any order) and walks them in chunks of ``chunk`` keys (the last padded)."""
    size = np.ones(1, np.int64)
    for length, k, a in zip(grid, kernel, tq, strict=True):
        u0, u1 = _axis_unions(length, k, a)
        size = np.multiply.outer(size, u1 - u0).ravel()
    n = int(np.prod(grid))
    return int((-(-size // chunk)).sum()) * chunk * int(np.prod(tq)) / (n * n)


def anchors(path: str) -> dict:
    """(case, block) -> measured forward speed-up, tile density and their product (the
    per-computed-element efficiency relative to dense) from the natten preset's JSON."""
    with open(path) as f:
        result = json.load(f)
    out = {}
    for (case, bs), want in ANCHORS.items():
        for r in result["records"]:
            if (r.get("impl") == "sparsetp" and r.get("pattern") == want and r.get("block") == bs
                    and "speedup_vs_dense" in r):
                sp = r["speedup_vs_dense"]["fwd"]
                out[(case, bs)] = {"pattern": want, "block": bs, "fwd_speedup": sp,
                                   "tile_density": r["density"], "eff": sp * r["density"],
                                   "device": result.get("versions", {}).get("device")
                                   or result.get("device_kind")}
    return out


def _model(row: dict, coarse: bool | None, eff128: float, eff64: float) -> dict:
    """The model columns of a row: ``coarse`` (the kernel keeps its 128-query x 64-key step)
    picks the block-128 efficiency, False the block-64 one, None (no kernel) none."""
    frac = row["computed_fraction"]
    eff = None if coarse is None else eff128 if coarse else eff64
    row.update(model_eff="floor" if coarse is None else "block128" if coarse else "block64",
               model_speedup=None if eff is None else eff / frac,
               model_speedup_eff128=eff128 / frac, model_speedup_eff64=eff64 / frac)
    return row


def layout_rows(name, grid, kernel, measured_tiles, blocks, sub_ns, sub_ms, eff128, eff64):
    """Options (a)-(c) from ``make_layout``'s tables, one row per (block, tile shape, sub-tile)."""
    n = int(np.prod(grid))
    rows = []
    for bs in blocks:
        shapes = [None] + (tile_shapes(grid, bs) if len(grid) > 1 else [])
        if measured_tiles.get(bs) is not None and tuple(measured_tiles[bs]) not in shapes:
            shapes.append(tuple(measured_tiles[bs]))  # e.g. 2x8x8 (product 128) at block 64
        subs = [(bs, bs)] + [(bs, x) for x in sub_ns if x < bs] + [
            (m, x) for m in sub_ms if m < bs for x in [bs] + [y for y in sub_ns if y < bs]]
        for tile in shapes:
            lay = make_layout(P.neighborhood(grid, kernel, tile_shape=tile), n, 1, bs)
            # the arms the natten preset timed (row-major at 128, tiled at 128 / 64)
            measured = (tile is None and bs == 128) or (
                tile is not None and tile == tuple(measured_tiles.get(bs, ())))
            for sm, sn in subs:
                st = subtile_stats(lay, sm, sn)
                option = "a" if (sm, sn) == (bs, bs) else "b" if measured or tile is None else "c"
                # Block 128 keeps the kernel's 128 x 64 step when it skips 64-key sub-tiles;
                # anything finer runs at (at best) the block-64 efficiency; sub_n = 1 is no kernel.
                coarse = None if sn < 16 else bs == 128 and sm == 128 and sn >= 64
                rows.append(_model({
                    "case": name, "option": option, "source": "layout", "block": bs,
                    "tile_shape": None if tile is None else list(tile),
                    "pattern": spec(grid, kernel, tile=tile), "measured_config": measured,
                    **st}, coarse, eff128, eff64))
    return rows


def closed_form_rows(name, grid, kernel, blocks, eff128, eff64):
    """Options (d) and (e), per axis in closed form (no layout): (d) query boxes of the block
    and key boxes of 128 / 64 / 32 tokens, each in its own tiled order; (e) query boxes that
    gather exactly their window union's keys in chunks of 64 / 32."""
    n, allowed = int(np.prod(grid)), int(np.prod(grid)) * int(np.prod(kernel))
    rows = []

    def row(option, tq, tk, chunk, frac, coarse):
        area = frac * n * n
        return _model({"case": name, "option": option, "source": "closed_form",
                       "block": int(np.prod(tq)), "tile_shape": list(tq),
                       "key_tile_shape": None if tk is None else list(tk), "chunk": chunk,
                       "sub_m": int(np.prod(tq)), "sub_n": chunk or int(np.prod(tk)),
                       "computed_fraction": frac, "useful_fraction": allowed / area,
                       "ceiling": 1 / frac}, coarse, eff128, eff64)

    for bq in blocks:
        for tq in tile_shapes(grid, bq):
            for bk in (128, 64, 32):
                if bk > bq:
                    continue
                pairs = [row("d", tq, tk, None, decoupled_fraction(grid, kernel, tq, tk),
                              bq == 128 and bk >= 64) for tk in tile_shapes(grid, bk)]
                pairs.sort(key=lambda r: r["computed_fraction"])
                # keep the JSON small: the best few key shapes and the one equal to tq
                rows += [r for i, r in enumerate(pairs)
                         if i < FLAGS.keep_key_shapes or r["key_tile_shape"] == list(tq)]
            for chunk in (64, 32):
                rows.append(row("e", tq, None, chunk, gathered_fraction(grid, kernel, tq, chunk),
                                bq == 128 and chunk == 64))
    return rows


def cross_check(layout_rows_, grid, kernel) -> int:
    """The closed forms against the tables: tile density of every tiled layout (key boxes =
    query boxes) and the per-key floor (key boxes of one token). Returns comparisons made."""
    made = 0
    for r in layout_rows_:
        if r["tile_shape"] is None and len(grid) > 1:
            continue
        tq = tuple(r["tile_shape"] or (r["block"],))
        if int(np.prod(tq)) != r["block"]:
            continue  # a tile of two blocks (2x8x8 at block 64)
        if (r["sub_m"], r["sub_n"]) == (r["block"], r["block"]):
            want = decoupled_fraction(grid, kernel, tq, tq)
        elif (r["sub_m"], r["sub_n"]) == (r["block"], 1):
            want = decoupled_fraction(grid, kernel, tq, (1,) * len(grid))
        else:
            continue
        if not np.isclose(r["computed_fraction"], want, rtol=0, atol=1e-12):
            raise AssertionError(f"closed form {want} != tables {r['computed_fraction']}: {r}")
        made += 1
    return made


def main(argv):
    del argv
    t0 = time.time()
    checks = self_check() if FLAGS.self_check else 0
    meas = anchors(FLAGS.measured)
    # 1-D has no block-64 arm: its block-64 efficiency is its block-128 one times 3-D's ratio
    # (the larger measured penalty; 2-D's is smaller).
    ratio64 = meas[("3d", 64)]["eff"] / meas[("3d", 128)]["eff"]
    blocks = [int(b) for b in FLAGS.blocks]
    sub_ns = [int(s) for s in FLAGS.sub_n]
    sub_ms = [int(s) for s in FLAGS.sub_m]
    rows, summary, closed_checks = [], {}, 0
    for name, grid, kernel, measured_tiles, target in GPU_CASES:
        if name not in FLAGS.cases:
            continue
        n = int(np.prod(grid))
        eff128 = meas[(name, 128)]["eff"]
        eff64 = meas[(name, 64)]["eff"] if (name, 64) in meas else eff128 * ratio64
        lrows = layout_rows(name, grid, kernel, measured_tiles, blocks, sub_ns, sub_ms,
                            eff128, eff64)
        crows = closed_form_rows(name, grid, kernel, blocks, eff128, eff64)
        closed_checks += cross_check(lrows, grid, kernel)
        rows += lrows + crows
        # Best row per option and efficiency class; (c) includes (b)'s rows (every tile shape,
        # the measured one too), and the per-key floors are split by query sub-tile height.
        best = {}
        members = {"a": "a", "b": "b", "c": "bc", "d": "d", "e": "e"}
        for opt, kind in itertools.product("abcde", ("block128", "block64", "floor128",
                                                      "floor64")):
            group = [r for r in lrows + crows if r["option"] in members[opt] and (
                r["model_eff"] == kind or r["model_eff"] + str(r["sub_m"]) == kind)]
            if group:
                r = min(group, key=lambda r: r["computed_fraction"])
                best[f"{opt}/{kind}"] = {k: r.get(k) for k in (
                    "block", "tile_shape", "key_tile_shape", "chunk", "sub_m", "sub_n",
                    "computed_fraction", "useful_fraction", "partial_area_fraction", "ceiling",
                    "model_speedup", "model_speedup_eff128")}
        summary[name] = {
            "grid": list(grid), "kernel": list(kernel),
            "allowed_fraction": int(np.prod(kernel)) / n,
            "ceiling_exact": n / int(np.prod(kernel)),
            "eff128": eff128, "eff64": eff64, "eff64_estimated": (name, 64) not in meas,
            "target_fwd": target,
            "computed_fraction_for_target_at_eff128": eff128 / target,
            "computed_fraction_for_target_at_eff64": eff64 / target,
            "eff_needed_at_best_block128_option": None,
            "best": best,
        }
        coarse = [r for r in lrows + crows if r["model_eff"] == "block128"
                  and r["option"] != "e"]
        frac = min(r["computed_fraction"] for r in coarse)
        summary[name]["eff_needed_at_best_block128_option"] = target * frac
    out = {
        "tool": "benchmarks/natten_tiling_study.py",
        "command": "python benchmarks/natten_tiling_study.py " + " ".join(
            f"--{k}={','.join(v) if isinstance(v, list) else v}" for k, v in sorted(
                FLAGS.flag_values_dict().items()) if k in ("out", "cases", "blocks", "sub_n",
                                                           "sub_m", "measured")),
        "model": ("model_speedup = eff / computed_fraction with eff = measured fwd speed-up x "
                  "tile density of the anchor arm (natten_h100.json, one H100); eff128 for "
                  "128-row, >=64-key steps (option e: as if the gather were free), eff64 "
                  "otherwise (1-D: eff128 x 3-D's eff64/eff128, nothing measured). A model, "
                  "not a measurement."),
        "anchors": {f"{c}/{b}": v for (c, b), v in meas.items()},
        "eff64_over_eff128_3d": ratio64,
        "summary": summary, "self_check_cases": checks, "closed_form_checks": closed_checks,
        "rows": rows,
        "env": {"numpy": np.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "cpus": os.cpu_count(),
                "load_average": os.getloadavg()},
        "wall_s": round(time.time() - t0, 1),
    }
    # One row a line: readable, and a third of the size of an indented dump.
    rows_text = ",\n".join("  " + json.dumps(r) for r in out.pop("rows"))
    text = json.dumps(out, indent=1)
    with open(FLAGS.out, "w") as f:
        f.write(text[:-2] + f',\n "rows": [\n{rows_text}\n ]\n}}\n')
    print_table(rows, summary, FLAGS.top)
    print(f"{len(rows)} rows, self-check {checks} cases, closed-form checks {closed_checks}, "
          f"{out['wall_s']} s -> {FLAGS.out}")


def fmt(x) -> str:
    return f"{'-':>6s}" if x is None else f"{x:6.2f}"


def _shape(t) -> str:
    return "rowmaj" if t is None else "x".join(map(str, t))


def print_table(rows, summary, top):
    """Per case: the layout rows (measured configs, then the ``top`` tile shapes per block and
    sub-tile), then the best row of each option per efficiency class."""
    head = (f"{'case':4s} {'block':>5s} {'tile':>8s} {'sub':>7s} {'tiles%':>7s} {'comp%':>6s} "
            f"{'useful':>6s} {'part%':>6s} {'ceil':>6s} {'model':>6s} {'(eff)':>8s}")
    for name, s in summary.items():
        print(f"\n{name}: allowed {100 * s['allowed_fraction']:.2f}% of pairs (exact ceiling "
              f"{s['ceiling_exact']:.1f}x), eff128 {s['eff128']:.3f}, eff64 {s['eff64']:.3f}; "
              f"target {s['target_fwd']}x needs computed <= "
              f"{100 * s['computed_fraction_for_target_at_eff128']:.1f}% (eff128) / "
              f"{100 * s['computed_fraction_for_target_at_eff64']:.1f}% (eff64)")
        print(head)
        mine = [r for r in rows if r["case"] == name and r["source"] == "layout"]
        keys = sorted({(r["block"], r["sub_m"], r["sub_n"]) for r in mine}, reverse=True)
        for key in keys:
            group = [r for r in mine if (r["block"], r["sub_m"], r["sub_n"]) == key]
            best = sorted(group, key=lambda r: r["computed_fraction"])[:top]
            shown = [r for r in group if r["measured_config"] or r["tile_shape"] is None]
            for r in shown + [r for r in best if r not in shown]:
                tag = "*" if r["measured_config"] else " "
                print(f"{name:4s} {r['block']:5d} {_shape(r['tile_shape']):>8s}{tag}"
                      f"{r['sub_m']:>3d}x{r['sub_n']:<3d} {100 * r['tile_density']:7.2f} "
                      f"{100 * r['computed_fraction']:6.2f} {r['useful_fraction']:6.3f} "
                      f"{100 * r['partial_area_fraction']:6.1f} {r['ceiling']:6.2f} "
                      f"{fmt(r['model_speedup'])} {r['model_eff']:>8s}")
        print(f"best per option ({name}): option/eff: q tile, k tile or chunk, comp%, useful, "
              "ceiling, model, model at eff128")
        for key, r in s["best"].items():
            k = (f"chunk {r['chunk']}" if r.get("chunk") else _shape(r["key_tile_shape"])
                 if r.get("key_tile_shape") else f"sub {r['sub_m']}x{r['sub_n']}")
            print(f"  {key:11s} {r['block']:4d} {_shape(r['tile_shape']):>8s} {k:>12s} "
                  f"{100 * r['computed_fraction']:6.2f} {r['useful_fraction']:6.3f} "
                  f"{r['ceiling']:6.2f} {fmt(r['model_speedup'])} "
                  f"{r['model_speedup_eff128']:6.2f}")
        print(f"  eff needed for {s['target_fwd']}x at the best block-128 option (no gather): "
              f"{s['eff_needed_at_best_block128_option']:.3f} (now {s['eff128']:.3f})")


if __name__ == "__main__":
    app.run(main)
