"""Shared test helpers: per-dtype tolerances, dtype rounding in numpy, random inputs.

Tolerance table (absolute); rtol = atol / 10; gradients are compared at 2 * atol (and
2 * rtol). An element passes when ``|x - ref| <= atol + rtol * |ref|``. Outputs of low-precision
kernels are stored in their dtype, so the table covers one storage rounding (bf16: 2^-9
relative) plus the accumulated compute error of fp32 softmax on rounded P.

Reductions over tokens (``reduced=T``): a parameter gradient such as ``d[fc1.weight] = X^T dY``
or ``d[ln1.bias] = sum_t dY_t`` sums ``T = batch * seq_len`` per-token contributions, each of
which carries the per-element error the table allows (the same error the input gradient ``dx``
is held to, per token). Independent rounding errors of T terms add like a random walk, so the
*absolute* error of the sum grows like ``sqrt(T)`` while the sum itself (of O(1) terms of mixed
sign) is only ``O(sqrt(T))`` large: with rtol alone, a 2000-token float32 bias gradient of
magnitude 70 failed at 1.1e-4 absolute (1.6e-6 relative, i.e. ~13 float32 ulps) on the GPU.
``tolerance(..., reduced=T)`` therefore scales atol (not rtol) by ``sqrt(T)``. In that run the
input gradients were off by at most 5.4e-6 (atol/7) per element, and 5.4e-6 * sqrt(2000) = 2.4e-4
bounds the 1.1e-4 seen in the bias gradient: the random-walk model explains the failure, and the
scaled bound (1.8e-3 there) still sits 16x above what was seen. What it still
catches is pinned down in ``testing_utils_test.py``: a dropped token, a 1% error in one token's
contribution, and a 1e-4 relative error in every token's contribution all fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

__all__ = ["ATOL", "tolerance", "round_to_dtype", "random_inputs", "assert_close",
           "REPO", "run_json_script"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ATOL = {
    "float64": 1e-10,
    "float32": 2e-5,
    "float16": 5e-3,
    "bfloat16": 3e-2,
}


def tolerance(dtype: str, grad: bool = False, reduced: int = 1) -> tuple[float, float]:
    """(atol, rtol) for ``dtype``; gradients get twice both; a sum over ``reduced`` tokens gets
    ``sqrt(reduced)`` times the atol (see the module docstring), the same rtol."""
    if reduced < 1:
        raise ValueError(f"reduced must be >= 1, got {reduced}")
    base = ATOL[dtype] * (2 if grad else 1)
    return base * float(np.sqrt(reduced)), base / 10


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of ``x`` holding values exactly representable in ``dtype``.

    bfloat16 has no numpy dtype: round float32 to its upper 16 bits (round-to-nearest-even).
    """
    x = np.asarray(x, np.float32)
    if dtype in ("float32", "float64"):
        return x.copy()
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32)
    raise ValueError(f"unknown dtype {dtype!r}")


def random_inputs(seed: int, shape, dtype: str, count: int = 4) -> list[np.ndarray]:
    """``count`` fresh standard-normal arrays (float32, or float64 for float64) in ``dtype``."""
    rng = np.random.default_rng(seed)
    out = [round_to_dtype(rng.standard_normal(shape), dtype) for _ in range(count)]
    if dtype == "float64":
        out = [np.random.default_rng(seed + 1 + i).standard_normal(shape) for i in range(count)]
    return out


def assert_close(actual, expected, dtype: str, *, grad: bool = False, reduced: int = 1,
                 what: str = ""):
    """Elementwise ``|a - e| <= atol + rtol |e|`` with infinities required to match exactly."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape} != expected {e.shape}")
    if np.isnan(a).any():
        raise AssertionError(f"{what}: {int(np.isnan(a).sum())} NaN elements")
    inf = np.isinf(e)
    if not np.array_equal(np.isinf(a), inf) or not np.array_equal(a[inf], e[inf]):
        raise AssertionError(f"{what}: infinities differ from the reference")
    atol, rtol = tolerance(dtype, grad, reduced)
    a, e = a[~inf], e[~inf]
    err = np.abs(a - e)
    bad = err > atol + rtol * np.abs(e)
    if bad.any():
        i = int(np.argmax(err - (atol + rtol * np.abs(e))))
        raise AssertionError(
            f"{what} ({dtype}, atol={atol}, rtol={rtol}): {int(bad.sum())}/{bad.size} elements "
            f"out of tolerance; max abs err {err.max():.3g}; worst at flat index {i}: "
            f"got {a[i]!r}, expected {e[i]!r}")


def run_json_script(args, json_path: str, timeout: float):
    """``python *args`` from the repository root, with it on PYTHONPATH (a fresh process, as a
    user runs a benchmark); returns ``(the finished process, the JSON it wrote to json_path)``."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    with open(json_path) as f:
        return proc, json.load(f)
