"""The ``frontier`` preset of ``python -m sparsetp.bench attention``: issue #34's table.

Ours against the strongest peers on one Hopper GPU, bf16, B=1, H=16, D=128, layout block 128,
N = 8192 and 32768: causal, window 1024, BigBird, strided causal and a per-head mix.

=================  ==========================================================================
``fa4``            FlashAttention-4 (``flash_attn.cute.flash_attn_func``, CuTe DSL) on its own
                   ``[B, N, H, D]`` layout: ``causal=True``, ``window_size`` for windows, and its
                   block-sparse path (``block_sparse_tensors`` from a FlexAttention BlockMask
                   of our layout) for the rest, with a CuTe causal ``mask_mod`` on the partial
                   tiles where they are causal diagonal tiles (:func:`fa4_plan`). Skipped, with
                   the reason, where ``flash_attn.cute`` is not importable
                   (``../shared/peers/fa4.sh`` installs it on the GPU machine) or a layout's
                   partial tiles follow another rule.
``cudnn_causal``   dense SDPA, ``sdpa_kernel(CUDNN_ATTENTION)``, ``is_causal=True`` (causal only)
=================  ==========================================================================

Ours, FA4 and cuDNN run in interleaved rounds (their ratios compare readings taken side by
side); then JAX (``sparsetp_jax``, with torch re-timed in the same wall-clock loops); Flex
(``flex``) last, since its compiles take 5-48 s per mask. A bf16 GEMM (8192^3) measured in the
same run is the physical anchor: :func:`summary` reports every TFLOP/s (on our layout's
computed blocks; ``cudnn_causal``'s on the ``N(N+1)/2`` causal pairs) as a fraction of it.
Before any FA4 timing, its output on the same inputs is compared with ours
(``max_abs_diff_vs_sparsetp``); a difference past :data:`FA4_ATOL` is a recorded error.

Targets (:func:`targets`): F1 causal and window, forward and backward >= 1.0x FA4; F2 BigBird,
strided causal and the per-head mix >= 1.25x FA4's block-sparse path and >= 1.25x Flex (the
mix has partial tiles that are not causal diagonal ones, so FA4 skips it and its FA4 rows stay
"not measured"); F3 JAX / torch <= 1.05 (same wall-clock loops), forward and forward + backward.

    python -m sparsetp.bench attention --preset=frontier --out_dir=/tmp/frontier      # GPU
    python -m sparsetp.bench attention --preset=frontier --device=cpu --out_dir=/tmp/f  # smoke
"""

from __future__ import annotations

import functools

import numpy as np

PATTERNS = ("causal", "window:1024", "bigbird", "strided_causal", "per_head_mix")
DENSE_LIKE = ("causal", "window")  # bench_pattern kinds FA4 runs natively: target F1
GPU_NS = (8192, 32768)
GPU_SHAPE = dict(h=16, d=128, dtype="bfloat16", block=128)
CPU_NS = (256,)
CPU_SHAPE = dict(h=2, d=32, dtype="float32", block=64)
FA4_BLOCK = 128  # FA4's Hopper tiles: its block-sparse tables are per 128 x 128 tile
# An output is a weighted mean of unit-normal values (|o| < 4), where a bf16 ulp is at most
# 2^-6: a rounding or two apart passes; a wrongly masked tile moves outputs by O(0.1) and fails.
FA4_ATOL = 0.05
GEMM_N = 8192
MIN_OVER_FA4_DENSE, MIN_OVER_SPARSE, MAX_JAX_OVER_TORCH = 1.0, 1.25, 1.05


def preset_config(device: str):
    """Ours, FA4 and cuDNN causal in 3 interleaved rounds, then JAX, then Flex (a budget
    overrun loses the tail). About 5 minutes on one H200 with FA4's and Flex's compiles.

    >>> cfg = preset_config("cpu")
    >>> [(name, impls) for name, _, impls in cfg.sections]  # doctest: +NORMALIZE_WHITESPACE
    [('frontier', ['sparsetp', 'fa4']), ('frontier', ['cudnn_causal']),
     ('frontier_jax', ['sparsetp_jax']), ('frontier_flex', ['flex'])]
    """
    from sparsetp.bench.attention import BenchConfig, _case  # noqa: PLC0415

    gpu = device == "cuda"
    ns, shape = (GPU_NS, GPU_SHAPE) if gpu else (CPU_NS, CPU_SHAPE)
    cases = [_case(p, n, **shape) for n in ns for p in PATTERNS]
    causal = [c for c in cases if c["pattern"] == "causal"]
    sections = [("frontier", cases, ["sparsetp", "fa4"]), ("frontier", causal, ["cudnn_causal"]),
                ("frontier_jax", cases, ["sparsetp_jax"]), ("frontier_flex", cases, ["flex"])]
    return BenchConfig("frontier", device, sections, budget_s=480.0 if gpu else 120.0,
                       input_sets=3 if gpu else 2, rounds={"frontier": 3 if gpu else 1},
                       gemm_anchor=gpu)


def fa4_plan(layout, bp) -> dict:
    """How FA4 runs ``layout`` (of the bench pattern ``bp``): ``{"mode": "causal"}``,
    ``{"mode": "window", "window_size": (left, right)}`` or ``{"mode": "block_sparse",
    "mask_mod": None | "causal"}``. Raises ValueError with the reason where it cannot.

    >>> from sparsetp.bench.attention import bench_pattern
    >>> from sparsetp.core import make_layout
    >>> bp = bench_pattern("window:1024", 8192, 128)
    >>> fa4_plan(make_layout(bp.pattern, 8192, 1, 128), bp)
    {'mode': 'window', 'window_size': (511, 511)}
    """
    if layout.block_size != FA4_BLOCK:
        raise ValueError(f"FA4's block-sparse tables are per {FA4_BLOCK}-token tile; this layout "
                         f"has block {layout.block_size}")
    if bp.kind == "causal":
        return {"mode": "causal"}
    if bp.kind == "window":
        return {"mode": "window", "window_size": (int(bp.pattern.left), int(bp.pattern.right))}
    partial = int(np.asarray(layout.q_partial).sum())
    if partial == 0:
        return {"mode": "block_sparse", "mask_mod": None}
    if _partial_tiles_are_causal(layout):
        return {"mode": "block_sparse", "mask_mod": "causal"}
    raise ValueError(f"{partial} partial tiles under the {bp.kind!r} rule: FA4's block-sparse "
                     f"path needs that rule as a CuTe mask_mod, written here for causal "
                     f"diagonal tiles only")


def _partial_tiles_are_causal(layout) -> bool:
    """Whether every partial tile of ``layout`` is a diagonal tile whose mask is ``q >= kv``
    (on its valid tokens): then FA4's causal mask_mod on the partial tiles, full tiles
    unmasked, is the layout's mask. Decided from the layout, not from the pattern's name: the
    same pattern at another pattern block has partial tiles off the diagonal."""
    if layout.kv_len != layout.seq_len:
        return False
    bs, part = layout.block_size, np.asarray(layout.q_partial)
    w = max(1, int(part.max(initial=0)))
    listed = np.arange(w) < part[..., None]  # [H, nb, w]: the partial entries (listed first)
    rows = np.broadcast_to(np.arange(part.shape[1])[:, None], listed.shape)[listed]
    if (np.asarray(layout.q_index)[..., :w][listed] != rows).any():
        return False
    ids, first = np.unique(np.asarray(layout.q_mask_id)[..., :w][listed], return_index=True)
    valid = np.minimum(bs, layout.seq_len - rows[first] * bs)[:, None, None]  # per mask
    r = np.arange(bs)
    bits = (np.asarray(layout.masks)[ids][:, :, r // 32] >> (r % 32)) & 1  # [U, bs, bs]
    want = (r[:, None] >= r[None, :]) & (r[:, None] < valid) & (r[None, :] < valid)
    return bool((bits.astype(bool) == want).all())


@functools.cache
def _cute_causal_mask_mod():
    """FA4's mask_mod signature (``flash_attn.cute.mask.call_mask_mod``): keep ``q >= kv``."""
    import cutlass.cute as cute  # noqa: PLC0415

    @cute.jit
    def causal(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return q_idx >= kv_idx

    return causal


def prep_fa4(cfg, case, layout, bp, rec):
    """The ``fa4`` implementation (see the module docstring)."""
    from sparsetp.bench.attention import (  # noqa: PLC0415
        Prepared,
        Skip,
        _Inputs,
        _torch_pair,
        flex_block_mask,
    )

    try:  # a GPU-only implementation: the bench skips it on CPU before this
        from flash_attn.cute import flash_attn_func  # noqa: PLC0415
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: PLC0415
    except ImportError as e:
        raise Skip(f"flash_attn.cute is not importable ({e}); ../shared/peers/fa4.sh installs "
                   f"FlashAttention-4 on the GPU machine") from None
    import torch  # noqa: PLC0415

    try:
        plan = fa4_plan(layout, bp)
    except ValueError as e:
        raise Skip(f"fa4: {e}") from None
    rec["fa4_plan"] = dict(plan)
    kw = {}
    if plan["mode"] == "causal":
        kw["causal"] = True
    elif plan["mode"] == "window":
        kw["window_size"] = plan["window_size"]
    else:
        bm = flex_block_mask(layout, bp, cfg.device)

        def tables(side):  # "kv": key-major lists (forward), "q": query-major (backward)
            return BlockSparseTensorsTorch(
                mask_block_cnt=getattr(bm, f"{side}_num_blocks"),
                mask_block_idx=getattr(bm, f"{side}_indices"),
                full_block_cnt=getattr(bm, f"full_{side}_num_blocks"),
                full_block_idx=getattr(bm, f"full_{side}_indices"),
                block_size=(FA4_BLOCK, FA4_BLOCK))

        kw["block_sparse_tensors"] = tables("kv")
        kw["block_sparse_tensors_bwd"] = tables("q")
        if plan["mask_mod"] == "causal":
            kw["mask_mod"] = _cute_causal_mask_mod()
    # FA4's own layout, [B, N, H, D] contiguous: no transpose inside its timed calls.
    sets = [tuple(t.detach().transpose(1, 2).contiguous().requires_grad_(i < 3)
                  for i, t in enumerate(s))
            for s in _Inputs.get(case, cfg.device, cfg.input_sets)]

    def fn(q, k, v):
        out = flash_attn_func(q, k, v, **kw)
        return out[0] if isinstance(out, tuple) else out

    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    q, k, v, _ = _Inputs.get(case, cfg.device, cfg.input_sets)[0]
    with torch.no_grad():
        ours = sparse_attention(q, k, v, layout).transpose(1, 2)
        diff = float((fn(*sets[0][:3]).float() - ours.float()).abs().max())
    rec["max_abs_diff_vs_sparsetp"] = diff
    if not diff <= FA4_ATOL:  # also NaN
        raise RuntimeError(f"fa4 output differs from ours by {diff:.3g} > {FA4_ATOL} "
                           f"(plan {plan}): not timed")
    f, fb, g = _torch_pair(fn, sets)
    return Prepared(f, fb, g)


def measure_gemm(device: str) -> dict:
    """The physical anchor: a bf16 ``GEMM_N``^3 matmul, median of ``do_bench``."""
    import torch  # noqa: PLC0415
    from triton.testing import do_bench  # noqa: PLC0415

    a = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
    ms = float(do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median"))
    return {"n": GEMM_N, "ms": ms, "tflops": 2 * GEMM_N ** 3 / ms / 1e9}


def _by(result):
    out = {}
    for r in result["records"]:
        if "fwd_ms" in r and r.get("section", "").startswith("frontier"):
            out[(r["impl"], r["pattern"], r["N"])] = r
    return out


def targets(result: dict) -> list:
    """Issue #34's targets (F1-F3) from the records; pass is None where not measured."""
    from sparsetp.bench.attention import _target  # noqa: PLC0415

    gpu = result.get("device_kind") == "cuda"
    by = _by(result)
    out = []
    for n in sorted({k[2] for k in by}):
        for p in PATTERNS:
            ours = by.get(("sparsetp", p, n))
            dense_like = p.split(":")[0] in DENSE_LIKE
            peers = [("fa4", MIN_OVER_FA4_DENSE if dense_like else MIN_OVER_SPARSE)]
            if not dense_like:
                peers.append(("flex", MIN_OVER_SPARSE))
            for peer, thr in peers:
                other = by.get((peer, p, n))
                for m in ("fwd", "bwd"):
                    v = None
                    if ours and other and ours[f"{m}_ms"] > 0:
                        v = other[f"{m}_ms"] / ours[f"{m}_ms"]
                    out.append(_target("F1" if dense_like else "F2",
                                       f"{m} vs {peer}, {p}, N={n}", v, thr, ">=",
                                       f"x ({peer}_ms / sparsetp_ms)", gpu))
            jx = by.get(("sparsetp_jax", p, n))
            for m in ("fwd", "fwd_bwd"):
                out.append(_target("F3", f"JAX / torch {m}, {p}, N={n}",
                                   jx and jx.get(f"jax_over_torch_{m}"), MAX_JAX_OVER_TORCH,
                                   "<=", "x (same wall-clock loops)", gpu))
    return out


def summary(result: dict) -> str:
    """One line per (pattern, N): ms and TFLOP/s of each implementation (forward / backward;
    on its ``flop_elements``: our layout's computed blocks, except ``cudnn_causal``'s causal
    pairs), the TFLOP/s as a fraction of the run's bf16 GEMM, then the targets.

    >>> print(summary({"records": [], "targets": []}))
    bf16 GEMM: not measured
    """
    gemm = (result.get("gemm_anchor") or {}).get("tflops")
    by = _by(result)
    rows = [f"bf16 GEMM {GEMM_N}^3: {gemm:.0f} TFLOP/s" if gemm else "bf16 GEMM: not measured"]
    impls = ("sparsetp", "fa4", "cudnn_causal", "flex", "sparsetp_jax")
    for n in sorted({k[2] for k in by}):
        for p in PATTERNS:
            cells = []
            for impl in impls:
                r = by.get((impl, p, n))
                if r is None:
                    continue
                tf = [r.get("fwd_tflops"), r.get("bwd_tflops")]
                frac = "/".join(f"{x / gemm:.2f}" if x and gemm else "-" for x in tf)
                cells.append(f"{impl} {r['fwd_ms']:.3f}/{r['bwd_ms']:.3f} ms "
                             f"{'/'.join(f'{x:.0f}' if x else '-' for x in tf)} TF/s "
                             f"({frac} of GEMM)")
            if cells:
                rows.append(f"{p} N={n}: " + "; ".join(cells))
    for t in result.get("targets", []):
        v = "-" if t["value"] is None else f"{t['value']:.3f}"
        rows.append(f"target {t['id']}: {t['name']}: {v} {t['op']} {t['threshold']} -> "
                    f"{t['status']}")
    return "\n".join(rows)
