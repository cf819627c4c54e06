"""``python -m sparsetp.bench attention``: time block-sparse attention against its alternatives.

Implementations (``--impls``; each (case, implementation) pair is one job, run in its own
``try``: a failure is recorded in the JSON, never dropped, and the run goes on):

==================  ===========================================================================
``sparsetp``        ``sparsetp.torch.sparse_attention`` (Triton on CUDA; the native CPU path)
``sparsetp_jax``    ``sparsetp.jax.sparse_attention`` under ``jax.jit`` (forward) and
                    ``jax.jit(jax.vjp)`` (forward + backward); jax-triton on GPU
``flex``            ``torch.compile(flex_attention)`` with a BlockMask built from OUR layout's
                    lists (partial tiles -> kv blocks, full tiles -> full kv blocks) and the
                    pattern's *natural* element rule as ``mask_mod`` (``q >= kv`` for causal,
                    ``|q - kv| < w/2`` for windows, ...), as a Flex user would write it
``sdpa_flash``      dense SDPA, ``sdpa_kernel(FLASH_ATTENTION)`` (no mask: the dense baseline)
``sdpa_cudnn``      dense SDPA, ``sdpa_kernel(CUDNN_ATTENTION)``
``sdpa``            dense SDPA, default dispatch (the CPU dense baseline)
``sdpa_causal``     SDPA ``is_causal=True`` (causal pattern only)
``sdpa_mask``       SDPA with the layout's dense boolean ``[1, H, N, N]`` mask
``naive``           ``sparsetp.torch.naive_sparse_attention`` (gather listed tiles, plain torch)
``reference``       ``sparsetp.core.reference`` float64 numpy oracle (CPU, small N only)
``fa4``             FlashAttention-4 (CuTe DSL; causal, window, block-sparse), when importable
                    (``sparsetp/bench/frontier.py``)
``cudnn_causal``    dense causal SDPA through cuDNN (causal pattern only)
==================  ===========================================================================

Timing: on GPU the median of ``triton.testing.do_bench`` (it flushes L2 between calls); JAX on
GPU (whose work runs on its own stream, invisible to do_bench's CUDA events) and everything on
CPU: the median of wall-clock loops synchronised with ``block_until_ready`` /
``torch.cuda.synchronize``. Every timed call takes the next of ``--input_sets`` random input
sets (standard normal, never zeros), so no result is served from a cache.
``bwd_ms = fwd_bwd_ms - fwd_ms`` (forward+backward minus forward, both measured). A section
with rounds (``BenchConfig.rounds``; the targets preset's ``block_sizes``) runs its jobs round
after round and keeps each job's median, so the ratios within it compare readings taken side
by side rather than minutes apart under a different host load.

FLOP convention: ``computed_elements = B * sum over heads of (computed tiles * block^2)``;
forward FLOPs = ``4 * D * computed_elements``, backward = 2.5x that. Dense SDPA counts ``H*N*N``
(``N*(N+1)/2`` per head for ``sdpa_causal``). Ratios: ``speedup_vs_X = X_ms / this_ms`` (> 1:
this implementation is faster).

Presets: ``targets`` (the performance targets, ~150 s on one H200 with compiles), ``sweep``
(speed-up over dense vs N, time vs sparsity), ``seed`` (issue #30's seed regime, below),
``natten`` (issue #32's neighbourhood cases against cuDNN dense and Flex: ``bench/natten.py``),
``frontier`` (issue #34's table: ours against FlashAttention-4, cuDNN and Flex, with a bf16
GEMM as the anchor: ``bench/frontier.py``),
``cpu`` (tiny sizes; what CI runs). Devices
(:func:`resolve_device`): with ``--device=auto`` the ``cpu`` preset runs on CPU tensors and CPU
JAX arrays (the native CPU path) on any machine, the GPU presets on the GPU when there is one;
every record says which (``device_kind``, ``versions.device``, ``jax_device``). Examples::

    python -m sparsetp.bench attention --preset=targets --out_dir=/tmp/bench
    python -m sparsetp.bench attention --preset=cpu --docs=docs/performance.md
    python -m sparsetp.bench attention --from_json=a.json,b.json --docs=docs/performance.md

The ``seed`` preset (issue #30 item 4): N in {512, 1024, 2048, 4096} x target tile density
{0.5, 0.25, 0.1} (sparsity 50/75/90%) x {``fixed_density``, ``strided_density`` (Sparse
Transformer fixed / strided, causal as in the paper), ``window_density`` (non-causal sliding
window), ``random``}, B=1, H=16, D=128, bf16, block 64, against dense SDPA (``sdpa_flash``), with
``sparsetp``, ``sparsetp_jax`` and ``naive`` (148 jobs, ~5-8 min on one GPU, budget 600 s). With
``--device=cpu`` the same grid at H=2, D=64, float32, dense ``sdpa`` (148 jobs, ~4 min on 2
shared cores; the record's ``torch_num_threads`` is also the native path's worker count). Each
density spec picks the parameter whose tile density at (N, block) is nearest the target;
``benchmarks/plot_cpu_gpu.py`` draws a CPU run and a GPU run side by side. The paper's patterns
are O(N sqrt N), so their low targets are not reachable at small N (the records carry the real
``density``). Targets S1 (sparse fwd+bwd >= dense for tile density <= 50%) and S2 (JAX / torch
fwd+bwd within 0.8-1.25x) are judged per (pattern, density, N), on CPU too;
``attention_seed_speedup.png`` plots them::

    python -m sparsetp.bench attention --preset=seed --out_dir=/tmp/seed            # GPU
    python -m sparsetp.bench attention --preset=seed --device=cpu --out_dir=/tmp/seed_cpu

Believe these numbers only if ``tests/torch_attention_test.py`` and
``tests/jax_attention_test.py`` pass (the same kernels against the float64 oracle).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

import numpy as np
from absl import app, flags

from sparsetp import _runtime
from sparsetp.bench import common
from sparsetp.core import make_layout
from sparsetp.core import patterns as P
from sparsetp.core.examples import EXAMPLE_PATTERNS, example_pattern

__all__ = [
    "BenchConfig", "BenchPattern", "bench_pattern", "preset_config", "run", "compute_targets",
    "add_derived", "render_markdown", "write_docs", "plot", "block_mask_tables", "main",
]

IMPLS = ("sparsetp", "sparsetp_jax", "flex", "sdpa_flash", "sdpa_cudnn", "sdpa", "sdpa_causal",
         "sdpa_mask", "naive", "reference", "fa4", "cudnn_causal")
GPU_ONLY = ("flex", "sdpa_flash", "sdpa_cudnn", "fa4", "cudnn_causal")
DENSE_BASELINES = ("sdpa_flash", "sdpa_cudnn", "sdpa")  # first one measured is "dense"
ANCHOR_PATTERNS = ("causal", "window", "bigbird", "strided_causal")
SCHEMA_VERSION = 1

FLAGS = flags.FLAGS


_PRESETS = ["auto", "targets", "sweep", "seed", "natten", "frontier", "cpu", "none"]
# (absl DEFINE_ function, name, default, help[, extra args]): defined by define_flags().
_FLAG_DEFS = [
    (flags.DEFINE_enum, "preset", "auto", "Case set (auto: targets on a GPU, cpu otherwise; "
     "none: only the flags below). With --device=auto, --preset=cpu runs on CPU and the GPU "
     "presets on the GPU (see resolve_device).", _PRESETS),
    (flags.DEFINE_list, "patterns", None, "Override: pattern specs (causal, window[:W], "
     "bigbird[:blk], strided_causal[:blk], random:<density>, window_density:<density>, "
     "fixed[:l], fixed_density:<density>, strided[:l], strided_density:<density> (Sparse "
     "Transformer, causal), dense, or a sparsetp.core.examples name)."),
    (flags.DEFINE_list, "seq_lens", None, "Override: sequence lengths."),
    (flags.DEFINE_list, "head_dims", None, "Override: head dims."),
    (flags.DEFINE_list, "dtypes", None, "Override: dtypes (bfloat16, float16, float32)."),
    (flags.DEFINE_list, "block_sizes", None, "Override: layout block sizes."),
    (flags.DEFINE_list, "impls", None, f"Override: implementations, of {','.join(IMPLS)}."),
    (flags.DEFINE_integer, "batch", None, "Override: batch size B."),
    (flags.DEFINE_integer, "num_heads", None, "Override: heads H."),
    (flags.DEFINE_float, "budget_s", None, "Wall-clock budget (s); jobs past it are recorded "
     "as skipped. Default: the preset's."),
    (flags.DEFINE_integer, "input_sets", None, "Random input sets rotated between timed calls."),
    (flags.DEFINE_bool, "first_call", None, "Measure cold first call and new-pattern first "
     "call."),
    (flags.DEFINE_bool, "fresh_triton_cache", None, "Point TRITON_CACHE_DIR at a new empty "
     "directory so the cold first call really compiles (default: on for GPU presets)."),
    (flags.DEFINE_string, "json_name", "attention.json", "File name of the JSON under "
     "--out_dir."),
    (flags.DEFINE_string, "docs", None, "Also render the results as markdown into this file "
     "(e.g. docs/performance.md; plots are copied next to it)."),
    (flags.DEFINE_list, "from_json", None, "Do not run: render --docs / plots from these JSON "
     "files."),
]


def define_flags() -> None:
    """Define this command's flags (idempotent), when the command runs rather than at import:
    the test suite imports this module next to ``tests/parity_test.py``, whose flags share
    names such as ``--patterns`` and ``--seq_lens``."""
    common.define_flags()
    for define, name, default, help_text, *extra in _FLAG_DEFS:
        if name not in FLAGS:
            if extra:
                define(name, default, *extra, help_text)
            else:
                define(name, default, help_text)



# =========================================================================== configuration
@dataclasses.dataclass
class BenchConfig:
    """What to run. ``sections`` is a list of (section name, cases, impls); a case is a dict
    with pattern, N, B, H, D, dtype, block. ``rounds`` maps a section name to a number of
    interleaved rounds: that section's jobs run round after round (every job once per round,
    in the same order), each record keeps the median of its rounds, and the section measures
    its cases even when an earlier section measured the same case (so its ratios compare
    readings taken side by side)."""

    preset: str
    device: str  # "cuda" | "cpu"
    sections: list
    budget_s: float = 150.0
    input_sets: int = 3
    first_call: bool = False
    first_call_case: dict | None = None
    fresh_triton_cache: bool = False
    cpu_reps: int = 3
    cpu_loop_ms: float = 20.0  # CPU: calls faster than this are repeated within one rep
    gpu_warmup_ms: float = 25.0
    gpu_rep_ms: float = 100.0
    jax_loop_ms: float = 30.0  # each wall-clock rep of a JAX timing runs about this long
    max_mask_bytes: float = 16.0 * 2**30  # sdpa_mask: the bool mask, and SDPA's bias copy
    max_naive_bytes: float = 8.0 * 2**30
    max_interp_tiles: int = 600  # interpreter (CPU) sparsetp: computed tiles per case
    max_reference_n: int = 1024
    out_dir: str = "bench_results"
    json_name: str = "attention.json"
    plots: bool = True
    command: str = ""
    rounds: dict = dataclasses.field(default_factory=dict)
    dense_order: tuple = DENSE_BASELINES  # which measured dense SDPA is "dense" (the first)
    gemm_anchor: bool = False  # GPU: time a bf16 GEMM in the run (result["gemm_anchor"])
    # A torch sparsetp job also times this dense impl's fwd+bwd, alternating with its own,
    # paired_rounds times: the record's paired_speedup_fwd_bwd (median of the per-round
    # ratios) compares readings taken side by side, where the host's load moves between jobs.
    paired_dense: str | None = None
    paired_rounds: int = 3


def _case(pattern, n, *, b=1, h=16, d=128, dtype="bfloat16", block=128) -> dict:
    return {"pattern": pattern, "N": int(n), "B": int(b), "H": int(h), "D": int(d),
            "dtype": dtype, "block": int(block)}


def preset_config(preset: str, device: str) -> BenchConfig:
    """The cases of a preset (before flag overrides)."""
    if preset == "targets":
        main_cases = [_case(p, n) for n in (8192, 32768) for p in ANCHOR_PATTERNS]
        dense = [_case("causal", n) for n in (8192, 32768)]
        # Target 4 compares these three layouts per computed element. At N=8192 their
        # fwd+bwd sits on the host floor (~0.64 ms of host time per autograd fwd+bwd on the
        # H200 host, KERNEL_NOTES.md), which drifts with the host's load over a run: the
        # section times its own block-128 row and interleaves the three in rounds.
        blocks = [_case("window", n, block=bs) for n in (32768, 8192) for bs in (128, 64, 32)]
        jax_cases = [_case(p, 32768) for p in ANCHOR_PATTERNS]
        # Ordered by importance: a budget overrun loses the tail, never the headline numbers.
        sections = [
            ("targets", main_cases, ["sparsetp"]),
            ("targets", dense, ["sdpa_flash", "sdpa_causal"]),
            ("targets", main_cases, ["flex"]),
            ("block_sizes", blocks, ["sparsetp"]),
            ("targets", jax_cases, ["sparsetp_jax"]),
        ]
        return BenchConfig("targets", device, sections, budget_s=150.0, first_call=True,
                           first_call_case=_case("window", 8192), fresh_triton_cache=True,
                           rounds={"block_sizes": 3})
    if preset == "sweep":
        ns = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
        seq = [_case(p, n) for p in ("window", "bigbird", "causal") for n in ns]
        sparsity = [_case(f"random:{d}", 8192) for d in (0.5, 0.25, 0.1, 0.05)]
        sparsity += [_case(f"window_density:{d}", 8192) for d in (0.5, 0.25, 0.1, 0.05)]
        sections = [
            ("seq_sweep", seq, ["sdpa_flash", "sparsetp"]),
            ("sparsity", sparsity, ["sdpa_flash", "sparsetp"]),
            ("seq_sweep", seq, ["flex"]),
            ("sparsity", sparsity, ["flex"]),
            ("seq_sweep", seq, ["sparsetp_jax", "sdpa_cudnn", "sdpa_mask", "naive"]),
        ]
        return BenchConfig("sweep", device, sections, budget_s=300.0)
    if preset == "cpu":
        # Tiny shapes: a smoke test of the tool (CI runs it) on the native CPU path (or the
        # Triton interpreter under SPARSETP_INTERPRET=1), not a performance result; the CPU
        # study is --preset=seed --device=cpu.
        kw = dict(h=1, d=16, dtype="float32", block=32)
        seq = [_case("window:64", n, **kw) for n in (64, 128)]
        sparsity = [_case(f"random:{d}", 128, **kw) for d in (0.5, 0.25)]
        sections = [
            ("seq_sweep", seq, ["sdpa", "sparsetp", "naive", "sdpa_mask", "reference"]),
            ("sparsity", sparsity, ["sdpa", "sparsetp"]),
            ("seq_sweep", [_case("window:64", 128, **kw)], ["sparsetp_jax"]),
        ]
        return BenchConfig("cpu", device, sections, budget_s=120.0, input_sets=2, cpu_reps=2,
                           first_call=True, first_call_case=_case("window:64", 128, **kw),
                           rounds={"sparsity": 2})
    if preset == "seed":
        # Issue #30 item 4. Block 64: at N=512 it gives 8 x 8 tiles, enough for the 50/75/90%
        # sparsity steps to differ (block 128 leaves 4 x 4 tiles: a window or a random row
        # cannot go below 25% density); one block for every N so the lines compare.
        if device == "cuda":
            kw, ns, dense_impl = SEED_SHAPE, SEED_NS, "sdpa_flash"
        else:
            kw, ns, dense_impl = SEED_CPU_SHAPE, SEED_CPU_NS, "sdpa"
        cases = [_case(f"{fam}:{d}", n, **kw) for n in ns for fam in SEED_FAMILIES
                 for d in SEED_DENSITIES]
        # The claims first (dense and torch, then JAX), naive last: a budget overrun loses it.
        sections = [("seed", cases, [dense_impl, "sparsetp"]), ("seed", cases, ["sparsetp_jax"]),
                    ("seed", cases, ["naive"])]
        return BenchConfig("seed", device, sections,
                           budget_s=600.0 if device == "cuda" else 420.0,
                           input_sets=3 if device == "cuda" else 2, paired_dense=dense_impl)
    if preset == "natten":  # issue #32: neighbourhood attention (sparsetp/bench/natten.py)
        from sparsetp.bench import natten  # noqa: PLC0415

        return natten.preset_config(device)
    if preset == "frontier":  # issue #34: against FlashAttention-4 (sparsetp/bench/frontier)
        from sparsetp.bench import frontier  # noqa: PLC0415

        return frontier.preset_config(device)
    if preset == "none":
        return BenchConfig("none", device, [], budget_s=600.0)
    raise ValueError(f"unknown preset {preset!r}")


# The seed preset's grid (issue #30 item 4): pattern families (spec prefixes taking a target
# tile density), target densities (sparsity 50/75/90%), and N per device.
SEED_FAMILIES = ("fixed_density", "strided_density", "window_density", "random")
SEED_DENSITIES = (0.5, 0.25, 0.1)
SEED_NS = (512, 1024, 2048, 4096)
SEED_SHAPE = dict(h=16, d=128, dtype="bfloat16", block=64)
# CPU: the same grid at a shape 2 shared cores time in ~4 minutes (N=4096 alone ~85 s).
SEED_CPU_NS = (512, 1024, 2048, 4096)
SEED_CPU_SHAPE = dict(h=2, d=64, dtype="float32", block=64)


def resolve_device(preset: str, device: str, has_cuda: bool) -> tuple[str, str]:
    """``(preset, device)`` from the ``--preset`` and ``--device`` flags on a machine with or
    without a CUDA GPU (torch's view).

    ``--device=auto``: the ``cpu`` preset runs on CPU (CPU tensors, the native CPU path: what
    CI runs, on a GPU machine too); every other preset on the GPU if there is one, else on CPU.
    ``--preset=auto``: ``targets`` on CUDA, ``cpu`` on CPU. An explicit ``--device`` wins
    (``--preset=cpu --device=cuda`` runs the tiny cases on the GPU); ``--device=cuda`` without a
    GPU is an error.

    >>> resolve_device("cpu", "auto", has_cuda=True)
    ('cpu', 'cpu')
    """
    if device == "cuda" and not has_cuda:
        raise RuntimeError("--device=cuda but torch sees no GPU")
    if device == "auto":
        device = "cpu" if preset == "cpu" or not has_cuda else "cuda"
    if preset == "auto":
        preset = "targets" if device == "cuda" else "cpu"
    return preset, device


def config_from_flags() -> BenchConfig:
    import torch  # noqa: PLC0415

    preset, device = resolve_device(FLAGS.preset, FLAGS.device, torch.cuda.is_available())
    cfg = preset_config(preset, device)
    over = {"pattern": FLAGS.patterns, "N": FLAGS.seq_lens, "D": FLAGS.head_dims,
            "dtype": FLAGS.dtypes, "block": FLAGS.block_sizes,
            "B": [FLAGS.batch] if FLAGS.batch else None,
            "H": [FLAGS.num_heads] if FLAGS.num_heads else None}
    over = {k: v for k, v in over.items() if v}
    if over or FLAGS.impls:
        # Overrides replace the preset's case grid by one grid: the preset's values for every
        # axis not overridden (deduplicated), crossed with the given ones.
        base = [c for _, cases, _ in cfg.sections for c in cases] or [_case("causal", 4096)]
        axes = {}
        for key in ("pattern", "N", "B", "H", "D", "dtype", "block"):
            vals = over.get(key) or list(dict.fromkeys(c[key] for c in base))
            axes[key] = [v if key in ("pattern", "dtype") else int(v) for v in vals]
        cases = [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]
        impls = FLAGS.impls or list(dict.fromkeys(i for _, _, im in cfg.sections for i in im))
        bad = sorted(set(impls) - set(IMPLS))
        if bad:
            raise app.UsageError(f"unknown --impls {bad}; known: {IMPLS}")
        cfg.sections = [("custom", cases, impls)]
    for name in ("budget_s", "input_sets", "first_call", "fresh_triton_cache"):
        if getattr(FLAGS, name) is not None:
            setattr(cfg, name, getattr(FLAGS, name))
    if cfg.first_call and cfg.first_call_case is None:
        cfg.first_call_case = dict(cfg.sections[0][1][0]) if cfg.sections else None
    cfg.out_dir, cfg.json_name, cfg.plots = FLAGS.out_dir, FLAGS.json_name, FLAGS.plots
    return cfg


# =========================================================================== patterns
@dataclasses.dataclass(frozen=True)
class BenchPattern:
    """A benchmark pattern: the sparsetp Pattern and its natural FlexAttention ``mask_mod``.

    ``mask_mod(tables)`` returns the mod; ``tables(layout, device)`` the tensors it reads
    (``None`` when it reads none). ``kind`` names the rule ("bitmask_table" when no natural
    rule is known and the mod reads our layout's mask table instead). ``check(layout, sets,
    case, rec)``, if given, checks our arm's results before it is timed (raises on failure).
    """

    spec: str
    pattern: P.Pattern
    kind: str
    description: str
    make_mask_mod: Callable
    check: Callable | None = None


def _arg(spec: str, default):
    return type(default)(spec.split(":", 1)[1]) if ":" in spec else default


def _band_density(half: int, n: int, bs: int) -> float:
    return make_layout(P.local(half - 1, half - 1), n, 1, bs).density


# Sparse Transformer (Child et al. 2019) patterns, causal as in the paper (autoregressive). The
# paper's "c" (summary tokens per block of the fixed pattern; it used 8, 16 or 32 for l = 128
# or 256) is fixed here, so one parameter, l, moves the density.
FIXED_SUMMARY = 32


def _fixed_pattern(length: int) -> P.Pattern:
    """Sparse Transformer "fixed", causal: ``j <= i and (i // l == j // l or j % l >= l - c)``."""
    return P.fixed(length, min(FIXED_SUMMARY, length)) & P.causal()


def _strided_pattern(stride: int, n: int) -> P.Pattern:
    """Sparse Transformer "strided", causal: ``j <= i and (i - j <= l or (i - j) % l == 0)``.

    The vocabulary has no "every l-th diagonal" pattern; a causal 1-D neighbourhood with
    dilation ``l`` and ``n / l`` neighbours is exactly ``j <= i and (i - j) % l == 0`` when ``l``
    divides ``n`` (every earlier token congruent to ``i`` mod ``l``), so ``l`` must divide ``n``.
    """
    if n % stride:
        raise ValueError(f"strided: the stride {stride} must divide N={n}")
    return P.neighborhood(n, n // stride, stride, causal=True) | P.local(stride, 0)


def _nearest_param(cands, make, want: float, n: int, bs: int) -> int:
    """The candidate whose pattern's tile density at (n, bs) is nearest ``want`` (the smaller
    parameter on a tie)."""
    return min(cands, key=lambda c: (abs(make_layout(make(c), n, 1, bs).density - want), c))


def bench_pattern(spec: str, n: int, bs: int, num_heads: int = 1) -> BenchPattern:
    """The pattern named by ``spec`` at ``n`` tokens and layout block ``bs``.

    >>> bench_pattern("window:1024", 8192, 128).description
    '|i - j| < 512'
    """
    name = spec.split(":", 1)[0]
    if name == "neighborhood":  # neighborhood:<grid>:<kernel>[:...], see sparsetp/bench/natten
        from sparsetp.bench import natten  # noqa: PLC0415

        return natten.bench_pattern(spec, n, bs)
    if name == "causal":
        return BenchPattern(spec, P.causal(), "causal", "j <= i",
                            lambda t: lambda b, h, q, kv: q >= kv)
    if name in ("window", "window_density"):
        if name == "window":
            half = _arg(spec, 1024) // 2
        else:  # the half-width (a multiple of bs) whose tile density is nearest the target
            want = _arg(spec, 0.1)
            cands = range(bs, n + bs, bs)
            half = min(cands, key=lambda w: abs(_band_density(w, n, bs) - want))
        return BenchPattern(spec, P.local(half - 1, half - 1), "window", f"|i - j| < {half}",
                            lambda t, w=half: lambda b, h, q, kv: (q - kv).abs() < w)
    if name == "bigbird":
        blk = _arg(spec, 128)
        rand = P.random_blocks(2, blk, seed=0)

        def bigbird_mod(t, blk=blk):
            def mod(b, h, q, kv):
                qb, kb = q // blk, kv // blk
                return (((qb - kb).abs() <= 1) | (q < blk) | (kv < blk)
                        | t["random"][h, qb, kb])
            return mod

        return BenchPattern(
            spec, P.bigbird(blk, 3, 1, 2, seed=0), "bigbird",
            f"BigBird: 3-block window, 1 global block, 2 random blocks per row ({blk}-token "
            f"blocks)", _with_tables(bigbird_mod, random=rand))
    if name == "strided_causal":
        blk = _arg(spec, 128)
        pat = (P.block_local(blk, 3, 0) | P.strided(16, blk, per_head_offset=True)) & P.causal()

        def strided_mod(t, blk=blk):
            def mod(b, h, q, kv):
                qb, kb = q // blk, kv // blk
                return (q >= kv) & (((qb - kb) <= 3) | ((kb + h) % 16 == 0))
            return mod

        return BenchPattern(spec, pat, "strided_causal",
                            f"causal, 4 local blocks + every 16th key block with per-head "
                            f"offset ({blk}-token blocks)", strided_mod)
    if name in ("fixed", "fixed_density"):
        if name == "fixed":
            length = _arg(spec, 128)
        else:  # the block length l (a multiple of bs) whose tile density is nearest the target
            length = _nearest_param(range(bs, n + bs, bs), _fixed_pattern, _arg(spec, 0.25),
                                    n, bs)
        c = min(FIXED_SUMMARY, length)

        def fixed_mod(t, ln=length, c=c):
            return lambda b, h, q, kv: (q >= kv) & ((q // ln == kv // ln) | (kv % ln >= ln - c))

        return BenchPattern(spec, _fixed_pattern(length), "fixed",
                            f"Sparse Transformer fixed, causal: j <= i and (i // {length} == "
                            f"j // {length} or j % {length} >= {length - c})", fixed_mod)
    if name in ("strided", "strided_density"):
        if name == "strided":
            stride = _arg(spec, 128)
        else:  # the stride l (a divisor of n, >= bs unless n < bs) with the nearest density
            cands = [d for d in range(min(bs, n), n + 1) if n % d == 0]
            stride = _nearest_param(cands, lambda s: _strided_pattern(s, n), _arg(spec, 0.25),
                                    n, bs)

        def strided_st_mod(t, st=stride):
            return lambda b, h, q, kv: (q >= kv) & (((q - kv) <= st) | ((q - kv) % st == 0))

        return BenchPattern(spec, _strided_pattern(stride, n), "strided",
                            f"Sparse Transformer strided, causal: j <= i and (i - j <= {stride} "
                            f"or (i - j) % {stride} == 0)", strided_st_mod)
    if name == "random":
        want = _arg(spec, 0.25)
        per_row = max(1, min(-(-n // bs), round(want * -(-n // bs))))
        rand = P.random_blocks(per_row, bs, seed=0)

        def random_mod(t, bs=bs):
            return lambda b, h, q, kv: t["random"][h, q // bs, kv // bs]

        return BenchPattern(spec, rand, "random",
                            f"{per_row} random key blocks per query block (target density "
                            f"{want})", _with_tables(random_mod, random=rand))
    if name == "dense":
        return BenchPattern(spec, P.dense(), "dense", "all pairs",
                            lambda t: lambda b, h, q, kv: q == q)
    if name in EXAMPLE_PATTERNS:
        return BenchPattern(spec, example_pattern(name, n, bs), "bitmask_table",
                            f"sparsetp.core.examples {name!r}", _bitmask_mask_mod)
    raise ValueError(f"unknown pattern spec {spec!r}")


def _with_tables(factory, **randoms):
    """Attach the random-block tables a mod reads: ``[H, nb, nb]`` bool, built on the device."""
    def make(tables):
        return factory(tables)
    make.randoms = randoms
    return make


def mask_mod_tables(bp: BenchPattern, layout, device) -> dict:
    """The tensors ``bp``'s mask_mod reads, for ``layout`` on ``device``."""
    import torch  # noqa: PLC0415

    out = {}
    for key, rand in getattr(bp.make_mask_mod, "randoms", {}).items():
        tab = np.stack([rand.table(h, layout.seq_len) for h in range(layout.num_heads)])
        out[key] = torch.from_numpy(tab).to(device)
    if bp.kind == "bitmask_table":
        _, _, _, _, mask_id = block_mask_tables(layout)
        out["mask_id"] = torch.from_numpy(mask_id).to(device)
        out["masks"] = torch.from_numpy(np.array(layout.masks)).to(device)
        out["block"] = layout.block_size
    return out


def _bitmask_mask_mod(t):
    """The layout's exact token mask read from its tile table (-1 empty, -2 full, >= 0 a row
    of the bitmask table): used for patterns with no arithmetic rule here."""
    bs, mid, masks = t["block"], t["mask_id"], t["masks"]

    def mod(b, h, q, kv):
        m = mid[h, q // bs, kv // bs]
        word = masks[m.clamp(min=0), q % bs, (kv % bs) // 32]
        return (m == -2) | ((m >= 0) & (((word >> (kv % 32)) & 1) == 1))
    return mod


def block_mask_tables(layout):
    """FlexAttention's block lists from our layout's ELL lists, vectorised.

    Returns ``kv_num, kv_idx, full_num, full_idx`` (``[1, H, nb]`` / ``[1, H, nb, nb]`` int32:
    partial tiles are Flex "kv blocks", full tiles "full kv blocks") and ``mask_id``
    (``[H, nb, nb]``: -1 empty, -2 full, else the partial tile's bitmask row).
    """
    cnt, part = np.asarray(layout.q_count), np.asarray(layout.q_partial)
    w = layout.widest_row  # the ELL width is padded; no row lists more than this (<= nb)
    idx = np.asarray(layout.q_index)[..., :w]
    mid = np.asarray(layout.q_mask_id)[..., :w]
    h, nb, _ = idx.shape
    ar = np.arange(w)
    in_part = ar < part[..., None]
    n_full = cnt - part
    full_src = np.minimum(ar + part[..., None], w - 1)
    full = np.take_along_axis(idx, full_src, -1)
    in_full = ar < n_full[..., None]
    kv_idx = np.zeros((1, h, nb, nb), np.int32)
    full_idx = np.zeros((1, h, nb, nb), np.int32)
    kv_idx[0, :, :, :w] = np.where(in_part, idx, 0)
    full_idx[0, :, :, :w] = np.where(in_full, full, 0)
    mask_id = np.full((h, nb, nb), -1, np.int32)
    hh, ii, kk = np.nonzero(in_part)
    mask_id[hh, ii, idx[hh, ii, kk]] = mid[hh, ii, kk]
    hh, ii, kk = np.nonzero(in_full)
    mask_id[hh, ii, full[hh, ii, kk]] = -2
    return (part[None].astype(np.int32), kv_idx, n_full[None].astype(np.int32), full_idx,
            mask_id)


def allowed_elements(layout) -> int:
    """Exact number of allowed (query, key) pairs over all heads, from the tiles (no N^2)."""
    bs, n, nb = layout.block_size, layout.seq_len, layout.num_blocks
    valid = np.minimum(bs, n - np.arange(nb) * bs).astype(np.int64)
    full = np.asarray(layout.block_mask) == P.FULL
    total = int((full * (valid[:, None] * valid[None, :])[None]).sum())
    masks = np.ascontiguousarray(np.asarray(layout.masks, dtype="<i4"))
    if masks.size:
        pop = np.unpackbits(masks.view(np.uint8).reshape(masks.shape[0], -1), axis=1).sum(1)
        part = np.asarray(layout.q_partial)
        sel = np.arange(layout.q_mask_id.shape[-1]) < part[..., None]
        total += int(pop[np.asarray(layout.q_mask_id)[sel]].sum())
    return total


# =========================================================================== timing
class _Cycle:
    """Hands out the input sets in turn, so consecutive timed calls never reuse one."""

    def __init__(self, sets):
        self.sets, self.i = sets, 0

    def __call__(self):
        s = self.sets[self.i % len(self.sets)]
        self.i += 1
        return s


def _sync(device):
    if device == "cuda":
        import torch  # noqa: PLC0415

        torch.cuda.synchronize()


def _time_wall(fn, reps: int, sync: Callable, loop_ms: float = 0.0) -> float:
    """Median over ``reps`` of the mean time (ms) of a loop of calls lasting about ``loop_ms``
    (one call when 0), after one warm-up call. Calls in a loop are not synchronised one by one
    (asynchronous dispatch overlaps, as in training); ``sync(last_result)`` ends each loop."""
    t0 = time.perf_counter()
    sync(fn())
    est = max(time.perf_counter() - t0, 1e-6) * 1e3
    iters = max(1, min(1000, math.ceil(loop_ms / est))) if loop_ms else 1
    if est * iters < 100:  # cheap: more reps make the median robust to scheduler hiccups
        reps = max(reps, 7)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn()
        sync(r)
        del r
        times.append((time.perf_counter() - t0) * 1e3 / iters)
    return float(statistics.median(times))


def _time_torch(cfg: BenchConfig, fn, grads=None) -> tuple[float, str]:
    if cfg.device == "cuda":
        from triton.testing import do_bench  # noqa: PLC0415

        fn()
        _sync("cuda")
        return float(do_bench(fn, warmup=cfg.gpu_warmup_ms, rep=cfg.gpu_rep_ms,
                              grad_to_none=grads, return_mode="median")), "do_bench median"
    return (_time_wall(fn, cfg.cpu_reps, lambda r: None, cfg.cpu_loop_ms),
            f"wall-clock loops ~{cfg.cpu_loop_ms:g} ms, median of {cfg.cpu_reps}")


# =========================================================================== implementations
class Skip(Exception):  # noqa: N818 - a recorded outcome, not an error
    """Raised by an implementation that cannot run this case; the message is the reason."""


@dataclasses.dataclass
class Prepared:
    fwd: Callable | None
    fwd_bwd: Callable | None
    grads: list | None = None
    flop_elements: int | None = None  # None: the layout's computed elements
    timer: str | None = None  # None: _time_torch
    extra: dict = dataclasses.field(default_factory=dict)


def _torch_dtype(name):
    import torch  # noqa: PLC0415

    return getattr(torch, name)


class _Inputs:
    """Random torch input sets for one case shape (kept while consecutive jobs share it)."""

    key = None
    sets: list = []

    @classmethod
    def get(cls, case, device, n_sets):
        import torch  # noqa: PLC0415

        key = (case["B"], case["H"], case["N"], case["D"], case["dtype"], device, n_sets)
        if cls.key != key:
            cls.sets, cls.key = [], None
            if device == "cuda":
                torch.cuda.empty_cache()
            g = torch.Generator(device=device).manual_seed(1234)
            shape = (case["B"], case["H"], case["N"], case["D"])
            dt = _torch_dtype(case["dtype"])
            for _ in range(n_sets):
                q, k, v, do = (torch.randn(shape, device=device, generator=g).to(dt)
                               for _ in range(4))
                cls.sets.append(tuple(t.requires_grad_(True) for t in (q, k, v)) + (do,))
            cls.key = key
        return cls.sets

    @classmethod
    def clear(cls):
        cls.sets, cls.key = [], None


def _torch_pair(fn, sets):
    """fwd (no autograd graph) and fwd+bwd callables of ``fn(q, k, v)`` over rotating sets."""
    import torch  # noqa: PLC0415

    cyc_f, cyc_b = _Cycle(sets), _Cycle(sets)

    def fwd():
        q, k, v, _ = cyc_f()
        with torch.no_grad():
            return fn(q, k, v)

    def fwd_bwd():
        q, k, v, do = cyc_b()
        fn(q, k, v).backward(do)

    return fwd, fwd_bwd, [t for s in sets for t in s[:3]]


def _prep_sparsetp(cfg, case, layout, bp, rec):
    import torch  # noqa: PLC0415

    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    if (_kernels_kind(cfg) == "interpreter"
            and layout.nnz_blocks * case["B"] > cfg.max_interp_tiles):
        raise Skip(f"interpreter: {layout.nnz_blocks * case['B']} tiles > max_interp_tiles="
                   f"{cfg.max_interp_tiles}")
    from sparsetp.kernels import schedule  # noqa: PLC0415

    # The tile the portable kernels run at (the layout's block, or the same pattern re-laid at
    # another block by schedule.kernel_layout's cost model on CUDA); the sm_90 kernels, where
    # "fwd_kernel" / "bwd_kernel" say they ran, run at 128.
    rec["kernel_block"] = schedule.kernel_layout(
        layout, _kernels_kind(cfg), head_dim=case["D"], dtype=case["dtype"]).block_size
    if _kernels_kind(cfg) == "cuda":
        from sparsetp.backends.torch import native  # noqa: PLC0415

        # Timed calls after the warm-up run the eager path users get: the C++ autograd node
        # (portable and sm_90 kernels alike) once its extension has built ("ready"), else the
        # Python one (the status says why).
        rec["torch_native"] = native.wait()
    sets = _Inputs.get(case, cfg.device, cfg.input_sets)
    if bp.check is not None:
        bp.check(layout, sets, case, rec)
    from sparsetp.torch import backward_kernel, forward_kernel  # noqa: PLC0415

    # Which forward and backward run (the sm_90 Gluon kernels or the portable ones), asked
    # after a first call, which is where a failing fast path would fall back.
    if _kernels_kind(cfg) == "cuda":  # both passes (interpreted, only the forward: cheap)
        q0, k0, v0 = (t.detach().requires_grad_() for t in sets[0][:3])
        sparse_attention(q0, k0, v0, layout).sum().backward()
    else:
        with torch.no_grad():
            sparse_attention(*sets[0][:3], layout)
    rec["fwd_kernel"] = forward_kernel(*sets[0][:3], layout).name
    rec["bwd_kernel"] = backward_kernel(*sets[0][:3], layout).name
    f, fb, g = _torch_pair(lambda q, k, v: sparse_attention(q, k, v, layout), sets)
    return Prepared(f, fb, g)


def _prep_naive(cfg, case, layout, bp, rec):
    from sparsetp.torch import naive_sparse_attention  # noqa: PLC0415

    w = int(np.asarray(layout.q_count).max())
    b, h, n, d, bs = case["B"], case["H"], case["N"], case["D"], case["block"]
    el = np.dtype("float32").itemsize if case["dtype"] == "float32" else 2
    # gathered K and V tiles + float32 scores and probabilities; backward holds them all
    need = b * h * (-(-n // bs)) * bs * w * bs * (2 * d * el / bs + 8)
    if need > cfg.max_naive_bytes:
        raise Skip(f"memory: gathered tiles ~{need / 2**30:.1f} GiB > max_naive_bytes")
    sets = _Inputs.get(case, cfg.device, cfg.input_sets)
    f, fb, g = _torch_pair(lambda q, k, v: naive_sparse_attention(q, k, v, layout), sets)
    rec["naive_row_width_tiles"] = w
    # naive computes W tiles for every query tile row, padded to the widest row
    return Prepared(f, fb, g, flop_elements=b * h * (-(-n // bs)) * w * bs * bs)


def _sdpa(cfg, case, backend: str | None, causal=False, mask=None):
    import torch.nn.functional as F  # noqa: N812, PLC0415

    ctx = None
    if backend is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        ctx = lambda: sdpa_kernel(getattr(SDPBackend, backend))  # noqa: E731
    sets = _Inputs.get(case, cfg.device, cfg.input_sets)

    def fn(q, k, v):
        if ctx is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        with ctx():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    f, fb, g = _torch_pair(fn, sets)
    b, h, n = case["B"], case["H"], case["N"]
    return Prepared(f, fb, g, flop_elements=b * h * (n * (n + 1) // 2 if causal else n * n))


def _prep_sdpa_flash(cfg, case, layout, bp, rec):
    return _sdpa(cfg, case, "FLASH_ATTENTION")


def _prep_sdpa_cudnn(cfg, case, layout, bp, rec):
    return _sdpa(cfg, case, "CUDNN_ATTENTION")


def _prep_sdpa(cfg, case, layout, bp, rec):
    return _sdpa(cfg, case, None)


def _causal_sdpa(cfg, case, bp, impl: str, backend: str | None):
    if bp.kind != "causal":
        raise Skip(f"{impl} only for the causal pattern")
    return _sdpa(cfg, case, backend, causal=True)


def _prep_sdpa_causal(cfg, case, layout, bp, rec):
    return _causal_sdpa(cfg, case, bp, "sdpa_causal", None)


def _prep_cudnn_causal(cfg, case, layout, bp, rec):
    return _causal_sdpa(cfg, case, bp, "cudnn_causal", "CUDNN_ATTENTION")


def dense_mask_torch(layout, device):
    """The layout's bool ``[H, N, N]`` mask expanded on ``device`` from the tiles (no numpy
    N^2 array: at N = 16384 that would be seconds of host work and a 4 GiB copy)."""
    import torch  # noqa: PLC0415

    h, nb, bs, n = layout.num_heads, layout.num_blocks, layout.block_size, layout.seq_len
    bm = torch.from_numpy(np.array(layout.block_mask)).to(device)
    out = (bm == P.FULL)[:, :, None, :, None].expand(h, nb, bs, nb, bs).contiguous()
    part = np.asarray(layout.q_partial)
    sel = np.arange(layout.q_index.shape[-1]) < part[..., None]
    hh, ii, kk = np.nonzero(sel)
    if hh.size:
        jj = np.asarray(layout.q_index)[hh, ii, kk]
        mid = torch.from_numpy(np.asarray(layout.q_mask_id)[hh, ii, kk].astype(np.int64))
        words = torch.from_numpy(np.array(layout.masks)).to(device)[mid.to(device)]  # [P,bs,w]
        col = torch.arange(bs, device=device)
        bits = (words[:, :, col // 32] >> (col % 32)) & 1  # [P, bs(q), bs(k)]
        t = lambda a: torch.from_numpy(a.astype(np.int64)).to(device)  # noqa: E731
        out.permute(0, 1, 3, 2, 4)[t(hh), t(ii), t(jj)] = bits.bool()
    return out.reshape(h, nb * bs, nb * bs)[:, :n, :n]


def _prep_sdpa_mask(cfg, case, layout, bp, rec):
    h, n = case["H"], case["N"]
    need = h * n * n * (1 + 2)  # the bool mask and SDPA's additive low-precision bias
    if need > cfg.max_mask_bytes:
        raise Skip(f"memory: dense mask + bias ~{need / 2**30:.1f} GiB > max_mask_bytes")
    t0 = time.perf_counter()
    mask = dense_mask_torch(layout, cfg.device)[None]
    rec["mask_build_s"] = time.perf_counter() - t0
    return _sdpa(cfg, case, None, mask=mask)


def _prep_reference(cfg, case, layout, bp, rec):
    from sparsetp.core import reference  # noqa: PLC0415

    if cfg.device != "cpu" or case["N"] > cfg.max_reference_n:
        raise Skip(f"float64 numpy oracle: CPU only, N <= {cfg.max_reference_n}")
    rng = np.random.default_rng(0)
    shape = (case["B"], case["H"], case["N"], case["D"])
    sets = [tuple(rng.standard_normal(shape) for _ in range(4)) for _ in range(cfg.input_sets)]
    cyc_f, cyc_b = _Cycle(sets), _Cycle(sets)

    def fwd():
        q, k, v, _ = cyc_f()
        return reference.attention(q, k, v, layout)

    def fwd_bwd():
        q, k, v, do = cyc_b()
        reference.attention(q, k, v, layout)
        return reference.attention_grad(q, k, v, layout, do)

    b, h, n = case["B"], case["H"], case["N"]
    return Prepared(fwd, fwd_bwd, timer="wall", flop_elements=b * h * n * n,
                    extra={"note": "float64 numpy, dense N x N per head"})


_FLEX: dict = {}


def _flex_fn():
    """One ``torch.compile``'d flex_attention for the whole run (static shapes: a new N or
    mask_mod recompiles, which is what a Flex user pays too)."""
    if "fn" not in _FLEX:
        import torch  # noqa: PLC0415
        import torch._dynamo  # noqa: PLC0415
        from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

        # One compiled function serves every (mask_mod, shape): allow that many recompiles
        # (the knob was renamed cache_size_limit -> recompile_limit across torch versions).
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob,
                        max(getattr(torch._dynamo.config, knob), 256))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        _FLEX["ok_options"] = {}  # (D, dtype) -> kernel_options that compiled last time
    return _FLEX["fn"]


# Flex's default D=128 bf16 config asked for 256 KiB of shared memory on the H200 (limit
# 227 KiB) in the first GPU run; these are tried in order after the default.
_FLEX_FALLBACK_OPTIONS = (None, {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2},
                          {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2},
                          {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1})


def flex_block_mask(layout, bp: BenchPattern, device):
    """FlexAttention BlockMask from OUR layout's lists, with ``bp``'s natural mask_mod."""
    import torch  # noqa: PLC0415
    from torch.nn.attention.flex_attention import BlockMask  # noqa: PLC0415

    kv_num, kv_idx, full_num, full_idx, _ = block_mask_tables(layout)
    mod = bp.make_mask_mod(mask_mod_tables(bp, layout, device))
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    n = layout.seq_len
    return BlockMask.from_kv_blocks(t(kv_num), t(kv_idx), t(full_num), t(full_idx),
                                    BLOCK_SIZE=layout.block_size, mask_mod=mod,
                                    seq_lengths=(n, n))


def _prep_flex(cfg, case, layout, bp, rec):
    import torch  # noqa: PLC0415

    if cfg.device != "cuda":
        raise Skip("flex is timed compiled on a GPU only")
    try:
        import torch.nn.attention.flex_attention  # noqa: F401, PLC0415
    except ImportError as e:
        raise Skip(f"this torch has no FlexAttention: {e}") from None
    flex = _flex_fn()
    t0 = time.perf_counter()
    bm = flex_block_mask(layout, bp, cfg.device)
    rec["block_mask_build_s"] = time.perf_counter() - t0
    rec["mask_mod"] = bp.kind
    sets = _Inputs.get(case, cfg.device, cfg.input_sets)
    key = (case["D"], case["dtype"])
    known = _FLEX["ok_options"].get(key, "unknown")
    order = list(_FLEX_FALLBACK_OPTIONS)
    if known != "unknown":  # start from what compiled before: a failed compile costs seconds
        order.remove(known)
        order.insert(0, known)
        rec["kernel_options_from_earlier_case"] = True
    failures = []
    t0 = time.perf_counter()
    for opts in order:
        fn = lambda q, k, v, o=opts: flex(q, k, v, block_mask=bm, kernel_options=o)  # noqa: E731
        f, fb, g = _torch_pair(fn, sets)
        try:
            f()
            fb()
            torch.cuda.synchronize()
            break
        except Exception as e:  # noqa: BLE001 - try smaller tiles; every failure is recorded
            failures.append({"kernel_options": opts, "error": f"{type(e).__name__}: "
                             f"{str(e)[:300]}"})
    else:
        rec["kernel_option_failures"] = failures
        raise RuntimeError(f"flex: no kernel_options compiled: {failures}")
    rec["compile_s"] = time.perf_counter() - t0
    rec["kernel_options"] = opts
    rec["kernel_option_failures"] = failures
    if known == "unknown" or opts != known:
        _FLEX["ok_options"][key] = opts
    # Same inputs through sparsetp: a wrong mask_mod or block list would show here.
    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    q, k, v, _ = sets[0]
    with torch.no_grad():
        diff = (fn(q, k, v).float() - sparse_attention(q, k, v, layout).float()).abs().max()
    rec["max_abs_diff_vs_sparsetp"] = float(diff)
    return Prepared(f, fb, g)


def _prep_sparsetp_jax(cfg, case, layout, bp, rec):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from sparsetp.jax import layout_arrays, sparse_attention  # noqa: PLC0415

    if (_kernels_kind(cfg) == "interpreter"
            and layout.nnz_blocks * case["B"] > cfg.max_interp_tiles):
        raise Skip(f"interpreter: {layout.nnz_blocks * case['B']} tiles > max_interp_tiles")
    want = "gpu" if cfg.device == "cuda" else "cpu"
    try:  # the run's platform, whatever JAX's default backend is (CPU runs on a GPU machine)
        dev = jax.devices(want)[0]
    except RuntimeError as e:
        raise Skip(f"JAX has no {want} device: {e}") from None
    rec["jax_device"], rec["jax_platform"] = str(dev), dev.platform
    if cfg.device == "cuda":
        from sparsetp.backends.jax import compat  # noqa: PLC0415

        rec["jax_triton"] = compat.jax_triton().__version__  # ImportError -> recorded error
    # Same kernel tiles as the torch launch (schedule.kernel_layout sees the same D and dtype).
    # Every operand committed to ``dev``, so the jitted calls run there.
    lay = jax.device_put(layout_arrays(layout, head_dim=case["D"], dtype=case["dtype"],
                                       static_widths=True), dev)  # one layout per job
    shape = (case["B"], case["H"], case["N"], case["D"])
    dt = jnp.dtype(case["dtype"])
    with jax.default_device(dev):
        keys = jax.random.split(jax.random.PRNGKey(1234), 4 * cfg.input_sets)
        arrs = [jax.device_put(jax.random.normal(kk, shape, jnp.float32).astype(dt), dev)
                for kk in keys]
    sets = [tuple(arrs[4 * i:4 * i + 4]) for i in range(cfg.input_sets)]
    fwd_j = jax.jit(lambda q, k, v, lay: sparse_attention(q, k, v, lay))

    @jax.jit
    def fwd_bwd_j(q, k, v, do, lay):
        out, vjp = jax.vjp(lambda q, k, v: sparse_attention(q, k, v, lay), q, k, v)
        return vjp(do)

    cyc_f, cyc_b = _Cycle(sets), _Cycle(sets)

    def fwd():
        q, k, v, _ = cyc_f()
        return fwd_j(q, k, v, lay)

    def fwd_bwd():
        return fwd_bwd_j(*cyc_b(), lay)

    t0 = time.perf_counter()
    jax.block_until_ready(fwd())
    jax.block_until_ready(fwd_bwd())
    rec["first_calls_s"] = time.perf_counter() - t0  # trace + compile (jit and Triton)
    # The same inputs through torch's sparsetp: a wrong launch or metadata would show here.
    import torch  # noqa: PLC0415

    from sparsetp.torch import sparse_attention as torch_attention  # noqa: PLC0415

    q, k, v, _ = sets[0]
    to_torch = lambda x: torch.from_numpy(np.array(x, np.float32)).to(  # noqa: E731
        cfg.device, _torch_dtype(case["dtype"]))
    with torch.no_grad():
        want = torch_attention(to_torch(q), to_torch(k), to_torch(v), layout)
    got = np.asarray(fwd_j(q, k, v, lay), np.float32)
    rec["max_abs_diff_vs_sparsetp"] = float(np.abs(got - want.float().cpu().numpy()).max())
    from sparsetp.jax import backward_kernel, forward_kernel  # noqa: PLC0415

    # The kernels the jitted calls run (the rule reads only static fields of ``lay``).
    rec["fwd_kernel"] = forward_kernel(q, k, v, lay).name
    rec["bwd_kernel"] = backward_kernel(q, k, v, lay).name
    return Prepared(fwd, fwd_bwd, timer="jax")


def _prep_fa4(cfg, case, layout, bp, rec):
    from sparsetp.bench import frontier  # noqa: PLC0415

    return frontier.prep_fa4(cfg, case, layout, bp, rec)


_PREP = {"sparsetp": _prep_sparsetp, "sparsetp_jax": _prep_sparsetp_jax, "flex": _prep_flex,
         "sdpa_flash": _prep_sdpa_flash, "sdpa_cudnn": _prep_sdpa_cudnn, "sdpa": _prep_sdpa,
         "sdpa_causal": _prep_sdpa_causal, "sdpa_mask": _prep_sdpa_mask, "naive": _prep_naive,
         "reference": _prep_reference, "fa4": _prep_fa4, "cudnn_causal": _prep_cudnn_causal}
# Rough cost of one job on the GPU (compiles dominate): a job starts only if this much of the
# budget is left, so the run ends near its budget instead of one Flex compile past it.
_EXPECTED_S = {"flex": 12.0, "sparsetp_jax": 4.0, "naive": 1.0, "sdpa_mask": 1.0, "fa4": 10.0}
# Dense SDPA does not depend on the pattern: one measurement per shape serves every pattern.
_PATTERN_FREE = ("sdpa_flash", "sdpa_cudnn", "sdpa")


# =========================================================================== running
class _Layouts:
    """Layouts (and their build time) by (pattern spec, N, H, block)."""

    def __init__(self):
        self.cache = {}

    def get(self, case):
        key = (case["pattern"], case["N"], case["H"], case["block"])
        if key not in self.cache:
            t0 = time.perf_counter()
            bp = bench_pattern(case["pattern"], case["N"], case["block"], case["H"])
            layout = make_layout(bp.pattern, case["N"], case["H"], case["block"])
            self.cache[key] = (bp, layout, time.perf_counter() - t0)
        return self.cache[key]


def _layout_fields(case, bp, layout, build_s) -> dict:
    bs, b = case["block"], case["B"]
    computed = layout.nnz_blocks * bs * bs * b
    return {"pattern_description": bp.description, "density": layout.density,
            "computed_blocks": layout.nnz_blocks * b, "computed_elements": computed,
            "allowed_elements": allowed_elements(layout) * b, "layout_build_s": build_s}


def _run_job(cfg, section, case, impl, layouts, torch_wall_for_jax) -> dict:
    rec = {"section": section, "impl": impl, **case, "status": "ok"}
    bp, layout, build_s = layouts.get(case)
    if impl in _PATTERN_FREE:  # dense: one measurement per shape, whatever the pattern
        nb, bs = layout.num_blocks, case["block"]
        tiles = case["B"] * case["H"] * nb * nb
        rec.update(pattern="dense", pattern_description="all pairs (no mask)", density=1.0,
                   computed_blocks=tiles, computed_elements=tiles * bs * bs,
                   allowed_elements=case["B"] * case["H"] * case["N"] ** 2)
    else:
        rec.update(_layout_fields(case, bp, layout, build_s))
    if impl in GPU_ONLY and cfg.device != "cuda":
        raise Skip(f"{impl} needs a GPU")
    prep = _PREP[impl](cfg, case, layout, bp, rec)
    rec.update(prep.extra)
    if prep.timer == "jax":
        import jax  # noqa: PLC0415

        loop = cfg.jax_loop_ms if cfg.device == "cuda" else cfg.cpu_loop_ms
        reps = 5 if cfg.device == "cuda" else cfg.cpu_reps
        rec["timer"] = f"wall-clock loops ~{loop:g} ms, median of {reps}"
        if not torch_wall_for_jax:
            rec["fwd_ms"] = _time_wall(prep.fwd, reps, jax.block_until_ready, loop)
            rec["fwd_bwd_ms"] = _time_wall(prep.fwd_bwd, reps, jax.block_until_ready, loop)
        else:
            # Target 6 / F3 compare launches timed the same way: torch in the same wall-clock
            # loops, the two loops alternating round by round (the GPU's speed drifts by more
            # than the 5% judged between loops minutes apart); the ratio is the median of the
            # rounds' ratios.
            rec["timer"] += ", JAX and torch loops alternating"
            rec.update(_paired_jax_torch(cfg, case, layout, prep, loop, reps))
            if cfg.paired_dense:  # eager torch's dense attention, a one-node step, a graph
                extra = {
                    "dense": lambda: _wall_fwd_bwd(
                        cfg, _PREP[cfg.paired_dense](cfg, case, layout, bp, {}), loop, reps),
                    "floor": lambda: _wall_fwd_bwd(cfg, _torch_floor(cfg, case), loop, reps),
                    "graphed": lambda: _graphed_wall(cfg, case, layout, loop, reps)}
                for name, measure in extra.items():
                    _informative(rec, f"torch_{name}_wall_fwd_bwd_ms", measure)
    elif prep.timer == "wall":
        rec["fwd_ms"] = _time_wall(prep.fwd, cfg.cpu_reps, lambda r: None, cfg.cpu_loop_ms)
        rec["fwd_bwd_ms"] = _time_wall(prep.fwd_bwd, cfg.cpu_reps, lambda r: None,
                                       cfg.cpu_loop_ms)
        rec["timer"] = f"wall-clock loops ~{cfg.cpu_loop_ms:g} ms, median of {cfg.cpu_reps}"
    else:
        rec["fwd_ms"], rec["timer"] = _time_torch(cfg, prep.fwd)
        rec["fwd_bwd_ms"], _ = _time_torch(cfg, prep.fwd_bwd, prep.grads)
        if cfg.paired_dense and impl == "sparsetp":
            _informative(rec, "paired", lambda: rec.update(
                _paired_dense(cfg, case, layout, bp, prep)))
    if prep.flop_elements is not None:
        rec["flop_elements"] = int(prep.flop_elements)
    else:
        rec["flop_elements"] = rec["computed_elements"]
    return rec


def _informative(rec: dict, key: str, measure: Callable) -> None:
    """``rec[key] = measure()``, or ``rec[key + "_error"]`` with the exception's text: a failed
    side measurement must not lose the record's own readings (its target then says which
    reading it used)."""
    try:
        value = measure()
    except Exception as e:  # noqa: BLE001 - recorded in the record, never swallowed silently
        rec[f"{key}_error"] = f"{type(e).__name__}: {e}"[:500]
        return
    if value is not None:
        rec[key] = value


def _paired_dense(cfg, case, layout, bp, prep) -> dict:
    """``cfg.paired_rounds`` rounds of (dense fwd+bwd, this job's fwd+bwd), each timed as the
    job's own readings are: the readings and the median of the per-round ratios."""
    dense = _PREP[cfg.paired_dense](cfg, case, layout, bp, {})
    d_ms, s_ms = [], []
    for _ in range(cfg.paired_rounds):
        d_ms.append(_time_torch(cfg, dense.fwd_bwd, dense.grads)[0])
        s_ms.append(_time_torch(cfg, prep.fwd_bwd, prep.grads)[0])
    ratios = [d / s for d, s in zip(d_ms, s_ms, strict=True)]
    return {"paired_dense_impl": cfg.paired_dense, "paired_dense_fwd_bwd_ms": d_ms,
            "paired_fwd_bwd_ms": s_ms, "paired_speedup_fwd_bwd": float(np.median(ratios))}


def _paired_jax_torch(cfg, case, layout, prep: Prepared, loop_ms, reps) -> dict:
    """JAX's (``prep``) and torch's forward and forward + backward in wall-clock loops, one
    loop of each in turn for ``reps`` rounds: medians of each, and the median of the rounds'
    JAX / torch ratios."""
    import jax  # noqa: PLC0415

    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    sets = _Inputs.get(case, cfg.device, cfg.input_sets)
    f, fb, g = _torch_pair(lambda q, k, v: sparse_attention(q, k, v, layout), sets)
    torch_prep = Prepared(f, fb, g)
    out = {}
    for key, jax_fn, torch_time in (
            ("fwd", prep.fwd, lambda: _time_wall(f, 1, lambda r: _sync(cfg.device), loop_ms)),
            ("fwd_bwd", prep.fwd_bwd, lambda: _wall_fwd_bwd(cfg, torch_prep, loop_ms, 1))):
        jax_ms, torch_ms = [], []
        for _ in range(reps):
            jax_ms.append(_time_wall(jax_fn, 1, jax.block_until_ready, loop_ms))
            torch_ms.append(torch_time())
        out[f"{key}_ms"] = float(statistics.median(jax_ms))
        out[f"torch_wall_{key}_ms"] = float(statistics.median(torch_ms))
        out[f"jax_over_torch_{key}"] = float(statistics.median(
            a / b for a, b in zip(jax_ms, torch_ms, strict=True)))
    return out


def _torch_floor(cfg, case) -> Prepared:
    """A reference for eager torch's host cost per attention-shaped step: ``addcmul(q, k, v)``
    forward and backward, one autograd node over the same three leaves with only elementwise
    kernels, so its wall time is almost all host work (the autograd engine and ATen's
    launches). Not a strict lower bound: its op mix is not the attention's."""
    import torch  # noqa: PLC0415

    f, fb, g = _torch_pair(torch.addcmul, _Inputs.get(case, cfg.device, cfg.input_sets))
    return Prepared(f, fb, g)


def _graphed_wall(cfg, case, layout, loop_ms, reps) -> float:
    """Torch's fwd+bwd of the attention captured whole in one CUDA graph (the first input set,
    static), replayed in wall-clock loops: the step with eager torch's host work taken out."""
    import torch  # noqa: PLC0415

    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    q, k, v, do = _Inputs.get(case, cfg.device, cfg.input_sets)[0]

    def step():
        for t in (q, k, v):
            t.grad = None
        sparse_attention(q, k, v, layout).backward(do)

    graph = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture asks
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: JAX's runtime shares the process; its threads' CUDA calls must not
        # invalidate (or be refused by) this thread's capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        return _time_wall(graph.replay, reps, lambda r: _sync(cfg.device), loop_ms)
    finally:
        for t in (q, k, v):
            t.grad = None  # the graph's pool holds these; later arms start clean
        del graph


def _wall_fwd_bwd(cfg, prep: Prepared, loop_ms, reps) -> float:
    """``prep``'s fwd+bwd in wall-clock loops, its leaves' gradients cleared after each call."""

    def fb_clear():
        prep.fwd_bwd()
        for t in prep.grads:
            t.grad = None

    return _time_wall(fb_clear, reps, lambda r: _sync(cfg.device), loop_ms)


def torch_first_backward(device) -> None:
    """One trivial autograd backward with an explicit gradient on ``device``. Torch's first
    such backward imports its symbolic-shapes module and sympy (``torch.autograd._make_grads``),
    2.2-3.1 s on the device tool's hosts (``benchmarks/KERNEL_NOTES.md``): once per
    process and the same for every attention implementation. Cold-start timings run this first
    and time it apart, so that they count compiles, not that import."""
    import torch  # noqa: PLC0415

    x = torch.ones(4, device=device, requires_grad=True)
    (x * 2).backward(torch.ones(4, device=device))


def _first_call(cfg, case) -> dict:
    """Target 5: the cold first call of a shape (compiles), and the first call of a new
    pattern with the same shapes (must not compile: metadata are kernel operands).

    Before the cold calls, :func:`torch_first_backward` runs and is timed on its own
    (``torch_first_backward_s``); without it ``cold_bwd_s`` would count torch's one-time import
    as the backward's compile time (older recorded results do)."""
    import torch  # noqa: PLC0415

    from sparsetp.torch import sparse_attention  # noqa: PLC0415

    rec = {"section": "first_call", "impl": "sparsetp", **case, "status": "ok"}
    dev = cfg.device
    sets = _Inputs.get(case, dev, 1)
    q, k, v, do = sets[0]
    sync = lambda: _sync(dev)  # noqa: E731

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        r = fn()
        sync()
        return time.perf_counter() - t0, r

    bp = bench_pattern(case["pattern"], case["N"], case["block"], case["H"])
    rec["layout_build_s"], layout = timed(
        lambda: make_layout(bp.pattern, case["N"], case["H"], case["block"]))
    rec["pattern_description"] = bp.description

    def fwd(lay):
        with torch.no_grad():
            return sparse_attention(q, k, v, lay)

    def fwd_bwd(lay):
        sparse_attention(q, k, v, lay).backward(do)

    rec["torch_first_backward_s"], _ = timed(lambda: torch_first_backward(dev))
    rec["cold_fwd_s"], _ = timed(lambda: fwd(layout))
    out = sparse_attention(q, k, v, layout)
    rec["cold_bwd_s"], _ = timed(lambda: out.backward(do))
    rec["warm_fwd_s"], _ = timed(lambda: fwd(layout))
    # A new pattern with the same shapes: a BigBird draw no case uses, unioned with a window.
    new_pat = (P.bigbird(case["block"], 3, 1, 3, seed=987654321)
               | P.local(case["block"] // 2, case["block"] // 2))
    rec["new_pattern"] = "bigbird(block, 3, 1, 3, seed=987654321) | local(block/2, block/2)"
    rec["new_layout_build_s"], new_layout = timed(
        lambda: make_layout(new_pat, case["N"], case["H"], case["block"]))
    rec["new_pattern_first_fwd_s"], _ = timed(lambda: fwd(new_layout))
    rec["new_pattern_first_fwd_bwd_s"], _ = timed(lambda: fwd_bwd(new_layout))
    rec["new_pattern_second_fwd_s"], _ = timed(lambda: fwd(new_layout))
    rec["new_pattern_second_fwd_bwd_s"], _ = timed(lambda: fwd_bwd(new_layout))
    rec["triton_cache_dir"] = os.environ.get("TRITON_CACHE_DIR", "(Triton's default)")
    _Inputs.clear()
    return rec


def _progress(items, desc):
    try:
        return common.progress(items, desc=desc, total=len(items))
    except ImportError:  # the GPU machine may lack tqdm: plain lines instead of a bar
        def gen():
            for i, it in enumerate(items):
                print(f"[{desc} {i + 1}/{len(items)}] {it}", file=sys.stderr, flush=True)
                yield it
        return gen()


def _jobs(cfg) -> list:
    """The distinct (section, case, impl) jobs, in section order. A case measured by an earlier
    section is not measured again, except in a section with rounds (``BenchConfig.rounds``)."""
    jobs, seen = [], set()
    for section, cases, impls in cfg.sections:
        for impl in impls:
            for case in cases:
                key = (impl, *sorted(case.items()))
                if impl in _PATTERN_FREE:  # one dense measurement per shape
                    key = (impl, *sorted((k, v) for k, v in case.items() if k != "pattern"))
                if cfg.rounds.get(section, 1) > 1:
                    key = (section, *key)
                if key in seen:
                    continue
                seen.add(key)
                jobs.append((section, case, impl))
    return jobs


def _schedule(cfg) -> list:
    """The run order: (section, case, impl, round). Jobs of a section with R > 1 rounds run
    R times, round after round, so its readings share the host's load over the section."""
    jobs, out = _jobs(cfg), []
    for section in dict.fromkeys(j[0] for j in jobs):
        mine = [j for j in jobs if j[0] == section]
        for r in range(cfg.rounds.get(section, 1)):
            out += [(*j, r) for j in mine]
    return out


def _merge_rounds(records: list, rounds: dict) -> list:
    """One record per (section, impl, case) of a section with rounds: the first round's
    fields, ``fwd_ms`` / ``fwd_bwd_ms`` the medians over the rounds that ran, the readings in
    ``rounds_fwd_ms`` / ``rounds_fwd_bwd_ms``."""
    merged, index = [], {}
    for rec in records:
        if rounds.get(rec.get("section"), 1) <= 1 or "fwd_ms" not in rec:
            merged.append(rec)
            continue
        key = (rec["section"], rec["impl"],
               *(rec[k] for k in ("pattern", "N", "B", "H", "D", "dtype", "block")))
        if key not in index:
            index[key] = len(merged)
            merged.append({**rec, "rounds_fwd_ms": [], "rounds_fwd_bwd_ms": []})
        first = merged[index[key]]
        first["rounds_fwd_ms"].append(rec["fwd_ms"])
        first["rounds_fwd_bwd_ms"].append(rec["fwd_bwd_ms"])
    for rec in merged:
        if "rounds_fwd_ms" in rec:
            rec["fwd_ms"] = float(np.median(rec["rounds_fwd_ms"]))
            rec["fwd_bwd_ms"] = float(np.median(rec["rounds_fwd_bwd_ms"]))
            rec["timer"] = (f"{rec['timer']}; median of {len(rec['rounds_fwd_ms'])} "
                            f"interleaved rounds")
    return merged


def _kernels_kind(cfg: BenchConfig) -> str:
    """How this run's attention executes: "cuda" (compiled kernels), "cpu" (the native CPU
    path) or "interpreter" (SPARSETP_INTERPRET=1: the kernels in Triton's interpreter)."""
    return _runtime.device_kind("cuda" if cfg.device == "cuda" else "cpu")


def run(cfg: BenchConfig) -> dict:
    """Run ``cfg``'s jobs; returns the results dict (also written as JSON with plots)."""
    t_start = time.perf_counter()
    result = {"tool": "sparsetp.bench.attention", "schema_version": SCHEMA_VERSION,
              "command": cfg.command, "preset": cfg.preset, "device_kind": cfg.device,
              "interpreter": _kernels_kind(cfg) == "interpreter", "conventions": CONVENTIONS,
              "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "sections"},
              "records": [], "skipped": [], "errors": [], "warnings": [],
              # CPU timings of other processes' load are noise: say how busy the machine was.
              "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg")
              else None}
    if cfg.device == "cuda":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU
    import torch  # noqa: PLC0415

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device=cuda but torch sees no GPU")
    # jax_triton's 0.3.1 import sets TRITON_CACHE_DIR="" for the process (versions() no longer
    # imports it, but a caller may have): choose the cache directory here.
    result["versions"] = common.versions(device=cfg.device)
    # CPU: torch's intra-op threads; the native sparse path runs its chunks on as many worker
    # threads, one torch thread each (backends/torch/cpu.py, WORKERS): its many small ops no
    # longer meet at OMP barriers that a thread descheduled by other load stalls.
    result["torch_num_threads"] = torch.get_num_threads()
    if cfg.fresh_triton_cache and cfg.device == "cuda":
        # Cold-start numbers must include compilation; a warm on-disk cache would hide it.
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparsetp_bench_triton_")
    elif os.environ.get("TRITON_CACHE_DIR") == "":
        del os.environ["TRITON_CACHE_DIR"]  # "" breaks Triton's cache; unset means default
    path = os.path.join(cfg.out_dir, cfg.json_name)

    def save():
        result["wall_s"] = time.perf_counter() - t_start
        common.write_json(path, result)

    layouts = _Layouts()
    if cfg.gemm_anchor and cfg.device == "cuda":
        from sparsetp.bench import frontier  # noqa: PLC0415

        try:
            result["gemm_anchor"] = frontier.measure_gemm(cfg.device)
        except Exception as e:  # noqa: BLE001 - recorded; the timings below still run
            result["errors"].append({"section": "gemm_anchor", "error": f"{type(e).__name__}: {e}"})
    if cfg.first_call and cfg.first_call_case:
        try:
            result["records"].append(_first_call(cfg, cfg.first_call_case))
        except Exception as e:  # noqa: BLE001 - recorded; the timings below still run
            result["errors"].append({"section": "first_call", **cfg.first_call_case,
                                     "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()[-3000:]})
        save()
    jobs = _schedule(cfg)
    torch_wall_for_jax = cfg.device == "cuda"
    for section, case, impl, rnd in _progress(jobs, "attention"):
        tag = {"section": section, "impl": impl, **case}
        if cfg.rounds.get(section, 1) > 1:
            tag["round"] = rnd
        left = cfg.budget_s - (time.perf_counter() - t_start)
        if left < _EXPECTED_S.get(impl, 0.0):
            result["skipped"].append({**tag, "reason": f"budget: {left:.0f} s of "
                                      f"{cfg.budget_s:g} s left, job needs ~"
                                      f"{_EXPECTED_S.get(impl, 0.0):g} s"})
            continue
        t0 = time.perf_counter()
        try:
            rec = _run_job(cfg, section, case, impl, layouts, torch_wall_for_jax)
            rec["job_s"] = time.perf_counter() - t0
            result["records"].append(rec)
        except Skip as s:
            result["skipped"].append({**tag, "reason": str(s)})
        except Exception as e:  # noqa: BLE001 - recorded with its traceback, never dropped
            result["errors"].append({**tag, "error": f"{type(e).__name__}: {str(e)[:2000]}",
                                     "traceback": traceback.format_exc()[-3000:],
                                     "job_s": time.perf_counter() - t0})
            if cfg.device == "cuda":
                try:
                    _Inputs.clear()
                    torch.cuda.empty_cache()
                except Exception:  # noqa: BLE001 - a dead CUDA context: later jobs record it
                    pass
        save()
    _Inputs.clear()
    result["records"] = _merge_rounds(result["records"], cfg.rounds)
    add_derived(result)
    result["targets"] = compute_targets(result)
    save()
    if cfg.plots:
        try:
            result["plots"] = plot(result, cfg.out_dir)
        except ImportError as e:
            result["warnings"].append(f"no plots: matplotlib missing ({e})")
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the pictures
            result["warnings"].append(f"plotting failed: {type(e).__name__}: {e}")
    save()
    return result


CONVENTIONS = {
    "time": "ms; GPU torch: median of triton.testing.do_bench (L2 flushed, grads reset); GPU "
            "JAX and all CPU: median of wall-clock loops with block_until_ready / "
            "torch.cuda.synchronize; input sets rotate between calls (random normal, no zeros)",
    "bwd_ms": "fwd_bwd_ms - fwd_ms (forward+backward minus forward, both measured)",
    "rounds": "a section with rounds (config.rounds; targets: block_sizes) runs its jobs R "
              "times, round after round, and records the median of each job's R readings "
              "(rounds_fwd_ms / rounds_fwd_bwd_ms); its ratios use its own readings",
    "computed_elements": "B * sum over heads of computed tiles * block^2 (tile padding and "
                         "masked-out pairs inside partial tiles included)",
    "flop_elements": "the elements an implementation computes: computed_elements for sparsetp, "
                     "sparsetp_jax, flex and fa4; B*H*N*N for dense SDPA, sdpa_mask and "
                     "reference; B*H*N(N+1)/2 for sdpa_causal and cudnn_causal; "
                     "B*H*N_tiles*W*block^2 for naive",
    "tflops": "fwd: 4 * D * flop_elements / fwd time; bwd: 2.5x the fwd FLOPs / bwd time; "
              "fwd_bwd: 3.5x / fwd_bwd time",
    "true_tflops": "true_fwd_tflops / true_bwd_tflops: the same with allowed_elements (the "
                   "pairs the pattern allows, B*H*N*N for dense) in place of flop_elements",
    "bwd_over_fwd": "bwd_ms / fwd_ms",
    "speedup_vs_X": "X_ms / this_ms for the same case (> 1: this is faster); dense = the first "
                    "of config.dense_order (default sdpa_flash, sdpa_cudnn, sdpa; natten: "
                    "sdpa_cudnn first) measured at that shape",
}


def add_derived(result: dict) -> dict:
    """TFLOP/s, bwd time and ratios vs Flex and vs dense, all from the recorded ms."""
    recs = result["records"]
    for r in recs:
        if "fwd_ms" not in r:
            continue
        r["bwd_ms"] = r["fwd_bwd_ms"] - r["fwd_ms"]
        fl = 4.0 * r["D"] * r["flop_elements"]
        r["fwd_tflops"] = fl / (r["fwd_ms"] * 1e-3) / 1e12
        r["bwd_tflops"] = 2.5 * fl / (r["bwd_ms"] * 1e-3) / 1e12 if r["bwd_ms"] > 0 else None
        r["fwd_bwd_tflops"] = 3.5 * fl / (r["fwd_bwd_ms"] * 1e-3) / 1e12
        r["bwd_over_fwd"] = r["bwd_ms"] / r["fwd_ms"] if r["fwd_ms"] > 0 else None
        if "allowed_elements" in r:  # the pairs the pattern allows: its true work
            true = 4.0 * r["D"] * r["allowed_elements"] / 1e12
            r["true_fwd_tflops"] = true / (r["fwd_ms"] * 1e-3)
            r["true_bwd_tflops"] = 2.5 * true / (r["bwd_ms"] * 1e-3) if r["bwd_ms"] > 0 else None

    def key(r, with_pattern=True):
        k = (r["N"], r["B"], r["H"], r["D"], r["dtype"])
        return k + (r["pattern"], r["block"]) if with_pattern else k

    # A reference measured in the record's own section (side by side, e.g. in interleaved
    # rounds) is preferred to one of the same case from another section.
    def refs(impls, with_pattern):
        out = {}
        for name in reversed(impls):  # earlier names win
            for r in reversed([r for r in recs if r["impl"] == name and "fwd_ms" in r]):
                out[key(r, with_pattern)] = r  # the first record of a case wins ...
                out[(r["section"], key(r, with_pattern))] = r  # ... and of a (section, case)
        return out

    order = tuple(result.get("config", {}).get("dense_order") or DENSE_BASELINES)
    flex, dense = refs(("flex",), True), refs(order, False)
    for r in recs:
        if "fwd_ms" not in r:
            continue
        for label, table, k in (("flex", flex, key(r)), ("dense", dense, key(r, False))):
            ref = table.get((r["section"], k), table.get(k))
            if ref is None or ref is r or ref["impl"] == r["impl"]:
                continue
            r[f"speedup_vs_{label}"] = {m: (ref[f"{m}_ms"] / r[f"{m}_ms"]
                                            if r[f"{m}_ms"] > 0 else None)
                                        for m in ("fwd", "bwd", "fwd_bwd")}
            if label == "dense":
                r["dense_impl"] = ref["impl"]
    return result


# =========================================================================== targets
TARGET_SHAPE = {"B": 1, "H": 16, "D": 128, "dtype": "bfloat16"}


def _find(recs, impl, pattern, n, block=128, section=None, **shape):
    """The first timed record of (impl, pattern, N, block) at the target shape; with
    ``section``, one of that section if there is one, else the first of any."""
    want = {**TARGET_SHAPE, **shape}
    hits = [r for r in recs
            if (r["impl"] == impl and r["pattern"] == pattern and r["N"] == n
                and r["block"] == block and all(r[k] == v for k, v in want.items())
                and "fwd_ms" in r)]
    return next((r for r in hits if r["section"] == section), hits[0] if hits else None)


def _target(tid, name, value, threshold, op, unit, applicable, note="",
            not_applicable="thresholds are for the GPU"):
    """One target row. ``op``: ">=", "<=" or "within" (``threshold`` = [low, high], inclusive)."""
    ok = None
    if value is not None and applicable:
        ok = (bool(threshold[0] <= value <= threshold[1]) if op == "within"
              else bool(value >= threshold) if op == ">=" else bool(value <= threshold))
    status = ("not measured" if value is None else
              f"not applicable ({not_applicable})" if not applicable else
              "pass" if ok else "fail")
    return {"id": tid, "name": name, "value": value, "threshold": threshold, "op": op,
            "unit": unit, "pass": ok, "status": status, "note": note}


def compute_targets(result: dict) -> list:
    """The performance targets from the records (value, threshold, pass/fail; pass is None
    when the value was not measured or the run was not on a GPU)."""
    recs = result["records"]
    gpu = result.get("device_kind") == "cuda"
    out = seed_targets(result)
    if result.get("preset") == "seed":  # issue #8's targets need cases this preset never runs
        return out
    if result.get("preset") == "natten":  # issue #32's targets only
        from sparsetp.bench import natten  # noqa: PLC0415

        return natten.targets(result)
    if result.get("preset") == "frontier":  # issue #34's targets only
        from sparsetp.bench import frontier  # noqa: PLC0415

        return frontier.targets(result)
    shape_note = "bf16, B=1, H=16, D=128, block 128"
    for n in (8192, 32768):
        for p in ANCHOR_PATTERNS:
            ours, fl = _find(recs, "sparsetp", p, n), _find(recs, "flex", p, n)
            for m in ("fwd", "bwd"):
                v = None
                if ours and fl and ours[f"{m}_ms"] > 0:
                    v = fl[f"{m}_ms"] / ours[f"{m}_ms"]
                out.append(_target("1", f"{m} vs Flex, {p}, N={n}", v, 1.10, ">=",
                                   "x (flex_ms / sparsetp_ms)", gpu,
                                   f"{shape_note}; 10% faster = 1.1x Flex's speed"))
    r = _find(recs, "sparsetp", "causal", 32768)
    out.append(_target("2", "causal fwd TFLOP/s, N=32768", r and r["fwd_tflops"], 450.0, ">=",
                       "TFLOP/s on computed blocks", gpu, shape_note))
    for n in (8192, 32768):
        bb, w = _find(recs, "sparsetp", "bigbird", n), _find(recs, "sparsetp", "window", n)
        for m in ("fwd", "bwd"):
            v = None
            if bb and w and bb.get(f"{m}_tflops") and w.get(f"{m}_tflops"):
                v = bb[f"{m}_tflops"] / w[f"{m}_tflops"]
            out.append(_target("3", f"BigBird / window {m} TFLOP/s, N={n}", v, 0.80, ">=",
                               "ratio", gpu, shape_note))
    for n in (32768, 8192):
        # The block-128 reading of the block_sizes section (taken beside the others) if any.
        base = _find(recs, "sparsetp", "window", n, section="block_sizes")
        for bs in (64, 32):
            r = _find(recs, "sparsetp", "window", n, block=bs, section="block_sizes")
            for m in ("fwd", "bwd"):
                v = None
                if base and r and r[f"{m}_ms"] > 0 and base[f"{m}_ms"] > 0:
                    v = ((r[f"{m}_ms"] / r["computed_elements"])
                         / (base[f"{m}_ms"] / base["computed_elements"]))
                out.append(_target("4", f"window {m} time per computed element, block {bs} "
                                   f"vs 128, N={n}", v, 1.25, "<=", "ratio", gpu,
                                   "bf16, B=1, H=16, D=128"))
    fc = next((r for r in recs if r["section"] == "first_call"), None)
    fcn = (f"{fc['pattern']} N={fc['N']} D={fc['D']} {fc['dtype']} block {fc['block']}"
           if fc else "")
    for field, name, thr, unit in (
            ("new_pattern_first_fwd_s", "new pattern, same shapes: first fwd call", 0.050, "s"),
            ("new_pattern_first_fwd_bwd_s", "new pattern, same shapes: first fwd+bwd call",
             0.050, "s"),
            ("cold_fwd_s", "cold first fwd call of a new shape (compiles)", 5.0, "s"),
            ("cold_bwd_s", "cold first bwd call of a new shape (compiles)", 5.0, "s")):
        out.append(_target("5", name, fc and fc.get(field), thr, "<=", unit, gpu,
                           f"{fcn}; layout building timed separately; Triton cache dir: "
                           f"{fc and fc.get('triton_cache_dir')}"))
    for r in recs:
        if r["impl"] == "sparsetp_jax" and "jax_over_torch_fwd" in r:
            for m in ("fwd", "fwd_bwd"):
                out.append(_target("6", f"JAX / torch launch {m}, {r['pattern']} N={r['N']}",
                                   r[f"jax_over_torch_{m}"], 1.05, "<=",
                                   "x (jax_ms / torch_ms, same wall-clock loops)", gpu))
    if not any(t["id"] == "6" for t in out):
        out.append(_target("6", "JAX / torch launch", None, 1.05, "<=", "x", gpu))
    return out


SEED_MAX_DENSITY = 0.5  # claim S1 covers patterns of tile density <= 50%
SEED_JAX_RANGE = (0.8, 1.25)  # claim S2: JAX / torch fwd+bwd time


def _seed_cells(recs) -> dict:
    """Section "seed" records by (family, target density, N, B, H, D, dtype, block) and impl."""
    cells = {}
    for r in recs:
        if r.get("section") != "seed" or "fwd_ms" not in r or r["impl"] in _PATTERN_FREE:
            continue
        fam, _, want = r["pattern"].partition(":")
        key = (fam, float(want) if want else None, r["N"], r["B"], r["H"], r["D"], r["dtype"],
               r["block"])
        cells.setdefault(key, {})[r["impl"]] = r
    return cells


def _seed_speedup(rec: dict | None) -> float | None:
    """A seed record's fwd+bwd speed-up over dense: its paired rounds' median where it has
    them (``BenchConfig.paired_dense``), else against the section's dense record."""
    if not rec:
        return None
    if "paired_speedup_fwd_bwd" in rec:
        return rec["paired_speedup_fwd_bwd"]
    return (rec.get("speedup_vs_dense") or {}).get("fwd_bwd")


def seed_targets(result: dict) -> list:
    """Issue #30's two seed-regime claims, one row per (pattern, target density, N) measured in
    the "seed" section:

    - **S1**: eager torch sparse forward + backward at least as fast as dense SDPA for every
      pattern of tile density <= 50%: ``dense fwd_bwd_ms / sparsetp fwd_bwd_ms >= 1``, from
      the record's paired rounds (``paired_speedup_fwd_bwd``, ``BenchConfig.paired_dense``)
      where it has them, else from the section's dense record. A case whose nearest-density
      layout came out denser than 50% is "not applicable".
    - **S2**: JAX / torch forward + backward time within 0.8-1.25x. On a GPU the ratio of the
      JAX record's ``jax_over_torch_fwd_bwd`` (torch timed with the same wall-clock loops); on
      CPU, where both are wall-clock loops, ``sparsetp_jax fwd_bwd_ms / sparsetp fwd_bwd_ms``.

    Both are judged on CPU runs too (the claims are ratios); the note gives the device and shape.
    """
    recs = result["records"]
    dev = "GPU" if result.get("device_kind") == "cuda" else "CPU"
    out = []
    for (fam, want, n, b, h, d, dt, bs), by in sorted(
            _seed_cells(recs).items(), key=lambda kv: (kv[0][0], -(kv[0][1] or 0), kv[0][2:])):
        shape = f"{dev}, B={b}, H={h}, D={d}, {dt}, block {bs}"
        ours, jx = by.get("sparsetp"), by.get("sparsetp_jax")
        dens = (ours or jx)["density"]
        label = f"{fam}:{want} N={n} (tile density {dens:.3f})"
        v1 = _seed_speedup(ours)
        if ours and "paired_speedup_fwd_bwd" in ours:
            unit = f"x (dense {ours['paired_dense_impl']} ms / sparsetp ms, paired rounds)"
        else:
            unit = f"x (dense {ours and ours.get('dense_impl')} ms / sparsetp ms)"
        out.append(_target("S1", f"sparse fwd+bwd vs dense, {label}", v1, 1.0, ">=", unit,
                           dens <= SEED_MAX_DENSITY + 1e-9, shape,
                           not_applicable=f"tile density {dens:.3f} > {SEED_MAX_DENSITY}"))
        v2 = None
        if jx and "jax_over_torch_fwd_bwd" in jx:
            v2 = jx["jax_over_torch_fwd_bwd"]
        elif jx and ours and ours["fwd_bwd_ms"] > 0:
            v2 = jx["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
        out.append(_target("S2", f"JAX / torch fwd+bwd, {label}", v2, list(SEED_JAX_RANGE),
                           "within", "x (jax_ms / torch_ms)", True, shape))
    return out


# =========================================================================== plots and docs
def plot(result: dict, out_dir: str) -> list:
    """Speed-up over dense vs N, and time vs sparsity; returns the PNG paths written."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    os.makedirs(out_dir, exist_ok=True)
    recs = [r for r in result["records"] if "fwd_ms" in r]
    tag = f"{result.get('versions', {}).get('device', result.get('device_kind'))}"
    paths = []
    sparse_impls = ("sparsetp", "flex", "sparsetp_jax", "naive", "sdpa_mask")
    seq = [r for r in recs if r["impl"] in sparse_impls and "speedup_vs_dense" in r
           and r["section"] != "seed"]  # the seed grid has its own figure (plot_seed)
    groups = {}
    for r in seq:
        groups.setdefault((r["pattern"], r["impl"], r["block"], r["D"], r["dtype"]), []).append(r)
    groups = {k: v for k, v in groups.items() if len({r["N"] for r in v}) >= 2}
    if groups:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for (pat, impl, bs, d, dt), rs in sorted(groups.items()):
            tail = f" D{d} {dt}" if len({(k[3], k[4]) for k in groups}) > 1 else ""
            rs = sorted(rs, key=lambda r: r["N"])
            for ax, m in zip(axes, ("fwd", "fwd_bwd"), strict=True):
                ax.plot([r["N"] for r in rs], [r["speedup_vs_dense"][m] for r in rs],
                        marker="o", label=f"{impl} {pat} (b{bs}){tail}")
        for ax, m in zip(axes, ("forward", "forward + backward"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("speed-up over dense SDPA (x)")
            ax.set_title(f"{m}")
            ax.grid(True, which="both", alpha=0.3)
        paths.append(_save_figure(plt, fig, axes, f"block-sparse attention vs dense, {tag}",
                                  os.path.join(out_dir, "attention_speedup_vs_seqlen.png")))
    spars = [r for r in recs if r["section"] == "sparsity"]
    if spars:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        fam = {}
        for r in spars:
            if r["impl"] in _PATTERN_FREE:
                continue
            fam.setdefault((r["impl"], r["pattern"].split(":")[0], r["N"]), []).append(r)
        for (impl, family, n), rs in sorted(fam.items()):
            rs = sorted(rs, key=lambda r: 1 - r["density"])
            for ax, m in zip(axes, ("fwd", "fwd_bwd"), strict=True):
                ax.plot([100 * (1 - r["density"]) for r in rs], [r[f"{m}_ms"] for r in rs],
                        marker="o", label=f"{impl} {family} N={n}")
        spars_n = {r["N"] for r in spars}
        dense_recs = [r for r in recs if r["impl"] in _PATTERN_FREE and r["N"] in spars_n
                      and r["H"] == spars[0]["H"] and r["D"] == spars[0]["D"]]
        for r in dense_recs:  # dense jobs are shared across sections: take them from any
            for ax, m in zip(axes, ("fwd", "fwd_bwd"), strict=True):
                ax.axhline(r[f"{m}_ms"], ls="--", color="gray", lw=0.8)
                ax.text(50, r[f"{m}_ms"], f"dense {r['impl']} N={r['N']}", fontsize=7,
                        va="bottom")
        for ax, m in zip(axes, ("forward", "forward + backward"), strict=True):
            ax.set_xlabel("sparsity (% of tiles skipped)")
            ax.set_ylabel("time (ms)")
            ax.set_yscale("log")
            ax.set_title(m)
            ax.grid(True, which="both", alpha=0.3)
        paths.append(_save_figure(plt, fig, axes, f"time vs sparsity, {tag}",
                                  os.path.join(out_dir, "attention_time_vs_sparsity.png")))
    seed = plot_seed(result, out_dir, plt)
    return paths + ([seed] if seed else [])


SEED_PLOT = "attention_seed_speedup.png"
_SEED_STYLE = {"sparsetp": ("-", "torch"), "sparsetp_jax": ("--", "JAX"),
               "naive": (":", "naive")}


def plot_seed(result: dict, out_dir: str, plt=None) -> str | None:
    """The seed grid (section "seed"): forward+backward speed-up over dense SDPA vs N, one panel
    per pattern family, one colour per target density; torch solid, JAX dashed, naive dotted.
    Returns the PNG path, or None when the records hold no seed grid."""
    cells = _seed_cells(result["records"])
    if not cells:
        return None
    if plt is None:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    os.makedirs(out_dir, exist_ok=True)
    fams = [f for f in SEED_FAMILIES if any(k[0] == f for k in cells)]
    fams += sorted({k[0] for k in cells} - set(fams))
    wants = sorted({k[1] for k in cells}, key=lambda w: -(w or 0))
    colours = dict(zip(wants, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, axes = plt.subplots(1, len(fams), figsize=(4.2 * len(fams), 4.2), squeeze=False)
    axes = list(axes[0])
    for ax, fam in zip(axes, fams, strict=True):
        for want in wants:
            for impl, (ls, name) in _SEED_STYLE.items():
                pts = sorted((k[2], _seed_speedup(by[impl]))
                             for k, by in cells.items() if k[0] == fam and k[1] == want
                             and impl in by and _seed_speedup(by[impl]))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker="o", ms=3,
                            color=colours.get(want), lw=0.9 if impl == "naive" else 1.5,
                            label=f"{name}, density {want:g}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(fam.removesuffix("_density"))
        ax.set_xlabel("sequence length N")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fwd+bwd speed-up over dense SDPA (x)")
    r0 = next(iter(next(iter(cells.values())).values()))
    tag = result.get("versions", {}).get("device", result.get("device_kind"))
    return _save_figure(plt, fig, axes, f"seed regime, B={r0['B']} H={r0['H']} D={r0['D']} "
                        f"{r0['dtype']} block {r0['block']}; {tag}",
                        os.path.join(out_dir, SEED_PLOT))


def _save_figure(plt, fig, axes, title: str, path: str) -> str:
    """Legend, title, layout, PNG; closes the figure and returns ``path``."""
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(x, nd=3):
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if abs(x) < 1e4 else f"{x:.3g}"
    return str(x)


_TORCH_FIRST_BACKWARD_NOTE = (
    "`torch_first_backward_s` is a trivial autograd backward with an explicit gradient, run "
    "before the cold calls: torch's once-per-process imports (its symbolic-shapes module and "
    "sympy), which `cold_bwd_s` does not count.")
# Older recorded results have no torch_first_backward_s.
_NO_TORCH_FIRST_BACKWARD_NOTE = (
    "This run predates `torch_first_backward_s`: its `cold_bwd_s` includes torch's "
    "once-per-process imports at the first backward with an explicit gradient (its "
    "symbolic-shapes module and sympy; 2.2-3.1 s on the device hosts).")


def render_markdown(results: dict | Sequence[dict], plots: Sequence[str] = (),
                    json_paths: Sequence[str] = ()) -> str:
    """The attention section of docs/performance.md from one or more result dicts."""
    results = [results] if isinstance(results, dict) else list(results)
    lines = ["## Attention", ""]
    cpu = any(r.get("device_kind") != "cuda" for r in results)
    if cpu:
        lines += ["> **CPU numbers.** These come from a CPU run (CPU tensors: the native "
                  "CPU path, or the Triton kernels in Triton's interpreter under "
                  "SPARSETP_INTERPRET=1), so the times say nothing about GPU performance. They "
                  "show what the tool records; the GPU run replaces them.", ""]
    for res in results:
        v = res.get("versions", {})
        lines += [f"**Run**: preset `{res.get('preset')}` on {v.get('device', '?')}; torch "
                  f"{v.get('torch', '–')}, triton {v.get('triton', '–')}, jax {v.get('jax', '–')}"
                  f", jax_triton {v.get('jax_triton', '–')}, Python {v.get('python', '?')}; "
                  f"{v.get('date', '')}; {res.get('wall_s', 0):.0f} s wall; load average at "
                  f"start {res.get('load_average_at_start')}.", "",
                  f"Command: `{res.get('command', '')}`", ""]
    if json_paths:
        lines += [f"Rendered from: {', '.join(f'`{p}`' for p in json_paths)} with "
                  f"`python -m sparsetp.bench attention --from_json={','.join(json_paths)} "
                  f"--docs=docs/performance.md`.", ""]
    conv = results[0].get("conventions", CONVENTIONS)
    lines += ["Conventions:", ""] + [f"- **{k}**: {t}" for k, t in conv.items()] + [""]
    targets = [t for r in results for t in r.get("targets", [])]
    if targets:
        lines += ["### Targets (1-6: issue #8; S1, S2: issue #30's seed regime)", "",
                  "| # | target | value | threshold | result |", "|---|---|---|---|---|"]
        for t in targets:
            thr = (f"{_f(t['threshold'][0], 2)}–{_f(t['threshold'][1], 2)}"
                   if t["op"] == "within" else _f(t["threshold"]))
            lines.append(f"| {t['id']} | {t['name']} | {_f(t['value'])} {t['unit']} | "
                         f"{t['op']} {thr} | {t['status']} |")
        lines.append("")
    fc = [r for res in results for r in res["records"] if r["section"] == "first_call"]
    for r in fc:
        lines += ["### First calls", "",
                  f"Shape: {r['pattern']}, N={r['N']}, B={r['B']}, H={r['H']}, D={r['D']}, "
                  f"{r['dtype']}, block {r['block']}; Triton cache `{r.get('triton_cache_dir')}`.",
                  "", "| step | seconds |", "|---|---|"]
        for k in ("layout_build_s", "torch_first_backward_s", "cold_fwd_s", "cold_bwd_s",
                  "warm_fwd_s", "new_layout_build_s", "new_pattern_first_fwd_s",
                  "new_pattern_first_fwd_bwd_s", "new_pattern_second_fwd_s",
                  "new_pattern_second_fwd_bwd_s"):
            lines.append(f"| {k} | {_f(r.get(k), 4)} |")
        lines += ["", _TORCH_FIRST_BACKWARD_NOTE if "torch_first_backward_s" in r
                  else _NO_TORCH_FIRST_BACKWARD_NOTE, ""]
    recs = [r for res in results for r in res["records"] if "fwd_ms" in r]
    lines += _seed_table(recs)
    if recs:
        lines += ["### Timings", "",
                  "| section | pattern | N | B×H×D | dtype | block | density | computed blocks |"
                  " impl | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | vs Flex fwd/bwd |"
                  " vs dense fwd/bwd |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(recs, key=lambda r: (r["section"], r["pattern"], r["N"], r["block"],
                                             r["impl"])):
            sf, sd = r.get("speedup_vs_flex"), r.get("speedup_vs_dense")
            vs = lambda s: f"{_f(s['fwd'], 2)} / {_f(s['bwd'], 2)}" if s else "–"  # noqa: E731
            lines.append(
                f"| {r['section']} | {r['pattern']} | {r['N']} | {r['B']}×{r['H']}×{r['D']} | "
                f"{r['dtype']} | {r['block']} | {r['density']:.4f} | {r['computed_blocks']} | "
                f"{r['impl']} | {_f(r['fwd_ms'])} | {_f(r['bwd_ms'])} | "
                f"{_f(r['fwd_tflops'], 2)} | {_f(r['bwd_tflops'], 2)} | {vs(sf)} | {vs(sd)} |")
        lines.append("")
        flex = [r for r in recs if r["impl"] == "flex"]
        if flex:
            lines += ["Flex details (compile time, kernel options, max |Flex − sparsetp| on the "
                      "same inputs):", ""]
            for r in flex:
                fails = len(r.get("kernel_option_failures", []))
                lines.append(f"- {r['pattern']} N={r['N']}: compile {_f(r.get('compile_s'), 1)}"
                             f" s, kernel_options {r.get('kernel_options')} ({fails} failed "
                             f"before), mask_mod `{r.get('mask_mod')}`, max diff "
                             f"{_f(r.get('max_abs_diff_vs_sparsetp'), 4)}")
            lines.append("")
    for p in plots:
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    skipped = [s for r in results for s in r.get("skipped", [])]
    errors = [e for r in results for e in r.get("errors", [])]
    if skipped or errors:
        lines += ["### Skipped and failed", ""]
        for s in skipped:
            lines.append(f"- skipped {s.get('impl')} {s.get('pattern')} N={s.get('N')} block "
                         f"{s.get('block')}: {s['reason']}")
        for e in errors:
            lines.append(f"- **error** {e.get('impl', e.get('section'))} {e.get('pattern')} "
                         f"N={e.get('N')}: {e['error'][:300]}")
        lines.append("")
    return "\n".join(lines)


def seed_torch_references(cells: dict) -> dict:
    """Per shape (N, B, H, D, dtype, block): the median over the seed cells' JAX records of
    eager torch's dense SDPA and one-node (addcmul) fwd+bwd wall times, ``{"dense": ms,
    "floor": ms}``. Both are the same work for every pattern at a shape, so the median of
    their readings across the shape's jobs is the steadier figure."""
    readings = {}
    for key, by in cells.items():
        jx = by.get("sparsetp_jax", {})
        for name in ("dense", "floor"):
            ms = jx.get(f"torch_{name}_wall_fwd_bwd_ms")
            if ms:
                readings.setdefault(key[2:], {}).setdefault(name, []).append(ms)
    return {k: {n: float(np.median(v)) for n, v in d.items()} for k, d in readings.items()}


def _seed_table(recs) -> list:
    """Markdown lines: the seed grid's fwd+bwd speed-ups over dense and JAX / torch ratios."""
    cells = _seed_cells(recs)
    if not cells:
        return []
    out = ["### Seed regime (issue #30)", "",
           "Forward+backward speed-up over dense SDPA (dense ms / this ms; torch's from dense "
           "and torch timed in alternating rounds where the run paired them) and JAX / torch "
           "fwd+bwd time; targets S1 and S2 above judge them. The next two columns divide "
           "JAX's time by eager torch's in the same wall-clock loops (GPU) for dense SDPA and "
           "for a cheap one-node step over the same leaves (addcmul, elementwise kernels "
           "only), each the median of its readings at that N (the same work for every "
           "pattern there): below 0.8, JAX's sparse step beats that eager step by more than "
           "S2's band allows. The last column times torch's attention fwd+bwd captured whole "
           "in one CUDA graph and replayed on one static input set (eager torch's host work "
           "taken out; informative, S2 judges eager).", "",
           "| pattern | target density | N | tile density | torch | JAX | naive | JAX / torch "
           "| JAX / torch's dense | JAX / torch's addcmul | JAX / torch in one CUDA graph |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    per_n = seed_torch_references(cells)
    for key, by in sorted(cells.items(), key=lambda kv: (kv[0][0], -(kv[0][1] or 0), kv[0][2:])):
        fam, want, n = key[:3]
        sp = {i: _f(_seed_speedup(r), 2) for i, r in by.items()}
        ratio = None
        if "sparsetp_jax" in by and "sparsetp" in by:
            ratio = by["sparsetp_jax"].get("jax_over_torch_fwd_bwd",
                                           by["sparsetp_jax"]["fwd_bwd_ms"]
                                           / by["sparsetp"]["fwd_bwd_ms"])
        jx = by.get("sparsetp_jax", {})
        refs = {**per_n.get(key[2:], {}), "graphed": jx.get("torch_graphed_wall_fwd_bwd_ms")}
        over = {k: jx["fwd_bwd_ms"] / ms for k, ms in refs.items() if ms}
        dens = next(iter(by.values()))["density"]
        out.append(f"| {fam} | {want} | {n} | {dens:.3f} | {sp.get('sparsetp', '–')} | "
                   f"{sp.get('sparsetp_jax', '–')} | {sp.get('naive', '–')} | {_f(ratio, 2)} "
                   f"| {_f(over.get('dense'), 2)} | {_f(over.get('floor'), 2)} "
                   f"| {_f(over.get('graphed'), 2)} |")
    return out + [""]


TP_HEADING = "## Tensor parallelism"


def write_docs(results, path: str, plots: Sequence[str] = (),
               json_paths: Sequence[str] = ()) -> str:
    """Write ``path`` (docs/performance.md): a title, the attention section, and whatever
    ``## Tensor parallelism`` section the file already has (owned by the TP benchmark)."""
    out_dir = os.path.dirname(os.path.abspath(path))
    os.makedirs(out_dir, exist_ok=True)
    copied = []
    for p in plots:
        dst = os.path.join(out_dir, os.path.basename(p))
        if os.path.abspath(p) != dst:
            shutil.copyfile(p, dst)
        copied.append(dst)
    tail = f"{TP_HEADING}\n\n(To be filled by the tensor-parallel benchmark, " \
           "`python -m sparsetp.bench tp`.)\n"
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if TP_HEADING in old:
            tail = old[old.index(TP_HEADING):]
    text = ("# Performance\n\nEvery number below was produced by `python -m sparsetp.bench`; "
            "each section names its device, versions and command.\n\n"
            + render_markdown(results, copied, json_paths) + "\n" + tail)
    with open(path, "w") as f:
        f.write(text)
    return path


# =========================================================================== command line
def _main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.from_json:
        results = []
        for p in FLAGS.from_json:
            with open(p) as f:
                results.append(json.load(f))
        plots = []
        if FLAGS.plots:
            merged = {"records": [r for res in results for r in res["records"]],
                      "versions": results[0].get("versions", {}),
                      "device_kind": results[0].get("device_kind")}
            try:
                plots = plot(merged, FLAGS.out_dir)
            except ImportError as e:
                print(f"no plots: matplotlib missing ({e})", file=sys.stderr)
        if FLAGS.docs:
            write_docs(results, FLAGS.docs, plots, FLAGS.from_json)
            print(f"wrote {FLAGS.docs}")
        return
    cfg = config_from_flags()
    cfg.command = "python -m sparsetp.bench attention " + " ".join(argv_flags())
    res = run(cfg)
    path = os.path.join(cfg.out_dir, cfg.json_name)
    print(summary(res))
    print(f"wrote {path} ({len(res['records'])} records, {len(res['skipped'])} skipped, "
          f"{len(res['errors'])} errors)")
    if FLAGS.docs:
        write_docs(res, FLAGS.docs, res.get("plots", []), [path])
        print(f"wrote {FLAGS.docs}")


def argv_flags() -> list:
    return [a for a in sys.argv[1:] if a.startswith("-")]


def summary(res: dict) -> str:
    if res.get("preset") == "natten":
        from sparsetp.bench import natten  # noqa: PLC0415

        return natten.summary(res)
    if res.get("preset") == "frontier":  # with the GEMM anchor and the targets F1-F3
        from sparsetp.bench import frontier  # noqa: PLC0415

        return frontier.summary(res)
    rows = [f"{'impl':13s} {'pattern':18s} {'N':>6s} {'bs':>4s} {'fwd ms':>9s} {'bwd ms':>9s} "
            f"{'fwd TF/s':>9s} {'vsFlex f/b':>11s}"]
    for r in res["records"]:
        if "fwd_ms" not in r:
            continue
        sf = r.get("speedup_vs_flex")
        vs = f"{sf['fwd']:.2f}/{sf['bwd']:.2f}" if sf else "-"
        rows.append(f"{r['impl']:13s} {r['pattern']:18s} {r['N']:6d} {r['block']:4d} "
                    f"{r['fwd_ms']:9.3f} {r['bwd_ms']:9.3f} {r['fwd_tflops']:9.2f} {vs:>11s}")
    for t in res.get("targets", []):
        rows.append(f"target {t['id']}: {t['name']}: {_f(t['value'])} {t['op']} "
                    f"{t['threshold']} -> {t['status']}")
    return "\n".join(rows)


def main(argv=None) -> None:
    """Entry point of ``python -m sparsetp.bench attention`` (``argv`` without the command)."""
    define_flags()
    app.run(_main, argv=list(sys.argv if argv is None else argv))


if __name__ == "__main__":
    main()
