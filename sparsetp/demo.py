"""The main job: a tensor-parallel HybridBlock checked against the float64 oracle (torch side),
and what the torch and JAX demos share.

``python -m sparsetp demo --backend torch --tp 4`` spawns 4 processes itself;
``torchrun --nproc_per_node 4 -m sparsetp demo --backend torch`` runs the same thing in processes
torchrun started. Each run builds ``HybridBlock.from_params(cfg, init_params(cfg, seed))`` with a
BigBird pattern, runs a few forward+backward steps on fresh random inputs and random cotangents,
compares every step's output, input gradient and (gathered) parameter gradients with
:func:`sparsetp.core.reference.hybrid_block_grad` of the whole unsharded block, and prints a
short table. It exits non-zero when a check fails.

Modules: this one holds :class:`DemoArgs`, the device rule, the tolerances and the table, plus
the torch demo (:func:`main`); :mod:`sparsetp.backends.jax.demo` is the JAX demo and imports
them from here; ``sparsetp.__main__`` dispatches ``--backend`` (this module imports no JAX).

Device rule (:func:`choose_device`, both backends; ``--device auto``, the default): with at least
``tp`` GPUs visible to the framework, ``tp`` GPUs (torch: one NCCL process per GPU; JAX: a mesh of
``tp`` GPUs) and compiled Triton kernels; otherwise ``tp`` CPU workers (torch: ``tp`` gloo
processes; JAX: ``tp`` CPU host devices) and the native CPU path, so ``--tp 4`` on a machine
with one GPU runs on CPU, and says so. ``--tp`` unset: one per GPU if there is a GPU, else 4 on
CPU. ``--device cuda`` insists on ``tp`` GPUs (an error with fewer); ``--device cpu`` always runs
on CPU. The table's ``device`` and ``kernels`` rows say what ran and why.

Defaults fit a 2-core CPU: B=1, N=256, d=64, 4 heads, d_ff=256,
32-token blocks, float32. On GPUs: B=1, N=1024, d=512, 8 heads, d_ff=2048, 64-token blocks (the
float64 oracle of the whole block, dense O(N^2) numpy, stays a few seconds per step at that size;
at N=2048 it is ~4x that).

Example::

    >>> from sparsetp import demo
    >>> demo.choose_device("auto", 4, n_gpus=1, framework="torch").device
    'cpu'
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time

import numpy as np

from sparsetp import _runtime
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

__all__ = ["DemoArgs", "Placement", "choose_device", "kernels_path", "main", "validate",
           "scaled_error", "kib", "print_table", "common_rows", "TOLERANCE"]

# Scaled max error max|got - want| / max(1, max|want|) allowed per parameter dtype. float32:
# O(1) values, reductions <= a few thousand long with IEEE (not TF32) dots -> errors ~1e-6, so 1e-4
# leaves margin yet catches any real bug (O(0.1-1)); half precisions keep ~3 (bf16) / ~4 (fp16)
# significant digits through two residual layers.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}

CPU_TP = 4  # --tp unset and no GPU: 4 CPU workers

_CPU_DEFAULTS = dict(batch=1, seq_len=256, d_model=64, num_heads=4, d_ff=256, block_size=32,
                     dtype="float32")
_GPU_DEFAULTS = dict(batch=1, seq_len=1024, d_model=512, num_heads=8, d_ff=2048, block_size=64,
                     dtype="float32")


@dataclasses.dataclass(frozen=True)
class DemoArgs:
    """What the demo runs; None fields take the CPU or GPU default (see the module docstring).

    ``tp=None``: ``WORLD_SIZE`` under torchrun, else one per GPU, or 4 on CPU.
    ``device``: "auto" (GPUs when there are ``tp`` of them, else CPU), "cpu" or "cuda".
    ``pg_timeout_s``: the torch process group's timeout (``--pg_timeout_s``, default 300 s).
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
    # torch's process-group timeout (seconds): a rank stalled this long in a collective makes
    # the others raise (comm.CollectiveError naming the collective) instead of hanging the job.
    pg_timeout_s: float = 300.0

    def __post_init__(self):
        if self.backend not in ("torch", "jax"):
            raise ValueError(f"backend must be 'torch' or 'jax', got {self.backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if (isinstance(self.pg_timeout_s, bool) or not isinstance(self.pg_timeout_s, (int, float))
                or not 0 < self.pg_timeout_s < float("inf")):
            raise ValueError(f"pg_timeout_s must be a finite number of seconds > 0, got "
                             f"{self.pg_timeout_s!r}")
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


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a demo runs: ``device`` "cuda" or "cpu", ``tp`` workers, and ``reason`` (why)."""

    device: str
    tp: int
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


def choose_device(requested: str, tp: int | None, n_gpus: int, framework: str) -> Placement:
    """The device rule of the module docstring, for ``n_gpus`` GPUs visible to ``framework``.

    Raises ValueError/RuntimeError when ``requested == "cuda"`` cannot be honoured.

    >>> choose_device("auto", None, n_gpus=2, framework="torch")
    Placement(device='cuda', tp=2, reason='one worker per GPU (--tp unset; torch sees 2 GPUs)')
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    seen = f"{framework} sees {n_gpus} GPU{'s' if n_gpus != 1 else ''}"
    if requested == "cpu":
        return Placement("cpu", tp or CPU_TP, "--device cpu")
    if requested == "cuda":
        if n_gpus == 0:
            raise RuntimeError(f"--device cuda but {seen}")
        if tp is not None and tp > n_gpus:
            raise ValueError(f"--tp={tp} with --device cuda needs {tp} GPUs; {seen}")
        return Placement("cuda", tp or n_gpus, f"--device cuda; {seen}")
    if n_gpus == 0:
        return Placement("cpu", tp or CPU_TP, f"auto: {seen}")
    if tp is None:
        return Placement("cuda", n_gpus, f"one worker per GPU (--tp unset; {seen})")
    if tp <= n_gpus:
        return Placement("cuda", tp, f"auto: --tp {tp}, {seen}")
    return Placement("cpu", tp, f"auto: --tp {tp} needs {tp} GPUs, {seen}; {tp} CPU workers "
                                f"instead (--device cuda would refuse)")


def kernels_path(device: str) -> str:
    """How the attention runs on ``device`` ("cuda" or "cpu"): :mod:`sparsetp._runtime`'s
    rule, ``SPARSETP_INTERPRET`` included."""
    kind = _runtime.device_kind(device)
    if kind == "cuda":
        return "compiled Triton kernels on CUDA"
    if kind == "cpu":
        return "the native CPU path (no Triton)"
    where = "CPU" if device == "cpu" else "CUDA tensors"
    return f"Triton's interpreter on {where} (SPARSETP_INTERPRET=1: correctness, not speed)"


def validate(cfg: HybridConfig, tp: int) -> None:
    """Raise ValueError for sizes the ranks would reject: heads or d_ff not divisible by ``tp``,
    or a head dim the kernels do not support. Both demos call it before any process, process
    group or device mesh exists, so a bad size fails at once with one error."""
    from sparsetp.kernels.abi import check_head_dim  # noqa: PLC0415 (imports Triton)

    check_tp_size(cfg, tp)
    check_head_dim(cfg.head_dim, f"d_model={cfg.d_model} / num_heads={cfg.num_heads}")


def scaled_error(got, want) -> float:
    """max|got - want| / max(1, max|want|) (float64); ``got`` numpy, JAX or torch."""
    if hasattr(got, "detach"):  # a torch tensor
        got = got.detach().double().cpu().numpy()
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    """``title`` then one ``  key  value`` line per row, keys aligned; flushed."""
    width = max(len(k) for k, _ in rows)
    print(title)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    sys.stdout.flush()


def common_rows(args: DemoArgs, cfg: HybridConfig, layout, step_times, oracle_s, errors,
                worst_param, tol, ok, per: str, steps_what: str) -> list[tuple[str, str]]:
    """The table rows both demos print after their backend, device and kernels rows."""
    tp = args.tp
    later = step_times[1:] or step_times
    return [
        ("sizes", f"B={args.batch} N={args.seq_len} d_model={cfg.d_model} "
                  f"heads={cfg.num_heads} ({cfg.num_heads // tp}/{per}, head_dim="
                  f"{cfg.head_dim}) d_ff={cfg.d_ff} ({cfg.d_ff // tp}/{per}) dtype={cfg.dtype}"),
        ("pattern", args.pattern_description()),
        ("layout", f"block {cfg.block_size}: {layout.nnz_blocks} of {layout.block_mask.size} "
                   f"tiles computed, density {layout.density:.3f}"),
        ("steps", f"{len(step_times)} x {steps_what}: first {step_times[0] * 1e3:.1f} ms, then "
                  f"{np.median(later) * 1e3:.1f} ms/step (median); oracle {oracle_s:.2f} s"),
        ("max error vs fp64", f"y {errors['y']:.2e}  dx {errors['dx']:.2e}  dparams "
                              f"{errors['dparams']:.2e} ({worst_param})"),
        ("check", f"{'PASS' if ok else 'FAIL'} (scaled max error <= {tol:g} for {cfg.dtype})"),
    ]


# ---------------------------------------------------------------------------------------------
# torch


def _torch_placement(args: DemoArgs, gpus_needed: int | None = None) -> Placement:
    """:func:`choose_device` with torch's GPU count. ``gpus_needed``: the GPUs this machine must
    have for GPU runs (under torchrun: its local processes), when it differs from ``args.tp``."""
    import torch  # noqa: PLC0415

    n_gpus = torch.cuda.device_count()
    if gpus_needed is None:
        return choose_device(args.device, args.tp, n_gpus, "torch")
    p = choose_device(args.device, gpus_needed, n_gpus, "torch")
    return dataclasses.replace(p, tp=args.tp)


def main(args: DemoArgs) -> int:
    """Run the torch demo for ``args``; returns 0 when every check passed (raises on bad input).

    ``--backend jax`` is :func:`sparsetp.backends.jax.demo.main` (``python -m sparsetp demo``
    dispatches)."""
    if args.backend != "torch":
        raise ValueError(f"sparsetp.demo.main runs --backend torch, got {args.backend!r}; the "
                         f"JAX demo is sparsetp.backends.jax.demo.main")
    import torch.multiprocessing as tmp  # noqa: PLC0415

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        world = int(os.environ["WORLD_SIZE"])
        if args.tp is not None and args.tp != world:
            raise ValueError(f"--tp={args.tp} but torchrun started WORLD_SIZE={world} processes")
        args = dataclasses.replace(args, tp=world)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        placement = _torch_placement(args, gpus_needed=local)
        args = args.with_defaults(placement.on_gpu)
        validate(args.config(), world)  # before any process group exists
        return _torch_worker(int(os.environ["RANK"]), args, placement, None)

    placement = _torch_placement(args)
    args = dataclasses.replace(args, tp=placement.tp).with_defaults(placement.on_gpu)
    validate(args.config(), args.tp)  # fail in the parent, before spawning
    print(f"sparsetp demo (torch): TP={args.tp} on {placement.device} ({placement.reason}); "
          f"{kernels_path(placement.device)}", flush=True)
    port = _free_port()
    ctx = tmp.spawn(_spawned, args=(args, placement, port), nprocs=args.tp, join=False)
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
    import socket  # noqa: PLC0415
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, args: DemoArgs, placement: Placement, port: int) -> None:
    code = _torch_worker(rank, args, placement, port)
    if code:
        sys.exit(code)


def _torch_worker(rank: int, args: DemoArgs, placement: Placement, port: int | None) -> int:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    from sparsetp.backends.torch.block import TORCH_DTYPES, HybridBlock  # noqa: PLC0415
    from sparsetp.backends.torch.comm import all_gather_dim  # noqa: PLC0415

    if placement.on_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    backend = "nccl" if placement.on_gpu else "gloo"
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=args.tp,
                            timeout=datetime.timedelta(seconds=args.pg_timeout_s),
                            **({"device_id": device} if placement.on_gpu else {}))
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
                errors["y"] = max(errors["y"], scaled_error(y, y_ref))
                errors["dx"] = max(errors["dx"], scaled_error(xt.grad, dx_ref))
                for name, g in grads.items():
                    e = scaled_error(g, g_ref[name])
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
            name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
            rows = [
                ("backend", f"torch {torch.__version__}, TP={args.tp} over {backend} on "
                            f"{device.type}{name}"),
                ("device", f"{placement.device}: {args.tp} {backend} "
                           f"process{'es' if args.tp > 1 else ''} ({placement.reason})"),
                ("kernels", kernels_path(placement.device)),
                *common_rows(args, cfg, layout, step_times, oracle_s, errors, worst_param, tol,
                             ok, "rank", "fwd+bwd"),
                ("params / rank", "  ".join(f"r{r}: {kib(b)}" for r, b in enumerate(all_bytes))
                                  + f"  (unsharded {kib(full_bytes)})"),
            ]
            print_table("sparsetp demo: tensor-parallel HybridBlock vs the float64 oracle of "
                        "the whole block", rows)
        dist.barrier()  # before teardown: gloo aborted 1 in 4 teardowns without it
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def _sync(device) -> None:
    if device.type == "cuda":
        import torch  # noqa: PLC0415
        torch.cuda.synchronize(device)
