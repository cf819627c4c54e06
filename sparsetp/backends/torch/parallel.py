"""Data x tensor parallelism for torch: process set-up, a 2-D ``("dp", "tp")`` DeviceMesh, DDP.

A job of ``world = dp * tp`` ranks is laid out as a ``dp x tp`` grid, ``tp`` innermost: ranks
``[i * tp, (i + 1) * tp)`` form data replica ``i``'s tensor-parallel group, so with torchrun's
consecutive ranks per node a TP group stays inside one node (NVLink) whenever ``tp`` divides the
GPUs per node, and only the data-parallel gradient all-reduce crosses nodes::

    info = init_distributed()                        # torchrun's env; nccl on CUDA, gloo on CPU
    mesh = make_device_mesh(dp=2, tp=4, config=cfg, global_batch=16)
    blocks = nn.Sequential(*(HybridBlock(cfg, mesh["tp"].get_group(), seed=i) for i in range(n)))
    model = data_parallel(blocks, mesh)              # DDP over mesh["dp"]
    x_local = shard_batch(x_global, mesh)            # this replica's B / dp sequences
    loss = ((model(x_local) - t_local) ** 2).mean()  # a mean over the local batch
    loss.backward()                                  # grads = the single-process model's

**DDP, not FSDP2**, over the ``dp`` dim:

* The tensor-parallel parameters are plain tensors holding this rank's shard (the layers split
  them by hand, ``core.config.partition_dim``), not DTensors. FSDP2's ``fully_shard`` replaces
  every parameter by a DTensor sharded over its mesh, and composes with TP only when the TP
  shards are DTensors themselves. On a HybridBlock over 2 gloo ranks (torch 2.13) forward and
  backward run, but ``export_params`` fails (".numpy() is not supported for tensor
  subclasses") and so does ``load_params`` ("aten.copy_.default got mixed torch.Tensor and
  DTensor"): everything that reads or writes the canonical parameters outside forward, which
  the GPT's checkpoints build on. DDP leaves the module as it is: each ``dp`` rank keeps its TP
  shard whole and only the gradients are all-reduced.
* One code path on gloo (CPU tests, torch 2.13) and NCCL (the GPU machine, torch 2.11): DDP's
  ``process_group=`` API and gradient bucketing are the same in both releases; FSDP2 moved
  (``torch.distributed._composable.fsdp`` -> ``torch.distributed.fsdp`` in 2.6) and still
  changes between releases.
* ``torch.compile``: the compiler supports DDP (``torch._dynamo.config.optimize_ddp`` splits the
  graph at the gradient buckets so the all-reduces overlap backward); the TP autograd Functions
  keep their own compile rule (``comm.TRACES_FUNCTIONS``). DDP x TP under compile is not
  tested here.
* The cost: every ``dp`` rank holds a full replica of its TP shard (parameters, gradients,
  optimizer state), i.e. ``1 / tp`` of the model. When that no longer fits, FSDP2 over ``dp``
  needs the TP parameters as DTensors first (a separate change).

Gradients: DDP *averages* over ``dp``. With a loss that is a mean over the local batch and
``dp`` equal local batches, that average is exactly the gradient of the mean over the global
batch, i.e. the single-process model's (up to the order of the float sums).

Failures: the process groups made here carry a timeout (``init_distributed(timeout_s=...)``,
default 300 s; ``make_device_mesh`` gives its sub-groups the default group's, where torch would
give them its own 30 minutes). A rank that dies makes its peers' gloo collectives fail at once
(the TCP connection closes), a stalled one after the timeout; TP collectives raise
``comm.CollectiveError`` and DDP's gradient all-reduce raises one too (through the comm hook
:func:`data_parallel` installs), naming the collective, the group and the rank. On NCCL the
watchdog enforces the timeout (BUILD.md, "Timeouts"). Under torchrun, a rank exiting with an
error makes the agent stop the others.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sparsetp.backends.torch.comm import CollectiveError, _failed
from sparsetp.core.config import HybridConfig, check_tp_size

__all__ = ["DistInfo", "init_distributed", "make_device_mesh", "data_parallel", "shard_batch",
           "check_parallel_sizes", "CollectiveError", "DP", "TP"]

DP, TP = "dp", "tp"  # the mesh's dim names, outermost first

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its global and node-local rank, the world size, its device and
    the process-group backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _positive_seconds(name: str, value) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value < float("inf")):
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def init_distributed(backend: str | None = None, *, timeout_s: float = 300.0,
                     env: Mapping[str, str] | None = None) -> DistInfo:
    """Initialise ``torch.distributed`` from the environment torchrun sets; returns a DistInfo.

    Works unchanged single-node (``torchrun --nproc-per-node=8 ...``) and multi-node
    (``torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500``):
    it reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Without
    them (plain ``python``) it starts a one-process group, so the same script runs alone.

    Args:
      backend: ``"nccl"`` or ``"gloo"``; None picks nccl when CUDA is available (each rank then
        uses GPU ``LOCAL_RANK``, set before the group starts so NCCL binds to it) and gloo
        otherwise (CPU ranks).
      timeout_s: the process group's timeout: a collective waiting longer for a peer fails
        instead of hanging (``comm.CollectiveError``; on NCCL the watchdog, see BUILD.md).
      env: where to read the variables (default ``os.environ``).

    Already initialised: returns the current group's DistInfo and changes nothing.

    >>> info = init_distributed()          # under torchrun, or one process  # doctest: +SKIP
    >>> info.rank, info.world_size, info.backend                             # doctest: +SKIP
    (0, 1, 'gloo')
    """
    env = os.environ if env is None else env
    timeout_s = _positive_seconds("timeout_s", timeout_s)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which torch does not see; use 'gloo'")
    present = [v for v in _TORCHRUN_VARS if v in env]
    if present and len(present) != len(_TORCHRUN_VARS):
        missing = sorted(set(_TORCHRUN_VARS) - set(present))
        raise ValueError(f"the environment sets {present} but not {missing}; launch with "
                         "torchrun (it sets all of them) or set none for one process")
    local_rank = int(env.get("LOCAL_RANK", 0))
    if backend == "nccl" and local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} visible "
            "GPU(s): start at most that many processes per node (torchrun --nproc-per-node), "
            "or run the ranks on CPU with backend='gloo' (or CUDA_VISIBLE_DEVICES='')")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        device_kw = {"device_id": device} if backend == "nccl" else {}
        if present:
            dist.init_process_group(backend, init_method="env://", timeout=timeout,
                                    rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                                    **device_kw)
        else:  # one process: an in-memory store, no port to pick
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout, **device_kw)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=local_rank, device=device, backend=dist.get_backend())


def check_parallel_sizes(dp: int, tp: int, *, world_size: int | None = None,
                         config: HybridConfig | None = None,
                         global_batch: int | None = None) -> None:
    """ValueError naming the argument unless ``dp x tp`` fits: both positive ints, ``dp * tp ==
    world_size`` (when given), ``tp`` dividing ``config``'s ``num_heads``, ``num_kv_heads`` and
    ``d_ff`` (:func:`sparsetp.core.config.check_tp_size`), ``dp`` dividing ``global_batch``.
    Needs no process group, so a launcher can call it before starting any."""
    for name, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if config is not None:
        if not isinstance(config, HybridConfig):
            raise ValueError(f"config must be a HybridConfig, got {type(config).__name__}")
        check_tp_size(config, tp)
    if global_batch is not None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
        if global_batch % dp:
            raise ValueError(f"global_batch={global_batch} is not divisible by the data-parallel "
                             f"size dp={dp}: every replica needs the same number of sequences")
    if world_size is not None and dp * tp != world_size:
        raise ValueError(f"dp * tp = {dp} * {tp} = {dp * tp} must equal the world size "
                         f"{world_size} (torchrun: --nnodes x --nproc-per-node)")


def _default_timeout() -> datetime.timedelta | None:
    """The default group's timeout; None where this torch does not expose it (private API)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


def make_device_mesh(dp: int, tp: int, *, config: HybridConfig | None = None,
                     global_batch: int | None = None,
                     timeout_s: float | None = None) -> DeviceMesh:
    """The 2-D DeviceMesh ``(dp, tp)`` with dim names ``("dp", "tp")``, tp innermost.

    Rank ``r`` sits at ``(r // tp, r % tp)``: its TP group is ``mesh["tp"].get_group()`` (pass it
    to ``HybridBlock``), its data-parallel group ``mesh["dp"].get_group()`` (what
    :func:`data_parallel` reduces over). A collective: every rank calls it, with the same sizes.

    Args:
      dp, tp: the data- and tensor-parallel sizes; ``dp * tp`` must be the world size.
      config: if given, ``tp`` must divide its ``num_heads``, ``num_kv_heads`` and ``d_ff``.
      global_batch: if given, ``dp`` must divide it.
      timeout_s: the sub-groups' timeout; None takes the default group's (torch's ``new_group``
        would otherwise give them its 30-minute default, whatever ``init_process_group`` got).

    Raises ValueError naming the argument (checked before any group is created, the same on
    every rank), or when ``torch.distributed`` is not initialised.

    >>> mesh = make_device_mesh(2, 2)        # 4 ranks                       # doctest: +SKIP
    >>> mesh["tp"].size(), mesh.get_local_rank("dp")                         # doctest: +SKIP
    (2, 1)
    """
    check_parallel_sizes(dp, tp, config=config, global_batch=global_batch)
    if not dist.is_initialized():
        raise ValueError("make_device_mesh needs torch.distributed initialised; call "
                         "init_distributed() first")
    check_parallel_sizes(dp, tp, world_size=dist.get_world_size())
    timeout = (_default_timeout() if timeout_s is None
               else datetime.timedelta(seconds=_positive_seconds("timeout_s", timeout_s)))
    grid = torch.arange(dp * tp).reshape(dp, tp)
    rank = dist.get_rank()
    # new_group is collective over the whole world: every rank creates every group, in the same
    # order, and keeps the ones it belongs to. (init_device_mesh would do the same, but without
    # passing our timeout to the sub-groups.)
    mine = {}
    for dim, rows in ((DP, grid.T), (TP, grid)):
        for ranks in rows.tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[dim] = group
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return DeviceMesh.from_group([mine[DP], mine[TP]], device_type, mesh=grid,
                                 mesh_dim_names=(DP, TP))


def _check_mesh(mesh) -> None:
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names != (DP, TP):
        raise ValueError(f"mesh must be a DeviceMesh with dims {(DP, TP)} "
                         f"(make_device_mesh), got {mesh!r}")


def shard_batch(batch: torch.Tensor, mesh: DeviceMesh, dim: int = 0) -> torch.Tensor:
    """This data replica's contiguous slice of a global ``batch`` (the same on every rank)
    along ``dim``: replica ``i`` of ``dp`` gets ``[i * B / dp, (i + 1) * B / dp)``. The ranks of
    one TP group get the same slice. ValueError naming ``batch`` unless ``dp`` divides it.

    >>> shard_batch(torch.randn(8, 128, 64), mesh).shape   # dp=2   # doctest: +SKIP
    torch.Size([4, 128, 64])
    """
    _check_mesh(mesh)
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        raise ValueError(f"batch must be a tensor with a batch dim, got "
                         f"{getattr(batch, 'shape', type(batch).__name__)}")
    dp = mesh[DP].size()
    b = batch.shape[dim]
    if b % dp:
        raise ValueError(f"batch has {b} sequences along dim {dim}, not divisible by the "
                         f"data-parallel size dp={dp}")
    per = b // dp
    return batch.narrow(dim, mesh.get_local_rank(DP) * per, per)


def _comm_hook(group, bucket):
    """DDP's gradient all-reduce (average over ``group``) whose failures raise CollectiveError
    naming it, instead of the backend's bare message from inside DDP's reducer."""
    name = "DDP gradient all_reduce (dp)"
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    try:
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    except RuntimeError as err:
        raise _failed(name, group, err) from err

    def done(f):
        try:
            return f.value()[0]
        except RuntimeError as err:
            raise _failed(name, group, err) from err

    return fut.then(done)


def data_parallel(module: nn.Module, mesh: DeviceMesh, **ddp_kwargs) -> nn.Module:
    """``module`` wrapped in DistributedDataParallel over ``mesh["dp"]`` (see the module
    docstring for why DDP and not FSDP2).

    Any ``nn.Module`` works; its tensor-parallel layers must already use ``mesh["tp"]``'s group.
    A ``HybridBlock`` (or layer) anywhere inside on another group or TP size raises ValueError.
    DDP broadcasts each rank's parameters from the first rank of its ``dp`` group (the ranks
    holding the same TP shard) and averages gradients over ``dp`` in backward; its all-reduce
    failures raise :class:`~sparsetp.backends.torch.comm.CollectiveError`. ``ddp_kwargs`` go to
    ``DistributedDataParallel`` (``device_ids`` defaults to the parameters' GPU).

    >>> model = data_parallel(nn.Sequential(HybridBlock(cfg, mesh["tp"].get_group())), mesh)
    ... # doctest: +SKIP
    """
    _check_mesh(mesh)
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    tp_group, tp = mesh[TP].get_group(), mesh[TP].size()
    for name, sub in module.named_modules():
        group = getattr(sub, "group", None)
        world = getattr(sub, "world_size", None)
        # group None is the default group: right only when it is the TP group (dp = 1).
        if world is not None and (world != tp or (tp > 1 and group not in (None, tp_group))):
            raise ValueError(f"module's {name or 'root'} ({type(sub).__name__}) is tensor-parallel "
                             f"over a group of {world} ranks, not mesh['tp'] ({tp} ranks); build "
                             "it with group=mesh['tp'].get_group()")
    params = list(module.parameters())
    if not params:
        raise ValueError("module has no parameters to train data-parallel")
    device = params[0].device
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device])
    ddp = nn.parallel.DistributedDataParallel(module, process_group=mesh[DP].get_group(),
                                              **ddp_kwargs)
    if mesh[DP].size() > 1:
        ddp.register_comm_hook(mesh[DP].get_group(), _comm_hook)
    return ddp

