"""``python -m sparsetp demo --backend jax [--tp N]``: the JAX side of the main job.

One process drives ``tp`` devices through ``jax.shard_map`` (``tp`` GPUs, or ``tp`` CPU host
devices when there is no GPU: the CPU device count is set before JAX starts its backend). It
shards ``init_params(cfg, seed)`` over a 1-D mesh exactly as the torch ranks shard them, runs a
few jitted forward+backward steps of :func:`sparsetp.backends.jax.block.hybrid_block` with a
BigBird pattern on fresh random inputs and random cotangents, compares every step's output,
input gradient and (gathered) parameter gradients with the float64 oracle of the whole block,
and prints a short table. Returns 1 when a check fails.

The arguments are :class:`sparsetp.demo.DemoArgs` (shared with the torch demo, same defaults,
same seeds and data, same tolerance table).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np

from sparsetp.core import init_params, make_layout, param_shapes, reference
from sparsetp.demo import TOLERANCE, DemoArgs, validate

__all__ = ["main"]


def _setup_jax(args: DemoArgs):
    """Import JAX with the right platform and (on CPU) enough host devices; returns
    ``(jax, on_gpu, tp)``. Must run before anything starts JAX's backends."""
    from sparsetp import _runtime  # noqa: PLC0415

    if args.device == "cpu":
        # CPU arrays need the Triton interpreter; kernels read the mode when first imported.
        if "sparsetp.kernels" in sys.modules and not _runtime.interpret_mode():
            raise RuntimeError("--device cpu needs Triton's interpreter, but this process "
                               "already created compiled kernels; set SPARSETP_INTERPRET=1")
        os.environ.setdefault("SPARSETP_INTERPRET", "1")
    import jax  # noqa: PLC0415

    interpret = _runtime.interpret_mode()
    if interpret:  # interpreted kernels take host buffers: keep JAX on CPU (no accelerator probe)
        jax.config.update("jax_platforms", "cpu")
    on_gpu = not interpret
    if args.device == "cuda" and interpret:
        raise RuntimeError("--device cuda but the Triton kernels run in the interpreter here "
                           "(no CUDA GPU found, or SPARSETP_INTERPRET=1)")
    tp = args.tp
    if on_gpu:
        n_gpu = len(jax.devices("gpu"))
        tp = n_gpu if tp is None else tp
        if tp > n_gpu:
            raise ValueError(f"--tp={tp} but JAX sees only {n_gpu} GPUs")
    else:
        tp = 4 if tp is None else tp
        try:
            jax.config.update("jax_num_cpu_devices", max(tp, jax.config.jax_num_cpu_devices))
        except RuntimeError:
            pass  # backend already started: checked just below
        if len(jax.devices("cpu")) < tp:
            raise RuntimeError(
                f"--tp={tp} needs {tp} CPU host devices but JAX already started with "
                f"{len(jax.devices('cpu'))}; set XLA_FLAGS=--xla_force_host_platform_device_count"
                f"={tp} before starting Python")
    return jax, on_gpu, tp


def _scaled_err(got, want) -> float:
    """max|got - want| / max(1, max|want|) (float64), the torch demo's measure."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def main(args: DemoArgs) -> int:
    """Run the JAX demo for ``args``; returns 0 when every check passed."""
    if args.backend != "jax":
        raise ValueError(f"sparsetp.backends.jax.demo runs --backend jax, got {args.backend!r}")
    jax, on_gpu, tp = _setup_jax(args)
    import jax.numpy as jnp  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    from sparsetp.backends.jax import block as B  # noqa: PLC0415

    args = dataclasses.replace(args, tp=tp).with_defaults(on_gpu)
    cfg = args.config()
    validate(cfg, tp)  # before the mesh (and after _setup_jax: it imports the kernels)
    if cfg.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    devices = jax.devices("gpu" if on_gpu else "cpu")[:tp]
    mesh = B.make_mesh(tp, "tp", devices=devices)
    params = init_params(cfg, args.seed)  # float32; the oracle gets these
    layout = make_layout(cfg.pattern, args.seq_len, cfg.num_heads, cfg.block_size)
    shape = (args.batch, args.seq_len, cfg.d_model)
    dtype = jnp.dtype(cfg.dtype)
    # Held in the compute dtype, like the torch block's parameters.
    sharded = B.shard_params({n: jnp.asarray(a, dtype) for n, a in params.items()}, cfg, mesh,
                             "tp")

    @jax.jit
    def step(p, x, dy):
        y, vjp = jax.vjp(lambda p, x: B.hybrid_block(p, x, cfg, mesh=mesh), p, x)
        dp, dx = vjp(dy)
        return y, dx, dp

    errors = {"y": 0.0, "dx": 0.0, "dparams": 0.0}
    worst_param = ""
    step_times, oracle_s = [], 0.0
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
        y_ref = reference.hybrid_block(params, x, cfg)
        dx_ref, g_ref = reference.hybrid_block_grad(params, x, cfg, dy)
        oracle_s += time.perf_counter() - t1
        errors["y"] = max(errors["y"], _scaled_err(y, y_ref))
        errors["dx"] = max(errors["dx"], _scaled_err(dx, dx_ref))
        for name, g in grads.items():
            e = _scaled_err(g, g_ref[name])
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
    later = step_times[1:] or step_times
    dev = devices[0]
    rows = [
        ("backend", f"jax {jax.__version__}, TP={tp} via shard_map on {dev.platform} "
                    f"({dev.device_kind}); kernels "
                    + ("compiled (jax_triton)" if on_gpu else "in Triton's interpreter "
                       "(buffer_callback; correctness, not speed)")),
        ("sizes", f"B={args.batch} N={args.seq_len} d_model={cfg.d_model} "
                  f"heads={cfg.num_heads} ({cfg.num_heads // tp}/shard, head_dim="
                  f"{cfg.head_dim}) d_ff={cfg.d_ff} ({cfg.d_ff // tp}/shard) dtype={cfg.dtype}"),
        ("pattern", args.pattern_description()),
        ("layout", f"block {cfg.block_size}: {layout.nnz_blocks} of {layout.block_mask.size} "
                   f"tiles computed, density {layout.density:.3f}"),
        ("steps", f"{len(step_times)} x jitted fwd+bwd: first {step_times[0] * 1e3:.1f} ms "
                  f"(with compile), then {np.median(later) * 1e3:.1f} ms/step (median); "
                  f"oracle {oracle_s:.2f} s"),
        ("max error vs fp64", f"y {errors['y']:.2e}  dx {errors['dx']:.2e}  dparams "
                              f"{errors['dparams']:.2e} ({worst_param})"),
        ("check", f"{'PASS' if ok else 'FAIL'} (scaled max error <= {tol:g} for {cfg.dtype})"),
        ("params / shard", "  ".join(f"d{i}: {_kib(per_device[d])}"
                                     for i, d in enumerate(devices))
                           + f"  (unsharded {_kib(full_bytes)})"),
    ]
    width = max(len(k) for k, _ in rows)
    print("sparsetp demo (JAX): tensor-parallel hybrid block vs the float64 oracle of the whole "
          "block")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    sys.stdout.flush()
    return 0 if ok else 1
