"""The pre-norm hybrid block (block-sparse attention + MLP) with Megatron tensor parallelism.

``y1 = x + Attn(LN1(x)); y = y1 + MLP(LN2(y1))``: attention heads and the MLP hidden width are
split over the tensor-parallel ``group`` (two all-reduces forward, two backward); layer norms
and the row-parallel output biases are replicated. Parameter names are the canonical names of
:mod:`sparsetp.core.config` (``block.named_parameters()`` yields ``attn.qkv.weight`` ...), each
holding this rank's shard as described by ``sparsetp.core.partition_dim``.

With ``sequence_parallel=True`` (Megatron-LM's sequence parallelism) the block's input and output
are sequence shards ``[B, N / tp, d]`` (rank ``r`` holds tokens ``[r N / tp, (r + 1) N / tp)``):
layer norms and residuals run on the shard, each parallel region opens with an all-gather and
closes with a reduce-scatter (two of each forward and backward instead of two all-reduces each
way), and the gradients of the replicated parameters (layer norms, row-parallel biases) are
all-reduced in backward, together in one call, so every rank's ``.grad`` is the full gradient,
as without SP.

>>> from sparsetp.core import HybridConfig, init_params, patterns as P
>>> cfg = HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=P.causal(), block_size=32)
>>> block = HybridBlock.from_params(cfg, init_params(cfg, seed=0))   # single process
>>> sorted(block.export_params()) == sorted(init_params(cfg, seed=0))
True
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sparsetp.backends.torch.comm import all_gather_dim, copy_many_to_region, group_size
from sparsetp.backends.torch.layers import (
    ParallelMLP,
    ParallelSparseAttention,
    _as_tensor,
    _poison,
)
from sparsetp.core.config import (
    HybridConfig,
    check_seed,
    check_tp_size,
    init_params,
    param_shapes,
    partition_dim,
)

__all__ = ["HybridBlock", "TORCH_DTYPES"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "float64": torch.float64}


def _grad_of(name: str, p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        raise ValueError(f"{name} has no gradient: run backward first")
    return p.grad


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host copy; bfloat16 (no numpy dtype) as float32, which is exact."""
    return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy().copy()


class HybridBlock(nn.Module):
    """Pre-norm transformer block with block-sparse attention, tensor-parallel over ``group``.

    Args:
      config: sizes, pattern and dtype (parameters are created in ``config.dtype``).
      group: process group (None: the default group if torch.distributed is initialised, else
        a single process).
      seed: parameters are ``init_params(config, seed)`` (the canonical draw, so every TP size
        and the JAX frontend start from the same weights), a non-negative int; None skips the
        draw (for :meth:`load_params` next, as :meth:`from_params` does): every parameter is
        NaN until loaded. (``init_params`` itself refuses None: ``core.config.check_seed``.)
      device: where the parameters live.
      overlap_comm: overlap each column-parallel layer's backward all-reduce with its
        weight-gradient GEMM (bitwise the same numbers; see ``layers.ColumnParallelLinear``)
        and each layer's forward collective with its GEMM as ``comm_chunks`` says.
      comm_chunks: collective matmuls in every linear (``layers.RowParallelLinear``,
        ``layers.forward_chunks``): None (auto: where a layer's GEMM is large enough to
        gain), or a positive int; 1 is bitwise the plain schedule, more pieces equal it within
        the dtype's rounding.
      sequence_parallel: input and output are this rank's sequence shard (below).

    Raises ValueError when ``num_heads``, ``num_kv_heads`` or ``d_ff`` is not divisible by the
    group size. Calling it with an ``x`` of another dtype than the parameters (outside
    ``torch.autocast``) or on another device (the meta device included) raises ValueError
    naming ``x``.
    Input ``x [B, N, d_model]`` (the same on every rank), output ``[B, N, d_model]``. With
    ``sequence_parallel``: input ``[B, N / tp, d_model]``, this rank's contiguous tokens of the
    ``N``-token sequence the attention sees, output the same tokens of the block's output. To
    go from a replicated ``x`` and back (autograd-aware)::

        x_shard = scatter_to_sequence_region(x, group)   # ValueError unless tp divides N
        y = gather_from_sequence_region(block(x_shard), group)
    """

    def __init__(self, config: HybridConfig, group=None, *, seed: int | None = 0,
                 device=None, overlap_comm: bool = True, sequence_parallel: bool = False,
                 comm_chunks: int | None = None):
        super().__init__()
        if not isinstance(config, HybridConfig):
            raise ValueError(f"config must be a HybridConfig, got {type(config).__name__}")
        seed = check_seed(seed, allow_none=True)
        self.config, self.group = config, group
        self.world_size = group_size(group)
        self.sequence_parallel = bool(sequence_parallel)
        check_tp_size(config, self.world_size)
        dtype = TORCH_DTYPES[config.dtype]
        d = config.d_model
        kw = dict(group=group, dtype=dtype, device=device, seed=None, overlap_comm=overlap_comm,
                  sequence_parallel=self.sequence_parallel, comm_chunks=comm_chunks)
        self.ln1 = nn.LayerNorm(d, eps=config.norm_eps, dtype=dtype, device=device)
        self.attn = ParallelSparseAttention(d, config.num_heads, config.pattern,
                                            config.block_size, config.bias,
                                            num_kv_heads=config.num_kv_heads, **kw)
        self.ln2 = nn.LayerNorm(d, eps=config.norm_eps, dtype=dtype, device=device)
        self.mlp = ParallelMLP(d, config.d_ff, config.bias, **kw)
        if seed is not None:
            self.load_params(init_params(config, seed))
        else:
            _poison(self)

    @classmethod
    def from_params(cls, config: HybridConfig, params: Mapping[str, object], group=None, *,
                    device=None, overlap_comm: bool = True,
                    sequence_parallel: bool = False,
                    comm_chunks: int | None = None) -> HybridBlock:
        """A block holding this rank's shards of the canonical UNSHARDED ``params``."""
        block = cls(config, group, seed=None, device=device, overlap_comm=overlap_comm,
                    sequence_parallel=sequence_parallel, comm_chunks=comm_chunks)
        block.load_params(params)
        return block

    @torch.no_grad()
    def load_params(self, params: Mapping[str, object]) -> None:
        """Load canonical unsharded parameters (numpy or torch), keeping this rank's shards."""
        shapes = param_shapes(self.config)
        if set(params) != set(shapes):
            raise ValueError(
                f"params must hold exactly {sorted(shapes)}; missing "
                f"{sorted(set(shapes) - set(params))}, unexpected "
                f"{sorted(set(params) - set(shapes))}")
        full = {}
        for name, shape in shapes.items():
            t = _as_tensor(params[name], name)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
            full[name] = t
        for ln in ("ln1", "ln2"):
            getattr(self, ln).weight.copy_(full[f"{ln}.weight"])
            getattr(self, ln).bias.copy_(full[f"{ln}.bias"])
        for name, lin in (("attn.qkv", self.attn.qkv), ("attn.out", self.attn.out),
                          ("mlp.fc1", self.mlp.fc1), ("mlp.fc2", self.mlp.fc2)):
            lin.load_unsharded(full[f"{name}.weight"], full.get(f"{name}.bias"))

    @torch.no_grad()
    def export_params(self) -> dict[str, np.ndarray]:
        """The canonical UNSHARDED parameters as numpy arrays, gathered from every rank.

        A collective: every rank of the group must call it. float32/float16/float64 parameters
        come back in their dtype; bfloat16 (no numpy dtype) as float32, which is exact. So
        ``from_params(cfg, p).export_params()`` returns ``p`` bitwise when ``p`` is already
        representable in ``config.dtype``.
        """
        return self._export(lambda name, p: p)

    @torch.no_grad()
    def export_grads(self) -> dict[str, np.ndarray]:
        """The parameters' gradients (``.grad``) in canonical UNSHARDED form, gathered like
        :meth:`export_params` (a collective; the same dtypes). Replicated parameters give this
        rank's own gradient. ValueError naming the parameter if one has no gradient yet."""
        return self._export(_grad_of)

    def _export(self, pick) -> dict[str, np.ndarray]:
        """``pick(name, parameter)`` of every canonical parameter, TP shards gathered."""
        own = dict(self.named_parameters())
        out = {}
        for name in param_shapes(self.config):
            t = pick(name, own[name]).detach()
            dim = partition_dim(name)
            if dim is not None:
                t = all_gather_dim(t, dim, self.group)
            out[name] = _to_numpy(t)
        return out

    def _check_input(self, x) -> None:
        """The block's input checks, in one place: a clear ValueError naming ``x`` instead of
        torch's "mixed dtype (CPU)" or a device error from deep inside a layer."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(f"x must be [B, N, d_model={self.config.d_model}], got "
                             f"{tuple(x.shape)}")
        p = self.ln1.weight
        if x.device != p.device:
            raise ValueError(f"x is on {x.device} but the block's parameters are on {p.device}; "
                             f"move x there (x.to({str(p.device)!r})) or the block to x's device")
        if x.dtype != p.dtype and not torch.is_autocast_enabled(x.device.type):
            raise ValueError(f"x has dtype {x.dtype} but the block's parameters are {p.dtype} "
                             f"(config.dtype={self.config.dtype!r}); cast x with "
                             f"x.to({p.dtype})")

    def forward(self, x: torch.Tensor, document_lengths=None) -> torch.Tensor:
        """The block on ``x``; ``document_lengths`` (optional): packed documents of this call,
        one list of lengths for every batch row or one list per row, each summing to ``N``
        (all ``N`` tokens, also under sequence parallelism): attention then runs
        ``P.documents(document_lengths) & config.pattern``, as the float64 oracle's
        ``reference.hybrid_block(..., document_lengths)``.

        >>> y = block(x, document_lengths=[[40, 24], [64]])     # doctest: +SKIP
        """
        self._check_input(x)
        if not self.sequence_parallel:
            y1 = x + self.attn(self.ln1(x), document_lengths=document_lengths)
            return y1 + self.mlp(self.ln2(y1))
        (w1, b1, w2, b2), out_bias, fc2_bias = self._synced_replicas()
        h = F.layer_norm(x, self.ln1.normalized_shape, w1, b1, self.ln1.eps)
        y1 = x + self.attn(h, document_lengths=document_lengths, synced_bias=out_bias)
        h = F.layer_norm(y1, self.ln2.normalized_shape, w2, b2, self.ln2.eps)
        return y1 + self.mlp(h, synced_bias=fc2_bias)

    def _synced_replicas(self):
        """The replicated parameters under SP, through one :func:`.copy_many_to_region`.

        Each rank normalises and adds the row layers' biases to its own tokens only, so these
        parameters' gradients are partial sums over N / tp tokens. One all-reduce at the end of
        backward (instead of one per parameter) makes every rank's .grad the full sum, so
        replicas stay equal with no extra call after backward (Megatron instead all-reduces
        them in its training loop). F.layer_norm is what nn.LayerNorm computes."""
        lns = [self.ln1.weight, self.ln1.bias, self.ln2.weight, self.ln2.bias]
        biases = [self.attn.out.bias, self.mlp.fc2.bias]
        if biases[0] is None:  # config.bias=False: no row-parallel biases
            return tuple(copy_many_to_region(lns, self.group)), None, None
        got = copy_many_to_region(lns + biases, self.group)
        return tuple(got[:4]), got[4], got[5]
