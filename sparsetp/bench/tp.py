"""``python -m sparsetp.bench tp``: tensor-parallel strong scaling, against DP, PP and DTensor.

One fixed model (the MLP and the hybrid block of :mod:`sparsetp.core.config`) on TP = 1, 2, 4,
... up to every device of the machine, in PyTorch (``sparsetp.backends.torch``, NCCL on GPUs,
gloo on CPU) and JAX (``shard_map``), forward and forward+backward. Recorded per case: median
time, tokens/s, TFLOP/s per GPU, strong-scaling efficiency ``T1 / (p * Tp)``, per-GPU parameter
bytes and activation bytes. Next to it: all-reduce latency and bus bandwidth by message size;
the same MLP under data parallelism (torch DDP; JAX with the batch sharded) and under a
two-stage pipeline (``torch.distributed.pipelining``, GPipe) with time, communication volume and
memory per GPU; and DTensor's ColwiseParallel/RowwiseParallel MLP on the same shapes. The
``torch_sp`` stage times the torch MLP and block with sequence parallelism
(``sequence_parallel=True``: each rank gets ``T / p`` tokens, all-gather/reduce-scatter instead
of all-reduce) at every TP size > 1, recorded as variant ``sp`` next to the plain TP rows; its
efficiency is against the plain TP=1 time (SP on one rank is plain TP). The JAX stages
``jax_overlap`` (MLP) and ``jax_block_overlap`` time TP = world with ``overlap_comm`` off and on,
without and with sequence parallelism (variants ``plain``, ``overlap``, ``sp_plain``,
``sp_overlap``; efficiency against JAX's plain TP=1 time; each row's HLO summary counts the
all-reduces, collective-permutes, all-gathers and reduce-scatters and the GEMMs XLA put inside
each async one).

The tool starts its own processes: one spawn of ``world`` torch ranks (each stage in turn) and
one Python subprocess per JAX variant (JAX drives every device from one process). Each stage is
recorded as soon as it ends; a failure is recorded with its traceback and the next stage still
runs; ``--budget_s`` bounds the wall clock (stages that no longer fit are recorded as skipped).

Usage::

    python -m sparsetp.bench tp --preset=cpu                      # tiny, gloo, 4 CPU processes
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python -m sparsetp.bench tp --preset=gpu2 --out_dir=$OUT   # 2 GPUs, ~150 s

Devices (:func:`resolve_device`): ``--preset=cpu`` runs on CPU ranks wherever it runs (a GPU
machine too) unless ``--device=cuda``; ``--preset=gpu2`` runs one rank per GPU and needs 2 GPUs.

Output: ``<out_dir>/tp.json`` (and ``tp_*.png`` with matplotlib). Believe the numbers only when
``tests/torch_tp_test.py``, ``tests/torch_overlap_test.py``, ``tests/torch_sp_test.py``,
``tests/jax_tp_test.py``, ``tests/jax_sp_test.py`` and ``tests/jax_overlap_test.py`` pass.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

from absl import flags

from sparsetp.bench import common

FLAGS = flags.FLAGS


def _define_shared_flags():
    """--preset and --budget_s: generic names that sparsetp.bench.attention defines too (with
    its own preset names), so they are defined only when this command runs and only if absent:
    importing both modules in one process (pytest) must not raise DuplicateFlagError."""
    if "preset" not in FLAGS:
        flags.DEFINE_string("preset", "cpu", "Shapes and iterations: cpu (tiny, gloo) or gpu2 "
                            "(T=8192, d=8192, ff=32768, bf16 on the GPUs).")
    if "budget_s" not in FLAGS:
        flags.DEFINE_float("budget_s", None, "Wall-clock budget in seconds (default: the "
                           "preset's).")


flags.DEFINE_integer("tp_world", None, "Processes/devices to use (default: every GPU, or 4 on "
                     "CPU). TP sizes are the powers of two up to it.")
flags.DEFINE_list("tp_stages", "comm,torch_mlp,torch_overlap,torch_overlap_ab,dtensor,ddp,"
                  "pipeline,torch_block,"
                  "torch_sp,jax", "Stages to run (jax covers JAX TP, DP, block and the XLA-flag "
                  "variants; torch_sp the sequence-parallel torch MLP and block).")
flags.DEFINE_bool("tp_jax_variants", True, "Also time the JAX MLP with the latency-hiding "
                  "scheduler forced on and off (one extra subprocess each).")
flags.DEFINE_integer("tp_iters", None, "Timed iterations per case (default: the preset's).")
flags.DEFINE_integer("tp_d_model", None, "Model width instead of the preset's (the block keeps "
                     "head dim 128: num_heads = d_model / 128).", lower_bound=128)
flags.DEFINE_integer("tp_d_ff", None, "MLP width instead of the preset's (default with "
                     "--tp_d_model: 4 d_model).", lower_bound=1)
flags.DEFINE_integer("tp_seq_len", None, "Tokens (B=1) instead of the preset's.", lower_bound=1)
flags.DEFINE_float("tp_pg_timeout_s", None, "torch process-group timeout in seconds (a stalled "
                   "rank makes the others raise rather than hang; default: half the budget, "
                   "clamped to [30, 120]).", lower_bound=0.001)

# Shapes: the MLP sees T = batch * seq_len tokens of width d_model.
PRESETS = {
    "cpu": dict(batch=1, seq_len=64, d_model=64, num_heads=4, d_ff=128, block_size=32,
                dtype="float32", iters=3, warmup=1, budget_s=300.0, world=4,
                comm_sizes=[2 ** k for k in range(10, 21, 2)], microbatches=4),
    "gpu2": dict(batch=1, seq_len=8192, d_model=8192, num_heads=64, d_ff=32768, block_size=128,
                 dtype="bfloat16", iters=15, warmup=3, budget_s=150.0, world=None,
                 comm_sizes=[2 ** k for k in range(10, 30, 2)] + [2 ** 29], microbatches=4),
}
_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
_ELEM = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


# ---------------------------------------------------------------------------------------------
# Model arithmetic (shared by both frameworks and by the tests)


def tp_sizes(world: int) -> list[int]:
    """1, 2, 4, ... up to ``world``."""
    return [p for p in (2 ** k for k in range(8)) if p <= world]


def _pattern(spec):
    from sparsetp.core import patterns as P  # noqa: PLC0415
    return P.bigbird(spec["block_size"], 3, 1, 2, seed=0)


def _config(spec):
    from sparsetp.core import HybridConfig  # noqa: PLC0415
    return HybridConfig(spec["d_model"], spec["num_heads"], spec["d_ff"], _pattern(spec),
                        block_size=spec["block_size"], dtype=spec["dtype"])


def model_flops(spec, model: str, mode: str, density: float | None = None) -> float:
    """Matmul FLOPs of one step (all GPUs together); backward = 2x forward for GEMMs and 2.5x
    for attention (5 matmuls against 2)."""
    t, d, ff, n = spec["batch"] * spec["seq_len"], spec["d_model"], spec["d_ff"], spec["seq_len"]
    dense = 4 * t * d * ff
    attn = 0.0
    if model == "block":
        dense += 2 * t * d * 3 * d + 2 * t * d * d
        attn = 4.0 * t * n * d * density
    return dense + attn if mode == "fwd" else 3 * dense + 3.5 * attn


def mlp_param_bytes(spec, p: int, layout: str = "tp") -> int:
    """Per-GPU parameter bytes of the MLP (with biases): TP splits W1, b1, W2 and replicates b2;
    DP replicates all; the pipeline's stage 0 holds fc1, stage 1 fc2 (the larger one given)."""
    d, ff, e = spec["d_model"], spec["d_ff"], _ELEM[spec["dtype"]]
    if layout == "tp":
        return e * (d * ff // p + ff // p + ff * d // p + d)
    if layout == "dp":
        return e * (2 * d * ff + ff + d)
    return e * max(d * ff + ff, ff * d + d)


def mlp_saved_bytes(spec, p: int, layout: str = "tp") -> int:
    """Bytes autograd saves for backward in the MLP per GPU (parameters excluded): the input
    ``[T, d]`` (replicated under TP), fc1's output (GELU's input) and GELU's output
    ``[T, ff / p]``. Under DP each GPU holds T / p tokens of the full width. Under SP (with the
    default overlapped backward, which re-gathers the input) only the input shard
    ``[T / p, d]`` is kept."""
    t, d, ff, e = spec["batch"] * spec["seq_len"], spec["d_model"], spec["d_ff"], \
        _ELEM[spec["dtype"]]
    if layout == "tp":
        return e * (t * d + 2 * t * ff // p)
    if layout == "sp":
        return e * (t // p * d + 2 * t * ff // p)
    return e * (t // p) * (d + 2 * ff)


def comm_bytes(spec, layout: str, mode: str, p: int, param_bytes: int = 0) -> dict:
    """Communication of one step: message bytes per collective and bytes each GPU sends (ring
    all-reduce: ``2 (p - 1) / p`` of the message; pipeline: activations fwd, gradients bwd).

    SP (the MLP, overlapped backward): forward an all-gather and a reduce-scatter of the
    ``[T, d]`` message, each sending ``(p - 1) / p`` of it (together one all-reduce's bytes);
    backward the all-gather of d(y), the re-gather of the input and the reduce-scatter of d(x),
    plus the all-reduce of fc2's ``d``-element bias gradient (counted in collectives and bytes).
    """
    t, d, ff, e = spec["batch"] * spec["seq_len"], spec["d_model"], spec["d_ff"], \
        _ELEM[spec["dtype"]]
    if p == 1:
        return dict(collectives=0, message_bytes=0, sent_per_gpu_bytes=0)
    if layout == "tp":
        n = 1 if mode == "fwd" else 2
        msg = t * d * e
    elif layout == "sp":
        act = 2 if mode == "fwd" else 5
        bias = 0 if mode == "fwd" else d * e
        return dict(collectives=act + (0 if mode == "fwd" else 1), message_bytes=t * d * e,
                    sent_per_gpu_bytes=int(act * t * d * e * (p - 1) / p
                                           + bias * 2 * (p - 1) / p))
    elif layout == "dp":  # gradient all-reduce (backward only)
        n, msg = (0 if mode == "fwd" else 1), param_bytes
    else:  # pipeline: stage 0 sends [T, ff] forward, receives its gradient backward
        msg = t * ff * e
        return dict(collectives=0, message_bytes=msg, sent_per_gpu_bytes=msg)
    return dict(collectives=n, message_bytes=msg,
                sent_per_gpu_bytes=int(n * msg * 2 * (p - 1) / p))


def add_derived(rows: list[dict], spec) -> None:
    """Fill tokens/s, TFLOP/s per GPU and scaling efficiency ``T1 / (p * Tp)`` in place (rows of
    the same framework/model/mode/variant share the TP=1 time)."""
    base = {}
    for r in rows:
        if r.get("median_ms") and r["p"] == 1:
            base[(r["framework"], r["model"], r["mode"], r.get("variant", ""))] = r["median_ms"]
    tokens = spec["batch"] * spec["seq_len"]
    for r in rows:
        if not r.get("median_ms"):
            continue
        s = r["median_ms"] / 1e3
        r["tokens_per_s"] = tokens / s
        r["tokens_per_s_per_gpu"] = tokens / s / r["p"]
        r["tflops_per_gpu"] = r["flops"] / r["p"] / s / 1e12
        t1 = base.get((r["framework"], r["model"], r["mode"], r.get("variant", "")))
        if t1 is not None and r.get("parallelism", "tp") == "tp":
            r["efficiency"] = t1 / (r["p"] * r["median_ms"])


# ---------------------------------------------------------------------------------------------
# Progress and the record


class _Run:
    def __init__(self, out_dir, spec, budget_s):
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.path = os.path.join(out_dir, "tp.json")
        # common.versions() runs after every child has ended: it queries torch's CUDA state in
        # this process, which the children need not inherit.
        self.result = dict(versions=dict(argv=sys.argv, python=sys.version.split()[0]),
                           spec=spec, budget_s=budget_s, stages={}, warnings=[])
        try:
            from tqdm import tqdm  # noqa: PLC0415
            self.bar = tqdm(total=0, desc="tp bench", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None
            self.result["warnings"].append("tqdm missing: plain progress lines")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg):
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def record(self, name, entry):
        self.result["stages"][name] = entry
        common.write_json(self.path, self.result)
        status = "ok" if entry.get("ok") else ("skipped" if entry.get("skipped") else "FAILED")
        self.log(f"{name}: {status}" + (f" ({entry['error'].splitlines()[-1]})"
                                        if entry.get("error") else ""))
        if self.bar is not None:
            self.bar.update(1)


# ---------------------------------------------------------------------------------------------
# torch ranks


def _sync(device):
    import torch  # noqa: PLC0415
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, iters, warmup, barrier_group=None):
    """Median and min of ``iters`` calls after ``warmup`` (each call synchronised)."""
    import torch.distributed as dist  # noqa: PLC0415
    times = []
    for i in range(warmup + iters):
        _sync(device)
        if barrier_group is not None:
            dist.barrier(group=barrier_group)
        t = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t))
    times.sort()
    return dict(median_ms=times[len(times) // 2], min_ms=times[0], iters=iters)


def _input_leaf(x):
    """``x`` as a leaf that requires grad. A layer inside a model always owes its input a
    gradient: without it autograd skips the first layer's input-gradient GEMM and, under TP,
    the backward all-reduce (the collective that overlap_comm hides), and every torch fwd+bwd
    would time 5 of the MLP's 6 GEMMs while JAX's vjp (taken w.r.t. x too) times all 6 (the
    torch rows of sessions 1-4 did exactly that)."""
    return x.detach().requires_grad_(True)


def _interleaved(models: dict, x, dy, device, rounds: int, group, burst: int = 4,
                 mode: str = "fwd_bwd") -> dict:
    """A/B timing: each round times a burst of ``burst`` steps (``mode`` "fwd_bwd", or "fwd"
    under no_grad; one sync at each end) of every model in turn, so clock and neighbour drift
    hit all of them alike. Returns the median per-step ms of each model and the median of the
    per-round ratios to the first."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    x = _input_leaf(x)
    steps = {}
    for name, m in models.items():
        params = list(m.parameters())

        def step(m=m, params=params):
            if mode == "fwd":
                with torch.no_grad():
                    m(x)
                return
            for q in params:
                q.grad = None
            x.grad = None
            m(x).backward(dy)
        steps[name] = step
        step()  # warm-up
    per = {name: [] for name in models}
    for _ in range(rounds):
        for name, step in steps.items():
            _sync(device)
            dist.barrier(group=group)
            t = time.perf_counter()
            for _ in range(burst):
                step()
            _sync(device)
            per[name].append(1e3 * (time.perf_counter() - t) / burst)
    first = next(iter(models))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    out = {f"{name}_{mode}_ms": med(v) for name, v in per.items()}
    for name in models:
        if name != first:
            out[f"{name}_over_{first}"] = med([b / a for a, b in zip(per[first], per[name],
                                                                  strict=True)])
    return dict(out, rounds=rounds, burst=burst)


class _SavedBytes:
    """Bytes autograd saves for backward during a forward (parameters excluded, each storage
    counted once): the activation memory of the step, on any device."""

    def __init__(self, params):
        self.skip = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr()
                     for p in params}
        self.seen, self.bytes = set(), 0

    def __enter__(self):
        import torch  # noqa: PLC0415

        def pack(t):
            local = getattr(t, "_local_tensor", t)  # a DTensor: count its local shard
            s = local.untyped_storage()
            if s.data_ptr() not in self.skip and s.data_ptr() not in self.seen:
                self.seen.add(s.data_ptr())
                self.bytes += s.nbytes()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _measure_torch(model, x, dy, device, iters, warmup, group, forward=None):
    """fwd and fwd+bwd times, parameter bytes, saved-activation bytes, CUDA peak."""
    import torch  # noqa: PLC0415
    forward = forward or model
    params = list(model.parameters())
    out = dict(param_bytes=sum(p.numel() * p.element_size() for p in params))
    x = _input_leaf(x)

    def fwd():
        with torch.no_grad():
            forward(x)

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        forward(x).backward(dy)

    out["fwd"] = _time(fwd, device, iters, warmup, group)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with _SavedBytes(params) as saved:
        y = forward(x)
    out["saved_activation_bytes"] = saved.bytes
    y.backward(dy)
    del y
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["peak_step_bytes_over_params"] = torch.cuda.max_memory_allocated() - before
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    out["fwd_bwd"] = _time(step, device, iters, warmup, group)
    return out


def _rand_(module, gen):
    """Random weights on the module's device (~N(0, 1/fan_in), norms at 1/0): a numpy draw of
    the full canonical weights would cost seconds per GPU-size matrix, and timing does not
    depend on the values."""
    import torch  # noqa: PLC0415
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, p.shape[0] ** -0.5 if "weight" in name else 1.0, generator=gen)
            elif "ln" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.1, generator=gen)


def _torch_rank(rank, world, spec, stages, deadline, partial_path, q):
    """One torch rank: every torch stage in turn; rank 0 gathers and reports each stage."""
    try:
        if spec["device"] == "cuda":
            # Megatron's setting for its async TP all-reduce: one hardware queue, so the NCCL
            # kernel launched before the weight-gradient GEMM is also scheduled first.
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            for k, v in _GPU_ENV.items():
                os.environ.setdefault(k, v)
        import datetime  # noqa: PLC0415

        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        if spec["device"] == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            backend = "nccl"
        else:
            torch.set_num_threads(1)
            device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['port']}",
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]))
        groups = {p: dist.new_group(list(range(p))) for p in tp_sizes(world)}
        # new_group is collective: every rank creates every one-rank group, keeps its own.
        solo = [dist.new_group([r]) for r in range(world)]
        results = {}
        for name in stages:
            # Rank 0 decides whether the stage still fits, so every rank takes the same branch.
            flag = [time.time() < deadline - spec["stage_reserve_s"].get(name, 5.0)]
            dist.broadcast_object_list(flag, src=0)
            t0 = time.perf_counter()
            if not flag[0]:
                entry = dict(ok=False, skipped=True, error=None, reason="budget")
            else:
                try:
                    data = _TORCH_STAGES[name](rank, world, spec, device,
                                               dict(groups, solo=solo[rank]))
                    entry = dict(ok=True, data=data)
                except Exception:  # noqa: BLE001  (recorded, next stage still runs)
                    entry = dict(ok=False, error=traceback.format_exc()[-4000:])
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            gathered = [None] * world
            dist.all_gather_object(gathered, entry)
            if rank == 0:
                merged = dict(gathered[0])
                merged["ranks"] = [{k: v for k, v in g.items() if k != "ranks"} for g in gathered]
                merged["ok"] = all(g.get("ok") for g in gathered)
                bad = [g["error"] for g in gathered if g.get("error")]
                if bad and not merged.get("error"):
                    merged["error"] = bad[0]
                results[name] = merged
                common.write_json(partial_path, results)
                q.put(("stage", name, merged))
        dist.barrier()
        dist.destroy_process_group()
        q.put(("done", rank, None))
    except BaseException:  # noqa: BLE001  (the parent records it)
        q.put(("error", rank, traceback.format_exc()[-4000:]))


def _bench_inputs(spec, device):
    """``(gen, x, dy)``: the seeded generator and the full ``[B, N, d]`` input and cotangent."""
    import torch  # noqa: PLC0415

    from sparsetp.backends.torch.block import TORCH_DTYPES  # noqa: PLC0415
    dtype = TORCH_DTYPES[spec["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (spec["batch"], spec["seq_len"], spec["d_model"])
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    dy = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    return gen, x, dy


def _tp_model(model, spec, group, device, gen, sequence_parallel, overlap, chunks):
    """The torch MLP or HybridBlock of ``spec`` on ``group``, random weights from ``gen``."""
    from sparsetp.backends.torch.block import TORCH_DTYPES, HybridBlock  # noqa: PLC0415
    from sparsetp.backends.torch.layers import ParallelMLP  # noqa: PLC0415

    kw = dict(overlap_comm=overlap, comm_chunks=chunks, sequence_parallel=sequence_parallel)
    if model == "mlp":
        m = ParallelMLP(spec["d_model"], spec["d_ff"], group=group,
                        dtype=TORCH_DTYPES[spec["dtype"]], device=device, seed=None, **kw)
    else:
        m = HybridBlock(_config(spec), group, seed=None, device=device, **kw)
    _rand_(m, gen)
    return m


def _seq_shards(group, *tensors):
    """This rank's T / p contiguous tokens of each tensor. Cloned: at batch 1 the shard is a
    view of the full tensor, and the saved-bytes probe counts whole storages; a real SP model
    owns it."""
    from sparsetp.backends.torch.comm import split_seq  # noqa: PLC0415
    return [split_seq(a, group=group, name="the bench input").clone() for a in tensors]


def _tp_cases(rank, world, spec, device, groups, model, overlap_options,
              sequence_parallel=False):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    gen, x, dy = _bench_inputs(spec, device)
    rows = []
    for p, group in groups.items():
        if p == "solo":
            continue
        sp = dict(model=model, **(dict(sequence_parallel=True) if sequence_parallel else {}))
        for overlap, chunks in overlap_options:  # (overlap_comm, comm_chunks)
            sp["comm_chunks"] = chunks
            if rank < p:
                # A case that fails (say out of memory) is recorded and the rank still reaches
                # the barrier below, so the other ranks and the later cases go on.
                try:
                    m = _tp_model(model, spec, group, device, gen, sequence_parallel, overlap,
                                  chunks)
                    xs, dys = _seq_shards(group, x, dy) if sequence_parallel else (x, dy)
                    meas = _measure_torch(m, xs, dys, device, spec["iters"], spec["warmup"],
                                          group)
                    rows.append(dict(p=p, overlap_comm=overlap, **sp, **meas))
                except Exception:  # noqa: BLE001
                    rows.append(dict(p=p, overlap_comm=overlap, **sp,
                                     error=traceback.format_exc()[-3000:]))
                m = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            dist.barrier()  # ranks >= p wait: one TP size at a time on the machine
    bad = [r["error"] for r in rows if "error" in r]
    if bad:
        raise RuntimeError(f"{len(bad)} of the cases failed; first:\n{bad[0]}")
    return rows


def _stage_torch_mlp(rank, world, spec, device, groups):
    return _tp_cases(rank, world, spec, device, groups, "mlp", ((True, None),))


# The forward-overlap arms (overlap_comm, comm_chunks) timed beside the default (auto) rows:
# no overlap at all, the backward overlap alone (one forward collective), fixed piece counts.
OVERLAP_ARMS = ((False, 1), (True, 1), (True, 2), (True, 8))


def _stage_torch_overlap(rank, world, spec, device, groups):
    big = {p: g for p, g in groups.items() if p != "solo" and p > 1}
    return [case for model in ("mlp", "block")
            for case in _tp_cases(rank, world, spec, device, big, model, OVERLAP_ARMS)]


def _stage_torch_block(rank, world, spec, device, groups):
    return _tp_cases(rank, world, spec, device, groups, "block", ((True, None),))


def _stage_torch_sp(rank, world, spec, device, groups):
    """The MLP and the block with sequence parallelism at every TP size > 1 (on one rank SP is
    the plain layer; its TP=1 time is the torch_mlp / torch_block one)."""
    big = {p: g for p, g in groups.items() if p != "solo" and p > 1}
    return [case for model in ("mlp", "block")
            for case in _tp_cases(rank, world, spec, device, big, model, ((True, None), (True, 1)),
                                  sequence_parallel=True)]


def _stage_comm(rank, world, spec, device, groups):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    rows = []
    for nbytes in spec["comm_sizes"]:
        elem = 2 if device.type == "cuda" else 4
        buf = torch.ones(max(1, nbytes // elem), device=device,
                         dtype=torch.bfloat16 if elem == 2 else torch.float32)
        reps = 20 if nbytes <= 2 ** 22 else 5
        for _ in range(2):
            dist.all_reduce(buf)
        _sync(device)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(buf)
        _sync(device)
        s = (time.perf_counter() - t) / reps
        size = buf.numel() * buf.element_size()
        rows.append(dict(bytes=size, p=world, latency_us=1e6 * s, algbw_gbps=size / s / 1e9,
                         busbw_gbps=size / s / 1e9 * 2 * (world - 1) / world))
        del buf
    return rows


def _stage_dtensor(rank, world, spec, device, groups):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from sparsetp.backends.torch.block import TORCH_DTYPES  # noqa: PLC0415
    from sparsetp.backends.torch.layers import ParallelMLP  # noqa: PLC0415

    dtype = TORCH_DTYPES[spec["dtype"]]
    d, ff = spec["d_model"], spec["d_ff"]
    rows = []
    # Every TP size > 1, like the torch_mlp stage (ranks >= p wait at the barrier).
    for p in sorted(k for k in groups if k != "solo" and k > 1):
        if rank < p:
            mesh = DeviceMesh.from_group(groups[p], device.type)
            gen = torch.Generator(device=device).manual_seed(0)
            m = nn.Sequential(nn.Linear(d, ff, device=device, dtype=dtype),
                              nn.GELU(approximate="tanh"),
                              nn.Linear(ff, d, device=device, dtype=dtype))
            m = parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            shape = (spec["batch"], spec["seq_len"], d)
            x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
            dy = torch.randn(shape, generator=gen, device=device, dtype=dtype)
            meas = _measure_torch(m, x, dy, device, spec["iters"], spec["warmup"], groups[p])
            meas["param_bytes"] = sum(q.to_local().numel() * q.to_local().element_size()
                                      for q in m.parameters())
            ours = ParallelMLP(d, ff, group=groups[p], dtype=dtype, device=device, seed=None)
            _rand_(ours, gen)
            meas["interleaved"] = _interleaved({"sparsetp": ours, "dtensor": m}, x, dy, device,
                                               spec["iters"], groups[p])
            rows.append(dict(p=p, **meas))
            m = x = dy = ours = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
    return rows


def _stage_ddp(rank, world, spec, device, groups):
    import torch  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    from sparsetp.backends.torch.block import TORCH_DTYPES  # noqa: PLC0415
    from sparsetp.backends.torch.layers import ParallelMLP  # noqa: PLC0415

    dtype = TORCH_DTYPES[spec["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    t = spec["batch"] * spec["seq_len"]
    # Each replica is the whole MLP: a size-1 group means no TP collective in the layers.
    m = ParallelMLP(spec["d_model"], spec["d_ff"], group=groups["solo"], dtype=dtype,
                    device=device, seed=None)
    _rand_(m, gen)
    ddp = DDP(m, device_ids=[rank] if device.type == "cuda" else None)
    # The same global batch of T tokens, split over the ranks (the MLP is per-token).
    x = torch.randn(t // world, spec["d_model"], generator=gen, device=device, dtype=dtype)
    dy = torch.randn(t // world, spec["d_model"], generator=gen, device=device, dtype=dtype)
    meas = _measure_torch(m, x, dy, device, spec["iters"], spec["warmup"], None, forward=ddp)
    return [dict(p=world, **meas)]


def _stage_pipeline(rank, world, spec, device, groups):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # noqa: PLC0415

    from sparsetp.backends.torch.block import TORCH_DTYPES  # noqa: PLC0415

    if world < 2:
        raise ValueError("a two-stage pipeline needs 2 processes")
    dtype = TORCH_DTYPES[spec["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    d, ff, t = spec["d_model"], spec["d_ff"], spec["batch"] * spec["seq_len"]
    rows = []
    if rank < 2:
        # Stage 0: fc1 + GELU; stage 1: fc2 (the MLP has no other cut; its activation [T, ff]
        # is what crosses).
        sub = (nn.Sequential(nn.Linear(d, ff, device=device, dtype=dtype),
                             nn.GELU(approximate="tanh")) if rank == 0 else
               nn.Sequential(nn.Linear(ff, d, device=device, dtype=dtype)))
        _rand_(sub, gen)
        mb = spec["microbatches"]
        stage = PipelineStage(sub, rank, 2, device, group=groups[2])
        sched = ScheduleGPipe(stage, mb, loss_fn=lambda out, target: (out * target).sum())
        # Stage 0's input a leaf that requires grad, like every other torch step here: the
        # schedule then computes fc1's input-gradient GEMM as well (checked with gloo: x.grad
        # is filled), so the pipeline row times the MLP's 6 GEMMs too.
        x = _input_leaf(torch.randn(t, d, generator=gen, device=device, dtype=dtype))
        dy = torch.randn(t, d, generator=gen, device=device, dtype=dtype)

        def step():
            for p in sub.parameters():
                p.grad = None
            if rank == 0:
                x.grad = None
                sched.step(x)
            else:
                sched.step(target=dy, losses=[])

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        timing = _time(step, device, spec["iters"], spec["warmup"], groups[2])
        row = dict(p=2, stage=rank, fwd_bwd=timing, microbatches=mb,
                   param_bytes=sum(p.numel() * p.element_size() for p in sub.parameters()))
        if rank == 0:
            row["input_grad"] = x.grad is not None  # the step computed fc1's input gradient
        if device.type == "cuda":
            row["peak_step_bytes_over_params"] = torch.cuda.max_memory_allocated() - before
        rows.append(row)
    dist.barrier()
    return rows


def _stage_torch_overlap_ab(rank, world, spec, device, groups):
    """The default schedule (``comm_chunks`` auto) against the plain one (``comm_chunks=1``) and
    no overlap at all, interleaved (:func:`_interleaved`) at TP = world: the MLP and the block,
    with and without sequence parallelism, forward and fwd+bwd. Sequential cases of separate
    stages drifted by up to 5% on 2 H200s, more than the differences in question."""
    import torch  # noqa: PLC0415

    group = groups[world]
    gen, x, dy = _bench_inputs(spec, device)
    rows = []
    for model in ("mlp", "block"):
        for sp in (False, True):
            arms = {"auto": (True, None), "plain": (True, 1)}
            if not sp:
                arms["no_overlap"] = (False, 1)
            models = {name: _tp_model(model, spec, group, device, gen, sp, overlap, chunks)
                      for name, (overlap, chunks) in arms.items()}
            xs, dys = _seq_shards(group, x, dy) if sp else (x, dy)
            row = dict(p=world, model=model, sequence_parallel=sp)
            for mode in ("fwd", "fwd_bwd"):
                row[mode] = _interleaved(models, xs, dys, device, spec["iters"], group,
                                         mode=mode)
            rows.append(row)
            models = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


_TORCH_STAGES = {"comm": _stage_comm, "torch_mlp": _stage_torch_mlp,
                 "torch_overlap": _stage_torch_overlap, "torch_overlap_ab": _stage_torch_overlap_ab,
                 "dtensor": _stage_dtensor,
                 "ddp": _stage_ddp, "pipeline": _stage_pipeline,
                 "torch_block": _stage_torch_block, "torch_sp": _stage_torch_sp}


def _spawn_torch(world, spec, stages, deadline, run: _Run, timeout):
    """Spawn the torch ranks; stages are recorded as rank 0 reports them."""
    partial = os.path.join(tempfile.mkdtemp(prefix="sparsetp_tp_"), "torch_partial.json")
    common.spawn_ranks(_torch_rank, world, (world, spec, stages, deadline, partial), run.record,
                       timeout, "tp-rank", "stage")


# ---------------------------------------------------------------------------------------------
# JAX (a subprocess: JAX drives every device from one process, and XLA_FLAGS are read once)


def _jax_worker(spec_path: str) -> None:
    """Subprocess entry: read the spec, run the JAX stages, write each result as it ends."""
    with open(spec_path) as f:
        job = json.load(f)
    spec, out_path = job["spec"], job["out"]
    import jax  # noqa: PLC0415

    if spec["device"] == "cpu":
        jax.config.update("jax_num_cpu_devices", job["world"])
    result = dict(xla_flags=os.environ.get("XLA_FLAGS", ""), stages={})

    def save():
        with open(out_path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out_path + ".tmp", out_path)

    result["devices"] = [str(d) for d in jax.devices()]
    save()
    for name in job["stages"]:
        t0 = time.perf_counter()
        if time.time() > job["deadline"] - 3:
            result["stages"][name] = dict(ok=False, skipped=True, reason="budget")
        else:
            try:
                data = _JAX_STAGES[name](spec, job["world"])
                result["stages"][name] = dict(ok=True, data=data)
            except Exception:  # noqa: BLE001
                result["stages"][name] = dict(ok=False, error=traceback.format_exc()[-4000:])
        result["stages"][name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"jax {name}: {'ok' if result['stages'][name].get('ok') else 'not ok'}",
              file=sys.stderr, flush=True)
        save()


def _jax_time(fn, args, iters, warmup):
    import jax  # noqa: PLC0415
    times = []
    for i in range(warmup + iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t))
    times.sort()
    return dict(median_ms=times[len(times) // 2], min_ms=times[0], iters=iters)


def _hlo_overlap(compiled) -> dict:
    """What the compiled (scheduled) HLO does with each collective: async start/done pairs and
    the instructions XLA placed between them (GEMMs there run while the collective is in
    flight). Keys ``sync_<op>s`` (a count) and ``async_<op>s`` (one entry per pair) for the
    all-reduces, and for the collective-permutes, all-gathers and reduce-scatters that the
    JAX overlap rings and sequence parallelism use.
    """
    text = compiled.as_text()
    lines = [ln.strip() for ln in text.splitlines() if " = " in ln]
    out = {}
    for op in ("all-reduce", "collective-permute", "all-gather", "reduce-scatter"):
        key = op.replace("-", "_")
        sync = sum(1 for ln in lines if f" {op}(" in ln)
        pairs, open_ = [], {}
        for i, ln in enumerate(lines):
            lhs = ln.split(" = ")[0].replace("ROOT ", "").strip()
            if f" {op}-start(" in ln:
                open_[lhs] = i
            elif f" {op}-done(" in ln:
                src = ln.split(f"{op}-done(")[1].split(")")[0].split()[-1].lstrip("%")
                start = open_.pop(src, open_.pop("%" + src, None))
                if start is not None:
                    between = lines[start + 1:i]
                    pairs.append(dict(ops_between=len(between),
                                      gemms_between=sum(1 for b in between
                                                        if "gemm" in b or " dot(" in b)))
        out[f"sync_{key}s"], out[f"async_{key}s"] = sync, pairs
    return out


def _jax_mlp_fns(spec, mesh, axis, dp: bool, **layer_kw):
    """jitted fwd and fwd+bwd of the MLP and their arguments; ``layer_kw`` goes to
    ``parallel_mlp`` (``sequence_parallel=True`` also splits x and dy along the tokens)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from sparsetp.backends.jax.layers import parallel_mlp  # noqa: PLC0415

    d, ff, t = spec["d_model"], spec["d_ff"], spec["batch"] * spec["seq_len"]
    dtype = jnp.dtype(spec["dtype"])
    key = jax.random.PRNGKey(0)
    k = jax.random.split(key, 6)
    if dp:
        specs = (P(), P(), P(), P())
        xspec = P(axis, None)
        x_shape = (t, d)
    else:
        specs = (P(None, axis), P(axis), P(axis, None), P())
        xspec = P(None, axis, None) if layer_kw.get("sequence_parallel") else P()
        x_shape = (spec["batch"], spec["seq_len"], d)

    def put(a, s):
        return jax.device_put(a, NamedSharding(mesh, s))

    params = [put((jax.random.normal(k[0], (d, ff)) * d ** -0.5).astype(dtype), specs[0]),
              put((0.1 * jax.random.normal(k[1], (ff,))).astype(dtype), specs[1]),
              put((jax.random.normal(k[2], (ff, d)) * ff ** -0.5).astype(dtype), specs[2]),
              put((0.1 * jax.random.normal(k[3], (d,))).astype(dtype), specs[3])]
    x = put(jax.random.normal(k[4], x_shape).astype(dtype), xspec)
    dy = put(jax.random.normal(k[5], x_shape).astype(dtype), xspec)
    if dp:  # plain MLP; GSPMD all-reduces the weight gradients of the sharded batch
        def f(w1, b1, w2, b2, x):
            return parallel_mlp(x, w1, b1, w2, b2, axis_name=None)
    else:
        f = jax.shard_map(lambda w1, b1, w2, b2, x: parallel_mlp(x, w1, b1, w2, b2,
                                                                 axis_name=axis, **layer_kw),
                          mesh=mesh, in_specs=(*specs, xspec), out_specs=xspec, check_vma=True)

    def fwd_bwd(params, x, dy):
        # The output is returned too: a training step needs it (for the loss), and without it
        # XLA would drop the forward all-reduce as dead code, unlike torch's step.
        y, vjp = jax.vjp(f, *params, x)
        return y, vjp(dy)

    return jax.jit(lambda params, x: f(*params, x)), jax.jit(fwd_bwd), (params, x, dy)


def _jax_measure(fwd, fwd_bwd, params, x, dy, spec):
    import jax  # noqa: PLC0415
    out = dict(param_bytes=sum(a.addressable_shards[0].data.nbytes for a in
                               jax.tree_util.tree_leaves(params)))
    for mode, fn, args in (("fwd", fwd, (params, x)), ("fwd_bwd", fwd_bwd, (params, x, dy))):
        t = time.perf_counter()
        compiled = fn.lower(*args).compile()
        entry = dict(compile_s=round(time.perf_counter() - t, 2))
        try:
            ma = compiled.memory_analysis()
            entry["temp_bytes"] = int(ma.temp_size_in_bytes)
            entry["argument_bytes"] = int(ma.argument_size_in_bytes)
            entry["output_bytes"] = int(ma.output_size_in_bytes)
        except Exception as e:  # noqa: BLE001  (not every backend reports it)
            entry["memory_analysis_error"] = repr(e)
        entry["hlo"] = _hlo_overlap(compiled)
        entry.update(_jax_time(compiled, args, spec["iters"], spec["warmup"]))
        out[mode] = entry
    stats = jax.devices()[0].memory_stats()
    if stats:
        out["peak_bytes_in_use_dev0"] = int(stats.get("peak_bytes_in_use", 0))
    return out


def _jax_stage_mlp(spec, world):
    from sparsetp.backends.jax.block import make_mesh  # noqa: PLC0415
    rows = []
    for p in tp_sizes(world):
        fwd, fwd_bwd, (params, x, dy) = _jax_mlp_fns(spec, make_mesh(p), "tp", dp=False)
        rows.append(dict(p=p, **_jax_measure(fwd, fwd_bwd, params, x, dy, spec)))
    return rows


def _jax_stage_mlp_world(spec, world):
    """Only TP = world (the flag variants): the case the overlap question is about."""
    from sparsetp.backends.jax.block import make_mesh  # noqa: PLC0415
    fwd, fwd_bwd, (params, x, dy) = _jax_mlp_fns(spec, make_mesh(world), "tp", dp=False)
    return [dict(p=world, **_jax_measure(fwd, fwd_bwd, params, x, dy, spec))]


def _jax_stage_dp(spec, world):
    from sparsetp.backends.jax.block import make_mesh  # noqa: PLC0415
    fwd, fwd_bwd, (params, x, dy) = _jax_mlp_fns(spec, make_mesh(world, "dp"), "dp", dp=True)
    return [dict(p=world, **_jax_measure(fwd, fwd_bwd, params, x, dy, spec))]


def _jax_block_params(cfg, rng) -> dict:
    """Random canonical block parameters (weights ~ N(0, 1/fan_in), norms at 1 / 0) held in
    ``cfg.dtype``, as the torch block holds its parameters. Held in float32, every JAX block
    step would cast them to the compute dtype, its gradients would come back in float32, and
    the rows would report twice torch's parameter bytes."""
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from sparsetp.core.config import param_shapes  # noqa: PLC0415

    full = {}
    for n, s in param_shapes(cfg).items():
        if len(s) == 2:
            v = rng.standard_normal(s, dtype=np.float32) * s[0] ** -0.5
        else:
            v = (np.ones(s, np.float32) if n.startswith("ln") and n.endswith("weight")
                 else np.zeros(s, np.float32))
        full[n] = jnp.asarray(v, cfg.dtype)
    return full


def _jax_block_input(a, cfg, mesh, sequence_parallel=False):
    """``a`` (host) laid out on ``mesh`` as a block's output leaves it for the next block:
    replicated, or split along the tokens under sequence parallelism. An array on one device
    would be copied to the others inside every timed call (a cost a model pays once, at its
    first layer, not per block)."""
    import jax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    spec = P(None, "tp" if sequence_parallel else None, None)
    return jax.device_put(jax.numpy.asarray(a, cfg.dtype), NamedSharding(mesh, spec))


def _jax_stage_block(spec, world):
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from sparsetp.backends.jax.block import hybrid_block, make_mesh, shard_params  # noqa: PLC0415

    cfg = _config(spec)
    rng = np.random.default_rng(0)
    full = _jax_block_params(cfg, rng)
    shape = (spec["batch"], spec["seq_len"], spec["d_model"])
    rows = []
    for p in tp_sizes(world):
        mesh = make_mesh(p)
        params = shard_params(full, cfg, mesh)
        x, dy = (_jax_block_input(rng.standard_normal(shape, dtype=np.float32), cfg, mesh)
                 for _ in range(2))

        def fwd(params, x, mesh=mesh):
            return hybrid_block(params, x, cfg, mesh=mesh)

        def fwd_bwd(params, x, dy, fwd=fwd):
            y, vjp = jax.vjp(fwd, params, x)
            return y, vjp(dy)

        rows.append(dict(p=p, **_jax_measure(jax.jit(fwd), jax.jit(fwd_bwd), params, x, dy,
                                             spec)))
    return rows


# The JAX A/B at TP = world (stages jax_overlap, jax_block_overlap): variant -> layer options.
# "sp_*" are JAX's sequence parallelism (autodiff keeps the gathered input: no re-gather, unlike
# torch's "sp" rows); efficiency is against JAX's plain TP=1 time.
JAX_OVERLAP_VARIANTS = {"plain": {}, "overlap": dict(overlap_comm=True),
                        "sp_plain": dict(sequence_parallel=True),
                        "sp_overlap": dict(sequence_parallel=True, overlap_comm=True)}


def _jax_variant_case(variant, world):
    kw = JAX_OVERLAP_VARIANTS[variant]
    return dict(p=world, variant=variant, sequence_parallel=kw.get("sequence_parallel", False),
                overlap_comm=kw.get("overlap_comm", False))


def _jax_stage_overlap(spec, world):
    """The MLP at TP = world, overlap_comm off and on, without and with sequence parallelism."""
    from sparsetp.backends.jax.block import make_mesh  # noqa: PLC0415
    rows = []
    for variant, kw in JAX_OVERLAP_VARIANTS.items():
        fwd, fwd_bwd, (params, x, dy) = _jax_mlp_fns(spec, make_mesh(world), "tp", dp=False,
                                                     **kw)
        rows.append(dict(**_jax_variant_case(variant, world),
                         **_jax_measure(fwd, fwd_bwd, params, x, dy, spec)))
    return rows


def _jax_stage_block_overlap(spec, world):
    """The block at TP = world, overlap_comm off and on, without and with sequence
    parallelism (x and dy laid out as the previous block leaves them:
    :func:`_jax_block_input`)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from sparsetp.backends.jax.block import hybrid_block, make_mesh, shard_params  # noqa: PLC0415

    cfg = _config(spec)
    rng = np.random.default_rng(0)
    mesh = make_mesh(world)
    params = shard_params(_jax_block_params(cfg, rng), cfg, mesh)
    shape = (spec["batch"], spec["seq_len"], spec["d_model"])
    x_host, dy_host = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    rows = []
    for variant, kw in JAX_OVERLAP_VARIANTS.items():
        sp = kw.get("sequence_parallel", False)
        x, dy = (_jax_block_input(a, cfg, mesh, sp) for a in (x_host, dy_host))

        def fwd(params, x, kw=kw):
            return hybrid_block(params, x, cfg, mesh=mesh, **kw)

        def fwd_bwd(params, x, dy, fwd=fwd):
            y, vjp = jax.vjp(fwd, params, x)
            return y, vjp(dy)

        rows.append(dict(**_jax_variant_case(variant, world),
                         **_jax_measure(jax.jit(fwd), jax.jit(fwd_bwd), params, x, dy, spec)))
    return rows


_JAX_STAGES = {"jax_mlp": _jax_stage_mlp, "jax_dp": _jax_stage_dp, "jax_block": _jax_stage_block,
               "jax_mlp_world": _jax_stage_mlp_world, "jax_overlap": _jax_stage_overlap,
               "jax_block_overlap": _jax_stage_block_overlap}


def _run_jax(run: _Run, spec, world, stages, label, extra_xla_flags=""):
    """One JAX subprocess; its stages are recorded as ``<label>:<stage>``."""
    tmp = tempfile.mkdtemp(prefix="sparsetp_tp_jax_")
    out = os.path.join(tmp, "jax.json")
    job = dict(spec=spec, world=world, stages=stages, out=out, deadline=time.time() + run.left())
    with open(os.path.join(tmp, "job.json"), "w") as f:
        json.dump(job, f)
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # so memory_stats measure what is used
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # a torch/Megatron setting, not XLA's
    if extra_xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + extra_xla_flags).strip()
    if spec["device"] == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-c",
           f"from sparsetp.bench import tp; tp._jax_worker({os.path.join(tmp, 'job.json')!r})"]
    got, err = common.run_json_subprocess(cmd, env, max(5.0, run.left()), out)
    for name in stages:
        entry = got.get("stages", {}).get(name)
        if entry is None:
            entry = dict(ok=False, error=err or "JAX subprocess recorded nothing for this stage")
        entry["xla_flags"] = got.get("xla_flags", extra_xla_flags)
        entry["devices"] = got.get("devices")
        run.record(f"{label}:{name}" if label else name, entry)


# ---------------------------------------------------------------------------------------------
# Tables, plots, main


def _rows(result, spec) -> list[dict]:
    """Every timed case as flat rows: framework, model, parallelism, variant, p, mode, time."""
    stages = result["stages"]
    rows = []

    def add(stage, framework, model, parallelism, variant="", pick=None):
        e = stages.get(stage)
        if not e or not e.get("ok"):
            return
        for case in e["data"]:
            if pick and not pick(case):
                continue
            for mode in ("fwd", "fwd_bwd"):
                if mode not in case:
                    continue
                r = dict(framework=framework, model=model, parallelism=parallelism, p=case["p"],
                         mode=mode, variant=variant, median_ms=case[mode]["median_ms"],
                         min_ms=case[mode]["min_ms"], param_bytes=case.get("param_bytes"),
                         flops=model_flops(spec, model, mode, spec.get("density")))
                for k in ("saved_activation_bytes", "peak_step_bytes_over_params"):
                    if k in case:
                        r[k] = case[k]
                if "temp_bytes" in case[mode]:
                    r["xla_temp_bytes"] = case[mode]["temp_bytes"]
                layout = {"tp": "tp", "dp": "dp", "pp": "pp"}.get(parallelism)
                if variant.startswith("sp"):
                    layout = "sp"
                if layout and model == "mlp":
                    r["comm"] = comm_bytes(spec, layout, mode, case["p"], r["param_bytes"] or 0)
                rows.append(r)

    add("torch_mlp", "torch", "mlp", "tp")
    for model in ("mlp", "block"):
        for overlap, chunks in OVERLAP_ARMS:
            variant = f"chunks{chunks}" if overlap else "no_overlap"
            add("torch_overlap", "torch", model, "tp", variant,
                lambda c, m=model, o=overlap, k=chunks: (c["model"] == m
                                                         and c["overlap_comm"] == o
                                                         and c.get("comm_chunks") == k))
    add("torch_block", "torch", "block", "tp")
    for model in ("mlp", "block"):
        add("torch_sp", "torch", model, "tp", "sp",
            lambda c, m=model: c["model"] == m and c.get("comm_chunks") is None)
        add("torch_sp", "torch", model, "tp", "sp_chunks1",
            lambda c, m=model: c["model"] == m and c.get("comm_chunks") == 1)
    add("dtensor", "dtensor", "mlp", "tp")
    add("ddp", "torch", "mlp", "dp")
    add("jax:jax_mlp", "jax", "mlp", "tp")
    add("jax:jax_dp", "jax", "mlp", "dp")
    add("jax:jax_block", "jax", "block", "tp")
    for stage, model in (("jax:jax_overlap", "mlp"), ("jax:jax_block_overlap", "block")):
        for variant in JAX_OVERLAP_VARIANTS:
            add(stage, "jax", model, "tp", variant, lambda c, v=variant: c["variant"] == v)
    for r in rows:  # torch's comm model describes neither the rings nor the chunked all-reduces
        if r["framework"] == "jax" and r["variant"] in JAX_OVERLAP_VARIANTS \
                and r["variant"] != "plain":
            r.pop("comm", None)
    add("jax_lhs_on:jax_mlp_world", "jax", "mlp", "tp", "lhs_on")
    add("jax_lhs_off:jax_mlp_world", "jax", "mlp", "tp", "lhs_off")
    pp = stages.get("pipeline")
    if pp and pp.get("ok"):
        per_rank = [c for r in pp["ranks"] for c in (r.get("data") or [])]
        if per_rank:
            slow = max(per_rank, key=lambda c: c["fwd_bwd"]["median_ms"])
            rows.append(dict(framework="torch", model="mlp", parallelism="pp", p=2,
                             mode="fwd_bwd", variant=f"gpipe_{slow['microbatches']}mb",
                             median_ms=slow["fwd_bwd"]["median_ms"],
                             min_ms=slow["fwd_bwd"]["min_ms"],
                             param_bytes=max(c["param_bytes"] for c in per_rank),
                             flops=model_flops(spec, "mlp", "fwd_bwd"),
                             comm=comm_bytes(spec, "pp", "fwd_bwd", 2)))
    # dtensor and torch SP are compared with TP at the same p; their efficiency uses torch's
    # plain TP=1 time (SP on one rank is the plain layer, so it has no TP=1 row of its own).
    add_derived(rows, spec)
    t1 = {(r["model"], r["mode"]): r["median_ms"] for r in rows
          if r["framework"] == "torch" and r["parallelism"] == "tp" and r["p"] == 1
          and not r["variant"]}
    for r in rows:
        if ((r["framework"] == "dtensor" or (r["framework"] == "torch" and r["variant"]))
                and (r["model"], r["mode"]) in t1):
            r["efficiency"] = t1[(r["model"], r["mode"])] / (r["p"] * r["median_ms"])
    # The JAX A/B rows (TP = world only) against JAX's plain TP=1 time.
    t1_jax = {(r["model"], r["mode"]): r["median_ms"] for r in rows
              if r["framework"] == "jax" and r["parallelism"] == "tp" and r["p"] == 1
              and not r["variant"]}
    for r in rows:
        if (r["framework"] == "jax" and r["variant"] in JAX_OVERLAP_VARIANTS
                and (r["model"], r["mode"]) in t1_jax):
            r["efficiency"] = t1_jax[(r["model"], r["mode"])] / (r["p"] * r["median_ms"])
    return rows


def _summary(rows) -> list[str]:
    head = (f"{'framework':8} {'model':5} {'par':3} {'variant':11} {'p':>2} {'mode':7} "
            f"{'ms':>9} {'TFLOP/s/GPU':>11} {'eff':>6} {'params/GPU MiB':>14}")
    lines = [head]
    for r in rows:
        eff = f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
        pb = f"{r['param_bytes'] / 2 ** 20:.2f}" if r.get("param_bytes") else "-"
        lines.append(f"{r['framework']:8} {r['model']:5} {r['parallelism']:3} "
                     f"{r['variant'] or '-':11} {r['p']:>2} {r['mode']:7} "
                     f"{r['median_ms']:9.3f} {r['tflops_per_gpu']:11.3f} {eff:>6} {pb:>14}")
    return lines


def _plots(result, rows, out_dir) -> list[str]:
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as e:
        result["warnings"].append(f"matplotlib missing, no plots: {e}")
        return []
    made = []
    tp_rows = [r for r in rows if r["parallelism"] == "tp" and "efficiency" in r]
    if tp_rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        keys = sorted({(r["framework"], r["model"], r["mode"], r["variant"]) for r in tp_rows})
        for k in keys:
            pts = sorted((r["p"], r["efficiency"]) for r in tp_rows
                         if (r["framework"], r["model"], r["mode"], r["variant"]) == k)
            ax.plot(*zip(*pts, strict=True), marker="o", label=" ".join(x for x in k if x))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("TP size p")
        ax.set_ylabel("efficiency T1 / (p Tp)")
        ax.legend(fontsize=6)
        ax.set_title(f"strong scaling ({result['versions'].get('device', '?')})", fontsize=8)
        fig.tight_layout()
        made.append(os.path.join(out_dir, "tp_scaling.png"))
        fig.savefig(made[-1], dpi=120)
        plt.close(fig)
    comm = result["stages"].get("comm")
    if comm and comm.get("ok"):
        fig, ax = plt.subplots(figsize=(6, 4))
        c = comm["data"]
        ax.plot([r["bytes"] for r in c], [r["busbw_gbps"] for r in c], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message bytes")
        ax.set_ylabel("all-reduce bus bandwidth GB/s")
        fig.tight_layout()
        made.append(os.path.join(out_dir, "tp_allreduce.png"))
        fig.savefig(made[-1], dpi=120)
        plt.close(fig)
    return made


def resolve_device(preset: str, device: str, gpus: int, world: int | None) -> tuple[str, int]:
    """``(device, world)`` of a run: the device rule of the ``--preset``/``--device`` flags on a
    machine where torch sees ``gpus`` GPUs, and the number of ranks (``--tp_world`` or the
    preset's).

    ``--device=auto``: the ``cpu`` preset runs on CPU (gloo ranks, CPU JAX devices), on a GPU
    machine too; ``gpu2`` on the GPUs. ``--device`` given: that device. A CUDA run has one rank
    per GPU (``world`` defaults to every GPU) and needs ``world`` GPUs; every run needs at least
    2 ranks (the bench compares TP, DP and pipeline sizes). Violations raise ValueError naming
    what is needed, before any process starts.

    >>> resolve_device("cpu", "auto", gpus=1, world=2)
    ('cpu', 2)
    """
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)} for tp, got {preset!r}")
    if device == "auto":
        device = "cpu" if preset == "cpu" else "cuda"
    world = world or PRESETS[preset]["world"] or (gpus if device == "cuda" else 4)
    if device == "cuda" and gpus < max(2, world or 0):
        raise ValueError(f"--preset={preset} on the GPUs needs {max(2, world or 0)} GPUs "
                         f"(one rank each); torch sees {gpus}. --preset=cpu runs on CPU ranks.")
    if not world or world < 2:
        raise ValueError(f"the tp bench needs at least 2 ranks (--tp_world), got {world}")
    return device, world


def resolve_spec(preset: str, world: int | None, device: str) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)} for tp, got {preset!r}")
    spec = dict(PRESETS[preset], preset=preset, device=device)
    spec["world"] = world or spec["world"]
    return spec


def main(argv=None) -> int:
    common.define_flags()
    _define_shared_flags()
    FLAGS(argv if argv is not None else sys.argv)
    import torch  # noqa: PLC0415

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, world = resolve_device(FLAGS.preset, FLAGS.device, gpus, FLAGS.tp_world)
    if device == "cuda":
        for k, v in _GPU_ENV.items():  # keep NVLink multicast off here and in every child
            os.environ.setdefault(k, v)
    spec = resolve_spec(FLAGS.preset, world, device)
    if FLAGS.tp_iters:
        spec["iters"] = FLAGS.tp_iters
    if FLAGS.tp_d_model:
        spec.update(d_model=FLAGS.tp_d_model, num_heads=max(1, FLAGS.tp_d_model // 128),
                    d_ff=4 * FLAGS.tp_d_model)
    if FLAGS.tp_d_ff:
        spec["d_ff"] = FLAGS.tp_d_ff
    if FLAGS.tp_seq_len:
        spec["seq_len"] = FLAGS.tp_seq_len
    budget = FLAGS.budget_s or spec["budget_s"]
    del spec["budget_s"]
    from sparsetp.core import make_layout  # noqa: PLC0415
    spec["density"] = make_layout(_pattern(spec), spec["seq_len"], spec["num_heads"],
                                  spec["block_size"]).density
    out_dir = FLAGS.out_dir
    os.makedirs(out_dir, exist_ok=True)
    run = _Run(out_dir, spec, budget)
    stages = list(FLAGS.tp_stages)
    unknown = set(stages) - set(_TORCH_STAGES) - {"jax"}
    if unknown:
        raise ValueError(f"unknown --tp_stages {sorted(unknown)}")
    if run.bar is not None:
        n_jax = 3 + (2 if world > 1 else 0) + (2 if FLAGS.tp_jax_variants and world > 1 else 0)
        run.bar.total = len(stages) + (n_jax - 1 if "jax" in stages else 0)
    run.log(f"tp bench: preset={spec['preset']} device={device} world={world} "
            f"budget={budget:.0f}s stages={stages}")

    torch_stages = [s for s in stages if s in _TORCH_STAGES]
    if torch_stages:
        # The JAX stages get the last ~40% of the budget (process start and compiles).
        jax_share = 0.4 * budget if "jax" in stages else 0.0
        spec_t = dict(spec, port=_free_port(), pg_timeout_s=FLAGS.tp_pg_timeout_s
                      or max(30.0, min(120.0, budget / 2)),
                      stage_reserve_s={name: 10.0 if device == "cuda" else 3.0
                                       for name in ("torch_block", "torch_sp")})
        try:
            _spawn_torch(world, spec_t, torch_stages, time.time() + run.left() - jax_share, run,
                         timeout=max(10.0, run.left() - jax_share + 15.0))
        except Exception:  # noqa: BLE001  (recorded: the JAX stages still run)
            err = traceback.format_exc()[-4000:]
            for s in torch_stages:
                if s not in run.result["stages"]:
                    run.record(s, dict(ok=False, error=err))
    if "jax" in stages:
        _run_jax(run, spec, world, ["jax_mlp", "jax_dp", "jax_block"]
                 + (["jax_overlap", "jax_block_overlap"] if world > 1 else []), "jax")
        if FLAGS.tp_jax_variants and world > 1:
            for label, val in (("jax_lhs_on", "true"), ("jax_lhs_off", "false")):
                if run.left() > 8:
                    _run_jax(run, spec, world, ["jax_mlp_world"], label,
                             f"--xla_gpu_enable_latency_hiding_scheduler={val}")
                else:
                    run.record(f"{label}:jax_mlp_world",
                               dict(ok=False, skipped=True, error=None, reason="budget"))
    try:
        run.result["versions"] = common.versions(device=device)
    except Exception as e:  # noqa: BLE001
        run.result["warnings"].append(f"versions(): {e!r}")
    rows = _rows(run.result, spec)
    run.result["rows"] = rows
    run.result["plots"] = _plots(run.result, rows, out_dir)
    run.result["wall_s"] = round(time.monotonic() - run.t0, 1)
    failed = sorted(k for k, v in run.result["stages"].items() if not v.get("ok"))
    run.result["failed_or_skipped"] = failed
    common.write_json(run.path, run.result)
    for line in _summary(rows):
        print(line)
    for case in (run.result["stages"].get("dtensor") or {}).get("data") or []:
        if "interleaved" in case:
            print(f"interleaved fwd+bwd, p={case['p']}: {case['interleaved']}")
    for case in (run.result["stages"].get("torch_overlap_ab") or {}).get("data") or []:
        for mode in ("fwd", "fwd_bwd"):
            r = case[mode]
            arms = "  ".join(f"{k[:-len(mode) - 4]} {v:.3f}" for k, v in r.items()
                             if k.endswith(f"_{mode}_ms"))
            ratios = "  ".join(f"{k} {v:.3f}" for k, v in r.items() if "_over_" in k)
            print(f"overlap A/B {case['model']} sp={case['sequence_parallel']} p={case['p']} "
                  f"{mode} ms: {arms}  ({ratios})")
    print(f"wrote {run.path} in {run.result['wall_s']} s; not ok: {failed or 'none'}")
    if failed:  # the dispatcher ignores return values: a failed or skipped stage exits 1
        sys.exit(1)
    return 0


def _free_port() -> int:
    import socket  # noqa: PLC0415
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
