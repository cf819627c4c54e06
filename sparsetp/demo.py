"""The main job: a tensor-parallel HybridBlock checked against the float64 oracle.

``python -m sparsetp demo --backend torch --tp 4`` spawns 4 processes itself (gloo on CPU, NCCL
on GPUs); ``torchrun --nproc_per_node 4 -m sparsetp demo --backend torch`` runs the same thing in
processes torchrun started. Each run builds ``HybridBlock.from_params(cfg, init_params(cfg,
seed))`` with a BigBird pattern, runs a few forward+backward steps on fresh random inputs and
random cotangents, compares every step's output, input gradient and (gathered) parameter
gradients with :func:`sparsetp.core.reference.hybrid_block_grad` of the whole unsharded block,
and prints a short table. It exits non-zero when a check fails.

``--backend jax`` hands the same :class:`DemoArgs` to ``sparsetp.backends.jax.demo.main``.

Defaults fit a 2-core CPU (the Triton interpreter): B=1, N=256, d=64, 4 heads, d_ff=256, 32-token
blocks, float32. On GPUs: B=1, N=1024, d=512, 8 heads, d_ff=2048, 64-token blocks (the float64
oracle of the whole block, dense O(N^2) numpy, stays a few seconds per step at that size; at
N=2048 it is ~4x that).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import sys
import time

import numpy as np

from sparsetp.core import (
    DTYPES,
    HybridConfig,
    check_tp_size,
    init_params,
    make_layout,
    param_shapes,
    partition_dim,
    reference,
)
from sparsetp.core import patterns as P

__all__ = ["DemoArgs", "main", "validate", "TOLERANCE"]

# Scaled max error max|got - want| / max(1, max|want|) allowed per parameter dtype. float32:
# O(1) values, reductions <= a few thousand long with IEEE (not TF32) dots -> errors ~1e-6, so 1e-4
# leaves margin yet catches any real bug (O(0.1-1)); half precisions keep ~3 (bf16) / ~4 (fp16)
# significant digits through two residual layers.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}

_CPU_DEFAULTS = dict(batch=1, seq_len=256, d_model=64, num_heads=4, d_ff=256, block_size=32,
                     dtype="float32")
_GPU_DEFAULTS = dict(batch=1, seq_len=1024, d_model=512, num_heads=8, d_ff=2048, block_size=64,
                     dtype="float32")


@dataclasses.dataclass(frozen=True)
class DemoArgs:
    """What the demo runs; None fields take the CPU or GPU default (see the module docstring).

    ``tp=None``: ``WORLD_SIZE`` under torchrun, else 4 on CPU or the number of GPUs.
    ``device``: "auto" (GPU when torch sees one), "cpu" or "cuda".
    """

    backend: str = "torch"
    tp: int | None = None
    steps: int = 3
    batch: int | None = None
    seq_len: int | None = None
    d_model: int | None = None
    num_heads: int | None = None
    d_ff: int | None = None
    block_size: int | None = None
    dtype: str | None = None
    seed: int = 0
    device: str = "auto"

    def __post_init__(self):
        if self.backend not in ("torch", "jax"):
            raise ValueError(f"backend must be 'torch' or 'jax', got {self.backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("tp", "steps", "batch", "seq_len", "d_model", "num_heads", "d_ff"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    def with_defaults(self, on_gpu: bool) -> DemoArgs:
        """Fill the None sizes with the CPU or GPU defaults."""
        defaults = _GPU_DEFAULTS if on_gpu else _CPU_DEFAULTS
        return dataclasses.replace(self, **{
            k: v for k, v in defaults.items() if getattr(self, k) is None})

    def _bigbird(self) -> dict:
        # BigBird: 3-block window, 1 global block, 2 random blocks per row (1 when the sequence
        # is too short to have 2), blocks of one tile.
        bs = self.block_size
        return dict(block=bs, window_blocks=3, global_blocks=1,
                    random_per_row=2 if self.seq_len >= 4 * bs else 1, seed=self.seed)

    def pattern_description(self) -> str:
        return "bigbird(" + ", ".join(f"{k}={v}" for k, v in self._bigbird().items()) + ")"

    def config(self) -> HybridConfig:
        bs = self.block_size
        pattern = P.bigbird(**self._bigbird())
        return HybridConfig(d_model=self.d_model, num_heads=self.num_heads, d_ff=self.d_ff,
                            pattern=pattern, block_size=bs, dtype=self.dtype)


def main(args: DemoArgs) -> int:
    """Run the demo for ``args``; returns 0 when every check passed (raises on bad input)."""
    if args.backend == "jax":
        try:
            jax_demo = importlib.import_module("sparsetp.backends.jax.demo")
        except ModuleNotFoundError as e:
            if e.name != "sparsetp.backends.jax.demo":
                raise
            raise RuntimeError(
                "--backend jax needs sparsetp.backends.jax.demo, which is not in this checkout "
                "yet; the torch demo is `--backend torch` (no fallback is taken)") from e
        return jax_demo.main(args)
    return _torch_main(args)


def validate(cfg: HybridConfig, tp: int) -> None:
    """Raise ValueError for sizes the ranks would reject: heads or d_ff not divisible by ``tp``,
    or a head dim the kernels do not support. Both demos call it before any process, process
    group or device mesh exists, so a bad size fails at once with one error."""
    from sparsetp.kernels.launch import check_head_dim  # noqa: PLC0415 (imports Triton)

    check_tp_size(cfg, tp)
    check_head_dim(cfg.head_dim, f"d_model={cfg.d_model} / num_heads={cfg.num_heads}")


# ---------------------------------------------------------------------------------------------
# torch


def _on_gpu(args: DemoArgs) -> bool:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no CUDA device")
    return args.device != "cpu" and torch.cuda.is_available()


def _torch_main(args: DemoArgs) -> int:
    import torch.multiprocessing as tmp

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    on_gpu = _on_gpu(args)
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if args.tp is not None and args.tp != world:
            raise ValueError(f"--tp={args.tp} but torchrun started WORLD_SIZE={world} processes")
        args = dataclasses.replace(args, tp=world).with_defaults(on_gpu)
        validate(args.config(), world)  # before any process group exists
        return _torch_worker(int(os.environ["RANK"]), args, None)

    if args.tp is None:
        import torch
        args = dataclasses.replace(args, tp=torch.cuda.device_count() if on_gpu else 4)
    args = args.with_defaults(on_gpu)
    validate(args.config(), args.tp)  # fail in the parent, before spawning
    if on_gpu:
        import torch
        if args.tp > torch.cuda.device_count():
            raise ValueError(f"--tp={args.tp} but only {torch.cuda.device_count()} GPUs")
    port = _free_port()
    ctx = tmp.spawn(_spawned, args=(args, port), nprocs=args.tp, join=False)
    # Ranks report their failure through the exception join() raises; a failed check makes
    # rank 0 exit with status 1, which join() also reports.
    try:
        while not ctx.join():
            pass
    except tmp.ProcessExitedException as e:
        if e.exit_code == 1 and e.error_index == 0:
            return 1
        raise
    return 0


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, args: DemoArgs, port: int) -> None:
    code = _torch_worker(rank, args, port)
    if code:
        sys.exit(code)


def _torch_worker(rank: int, args: DemoArgs, port: int | None) -> int:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from sparsetp.backends.torch.block import TORCH_DTYPES, HybridBlock
    from sparsetp.backends.torch.comm import all_gather_dim

    on_gpu = _on_gpu(args)
    if on_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    backend = "nccl" if on_gpu else "gloo"
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=600),
                            **({"device_id": device} if on_gpu else {}))
    try:
        cfg = args.config()
        dtype = TORCH_DTYPES[cfg.dtype]
        params = init_params(cfg, args.seed)
        block = HybridBlock.from_params(cfg, params, device=device)
        layout = make_layout(cfg.pattern, args.seq_len, cfg.num_heads, cfg.block_size)
        shape = (args.batch, args.seq_len, cfg.d_model)
        errors = {"y": 0.0, "dx": 0.0, "dparams": 0.0}
        worst_param = ""
        step_times = []
        oracle_s = 0.0
        bar = tqdm(range(args.steps), desc=f"fwd+bwd (tp={args.tp})", disable=rank != 0,
                   file=sys.stdout)
        for step in bar:
            rng = np.random.default_rng((args.seed, step))  # the same draws on every rank
            x = rng.standard_normal(shape)
            dy = rng.standard_normal(shape)
            block.zero_grad(set_to_none=True)
            xt = torch.tensor(x, dtype=dtype, device=device, requires_grad=True)
            dyt = torch.tensor(dy, dtype=dtype, device=device)
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            y = block(xt)
            y.backward(dyt)
            _sync(device)
            step_times.append(time.perf_counter() - t0)
            # Gather the parameter grads (a collective) and check on rank 0 only.
            grads = {}
            for name, p in block.named_parameters():
                dim = partition_dim(name)
                g = p.grad.detach()
                grads[name] = (g if dim is None else all_gather_dim(g, dim)).double().cpu()
            if rank == 0:
                t1 = time.perf_counter()
                y_ref, dx_ref, g_ref = reference.hybrid_block_value_and_grad(params, x, cfg, dy)
                oracle_s += time.perf_counter() - t1
                errors["y"] = max(errors["y"], _scaled_err(y, y_ref))
                errors["dx"] = max(errors["dx"], _scaled_err(xt.grad, dx_ref))
                for name, g in grads.items():
                    e = _scaled_err(g, g_ref[name])
                    if e >= errors["dparams"]:
                        errors["dparams"], worst_param = e, name
        bar.close()
        local_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
        all_bytes = [None] * args.tp
        dist.all_gather_object(all_bytes, local_bytes)
        ok = True
        if rank == 0:
            tol = TOLERANCE[cfg.dtype]
            ok = all(e <= tol for e in errors.values())
            full_bytes = sum(int(np.prod(s)) for s in param_shapes(cfg).values()) * (
                torch.tensor([], dtype=dtype).element_size())
            _print_table(args, cfg, layout, backend, device, step_times, oracle_s, errors,
                         worst_param, tol, ok, all_bytes, full_bytes)
        dist.barrier()  # before teardown: gloo aborted 1 in 4 teardowns without it
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def _sync(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)


def _scaled_err(got, want) -> float:
    """max|got - want| / max(1, max|want|) (float64)."""
    import torch
    if isinstance(got, torch.Tensor):
        got = got.detach().double().cpu().numpy()
    want = np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def _print_table(args, cfg, layout, backend, device, step_times, oracle_s, errors, worst_param,
                 tol, ok, all_bytes, full_bytes) -> None:
    import torch
    tp = args.tp
    later = step_times[1:] or step_times
    rows = [
        ("backend", f"torch {torch.__version__}, TP={tp} over {backend} on {device.type}"
                    + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
                       else "")),
        ("sizes", f"B={args.batch} N={args.seq_len} d_model={cfg.d_model} "
                  f"heads={cfg.num_heads} ({cfg.num_heads // tp}/rank, head_dim={cfg.head_dim}) "
                  f"d_ff={cfg.d_ff} ({cfg.d_ff // tp}/rank) dtype={cfg.dtype}"),
        ("pattern", args.pattern_description()),
        ("layout", f"block {cfg.block_size}: {layout.nnz_blocks} of {layout.block_mask.size} "
                   f"tiles computed, density {layout.density:.3f}"),
        ("steps", f"{len(step_times)} x fwd+bwd: first {step_times[0] * 1e3:.1f} ms, then "
                  f"{np.median(later) * 1e3:.1f} ms/step (median); oracle {oracle_s:.2f} s"),
        ("max error vs fp64", f"y {errors['y']:.2e}  dx {errors['dx']:.2e}  dparams "
                              f"{errors['dparams']:.2e} ({worst_param})"),
        ("check", f"{'PASS' if ok else 'FAIL'} (scaled max error <= {tol:g} for {cfg.dtype})"),
        ("params / rank", "  ".join(f"r{r}: {_kib(b)}" for r, b in enumerate(all_bytes))
                          + f"  (unsharded {_kib(full_bytes)})"),
    ]
    width = max(len(k) for k, _ in rows)
    print("sparsetp demo: tensor-parallel HybridBlock vs the float64 oracle of the whole block")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    sys.stdout.flush()
