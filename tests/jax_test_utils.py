"""JAX test set-up shared by the ``tests/jax_*_test.py`` files (not a test file itself).

:func:`ensure_cpu_devices` must run before anything initialises JAX's backends. ``pytest`` runs
every test file in one process, so ``tests/conftest.py`` calls it at collection time, before any
test module is imported; each JAX test file also calls it at its top so that it runs alone
(``python tests/jax_attention_test.py``) as well.

Devices (the suite's rule, the one :func:`sparsetp.backends.jax.block.mesh_devices` implements):
a test that needs ``n`` devices runs on the first ``n`` devices of JAX's default backend if it has
``n`` (the GPUs of a GPU machine), else on ``n`` CPU host devices (:func:`ensure_cpu_devices`
provides 4), else it is skipped with a reason naming what it needs. :func:`devices`,
:func:`mesh` and :func:`on_devices_of` are that rule for tests; a test that compares runs of
several sizes (unsharded against 2 and 4 shards, say) takes the devices of its largest size for
all of them, so that one platform computes every number it compares.
"""

from __future__ import annotations

import contextlib
import os
import re
import unittest

NUM_CPU_DEVICES = 4


def ensure_cpu_devices(n: int = NUM_CPU_DEVICES) -> None:
    """Give JAX's CPU platform ``n`` devices (no-op if it already has at least ``n``).

    Uses ``jax.config.update("jax_num_cpu_devices", n)``, which only works before the backend
    starts; if it already started with fewer devices, fail loudly rather than let the multi-device
    tests be skipped or silently run on fewer shards.

    Also, unless the environment says otherwise, has JAX allocate GPU memory as it needs it
    (``XLA_PYTHON_CLIENT_PREALLOCATE=false``): in a test run torch and JAX share the GPU, as do
    pytest-xdist's workers, and JAX's default (75% of the GPU at its first use) starves them.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read when JAX's GPU starts
    import jax  # noqa: PLC0415  (callers control when JAX is first imported)

    if jax.config.jax_num_cpu_devices >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have < n:
            raise RuntimeError(
                f"JAX's CPU backend started with {have} device(s) before the tests could ask for "
                f"{n}; set XLA_FLAGS=--xla_force_host_platform_device_count={n}") from None
    os.environ.setdefault("SPARSETP_TEST_CPU_DEVICES", str(n))


def cpu_device_count() -> int:
    import jax  # noqa: PLC0415

    return len(jax.devices("cpu"))


def devices(n: int) -> list:
    """The ``n`` devices a test needing ``n`` devices runs on (the rule above); raises
    ``unittest.SkipTest`` naming what is missing when neither the default backend nor the CPU
    backend has ``n``."""
    from sparsetp.backends.jax.block import mesh_devices  # noqa: PLC0415

    try:
        return mesh_devices(n)
    except ValueError as e:
        raise unittest.SkipTest(f"needs {n} JAX devices: {e}") from None


def mesh(n: int, axis_name: str = "tp", *, explicit: bool = False):
    """A 1-D mesh over :func:`devices` ``(n)``: ``make_mesh``'s Auto axis, or with
    ``explicit=True`` ``jax.make_mesh``'s Explicit one."""
    import jax  # noqa: PLC0415

    from sparsetp.backends.jax.block import make_mesh  # noqa: PLC0415

    if explicit:
        return jax.make_mesh((n,), (axis_name,), axis_types=(jax.sharding.AxisType.Explicit,),
                             devices=devices(n))
    return make_mesh(n, axis_name, devices=devices(n))


@contextlib.contextmanager
def on_devices_of(n: int):
    """Make the first of :func:`devices` ``(n)`` JAX's default device inside the block: the
    unsharded runs of a test that compares them with runs on ``n`` devices then compute on the
    same platform as those."""
    import jax  # noqa: PLC0415

    with jax.default_device(devices(n)[0]):
        yield


def assert_block_matches(got, ref, label: str) -> None:
    """``(y, dx, grads)`` of a hybrid-block run against another (``grads``: canonical name ->
    array), at the suite's float32 tolerances (gradients 2x)."""
    from testing_utils import assert_close  # noqa: PLC0415

    y, dx, grads = got
    ref_y, ref_dx, ref_grads = ref
    assert_close(y, ref_y, "float32", what=f"y {label}")
    assert_close(dx, ref_dx, "float32", grad=True, what=f"dx {label}")
    if set(grads) != set(ref_grads):
        raise AssertionError(f"{label}: gradient names {sorted(grads)} != {sorted(ref_grads)}")
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], "float32", grad=True,
                     what=f"d {name} {label}")


_COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(collective-permute|all-gather|"
                         r"reduce-scatter|all-reduce)(?:-start)?\(")


def hlo_collectives(hlo: str) -> dict[str, list[tuple[int, ...]]]:
    """``{op: [result array shape, ...]}`` of every collective-permute, all-gather,
    reduce-scatter and all-reduce in compiled HLO text (a tuple-shaped, combined collective
    lists each of its arrays)."""
    out = {"collective-permute": [], "all-gather": [], "reduce-scatter": [], "all-reduce": []}
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            for dims in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", m.group(1)):
                out[m.group(2)].append(tuple(int(d) for d in dims.split(",") if d))
    return out


def rng_arrays(seed: int, *shapes, scale: float = 1.0) -> list:
    """float32 standard-normal arrays of ``shapes`` (times ``scale``) from one seeded generator."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(s)).astype(np.float32) for s in shapes]


PSUMS = ("psum", "psum_invariant", "psum2")  # the all-reduce primitives' names across JAX versions


def count_primitives(fn, *args, names=PSUMS) -> int:
    """Occurrences of the primitives ``names`` (default: all-reduces) in the jaxpr of
    ``fn(*args)``, nested jaxprs included."""
    import jax  # noqa: PLC0415

    text = str(jax.make_jaxpr(fn)(*args))
    return sum(text.count(f"{name}[") for name in names)
