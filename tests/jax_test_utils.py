"""JAX test set-up shared by the ``tests/jax_*_test.py`` files (not a test file itself).

:func:`ensure_cpu_devices` must run before anything initialises JAX's backends. ``pytest`` runs
every test file in one process, so ``tests/conftest.py`` calls it at collection time, before any
test module is imported; each JAX test file also calls it at its top so that it runs alone
(``python tests/jax_attention_test.py``) as well.
"""

from __future__ import annotations

import os

NUM_CPU_DEVICES = 4


def ensure_cpu_devices(n: int = NUM_CPU_DEVICES) -> None:
    """Give JAX's CPU platform ``n`` devices (no-op if it already has at least ``n``).

    Uses ``jax.config.update("jax_num_cpu_devices", n)``, which only works before the backend
    starts; if it already started with fewer devices, fail loudly rather than let the multi-device
    tests be skipped or silently run on fewer shards.
    """
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
