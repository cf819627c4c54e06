"""pytest set-up: JAX needs its CPU device count fixed before its backend starts.

pytest runs every test file in one process, and the torch and spec-layer files never touch JAX,
so the first file to initialise JAX's backend could be any of them (or a doctest). Asking for 4
host devices here, before any test module is imported, makes the JAX tensor-parallel tests see 4
devices whatever the collection order. Importing JAX does not start its backend, so this costs
nothing for torch-only runs beyond the import.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers (no package)

from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()


def pytest_report_header(config):
    """The versions this run used, first thing in the log (tests/versions_test.py checks them)."""
    from versions_test import installed_versions  # noqa: PLC0415

    return "sparsetp ran with: " + ", ".join(
        f"{n} {v}" for n, v in sorted(installed_versions().items()))


_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def pytest_configure(config):
    # xdist registers this mark when installed; without it the marks below would warn (and
    # fail under --strict-markers)
    config.addinivalue_line("markers", "xdist_group(name): tests xdist runs on one worker")


def _own_set_up(cls) -> bool:
    """Whether ``cls`` or one of its bases defined in tests/ has its own ``setUpClass``."""
    for c in cls.__mro__:
        path = getattr(sys.modules.get(c.__module__), "__file__", None) or ""
        if "setUpClass" in vars(c) and os.path.dirname(os.path.abspath(path)) == _TESTS_DIR:
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """Group each class that defines `setUpClass` (itself or a base in tests/) into one xdist group.

    With `--dist loadgroup` (the README's and .ci/gpu_test's runs) such a class then runs on one
    worker, so its shared set-up (a whole benchmark preset, a multi-process run) runs once; plain
    `load` would repeat it on every worker that gets one of its tests.
    """
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and _own_set_up(cls):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{cls.__qualname__}"))
