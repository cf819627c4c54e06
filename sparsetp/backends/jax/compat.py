"""Version differences of JAX and jax-triton, kept in one place.

Tested combinations (pin these; anything else is untested):

========================  ==============================  =================================
where                     versions                        path
========================  ==============================  =================================
CI / developer machines   jax 0.10.2 (CPU), triton 3.9    ``buffer_callback`` + Triton interpreter
GPU device machine        jax 0.11.2 (CUDA 13), triton    ``jax_triton.triton_call``
                          3.6, jax-triton 0.3.1
========================  ==============================  =================================

* ``import jax_triton`` raises ImportError on a JAX without GPU support, so it is imported lazily,
  only on the GPU path (:func:`jax_triton`).
* jax-triton 0.3.1 sets ``TRITON_CACHE_DIR=""`` for the whole process when imported (0.4.x
  deletes it); a later torch launch of a Triton kernel then fails. :func:`jax_triton` restores
  the variable to what it was.
* The "varying manual axes" of a value inside ``shard_map`` are ``aval.vma`` on newer JAX and
  ``aval.manual_axis_type.varying`` on 0.10.x (:func:`varying_axes`); ``jax.lax.pcast(x, axes,
  to="varying")`` marks outputs of opaque calls (``triton_call``, ``buffer_callback``) as varying,
  and older JAX spelled it ``jax.lax.pvary`` (:func:`mark_varying`).
* The CPU path calls back into Python through ``jax.experimental.buffer_callback`` (present
  since jax 0.7, experimental): :func:`buffer_callback` is the one place that imports it.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType

import jax

__all__ = ["jax_triton", "buffer_callback", "varying_axes", "mark_varying", "mark_varying_like",
           "auto_mesh", "TESTED_JAX_TRITON"]

# jax-triton versions the GPU path was run with (the GPU suite, BUILD.md).
# 0.4.x needs Python >= 3.12 and triton >= 3.7 and breaks on jax 0.12 (GPU.md).
TESTED_JAX_TRITON = ("0.3.1",)

_IMPORT_LOCK = threading.Lock()
_JAX_TRITON = None


def jax_triton() -> ModuleType:
    """The ``jax_triton`` module (imported on first use), with ``TRITON_CACHE_DIR`` restored."""
    global _JAX_TRITON
    with _IMPORT_LOCK:
        if _JAX_TRITON is None:
            saved = os.environ.get("TRITON_CACHE_DIR")
            try:
                import jax_triton as jt  # noqa: PLC0415  (GPU-only import; see module docstring)
            finally:
                if saved is None:
                    os.environ.pop("TRITON_CACHE_DIR", None)
                else:
                    os.environ["TRITON_CACHE_DIR"] = saved
            version = getattr(jt, "__version__", "unknown")
            if version not in TESTED_JAX_TRITON:
                warnings.warn(f"jax_triton {version} is untested with sparsetp (tested: "
                              f"{', '.join(TESTED_JAX_TRITON)}); see sparsetp.backends.jax.compat",
                              stacklevel=2)
            _JAX_TRITON = jt
    return _JAX_TRITON


def buffer_callback(callback, result_shape_dtypes) -> Callable:
    """``jax.experimental.buffer_callback.buffer_callback`` (CPU path; see the module docstring).

    ``callback(ctx, out_buffers, *in_buffers)`` writes its results into ``out_buffers`` in
    place; ``np.asarray`` views every buffer on CPU.
    """
    from jax.experimental.buffer_callback import buffer_callback as impl  # noqa: PLC0415

    return impl(callback, result_shape_dtypes)


def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` varies inside ``shard_map`` (empty outside / when replicated)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset()


def mark_varying(x, axes: Iterable[str]) -> jax.Array:
    """``x`` typed as varying over ``axes`` (no-op for axes it already varies over)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # JAX before pcast


def mark_varying_like(values, operands) -> tuple:
    """``values`` (a sequence of arrays) each typed as varying over every mesh axis that an
    array of ``operands`` (a pytree) varies over: what a computation's results are typed as
    when JAX cannot see that they come from its operands (an opaque call, a loop's carry
    started from constants)."""
    axes = frozenset().union(*map(varying_axes, jax.tree.leaves(operands)))
    return tuple(mark_varying(v, axes) for v in values)


def auto_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...],
              devices=None) -> jax.sharding.Mesh:
    """A mesh whose axes are of type Auto.

    ``jax.make_mesh`` defaults to Explicit axes on JAX >= 0.10, under which ``shard_map`` refuses
    inputs not already laid out as its ``in_specs`` and ``with_sharding_constraint`` is rejected;
    with Auto axes XLA reshards as needed, which is what a one-call API like ``hybrid_block``
    wants.
    """
    axis_type = jax.sharding.AxisType.Auto
    kwargs = {} if devices is None else {"devices": devices}
    return jax.make_mesh(shape, axis_names, axis_types=(axis_type,) * len(shape), **kwargs)
