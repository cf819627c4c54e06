"""The ``natten`` preset of ``python -m sparsetp.bench attention``: issue #32's speed cases.

Neighbourhood attention (NATTEN semantics, :func:`sparsetp.core.patterns.neighborhood`) in the
issue's three shapes, bf16, B=1, H=16, D=128 on the GPU:

==========  ================  ================  =======================================
case        grid              kernel            forward speed-up over cuDNN dense wanted
==========  ================  ================  =======================================
1-D         32768             2048              >= 13x
2-D         128 x 128         31 x 31           >= 6x
3-D         16 x 32 x 32      7 x 15 x 15       >= 4.5x
==========  ================  ================  =======================================

Arms: ours (``sparsetp``, torch) on the row-major sequence and, for 2-D and 3-D, in the tiled
token order of ``neighborhood(..., tile_shape=...)`` (inputs already in that order, as in a
model that permutes once with :func:`~sparsetp.core.grid_tiling`; the permutation is not
timed); cuDNN dense SDPA (``sdpa_cudnn``) at the same N, the "dense" of every ratio (flash's
``sdpa_flash`` is measured too and stands in where cuDNN's fails); FlexAttention (``flex``) with a
BlockMask from our layout and the NATTEN rule written as a ``mask_mod`` over the token indices
(row-major or tiled, as a Flex user would write it); ours in JAX (``sparsetp_jax``).

Before any timing of ours, :func:`check` compares our output and dQ with a float64 oracle on
sampled query rows, and the tiled arm (permuted in, un-permuted out) with the row-major one
(output and all gradients); the Flex and JAX arms record their difference from ours
(``max_abs_diff_vs_sparsetp``), and :func:`targets` turns those into rows N0. A failed check
is a recorded error, not a timing.

Spec strings: ``neighborhood:<grid>:<kernel>[:dil<d>][:causal<c>][:tile<t>]``, each an
``x``-separated tuple with one entry per axis, e.g. ``neighborhood:128x128:31x31:tile8x16``.

    python -m sparsetp.bench attention --preset=natten --out_dir=/tmp/natten        # GPU
    python -m sparsetp.bench attention --preset=natten --device=cpu --out_dir=/tmp/n  # smoke
"""

from __future__ import annotations

import numpy as np

from sparsetp.core import grid_tiling, make_layout
from sparsetp.core import patterns as P

# (name, grid, kernel, tile shape per layout block, forward speed-up over dense wanted).
GPU_CASES = (
    ("1d", (32768,), (2048,), {}, 13.0),
    ("2d", (128, 128), (31, 31), {128: (8, 16), 64: (8, 8)}, 6.0),
    ("3d", (16, 32, 32), (7, 15, 15), {128: (2, 8, 8), 64: (2, 8, 8)}, 4.5),
)
GPU_SHAPE = dict(h=16, d=128, dtype="bfloat16")
# CPU smoke: the same machinery at sizes two shared cores run in seconds (not a speed result).
CPU_CASES = (
    ("1d", (1024,), (64,), {}, 13.0),
    ("2d", (32, 32), (7, 7), {32: (4, 8)}, 6.0),
    ("3d", (8, 8, 16), (3, 5, 5), {32: (2, 4, 4)}, 4.5),
)
CPU_SHAPE = dict(h=2, d=32, dtype="float32")
BWD_FRACTION = 0.8  # backward speed-ups: at least 80% of the forward's
MAX_BWD_OVER_FWD = 3.0
MAX_JAX_OVER_TORCH = 1.05
# Per-dtype absolute tolerance of the test suite (tests/testing_utils.py: rtol = atol / 10,
# gradients twice both).
ATOL = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 3e-2}
CHECK_ROWS = 8  # query rows the float64 oracle recomputes (the edges among them)


def _tup(text: str) -> tuple:
    return tuple(int(x) for x in text.split("x"))


def spec(grid, kernel, *, dilation=None, causal=None, tile=None) -> str:
    """The spec string of a neighbourhood (tuples, one entry per axis).

    >>> spec((128, 128), (31, 31), tile=(8, 16))
    'neighborhood:128x128:31x31:tile8x16'
    """
    out = f"neighborhood:{'x'.join(map(str, grid))}:{'x'.join(map(str, kernel))}"
    for name, val in (("dil", dilation), ("causal", causal), ("tile", tile)):
        if val is not None:
            out += f":{name}{'x'.join(str(int(v)) for v in val)}"
    return out


def parse(text: str) -> dict:
    """``grid, kernel, dilation, causal, tile`` of a spec (defaults filled in)."""
    parts = text.split(":")
    if parts[0] != "neighborhood" or len(parts) < 3:
        raise ValueError(f"neighbourhood spec must be neighborhood:<grid>:<kernel>[:dil..]"
                         f"[:causal..][:tile..], got {text!r}")
    grid, kernel = _tup(parts[1]), _tup(parts[2])
    out = {"grid": grid, "kernel": kernel, "dilation": (1,) * len(grid),
           "causal": (False,) * len(grid), "tile": None}
    for part in parts[3:]:
        for name in ("dil", "causal", "tile"):
            if part.startswith(name):
                val = _tup(part[len(name):])
                key = {"dil": "dilation"}.get(name, name)
                out[key] = tuple(bool(v) for v in val) if name == "causal" else val
                break
        else:
            raise ValueError(f"unknown part {part!r} of neighbourhood spec {text!r}")
    return out


def pattern(text: str) -> P.Pattern:
    s = parse(text)
    return P.neighborhood(s["grid"], s["kernel"], s["dilation"], s["causal"],
                          tile_shape=s["tile"])


def mask_mod(grid, kernel, dilation, causal, tile=None):
    """NATTEN's rule as a Flex ``mask_mod`` over token indices: each index is split into grid
    coordinates (row-major, or the tiled order: tile coordinates, then the coordinates inside
    the tile), then per axis ``i % d == j % d`` and the window of ``i // d``."""
    import torch  # noqa: PLC0415

    dims = len(grid)
    tile = tile or (1,) * (dims - 1) + (grid[-1],)
    sizes = [g // t for g, t in zip(grid, tile, strict=True)] + list(tile)
    strides = [int(np.prod(sizes[a + 1:], dtype=np.int64)) for a in range(2 * dims)]

    def coords(x):
        digit = [(x // strides[a]) % sizes[a] for a in range(2 * dims)]
        return [digit[a] * tile[a] + digit[dims + a] for a in range(dims)]

    def mod(b, h, q, kv):
        ok = None
        for i, j, length, k, d, c in zip(coords(q), coords(kv), grid, kernel, dilation, causal,
                                         strict=True):
            r, p, t = i % d, i // d, j // d
            if c:
                axis = (t <= p) & (t > p - k)
            else:
                groups = (length - r + d - 1) // d  # coordinates congruent to i mod d
                s = torch.minimum((p - k // 2).clamp(min=0), groups - k)
                axis = (t >= s) & (t < s + k)
            axis = axis & (j % d == r)
            ok = axis if ok is None else ok & axis
        return ok
    return mod


def bench_pattern(text: str, n: int, bs: int):
    """The :class:`~sparsetp.bench.attention.BenchPattern` of a neighbourhood spec."""
    from sparsetp.bench.attention import BenchPattern  # noqa: PLC0415

    s = parse(text)
    pat = pattern(text)
    if pat.seq_len != n:
        raise ValueError(f"{text}: the grid holds {pat.seq_len} tokens, not N={n}")
    order = f", tiled order {'x'.join(map(str, s['tile']))}" if s["tile"] else ", row-major"
    desc = (f"NATTEN neighbourhood, grid {'x'.join(map(str, s['grid']))}, kernel "
            f"{'x'.join(map(str, s['kernel']))}, dilation {'x'.join(map(str, s['dilation']))}"
            f", causal {'x'.join(str(int(c)) for c in s['causal'])}{order}")
    return BenchPattern(text, pat, "neighborhood", desc,
                        lambda t: mask_mod(s["grid"], s["kernel"], s["dilation"], s["causal"],
                                           s["tile"]),
                        check=check)


def preset_config(device: str):
    """The ``natten`` preset: ours and cuDNN first, then JAX, then Flex row-major, then Flex
    tiled (a budget overrun loses the tail; Flex compiles take 5-48 s per mask and shape on the
    GPU machine). About 3 minutes on one H100/H200; the budget leaves room for the slowest
    Flex compiles, so the last Flex row is not lost to it."""
    from sparsetp.bench.attention import BenchConfig, _case  # noqa: PLC0415

    gpu = device == "cuda"
    table, shape = (GPU_CASES, GPU_SHAPE) if gpu else (CPU_CASES, CPU_SHAPE)
    base_block = 128 if gpu else 32
    ours, flex_tiled = [], []
    for _, grid, kernel, tiles, _ in table:
        n = int(np.prod(grid))
        ours.append(_case(spec(grid, kernel), n, block=base_block, **shape))
        for bs, tile in tiles.items():
            ours.append(_case(spec(grid, kernel, tile=tile), n, block=bs, **shape))
            if bs == base_block:
                flex_tiled.append(ours[-1])
    flex_row_major = [c for c in ours if ":tile" not in c["pattern"]]
    dense = "sdpa_cudnn" if gpu else "sdpa"
    sections = [("natten", ours, [dense, "sparsetp"]), ("natten", ours, ["sparsetp_jax"]),
                ("natten", flex_row_major, ["flex"]), ("natten", flex_tiled, ["flex"])]
    if gpu:  # flash: the dense anchor only where cuDNN's did not run (dense_order)
        sections.insert(1, ("natten", ours, ["sdpa_flash"]))
    return BenchConfig("natten", device, sections, budget_s=210.0 if gpu else 120.0,
                       input_sets=3 if gpu else 2, cpu_reps=5,
                       dense_order=("sdpa_cudnn", "sdpa_flash", "sdpa"))


def _rows_oracle(pat, q, k, v, do, rows, scale):
    """float64 output and dQ of query ``rows`` (all heads), from every key: [B, H, R, D]."""
    import torch  # noqa: PLC0415

    n = q.shape[2]
    allowed = pat.token_mask(0, rows[:, None], np.arange(n)[None, :], n)
    allowed = torch.from_numpy(allowed).to(q.device)
    idx = torch.from_numpy(rows).to(q.device)
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    q64, do64 = q64[:, :, idx], do.double()[:, :, idx]
    s = (q64 @ k64.transpose(-1, -2)) * scale
    prob = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    out = prob @ v64
    dp = do64 @ v64.transpose(-1, -2)
    ds = prob * (dp - (prob * dp).sum(-1, keepdim=True))
    return out, (ds @ k64) * scale


def _ok(got, want, dtype, grad=False) -> tuple[float, float, bool]:
    """max |got - want|, its bound (atol + rtol |want|, the test suite's rule) and pass."""
    atol = ATOL[dtype] * (2 if grad else 1)
    err = (got.double() - want.double()).abs()
    bound = atol + atol / 10 * want.double().abs()
    return float(err.max()), atol, bool((err <= bound).all())


def check(layout, sets, case, rec) -> None:
    """Correctness of our arm before it is timed (see the module docstring); records
    ``rec["checks"]`` and raises RuntimeError if any comparison fails."""
    import torch  # noqa: PLC0415

    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    s = parse(case["pattern"])
    n, dtype, d = case["N"], case["dtype"], case["D"]
    q, k, v, do = (x.detach() for x in sets[0])
    scale = d ** -0.5
    checks = {}

    def fwd_bwd(lay, perm=None, inv=None):
        xs = [x if perm is None else x[:, :, perm] for x in (q, k, v)]
        xs = [x.clone().requires_grad_(True) for x in xs]
        out = sparse_attention(*xs, lay)
        out.backward(do if perm is None else do[:, :, perm])
        res = [out.detach()] + [x.grad for x in xs]
        return res if inv is None else [r[:, :, inv] for r in res]

    rm_pattern = P.neighborhood(s["grid"], s["kernel"], s["dilation"], s["causal"])
    if s["tile"] is None:
        got = fwd_bwd(layout)
    else:  # permute in, attend in tiled order, un-permute: row-major attention again
        perm, inv = (torch.from_numpy(a).to(q.device) for a in grid_tiling(s["grid"], s["tile"]))
        got = fwd_bwd(layout, perm, inv)
        want = fwd_bwd(make_layout(rm_pattern, n, case["H"], case["block"]))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            err, atol, ok = _ok(a, b, dtype, grad=name != "out")
            checks[f"tiled_vs_row_major_{name}"] = {"max_abs": err, "atol": atol, "ok": ok}
    rows = np.unique(np.linspace(0, n - 1, CHECK_ROWS).round().astype(np.int64))
    out64, dq64 = _rows_oracle(rm_pattern, q, k, v, do, rows, scale)
    idx = torch.from_numpy(rows).to(q.device)
    for name, a, b in (("out", got[0], out64), ("dq", got[1], dq64)):
        err, atol, ok = _ok(a[:, :, idx], b, dtype, grad=name != "out")
        checks[f"oracle_rows_{name}"] = {"max_abs": err, "atol": atol, "ok": ok,
                                         "rows": rows.tolist()}
    rec["checks"] = checks
    bad = {k: v for k, v in checks.items() if not v["ok"]}
    if bad:
        raise RuntimeError(f"neighbourhood check failed before timing: {bad}")


def targets(result: dict) -> list:
    """Issue #32's targets, one row per (case, arm): N0 agreement of Flex and JAX with ours,
    N1 forward and N2 backward speed-up over dense, N3 backward / forward time, N4 JAX / torch
    time (same wall-clock loops)."""
    from sparsetp.bench.attention import _target  # noqa: PLC0415

    gpu = result.get("device_kind") == "cuda"
    wanted = {spec(grid, kernel): fwd for _, grid, kernel, _, fwd in GPU_CASES + CPU_CASES}
    out = []
    for r in result["records"]:
        if r.get("section") != "natten" or "fwd_ms" not in r or r["impl"] in (
                "sdpa_cudnn", "sdpa", "sdpa_flash"):
            continue
        s = parse(r["pattern"])
        want = wanted.get(spec(s["grid"], s["kernel"]))
        where = f"{r['impl']}, {r['pattern']}, block {r['block']}"
        if "max_abs_diff_vs_sparsetp" in r:
            atol = ATOL[r["dtype"]]
            out.append(_target("N0", f"max |out - ours|, {where}", r["max_abs_diff_vs_sparsetp"],
                               atol, "<=", "abs", True, "same inputs, forward output"))
        sp = r.get("speedup_vs_dense") or {}
        if want is not None:
            out.append(_target("N1", f"fwd speed-up vs dense, {where}", sp.get("fwd"), want,
                               ">=", "x (dense_ms / ms)", gpu, f"dense: {r.get('dense_impl')}"))
            out.append(_target("N2", f"bwd speed-up vs dense, {where}", sp.get("bwd"),
                               round(BWD_FRACTION * want, 3), ">=", "x (dense_ms / ms)", gpu,
                               f"{BWD_FRACTION:g} x the forward's target"))
        out.append(_target("N3", f"bwd / fwd time, {where}", r.get("bwd_over_fwd"),
                           MAX_BWD_OVER_FWD, "<=", "ratio", gpu))
        for m in ("fwd", "fwd_bwd"):
            if f"jax_over_torch_{m}" in r:
                out.append(_target("N4", f"JAX / torch {m}, {where}", r[f"jax_over_torch_{m}"],
                                   MAX_JAX_OVER_TORCH, "<=", "x (same wall-clock loops)", gpu))
    return out


def summary(result: dict) -> str:
    """One line per timed record (speed-ups over dense and Flex, bwd / fwd, TFLOP/s on the
    pairs the pattern allows, JAX / torch), then the target rows."""
    def f(x, nd=2):
        return "-" if x is None else f"{x:.{nd}f}"

    def pair(d, a="fwd", b="bwd", nd=2):
        return f"{f((d or {}).get(a), nd)}/{f((d or {}).get(b), nd)}"

    rows = [f"{'impl':12s} {'pattern':40s} {'bs':>4s} {'fwd ms':>8s} {'bwd ms':>8s} "
            f"{'x dense f/b':>12s} {'x flex f/b':>11s} {'bwd/fwd':>7s} {'true TF/s f/b':>14s} "
            f"{'jax/torch f/fb':>14s}"]
    for r in result["records"]:
        if "fwd_ms" not in r:
            continue
        jt = {"fwd": r.get("jax_over_torch_fwd"), "fwd_bwd": r.get("jax_over_torch_fwd_bwd")}
        tf = {"fwd": r.get("true_fwd_tflops"), "bwd": r.get("true_bwd_tflops")}
        rows.append(f"{r['impl']:12s} {r['pattern']:40s} {r['block']:4d} {r['fwd_ms']:8.3f} "
                    f"{r['bwd_ms']:8.3f} {pair(r.get('speedup_vs_dense')):>12s} "
                    f"{pair(r.get('speedup_vs_flex')):>11s} {f(r.get('bwd_over_fwd')):>7s} "
                    f"{pair(tf, nd=1):>14s} {pair(jt, 'fwd', 'fwd_bwd'):>14s}")
    for t in result.get("targets", []):
        rows.append(f"target {t['id']}: {t['name']}: {f(t['value'], 3)} {t['op']} "
                    f"{t['threshold']} -> {t['status']}")
    return "\n".join(rows)
