"""Question: do the *compiled* kernels give the right answer where only a GPU runs them?

The test suite runs the same kernel sources in Triton's interpreter on CPU tensors, at small
shapes and the layout's own tile. On a GPU three things differ, and this checks each:

1. ``oracle``: compiled code generation, at small shapes, against the float64 numpy oracle
   (fp32 / bf16 / fp16, several example patterns, ragged N, masked rows);
2. ``gpu_size``: the targets' sizes (N=8192, block 128, so the CUDA kernel-tile policy may run
   the layout at another tile) against a float32 torch reference, with NaN-poisoned outputs
   (an unwritten element fails) and one bitwise determinism check (run twice);
3. ``direct_launch``: the torch launcher's direct launch of compiled kernels
   (``LaunchOptions.direct_launch``) gives the JIT entry point's results bit for bit (aligned
   and misaligned inputs, an LSE cotangent) and really skips the entry point.

Believe nothing here unless ``python -m pytest -q tests/torch_attention_test.py`` passes. The
exit status is 1 when a check fails or errors. ``benchmarks/gpu_session.sh`` runs it as the
``check`` stage::

    python benchmarks/gpu_correctness.py --out=$OUT/check.json --budget_s=70

On CPU (the interpreter; a smoke test of this script, smallest cases only)::

    python benchmarks/gpu_correctness.py --device=cpu --out=/tmp/check.json
"""

from __future__ import annotations

import sys
from unittest import mock

import attention_common as C
import numpy as np
import torch
from absl import app, flags

from sparsetp.backends.torch import launch as tlaunch
from sparsetp.core import make_layout, reference
from sparsetp.core.examples import example_pattern
from sparsetp.kernels import options

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "check.json", "where to write the JSON")
flags.DEFINE_float("budget_s", 150.0, "wall-clock budget; later cases are skipped past it")
flags.DEFINE_enum("device", "cuda", ["cuda", "cpu"], "cpu: the interpreter, smallest cases")
flags.DEFINE_list("sections", ["oracle", "gpu_size", "direct_launch"], "sections to run")
flags.DEFINE_bool("all_cases", False, "every case of each section (default: the first few, "
                  "which share compiled kernels; every new (dtype, D, block) compiles ~4 kernels)")

# (example pattern, N, block, H, D, dtype)
ORACLE_CASES = [
    ("strided_causal", 333, 128, 2, 128, "bfloat16"), ("causal", 200, 64, 2, 64, "float32"),
    ("local", 250, 32, 2, 32, "float16"), ("random", 180, 16, 2, 16, "float32"),
    ("bigbird", 200, 64, 2, 64, "bfloat16"), ("masked_rows", 150, 64, 2, 64, "float16"),
    ("per_head_mix", 300, 64, 3, 128, "bfloat16"), ("dense", 256, 128, 1, 64, "bfloat16"),
]
# (name, pattern or None for the anchor of that name, N, block, H, D, dtype, poisoned)
GPU_SIZE_CASES = [
    ("causal", None, 8192, 128, 2, 128, "bfloat16", True),
    ("window", None, 8192, 128, 2, 128, "bfloat16", True),
    ("bigbird", None, 8192, 128, 2, 128, "bfloat16", False),
    ("masked_rows", "masked_rows", 8192, 64, 2, 64, "bfloat16", True),
    ("bigbird", None, 8192, 128, 2, 64, "float16", False),
    ("strided_causal", None, 8192, 128, 2, 128, "float16", False),
]
CPU_CASES = {"oracle": [("causal", 100, 32, 2, 32, "float32"),
                        ("masked_rows", 90, 32, 2, 16, "bfloat16")],
             "gpu_size": [("window", None, 300, 32, 2, 32, "float32", True)]}


def oracle(rec: C.Record, device: str) -> None:
    cases = CPU_CASES["oracle"] if device == "cpu" else (
        ORACLE_CASES if FLAGS.all_cases else ORACLE_CASES[:4])
    for name, n, bs, h, d, dtype in cases:
        tag = f"{name} N={n} block={bs} H={h} D={d} {dtype}"
        if rec.over_budget(f"oracle {tag}"):
            continue
        try:
            layout = make_layout(example_pattern(name, n, bs), n, h, bs)
            import testing_utils as tu  # noqa: PLC0415

            q, k, v, d_out = tu.random_inputs(n + d, (1, h, n, d), dtype)
            dev = [torch.from_numpy(x).to(device, getattr(torch, dtype)) for x in (q, k, v, d_out)]
            got = C.run_with_grads(C.library_attention, *dev[:3], layout, dev[3])
            out, lse = reference.attention(q, k, v, layout)
            want = [torch.from_numpy(np.asarray(x)) for x in
                    (out, lse, *reference.attention_grad(q, k, v, layout, d_out))]
            r = C.ratios(got, want, dtype)
            rec.check("float64 oracle", tag, all(x <= 1.0 for x in r.values()), ratio=r)
        except Exception as e:  # noqa: BLE001 - one failing shape must not hide the rest
            rec.error(f"oracle {tag}", e)
        rec.save()


def gpu_size(rec: C.Record, device: str) -> None:
    cases = CPU_CASES["gpu_size"] if device == "cpu" else (
        GPU_SIZE_CASES if FLAGS.all_cases else GPU_SIZE_CASES[:4])
    determinism_done = False
    for name, example, n, bs, h, d, dtype, poison in cases:
        tag = f"{name} N={n} block={bs} H={h} D={d} {dtype} poisoned={poison}"
        if rec.over_budget(f"gpu_size {tag}"):
            continue
        try:
            pat = C.anchor_pattern(name) if example is None else example_pattern(example, n, bs)
            r, (q, k, v, d_out, layout) = C.check_fp32(C.library_attention, pat, n, bs, h, d,
                                                       dtype, device, poison=poison)
            extra = {}
            if not determinism_done:
                a, b = (C.run_with_grads(C.library_attention, q, k, v, layout, d_out)
                        for _ in range(2))
                extra["bitwise_deterministic"] = all(
                    torch.equal(x, y) for x, y in zip(a, b, strict=True))
                determinism_done = True
            rec.check("float32 torch reference", tag,
                      all(x <= 1.0 for x in r.values()) and extra.get("bitwise_deterministic",
                                                                      True), ratio=r, **extra)
        except Exception as e:  # noqa: BLE001
            rec.error(f"gpu_size {tag}", e)
        if device == "cuda":
            torch.cuda.empty_cache()
        rec.save()


def _both_launch_paths(q, k, v, layout, d_out, d_lse):
    """{direct: (out, lse, dq, dk, dv)} through the JIT entry (False) and the direct launch
    (True), each path's second call (the first compiles), and {direct: JIT-entry launches the
    second call made} (4 through the entry, 0 direct)."""
    results, entry_calls = {}, {}
    for direct in (False, True):
        with options.launch_options(direct_launch=direct):
            C.run_with_grads(C.library_attention, q, k, v, layout, d_out, d_lse)
            with mock.patch.object(tlaunch, "_launch", wraps=tlaunch._launch) as entry:
                results[direct] = C.run_with_grads(C.library_attention, q, k, v, layout, d_out,
                                                   d_lse)
        entry_calls[direct] = entry.call_count
    return results, entry_calls


def direct_launch(rec: C.Record, device: str) -> None:
    if device != "cuda":
        rec.log("direct_launch: CUDA only (the interpreter has no compiled kernel to call)")
        return
    h, d = 2, 128
    for name, n, offset in (("window", 2048, 0), ("bigbird", 2048, 0),
                            ("strided_causal", 1000, 0), ("window", 2048, 1)):
        tag = f"{name} N={n} storage offset {offset}"
        if rec.over_budget(f"direct launch {tag}"):
            continue
        try:
            layout = make_layout(C.anchor_pattern(name), n, h, 128)
            g = torch.Generator(device="cuda").manual_seed(7)
            base = [torch.randn(h * n * d + offset, device="cuda", generator=g)
                    .to(torch.bfloat16) for _ in range(4)]
            # A one-element (2-byte) offset: pointers not 16-byte aligned, another specialisation.
            q, k, v, d_out = (x[offset:].view(1, h, n, d) for x in base)
            d_lse = torch.randn(1, h, n, device="cuda", generator=g)
            res, calls = _both_launch_paths(q, k, v, layout, d_out, d_lse)
            same = {nm: bool(torch.equal(a, b)) for nm, a, b in zip(C.OUTPUTS, res[False],
                                                                    res[True], strict=True)}
            rec.check("direct launch vs JIT entry (bitwise)", tag,
                      all(same.values()) and calls[True] == 0 and calls[False] == 4,
                      bitwise_equal=same, jit_entry_calls=calls)
        except Exception as e:  # noqa: BLE001
            rec.error(f"direct launch {tag}", e)
        rec.save()


def main(argv):
    del argv
    rec = C.Record(FLAGS.out, FLAGS.budget_s)
    rec.log(f"env {rec.data['env']}")
    sections = {"oracle": oracle, "gpu_size": gpu_size, "direct_launch": direct_launch}
    for name in FLAGS.sections:
        sections[name](rec, FLAGS.device)
    sys.exit(rec.finish())


if __name__ == "__main__":
    app.run(main)
