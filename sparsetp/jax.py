"""sparsetp for JAX: the same Triton kernels and the same block, with ``shard_map`` parallelism.

On GPU the kernels launch through jax-triton; on CPU through Triton's interpreter inside
``jax.experimental.buffer_callback`` (for correctness, not speed), chosen per platform in one
process (:mod:`sparsetp._runtime`).

>>> import numpy as np
>>> from sparsetp.core import make_layout, patterns as P
>>> from sparsetp.jax import sparse_attention
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 64, 32)).astype("float32")
>>> sparse_attention(q, k, v, make_layout(P.causal(), 64, 2, 32)).shape
(1, 2, 64, 32)
"""

from sparsetp.backends.jax import checkpoint
from sparsetp.backends.jax.attention import (
    LayoutArrays,
    backward_kernel,
    forward_kernel,
    layout_arrays,
    sparse_attention,
)
from sparsetp.backends.jax.block import (
    export_params,
    hybrid_block,
    load_params,
    make_2d_mesh,
    make_mesh,
    param_specs,
    shard_batch,
    shard_params,
)
from sparsetp.backends.jax.distributed import deadline, init_distributed
from sparsetp.backends.jax.layers import column_parallel_linear, parallel_mlp, row_parallel_linear
from sparsetp.backends.jax.model import (
    export_gpt_params,
    gpt,
    load_gpt_params,
    shard_gpt_params,
)
from sparsetp.backends.jax.model import loss as gpt_loss
from sparsetp.core import GPTConfig, HybridConfig, init_gpt_params, init_params, make_layout

__all__ = [
    "sparse_attention", "forward_kernel", "backward_kernel", "LayoutArrays", "layout_arrays",
    "column_parallel_linear", "row_parallel_linear", "parallel_mlp",
    "hybrid_block", "shard_params", "param_specs", "load_params", "export_params", "make_mesh",
    "make_2d_mesh", "shard_batch",
    "HybridConfig", "init_params", "make_layout",
    "checkpoint",  # checkpoint.save(params, path, cfg) / checkpoint.load(path, cfg, mesh=...)
    "gpt", "gpt_loss", "load_gpt_params", "shard_gpt_params", "export_gpt_params",
    "GPTConfig", "init_gpt_params",
    "init_distributed", "deadline",  # multi-process: bounded waits (BUILD.md "Timeouts")
]
