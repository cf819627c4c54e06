"""What the attention benchmark scripts share: the targets' patterns, inputs, references, timing,
launch-option arms and a JSON record with a wall-clock budget.

Flag-free (like ``cubin_tools.py``), so every script under ``benchmarks/`` can import it; the
scripts run as ``python benchmarks/<name>.py`` with the repository root on ``PYTHONPATH``.
Everything here works on CPU tensors too (the kernels then run in Triton's interpreter), which
is how the scripts are smoke-tested without a GPU; their numbers mean something on CUDA only.

An *arm* is one way of launching the library's kernels, written ``NAME[:FIELD=VALUE,...]``:

Several arms on a command line: ``--arms='A;B'`` or ``--arms=A --arms=B``.

* ``block=B``: the layout block the pattern is laid out at (default 128, the targets');
* ``kernel_tile=auto|layout|16|32|64|128``, ``work_order=...``, ``head_group=G``,
  ``fwd_kernel=auto|portable|hopper``, ``bwd_kernel=...``, ``direct_launch=0|1``,
  ``parallel_compile=0|1``, ``native_autograd=0|1``:
  :class:`sparsetp.kernels.options.LaunchOptions`;
* ``fwd=SUB/WARPS/STAGES``, ``bwd_dq=...``, ``bwd_dkdv=...``, ``bwd=...`` (both backward list
  kernels): explicit :class:`~sparsetp.kernels.tiles.TileConfig` s. Explicit configs pin the
  kernel tile to the layout block unless ``kernel_tile`` names one (the default policy may run a
  layout at another tile, which a config for one tile cannot follow).

>>> a = parse_arm("t64:block=64,bwd=64/4/2")
>>> a.name, a.block, a.options["kernel_tile"], a.options["tiles"]["bwd_dq"].num_warps
('t64', 64, 'layout', 4)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any
from unittest import mock

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.append(os.path.join(ROOT, "tests"))  # testing_utils: the tests' tolerance table

ANCHORS = ("causal", "window", "bigbird", "strided_causal")
OUTPUTS = ("out", "lse", "dq", "dk", "dv")


def anchor_pattern(name: str):
    """The issue-8 target patterns (laid out at block 128 in the targets)."""
    from sparsetp.core import patterns as P  # noqa: PLC0415

    if name == "causal":
        return P.causal()
    if name == "window":  # |i - j| < 512
        return P.local(511, 511)
    if name == "bigbird":  # 3-block window, 1 global block, 2 random blocks per row
        return P.bigbird(128, 3, 1, 2, seed=0)
    if name == "strided_causal":  # 4 local blocks causal + vertical stride 16, per-head offset
        return (P.block_local(128, 3, 0) | P.strided(16, 128, per_head_offset=True)) & P.causal()
    raise ValueError(f"pattern must be one of {ANCHORS}, got {name!r}")


# ----------------------------------------------------------------------------- arms
@dataclasses.dataclass(frozen=True)
class Arm:
    """A named way of launching: the layout block and the launch options (keyword arguments of
    :func:`sparsetp.kernels.options.launch_options`)."""

    name: str
    block: int = 128
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def context(self):
        from sparsetp.kernels.options import launch_options  # noqa: PLC0415

        return launch_options(**self.options)

    def tiling(self) -> tuple:
        """What decides the arithmetic (the rest only reorders programs): arms with equal
        tilings compute bitwise-equal results."""
        return (self.block, self.options.get("kernel_tile", "auto"),
                tuple(sorted(self.options.get("tiles", {}).items())))


def define_target_flags(out: str, n: tuple[str, ...]) -> None:
    """The absl flags every target-pattern timing script shares (its own come after)."""
    from absl import flags  # noqa: PLC0415

    flags.DEFINE_string("out", out, "where to write the JSON")
    flags.DEFINE_list("n", list(n), "sequence lengths")
    flags.DEFINE_list("patterns", list(ANCHORS), "target patterns")
    flags.DEFINE_integer("heads", 16, "H")
    flags.DEFINE_integer("head_dim", 128, "D")
    flags.DEFINE_float("rep_ms", 60.0, "do_bench rep (ms) per measurement")
    flags.DEFINE_integer("check_n", 2048, "N of the float32-reference gate")
    flags.DEFINE_float("budget_s", float("inf"), "wall-clock budget")
    flags.DEFINE_enum("device", "cuda", ["cuda", "cpu"], "cpu: the interpreter (smoke test only)")


_TILE_KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")


def parse_arm(spec: str) -> Arm:
    """An :class:`Arm` from ``NAME[:FIELD=VALUE,...]`` (see the module docstring)."""
    from sparsetp.kernels.tiles import TileConfig  # noqa: PLC0415

    name, _, rest = spec.partition(":")
    fields = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    block = int(fields.pop("block", 128))
    opts: dict = {}
    if "kernel_tile" in fields:
        kt = fields.pop("kernel_tile")
        opts["kernel_tile"] = int(kt) if kt.isdigit() else kt
    for opt in ("work_order", "fwd_kernel", "bwd_kernel"):
        if opt in fields:
            opts[opt] = fields.pop(opt)
    if "head_group" in fields:
        opts["head_group"] = int(fields.pop("head_group"))
    for flag in ("direct_launch", "parallel_compile", "native_autograd"):
        if flag in fields:
            opts[flag] = fields.pop(flag) in ("1", "true", "True")
    tiles = {}
    for kname in (*_TILE_KERNELS, "bwd"):
        if kname in fields:
            sub, warps, stages = (int(x) for x in fields.pop(kname).split("/"))
            kt = opts.get("kernel_tile", "layout")
            bs = kt if isinstance(kt, int) else block
            cfg = TileConfig(bs, bs, warps, stages, sub=sub)
            tiles.update({"bwd_dq": cfg, "bwd_dkdv": cfg} if kname == "bwd" else {kname: cfg})
    if tiles:
        opts["tiles"] = tiles
        opts.setdefault("kernel_tile", "layout")
    if fields:
        raise ValueError(f"arm {spec!r}: unknown fields {sorted(fields)}")
    return Arm(name or "default", block, opts)


def parse_arms(specs, presets: Mapping[str, list[str]] | None = None) -> list[Arm]:
    """Arms from flag values, each one spec or several separated by ``;`` (a spec holds commas);
    a spec that names a preset expands to the preset's specs."""
    out = []
    for s in (x for entry in specs for x in entry.split(";") if x):
        out += [parse_arm(x) for x in (presets or {}).get(s, [s])]
    names = [a.name for a in out]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    return out


# ----------------------------------------------------------------------------- record
class Record:
    """The JSON a script writes (rewritten after every entry, so a killed run keeps what it had),
    with a wall-clock budget past which items are skipped and listed as skipped."""

    def __init__(self, out: str | None, budget_s: float = float("inf")):
        self.out, self.budget_s, self.t0 = out, budget_s, time.time()
        self.data: dict = {"env": env(), "correctness": [], "skipped": [], "errors": []}

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True)

    def over_budget(self, what: str) -> bool:
        if time.time() - self.t0 > self.budget_s:
            self.data["skipped"].append(what)
            self.log(f"SKIP (budget) {what}")
            return True
        return False

    def error(self, case: str, exc: BaseException) -> None:
        self.data["errors"].append({"case": case, "error": traceback.format_exc()[-4000:]})
        self.log(f"ERROR {case}: {exc!r}")

    def check(self, kind: str, case: str, ok: bool, **fields) -> bool:
        self.data["correctness"].append({"kind": kind, "case": case, "pass": bool(ok), **fields})
        self.log(f"{'ok  ' if ok else 'FAIL'} {kind}: {case} "
                 f"{ {k: v for k, v in fields.items() if k != 'raw'} or ''}")
        return bool(ok)

    def save(self) -> None:
        if not self.out:
            return
        self.data["wall_s"] = time.time() - self.t0
        os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
        with open(self.out, "w") as f:
            json.dump(self.data, f, indent=1, default=str)

    def finish(self) -> int:
        """Save, print the summary line; the exit status: 1 if any check failed or errored."""
        self.save()
        fails = sum(not c["pass"] for c in self.data["correctness"])
        self.log(f"correctness: {len(self.data['correctness'])} cases, {fails} failing; "
                 f"errors: {len(self.data['errors'])}; skipped: {len(self.data['skipped'])}")
        return int(bool(fails or self.data["errors"]))


def env() -> dict:
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"torch": torch.__version__, "triton": triton.__version__, "device": dev,
            "python": sys.version.split()[0], "command": " ".join(sys.argv)}


# ----------------------------------------------------------------------------- tensors, timing
def sync(device) -> None:
    import torch  # noqa: PLC0415

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def document_lengths(n: int, seed: int = 0) -> list[int]:
    """A packing of ``n`` tokens as documents of 512-8192 tokens: lengths drawn (seeded) until
    they reach ``n``, the last one cut to fit (``real_models.py``, the lab's
    ``gluon_tools.lab_pattern``)."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(rng.integers(512, 8193)))
    lengths[-1] -= sum(lengths) - n
    if lengths[-1] < 1:
        lengths.pop()
        lengths[-1] += n - sum(lengths)
    return lengths


def inputs(n: int, h: int, d: int, dtype: str, device: str, seed: int, b: int = 1,
           h_kv: int | None = None):
    """(q, k, v, qg, kg, vg, d_out): standard-normal inputs, and leaf copies that want grads;
    k and v with ``h_kv`` heads (GQA; default ``h``)."""
    import torch  # noqa: PLC0415

    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, d_out = (torch.randn(b, hh, n, d, device=device, generator=g)
                      .to(getattr(torch, dtype)) for hh in (h, h_kv or h, h_kv or h, h))
    return (q, k, v, *(t.clone().requires_grad_() for t in (q, k, v)), d_out)


def bench_ms(fn, device, grads=None, rep_ms: float = 60.0) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA, wall clock elsewhere."""
    fn()
    sync(device)
    if str(device).startswith("cuda"):
        from triton.testing import do_bench  # noqa: PLC0415

        return float(do_bench(fn, warmup=10, rep=rep_ms, grad_to_none=grads,
                              return_mode="median"))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def wall_loop_ms(fn, sync, loop_ms: float = 30.0, reps: int = 5) -> float:
    """ms per call of ``fn`` in the attention bench's own wall-clock loops
    (``sparsetp.bench.attention._time_wall``: back-to-back calls for about ``loop_ms``, then
    ``sync(last result)``; median of ``reps``), after three warm-up calls: the bench sizes its
    loops on one timed call, which must not include a compile."""
    from sparsetp.bench.attention import _time_wall  # noqa: PLC0415

    for _ in range(3):
        r = fn()
    sync(r)
    return _time_wall(fn, reps, sync, loop_ms)


def enqueue_us(fn, sync, calls: int) -> float:
    """Host microseconds per call to enqueue ``calls`` back-to-back calls of ``fn``, the queue
    drained first (``sync(result)`` waits for a call's result)."""
    sync(fn())
    t0 = time.perf_counter()
    for _ in range(calls):
        r = fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    sync(r)
    return t


def fwd_and_fwd_bwd_ms(attn, tensors, layout, device, rep_ms: float = 60.0) -> tuple:
    """(forward ms, forward+backward ms) of ``attn(q, k, v, layout) -> (out, lse)`` on
    ``tensors`` = :func:`inputs`, the backward through autograd."""
    q, k, v, qg, kg, vg, d_out = tensors
    return (bench_ms(lambda: attn(q, k, v, layout), device, rep_ms=rep_ms),
            bench_ms(lambda: attn(qg, kg, vg, layout)[0].backward(d_out), device, [qg, kg, vg],
                     rep_ms=rep_ms))


def interleaved(arms: Mapping[str, Callable[[], Any]], rounds: int,
                measure: Callable[[str], tuple], stop: Callable[[], bool] = lambda: False):
    """``measure(arm)`` under each arm's context, the arms interleaved over ``rounds`` and every
    other round in reverse (so no arm always follows the same one: the last arm of a round can
    read several % slow). -> (medians per arm, raw rows per arm), or None once ``stop()``."""
    rows: dict = {a: [] for a in arms}
    for r in range(rounds):
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            if stop():
                return None
            with arms[a]():
                rows[a].append(measure(a))
    med = {a: [float(np.median([x[i] for x in rows[a]])) for i in range(len(rows[a][0]))]
           for a in arms}
    return med, rows


# ----------------------------------------------------------------------------- correctness
def library_attention(q, k, v, layout):
    """The library's public torch function, returning (out, lse)."""
    from sparsetp.backends.torch.attention import sparse_attention  # noqa: PLC0415

    return sparse_attention(q, k, v, layout, return_lse=True)


def run_with_grads(attn, q, k, v, layout, d_out, d_lse=None):
    """(out, lse, dq, dk, dv) of ``attn(q, k, v, layout) -> (out, lse)`` on fresh leaves."""
    import torch  # noqa: PLC0415

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = attn(q, k, v, layout)
    if d_lse is None:
        out.backward(d_out)
    else:
        torch.autograd.backward((out, lse), (d_out, d_lse))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@contextlib.contextmanager
def poisoned():
    """Every output buffer of the torch launcher starts as NaN (unwritten elements then fail)."""
    import torch  # noqa: PLC0415

    from sparsetp.backends.torch import launch as tlaunch  # noqa: PLC0415

    def nan(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)

    with mock.patch.object(tlaunch, "new_output", nan):
        yield


def ratio(actual, expected, dtype: str, grad: bool) -> float:
    """max |a - e| / (atol + rtol |e|) under the tests' tolerance table (<= 1 passes); inf on
    NaN or on infinities that do not match."""
    import testing_utils as tu  # noqa: PLC0415
    import torch  # noqa: PLC0415

    a, e = torch.as_tensor(actual).double().cpu(), torch.as_tensor(expected).double().cpu()
    if torch.isnan(a).any():
        return float("inf")
    inf = torch.isinf(e)
    if not torch.equal(torch.isinf(a), inf) or not torch.equal(a[inf], e[inf]):
        return float("inf")
    atol, rtol = tu.tolerance(dtype, grad)
    a, e = a[~inf], e[~inf]
    return float(((a - e).abs() / (atol + rtol * e.abs())).max()) if a.numel() else 0.0


def ratios(got, want, dtype: str) -> dict:
    return {nm: ratio(g, w, dtype, nm not in ("out", "lse"))
            for nm, g, w in zip(OUTPUTS, got, want, strict=True)}


def ref_fp32(q, k, v, mask, scale, d_out):
    """Dense float32 reference (rows with no key: output 0, LSE -inf, zero gradients)."""
    import torch  # noqa: PLC0415

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


def check_fp32(attn, pattern, n: int, bs: int, h: int, d: int, dtype: str, device: str, *,
               poison: bool = False, seed: int = 0):
    """``attn`` on ``pattern`` laid out at block ``bs`` against :func:`ref_fp32`:
    (ratios, (q, k, v, d_out, layout))."""
    import torch  # noqa: PLC0415

    from sparsetp.core import make_layout  # noqa: PLC0415

    layout = make_layout(pattern, n, h, bs)
    q, k, v, *_, d_out = inputs(n, h, d, dtype, device, seed + n + d)
    with poisoned() if poison else contextlib.nullcontext():
        got = run_with_grads(attn, q, k, v, layout, d_out)
    mask = torch.from_numpy(layout.dense_mask()).to(device)[None]
    return ratios(got, ref_fp32(q, k, v, mask, d ** -0.5, d_out), dtype), (q, k, v, d_out, layout)


def gate(rec: Record, label: str, attn, bs: int, device: str, *, d: int = 128, n: int = 2048,
         poison: bool = True, unchecked=()) -> bool:
    """The correctness gate of an A/B arm (under the caller's context): causal and BigBird at
    N=``n`` and the window at the ragged N=``n`` - 48, block ``bs``, H=2, bf16, against the float32
    reference, each recorded. A check that raises (say, a variant that does not compile) fails."""
    passed = True
    for nm, nn in (("causal", n), ("bigbird", n), ("window", n - 48)):
        case = f"{label} {nm} N={nn} D={d}" + (" poisoned" if poison else "")
        try:
            r, _ = check_fp32(attn, anchor_pattern(nm), nn, bs, 2, d, "bfloat16", device,
                              poison=poison)
        except Exception:  # noqa: BLE001 - recorded as a failing case; the arm is not timed
            passed &= rec.check("float32 reference", case, False,
                                error=traceback.format_exc()[-3000:])
            continue
        r = {k: x for k, x in r.items() if k not in unchecked}
        passed &= rec.check("float32 reference", case, all(x <= 1.0 for x in r.values()),
                            ratio=r)
    return passed


def bitwise_alike(rec: Record, case: str, arms: Mapping[str, Any], run: Callable[[str], tuple]):
    """Whether ``run(arm)`` (under each arm's context) gives the first arm's tensors bit for bit;
    recorded. A dispatch order changes which program runs when, never what it computes."""
    import torch  # noqa: PLC0415

    got = {}
    for a, context in arms.items():
        with context():
            got[a] = run(a)
    first = next(iter(got))
    differ = [f"{a} {w}" for a in got for w, x, y in zip(OUTPUTS, got[a], got[first], strict=True)
              if not torch.equal(x, y)]
    return rec.check(f"bitwise equal to arm {first}", case, not differ, arms=list(arms),
                     differ=differ)
