"""One process of the 2-process JAX stall test (not a test file itself).

``python tests/jax_stall_worker.py COORDINATOR PROCESS_ID TIMEOUT_S BAD_PROCESS MODE``: joins a
2-process job through ``sparsetp``'s ``init_distributed`` (gloo CPU collectives, every JAX
timeout ``TIMEOUT_S``), runs one cross-process all-reduce step as a warm-up (both processes
healthy), then process ``BAD_PROCESS`` misbehaves before the second step: MODE ``stall`` sleeps
forever (alive, heartbeating), ``die`` calls ``os._exit(1)``. The other process runs the step
under ``deadline("train step")`` and prints ``ENTER <time.time()>`` first, so the test can time
its exit from there.
"""

from __future__ import annotations

import os
import sys
import time


def main(coordinator: str, process_id: int, timeout_s: int, bad: int, mode: str) -> None:
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from sparsetp.backends.jax.distributed import deadline, init_distributed  # noqa: PLC0415

    jax.config.update("jax_num_cpu_devices", 1)  # before the backend starts
    init_distributed(coordinator, 2, process_id, timeout_s=timeout_s)
    mesh = Mesh(np.array(jax.devices()), ("data",))  # one device per process
    x = jax.make_array_from_callback((2,), NamedSharding(mesh, P("data")),
                                     lambda idx: np.ones(1, np.float32))
    step = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))  # all-reduce
    with deadline("warm-up step"):
        print("WARM", float(jax.block_until_ready(step(x)).addressable_data(0)), flush=True)
    if process_id == bad:
        print("BAD", mode, flush=True)
        if mode == "stall":
            time.sleep(3600)
        os._exit(1)
    print("ENTER", time.time(), flush=True)
    with deadline("train step"):
        jax.block_until_ready(step(2 * x))
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
