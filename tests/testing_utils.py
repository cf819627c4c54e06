"""Shared test helpers: per-dtype tolerances, dtype rounding in numpy, random inputs.

Tolerance table (absolute); rtol = atol / 10; gradients are compared at 2 * atol (and
2 * rtol). An element passes when ``|x - ref| <= atol + rtol * |ref|``. Outputs of low-precision
kernels are stored in their dtype, so the table covers one storage rounding (bf16: 2^-9
relative) plus the accumulated compute error of fp32 softmax on rounded P.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ATOL", "tolerance", "round_to_dtype", "random_inputs", "assert_close"]

ATOL = {
    "float64": 1e-10,
    "float32": 2e-5,
    "float16": 5e-3,
    "bfloat16": 3e-2,
}


def tolerance(dtype: str, grad: bool = False) -> tuple[float, float]:
    """(atol, rtol) for ``dtype``; gradients get twice both."""
    atol = ATOL[dtype] * (2 if grad else 1)
    return atol, atol / 10


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


def assert_close(actual, expected, dtype: str, *, grad: bool = False, what: str = ""):
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
    atol, rtol = tolerance(dtype, grad)
    a, e = a[~inf], e[~inf]
    err = np.abs(a - e)
    bad = err > atol + rtol * np.abs(e)
    if bad.any():
        i = int(np.argmax(err - (atol + rtol * np.abs(e))))
        raise AssertionError(
            f"{what} ({dtype}, atol={atol}, rtol={rtol}): {int(bad.sum())}/{bad.size} elements "
            f"out of tolerance; max abs err {err.max():.3g}; worst at flat index {i}: "
            f"got {a[i]!r}, expected {e[i]!r}")
