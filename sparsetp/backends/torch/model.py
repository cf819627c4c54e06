"""A GPT of :class:`HybridBlock` s in PyTorch, on the canonical parameters of
:mod:`sparsetp.core.model`.

``logits = LN_f(blocks(embed[tokens] + pos[:N])) @ head``. The blocks are tensor-parallel over
``group`` (Megatron: two all-reduces per block forward, two backward); the embeddings, the final
norm and the head are replicated. Every rank then sees the same block outputs and, in backward,
the same (all-reduced) input gradients, so the replicated parameters get the same gradients on
every rank with no extra collective. ``named_parameters()`` yields the canonical names
(``embed.weight``, ``blocks.0.attn.qkv.weight``, ..., ``head.weight``), each holding this
rank's shard.

>>> from sparsetp.core import GPTConfig, HybridConfig, patterns as P
>>> blk = HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=P.causal(), block_size=16)
>>> cfg = GPTConfig(vocab_size=50, num_layers=2, max_seq_len=64, block=blk)
>>> model = GPT(cfg, seed=0)
>>> model(torch.zeros(2, 64, dtype=torch.int64)).shape
torch.Size([2, 64, 50])
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from sparsetp.backends.torch.block import TORCH_DTYPES, HybridBlock, _grad_of, _to_numpy
from sparsetp.backends.torch.layers import _as_tensor
from sparsetp.core.config import check_seed
from sparsetp.core.model import (
    GPTConfig,
    check_gpt_params,
    check_tokens,
    init_gpt_params,
    join_block_params,
    split_block_params,
)

__all__ = ["GPT", "loss"]


class _Head(nn.Module):
    """The untied output projection, stored ``[d, vocab]`` like the canonical ``head.weight``
    (so ``named_parameters()`` is canonical with no transpose on load or export)."""

    def __init__(self, d: int, vocab: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d, vocab, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class GPT(nn.Module):
    """Decoder-only model of ``config.num_layers`` hybrid blocks.

    Args:
      config: a :class:`~sparsetp.core.model.GPTConfig` (dtype: ``config.block.dtype``).
      group: tensor-parallel process group of the blocks (None: the default group if
        torch.distributed is initialised, else a single process).
      seed: parameters are ``init_gpt_params(config, seed)`` (the canonical draw: every TP size
        and the JAX frontend start from the same weights); None skips the draw (for
        :meth:`load_params` next, as :meth:`from_params` does).
      device: where the parameters live.
      overlap_comm, comm_chunks: passed to every :class:`HybridBlock`.

    ``forward(tokens)`` takes int64 (or int32) ``tokens [B, N]`` (the same on every rank),
    ``N <= max_seq_len``, ids in ``[0, vocab_size)``, and returns float logits
    ``[B, N, vocab_size]`` in the parameters' dtype; anything else raises ValueError naming
    ``tokens``. The id range check reads one flag back from the device (a host sync).
    """

    def __init__(self, config: GPTConfig, group=None, *, seed: int | None = 0, device=None,
                 overlap_comm: bool = True, comm_chunks: int | None = None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
        seed = check_seed(seed, allow_none=True)
        self.config, self.group = config, group
        b = config.block
        dtype = TORCH_DTYPES[b.dtype]
        d, v = b.d_model, config.vocab_size
        self.embed = nn.Embedding(v, d, dtype=dtype, device=device)
        self.pos = nn.Embedding(config.max_seq_len, d, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(
            HybridBlock(b, group, seed=None, device=device, overlap_comm=overlap_comm,
                        comm_chunks=comm_chunks)
            for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(d, eps=b.norm_eps, dtype=dtype, device=device)
        self.head = _Head(d, v, dtype, device)
        if seed is not None:
            self.load_params(init_gpt_params(config, seed))
        else:
            with torch.no_grad():  # unloaded parameters are NaN, never plausible numbers
                for p in self.parameters():
                    p.fill_(float("nan"))

    @classmethod
    def from_params(cls, config: GPTConfig, params: Mapping[str, object], group=None, *,
                    device=None, overlap_comm: bool = True,
                    comm_chunks: int | None = None) -> GPT:
        """A model holding this rank's shards of the canonical UNSHARDED ``params``."""
        model = cls(config, group, seed=None, device=device, overlap_comm=overlap_comm,
                    comm_chunks=comm_chunks)
        model.load_params(params)
        return model

    @torch.no_grad()
    def load_params(self, params: Mapping[str, object]) -> None:
        """Load canonical unsharded parameters (numpy or torch); blocks keep their shards."""
        check_gpt_params(params, self.config)
        outer, blocks = split_block_params(params, self.config)
        for name in outer:
            module, attr = name.split(".")
            getattr(getattr(self, module), attr).copy_(_as_tensor(outer[name], name))
        for block, bp in zip(self.blocks, blocks, strict=True):
            block.load_params(bp)

    @torch.no_grad()
    def export_params(self) -> dict[str, np.ndarray]:
        """The canonical UNSHARDED parameters as numpy arrays (a collective under TP: every
        rank must call it). bfloat16 comes back as float32 (exact), as in
        :meth:`HybridBlock.export_params`."""
        outer = {name: _to_numpy(p.detach()) for name, p in self._outer()}
        return join_block_params(outer, [b.export_params() for b in self.blocks])

    @torch.no_grad()
    def export_grads(self) -> dict[str, np.ndarray]:
        """The gradients in canonical UNSHARDED form, as :meth:`HybridBlock.export_grads`
        (a collective under TP; replicated parameters give this rank's own gradient)."""
        outer = {name: _to_numpy(_grad_of(name, p)) for name, p in self._outer()}
        return join_block_params(outer, [b.export_grads() for b in self.blocks])

    def _outer(self):
        """(canonical name, parameter) of the parameters outside the blocks."""
        for name in ("embed.weight", "pos.weight", "ln_f.weight", "ln_f.bias", "head.weight"):
            module, attr = name.split(".")
            yield name, getattr(getattr(self, module), attr)

    def _check_tokens(self, tokens) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"tokens must be a torch.Tensor of token ids, got "
                             f"{type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be int64 (or int32) token ids, got {tokens.dtype}")
        check_tokens(tuple(tokens.shape), np.int64, self.config)
        if tokens.device != self.embed.weight.device:
            raise ValueError(f"tokens are on {tokens.device} but the model's parameters are on "
                             f"{self.embed.weight.device}")
        # One host sync: an out-of-range id is an IndexError on CPU and a device-side assert
        # (which kills the CUDA context) on GPU; a ValueError naming the range is better.
        if bool(((tokens < 0) | (tokens >= self.config.vocab_size)).any()):
            check_tokens(tuple(tokens.shape), np.int64, self.config,
                         values=tokens.cpu().numpy())

    def forward(self, tokens: torch.Tensor, document_lengths=None) -> torch.Tensor:
        """Logits ``[B, N, vocab_size]``; ``document_lengths`` (packed documents of this call,
        one list for every row or one per row) goes to every block
        (:meth:`HybridBlock.forward`); positions stay absolute."""
        self._check_tokens(tokens)
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos.weight[:n]
        for block in self.blocks:
            x = block(x, document_lengths=document_lengths)
        return self.head(self.ln_f(x))


def loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
         ) -> torch.Tensor:
    """Masked mean next-token cross-entropy, ``sum(mask * nll) / max(sum(mask), 1)`` (the
    oracle's :func:`sparsetp.core.reference.gpt_loss`), computed in float32 at least.

    ``logits [B, N, V]``, integer ``targets [B, N]``, ``mask [B, N]`` bool (None: every
    position)."""
    if logits.dim() != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"logits must be [B, N, V] and targets [B, N], got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if mask is not None and tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask must be [B, N] like targets, got {tuple(mask.shape)}")
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    nll = -logp.gather(-1, targets.long()[..., None])[..., 0]
    if mask is None:
        return nll.mean()
    m = mask.to(nll.dtype)
    return (nll * m).sum() / m.sum().clamp_min(1.0)
