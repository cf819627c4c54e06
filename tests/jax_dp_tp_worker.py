"""One process of the 2-process JAX data x tensor-parallel test (not a test file itself).

``python tests/jax_dp_tp_worker.py COORDINATOR PROCESS_ID OUT.npy``: joins a 2-process JAX job
(``sparsetp.jax.init_distributed``: gloo CPU collectives, 60 s timeouts) with 2 local CPU
devices, builds the 2 x 2 ("data", "model") mesh over the 4 devices of both processes, runs
one training step of the two-block stack and saves the loss, the gathered gradients and the
stepped parameters.
``jax_dp_tp_test.py`` imports :func:`loss` and :func:`sgd` from here (the same model).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp


def loss(params, x, t, cfg, **kw):
    """``mean((blocks(x) - t) ** 2)`` over the global batch; ``kw`` goes to every block."""
    from sparsetp.backends.jax.block import hybrid_block  # noqa: PLC0415

    y = x
    for p in params:
        y = hybrid_block(p, y, cfg, **kw)
    return jnp.mean((y - t) ** 2)


def sgd(params, grads, lr):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def main(coordinator: str, process_id: int, out: str) -> None:
    jax.config.update("jax_num_cpu_devices", 2)  # before the backend starts
    from sparsetp.backends.jax.distributed import init_distributed  # noqa: PLC0415

    init_distributed(coordinator, num_processes=2, process_id=process_id, timeout_s=60)
    import dp_tp_common as C  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from sparsetp.backends.jax import block as B  # noqa: PLC0415
    from sparsetp.core import init_params  # noqa: PLC0415

    cfg = C.config()
    mesh = B.make_2d_mesh(C.DP, C.TP)  # the 4 devices of both processes
    local = {d.process_index for d in jax.local_devices()}
    # tp innermost, devices ordered by process: each "model" row is one process's devices.
    rows = [sorted({d.process_index for d in row}) for row in mesh.devices]
    params = tuple(B.shard_params(init_params(cfg, s), cfg, mesh, "model") for s in C.SEEDS)
    x, t = B.shard_batch(C.data(), mesh)
    kw = dict(mesh=mesh, axis_name="model", batch_axis="data")
    # x and t are arguments: a jit may not close over arrays spread over several processes.
    step = jax.jit(jax.value_and_grad(lambda p, x, t: loss(p, x, t, cfg, **kw)))
    value, grads = step(params, x, t)
    new = sgd(params, grads, C.LR)
    result = dict(rows=rows, local=sorted(local), loss=float(value.addressable_data(0)),
                  grads=[B.export_params(g) for g in grads],
                  params=[B.export_params(p) for p in new])
    np.save(out, result, allow_pickle=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
