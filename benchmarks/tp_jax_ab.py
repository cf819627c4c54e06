"""JAX tensor parallelism against its no-communication ceiling (issue #26), 2 devices.

The torch runs of session 27 (``tp_block_ab.py``) showed #26's targets sitting at what TP=2
reaches with no communication at all. This is the same measurement for the JAX frontend: the
``gpu2`` preset's MLP and hybrid block (T = 8192, d = 8192, ff = 32768, 64 heads of 128,
BigBird, bf16), fwd+bwd (``jax.vjp``, the output returned too), arms timed in interleaved
rounds (a burst of 4 calls each, median per call):

- ``tp1``: every device runs the whole unsharded model on its own copy (so both devices are
  busy, as in the TP arms: the same power and clocks);
- ``nocomm``: every device runs its TP=2 shard (half the heads and hidden columns, the
  replicated layer norms) with no collective (inputs stacked per device, so autodiff adds none);
  the ceiling of any schedule;
- ``plain``, ``overlap``, ``sp``, ``sp_overlap``: ``hybrid_block`` / ``parallel_mlp`` at TP=2
  with ``overlap_comm`` and ``sequence_parallel`` as named.

Efficiency ``t(tp1) / (2 t(arm))``. Also checks that ``plain`` and ``nocomm`` compiled to as
many / no all-reduces. ``--profile`` adds per arm a JAX profiler trace (kernel ms by kind on the
first GPU, NCCL ms with no other kernel beside it, copies by XLA op) and, per collective of the
compiled step, the GEMMs and ops XLA scheduled between its start and done. The block's x and dy
sit on the mesh as a previous block leaves them (``sparsetp.bench.tp._jax_block_input``).
``--preset=cpu`` runs tiny shapes on 2 host devices (a functional check).

    PYTHONPATH=$PWD python benchmarks/tp_jax_ab.py --out=OUT.json [--rounds=15]

On the GPU machine jax-triton comes from the carried wheels (carry ``.whl``, BUILD.md)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:$PWD \
        python3 benchmarks/tp_jax_ab.py --out=$OUT/tp_jax_ab.json

Run on 2 H200s in session 28 (``results/tp_jax_ab_h200x2.json``, KERNEL_NOTES "Session 28").
"""
from __future__ import annotations

import collections
import json
import os
import re
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", "gpu2", ["gpu2", "cpu"], "shapes: the TP bench's gpu2, or tiny")
flags.DEFINE_integer("rounds", 15, "interleaved rounds")
flags.DEFINE_list("models", ["mlp", "block"], "mlp, block")
flags.DEFINE_string("out", None, "write the result here as JSON")
flags.DEFINE_bool("profile", False, "also trace each arm (GPU): kernel time by kind, NCCL with "
                  "no compute beside it, and what XLA scheduled between each collective's "
                  "start and done")

ARMS = {"plain": {}, "overlap": dict(overlap_comm=True), "sp": dict(sequence_parallel=True),
        "sp_overlap": dict(sequence_parallel=True, overlap_comm=True)}


def _spec():
    from sparsetp.bench import tp as T  # noqa: PLC0415
    if FLAGS.preset == "cpu":
        return dict(batch=1, seq_len=256, d_model=128, num_heads=4, d_ff=512, block_size=32,
                    dtype="float32")
    return T.resolve_spec("gpu2", 2, "cuda")


def _stacked(a, mesh):
    """``a`` once per device: ``[2, ...]`` split over ``tp`` (a mapped input, so the
    transpose of ``shard_map`` adds no collective for it)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415
    return jax.device_put(jnp.stack([a, a]), NamedSharding(mesh, P("tp")))


def _fwd_bwd(f):
    import jax  # noqa: PLC0415

    def step(params, x, dy):
        y, vjp = jax.vjp(f, params, x)
        return y, vjp(dy)
    return jax.jit(step)


def _block_arms(spec, mesh):
    """``{arm: (jitted fwd+bwd, args)}`` for the hybrid block."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from sparsetp.backends.jax.attention import layout_arrays  # noqa: PLC0415
    from sparsetp.backends.jax.block import (  # noqa: PLC0415
        _block_local,
        block_layout,
        hybrid_block,
        param_specs,
        shard_params,
    )
    from sparsetp.bench import tp as T  # noqa: PLC0415

    cfg = T._config(spec)
    rng = np.random.default_rng(0)
    full = T._jax_block_params(cfg, rng)
    shape = (spec["batch"], spec["seq_len"], spec["d_model"])
    x = jax.numpy.asarray(rng.standard_normal(shape, dtype=np.float32), cfg.dtype)
    dy = jax.numpy.asarray(rng.standard_normal(shape, dtype=np.float32), cfg.dtype)
    lay = layout_arrays(block_layout(cfg, spec["seq_len"]), head_dim=cfg.head_dim,
                        dtype=cfg.dtype, static_widths=True)
    specs = param_specs(cfg, "tp")
    arms = {}

    def per_device(params, lay_spec, replicated):
        # Every input mapped over the stacked axis or split as TP splits it; no collective.
        in_specs = ({n: P("tp") if n in replicated else specs[n] for n in params}, P("tp"),
                    lay_spec)

        def local(p, xs, lay_):
            p = {n: (a[0] if n in replicated else a) for n, a in p.items()}
            return _block_local(p, xs[0], lay_, cfg, None)[None]
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P("tp"))

    everything = set(full)
    tp1 = per_device(full, lay.partition_specs(None), everything)
    arms["tp1"] = (_fwd_bwd(lambda p, xs: tp1(p, xs, lay)),
                   ({n: _stacked(a, mesh) for n, a in full.items()}, _stacked(x, mesh),
                    _stacked(dy, mesh)))
    sharded = shard_params(full, cfg, mesh)
    replicated = {n for n in full if all(ax is None for ax in specs[n])}
    nocomm = per_device(full, lay.partition_specs("tp"), replicated)
    arms["nocomm"] = (_fwd_bwd(lambda p, xs: nocomm(p, xs, lay)),
                      ({n: (_stacked(full[n], mesh) if n in replicated else a)
                        for n, a in sharded.items()}, _stacked(x, mesh), _stacked(dy, mesh)))
    for arm, kw in ARMS.items():
        sp = kw.get("sequence_parallel", False)
        arms[arm] = (_fwd_bwd(lambda p, x_, kw=kw: hybrid_block(p, x_, cfg, mesh=mesh, **kw)),
                     (sharded, *(T._jax_block_input(a, cfg, mesh, sp) for a in (x, dy))))
    return arms


def _mlp_arms(spec, mesh):
    """``{arm: (jitted fwd+bwd, args)}`` for the MLP (fc1 column, fc2 row): the TP=2 arms are
    the TP bench's own (:func:`sparsetp.bench.tp._jax_mlp_fns`); ``tp1`` and ``nocomm`` run
    their weights and inputs."""
    import jax  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from sparsetp.backends.jax.layers import parallel_mlp  # noqa: PLC0415
    from sparsetp.bench import tp as T  # noqa: PLC0415

    tp2 = {arm: T._jax_mlp_fns(spec, mesh, "tp", dp=False, **kw)[1:] for arm, kw in ARMS.items()}
    params, x, dy = tp2["plain"][1]
    full = dict(zip(("w1", "b1", "w2", "b2"), params, strict=True))
    split = {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)}  # as TP splits them

    def per_device(kept):
        """Every device runs the MLP alone: the parameters in ``kept`` as TP splits them, the
        others (and x, dy) stacked once per device; no collective."""
        def local(p, xs):
            p = {n: (a if n in kept else a[0]) for n, a in p.items()}
            return parallel_mlp(xs[0], p["w1"], p["b1"], p["w2"], p["b2"], axis_name=None)[None]
        f = jax.shard_map(local, mesh=mesh, in_specs=(
            {n: split[n] if n in kept else P("tp") for n in full}, P("tp")), out_specs=P("tp"))
        return _fwd_bwd(f), ({n: (a if n in kept else _stacked(a, mesh)) for n, a in full.items()},
                            _stacked(x, mesh), _stacked(dy, mesh))

    return {"tp1": per_device(set()), "nocomm": per_device(set(split)), **tp2}


def _all_reduces(fn, args) -> int:
    """All-reduces in the compiled step (async start/done pairs counted once)."""
    text = fn.lower(*args).compile().as_text()
    return text.count("all-reduce-start(") + text.count(" all-reduce(")


def _schedule(text: str) -> list:
    """For each async collective of the compiled step's entry computation (in XLA's schedule
    order): its kind, its result shape and how many GEMMs and other ops run between its start
    and its done, which is all the overlap XLA can give it."""
    entry = text[text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    open_, rows = {}, []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\(", line)
        if not m:
            continue
        name, shape, op = m.groups()
        kind = op[:-6] if op.endswith("-start") else ""
        if kind == "async":  # a collective XLA wraps in an async computation
            kind = next((c for c in _COLLECTIVES if c in line), "")
        if kind in _COLLECTIVES:
            open_[name] = dict(op=kind, shape=shape[:60], gemms=0, ops=0)
        elif op.endswith("-done"):
            start = re.search(r"-done\(%?([\w.\-]+)", line)
            if start and start.group(1) in open_:
                rows.append(open_.pop(start.group(1)))
        else:
            gemm = "gemm" in line or "__cublas" in line or "dot(" in line
            for row in open_.values():
                row["ops"] += 1
                row["gemms"] += gemm
    return rows


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _trace(fn, args, steps=3) -> dict:
    """Kernel ms per step by kind on the first GPU, and NCCL ms with no other kernel running
    beside it, from a JAX profiler trace (Perfetto JSON)."""
    import gzip  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import jax  # noqa: PLC0415
    from tp_profile import cat, exposed_ms  # noqa: PLC0415

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                out = fn(*args)
            jax.block_until_ready(out)
        path = next(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs
                    if f == "perfetto_trace.json.gz")
        events = json.load(gzip.open(path))["traceEvents"]
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and e["args"]["name"].startswith("/device:GPU:0")}
    kern = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur")]
    sums, comp, nccl = collections.Counter(), [], []
    copies = collections.Counter()  # copies and fills by kernel and XLA op: none in nocomm
    for e in kern:
        c = cat(e["name"])
        sums[c] += e["dur"] / steps / 1e3
        if c == "copy":
            args = e.get("args", {})
            op = args.get("hlo_op") or args.get("long_name") or ""
            copies[f"{e['name'][:40]} {op[:60]}"] += e["dur"] / steps / 1e3
        if c == "nccl":
            nccl.append((e["ts"], e["ts"] + e["dur"], e["name"].split("(")[0][:48]))
        else:
            comp.append((e["ts"], e["ts"] + e["dur"]))
    exposed = exposed_ms(comp, nccl, steps)
    return dict(by_cat={k: round(v, 3) for k, v in sums.most_common()},
                nccl_exposed_ms=round(sum(exposed.values()), 3),
                nccl_exposed_by_kernel={k: round(v, 3) for k, v in exposed.most_common(6)},
                copies={k: round(v, 3) for k, v in copies.most_common(8)},
                event_args=sorted({k for e in kern for k in e.get("args", {})})[:20])


def _interleaved(arms, rounds, burst=4):
    import jax  # noqa: PLC0415
    compiled = {}
    for name, (fn, args) in arms.items():
        compiled[name] = (fn.lower(*args).compile(), args)
        jax.block_until_ready(compiled[name][0](*args))
    per = {name: [] for name in arms}
    for _ in range(rounds):
        for name, (fn, args) in compiled.items():
            t = time.perf_counter()
            for _ in range(burst):
                out = fn(*args)
            jax.block_until_ready(out)
            per[name].append((time.perf_counter() - t) / burst * 1e3)
    return {name: sorted(v)[len(v) // 2] for name, v in per.items()}


def main(argv):
    del argv
    if FLAGS.preset == "cpu":
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    import jax  # noqa: PLC0415

    from sparsetp.backends.jax.block import make_mesh  # noqa: PLC0415

    spec = _spec()
    mesh = make_mesh(2)
    result = dict(preset=FLAGS.preset, rounds=FLAGS.rounds, jax=jax.__version__,
                  devices=[str(d) for d in jax.devices()], models={})
    for model in FLAGS.models:
        arms = (_mlp_arms if model == "mlp" else _block_arms)(spec, mesh)
        reduces = {a: _all_reduces(*arms[a]) for a in ("tp1", "nocomm", "plain")}
        ms = _interleaved(arms, FLAGS.rounds)
        eff = {a: round(ms["tp1"] / (2 * t), 4) for a, t in ms.items() if a != "tp1"}
        result["models"][model] = dict(ms=ms, efficiency=eff, all_reduces=reduces)
        if FLAGS.profile:
            result["models"][model]["schedule"] = {
                a: _schedule(fn.lower(*args).compile().as_text())
                for a, (fn, args) in arms.items() if a not in ("tp1", "nocomm")}
            result["models"][model]["trace"] = {a: _trace(fn, args)
                                                for a, (fn, args) in arms.items()}
        print(model, json.dumps(result["models"][model]), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
