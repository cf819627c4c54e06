"""Question (issue #24, training throughput): on 2 GPUs, how fast does the sparsetp GPT *train*
when the two GPUs split the model (TP=2), split the batch (DP=2), or one GPU does it all (TP=1)?

One invocation measures, for both frameworks and every ``--seq_lens`` N, full training steps
(forward, masked next-token loss, backward, Adam) of the GPT of the training examples, the same
way the examples train it (``examples/train_torch.py``, ``examples/train_jax.py``): fp32 master
weights and optimizer state with bf16 compute (torch: ``torch.autocast("cuda", torch.bfloat16)``
+ ``torch.optim.Adam``; JAX: the blocks' ``dtype="bfloat16"``, which casts the fp32 parameters
for compute, + ``optax.adam``), on the recall task's batches (``sparsetp.core.RecallTask``). The
three layouts see the same global batch of ``batch`` sequences and start from the same weights:

* ``tp1``: one GPU runs the whole batch (torch: rank 0 alone, on a one-rank group; JAX: one
  device, no mesh);
* ``dp2``: each GPU runs ``batch / 2`` sequences on a full replica (torch: DDP over
  ``make_device_mesh(dp=2, tp=1)`` via ``sparsetp.torch.data_parallel``; JAX: a
  ``make_2d_mesh(2, 1)`` mesh, the batch split over ``"data"`` by ``shard_batch`` and
  ``gpt(..., batch_axis="data")``);
* ``tp2``: both GPUs run the whole batch, every block split Megatron-style (torch:
  ``GPT(config, group)`` over a 2-rank group, ``overlap_comm`` at its default; JAX: a
  ``make_2d_mesh(1, 2)`` mesh, ``gpt(..., mesh=mesh, axis_name="model")``).

Per row: median step ms over ``steps`` timed steps (``warmup`` steps before them are left out;
JAX compiles ahead of time, its compile time is recorded apart), tokens/s of the global batch,
MFU per GPU = ``batch * gpt_train_flops(config, N, density)`` (``sparsetp.core.model``: 3x the
forward matmul FLOPs, attention over the computed tiles, as ``examples/common.py`` counts) per
step / step time / (GPUs of the layout x ``examples/common.PEAK_FLOPS`` of the device), speed-up
= TP=1's step time / this step time (same framework and N), peak memory per GPU (torch:
``max_memory_allocated`` of each rank's case; JAX: ``peak_bytes_in_use`` of each device, one
process per case on the GPU so the peak is the case's own, plus XLA's own estimate of the
step), and the loss of every step (the first is taken before any update: the layouts must agree
on it, and do to fp32 rounding on the CPU preset).

Model (``--preset=gpu2``): d_model 2048, 16 heads of 128, d_ff 8192, 8 layers (403M block
parameters, 1.6 GB in fp32; 471M with the 32768-row position table), block 128, the examples'
recall-task vocabulary (64 values + 128 slot markers = 192 tokens), ``batch`` 2. Wide enough
that a TP=2 shard still runs large GEMMs (2048 x 3072 qkv, 2048 x 4096 fc1 per rank over 16k-64k
tokens: TP is meaningful, not launch-bound), small enough that TP=1 at N=32768 fits one GPU:
torch keeps ~44 d bytes of autocast activations per token and layer (fp32 residual stream and
layer-norm inputs, bf16 GEMM inputs, qkv, attention output, fc1/GELU outputs), 47 GB for 65536
tokens x 8 layers, plus 7.5 GB of fp32 parameters, gradients and Adam moments: ~60 GB of the
H200's 141 GB (an H100's 80 GB too, narrowly). Pattern: the examples' ``global``
(``examples/common.PATTERNS``: a causal window of ``window`` tokens plus the first block visible
to every query, the tile the recall task's memory sits in) with a 2048-token window: density
0.244 at N=8192 and 0.068 at 32768, so attention is 14-15% of the step's matmul FLOPs at both
lengths, the share a long-context sparse model has (a 512-token window would make it 6%, the
benchmark a GEMM benchmark; causal-dense would make it a FlashAttention one). The position
table has ``max(seq_lens)`` rows, drawn once (``init_gpt_params``, seed 0); a shorter N uses its
first N rows, so every case's weights are the same canonical draw.

Processes: the torch layouts run in 2 spawned ranks (NCCL on the GPUs, gloo on CPU), case after
case (``tp1`` on rank 0 while rank 1 waits); then JAX in a subprocess that drives both devices
(one per case on the GPU, for a per-case memory peak; one for every case on CPU), so the two
frameworks never hold GPU memory at once. A case that fails (say out of memory) is recorded with
its traceback and the next case runs; ``--budget_s`` bounds the wall clock (torch gets 40% of
it, JAX the rest and whatever torch left; cases that no longer fit are recorded as skipped).

Usage::

    python benchmarks/gpt_scaling.py --preset=cpu        # 2 gloo ranks + 2 JAX host devices,
                                                         # tiny: a functional check, ~30 s
    python3 benchmarks/gpt_scaling.py --preset=gpu2 --out_dir=$OUT --budget_s=360   # 2 GPUs

On 2 GPUs expect ~1 min for torch (spawn, NCCL, 6 cases of 7 steps; the first step of the
first case compiles the Triton kernels) and ~25 s per JAX case (process start, XLA compile with
its GEMM autotuning, 7 steps), ~4-5 min in all: the default ``--budget_s`` of 240 s may leave
the last JAX cases skipped. On the GPU machine install jax-triton first (BUILD.md). The tool
sets ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1`` for its
children and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` for the torch ranks (Megatron's setting, which
the TP layers' backward overlap assumes; every torch layout runs with it) unless already set.
Output: ``<out_dir>/gpt_scaling.json`` (``rows``: one per framework x N x layout; ``cases``: the
raw per-rank / per-device records) and ``gpt_scaling.png``; a table on stdout. Exits 1 if any
case failed or was skipped.

Believe the numbers only when these pass (on the GPU machine for the GPU numbers):
``tests/model_test.py`` (the GPT in both frameworks against the float64 oracle; JAX at TP=2
and at DP=2 x TP=2), ``tests/torch_gpt_tp_test.py``, ``tests/torch_dp_tp_test.py``,
``tests/jax_dp_tp_test.py``, ``tests/torch_amp_test.py`` (autocast) and
``tests/gpt_scaling_test.py`` (this tool's cpu preset: every row ran, and the three layouts'
losses agree within each framework).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import types

import numpy as np
from absl import app, flags

from sparsetp.bench import common as bench_common
from sparsetp.core import GPTConfig, HybridConfig, RecallTask, init_gpt_params, make_layout
from sparsetp.core.model import gpt_train_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _examples_common():
    """``examples/common.py`` (the examples' patterns, peak FLOP/s table), loaded by path: the
    name ``common`` would be ambiguous on ``sys.path``."""
    spec = importlib.util.spec_from_file_location("examples_common",
                                                  os.path.join(ROOT, "examples", "common.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


EX = _examples_common()
FLAGS = flags.FLAGS

flags.DEFINE_enum("preset", "auto", ["auto", "gpu2", "cpu"], "Shapes, steps and devices: gpu2 "
                  "(2 GPUs, the model of the docstring, bf16 compute), cpu (tiny, fp32, gloo + 2 "
                  "JAX host devices), auto (gpu2 where torch sees >= 2 GPUs, else cpu).")
flags.DEFINE_string("out_dir", "benchmarks/out", "Directory for gpt_scaling.json and the plot.")
flags.DEFINE_float("budget_s", None, "Wall-clock budget in seconds (default: the preset's).")
flags.DEFINE_list("seq_lens", None, "Sequence lengths N (default: the preset's).")
flags.DEFINE_list("layouts", ["tp1", "dp2", "tp2"], "Layouts to run (tp1 always runs first: "
                  "the speed-ups are against it).")
flags.DEFINE_list("frameworks", ["torch", "jax"], "Frameworks to run.")
flags.DEFINE_integer("batch", None, "Global batch in sequences (default: the preset's; DP=2 "
                     "needs it even: an odd one makes the dp2 cases fail, which is recorded).")
flags.DEFINE_integer("steps", None, "Timed training steps per case (default: the preset's).")
flags.DEFINE_integer("warmup", None, "Untimed steps before them (default: the preset's).")
flags.DEFINE_enum("compute_dtype", None, ["bfloat16", "float32"], "Compute dtype (default: "
                  "the preset's; parameters and Adam state are float32 either way).")
flags.DEFINE_bool("jax_process_per_case", None, "One JAX subprocess per case (a per-case "
                  "memory peak; default: on for gpu2, off for cpu).")
flags.DEFINE_bool("plots", True, "Draw gpt_scaling.png (matplotlib).")
flags.DEFINE_bool("progress", True, "Show a tqdm progress bar over the cases.")
flags.DEFINE_string("jax_job", None, "Internal: run the JAX cases of this job file and exit.")

PRESETS = {
    # 2 GPUs: see the module docstring for the model and the pattern.
    "gpu2": dict(device="cuda", seq_lens=[8192, 32768], batch=2, d_model=2048, num_heads=16,
                 d_ff=8192, num_layers=8, block_size=128, window=2048, num_values=64,
                 num_slots=128, num_queries=128, lr=1e-3, compute_dtype="bfloat16", warmup=2,
                 steps=5, budget_s=240.0, jax_process_per_case=True),
    # A functional check on 2 CPU cores: every code path of the gpu2 run, tiny shapes, fp32
    # (the layouts' losses then agree to fp32 rounding).
    "cpu": dict(device="cpu", seq_lens=[128, 256], batch=2, d_model=32, num_heads=2, d_ff=64,
                num_layers=1, block_size=32, window=64, num_values=16, num_slots=16,
                num_queries=16, lr=3e-3, compute_dtype="float32", warmup=1, steps=2,
                budget_s=120.0, jax_process_per_case=False),
}
# (data-parallel size, tensor-parallel size) of each layout.
LAYOUTS = {"tp1": (1, 1), "dp2": (2, 1), "tp2": (1, 2)}
WORLD = 2
SEED = 0            # of the parameters and of the data (batch k = task.batch(SEED, k, batch))
ADAM = dict(b1=0.9, b2=0.999, eps=1e-8)   # the examples' Adam (common.adam_hparams)
_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
TORCH_SHARE = 0.4   # of the budget, for the torch ranks when JAX runs too


# ---------------------------------------------------------------------------------------------
# The model, the data, the parameters (numpy only: shared by the parent and both frameworks)


def _pattern(spec):
    s = types.SimpleNamespace(window=spec["window"], block_size=spec["block_size"])
    return EX.PATTERNS["global"](s)


def gpt_config(spec, seq_len: int, dtype: str = "float32") -> GPTConfig:
    """The GPT of ``spec`` for ``seq_len`` tokens; ``dtype`` is the blocks' (JAX computes in
    it; the parameters stay float32)."""
    block = HybridConfig(spec["d_model"], spec["num_heads"], spec["d_ff"], _pattern(spec),
                         block_size=spec["block_size"], dtype=dtype)
    vocab = spec["num_values"] + spec["num_slots"]
    return GPTConfig(vocab, spec["num_layers"], seq_len, block)


def task(spec, seq_len: int) -> RecallTask:
    return RecallTask(seq_len, spec["num_values"], spec["num_slots"], spec["num_queries"])


def batches(spec, seq_len: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The global batches of every step, warm-up included (the same for every layout)."""
    t = task(spec, seq_len)
    return [t.batch(SEED, step, spec["batch"]) for step in range(spec["warmup"] + spec["steps"])]


def _draw_params(spec, params_dir: str) -> dict:
    """Draw the canonical parameters once (``max(seq_lens)`` position rows) and save one .npy
    per parameter for the children."""
    t0 = time.perf_counter()
    params = init_gpt_params(gpt_config(spec, max(spec["seq_lens"])), SEED)
    os.makedirs(params_dir, exist_ok=True)
    for name, a in params.items():
        np.save(os.path.join(params_dir, name + ".npy"), a)
    return dict(draw_s=round(time.perf_counter() - t0, 2),
                count=int(sum(a.size for a in params.values())))


def _load_params(params_dir: str, spec) -> dict[str, np.ndarray]:
    config = gpt_config(spec, max(spec["seq_lens"]))
    from sparsetp.core import gpt_param_shapes  # noqa: PLC0415
    return {n: np.load(os.path.join(params_dir, n + ".npy")) for n in gpt_param_shapes(config)}


def params_for(params: dict, seq_len: int) -> dict:
    """The parameters of the ``seq_len`` model: the position table's first ``seq_len`` rows."""
    return dict(params, **{"pos.weight": params["pos.weight"][:seq_len]})


def case_name(framework: str, seq_len: int, layout: str) -> str:
    return f"{framework}:{layout}:{seq_len}"


# ---------------------------------------------------------------------------------------------
# torch ranks


def _torch_rank(rank, job, q):
    """One torch rank: every torch case in turn; rank 0 merges and reports each case."""
    try:
        spec = job["spec"]
        cuda = spec["device"] == "cuda"
        if cuda:
            # Megatron's setting for its async TP all-reduce (sparsetp.bench.tp sets it too),
            # for every layout alike; export another value to override it (recorded per case).
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            for k, v in _GPU_ENV.items():
                os.environ.setdefault(k, v)
        import datetime  # noqa: PLC0415

        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        from sparsetp.torch import make_device_mesh  # noqa: PLC0415

        if cuda:
            torch.cuda.set_device(rank)
            device, backend = torch.device("cuda", rank), "nccl"
        else:
            torch.set_num_threads(1)  # 2 ranks on 2 cores
            device, backend = torch.device("cpu"), "gloo"
        kw = {"device_id": device} if cuda else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{job['port']}",
                                rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=job["pg_timeout_s"]), **kw)
        # Every group is made by every rank, in one order (new_group is collective).
        ctx = dict(device=device,
                   meshes={"dp2": make_device_mesh(2, 1), "tp2": make_device_mesh(1, 2)},
                   solo=[dist.new_group([r]) for r in range(WORLD)][rank])
        params = _load_params(job["params_dir"], spec)
        for case in job["cases"]:
            name = case_name("torch", case["seq_len"], case["layout"])
            # Rank 0 decides whether the case still fits, so every rank takes the same branch.
            flag = [time.time() < job["deadline"] - job["reserve_s"]]
            dist.broadcast_object_list(flag, src=0)
            t0 = time.perf_counter()
            if not flag[0]:
                entry = dict(ok=False, skipped=True, reason="budget")
            else:
                try:
                    entry = dict(ok=True, data=_torch_case(rank, spec, case, params, ctx))
                except Exception:  # noqa: BLE001  (recorded; the next case still runs)
                    entry = dict(ok=False, error=traceback.format_exc()[-4000:])
                _torch_free(device)
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, entry)
            if rank == 0:
                q.put(("case", name, _merge_ranks(gathered)))
        dist.barrier()
        dist.destroy_process_group()
        q.put(("done", rank, None))
    except BaseException:  # noqa: BLE001  (the parent records it)
        q.put(("error", rank, traceback.format_exc()[-4000:]))


def _torch_free(device):
    import torch  # noqa: PLC0415
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _merge_ranks(gathered: list[dict]) -> dict:
    """One record of a case from the ranks' records (an idle rank's TP=1 record is left out of
    the timing; a failed rank fails the case)."""
    merged = dict(ok=all(g.get("ok") for g in gathered),
                  skipped=any(g.get("skipped") for g in gathered), ranks=gathered,
                  seconds=max(g.get("seconds", 0.0) for g in gathered))
    errors = [g["error"] for g in gathered if g.get("error")]
    if errors:
        merged["error"] = errors[0]
    if merged["skipped"]:
        merged["reason"] = "budget"
    if merged["ok"]:
        active = [g["data"] for g in gathered if not g["data"].get("idle")]
        # A step ends when its slowest rank ends (the ranks meet in every collective).
        step_s = [max(s) for s in zip(*(a["step_s"] for a in active), strict=True)]
        merged["data"] = dict(step_s=step_s, losses=active[0]["losses"],
                              first_step_s=max(a["first_step_s"] for a in active),
                              peak_bytes=[a["peak_bytes"] for a in active],
                              peak_reserved_bytes=[a["peak_reserved_bytes"] for a in active],
                              local_param_count=[a["local_param_count"] for a in active],
                              devices=[a["device"] for a in active],
                              cuda_device_max_connections=active[0].get(
                                  "cuda_device_max_connections"))
    return merged


def _torch_case(rank, spec, case, params, ctx) -> dict:
    import contextlib  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from sparsetp.torch import GPT, data_parallel, gpt_loss, shard_batch  # noqa: PLC0415

    layout, n = case["layout"], case["seq_len"]
    dp, tp = LAYOUTS[layout]
    device = ctx["device"]
    if dp * tp == 1 and rank != 0:
        return dict(idle=True)
    mesh = ctx["meshes"].get(layout)
    group = ctx["solo"] if mesh is None else mesh["tp"].get_group()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    config = gpt_config(spec, n)  # float32 parameters; autocast computes in bf16
    model = GPT.from_params(config, params_for(params, n), group, device=device)
    train_model = data_parallel(model, mesh) if dp > 1 else model
    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"], betas=(ADAM["b1"], ADAM["b2"]),
                           eps=ADAM["eps"])
    data = []
    for arrays in batches(spec, n):
        tensors = [torch.from_numpy(a) for a in arrays]
        if dp > 1:  # this replica's slice of the global batch
            tensors = [shard_batch(t, mesh) for t in tensors]
        data.append([t.to(device) for t in tensors])
    dtype = getattr(torch, spec["compute_dtype"])
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    step_s, losses = [], []
    for tokens, targets, mask in data:
        sync()
        t0 = time.perf_counter()
        with autocast:
            logits = train_model(tokens)
        loss = gpt_loss(logits, targets, mask)  # a mean over this replica's sequences
        opt.zero_grad(set_to_none=True)
        loss.backward()                         # DDP averages the gradients over dp
        opt.step()
        sync()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.detach().float())
        del logits, loss
    losses = torch.stack(losses)
    if dp > 1:  # the global batch's loss: the mean of the replicas' (equal masked counts)
        dist.all_reduce(losses, group=mesh["dp"].get_group())
        losses /= dp
    out = dict(step_s=step_s[spec["warmup"]:], first_step_s=step_s[0],
               losses=[float(v) for v in losses.cpu()],
               local_param_count=sum(p.numel() for p in model.parameters()),
               peak_bytes=int(torch.cuda.max_memory_allocated(device)) if cuda else None,
               peak_reserved_bytes=int(torch.cuda.max_memory_reserved(device)) if cuda else None,
               device=torch.cuda.get_device_name(device) if cuda else "cpu",
               cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    del train_model, model, opt, data
    return out


def _run_torch(run, job, timeout: float) -> None:
    """Spawn the 2 ranks; each case is recorded as rank 0 reports it."""
    bench_common.spawn_ranks(_torch_rank, WORLD, (job,), run.record, timeout,
                             "gpt-scaling-rank", "case")


# ---------------------------------------------------------------------------------------------
# JAX (a subprocess driving both devices)


def _jax_worker(job_path: str) -> None:
    """Subprocess entry: run the job's JAX cases, writing the results after each."""
    with open(job_path) as f:
        job = json.load(f)
    spec = job["spec"]
    import jax  # noqa: PLC0415

    result = dict(devices=[str(d) for d in jax.devices()],
                  xla_flags=os.environ.get("XLA_FLAGS", ""), cases={})

    def save():
        bench_common.write_json(job["out"], result)

    save()
    params = _load_params(job["params_dir"], spec)
    for case in job["cases"]:
        name = case_name("jax", case["seq_len"], case["layout"])
        t0 = time.perf_counter()
        if time.time() > job["deadline"] - job["reserve_s"]:
            entry = dict(ok=False, skipped=True, reason="budget")
        else:
            try:
                entry = dict(ok=True, data=_jax_case(spec, case, params))
                # peak_bytes_in_use never goes down: with several cases in one process it is
                # the largest so far, not this case's own.
                entry["data"]["peak_scope"] = "case" if len(job["cases"]) == 1 else "process"
            except Exception:  # noqa: BLE001  (recorded; the next case still runs)
                entry = dict(ok=False, error=traceback.format_exc()[-4000:])
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        result["cases"][name] = entry
        print(f"jax {name}: {'ok' if entry['ok'] else 'not ok'}", file=sys.stderr, flush=True)
        save()
        gc.collect()


def _jax_case(spec, case, params) -> dict:
    import dataclasses  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from sparsetp.jax import (  # noqa: PLC0415
        gpt,
        gpt_loss,
        load_gpt_params,
        make_2d_mesh,
        shard_batch,
        shard_gpt_params,
    )

    layout, n = case["layout"], case["seq_len"]
    dp, tp = LAYOUTS[layout]
    config = gpt_config(spec, n)  # float32 parameters and Adam state
    compute = dataclasses.replace(config, block=dataclasses.replace(
        config.block, dtype=spec["compute_dtype"]))  # the examples' bf16 compute
    p_np = params_for(params, n)
    if dp * tp == 1:
        dev = jax.devices()[0]
        devices = [dev]
        params = jax.device_put(load_gpt_params(p_np, config), dev)

        def put(a):
            return jax.device_put(a, dev)

        kw = {}
    else:
        mesh = make_2d_mesh(dp, tp)
        devices = list(mesh.devices.flat)
        params = shard_gpt_params(p_np, config, mesh, "model")

        def put(a):
            return shard_batch(a, mesh)

        kw = dict(mesh=mesh, axis_name="model", batch_axis="data")
    optimizer = optax.adam(spec["lr"], **ADAM)
    # Eagerly: the moments are laid out like the parameters (zeros_like keeps a concrete
    # array's sharding; jax.jit(optimizer.init) put them all on the first device). The step
    # count, a new scalar, is replicated over the mesh.
    opt_state = optimizer.init(params)
    if dp * tp > 1:
        rep = NamedSharding(mesh, P())
        opt_state = jax.tree_util.tree_map(
            lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, rep),
            opt_state)

    def step(params, opt_state, tokens, targets, mask):
        def loss_fn(p):
            return gpt_loss(gpt(p, tokens, compute, **kw), targets, mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = [tuple(put(a.astype(np.int32) if a.dtype == np.int64 else a) for a in b)
            for b in batches(spec, n)]
    # The step gives the parameters and the state back laid out as it takes them (so the
    # donated buffers are reused and the next step's inputs match the compiled layouts).
    shardings = jax.tree_util.tree_map(lambda a: a.sharding, (params, opt_state))
    out_shardings = (*shardings, NamedSharding(mesh, P())) if dp * tp > 1 else None
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings).lower(
        params, opt_state, *data[0]).compile()
    compile_s = time.perf_counter() - t0
    estimate = None
    try:
        ma = compiled.memory_analysis()
        # Per device: what the step's buffers need at its peak (donated inputs alias outputs).
        estimate = int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                       - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
    except Exception:  # noqa: BLE001  (not every backend reports it)
        pass
    step_s, losses = [], []
    for tokens, targets, mask in data:
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens, targets, mask)
        jax.block_until_ready((params, opt_state, loss))
        step_s.append(time.perf_counter() - t0)
        losses.append(loss)
    peaks = []
    for d in devices:
        stats = d.memory_stats() or {}
        peaks.append(int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None)
    local = sum(s.data.size for a in jax.tree_util.tree_leaves(params)
                for s in a.addressable_shards if s.device == devices[0])
    return dict(step_s=step_s[spec["warmup"]:], first_step_s=step_s[0],
                compile_s=round(compile_s, 2), losses=[float(v) for v in losses],
                peak_bytes=peaks, xla_step_bytes_estimate=estimate, local_param_count=int(local),
                devices=[d.device_kind if d.platform == "gpu" else d.platform for d in devices])


def _run_jax(run, job_base: dict, cases: list[dict]) -> None:
    """One JAX subprocess for ``cases``; each is recorded as ``jax:<layout>:<N>``."""
    tmp = tempfile.mkdtemp(prefix="gpt_scaling_jax_")
    out = os.path.join(tmp, "jax.json")
    job = dict(job_base, cases=cases, out=out, deadline=time.time() + run.left())
    with open(os.path.join(tmp, "job.json"), "w") as f:
        json.dump(job, f)
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # so memory_stats measure what is used
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)   # a torch/Megatron setting, not XLA's
    if job["spec"]["device"] == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={WORLD}").strip()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), f"--jax_job={os.path.join(tmp, 'job.json')}"]
    got, err = bench_common.run_json_subprocess(cmd, env, max(10.0, run.left() + 30.0), out)
    for case in cases:
        name = case_name("jax", case["seq_len"], case["layout"])
        entry = got.get("cases", {}).get(name)
        if entry is None:
            entry = dict(ok=False, error=err or "the JAX subprocess recorded nothing for it")
        entry["process_devices"] = got.get("devices")
        entry["xla_flags"] = got.get("xla_flags")
        run.record(name, entry)
    shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The record, rows, table, plot


class _Run:
    def __init__(self, out_dir: str, spec: dict, budget_s: float, total: int):
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.path = os.path.join(out_dir, "gpt_scaling.json")
        self.result = dict(question="issue #24: GPT training throughput, TP=1 vs DP=2 vs TP=2",
                           spec=spec, budget_s=budget_s, cases={}, warnings=[],
                           versions=dict(argv=sys.argv, python=sys.version.split()[0]))
        self.bar = None
        if FLAGS.progress:
            try:
                from tqdm import tqdm  # noqa: PLC0415
                self.bar = tqdm(total=total, desc="gpt scaling", file=sys.stderr,
                                dynamic_ncols=True)
            except ImportError:
                self.result["warnings"].append("tqdm missing: plain progress lines")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def record(self, name: str, entry: dict) -> None:
        self.result["cases"][name] = entry
        bench_common.write_json(self.path, self.result)
        status = "ok" if entry.get("ok") else ("skipped" if entry.get("skipped") else "FAILED")
        extra = ""
        if entry.get("ok"):
            extra = f" median step {1e3 * float(np.median(entry['data']['step_s'])):.1f} ms"
        elif entry.get("error"):
            extra = f" ({entry['error'].strip().splitlines()[-1][:200]})"
        self.log(f"{name}: {status}{extra}")
        if self.bar is not None:
            self.bar.update(1)


def make_rows(result: dict, spec: dict, cases: list[dict]) -> list[dict]:
    """One flat row per framework x N x layout, in run order, with the derived numbers."""
    rows = []
    device_peak = None
    for c in cases:
        entry = result["cases"].get(case_name(c["framework"], c["seq_len"], c["layout"]),
                                    dict(ok=False, error="not run"))
        dp, tp = LAYOUTS[c["layout"]]
        gpus = dp * tp
        n = c["seq_len"]
        config = gpt_config(spec, n)
        density = make_layout(config.block.pattern, n, config.block.num_heads,
                              config.block.block_size).density
        flops = spec["batch"] * gpt_train_flops(config, n, density)
        row = dict(framework=c["framework"], seq_len=n, layout=c["layout"], dp=dp, tp=tp,
                   gpus=gpus, batch=spec["batch"], ok=bool(entry.get("ok")),
                   skipped=bool(entry.get("skipped")), density=density,
                   train_flops_per_step=flops)
        if not row["ok"]:
            row["error"] = (entry.get("error") or entry.get("reason") or "").strip()[-300:]
            rows.append(row)
            continue
        d = entry["data"]
        step = float(np.median(d["step_s"]))
        name = (d.get("devices") or ["cpu"])[0]
        peak = EX.peak_flops(name) if spec["device"] == "cuda" else None
        device_peak = device_peak or peak
        peaks = [b for b in d.get("peak_bytes") or [] if b is not None]
        row.update(device=name, step_ms=1e3 * step,
                   step_ms_mean=1e3 * float(np.mean(d["step_s"])),
                   step_ms_min=1e3 * float(np.min(d["step_s"])), timed_steps=len(d["step_s"]),
                   first_step_s=d["first_step_s"], compile_s=d.get("compile_s"),
                   tokens_per_s=spec["batch"] * n / step,
                   mfu_per_gpu=flops / step / (gpus * peak) if peak else None,
                   peak_bytes_per_gpu=max(peaks) if peaks else None,
                   peak_bytes=d.get("peak_bytes"), peak_scope=d.get("peak_scope", "case"),
                   xla_step_bytes_estimate=d.get("xla_step_bytes_estimate"),
                   local_param_count=d.get("local_param_count"),
                   cuda_device_max_connections=d.get("cuda_device_max_connections"),
                   first_loss=d["losses"][0], losses=d["losses"])
        rows.append(row)
    for r in rows:  # speed-up against the same framework's TP=1 at the same N
        base = next((b for b in rows if b["framework"] == r["framework"]
                     and b["seq_len"] == r["seq_len"] and b["layout"] == "tp1" and b["ok"]),
                    None)
        if r["ok"] and base is not None:
            r["speedup_vs_tp1"] = base["step_ms"] / r["step_ms"]
            r["first_loss_minus_tp1"] = r["first_loss"] - base["first_loss"]
    return rows


def table(rows: list[dict]) -> list[str]:
    head = (f"{'framework':9} {'N':>6} {'layout':6} {'GPUs':>4} {'step ms':>9} {'tokens/s':>10} "
            f"{'MFU/GPU':>8} {'vs TP=1':>7} {'peak GiB/GPU':>12} {'first loss':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r["ok"]:
            why = "skipped (budget)" if r["skipped"] else "FAILED: " + (
                r.get("error", "").splitlines() or [""])[-1][:80]
            lines.append(f"{r['framework']:9} {r['seq_len']:>6} {r['layout']:6} {r['gpus']:>4} "
                         f"{why}")
            continue
        mfu = f"{100 * r['mfu_per_gpu']:.1f}%" if r["mfu_per_gpu"] is not None else "-"
        mem = (f"{r['peak_bytes_per_gpu'] / 2 ** 30:.1f}" if r["peak_bytes_per_gpu"] is not None
               else "-")
        sp = f"{r['speedup_vs_tp1']:.2f}x" if "speedup_vs_tp1" in r else "-"
        lines.append(f"{r['framework']:9} {r['seq_len']:>6} {r['layout']:6} {r['gpus']:>4} "
                     f"{r['step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} {mfu:>8} {sp:>7} "
                     f"{mem:>12} {r['first_loss']:>10.5f}")
    return lines


def plot(rows: list[dict], spec: dict, device: str, out_dir: str) -> str:
    """tokens/s, MFU per GPU and peak memory per GPU of every layout, grouped by N and
    framework (the speed-up against TP=1 written on the tokens/s bars)."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    groups = sorted({(r["framework"], r["seq_len"]) for r in rows},
                    key=lambda g: (g[1], g[0] != "torch", g[0]))
    layouts = [lay for lay in LAYOUTS if any(r["layout"] == lay for r in rows)]
    panels = (("tokens_per_s", 1e-3, "thousand tokens/s (global batch)"),
              ("mfu_per_gpu", 100.0, "MFU per GPU (%)"),
              ("peak_bytes_per_gpu", 2.0 ** -30, "peak memory per GPU (GiB)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.5))
    width = 0.8 / max(1, len(layouts))

    def row(g, lay):
        return next((r for r in rows if (r["framework"], r["seq_len"]) == g
                     and r["layout"] == lay and r["ok"]), None)

    for ax, (key, scale, label) in zip(axes, panels, strict=True):
        any_value = False
        for k, lay in enumerate(layouts):
            vals = []
            for g in groups:
                r = row(g, lay)
                v = r.get(key) if r else None
                any_value |= v is not None
                vals.append(scale * v if v is not None else 0.0)
            xs = [i + (k - (len(layouts) - 1) / 2) * width for i in range(len(groups))]
            bars = ax.bar(xs, vals, width, label=lay)
            if key == "tokens_per_s":
                for b, g in zip(bars, groups, strict=True):
                    r = row(g, lay)
                    if r and "speedup_vs_tp1" in r:
                        ax.annotate(f"{r['speedup_vs_tp1']:.2f}x",
                                    (b.get_x() + b.get_width() / 2, b.get_height()),
                                    ha="center", va="bottom", fontsize=7)
        if not any_value:
            ax.text(0.5, 0.5, "not measured on this device", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{f}\nN={n}" for f, n in groups])
        ax.set_ylabel(label)
        ax.legend(title="layout", fontsize=8)
    fig.suptitle(f"sparsetp GPT training steps on {device}: d={spec['d_model']}, "
                 f"{spec['num_layers']} layers, {spec['num_heads']} heads, batch {spec['batch']}, "
                 f"{spec['compute_dtype']} compute, fp32 Adam", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, "gpt_scaling.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _git() -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        return dict(commit=head or None, dirty_files=dirty.splitlines())
    except (OSError, subprocess.SubprocessError):
        return dict(commit=None)


def resolve_spec(gpus: int) -> dict:
    preset = FLAGS.preset
    if preset == "auto":
        preset = "gpu2" if gpus >= WORLD else "cpu"
    spec = dict(PRESETS[preset], preset=preset)
    if spec["device"] == "cuda" and gpus < WORLD:
        raise app.UsageError(f"--preset={preset} needs {WORLD} GPUs; torch sees {gpus}")
    for key in ("batch", "steps", "warmup", "compute_dtype", "jax_process_per_case",
                "budget_s"):
        if getattr(FLAGS, key) is not None:
            spec[key] = getattr(FLAGS, key)
    if FLAGS.seq_lens:
        spec["seq_lens"] = [int(n) for n in FLAGS.seq_lens]
    if spec["steps"] < 1 or spec["warmup"] < 0 or spec["batch"] < 1:
        raise app.UsageError("--steps and --batch must be >= 1, --warmup >= 0")
    unknown = (set(FLAGS.layouts) - set(LAYOUTS)) | (set(FLAGS.frameworks) - {"torch", "jax"})
    if unknown:
        raise app.UsageError(f"unknown --layouts/--frameworks {sorted(unknown)}")
    return spec


def main(argv):
    del argv
    if FLAGS.jax_job:
        _jax_worker(FLAGS.jax_job)
        return 0
    import torch  # noqa: PLC0415  (only to count GPUs; the ranks are fresh processes)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    spec = resolve_spec(gpus)
    if spec["device"] == "cuda":
        for k, v in _GPU_ENV.items():  # NVLink multicast off here and in every child
            os.environ.setdefault(k, v)
    budget = float(spec.pop("budget_s"))
    layouts = [lay for lay in LAYOUTS if lay in FLAGS.layouts]  # tp1 first
    cases = [dict(framework=f, seq_len=n, layout=lay) for f in FLAGS.frameworks
             for n in spec["seq_lens"] for lay in layouts]
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    run = _Run(FLAGS.out_dir, spec, budget, len(cases))
    run.result["env"] = {k: os.environ.get(k) for k in
                         (*_GPU_ENV, "XLA_FLAGS", "CUDA_DEVICE_MAX_CONNECTIONS")}
    run.result["git"] = _git()
    run.log(f"gpt scaling: preset={spec['preset']} device={spec['device']} budget={budget:.0f}s "
            f"N={spec['seq_lens']} layouts={layouts} frameworks={FLAGS.frameworks}")
    tmp = tempfile.mkdtemp(prefix="gpt_scaling_")
    try:
        params_dir = os.path.join(tmp, "params")
        run.result["params"] = _draw_params(spec, params_dir)
        run.log(f"drew {run.result['params']['count'] / 1e6:.1f}M parameters in "
                f"{run.result['params']['draw_s']} s")
        cuda = spec["device"] == "cuda"
        # A case starts only with this much budget left (GPU: a torch case takes ~5-15 s, a JAX
        # subprocess ~25 s to start, compile and run one case).
        reserve = dict(torch=15.0, jax_start=30.0, jax_case=20.0) if cuda else dict(
            torch=2.0, jax_start=4.0, jax_case=2.0)
        base = dict(spec=spec, params_dir=params_dir, reserve_s=reserve["jax_case"])
        torch_cases = [c for c in cases if c["framework"] == "torch"]
        jax_cases = [c for c in cases if c["framework"] == "jax"]
        if torch_cases:
            share = TORCH_SHARE * run.left() if jax_cases else run.left()
            job = dict(base, cases=torch_cases, port=_free_port(), reserve_s=reserve["torch"],
                       deadline=time.time() + share,
                       pg_timeout_s=max(60.0, min(300.0, budget / 2)))
            try:
                _run_torch(run, job, timeout=share + 60.0)
            except Exception:  # noqa: BLE001  (recorded: the JAX cases still run)
                err = traceback.format_exc()[-4000:]
                for c in torch_cases:
                    name = case_name("torch", c["seq_len"], c["layout"])
                    if name not in run.result["cases"]:
                        run.record(name, dict(ok=False, error=err))
        if jax_cases:
            groups = ([[c] for c in jax_cases] if spec["jax_process_per_case"]
                      else [jax_cases])
            for group in groups:
                if run.left() < reserve["jax_start"]:
                    for c in group:
                        run.record(case_name("jax", c["seq_len"], c["layout"]),
                                   dict(ok=False, skipped=True, reason="budget"))
                    continue
                _run_jax(run, base, group)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        run.result["versions"] = bench_common.versions(device=spec["device"])
    except Exception as e:  # noqa: BLE001
        run.result["warnings"].append(f"versions(): {e!r}")
    rows = make_rows(run.result, spec, cases)
    run.result["rows"] = rows
    if FLAGS.plots:
        try:
            device = next((r["device"] for r in rows if r.get("device")), spec["device"])
            run.result["plot"] = plot(rows, spec, f"{WORLD}x {device}", FLAGS.out_dir)
        except Exception as e:  # noqa: BLE001  (the JSON matters more than the picture)
            run.result["warnings"].append(f"plot: {e!r}")
    run.result["wall_s"] = round(time.monotonic() - run.t0, 1)
    failed = [case_name(r["framework"], r["seq_len"], r["layout"]) for r in rows if not r["ok"]]
    run.result["failed_or_skipped"] = failed
    bench_common.write_json(run.path, run.result)
    if run.bar is not None:
        run.bar.close()
    print("\n".join(table(rows)))
    print(f"wrote {run.path} in {run.result['wall_s']} s; not ok: {failed or 'none'}")
    return 1 if failed else 0


def _free_port() -> int:
    import socket  # noqa: PLC0415
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    app.run(main)
