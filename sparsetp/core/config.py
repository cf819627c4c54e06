"""HybridConfig, the canonical unsharded parameters of a hybrid block, and how TP splits them.

A *hybrid block* is a pre-norm transformer block whose attention is block-sparse::

    y1 = x + Attn(LN1(x));   y = y1 + MLP(LN2(y1));   MLP = fc2(gelu_tanh(fc1(.)))

Canonical parameters are **unsharded** numpy arrays named as below, weights stored ``[in, out]``
(``y = x @ W + b``). Both frontends load, shard and export exactly this dict, which is what makes
weights interchangeable between PyTorch and JAX and across tensor-parallel sizes.

=====================  =============  ==========================================
name                   shape          tensor-parallel split (``partition_dim``)
=====================  =============  ==========================================
``ln1.weight``         ``[d]``        replicated (None)
``ln1.bias``           ``[d]``        replicated (None)
``attn.qkv.weight``    ``[d, d+2kv]`` output columns (1): whole kv groups per rank
``attn.qkv.bias``      ``[d+2kv]``    output columns (0)
``attn.out.weight``    ``[d, d]``     input rows (0): whole heads per rank
``attn.out.bias``      ``[d]``        replicated (added once to the summed output)
``ln2.weight``         ``[d]``        replicated
``ln2.bias``           ``[d]``        replicated
``mlp.fc1.weight``     ``[d, ff]``    output columns (1)
``mlp.fc1.bias``       ``[ff]``       output columns (0)
``mlp.fc2.weight``     ``[ff, d]``    input rows (0)
``mlp.fc2.bias``       ``[d]``        replicated (added once to the summed output)
=====================  =============  ==========================================

``qkv`` columns are group-major and interleaved (Megatron's layout, with its GQA "query
groups"): ``kv = num_kv_heads * head_dim`` and ``G = num_heads / num_kv_heads`` query heads
share each kv head; the columns of kv head ``g`` are ``G + 2`` blocks of ``hd``: its query heads
``g*G .. g*G + G - 1``, then its key, then its value. Column ``g * (G+2) * hd + t * hd + e`` is
element ``e`` of query head ``g*G + t`` (``t < G``), of key ``g`` (``t = G``) or of value ``g``
(``t = G + 1``). With ``num_kv_heads == num_heads`` (the default, ``G = 1``) this is the
classic ``h * 3 * hd + t * hd + e``. A contiguous column split gives a rank whole kv groups
(its query heads and their keys and values), and ``attn.out`` rows are ``h * hd + e``.
With ``bias=False`` the four linear biases are absent (layer norms keep theirs).

GQA: ``HybridConfig(..., num_kv_heads=2)``; TP needs ``num_kv_heads`` divisible by the TP size.

>>> from sparsetp.core import patterns as P
>>> cfg = HybridConfig(d_model=64, num_heads=4, d_ff=256, pattern=P.causal(), block_size=32)
>>> params = init_params(cfg, seed=0)
>>> params["attn.qkv.weight"].shape, cfg.head_dim
((64, 192), 16)
>>> shard_param("attn.qkv.weight", params["attn.qkv.weight"], cfg, rank=1, world_size=2).shape
(64, 96)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sparsetp.core import patterns as _patterns
from sparsetp.core.layout import SUPPORTED_BLOCK_SIZES
from sparsetp.core.patterns import Pattern

__all__ = [
    "DTYPES", "HybridConfig", "PARAM_NAMES", "param_shapes", "init_params", "partition_dim",
    "check_tp_size", "shard_param", "shard_params", "unshard_param", "check_seed",
    "document_lengths_key", "with_documents",
]

DTYPES = ("float32", "bfloat16", "float16", "float64")

# Canonical order (also the order init_params draws in: changing it changes every seed).
PARAM_NAMES = (
    "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.out.weight",
    "attn.out.bias", "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
    "mlp.fc2.weight", "mlp.fc2.bias",
)
_LINEAR_BIASES = ("attn.qkv.bias", "attn.out.bias", "mlp.fc1.bias", "mlp.fc2.bias")

# Which dim of each canonical parameter tensor parallelism splits (None: replicated).
_PARTITION_DIM = {
    "attn.qkv.weight": 1, "attn.qkv.bias": 0,  # column-parallel: output features
    "attn.out.weight": 0,                      # row-parallel: input features
    "mlp.fc1.weight": 1, "mlp.fc1.bias": 0,
    "mlp.fc2.weight": 0,
}


def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_seed(seed: Any, *, allow_none: bool = False, name: str = "seed") -> int | None:
    """``seed`` as an int, or ValueError naming ``name``.

    The one rule for seeds everywhere in sparsetp: a seed is a non-negative Python or numpy int
    (what ``numpy.random.default_rng`` takes, so torch and JAX draw the same numbers).
    ``None`` never means "fresh entropy": :func:`init_params` refuses it (a silently different
    draw per call breaks reproducibility and the torch/JAX parity), and module constructors
    (``allow_none=True``) take it as "do not initialise", for a caller that loads parameters
    next (``HybridBlock.from_params``).

    >>> check_seed(3), check_seed(None, allow_none=True)
    (3, None)
    """
    if seed is None and allow_none:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        extra = (" (None is refused: pass an int for a reproducible draw)"
                 if seed is None else "")
        raise ValueError(f"{name} must be a non-negative int, got {seed!r}{extra}")
    if seed < 0:
        raise ValueError(f"{name} must be a non-negative int, got {seed}")
    return int(seed)


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Sizes and options of one hybrid (sparse-attention + MLP) transformer block.

    Args:
      d_model: model width ``d``; must be a multiple of ``num_heads``.
      num_heads: attention heads (``head_dim = d_model // num_heads``).
      d_ff: MLP hidden width.
      pattern: the attention :class:`~sparsetp.core.patterns.Pattern` (laid out per call for the
        input's sequence length with ``block_size`` tiles).
      block_size: layout tile size, one of ``SUPPORTED_BLOCK_SIZES``.
      norm_eps: layer-norm epsilon (> 0).
      bias: whether the four linear layers have biases.
      dtype: parameter/compute dtype name, one of ``DTYPES``.

    >>> from sparsetp.core import patterns as P
    >>> HybridConfig(64, 4, 256, P.causal()).head_dim
    16
    """

    d_model: int
    num_heads: int
    d_ff: int
    pattern: Pattern
    block_size: int = 64
    norm_eps: float = 1e-5
    bias: bool = True
    dtype: str = "float32"
    # Key/value heads (grouped-query attention); None means num_heads (multi-head attention).
    num_kv_heads: int | None = None

    def __post_init__(self):
        _pos_int("d_model", self.d_model)
        _pos_int("num_heads", self.num_heads)
        _pos_int("d_ff", self.d_ff)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of "
                             f"num_heads={self.num_heads}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _pos_int("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not isinstance(self.pattern, Pattern):
            raise ValueError(f"pattern must be a sparsetp Pattern, got {self.pattern!r}")
        if isinstance(self.block_size, bool) or self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got "
                             f"{self.block_size!r}")
        if (isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float))
                or not math.isfinite(self.norm_eps) or self.norm_eps <= 0):
            raise ValueError(f"norm_eps must be a finite float > 0, got {self.norm_eps!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"bias must be a bool, got {self.bias!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_group(self) -> int:
        """Query heads per kv head (1 for multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim


def param_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Canonical unsharded parameter shapes, in canonical order."""
    d, ff = config.d_model, config.d_ff
    qkv = d + 2 * config.kv_dim
    shapes = {
        "ln1.weight": (d,), "ln1.bias": (d,),
        "attn.qkv.weight": (d, qkv), "attn.qkv.bias": (qkv,),
        "attn.out.weight": (d, d), "attn.out.bias": (d,),
        "ln2.weight": (d,), "ln2.bias": (d,),
        "mlp.fc1.weight": (d, ff), "mlp.fc1.bias": (ff,),
        "mlp.fc2.weight": (ff, d), "mlp.fc2.bias": (d,),
    }
    if not config.bias:
        for name in _LINEAR_BIASES:
            del shapes[name]
    return shapes


def init_params(config: HybridConfig, seed: int) -> dict[str, np.ndarray]:
    """Canonical unsharded float32 parameters drawn with ``numpy.random.default_rng(seed)``.

    Weights ~ N(0, 1/fan_in); biases ~ N(0, 0.1^2); layer-norm weights ~ 1 + N(0, 0.1^2) and
    biases ~ N(0, 0.1^2), deliberately non-trivial so tests exercise every parameter. Draws go in
    ``PARAM_NAMES`` order, so the same seed gives the same arrays in every framework.

    ``config`` must be a :class:`HybridConfig` and ``seed`` a non-negative int (``None`` is
    refused, see :func:`check_seed`); anything else raises ValueError naming the argument.
    """
    if not isinstance(config, HybridConfig):
        raise ValueError(f"config must be a HybridConfig, got {type(config).__name__} "
                         "(build one with HybridConfig(d_model=..., num_heads=..., ...))")
    rng = np.random.default_rng(check_seed(seed))
    out = {}
    for name, shape in param_shapes(config).items():
        z = rng.standard_normal(shape)
        if name.startswith("ln") and name.endswith(".weight"):
            a = 1.0 + 0.1 * z
        elif name.endswith(".bias"):
            a = 0.1 * z
        else:
            a = z / math.sqrt(shape[0])
        out[name] = a.astype(np.float32)
    return out


def partition_dim(name: str) -> int | None:
    """The dim TP splits canonical parameter ``name`` on (contiguously), None if replicated."""
    if name not in PARAM_NAMES:
        raise ValueError(f"unknown parameter name {name!r}; known: {list(PARAM_NAMES)}")
    return _PARTITION_DIM.get(name)


def check_tp_size(config: HybridConfig, world_size: int) -> None:
    """Raise ValueError unless ``num_heads``, ``num_kv_heads`` and ``d_ff`` are multiples of
    ``world_size`` (each rank holds whole kv groups: its query heads with their keys/values)."""
    _pos_int("world_size", world_size)
    if config.num_heads % world_size:
        raise ValueError(f"num_heads={config.num_heads} is not divisible by the tensor-parallel "
                         f"size {world_size}")
    if config.num_kv_heads % world_size:
        raise ValueError(f"num_kv_heads={config.num_kv_heads} is not divisible by the "
                         f"tensor-parallel size {world_size}: each rank must hold whole kv "
                         "groups (kv heads are not replicated across ranks)")
    if config.d_ff % world_size:
        raise ValueError(f"d_ff={config.d_ff} is not divisible by the tensor-parallel size "
                         f"{world_size}")


def shard_param(name: str, array, config: HybridConfig, rank: int, world_size: int):
    """Rank ``rank``'s contiguous shard of canonical parameter ``name`` (or ``array`` itself when
    replicated). Works by basic slicing, so numpy, torch and JAX arrays all pass through."""
    check_tp_size(config, world_size)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not (
            0 <= rank < world_size):
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    expect = param_shapes(config).get(name)
    if expect is None:
        raise ValueError(f"{name!r} is not a parameter of this config "
                         f"(bias={config.bias}); known: {list(param_shapes(config))}")
    if tuple(array.shape) != expect:
        raise ValueError(f"{name} must have shape {expect}, got {tuple(array.shape)}")
    dim = partition_dim(name)
    if dim is None:
        return array
    size = expect[dim] // world_size
    index = (slice(None),) * dim + (slice(rank * size, (rank + 1) * size),)
    return array[index]


def shard_params(params: Mapping[str, Any], config: HybridConfig, rank: int,
                 world_size: int) -> dict[str, Any]:
    """``shard_param`` over a whole canonical dict (which must hold exactly the config's names)."""
    names = set(param_shapes(config))
    if set(params) != names:
        raise ValueError(f"params must hold exactly {sorted(names)}; missing "
                         f"{sorted(names - set(params))}, unexpected {sorted(set(params) - names)}")
    return {n: shard_param(n, params[n], config, rank, world_size) for n in param_shapes(config)}


def unshard_param(name: str, shards: Sequence[np.ndarray]) -> np.ndarray:
    """Inverse of ``shard_param`` for numpy shards listed in rank order (replicated: shard 0)."""
    dim = partition_dim(name)
    if dim is None:
        return np.asarray(shards[0])
    return np.concatenate([np.asarray(s) for s in shards], axis=dim)


def document_lengths_key(document_lengths: Any) -> tuple | None:
    """``document_lengths`` of a block call as nested tuples of ints (hashable: a cache key and
    a static argument under ``jax.jit``): None; one tuple (every batch row packed alike); or
    one tuple per batch row. Anything else raises ValueError naming ``document_lengths``.

    >>> document_lengths_key([3, 5]), document_lengths_key(np.array([[8], [8]]))
    ((3, 5), ((8,), (8,)))
    """
    if document_lengths is None:
        return None

    def seq(x):
        return hasattr(x, "__iter__") and not isinstance(x, (str, bytes, dict))

    def ints(row, where):
        out = []
        for k, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{where}[{k}] must be an int (a document length), got {v!r}")
            out.append(int(v))
        return tuple(out)

    if not seq(document_lengths):
        raise ValueError("document_lengths must be a sequence of document lengths (every batch "
                         "row packed alike) or one such sequence per batch row, got "
                         f"{type(document_lengths).__name__}")
    rows = list(document_lengths)
    if rows and all(seq(r) for r in rows):
        return tuple(ints(r, f"document_lengths[{i}]") for i, r in enumerate(rows))
    return ints(rows, "document_lengths")


def with_documents(pattern: Pattern, document_lengths: Any = None, *, batch: int,
                   seq_len: int) -> Pattern:
    """The attention pattern of one block call on ``[batch, seq_len]`` tokens: ``pattern``
    (the config's), or ``P.documents(document_lengths) & pattern`` (the pattern within each
    packed document). ``document_lengths``: None, one sequence of lengths (shared
    by every batch row) or ``batch`` sequences (each row its own packing, a per-batch-row
    layout); every sequence sums to ``seq_len``. Bad lengths raise ValueError naming
    ``document_lengths``.

    >>> from sparsetp.core import patterns as P
    >>> with_documents(P.causal(), [[10, 22], [32]], batch=2, seq_len=32).batch
    2
    """
    key = document_lengths_key(document_lengths)
    if key is None:
        return pattern
    rows = key if key and isinstance(key[0], tuple) else None
    if rows is not None and len(rows) != batch:
        raise ValueError(f"document_lengths has {len(rows)} rows (one list of lengths per batch "
                         f"row) but x has B={batch}")
    for i, row in enumerate(rows if rows is not None else (key,)):
        where = "document_lengths" if rows is None else f"document_lengths[{i}]"
        if not row or min(row) < 1:
            raise ValueError(f"{where} must hold positive document lengths, got {row}")
        if sum(row) != seq_len:
            raise ValueError(f"{where} sums to {sum(row)} but x has N={seq_len} tokens: the "
                             "lengths must cover the sequence")
    return _patterns.documents(key) & pattern
