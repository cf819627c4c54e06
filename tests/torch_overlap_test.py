"""The overlapped column-parallel backward (``overlap_comm=True``) against the plain path.

``ColumnParallelLinear(overlap_comm=True)`` computes d(x), starts its all-reduce asynchronously,
then computes d(W) and d(b) while it runs. It issues the same GEMMs on the same operands as
autograd's matmul backward and all-reduces the same tensor, so the claim is **bitwise**
equality with ``overlap_comm=False`` (not a tolerance): only the order in time differs. Checked
with 2 and 4 processes for the linear layers, the MLP and (2 processes) the hybrid block, in
float32 and float64 (NCCL with one GPU per rank when torch sees enough GPUs, else gloo on CPU:
``tests/dist_utils.py``); plus the schedule itself: the all-reduce is started asynchronously
*before* the weight-gradient GEMM, whereas the plain path reduces synchronously after it.
(Both paths are also held to the float64 oracle by ``tests/torch_tp_test.py``, whose layers use
the default, overlapped path.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from absl.testing import absltest, parameterized

from sparsetp.backends.torch.block import HybridBlock
from sparsetp.backends.torch.layers import ColumnParallelLinear, ParallelMLP
from sparsetp.core import HybridConfig, init_params
from sparsetp.core import patterns as P

try:  # pytest puts tests/ on sys.path (no package); a package layout reaches it as tests.*
    import dist_utils
except ImportError:  # pragma: no cover
    from tests import dist_utils

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _grads(module, x, dy):
    """Output, input gradient and every parameter gradient of one forward+backward."""
    module.zero_grad(set_to_none=True)
    xt = x.clone().requires_grad_(True)
    y = module(xt)
    y.backward(dy)
    return [y.detach(), xt.grad] + [p.grad for p in module.parameters()]


def _assert_bitwise(a, b, what):
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert u.dtype == v.dtype and u.shape == v.shape, (what, i)
        if not torch.equal(u, v):
            raise AssertionError(f"{what}: tensor {i} differs, max |diff| "
                                 f"{(u.double() - v.double()).abs().max().item():.3e}")


# Rank functions create tensors (and generators: dist_utils.generator) on torch's default
# device, which the harness sets per rank (cuda:<rank> under NCCL, cpu under gloo).
def _check_layers_bitwise(rank, world):
    for dtype_name, dtype in DTYPES.items():
        g = dist_utils.generator(0)  # same draws on every rank
        x = torch.randn(3, 5, 16, generator=g, dtype=dtype)
        for gather in (False, True):
            out = 24 if gather else 24 // world
            dy = torch.randn(3, 5, out, generator=g, dtype=dtype)
            a, b = (ColumnParallelLinear(16, 24, gather_output=gather, dtype=dtype, seed=4,
                                         overlap_comm=o) for o in (True, False))
            _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy),
                            f"column gather={gather} {dtype_name}")
        for bias in (True, False):
            dy = torch.randn(3, 5, 16, generator=g, dtype=dtype)
            a, b = (ParallelMLP(16, 64, bias, dtype=dtype, seed=7, overlap_comm=o)
                    for o in (True, False))
            _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy), f"mlp bias={bias} {dtype_name}")
    return True


def _check_block_bitwise(rank, world):
    cfg = HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.bigbird(16, 3, 1, 1, seed=3),
                       block_size=32)
    params = init_params(cfg, 11)
    g = dist_utils.generator(1)
    x, dy = (torch.randn(2, 64, 64, generator=g) for _ in range(2))
    a, b = (HybridBlock.from_params(cfg, params, overlap_comm=o) for o in (True, False))
    _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy), "hybrid block")
    return True


def _backward_schedule(rank, world, overlap):
    """Order of GEMMs and all-reduces (with their ``async_op``) in one column-linear backward.

    Records by wrapping ``torch.matmul``, ``Tensor.mm`` and ``dist.all_reduce`` in this spawned
    rank only (autograd's own matmul backward calls ATen directly and is invisible here, so the
    plain path shows only its all-reduce)."""
    events = []
    real = dict(all_reduce=dist.all_reduce, matmul=torch.matmul, mm=torch.Tensor.mm)

    def all_reduce(tensor, *args, **kwargs):
        events.append("all_reduce_async" if kwargs.get("async_op") else "all_reduce")
        return real["all_reduce"](tensor, *args, **kwargs)

    def gemm(name):
        def wrapped(*args, **kwargs):
            events.append("gemm")
            return real[name](*args, **kwargs)
        return wrapped

    lin = ColumnParallelLinear(8, 8, overlap_comm=overlap, seed=0)
    x = torch.randn(4, 8, requires_grad=True)
    y = lin(x)
    dist.all_reduce, torch.matmul, torch.Tensor.mm = all_reduce, gemm("matmul"), gemm("mm")
    try:
        y.backward(torch.ones_like(y))
    finally:
        dist.all_reduce, torch.matmul, torch.Tensor.mm = (real["all_reduce"], real["matmul"],
                                                          real["mm"])
    return events


class OverlapTest(parameterized.TestCase):
    @parameterized.parameters(2, 4)
    def test_layers_bitwise_equal_to_plain_path(self, world):
        dist_utils.run_distributed(_check_layers_bitwise, world)

    def test_block_bitwise_equal_to_plain_path(self):
        dist_utils.run_distributed(_check_block_bitwise, 2, timeout=180)

    def test_all_reduce_starts_before_weight_gradient(self):
        overlapped = dist_utils.run_distributed(_backward_schedule, 2, True)[0]
        plain = dist_utils.run_distributed(_backward_schedule, 2, False)[0]
        # d(x) GEMM, then the asynchronous all-reduce, then the d(W) GEMM it overlaps with.
        self.assertEqual(overlapped, ["gemm", "all_reduce_async", "gemm"])
        # Plain path: autograd's matmul backward (in ATen, so not recorded) finishes both GEMMs,
        # then copy_to_region's backward reduces synchronously.
        self.assertEqual(plain, ["all_reduce"])

    def test_single_process_is_a_plain_linear(self):
        # No process group: the overlap option changes nothing and needs no collective.
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        dy = torch.randn(2, 3, 16, dtype=torch.float64)
        a, b = (ColumnParallelLinear(8, 16, dtype=torch.float64, seed=2, overlap_comm=o)
                for o in (True, False))
        _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy), "single process")


if __name__ == "__main__":
    absltest.main()
