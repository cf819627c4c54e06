"""pytest set-up: JAX needs its CPU device count fixed before its backend starts.

pytest runs every test file in one process, and the torch and spec-layer files never touch JAX,
so the first file to initialise JAX's backend could be any of them (or a doctest). Asking for 4
host devices here, before any test module is imported, makes the JAX tensor-parallel tests see 4
devices whatever the collection order. Importing JAX does not start its backend, so this costs
nothing for torch-only runs beyond the import.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers (no package)

from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()


def pytest_report_header(config):
    """The versions this run used, first thing in the log (tests/versions_test.py checks them)."""
    from versions_test import installed_versions  # noqa: PLC0415

    return "sparsetp ran with: " + ", ".join(
        f"{n} {v}" for n, v in sorted(installed_versions().items()))
