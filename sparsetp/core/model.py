"""GPTConfig and the canonical parameters of a GPT of hybrid blocks (numpy only).

A *GPT* here is a decoder-only language model whose layers are
:mod:`hybrid blocks <sparsetp.core.config>` (pre-norm, block-sparse attention + MLP)::

    x = embed[tokens] + pos[:N];   x = block_i(x) for i < num_layers;   logits = LN_f(x) @ head

Canonical parameters are one flat dict of **unsharded** float32 numpy arrays (weights
``[in, out]``, like the block's); both frontends load, shard and export exactly this dict:

======================  ==========================  ===========================================
name                    shape                       tensor-parallel split
======================  ==========================  ===========================================
``embed.weight``        ``[vocab_size, d]``         replicated
``pos.weight``          ``[max_seq_len, d]``        replicated (learned absolute positions)
``blocks.{i}.<name>``   the block's ``<name>``      as the block's ``<name>`` (``partition_dim``)
``ln_f.weight``         ``[d]``                     replicated
``ln_f.bias``           ``[d]``                     replicated
``head.weight``         ``[d, vocab_size]``         replicated (untied from ``embed``)
======================  ==========================  ===========================================

where ``<name>`` runs over :func:`sparsetp.core.config.param_shapes` of ``config.block``.
The pattern of ``config.block`` is applied as given: a language model needs a causal one
(``P.causal() & ...``); :meth:`GPTConfig.is_causal` says whether it is.

>>> from sparsetp.core import HybridConfig, patterns as P
>>> blk = HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=P.causal(), block_size=16)
>>> cfg = GPTConfig(vocab_size=50, num_layers=2, max_seq_len=64, block=blk)
>>> params = init_gpt_params(cfg, seed=0)
>>> params["head.weight"].shape, sorted(split_block_params(params, cfg)[1][0])[:2]
((32, 50), ['attn.out.bias', 'attn.out.weight'])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparsetp.core.config import HybridConfig, _pos_int, check_seed, init_params, param_shapes

__all__ = [
    "GPTConfig", "gpt_param_shapes", "init_gpt_params", "block_seed", "split_block_params",
    "join_block_params", "check_gpt_params", "check_tokens", "gpt_forward_flops",
    "gpt_train_flops",
]

# The parameters outside the blocks, in canonical (and draw) order.
_OUTER_BEFORE = ("embed.weight", "pos.weight")
_OUTER_AFTER = ("ln_f.weight", "ln_f.bias", "head.weight")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT of ``num_layers`` identical hybrid blocks.

    Args:
      vocab_size: token ids are ``0 .. vocab_size - 1``.
      num_layers: number of hybrid blocks.
      max_seq_len: rows of ``pos.weight``: the longest sequence the model takes.
      block: the :class:`~sparsetp.core.config.HybridConfig` every block shares (width,
        heads, pattern, dtype; the model computes in ``block.dtype``).

    Frozen and hashable (a static argument under ``jax.jit``). Bad values raise ValueError
    naming the argument.

    >>> from sparsetp.core import HybridConfig, patterns as P
    >>> GPTConfig(64, 2, 128, HybridConfig(32, 2, 64, P.causal())).d_model
    32
    """

    vocab_size: int
    num_layers: int
    max_seq_len: int
    block: HybridConfig

    def __post_init__(self):
        _pos_int("vocab_size", self.vocab_size)
        _pos_int("num_layers", self.num_layers)
        _pos_int("max_seq_len", self.max_seq_len)
        if not isinstance(self.block, HybridConfig):
            raise ValueError(f"block must be a HybridConfig, got {type(self.block).__name__}")

    @property
    def d_model(self) -> int:
        return self.block.d_model

    def is_causal(self, seq_len: int | None = None) -> bool:
        """Whether no query of a ``seq_len``-token sequence (default ``max_seq_len``) may see a
        later key under ``block.pattern``: what next-token training needs. Checked on the
        layout's tiles (tiles above the diagonal must be empty; the diagonal tiles' elements
        are checked exactly), so it is cheap at any length."""
        from sparsetp.core.layout import make_layout  # local: layout is heavier than config

        n = self.max_seq_len if seq_len is None else _pos_int("seq_len", seq_len)
        lay = make_layout(self.block.pattern, n, self.block.num_heads, self.block.block_size)
        nb = lay.num_blocks
        above = np.triu(np.ones((nb, nb), bool), k=1)
        if (lay.block_mask[:, above] != 0).any():
            return False
        for h in range(lay.num_heads):
            for t in range(nb):
                if lay.block_mask[h, t, t] != 0:
                    m = lay.tile_mask(h, t, t)
                    if np.triu(m, k=1).any():
                        return False
        return True


def gpt_param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Canonical unsharded parameter shapes, in canonical order (embed, pos, blocks, ln_f,
    head)."""
    d, v = config.d_model, config.vocab_size
    shapes = {"embed.weight": (v, d), "pos.weight": (config.max_seq_len, d)}
    block = param_shapes(config.block)
    for i in range(config.num_layers):
        shapes.update({f"blocks.{i}.{n}": s for n, s in block.items()})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "head.weight": (d, v)})
    return shapes


def block_seed(seed: int, layer: int) -> int:
    """The seed block ``layer`` of a model seeded ``seed`` passes to ``init_params``:
    ``SeedSequence((seed, 1 + layer))``'s first 32-bit word. Distinct, well-mixed streams per
    layer (``seed + layer`` would make layer 1 of seed 0 equal layer 0 of seed 1)."""
    return int(np.random.SeedSequence((check_seed(seed), 1 + layer)).generate_state(1)[0])


def init_gpt_params(config: GPTConfig, seed: int) -> dict[str, np.ndarray]:
    """Canonical unsharded float32 parameters of ``config``, deterministic in ``seed``.

    Block ``i`` is ``init_params(config.block, block_seed(seed, i))`` (the block's own canonical
    draw, see :func:`sparsetp.core.config.init_params`). The rest is drawn, in the order
    ``embed, pos, ln_f.weight, ln_f.bias, head``, from ``numpy.random.default_rng((seed, 0))``:
    ``embed`` and ``pos`` ~ N(0, 1) (unit scale like the blocks' outputs, whose weights are
    N(0, 1/fan_in), so the token and position signals are not drowned in the residual stream),
    ``ln_f`` like the blocks' layer norms (weight 1 + N(0, 0.1^2), bias N(0, 0.1^2): non-trivial
    so tests exercise them), ``head`` ~ N(0, 1/d). So torch and JAX start from the same weights.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    seed = check_seed(seed)
    rng = np.random.default_rng((seed, 0))
    d, v = config.d_model, config.vocab_size
    outer = {
        "embed.weight": rng.standard_normal((v, d)),
        "pos.weight": rng.standard_normal((config.max_seq_len, d)),
        "ln_f.weight": 1.0 + 0.1 * rng.standard_normal(d),
        "ln_f.bias": 0.1 * rng.standard_normal(d),
        "head.weight": rng.standard_normal((d, v)) / math.sqrt(d),
    }
    blocks = [init_params(config.block, block_seed(seed, i)) for i in range(config.num_layers)]
    out = join_block_params({n: outer[n].astype(np.float32) for n in outer}, blocks)
    return {n: out[n] for n in gpt_param_shapes(config)}


def split_block_params(params: Mapping[str, Any], config: GPTConfig
                       ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(outer, blocks)``: the non-block parameters by name, and per layer the block's own
    canonical dict (``blocks.{i}.`` prefix removed), the form ``HybridBlock`` /
    ``hybrid_block`` take. Works on any array type (values are not copied)."""
    check_gpt_params(params, config)
    outer = {n: params[n] for n in _OUTER_BEFORE + _OUTER_AFTER}
    names = param_shapes(config.block)
    blocks = [{n: params[f"blocks.{i}.{n}"] for n in names} for i in range(config.num_layers)]
    return outer, blocks


def join_block_params(outer: Mapping[str, Any], blocks: list[Mapping[str, Any]]
                      ) -> dict[str, Any]:
    """Inverse of :func:`split_block_params` (canonical order)."""
    out = {n: outer[n] for n in _OUTER_BEFORE}
    for i, b in enumerate(blocks):
        out.update({f"blocks.{i}.{n}": a for n, a in b.items()})
    out.update({n: outer[n] for n in _OUTER_AFTER})
    return out


def check_gpt_params(params: Mapping[str, Any], config: GPTConfig) -> None:
    """ValueError naming the problem unless ``params`` holds exactly the canonical names of
    ``config``, each an array of the canonical shape."""
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a dict of canonical parameters, got "
                         f"{type(params).__name__}")
    shapes = gpt_param_shapes(config)
    if set(params) != set(shapes):
        missing, extra = sorted(set(shapes) - set(params)), sorted(set(params) - set(shapes))
        raise ValueError(f"params must hold exactly the {len(shapes)} canonical names of the "
                         f"config; missing {missing[:8]}, unexpected {extra[:8]}")
    for name, shape in shapes.items():
        a = params[name]
        if not hasattr(a, "shape"):
            raise ValueError(f"params[{name!r}] must be an array, got {type(a).__name__}")
        if tuple(a.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")


def check_tokens(shape: tuple[int, ...], dtype: Any, config: GPTConfig, name: str = "tokens",
                 values: np.ndarray | None = None) -> None:
    """The model's input rule, shared by every frontend: ``tokens`` is an integer ``[B, N]``
    array with ``1 <= N <= max_seq_len`` and (when ``values`` is given: concrete inputs) ids in
    ``[0, vocab_size)``. ValueError naming ``name`` otherwise."""
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{name} must be [B, N] (B, N >= 1), got shape {tuple(shape)}")
    if not np.issubdtype(np.dtype(dtype), np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {dtype}")
    if shape[1] > config.max_seq_len:
        raise ValueError(f"{name} has N={shape[1]} tokens, more than max_seq_len="
                         f"{config.max_seq_len} (the rows of pos.weight)")
    if values is not None and values.size:
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"{name} must hold ids in [0, vocab_size={config.vocab_size}), "
                             f"got ids in [{lo}, {hi}]")


# ---------------------------------------------------------------------------------------------
# FLOP counts (for tokens/s -> MFU in the examples).


def gpt_forward_flops(config: GPTConfig, seq_len: int, density: float | None = None) -> float:
    """Matmul FLOPs of one forward pass over one ``seq_len``-token sequence.

    Per layer and token: ``2 d (d + 2 kv)`` (qkv) + ``2 d^2`` (attention output) + ``4 d ff``
    (MLP); per layer and sequence, attention ``4 * H * hd * N^2 * density`` (``Q K^T`` and
    ``P V``, 2 FLOPs per multiply-add, over the tiles the kernel computes: ``density`` is the
    layout's fraction of computed tiles, partial tiles counted whole, as the hardware runs them;
    default: the layout's own); once per token the head ``2 d V``. Embedding lookups, norms,
    softmax and GELU are left out (not matmuls, a few percent at these widths), as in the
    PaLM MFU convention.
    """
    from sparsetp.core.layout import make_layout  # local: layout is heavier than config

    b = config.block
    n = _pos_int("seq_len", seq_len)
    if density is None:
        density = make_layout(b.pattern, n, b.num_heads, b.block_size).density
    per_token = 2 * b.d_model * (b.d_model + 2 * b.kv_dim) + 2 * b.d_model ** 2 \
        + 4 * b.d_model * b.d_ff
    attn = 4.0 * b.num_heads * b.head_dim * float(n) * n * density
    return config.num_layers * (per_token * n + attn) + 2.0 * b.d_model * config.vocab_size * n


def gpt_train_flops(config: GPTConfig, seq_len: int, density: float | None = None) -> float:
    """FLOPs of one training step on one sequence: 3x the forward (backward = 2 matmuls per
    forward matmul: input and weight gradients)."""
    return 3.0 * gpt_forward_flops(config, seq_len, density)
