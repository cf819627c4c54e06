"""Framework-neutral spec layer: patterns, block layouts, configs, parameters, float64 oracle.

Imports numpy and the standard library only (never torch or jax), so both frontends share it;
:mod:`sparsetp.core.checkpoint` adds safetensors (a numpy-level file format).
"""

from sparsetp.core import patterns
from sparsetp.core.checkpoint import (
    CheckpointInfo,
    checkpoint_info,
    load_checkpoint,
    save_checkpoint,
)
from sparsetp.core.config import (
    DTYPES,
    PARAM_NAMES,
    HybridConfig,
    check_tp_size,
    init_params,
    param_shapes,
    partition_dim,
    shard_param,
    shard_params,
    unshard_param,
)
from sparsetp.core.layout import SUPPORTED_BLOCK_SIZES, BlockLayout, make_layout
from sparsetp.core.model import (
    GPTConfig,
    gpt_param_shapes,
    gpt_train_flops,
    init_gpt_params,
    join_block_params,
    split_block_params,
)
from sparsetp.core.patterns import grid_tiling
from sparsetp.core.tasks import RecallTask

__all__ = [
    "patterns", "BlockLayout", "make_layout", "SUPPORTED_BLOCK_SIZES", "grid_tiling",
    "HybridConfig", "DTYPES", "PARAM_NAMES", "param_shapes", "init_params", "partition_dim",
    "check_tp_size", "shard_param", "shard_params", "unshard_param",
    "save_checkpoint", "load_checkpoint", "checkpoint_info", "CheckpointInfo",
    "GPTConfig", "gpt_param_shapes", "init_gpt_params", "split_block_params",
    "join_block_params", "gpt_train_flops", "RecallTask",
]
