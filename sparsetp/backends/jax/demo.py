"""``python -m sparsetp demo --backend jax [--tp N]``: the JAX side of the main job.

One process drives ``tp`` devices through ``jax.shard_map``. Which devices follows the demos'
device rule (:func:`sparsetp.demo.choose_device`): ``tp`` GPUs when JAX sees at least ``tp``
(compiled Triton kernels through jax_triton), otherwise ``tp`` CPU host devices (Triton's
interpreter through a host callback), so ``--tp 4`` on a machine with one GPU runs on 4 CPU
devices and says so; ``--device cuda`` refuses that, ``--device cpu`` asks for it. The CPU device
count is raised to ``tp`` before JAX starts its backends (in a process where they already
started with fewer, the error says how to get more). The demo shards ``init_params(cfg, seed)``
over a 1-D mesh exactly as the torch ranks shard them, runs a few jitted forward+backward steps
of :func:`sparsetp.backends.jax.block.hybrid_block` with a BigBird pattern on fresh random
inputs and random cotangents, compares every step's output, input gradient and (gathered)
parameter gradients with the float64 oracle of the whole block, and prints a short table.
Returns 1 when a check fails.

The arguments are :class:`sparsetp.demo.DemoArgs` (shared with the torch demo: same defaults,
same seeds and data, same tolerance table, same device rule); this module imports those pieces
from :mod:`sparsetp.demo`, which never imports this one.

Example::

    >>> from sparsetp.demo import DemoArgs                                   # doctest: +SKIP
    >>> main(DemoArgs(backend="jax", tp=2, seq_len=64, d_model=32, num_heads=2, d_ff=64,
    ...               block_size=16, steps=1))                               # doctest: +SKIP
    0
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

from sparsetp.core import init_params, make_layout, param_shapes, reference
from sparsetp.demo import (
    CPU_TP,
    TOLERANCE,
    DemoArgs,
    Placement,
    choose_device,
    common_rows,
    kernels_path,
    kib,
    print_table,
    scaled_error,
    validate,
)

__all__ = ["main", "placement"]


def _gpu_count(jax) -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend (CPU-only jaxlib, JAX_PLATFORMS=cpu, no device)
        return 0


def placement(args: DemoArgs):
    """``(jax, Placement, devices)`` for ``args``: the device rule applied to JAX's GPUs, and the
    ``tp`` devices it picked. Must run before anything else starts JAX's backends for the CPU
    device count to take effect."""
    import jax  # noqa: PLC0415

    want_cpu = args.tp or CPU_TP
    if jax.config.jax_num_cpu_devices < want_cpu:
        try:  # only before the backends start; checked below if it is too late
            jax.config.update("jax_num_cpu_devices", want_cpu)
        except RuntimeError:
            pass
    place: Placement = choose_device(args.device, args.tp, _gpu_count(jax), "JAX")
    devices = jax.devices("gpu" if place.on_gpu else "cpu")
    if len(devices) < place.tp:
        raise RuntimeError(
            f"--tp={place.tp} needs {place.tp} CPU host devices but JAX already started with "
            f"{len(devices)}; set XLA_FLAGS=--xla_force_host_platform_device_count={place.tp} "
            f"before starting Python")
    return jax, place, devices[:place.tp]


def main(args: DemoArgs) -> int:
    """Run the JAX demo for ``args``; returns 0 when every check passed."""
    if args.backend != "jax":
        raise ValueError(f"sparsetp.backends.jax.demo runs --backend jax, got {args.backend!r}")
    jax, place, devices = placement(args)
    import jax.numpy as jnp  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    from sparsetp.backends.jax import block as B  # noqa: PLC0415

    tp = place.tp
    args = dataclasses.replace(args, tp=tp).with_defaults(place.on_gpu)
    cfg = args.config()
    validate(cfg, tp)  # before the mesh
    if cfg.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    print(f"sparsetp demo (JAX): TP={tp} on {place.device} ({place.reason}); "
          f"{kernels_path(place.device)}", flush=True)
    mesh = B.make_mesh(tp, "tp", devices=devices)
    params = init_params(cfg, args.seed)  # float32; the oracle gets these
    layout = make_layout(cfg.pattern, args.seq_len, cfg.num_heads, cfg.block_size)
    shape = (args.batch, args.seq_len, cfg.d_model)
    dtype = jnp.dtype(cfg.dtype)

    @jax.jit
    def step(p, x, dy):
        y, vjp = jax.vjp(lambda p, x: B.hybrid_block(p, x, cfg, mesh=mesh), p, x)
        dp, dx = vjp(dy)
        return y, dx, dp

    errors = {"y": 0.0, "dx": 0.0, "dparams": 0.0}
    worst_param = ""
    step_times, oracle_s = [], 0.0
    # Every array of the run on the mesh's platform, never on a default device elsewhere.
    with jax.default_device(devices[0]):
        # Held in the compute dtype, like the torch block's parameters.
        sharded = B.shard_params({n: jnp.asarray(a, dtype) for n, a in params.items()}, cfg,
                                 mesh, "tp")
        bar = tqdm(range(args.steps), desc=f"fwd+bwd (jax, tp={tp})", file=sys.stdout)
        for i in bar:
            rng = np.random.default_rng((args.seed, i))  # the torch demo's draws
            x = rng.standard_normal(shape)
            dy = rng.standard_normal(shape)
            xj, dyj = jnp.asarray(x, dtype), jnp.asarray(dy, dtype)
            t0 = time.perf_counter()
            out = jax.block_until_ready(step(sharded, xj, dyj))
            step_times.append(time.perf_counter() - t0)
            y, dx, dp = out
            grads = B.export_params(dp)  # gathered, unsharded
            t1 = time.perf_counter()
            y_ref, dx_ref, g_ref = reference.hybrid_block_value_and_grad(params, x, cfg, dy)
            oracle_s += time.perf_counter() - t1
            errors["y"] = max(errors["y"], scaled_error(y, y_ref))
            errors["dx"] = max(errors["dx"], scaled_error(dx, dx_ref))
            for name, g in grads.items():
                e = scaled_error(g, g_ref[name])
                if e >= errors["dparams"]:
                    errors["dparams"], worst_param = e, name
        bar.close()
    tol = TOLERANCE[cfg.dtype]
    ok = all(e <= tol for e in errors.values())
    per_device = {d: 0 for d in devices}
    for a in sharded.values():
        for s in a.addressable_shards:
            per_device[s.device] += s.data.nbytes
    full_bytes = sum(int(np.prod(s)) for s in param_shapes(cfg).values()) * dtype.itemsize
    dev = devices[0]
    kernels = kernels_path(place.device) + (" via jax_triton" if place.on_gpu
                                            else " via a host callback")
    rows = [
        ("backend", f"jax {jax.__version__}, TP={tp} via shard_map on {dev.platform} "
                    f"({dev.device_kind})"),
        ("device", f"{place.device}: {tp} {dev.platform} device{'s' if tp > 1 else ''} "
                   f"({place.reason})"),
        ("kernels", kernels),
        *common_rows(args, cfg, layout, step_times, oracle_s, errors, worst_param, tol, ok,
                     "shard", "jitted fwd+bwd (the first with compile)"),
        ("params / shard", "  ".join(f"d{i}: {kib(per_device[d])}"
                                     for i, d in enumerate(devices))
                           + f"  (unsharded {kib(full_bytes)})"),
    ]
    print_table("sparsetp demo (JAX): tensor-parallel hybrid block vs the float64 oracle of the "
                "whole block", rows)
    return 0 if ok else 1
