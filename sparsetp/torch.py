"""sparsetp for PyTorch: block-sparse attention and tensor-parallel layers.

>>> import torch
>>> from sparsetp.core import make_layout, patterns as P
>>> from sparsetp.torch import sparse_attention
>>> q = k = v = torch.randn(1, 2, 64, 32)
>>> sparse_attention(q, k, v, make_layout(P.causal(), 64, 2, 32)).shape
torch.Size([1, 2, 64, 32])
"""

from sparsetp.backends.torch import checkpoint
from sparsetp.backends.torch.attention import (
    SparseAttention,
    backward_kernel,
    dense_attention,
    forward_kernel,
    naive_sparse_attention,
    sparse_attention,
)
from sparsetp.backends.torch.block import HybridBlock
from sparsetp.backends.torch.comm import (
    all_gather_to_region,
    copy_many_to_region,
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_from_region,
    scatter_to_region,
    scatter_to_sequence_region,
)
from sparsetp.backends.torch.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSparseAttention,
    RowParallelLinear,
)
from sparsetp.backends.torch.model import GPT
from sparsetp.backends.torch.model import loss as gpt_loss
from sparsetp.backends.torch.parallel import (
    DistInfo,
    check_parallel_sizes,
    data_parallel,
    init_distributed,
    make_device_mesh,
    shard_batch,
)
from sparsetp.core import GPTConfig, HybridConfig, init_gpt_params, init_params, make_layout

__all__ = [
    "sparse_attention", "forward_kernel", "backward_kernel", "SparseAttention",
    "naive_sparse_attention", "dense_attention",
    "copy_to_region", "copy_many_to_region", "reduce_from_region", "gather_from_region",
    "scatter_to_region",
    "all_gather_to_region", "reduce_scatter_from_region", "scatter_to_sequence_region",
    "gather_from_sequence_region",
    "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSparseAttention",
    "HybridBlock", "HybridConfig", "init_params", "make_layout",
    "checkpoint",  # checkpoint.save(block, path) / checkpoint.load(block, path)
    "init_distributed", "DistInfo", "make_device_mesh", "data_parallel", "shard_batch",
    "check_parallel_sizes",
    "GPT", "gpt_loss", "GPTConfig", "init_gpt_params",
]
