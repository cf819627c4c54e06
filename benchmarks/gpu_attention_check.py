"""GPU correctness check and first timings of the sparsetp attention kernels (torch frontend).

Believe these numbers only if ``tests/torch_attention_test.py`` passes (it runs the same kernels
in Triton's interpreter on CPU against the float64 oracle).

Sections, in order (a wall-clock budget skips what does not fit, and says so in the JSON):
1. small shapes vs the float64 numpy oracle (fp32, bf16, fp16; several patterns, ragged N);
2. GPU shapes (N = 8192, D = 64 / 128, bf16 / fp16) vs a float32 torch reference on the GPU,
   plus NaN-poisoned outputs and a bitwise determinism check;
3. timings (triton.testing.do_bench median, ms), bf16, B=1, H=16, D=128, N = 8192 and 32768:
   sparsetp fwd and fwd+bwd with the default launch config on causal, window, bigbird,
   strided_causal (optionally SDPA and FlexAttention, off by default: the comparison belongs to
   the benchmark tool);
4. sweeps at N = 32768 (each config first correctness-checked at N = 2048 against the float32
   reference): the three work orders (``launch.WORK_ORDERS``), backward sub-tile / warps /
   stages configs, forward sub-tile configs. Each entry names its config, so the JSON says
   which heuristic choice won. First among the sweeps (issue #8): the forward with row
   splitting (``launch._override(split_cap=C)``, C in ``--split_caps``) on bigbird and window
   at N = 32768 and 8192 (each cap correctness-checked at N = 2048 first); ``split_ratio``
   entries give bigbird / window forward TFLOP/s on computed blocks per (C, N), the default
   (unsplit) forward included as C = None. Target: >= 0.8.

Optional sections (flags): ``--bwd_kernels`` (each backward kernel alone), ``--order_ab`` (work
orders, interleaved), ``--kernel_ab=A.py,...`` (the tree's kernels against copies of
``sparsetp/kernels/attention.py``, interleaved, each checked first), ``--bwd_streams`` (dQ and
dK/dV on one stream vs two).

Usage (repo root on PYTHONPATH; about 150 s on an H200 including Triton compiles)::

    python benchmarks/gpu_attention_check.py --out=$OUT/attn.json --budget_s=150
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from unittest import mock

import numpy as np
import torch
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import testing_utils as tu  # noqa: E402

from sparsetp.backends.torch import attention as tattn  # noqa: E402
from sparsetp.bench.attention import torch_first_backward  # noqa: E402
from sparsetp.core import layout as L_core  # noqa: E402
from sparsetp.core import make_layout, reference  # noqa: E402
from sparsetp.core import patterns as P  # noqa: E402
from sparsetp.core.examples import example_pattern  # noqa: E402
from sparsetp.kernels import launch as L  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "attn.json", "where to write the JSON results")
flags.DEFINE_float("budget_s", 150.0, "wall-clock budget; later items are skipped past it")
flags.DEFINE_list("timing_n", ["32768", "8192"], "sequence lengths for the timings")
flags.DEFINE_bool("flex", False, "time FlexAttention too (slow to compile)")
flags.DEFINE_bool("sdpa", False, "time SDPA dense / causal too")
flags.DEFINE_bool("sweep", True, "run the work-order and tile-config sweeps")
flags.DEFINE_list("split_caps", ["16", "32", "64"], "forward split caps C to sweep (issue #8)")
flags.DEFINE_float("rep_ms", 60.0, "do_bench rep (ms) per measurement")
flags.DEFINE_bool("correctness", True, "run the correctness sections")
flags.DEFINE_list("tile_blocks", ["128", "64", "32", "16"],
                  "layout blocks of the kernel-tile sweep (empty: skip it)")
flags.DEFINE_list("tile_patterns", ["causal", "bigbird", "strided_causal"],
                  "patterns also timed at layout blocks 128 and 64 in the kernel-tile sweep")
flags.DEFINE_bool("host_overhead", True, "measure host time per call at N=1024")
flags.DEFINE_bool("direct_launch", True, "direct launch: bitwise check and host time both ways")
flags.DEFINE_integer("direct_launch_rounds", 2, "interleaved rounds of the direct-launch host "
                     "timings (JIT entry, direct)")
flags.DEFINE_bool("bwd_kernels", False, "time each backward kernel alone under config variants")
flags.DEFINE_bool("order_ab", False, "end-to-end A/B of the work orders, interleaved rounds")
flags.DEFINE_multi_integer("order_ab_groups", [2, 4, 8], "head groups the order A/B also times")
flags.DEFINE_list("order_ab_n", ["8192", "32768"], "sequence lengths of the order A/B")
flags.DEFINE_integer("order_ab_rounds", 3, "rounds of the order A/B")
flags.DEFINE_list("kernel_ab", [], "paths of variant copies of sparsetp/kernels/attention.py (e.g."
                  " the baseline from git show; the first is the reference): end-to-end A/B of"
                  " the current kernel sources against them, interleaved rounds in one process."
                  " A name containing 'timing_only' skips the correctness check; one containing"
                  " 'lsebase2' (a variant that stores the base-2 LSE its backward reads) is"
                  " checked on the output and gradients only. A variant whose check raises"
                  " (e.g. does not compile) is recorded as failing and not timed")
flags.DEFINE_integer("kernel_ab_rounds", 3, "rounds of the kernel A/B")
flags.DEFINE_bool("tile_ab", False, "end-to-end A/B of kernel tiles 128 and 64 (explicit tile "
                  "configs, interleaved rounds)")
flags.DEFINE_integer("tile_ab_rounds", 3, "rounds of the tile A/B")
flags.DEFINE_enum("tile_ab_set", "d128", ["d128", "d64", "d64_fwd", "d64_fwd128"], "arms and "
                  "head dim of the tile A/B (TILE_AB_SETS: TILE_AB at D=128, the TILE_AB_D64* "
                  "tables at D=64)")
flags.DEFINE_bool("bwd_streams", False, "backward: dQ and dK/dV one after another vs at once on"
                  " two streams (what a fused launch could gain), interleaved rounds")
flags.DEFINE_string("atomic_dq_ab", None, "path of a variant copy of sparsetp/kernels/"
                    "attention.py whose dK/dV kernel also accumulates dQ with fp32 atomics into "
                    "an extra DQA [B, H, N, D] operand (session 10): end-to-end A/B of the "
                    "tree's three-kernel backward against preprocess + that one kernel, "
                    "interleaved rounds (--kernel_ab_rounds), after its correctness check")
flags.DEFINE_list("atomic_dq_configs", ["8:2:64", "8:2:32"], "warps:stages:sub of the "
                  "atomic-dQ kernel's arms (kernel tile 64; at 4 warps it spills 0.5-1.2 KB on "
                  "Triton 3.6, ptx_probe)")
flags.DEFINE_bool("bwd_tile_ab", False, "end-to-end A/B of the backward with dQ and dK/dV "
                  "each at kernel tile 64 or 128 (a block-128 layout; the forward at the "
                  "policy's tile), interleaved rounds (--kernel_ab_rounds)")
flags.DEFINE_bool("cold", True, "cold-start A/B (fresh Triton cache, parallel compile on/off; "
                  "each child after a trivial autograd backward, --cold_torch_warm_ab)")
flags.DEFINE_integer("cold_child", None, "internal: run one cold-start child and exit")
flags.DEFINE_string("cold_child_kernels", None, "internal: the child's variant kernel copy")
flags.DEFINE_string("host_trace", None, "host-overhead section: also write a Chrome trace "
                    "(torch.profiler, CPU, Python stacks) of 20 fwd+bwd calls through autograd "
                    "here")
flags.DEFINE_bool("cold_profile", False, "cold-start children call the frontend's forward "
                  "and backward directly, each under cProfile, and return the profiles")
flags.DEFINE_bool("cold_trace", False, "cold-start children also record a timeline of what "
                  "the first calls spend: each Triton compile (stage times, thread), each C "
                  "build (launchers, Triton's cuda_utils), each module load, and every "
                  "thread's stack every 20 ms")
flags.DEFINE_bool("cold_torch_warm_ab", False, "cold start (parallel compile) in fresh processes "
                  "with and without a trivial autograd backward first (torch's own one-time "
                  "costs of a first backward with an explicit gradient), alternating over "
                  "--kernel_ab_rounds rounds")
flags.DEFINE_bool("cold_child_torch_warm", False, "internal: the child runs a trivial autograd "
                  "backward with an explicit gradient before the timed calls")
flags.DEFINE_list("cold_ab", [], "variant copies of sparsetp/kernels/attention.py: the cold "
                  "start (parallel compile) of the tree's kernels and of each, in alternating "
                  "order over --kernel_ab_rounds rounds, each in a fresh process and cache")

T0 = time.time()
RESULTS: dict = {"correctness": [], "timing": [], "skipped": [], "errors": []}


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def over_budget(what) -> bool:
    if time.time() - T0 > FLAGS.budget_s:
        RESULTS["skipped"].append(what)
        log(f"SKIP (budget) {what}")
        return True
    return False


def save():
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def anchor_pattern(name: str) -> P.Pattern:
    if name == "causal":
        return P.causal()
    if name == "window":  # |i - j| < 512
        return P.local(511, 511)
    if name == "bigbird":  # 3-block window, 1 global block, 2 random blocks per row
        return P.bigbird(128, 3, 1, 2, seed=0)
    if name == "strided_causal":  # 4 local blocks causal + vertical stride 16, per-head offset
        return (P.block_local(128, 3, 0) | P.strided(16, 128, per_head_offset=True)) & P.causal()
    raise ValueError(name)


# --------------------------------------------------------------------------- correctness
def ratio(actual: torch.Tensor, expected: torch.Tensor, dtype: str, grad: bool) -> float:
    """max |a - e| / (atol + rtol |e|) (<= 1 passes); inf on NaN or mismatched infinities."""
    a, e = actual.double(), expected.double()
    if torch.isnan(a).any():
        return float("inf")
    inf = torch.isinf(e)
    if not torch.equal(torch.isinf(a), inf) or not torch.equal(a[inf], e[inf]):
        return float("inf")
    atol, rtol = tu.tolerance(dtype, grad)
    a, e = a[~inf], e[~inf]
    return float(((a - e).abs() / (atol + rtol * e.abs())).max()) if a.numel() else 0.0


def run_sparse(q, k, v, layout, d_out, scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = tattn.sparse_attention(q, k, v, layout, scale=scale, return_lse=True)
    out.backward(d_out)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check_oracle(name, n, bs, h, d, dtype):
    layout = make_layout(example_pattern(name, n, bs), n, h, bs)
    q, k, v, d_out = tu.random_inputs(n + d, (1, h, n, d), dtype)
    tdt = getattr(torch, dtype)
    dev = [torch.from_numpy(x).to("cuda", tdt) for x in (q, k, v, d_out)]
    got = run_sparse(*dev[:3], layout, dev[3])
    ref_out, ref_lse = reference.attention(q, k, v, layout)
    refs = (ref_out, ref_lse, *reference.attention_grad(q, k, v, layout, d_out))
    names = ("out", "lse", "dq", "dk", "dv")
    r = {nm: ratio(g.cpu(), torch.from_numpy(np.asarray(x)), dtype, nm not in ("out", "lse"))
         for nm, g, x in zip(names, got, refs, strict=True)}
    return r


def ref_fp32(q, k, v, mask, scale, d_out):
    """Dense float32 reference on the GPU (rows with no key: 0 output, -inf lse, 0 grads)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    has = mask.any(-1, keepdim=True)
    s_safe = torch.where(has, s, 0.0)
    lse = torch.where(has[..., 0], torch.logsumexp(s_safe, -1), float("-inf"))
    p = torch.where(has, torch.softmax(s_safe, -1), 0.0)
    out = p @ v
    out.backward(d_out.float())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def check_gpu_size(name, pattern, n, bs, h, d, dtype, poison=False):
    layout = make_layout(pattern, n, h, bs)
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, d_out = (torch.randn(1, h, n, d, device="cuda", generator=g).to(tdt)
                      for _ in range(4))
    ctx = mock.patch.object(
        tattn, "_new_output",
        lambda shape, dt, dev: torch.full(tuple(shape), float("nan"), dtype=dt, device=dev)
    ) if poison else mock.patch.object(tattn, "_new_output", tattn._new_output)
    with ctx:
        got = run_sparse(q, k, v, layout, d_out)
    mask = torch.from_numpy(layout.dense_mask()).to("cuda")[None]
    refs = ref_fp32(q, k, v, mask, d ** -0.5, d_out)
    del mask
    names = ("out", "lse", "dq", "dk", "dv")
    r = {nm: ratio(a, b, dtype, nm not in ("out", "lse"))
         for nm, a, b in zip(names, got, refs, strict=True)}
    return r, (q, k, v, d_out, layout)


def correctness():
    # Under a tight budget (the default) only cases that share compiled kernels with the
    # timings (bf16, D=128, block 128) plus one case per other block size: every new
    # (dtype, D, block) costs ~4 Triton compiles.
    small = [
        ("strided_causal", 333, 128, 2, 128, "bfloat16"), ("causal", 200, 64, 2, 64, "float32"),
        ("local", 250, 32, 2, 32, "float16"), ("random", 180, 16, 2, 16, "float32"),
        ("bigbird", 200, 64, 2, 64, "bfloat16"), ("masked_rows", 150, 64, 2, 64, "float16"),
        ("per_head_mix", 300, 64, 3, 128, "bfloat16"), ("dense", 256, 128, 1, 64, "bfloat16"),
    ][:8 if FLAGS.budget_s > 300 else 4]
    for case in small:
        tag = f"oracle {case}"
        if over_budget(tag):
            continue
        try:
            r = check_oracle(*case)
            ok = all(x <= 1.0 for x in r.values())
            RESULTS["correctness"].append({"kind": "float64 oracle", "case": case,
                                           "ratio": r, "pass": ok})
            log(f"{'PASS' if ok else 'FAIL'} {tag} {r}")
        except Exception as e:  # record and go on: one failing shape must not hide the rest
            RESULTS["errors"].append({"case": tag, "error": traceback.format_exc()})
            log(f"ERROR {tag}: {e!r}")
        save()
    big = [
        ("causal", anchor_pattern("causal"), 8192, 128, 2, 128, "bfloat16", True),
        ("window", anchor_pattern("window"), 8192, 128, 2, 128, "bfloat16", False),
        ("bigbird", anchor_pattern("bigbird"), 8192, 128, 2, 128, "bfloat16", False),
        ("masked_rows", example_pattern("masked_rows", 8192, 64), 8192, 64, 2, 64, "bfloat16",
         False),
        ("bigbird", anchor_pattern("bigbird"), 8192, 128, 2, 64, "float16", False),
        ("strided_causal", anchor_pattern("strided_causal"), 8192, 128, 2, 128, "float16", False),
    ][:6 if FLAGS.budget_s > 300 else 4]
    det_done = False
    for name, pat, n, bs, h, d, dtype, poison in big:
        tag = f"gpu-size {name} N={n} bs={bs} H={h} D={d} {dtype} poison={poison}"
        if over_budget(tag):
            continue
        try:
            r, inputs = check_gpu_size(name, pat, n, bs, h, d, dtype, poison)
            ok = all(x <= 1.0 for x in r.values())
            entry = {"kind": "float32 torch reference", "case": tag, "ratio": r, "pass": ok}
            if not det_done:
                q, k, v, d_out, layout = inputs
                a = run_sparse(q, k, v, layout, d_out)
                b = run_sparse(q, k, v, layout, d_out)
                entry["bitwise_deterministic"] = all(
                    torch.equal(x, y) for x, y in zip(a, b, strict=True))
                det_done = True
            RESULTS["correctness"].append(entry)
            log(f"{'PASS' if ok else 'FAIL'} {tag} {r} "
                f"det={entry.get('bitwise_deterministic', '-')}")
            del inputs
        except Exception as e:
            RESULTS["errors"].append({"case": tag, "error": traceback.format_exc()})
            log(f"ERROR {tag}: {e!r}")
        torch.cuda.empty_cache()
        save()


# --------------------------------------------------------------------------- timing
def flex_block_mask(layout, n):
    from torch.nn.attention.flex_attention import BlockMask

    h, nb, _ = layout.q_index.shape
    kv_num = np.zeros((1, h, nb), np.int32)
    kv_idx = np.zeros((1, h, nb, nb), np.int32)
    full_num = np.zeros((1, h, nb), np.int32)
    full_idx = np.zeros((1, h, nb, nb), np.int32)
    mask_id = np.full((h, nb, nb), -1, np.int32)
    for hh in range(h):
        for i in range(nb):
            c, p = int(layout.q_count[hh, i]), int(layout.q_partial[hh, i])
            kv_num[0, hh, i] = p
            kv_idx[0, hh, i, :p] = layout.q_index[hh, i, :p]
            full_num[0, hh, i] = c - p
            full_idx[0, hh, i, :c - p] = layout.q_index[hh, i, p:c]
            mask_id[hh, i, layout.q_index[hh, i, :p]] = layout.q_mask_id[hh, i, :p]
            mask_id[hh, i, layout.q_index[hh, i, p:c]] = -2  # full tile
    bs = layout.block_size
    masks = torch.from_numpy(layout.masks).cuda()
    mid = torch.from_numpy(mask_id).cuda()

    def mask_mod(b, hd, q_idx, kv_idx_):
        # The exact token mask of the layout (-1 empty tile, -2 full tile, >= 0 a row of the
        # bitmask table). Compiled flex skips mask_mod on full blocks; eager flex does not.
        m = mid[hd, q_idx // bs, kv_idx_ // bs]
        word = masks[m.clamp(min=0), q_idx % bs, (kv_idx_ % bs) // 32]
        return (m == -2) | ((m >= 0) & (((word >> (kv_idx_ % 32)) & 1) == 1))

    t = lambda x: torch.from_numpy(x).cuda()
    return BlockMask.from_kv_blocks(t(kv_num), t(kv_idx), t(full_num), t(full_idx),
                                    BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(n, n))


def bench(fn, grads=None):
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=10, rep=FLAGS.rep_ms, grad_to_none=grads,
                          return_mode="median"))


def timing():
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 64
    flex = None
    if FLAGS.flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention)
    for n in (int(x) for x in FLAGS.timing_n):
        time_n(n, flex)
        torch.cuda.empty_cache()


def time_n(n, flex):
    b, h, d = 1, 16, 128
    if True:  # one indentation level kept from the per-N loop body
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, d_out = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                      generator=g) for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        # SDPA dense reference points.
        for label, causal in (("sdpa_dense", False), ("sdpa_causal", True))[:2 * FLAGS.sdpa]:
            tag = f"{label} N={n}"
            if over_budget(tag):
                continue
            try:
                f = lambda c=causal: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=c)
                fb = lambda c=causal: torch.nn.functional.scaled_dot_product_attention(
                    qg, kg, vg, is_causal=c).backward(d_out)
                e = {"impl": label, "N": n, "fwd_ms": bench(f),
                     "fwd_bwd_ms": bench(fb, [qg, kg, vg])}
                e["fwd_tflops"] = 4 * b * h * n * n * d / (2 if causal else 1) / e["fwd_ms"] / 1e9
                RESULTS["timing"].append(e)
                log(f"{e}")
            except Exception as ex:
                RESULTS["errors"].append({"case": tag, "error": traceback.format_exc()})
                log(f"ERROR {tag}: {ex!r}")
            save()
        for name in ("causal", "window", "bigbird", "strided_causal"):
            tag = f"{name} N={n}"
            if over_budget(f"sparsetp {tag}"):
                continue
            t0 = time.time()
            layout = make_layout(anchor_pattern(name), n, h, 128)
            flops = 4 * b * layout.nnz_blocks * 128 * 128 * d
            log(f"layout {tag}: {time.time() - t0:.2f}s density={layout.density:.4f}")
            try:
                f = lambda lay=layout: tattn.sparse_attention(q, k, v, lay)
                fb = lambda lay=layout: tattn.sparse_attention(qg, kg, vg, lay).backward(d_out)
                e = {"impl": "sparsetp", "pattern": name, "N": n, "density": layout.density,
                     "fwd_ms": bench(f), "fwd_bwd_ms": bench(fb, [qg, kg, vg])}
                e["fwd_tflops"] = flops / e["fwd_ms"] / 1e9
                e["bwd_ms"] = e["fwd_bwd_ms"] - e["fwd_ms"]
                # backward = 5 matmuls of the forward's 2 (dV, dP, dQ, dK + recomputed S).
                e["bwd_tflops"] = 2.5 * flops / e["bwd_ms"] / 1e9
                RESULTS["timing"].append(e)
                log(f"{e}")
            except Exception as ex:
                RESULTS["errors"].append({"case": f"sparsetp {tag}",
                                          "error": traceback.format_exc()})
                log(f"ERROR sparsetp {tag}: {ex!r}")
            save()
            if flex is None or over_budget(f"flex {tag}"):
                continue
            try:
                t0 = time.time()
                bm = flex_block_mask(layout, n)
                # Flex's default D=128 config asked for 256 KiB of shared memory on the H200
                # (limit 227 KiB) in run 1; fall back to smaller tiles when that happens.
                opts = None
                for opts in (None, {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2},
                             {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}):
                    f = lambda bm=bm, o=opts: flex(q, k, v, block_mask=bm, kernel_options=o)
                    fb = lambda bm=bm, o=opts: flex(qg, kg, vg, block_mask=bm,
                                                    kernel_options=o).backward(d_out)
                    try:
                        f()
                        fb()
                        break
                    except Exception as ex:  # noqa: BLE001 - try the next config, logged
                        log(f"flex {tag} kernel_options={opts} failed: {str(ex)[:200]}")
                else:
                    raise RuntimeError(f"flex {tag}: no kernel_options compiled")
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                e = {"impl": "flex", "pattern": name, "N": n, "compile_s": compile_s,
                     "kernel_options": opts,
                     "fwd_ms": bench(f), "fwd_bwd_ms": bench(fb, [qg, kg, vg])}
                e["fwd_tflops"] = flops / e["fwd_ms"] / 1e9
                # Flex vs sparsetp outputs on this input (bf16; both are approximations).
                with torch.no_grad():
                    diff = (f().float() - tattn.sparse_attention(q, k, v, layout).float())
                e["max_abs_diff_vs_sparsetp"] = float(diff.abs().max())
                RESULTS["timing"].append(e)
                log(f"{e}")
            except Exception as ex:
                RESULTS["errors"].append({"case": f"flex {tag}", "error": traceback.format_exc()})
                log(f"ERROR flex {tag}: {ex!r}")
            save()


# --------------------------------------------------------------------------- sweeps
def _tc(bs, warps, stages, sub):
    return L.TileConfig(bs, bs, warps, stages, sub=sub)


def _bwd_cfgs(sub, warps, stages):
    c = _tc(128, warps, stages, sub)
    return {"bwd_dq": c, "bwd_dkdv": c}


# (label, work_order, tile-config overrides). Defaults: see launch.tile_config and
# launch._OPTIONS (bs 128, D 128 bf16: fwd sub 64 / 8 warps / 3 stages; dQ and dK/dV sub 64 /
# 8 warps / 3 stages; heads-fastest longest-first order). Session 3's run4 swept the older
# alternatives (natural order, sub 16 / 128, the tutorial's 4 warps / 5 stages, fwd sub 128 / 32);
# this list checks the new defaults against their predecessors in one run.
SWEEP = [
    ("default", None, {}),
    ("bwd sub64 w8 s2 (old default)", None, _bwd_cfgs(64, 8, 2)),
    # Measured in session 4 (gpu_attention_check_h200_s4_run5): 16 warps ran the backward
    # 1.7-2x and the forward 1.6-1.9x slower than 8 warps; not swept again. Run 6 tried an
    # EVEN_N constexpr (unpredicated loads, no bounds select on full tiles when N % BLOCK == 0):
    # slower (causal fwd 12.17 vs 10.07 ms, BigBird bwd 2.69 vs 2.15), reverted.
]


def sweep():
    n, b, h, d = 32768, 1, 16, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, d_out = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                      for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    layouts = {nm: make_layout(anchor_pattern(nm), n, h, 128)
               for nm in ("causal", "window", "bigbird", "strided_causal")}
    for label, order, cfgs in SWEEP:
        is_fwd = "fwd" in cfgs
        # Tile-config overrides name block 128: pin the kernel tile to the layout's (the
        # default policy may run a block-128 layout in 64-token tiles).
        with L._override(work_order=order, kernel_tile="layout" if cfgs else None, **cfgs):
            tag = f"sweep {label}"
            if over_budget(tag):
                continue
            try:  # correctness first, at a size whose dense fp32 reference is cheap
                ok = True
                for nm in ("bigbird", "causal"):
                    r, _ = check_gpu_size(nm, anchor_pattern(nm), 2048, 128, 2, 128, "bfloat16")
                    ok &= all(x <= 1.0 for x in r.values())
                    RESULTS["correctness"].append({"kind": "float32 torch reference",
                                                   "case": f"{tag} {nm} N=2048", "ratio": r,
                                                   "pass": all(x <= 1.0 for x in r.values())})
                if not ok:
                    log(f"FAIL {tag}: not timed")
                    continue
                for nm, layout in layouts.items():
                    if over_budget(f"{tag} {nm}"):
                        break
                    flops = 4 * b * layout.nnz_blocks * 128 * 128 * d
                    f = lambda lay=layout: tattn.sparse_attention(q, k, v, lay)
                    fb = lambda lay=layout: tattn.sparse_attention(qg, kg, vg, lay).backward(
                        d_out)
                    e = {"impl": "sparsetp", "sweep": label, "pattern": nm, "N": n,
                         "fwd_ms": bench(f)}
                    e["fwd_tflops"] = flops / e["fwd_ms"] / 1e9
                    if not is_fwd:
                        e["fwd_bwd_ms"] = bench(fb, [qg, kg, vg])
                        e["bwd_ms"] = e["fwd_bwd_ms"] - e["fwd_ms"]
                        e["bwd_tflops"] = 2.5 * flops / e["bwd_ms"] / 1e9
                    RESULTS["timing"].append(e)
                    log(f"{e}")
                    save()
            except Exception as ex:
                RESULTS["errors"].append({"case": tag, "error": traceback.format_exc()})
                log(f"ERROR {tag}: {ex!r}")
            save()


def split_sweep():
    """Forward row splitting (issue #8): bigbird vs window forward TFLOP/s per (cap, N)."""
    b, h, d = 1, 16, 128
    caps = [None] + [int(c) for c in FLAGS.split_caps]
    for cap in caps:
        label = f"fwd split_cap={cap}"
        with L._override(split_cap=cap):
            if over_budget(f"sweep {label}"):
                continue
            try:  # correctness first (fwd and bwd from the split forward's out/LSE)
                ok = True
                for nm in ("bigbird", "window"):
                    r, _ = check_gpu_size(nm, anchor_pattern(nm), 2048, 128, 2, 128, "bfloat16",
                                          poison=True)
                    good = all(x <= 1.0 for x in r.values())
                    ok &= good
                    RESULTS["correctness"].append({"kind": "float32 torch reference",
                                                   "case": f"sweep {label} {nm} N=2048 poisoned",
                                                   "ratio": r, "pass": good})
                if not ok:
                    log(f"FAIL sweep {label}: not timed")
                    continue
                for n in (32768, 8192):
                    g = torch.Generator(device="cuda").manual_seed(2)
                    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                           generator=g) for _ in range(3))
                    tflops = {}
                    for nm in ("bigbird", "window"):
                        if over_budget(f"sweep {label} {nm} N={n}"):
                            break
                        layout = make_layout(anchor_pattern(nm), n, h, 128)
                        flops = 4 * b * layout.nnz_blocks * 128 * 128 * d
                        e = {"impl": "sparsetp", "sweep": label, "pattern": nm, "N": n,
                             "fwd_ms": bench(lambda lay=layout, q=q, k=k, v=v:
                                             tattn.sparse_attention(q, k, v, lay))}
                        e["fwd_tflops"] = tflops[nm] = flops / e["fwd_ms"] / 1e9
                        RESULTS["timing"].append(e)
                        log(f"{e}")
                        save()
                    if len(tflops) == 2:
                        RESULTS.setdefault("split_ratio", []).append(
                            {"split_cap": cap, "N": n,
                             "bigbird_over_window": tflops["bigbird"] / tflops["window"]})
                    torch.cuda.empty_cache()
            except Exception as ex:
                RESULTS["errors"].append({"case": f"sweep {label}",
                                          "error": traceback.format_exc()})
                log(f"ERROR sweep {label}: {ex!r}")
            save()


def tile_sweep():
    """Kernel tiles (issue #8 target: blocks 64 and 32 at most 25% slower per computed element
    than block 128 on the window). The window |i - j| < 512 at N = 32768 laid out at blocks
    128 / 64 / 32 / 16, each run at its own block (kernel_tile="layout": the per-element costs
    behind launch._TILE_MODEL) and with the default policy (kernel_tile="auto": the tile
    launch.kernel_layout picks). Each (block, policy) is first checked against the float32
    reference at N = 2048 with poisoned outputs. "Per computed element" always counts the
    elements of the layout as given (its block), whatever tile the kernels ran."""
    n, b, h, d = 32768, 1, 16, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, d_out = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                      for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    cases = [("window", int(bs)) for bs in FLAGS.tile_blocks]
    cases += [(nm, bs) for nm in FLAGS.tile_patterns for bs in (128, 64)]
    for name, bs in cases:
        layout = make_layout(anchor_pattern(name), n, h, bs)
        elems = b * int(layout.q_count.sum()) * bs * bs
        for mode in ("layout", "auto"):
            label = f"tiles {name} block={bs} kernel_tile={mode}"
            tile_of = lambda lay=layout: L.kernel_layout(lay, "cuda", head_dim=d,
                                                         dtype="bfloat16")
            if (mode == "auto" and tile_of() is layout) or over_budget(label):
                continue  # auto == layout: already timed
            with L._override(kernel_tile=mode):
                try:
                    r, _ = check_gpu_size(name, anchor_pattern(name), 2048, bs, 2, 128,
                                          "bfloat16", poison=True)
                    ok = all(x <= 1.0 for x in r.values())
                    RESULTS["correctness"].append({"kind": "float32 torch reference",
                                                   "case": f"{label} N=2048 poisoned",
                                                   "ratio": r, "pass": ok})
                    if not ok:
                        log(f"FAIL {label}: not timed")
                        continue
                    kblock = tile_of().block_size
                    f = lambda: tattn.sparse_attention(q, k, v, layout)
                    fb = lambda: tattn.sparse_attention(qg, kg, vg, layout).backward(d_out)
                    e = {"impl": "sparsetp", "sweep": label, "pattern": name, "N": n,
                         "block": bs, "kernel_block": kblock, "computed_elements": elems,
                         "fwd_ms": bench(f), "fwd_bwd_ms": bench(fb, [qg, kg, vg])}
                    e["bwd_ms"] = e["fwd_bwd_ms"] - e["fwd_ms"]
                    e["fwd_tflops"] = 4 * elems * d / e["fwd_ms"] / 1e9
                    e["bwd_tflops"] = 2.5 * 4 * elems * d / e["bwd_ms"] / 1e9
                    e["fwd_ns_per_kelem"] = e["fwd_ms"] * 1e9 / elems
                    e["bwd_ns_per_kelem"] = e["bwd_ms"] * 1e9 / elems
                    RESULTS["timing"].append(e)
                    log(f"{e}")
                except Exception as ex:
                    RESULTS["errors"].append({"case": label, "error": traceback.format_exc()})
                    log(f"ERROR {label}: {ex!r}")
                save()
    base = {e["sweep"]: e for e in RESULTS["timing"] if e.get("sweep", "").startswith("tiles")}
    cost = {}
    for lbl, e in base.items():
        ref = base.get(f"tiles {e['pattern']} block=128 kernel_tile=layout")
        if ref:
            cost[lbl] = {"fwd": e["fwd_ns_per_kelem"] / ref["fwd_ns_per_kelem"],
                         "bwd": e["bwd_ns_per_kelem"] / ref["bwd_ns_per_kelem"],
                         "fwd_ms_vs_128": e["fwd_ms"] / ref["fwd_ms"],
                         "bwd_ms_vs_128": e["bwd_ms"] / ref["bwd_ms"],
                         "kernel_block": e["kernel_block"]}
    RESULTS["tile_cost"] = cost
    log(f"tile cost per computed element vs block 128 (same pattern): {cost}")
    save()


def _host_us(fn, calls: int = 200, warmup: int = 20) -> float:
    """Host microseconds per call of ``fn`` over ``calls`` back-to-back calls and one sync."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def host_overhead():
    """Host time per call where the GPU has almost nothing to do (N = 1024, window, one head):
    what a small-N backward pays before any kernel runs (launch descriptions, Triton's
    launcher, autograd). Measured with 200 back-to-back calls and one synchronize."""
    n, h, d = 1024, 1, 128
    layout = make_layout(anchor_pattern("window"), n, h, 128)
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, d_out = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                      for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fns = {"fwd": lambda: tattn.sparse_attention(q, k, v, layout),
           "fwd_bwd": lambda: tattn.sparse_attention(qg, kg, vg, layout).backward(d_out)}
    out = {}
    for name, fn in fns.items():
        out[f"{name}_us_per_call"] = _host_us(fn)
        out[f"{name}_gpu_ms_do_bench"] = bench(fn, [qg, kg, vg] if name == "fwd_bwd" else None)
    # The autograd path vs the direct calls: time spent inside the frontend's backward while
    # autograd drives it, and a forward that records the graph.
    inside = []
    real_backward = tattn._backward

    def timed_backward(*a, **kw):
        t = time.perf_counter()
        r = real_backward(*a, **kw)
        inside.append(time.perf_counter() - t)
        return r

    with mock.patch.object(tattn, "_backward", timed_backward):
        out["fwd_bwd_patched_us_per_call"] = _host_us(fns["fwd_bwd"])
    out["backward_inside_autograd_us"] = sum(inside[20:]) / len(inside[20:]) * 1e6
    out["fwd_recording_graph_us_per_call"] = _host_us(
        lambda: tattn.sparse_attention(qg, kg, vg, layout))
    # Autograd's own cost with trivial ops on the same leaves: q * 1 chains, backward.
    out["trivial_autograd_fwd_bwd_us_per_call"] = _host_us(
        lambda: (qg * 1.0 + kg * 1.0 + vg * 1.0).backward(d_out))
    # Where the host time goes: the top functions of 50 backward calls by own time.
    import cProfile
    import io
    import pstats

    # autograd runs CUDA backwards on its own thread, out of cProfile's sight: call the
    # frontend's backward directly (the same code) in this thread.
    out_, lse_ = tattn._forward(q, k, v, layout, d ** -0.5)
    bwd = lambda: tattn._backward(q, k, v, out_, lse_, d_out, None, layout, d ** -0.5)
    out["direct_backward_us_per_call"] = _host_us(bwd)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        bwd()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    out["profile_backward_x50"] = buf.getvalue()[-6000:]
    print(out["profile_backward_x50"], flush=True)
    if FLAGS.host_trace:
        # Both threads' host timelines (autograd runs the backward on its device thread, out of
        # cProfile's sight): torch's profiler with Python stacks, 20 calls after 10 warm ones.
        from torch.profiler import ProfilerActivity, profile

        for _ in range(10):
            fns["fwd_bwd"]()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            for _ in range(20):
                fns["fwd_bwd"]()
            torch.cuda.synchronize()
        prof.export_chrome_trace(FLAGS.host_trace)
        out["host_trace"] = FLAGS.host_trace
    RESULTS["host_overhead"] = out
    log(f"host overhead (N=1024, H=1): {out}")
    save()


def _grads_both_ways(q, k, v, layout, d_out, d_lse):
    """out, lse, dq, dk, dv through Triton's JIT entry point and through the direct launch
    (each path warmed first, so the second call of each is the one compared), plus the number
    of JIT-entry launches the direct path's timed call made (0 when it really ran direct)."""
    def once():
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = tattn.sparse_attention(qg, kg, vg, layout, return_lse=True)
        torch.autograd.backward((out, lse), (d_out, d_lse))
        return [out.detach(), lse.detach(), qg.grad, kg.grad, vg.grad]

    results, jit_calls = {}, {}
    real = tattn._launch
    for direct in (False, True):
        calls = []

        def counted(*a, **kw):
            calls.append(1)
            return real(*a, **kw)

        with mock.patch.object(tattn, "_DIRECT_LAUNCH", direct):
            once()
            with mock.patch.object(tattn, "_launch", counted):
                results[direct] = once()
        jit_calls[direct] = len(calls)
    return results, jit_calls


def direct_launch():
    """Direct launches of the compiled kernels (``attention._DIRECT_LAUNCH``): bitwise equal to
    the JIT entry point (aligned and misaligned inputs, an LSE cotangent), then host time per
    call both ways (N = 1024, window, one head) and do_bench of fwd and fwd+bwd at N = 8192,
    in interleaved rounds."""
    out = {"cases": []}
    h, d = 2, 128
    for name, n, offset in (("window", 2048, 0), ("bigbird", 2048, 0), ("strided_causal", 1000, 0),
                            ("window", 2048, 1)):
        tag = f"direct launch {name} N={n} storage offset {offset}"
        if over_budget(tag):
            continue
        try:
            layout = make_layout(anchor_pattern(name), n, h, 128)
            g = torch.Generator(device="cuda").manual_seed(7)
            base = [torch.randn(1 * h * n * d + offset, device="cuda", generator=g)
                    .to(torch.bfloat16) for _ in range(4)]
            # offset 1 element (2 bytes): pointers not 16-byte aligned, another specialisation
            q, k, v, d_out = (x[offset:].view(1, h, n, d) for x in base)
            d_lse = torch.randn(1, h, n, device="cuda", generator=g)
            res, jit_calls = _grads_both_ways(q, k, v, layout, d_out, d_lse)
            same = {nm: bool(torch.equal(a, b)) for nm, a, b in zip(
                ("out", "lse", "dq", "dk", "dv"), res[False], res[True], strict=True)}
            e = {"case": tag, "bitwise_equal": same, "jit_entry_calls": jit_calls,
                 "pass": all(same.values()) and jit_calls[True] == 0 and jit_calls[False] == 4}
            RESULTS["correctness"].append({"kind": "direct launch vs JIT entry (bitwise)", **e})
            out["cases"].append(e)
            log(f"{'ok  ' if e['pass'] else 'FAIL'} {tag}: {same} jit calls {jit_calls}")
        except Exception as ex:
            RESULTS["errors"].append({"case": tag, "error": traceback.format_exc()})
            log(f"ERROR {tag}: {ex!r}")
        save()
    if over_budget("direct launch host time"):
        return
    # Host time by launch path, in interleaved rounds. (Session 11 also timed raw device
    # pointers instead of tensors in the direct launch: no difference, not kept.)
    paths = {"jit_entry": False, "direct": True}
    n, h1 = 1024, 1
    layout = make_layout(anchor_pattern("window"), n, h1, 128)
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, d_out = (torch.randn(1, h1, n, d, device="cuda", dtype=torch.bfloat16,
                                  generator=g) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out_, lse_ = tattn._forward(q, k, v, layout, d ** -0.5)
    big = {}
    for nm in ("window", "strided_causal", "bigbird"):
        n8, h16 = 8192, 16
        q8, k8, v8, do8 = (torch.randn(1, h16, n8, d, device="cuda", dtype=torch.bfloat16,
                                       generator=g) for _ in range(4))
        big[nm] = (make_layout(anchor_pattern(nm), n8, h16, 128), q8, k8, v8, do8,
                   *(t.clone().requires_grad_() for t in (q8, k8, v8)))
    for r in range(FLAGS.direct_launch_rounds):
        for path in (paths if r % 2 == 0 else list(paths)[::-1]):
            if over_budget(f"direct launch host time {path} round {r}"):
                return
            with mock.patch.object(tattn, "_DIRECT_LAUNCH", paths[path]):
                e = {"round": r,
                     "fwd_us_per_call": _host_us(lambda: tattn.sparse_attention(q, k, v, layout)),
                     "direct_backward_us_per_call": _host_us(
                         lambda: tattn._backward(q, k, v, out_, lse_, d_out, None, layout,
                                                 d ** -0.5)),
                     "fwd_bwd_us_per_call": _host_us(
                         lambda: tattn.sparse_attention(qg, kg, vg, layout).backward(d_out))}
                for nm, (lay, q8, k8, v8, do8, qg8, kg8, vg8) in big.items():
                    e[f"{nm}_N8192_fwd_ms"] = bench(
                        lambda: tattn.sparse_attention(q8, k8, v8, lay))
                    e[f"{nm}_N8192_fwd_bwd_ms"] = bench(
                        lambda: tattn.sparse_attention(qg8, kg8, vg8, lay).backward(do8),
                        [qg8, kg8, vg8])
            out.setdefault(path, []).append(e)
            log(f"host/launch {path} round {r}: {e}")
            save()
    RESULTS["direct_launch"] = out
    save()


def _captured(fn):
    """``fn()`` run with every launch of the torch frontend recorded: the list of
    ``(description, tensors, outputs)``, in order, for re-launching through ``tattn._run``."""
    launches = []
    real_run = tattn._run

    def record(desc, tensors, outputs, kind):
        launches.append((desc, tensors, outputs))
        return real_run(desc, tensors, outputs, kind)

    with mock.patch.object(tattn, "_run", record):
        fn()
    return launches


# Backward kernel configs timed one kernel at a time (D=128, bf16): (kernel tile, kernel,
# (sub, warps, stages)); kernel None = the defaults at that tile. Each alternative changes one
# kernel's config.
BWD_KERNEL_CONFIGS = [
    (128, None, None), (128, None, None, "longest_first_bh"),
    (64, None, None), (64, None, None, "longest_first_bh"),
]
flags.DEFINE_list("bwd_kernel_patterns", ["causal", "window", "strided_causal", "bigbird"],
                  "patterns of the per-kernel backward timings")
flags.DEFINE_list("bwd_kernel_n", ["32768"], "sequence lengths of the per-kernel timings")


def bwd_kernels():
    """GPU time of each backward kernel alone (preprocess, dQ, dK/dV; and the forward) at the
    ``--bwd_kernel_n`` lengths for layouts at block 128 run at kernel tiles 128 and 64, under
    the default configs and the alternatives in BWD_KERNEL_CONFIGS (each first checked against
    the fp32 reference at N = 2048): which kernel the backward's time goes to, and whether dQ
    and dK/dV want different tiles/configs."""
    for n in (int(x) for x in FLAGS.bwd_kernel_n):
        _bwd_kernels_at(n)


def _bwd_kernels_at(n):
    b, h, d = 1, 16, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, d_out = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                      for _ in range(4))
    # The same token masks laid out at each tile (what launch.kernel_layout does), run at
    # exactly that tile.
    tiles = sorted({c[0] for c in BWD_KERNEL_CONFIGS}, reverse=True)
    by_tile = {t: {nm: make_layout(anchor_pattern(nm), n, h, t)
                   for nm in FLAGS.bwd_kernel_patterns} for t in tiles}
    fwd = {nm: tattn._forward(q, k, v, lay, d ** -0.5) for nm, lay in by_tile[128].items()}
    rows = RESULTS.setdefault("bwd_kernels", [])
    for tile, kname, c, *order in BWD_KERNEL_CONFIGS:
        order = order[0] if order else None
        layouts = by_tile[tile]
        cfgs = {} if kname is None else {kname: L.TileConfig(tile, tile, c[1], c[2], sub=c[0])}
        tag = (f"bwd kernels N={n} tile {tile} {kname or 'default'} {c or ''} "
               f"order {order or 'default'}")
        if over_budget(tag):
            continue
        try:
            with L._override(kernel_tile="layout", work_order=order, **cfgs):
                r, _ = check_gpu_size("causal", anchor_pattern("causal"), 2048, tile, 2, 128,
                                      "bfloat16")
                ok = all(x <= 1.0 for x in r.values())
                RESULTS["correctness"].append({"kind": "float32 torch reference",
                                               "case": f"{tag} causal N=2048", "ratio": r,
                                               "pass": ok})
                if not ok:
                    log(f"FAIL {tag}")
                    continue
                for nm, layout in layouts.items():
                    out_, lse_ = fwd[nm]
                    launches = _captured(lambda: tattn._backward(
                        q, k, v, out_, lse_, d_out, None, layout, d ** -0.5))
                    launches += _captured(lambda: tattn._forward(q, k, v, layout, d ** -0.5))
                    e = {"pattern": nm, "N": n, "tile": tile, "kernel": kname,
                         "work_order": order or L._OPTIONS["work_order"],
                         "config": None if c is None else {"sub": c[0], "warps": c[1],
                                                           "stages": c[2]}}
                    for desc, tensors, outputs in launches:
                        e[f"{desc.call.name}_ms"] = bench(
                            lambda: tattn._run(desc, tensors, outputs, "cuda"))
                        e[f"{desc.call.name}_config"] = (desc.call.constexprs.get("SUB_M")
                                                         or desc.call.constexprs.get("SUB_N"),
                                                         desc.call.num_warps,
                                                         desc.call.num_stages)
                    rows.append(e)
                    log(f"{tag}: {e}")
        except Exception as ex:
            RESULTS["errors"].append({"case": tag, "error": traceback.format_exc()})
            log(f"ERROR {tag}: {ex!r}")
        save()


def _interleaved(tag, arms, rounds, tensors, lays):
    """Medians (fwd ms, fwd+bwd ms) per arm and the raw rows, the arms (name -> a function
    returning the context to time under) interleaved over ``rounds``, every other round in
    reverse order; None past the budget.
    ``lays``: the layout each arm runs (arm -> layout)."""
    q, k, v, qg, kg, vg, d_out = tensors
    rows = {a: [] for a in arms}
    for r in range(rounds):
        # Odd rounds run the arms in reverse, so no arm always runs right after the same one
        # (session 8: the last arm of a round read up to 6 % slow in one run).
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            context = arms[a]
            if over_budget(tag):
                return None
            la = lays[a]
            with context():
                f = bench(lambda: tattn.sparse_attention(q, k, v, la))
                fb = bench(lambda: tattn.sparse_attention(qg, kg, vg, la).backward(d_out),
                           [qg, kg, vg])
            rows[a].append((f, fb))
    med = {a: [float(np.median([r[i] for r in rows[a]])) for i in (0, 1)] for a in arms}
    return med, rows


def _ab_checked(label, bs, poison=False, d=128, unchecked=()) -> bool:
    """The correctness gate of an A/B arm, under the caller's context: causal and BigBird at
    N=2048 and the window at ragged N=2000 (block ``bs``, H=2, head dim ``d``, bf16) against
    the float32 reference, each recorded in RESULTS. True when all three pass. ``unchecked``
    names outputs (of out, lse, dq, dk, dv) the arm is not compared on."""
    passed = True
    for nm, n in (("causal", 2048), ("bigbird", 2048), ("window", 2000)):
        r, _ = check_gpu_size(nm, anchor_pattern(nm), n, bs, 2, d, "bfloat16", poison=poison)
        r = {k: x for k, x in r.items() if k not in unchecked}
        ok = all(x <= 1.0 for x in r.values())
        case = f"{label} {nm} N={n} D={d}" + (" poisoned" if poison else "")
        RESULTS["correctness"].append({"kind": "float32 torch reference", "case": case,
                                       "ratio": r, "pass": ok})
        log(f"{case}: {r} {'ok' if ok else 'FAIL'}")
        passed &= ok
    return passed


def _ab_tensors(n, seed, d=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, d_out = (torch.randn(1, 16, n, d, device="cuda", dtype=torch.bfloat16,
                                  generator=g) for _ in range(4))
    return (q, k, v, *(t.clone().requires_grad_() for t in (q, k, v)), d_out)


def _bitwise_alike(case, arms, tensors, lays) -> bool:
    """Whether every arm (running ``lays[arm]``) gives the first arm's out, LSE, dQ, dK and dV
    bit for bit (a dispatch order changes which program runs when, never what it computes),
    recorded in RESULTS."""
    q, k, v, *_, d_out = tensors
    got = {}
    for a, context in arms.items():
        with context():
            got[a] = run_sparse(q, k, v, lays[a], d_out)
    first = next(iter(got))
    differ = [f"{a} {w}" for a in got for w, x, y in zip(("out", "lse", "dq", "dk", "dv"),
                                                         got[a], got[first], strict=True)
              if not torch.equal(x, y)]
    ok = not differ
    RESULTS["correctness"].append({"kind": f"bitwise equal to arm {first}", "case": case,
                                   "arms": list(arms), "differ": differ, "pass": ok})
    log(f"{case}: arms bitwise equal to {first}: {ok} {differ or ''}")
    return ok


def _session7_head_group(count, concurrent, rule=L_core.head_group):
    """Session 7's head-order rule, for the A/B: all heads interleaved or one after another
    (nothing between), with 132 programs at once whatever the tile; i.e. today's ``rule`` at
    132 programs with every group above 1 widened to all heads. (``rule`` is bound here
    because :func:`_kernel_layouts` patches ``layout.head_group`` with this function.)"""
    heads = np.asarray(count).shape[0]
    return 1 if rule(count, 132) == 1 else heads


def _kernel_layouts(nm, n):
    """The block-128 target layout under the current head-order rule and under session 7's
    (``_session7_head_group``), each with its kernel layout built (and cached) under that
    rule, so the launches use each rule's head groups. -> (current, session 7)."""
    def build():
        lay = make_layout(anchor_pattern(nm), n, 16, 128)
        L.kernel_layout(lay, "cuda", head_dim=128, dtype="bfloat16")
        return lay

    current = build()
    with mock.patch.object(L_core, "head_group", _session7_head_group):
        old = build()
    return current, old


def _groups(lay):
    kl = L.kernel_layout(lay, "cuda", head_dim=128, dtype="bfloat16")
    return [kl.block_size, kl.q_head_group, kl.k_head_group]


def order_ab():
    """End-to-end fwd and fwd+bwd (the targets' shapes: bf16, B=1, H=16, D=128, block 128,
    kernel tiles by policy) under each head order, interleaved over rounds in one process (the
    order is a grid shape, so switching compiles nothing): medians per (arm, pattern, N), after
    checking that every arm's results are bitwise equal. Arms: ``auto`` (the layout's head
    groups), ``s7`` (session 7's rule, :func:`_session7_head_group`), ``longest_first_bh`` (all
    heads interleaved), ``longest_first`` (one after another), ``g<G>`` (groups of G)."""
    orders = ("auto", "longest_first_bh", "longest_first")
    arms = {o: (lambda o=o: L._override(work_order=o)) for o in orders}
    arms["s7"] = arms["auto"]
    arms.update({f"g{g}": (lambda g=g: L._override(head_group=g))
                 for g in FLAGS.order_ab_groups})
    for n in map(int, FLAGS.order_ab_n):
        tensors = _ab_tensors(n, 9)
        for nm in ("causal", "window", "bigbird", "strided_causal"):
            current, old = _kernel_layouts(nm, n)
            lays = {a: old if a == "s7" else current for a in arms}
            if not _bitwise_alike(f"order A/B {nm} N={n}", arms, tensors, lays):
                continue
            got = _interleaved(f"order A/B {nm} N={n}", arms, FLAGS.order_ab_rounds, tensors,
                               lays)
            if got is None:
                return
            summary, rows = got
            log(f"order A/B {nm} N={n} (fwd, fwd+bwd ms medians of 3; kernel tile, q / k head "
                f"groups: auto {_groups(current)}, s7 {_groups(old)}): {summary}")
            RESULTS.setdefault("order_ab", {})[f"{nm} N={n}"] = {
                "medians_fwd_fwd_bwd_ms": summary,
                "tile_q_k_head_groups": {"auto": _groups(current), "s7": _groups(old)},
                "raw": rows}
            save()


def kernel_ab():
    """End-to-end fwd and fwd+bwd of the current kernel sources and of variant copies of
    ``sparsetp/kernels/attention.py`` (``--kernel_ab``, named by file stem; the first is the
    reference of the ratios), interleaved over rounds in one process (the targets' shapes: bf16,
    B=1, H=16, D=128, block 128, default policy), after checking each variant against the float32
    reference at N=2048 (causal, bigbird) and ragged N=2000 (window). Variants are swapped in
    with ``launch._using_kernels``; each compiles once (Triton caches per kernel object)."""
    variants = {os.path.splitext(os.path.basename(p))[0].lstrip("."): L._load_kernels(p)
                for p in FLAGS.kernel_ab}
    ref = next(iter(variants))
    variants["current"] = dict(L._KERNELS)

    arms = {v: (lambda v=v: L._using_kernels(variants[v])) for v in variants}
    # A variant that stores the base-2 LSE its backward reads ("lsebase2") is compared on the
    # output and the gradients only; timing_only ones are never checked. A variant that fails
    # its check is not timed.
    failed = {v for v in variants if "timing_only" not in v and not _arm_checked(
        f"kernel A/B {v}", 128, arms[v], unchecked=("lse",) if "lsebase2" in v else ())}
    if ref in failed:
        log(f"kernel A/B: the reference {ref} failed its check; nothing timed")
        return
    _ab_timed("kernel_ab", "kernel A/B", {v: a for v, a in arms.items() if v not in failed},
              ref, 11)


def _arm_checked(name, bs, context, unchecked=()) -> bool:
    """:func:`_ab_checked` of an A/B arm under ``context()``; an arm whose check raises (e.g.
    does not compile) is recorded as a failing correctness case."""
    with context():
        try:
            return _ab_checked(name, bs, unchecked=unchecked)
        except Exception:  # noqa: BLE001 - an arm that does not run is not timed
            log(f"{name}: check raised\n{traceback.format_exc()}")
            RESULTS["correctness"].append({"kind": "float32 torch reference", "case": name,
                                           "pass": False,
                                           "error": traceback.format_exc()[-2000:]})
            return False


def _ab_timed(section, label, arms, ref, seed, tile=None):
    """Interleaved fwd and fwd+bwd of ``arms`` (name -> context factory) at the targets'
    shapes (bf16, B=1, H=16, D=128, block-128 layouts of the four anchor patterns, N=8192 and
    32768), with ratios ``ref`` / arm, recorded under ``RESULTS[section]``. ``tile``: skip a
    row whose policy kernel tile is not that."""
    for n in (8192, 32768):
        tensors = _ab_tensors(n, seed)
        for nm in ("causal", "window", "bigbird", "strided_causal"):
            lay = make_layout(anchor_pattern(nm), n, 16, 128)
            kernel_tile = _groups(lay)[0]
            if tile is not None and kernel_tile != tile:
                log(f"{label} {nm} N={n}: kernel tile {kernel_tile}, not {tile}; skipped")
                continue
            got = _interleaved(f"{label} {nm} N={n}", arms, FLAGS.kernel_ab_rounds, tensors,
                               dict.fromkeys(arms, lay))
            if got is None:
                return
            med, rows = got
            speed = {a: {w: med[ref][i] / med[a][i] for i, w in enumerate(("fwd", "fwd_bwd"))}
                     for a in arms}
            log(f"{label} {nm} N={n} (fwd, fwd+bwd ms medians; policy kernel tile "
                f"{kernel_tile}): {med}; {ref}/arm {speed}")
            RESULTS.setdefault(section, {})[f"{nm} N={n}"] = {
                "medians_fwd_fwd_bwd_ms": med, f"{ref}_over_arm": speed,
                "kernel_tile": kernel_tile, "raw": rows}
            save()


def _atomic_dq_backward(q, k, v, out, lse, d_out, d_lse, layout, scale):
    """``tattn._backward`` with dQ accumulated inside the dK/dV kernel of the kernels in use (a
    variant: ``--atomic_dq_ab``): the preprocess, a zeroed fp32 dQ, one list kernel, a cast.
    Launched through Triton's JIT entry (no description cache, no direct launch): the host
    costs a little more than the tree's path, which matters only where the host is the floor."""
    if d_lse is not None:
        raise NotImplementedError("the atomic-dQ A/B times out.backward(d_out) only")
    kind = tattn._device_kind(q)
    dtype = str(q.dtype).replace("torch.", "")
    meta = tattn._metadata(layout, q, kind)
    delta = torch.empty(lse.shape, dtype=lse.dtype, device=q.device)
    tattn._launch(L.bwd_preprocess_call(out, d_out, block_size=int(meta["masks"].shape[1]),
                                        dtype=dtype, device_kind=kind), (delta,), kind)
    dqa = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    call = L.bwd_dkdv_call(q, k, v, d_out, lse, delta, meta, scale=scale, dtype=dtype,
                           device_kind=kind)
    tattn._launch(call, (dk, dv, dqa, *dqa.stride()), kind)
    return dqa.to(q.dtype), dk, dv


def atomic_dq_ab():
    """End-to-end fwd and fwd+bwd, the tree's backward (preprocess, dQ, dK/dV: 7 MMAs per tile
    pair, deterministic) against FlashAttention-2's (dQ from dK/dV's dS^T with fp32 atomics:
    5 MMAs, not bitwise deterministic in dQ), interleaved over rounds at the targets' shapes,
    after the variant's correctness check (the arm runs :func:`_atomic_dq_backward` with the
    variant's kernels swapped in)."""
    variant = L._load_kernels(FLAGS.atomic_dq_ab)

    @contextlib.contextmanager
    def atomic(warps, stages, sub):
        with (L._override(bwd_dkdv=_tc(64, warps, stages, sub)), L._using_kernels(variant),
              mock.patch.object(tattn, "_backward", _atomic_dq_backward)):
            yield

    # The arms' config is for kernel tile 64, the policy's tile for the timed rows (checked
    # below); the check runs layouts of block 64.
    arms = {"tree": contextlib.nullcontext}
    for c in FLAGS.atomic_dq_configs:
        warps, stages, sub = map(int, c.split(":"))
        name = f"atomic_w{warps}_s{stages}_sub{sub}"
        arm = lambda w=warps, st=stages, sb=sub: atomic(w, st, sb)
        if _arm_checked(name, 64, arm):
            arms[name] = arm
        else:
            log(f"{name}: failed its check; not timed")
    if len(arms) > 1:
        _ab_timed("atomic_dq_ab", "atomic dQ A/B", arms, "tree", 13, tile=64)


_TILE_LAYOUTS: dict = {}


def _mixed_tile_backward(dq_tile: int, dkdv_tile: int):
    """A ``tattn._backward`` for a block-128 layout with dQ at kernel tile ``dq_tile`` and
    dK/dV at ``dkdv_tile`` (64: the pattern laid out at block 64; 128: the layout itself), each
    at its default config for that tile. Per-token LSE and Delta do not depend on the tile, so
    any mix computes the same gradients. Launched through Triton's JIT entry (as
    :func:`_atomic_dq_backward`)."""
    def backward(q, k, v, out, lse, d_out, d_lse, layout, scale):
        if d_lse is not None or layout.block_size != 128:
            raise NotImplementedError("the tile A/B times block-128 layouts, out.backward only")
        kind = tattn._device_kind(q)
        dtype = str(q.dtype).replace("torch.", "")
        if layout not in _TILE_LAYOUTS:
            _TILE_LAYOUTS.clear()
            _TILE_LAYOUTS[layout] = {128: layout, 64: make_layout(
                layout.pattern, layout.seq_len, layout.num_heads, 64)}
        with L._override(kernel_tile="layout"):
            meta = {t: tattn._metadata(_TILE_LAYOUTS[layout][t], q, kind) for t in (64, 128)}
        delta = torch.empty(lse.shape, dtype=lse.dtype, device=q.device)
        tattn._launch(L.bwd_preprocess_call(out, d_out, block_size=64, dtype=dtype,
                                            device_kind=kind), (delta,), kind)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        kw = dict(scale=scale, dtype=dtype, device_kind=kind)
        ins = (q, k, v, d_out, lse, delta)
        tattn._launch(L.bwd_dq_call(*ins, meta[dq_tile], **kw), (dq,), kind)
        tattn._launch(L.bwd_dkdv_call(*ins, meta[dkdv_tile], **kw), (dk, dv), kind)
        return dq, dk, dv
    return backward


def bwd_tile_ab():
    """End-to-end fwd and fwd+bwd with dQ and dK/dV each at kernel tile 64 or 128 (arm
    ``q<dQ tile>_k<dK/dV tile>``; ``tree``: the frontend's own backward), interleaved over
    rounds at the targets' shapes, after each arm's correctness check. FlexAttention's backward
    walks 128 keys per dK/dV program and 128 queries per dQ program, half the L2 -> SM bytes of
    our tile 64, at the same power cap (session 9); this asks which mix costs least."""
    arms = {"tree": contextlib.nullcontext}
    for tq in (64, 128):
        for tk in (64, 128):
            name = f"q{tq}_k{tk}"
            arm = lambda tq=tq, tk=tk: mock.patch.object(tattn, "_backward",
                                                         _mixed_tile_backward(tq, tk))
            if _arm_checked(name, 128, arm):
                arms[name] = arm
    _ab_timed("bwd_tile_ab", "bwd tile A/B", arms, "tree", 17)


def _arm(bs, fwd, bwd):
    """A tile-A/B arm: (block, configs) with the forward at ``fwd`` and both backward kernels
    at ``bwd``, each (warps, stages, sub)."""
    return bs, {"fwd": _tc(bs, *fwd), "bwd_dq": _tc(bs, *bwd), "bwd_dkdv": _tc(bs, *bwd)}


# (layout block, explicit configs of fwd / dQ / dK/dV): explicit so that the arms do not move
# when the defaults do. "t128" is the session-6 default at block 128; "t64_s4" the session-4
# defaults at 64; "t64" one warpgroup per program, two programs per SM (ncu, session 7 run 1:
# causal N=8192 dK/dV 1.56 -> 1.26 ms, dQ 0.97 -> 0.91, forward 0.88 -> 0.78).
TILE_AB = {
    "t128": _arm(128, (8, 3, 64), (8, 3, 64)),
    "t64": _arm(64, (4, 3, 64), (4, 2, 64)),
    "t64_fwd_s2": _arm(64, (4, 2, 64), (4, 2, 64)),
    "t64_s4": _arm(64, (4, 3, 64), (4, 3, 32)),
}
# Head dim 64 (open lead 7 of session 7): what tile_config gives today at tiles 64 and 128
# (the backward's sub 32 / 3 stages), and the tile-64 backward with 64-row sub-tiles.
TILE_AB_D64 = {
    "t64": _arm(64, (4, 3, 64), (4, 3, 32)),
    "t64_s64_2": _arm(64, (4, 3, 64), (4, 2, 64)),
    "t64_s64_3": _arm(64, (4, 3, 64), (4, 3, 64)),
    "t128": _arm(128, (8, 3, 64), (8, 3, 32)),
}
# Head dim 64, the forward at tile 64: 2 / 4 stages and 8 warps against tile_config's
# 4 warps / 3 stages (at D=64 a stage of K and V sub-tiles is 16 KB).
TILE_AB_D64_FWD = {
    "t64": TILE_AB_D64["t64"],
    "t64_f2": _arm(64, (4, 2, 64), (4, 3, 32)),
    "t64_f4": _arm(64, (4, 4, 64), (4, 3, 32)),
    "t64_w8": _arm(64, (8, 3, 64), (4, 3, 32)),
    "t128": TILE_AB_D64["t128"],
}
# Head dim 64, the forward at tile 128 (Flex's causal forward at N=32768, D=64 beat our tile-64
# one by 10 %, session 8 run 6): 4 warps, and 8 warps with 128-key sub-tiles.
TILE_AB_D64_FWD128 = {
    "t64": TILE_AB_D64["t64"],
    "t128": TILE_AB_D64["t128"],
    "t128_w4": _arm(128, (4, 3, 64), (8, 3, 32)),
    "t128_s128": _arm(128, (8, 2, 128), (8, 3, 32)),
}
TILE_AB_SETS = {"d128": (128, TILE_AB), "d64": (64, TILE_AB_D64),
                "d64_fwd": (64, TILE_AB_D64_FWD), "d64_fwd128": (64, TILE_AB_D64_FWD128)}


def tile_ab():
    """End-to-end fwd and fwd+bwd of the target patterns (bf16, B=1, H=16) run at kernel tiles
    128 and 64 under the explicit configs of the ``--tile_ab_set`` (:data:`TILE_AB_SETS`: head
    dim and arms; the same token mask laid out at each arm's block, pinned with
    ``kernel_tile="layout"``), interleaved over rounds in one process, after a float32-reference
    check of every arm (causal and BigBird at N=2048, the window at ragged N=2000, poisoned
    outputs). Ratios are against arm ``t128``."""
    d, table = TILE_AB_SETS[FLAGS.tile_ab_set]

    def arm(name):
        return lambda: L._override(kernel_tile="layout", **table[name][1])

    failed = set()
    for a, (bs, _) in table.items():
        with arm(a)():
            if not _ab_checked(f"tile A/B {a}", bs, poison=True, d=d):
                failed.add(a)
    arms = {a: arm(a) for a in table if a not in failed}
    for n in (8192, 32768):
        tensors = _ab_tensors(n, 13, d)
        for nm in ("causal", "window", "bigbird", "strided_causal"):
            lays = {a: make_layout(anchor_pattern(nm), n, 16, table[a][0]) for a in arms}
            got = _interleaved(f"tile A/B {nm} N={n} D={d}", arms, FLAGS.tile_ab_rounds,
                               tensors, lays)
            if got is None:
                return
            med, rows = got
            speed = {a: {w: med["t128"][i] / med[a][i] for i, w in enumerate(("fwd", "fwd_bwd"))}
                     for a in arms} if "t128" in arms else {}
            log(f"tile A/B {nm} N={n} D={d} (fwd, fwd+bwd ms medians): {med}; t128/arm "
                f"{speed}")
            RESULTS.setdefault("tile_ab", {})[f"{nm} N={n}" + ("" if d == 128 else f" D={d}")] = {
                "medians_fwd_fwd_bwd_ms": med, "t128_over_arm": speed, "raw": rows,
                "row_tiles": {a: lays[a].num_blocks for a in arms},
                "computed_elements": {a: int(lays[a].q_count.sum()) * table[a][0] ** 2
                                      for a in arms}}
            save()


def bwd_streams():
    """Would running dQ and dK/dV at the same time pay (Flex launches both in one kernel)?
    The backward's three launches (preprocess, dQ, dK/dV) as the torch frontend builds them,
    timed one after another on one stream and with dQ on a second stream concurrently with
    dK/dV (after the preprocess), interleaved over 3 rounds (bf16, B=1, H=16, D=128, block 128,
    default policy). The two-stream result is checked bitwise against the one-stream one."""
    for n in (8192, 32768):
        q, k, v, *_, d_out = _ab_tensors(n, 13)
        side = torch.cuda.Stream()
        for nm in ("causal", "window", "bigbird", "strided_causal"):
            if over_budget(f"bwd streams {nm} N={n}"):
                return
            lay = make_layout(anchor_pattern(nm), n, 16, 128)
            out_, lse_ = tattn._forward(q, k, v, lay, 128 ** -0.5)
            launches = _captured(lambda: tattn._backward(q, k, v, out_, lse_, d_out, None, lay,
                                                         128 ** -0.5))
            (pre, *grads) = launches
            names = [d.call.name for d, *_ in launches]
            assert names == ["bwd_preprocess", "bwd_dq", "bwd_dkdv"], names

            def one_stream():
                for desc, tensors, outputs in launches:
                    tattn._run(desc, tensors, outputs, "cuda")

            def two_streams():
                tattn._run(*pre, "cuda")
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    tattn._run(*grads[0], "cuda")
                tattn._run(*grads[1], "cuda")
                torch.cuda.current_stream().wait_stream(side)

            outs = [t for _, _, o in grads for t in o]
            one_stream()
            ref = [t.clone() for t in outs]
            for t in outs:
                t.fill_(float("nan"))
            two_streams()
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
            RESULTS["correctness"].append({"kind": "bitwise", "case":
                                           f"bwd two streams vs one {nm} N={n}", "pass": same})
            rows = {"one_stream": [], "two_streams": []}
            for _ in range(3):
                for key, fn in (("one_stream", one_stream), ("two_streams", two_streams)):
                    rows[key].append(bench(fn))
            med = {key: float(np.median(r)) for key, r in rows.items()}
            log(f"bwd streams {nm} N={n}: bitwise={same} medians ms {med} "
                f"one/two {med['one_stream'] / med['two_streams']:.3f}")
            RESULTS.setdefault("bwd_streams", {})[f"{nm} N={n}"] = {"medians_ms": med,
                                                                    "raw": rows,
                                                                    "bitwise": same}
            save()


def cold_child(parallel: bool):
    """In a fresh process with an empty Triton cache: wall time of the first forward and the
    first backward of the window at N = 8192 (bf16, D = 128, block 128); with
    ``--cold_child_kernels``, of that variant's kernels; with ``--cold_child_torch_warm``, after
    a trivial autograd backward (timed apart as ``torch_warm_s``)."""
    tattn._PARALLEL_COMPILE = parallel
    src = FLAGS.cold_child_kernels
    with L._using_kernels(L._load_kernels(src)) if src else contextlib.nullcontext():
        _cold_calls(parallel, src)


def _cold_calls(parallel, src):
    n, h, d = 8192, 16, 128
    layout = make_layout(anchor_pattern("window"), n, h, 128)
    q, k, v, d_out = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16)
                      for _ in range(4))
    q.requires_grad_()
    torch.cuda.synchronize()
    torch_warm_s = None
    if FLAGS.cold_child_torch_warm:  # torch's once-per-process import, timed apart
        t = time.perf_counter()
        torch_first_backward("cuda")
        torch.cuda.synchronize()
        torch_warm_s = time.perf_counter() - t
    if FLAGS.cold_profile:
        _cold_profile(q, k, v, d_out, layout, parallel, src, torch_warm_s)
        return
    trace = _ColdTrace() if FLAGS.cold_trace else contextlib.nullcontext()
    with trace:
        t0 = time.perf_counter()
        out = tattn.sparse_attention(q, k, v, layout)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out.backward(d_out)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    rec = {"parallel_compile": parallel, "kernels": src or "tree",
           "torch_warm_s": torch_warm_s, "cold_fwd_s": t1 - t0, "cold_bwd_s": t2 - t1}
    if FLAGS.cold_trace:
        rec["trace"] = trace.events(t0, {"fwd": (t0, t1), "bwd": (t1, t2)})
    print("COLD " + json.dumps(rec), flush=True)


def _cold_profile(q, k, v, d_out, layout, parallel, src, torch_warm_s):
    """The cold first forward and backward called directly (not through autograd, whose
    backward thread cProfile does not see), each under cProfile: where the first calls' time
    goes outside the compiles themselves."""
    import cProfile
    import io
    import pstats

    scale = q.shape[-1] ** -0.5
    rec = {"parallel_compile": parallel, "kernels": src or "tree", "torch_warm_s": torch_warm_s,
           "profile": {}}
    res = {}
    calls = {"fwd": lambda: res.update(fwd=tattn._forward(q, k, v, layout, scale)),
             "bwd": lambda: tattn._backward(q, k, v, *res["fwd"], d_out, None, layout, scale)}
    for name, fn in calls.items():
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        fn()
        torch.cuda.synchronize()
        prof.disable()
        rec[f"cold_{name}_s"] = time.perf_counter() - t
        for key in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
            rec["profile"][f"{name}_{key}"] = buf.getvalue()
    print("COLD " + json.dumps(rec), flush=True)


class _ColdTrace:
    """Wraps, for the duration of a ``with``, what a cold first call spends its time in:
    Triton's compiles (its ``knobs.compilation.listener`` gives each stage's time), the C
    builds of kernel launchers and of Triton's own ``cuda_utils`` (``runtime.build._build``:
    gcc, once per kernel signature in a fresh cache) and the module loads
    (``CompiledKernel._init_handles``), each with its thread and its wall interval; and every
    thread's stack every 20 ms (``_sample``), for the time none of those account for."""

    def __init__(self):
        self._ev = []

    def _wrap(self, owner, attr, what, name_of):
        orig = getattr(owner, attr)

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self._ev.append({"what": what, "name": name_of(a), "start": t,
                                 "end": time.perf_counter(),
                                 "thread": threading.current_thread().name})

        setattr(owner, attr, wrapped)
        self._undo.append((owner, attr, orig))

    def _sample(self, period_s=0.02):
        """Every ``period_s``: every other thread's innermost frames (the calling thread's too),
        so that time spent outside the wrapped calls (and on autograd's thread, which cProfile
        does not see) shows up."""
        me = threading.get_ident()
        names = {}
        while not self._stop.wait(period_s):
            t = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < 10:
                    code = frame.f_code
                    stack.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
                                 f"({code.co_name})")
                    frame = frame.f_back
                if ident not in names:
                    names[ident] = next((th.name for th in threading.enumerate()
                                         if th.ident == ident), str(ident))
                self._samples.append((t, names[ident], " < ".join(stack)))

    def __enter__(self):
        import triton.compiler.compiler as tcc
        import triton.runtime.build as tbuild
        from triton import knobs

        self._undo = []
        self._wrap(tbuild, "_build", "c_build", lambda a: a[0])
        self._wrap(tcc.CompiledKernel, "_init_handles", "load_module",
                   lambda a: a[0].metadata.name)

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            del src, metadata_group
            self._ev.append({"what": "compile", "name": metadata["name"],
                             "end": time.perf_counter(), "cache_hit": cache_hit,
                             "ir_init_s": times.ir_initialization / 1e6,
                             "stages_s": {k: v / 1e6 for k, v in times.lowering_stages},
                             "total_s": times.total / 1e6,
                             "thread": threading.current_thread().name})

        self._listener = knobs.compilation.listener
        knobs.compilation.listener = listener
        self._samples, self._stop = [], threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, *exc):
        from triton import knobs

        self._stop.set()
        self._sampler.join()
        knobs.compilation.listener = self._listener
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        return False

    def events(self, t0, phases):
        out = [{"what": "phase", "name": k, "start": a - t0, "end": b - t0}
               for k, (a, b) in phases.items()]
        for e in self._ev:
            e = dict(e)
            for key in ("start", "end"):
                if key in e:
                    e[key] -= t0
            out.append(e)
        out.sort(key=lambda e: e["end"])
        # Samples as runs: consecutive samples of one thread with the same stack, merged.
        runs = {}
        for t, thread, stack in self._samples:
            r = runs.get(thread)
            if r is not None and r["name"] == stack and t - t0 - r["end"] < 0.05:
                r["end"], r["n"] = t - t0, r["n"] + 1
                continue
            if r is not None:
                out.append(r)
            runs[thread] = {"what": "sampled", "name": stack, "thread": thread,
                            "start": t - t0, "end": t - t0, "n": 1}
        out.extend(runs.values())
        return out


def cold_start():
    import subprocess
    import tempfile

    # Children run a trivial autograd backward first (torch's one-time imports, not a compile;
    # session 11) unless --cold_torch_warm_ab compares with and without it.
    runs = [(p, None, True) for p in (True, False)]
    if FLAGS.cold_ab:  # the tree and each variant, parallel compile, alternating order
        arms = [None, *FLAGS.cold_ab]
        runs = [(True, a, True) for r in range(FLAGS.kernel_ab_rounds)
                for a in (arms if r % 2 == 0 else arms[::-1])]
    if FLAGS.cold_torch_warm_ab:
        runs = [(True, None, w) for r in range(FLAGS.kernel_ab_rounds)
                for w in ((False, True) if r % 2 == 0 else (True, False))]
    for parallel, src, torch_warm in runs:
        tag = (f"cold start parallel_compile={parallel} kernels={src or 'tree'} "
               f"torch_warm={torch_warm}")
        if over_budget(tag):
            continue
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            p = subprocess.run([sys.executable, os.path.abspath(__file__),
                                f"--cold_child={int(parallel)}", "--out=/dev/null",
                                *([f"--cold_child_kernels={src}"] if src else []),
                                *(["--cold_trace"] if FLAGS.cold_trace else []),
                                *(["--cold_profile"] if FLAGS.cold_profile else []),
                                *(["--cold_child_torch_warm"] if torch_warm else [])],
                               env=env, capture_output=True, text=True, timeout=120)
        line = [x for x in p.stdout.splitlines() if x.startswith("COLD ")]
        if p.returncode or not line:
            RESULTS["errors"].append({"case": tag, "error": p.stderr[-3000:]})
            log(f"ERROR {tag}: rc={p.returncode} {p.stderr[-500:]}")
            continue
        e = json.loads(line[0][5:])
        RESULTS.setdefault("cold_start", []).append(e)
        log(f"{tag}: {({k: x for k, x in e.items() if k not in ('trace', 'profile')})}")
        for key, text in e.get("profile", {}).items():
            log(f"  profile {key}:\n{text}")
        for ev in e.get("trace", ()):
            if ev["what"] == "sampled" and ev["n"] < 3:
                continue
            extra = ev.get("stages_s") or ""
            log(f"  {ev.get('start', float('nan')):7.3f} -> {ev['end']:7.3f} s  {ev['what']:11s} "
                f"{ev['name']:28s} {ev.get('thread', ''):24s} {extra}")
        save()


def table():
    rows = [f"{'impl':10s} {'config':28s} {'pattern':15s} {'N':>6s} {'fwd ms':>9s} "
            f"{'fwd+bwd ms':>11s} {'fwd TFLOP/s':>11s} {'bwd TFLOP/s':>11s}"]
    for e in RESULTS["timing"]:
        rows.append(f"{e['impl']:10s} {e.get('sweep', 'default'):28s} "
                    f"{e.get('pattern', '-'):15s} {e['N']:6d} {e['fwd_ms']:9.3f} "
                    f"{e.get('fwd_bwd_ms', float('nan')):11.3f} {e['fwd_tflops']:11.1f} "
                    f"{e.get('bwd_tflops', float('nan')):11.1f}")
    return "\n".join(rows)


def main(argv):
    del argv
    import triton

    if FLAGS.cold_child is not None:
        cold_child(bool(FLAGS.cold_child))
        return

    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__,
                      "device": torch.cuda.get_device_name(0), "python": sys.version.split()[0],
                      "command": " ".join(sys.argv), "t0_unix": T0}
    log(f"env {RESULTS['env']}")
    save()
    RESULTS["default_configs"] = {
        kn: str(L.tile_config(kn, head_dim=128, dtype="bfloat16", block_size=128,
                              device_kind="cuda")) for kn in L.KERNEL_NAMES}
    RESULTS["default_work_order"] = L._OPTIONS["work_order"]
    # Sections in order, each behind its flag. The cold start comes first: nothing compiled in
    # this process matters to it, but keep it early.
    sections = ((FLAGS.cold or FLAGS.cold_ab, cold_start), (FLAGS.correctness, correctness),
                (True, timing), (FLAGS.tile_blocks, tile_sweep),
                (FLAGS.direct_launch, direct_launch), (FLAGS.host_overhead, host_overhead),
                (FLAGS.bwd_kernels, bwd_kernels),
                (FLAGS.order_ab, order_ab), (FLAGS.kernel_ab, kernel_ab),
                (FLAGS.atomic_dq_ab, atomic_dq_ab), (FLAGS.bwd_tile_ab, bwd_tile_ab),
                (FLAGS.tile_ab, tile_ab), (FLAGS.bwd_streams, bwd_streams),
                (FLAGS.sweep, split_sweep), (FLAGS.sweep, sweep))
    for enabled, section in sections:
        if enabled:
            section()
    RESULTS["wall_s"] = time.time() - T0
    save()
    n_fail = sum(not c["pass"] for c in RESULTS["correctness"])
    log(f"correctness: {len(RESULTS['correctness'])} cases, {n_fail} failing; "
        f"errors: {len(RESULTS['errors'])}; skipped: {RESULTS['skipped']}")
    print(table(), flush=True)


if __name__ == "__main__":
    app.run(main)
