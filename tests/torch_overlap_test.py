"""The overlapped schedules (``overlap_comm=True``) against the plain path.

**Backward** (``comm_chunks=1``: no forward decomposition):

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

**Collective matmuls** (``comm_chunks > 1``, ``sparsetp/backends/torch/collective_matmul.py``):
the row-parallel all-reduce (and the column layer's backward one) as waves of ring
reduce-scatters plus send/recv all-gathers; with sequence parallelism the column all-gather
under this rank's own GEMM (backward: re-gather by send/recv under a ring reduce-scatter of
d(x)) and the row reduce-scatter as a ring of partial sums (backward: the all-gather under the
d(x) GEMM). These split GEMMs and sum in another order, so they are held to the plain path
(``comm_chunks=1``) with ``CROSS_ATOL`` (float32 1e-5, float64 1e-13, rtol atol/10, gradients
2x, token-summed gradients sqrt(T)x: the TP-invariance tolerance of ``tests/torch_sp_test.py``)
and to the float64 oracle with the suite's table; piece counts that do not divide the tokens,
batch 1 and batch > 1 (rank-major buffers copied), 2 and 4 ranks; and the schedule: GEMM
pieces interleaved with asynchronous collectives.
"""

from __future__ import annotations

import types
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
from absl.testing import absltest, parameterized

from sparsetp.backends.torch import layers as layers_module
from sparsetp.backends.torch.block import HybridBlock
from sparsetp.backends.torch.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    _sp_ring,
    forward_chunks,
)
from sparsetp.core import HybridConfig, init_params, reference
from sparsetp.core import patterns as P

try:  # pytest puts tests/ on sys.path (no package); a package layout reaches it as tests.*
    import dist_utils
    from testing_utils import assert_close
except ImportError:  # pragma: no cover
    from tests import dist_utils
    from tests.testing_utils import assert_close

DTYPES = {"float32": torch.float32, "float64": torch.float64}
CROSS_ATOL = {"float32": 1e-5, "float64": 1e-13}


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
                                         overlap_comm=o, comm_chunks=1) for o in (True, False))
            _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy),
                            f"column gather={gather} {dtype_name}")
        for bias in (True, False):
            dy = torch.randn(3, 5, 16, generator=g, dtype=dtype)
            a, b = (ParallelMLP(16, 64, bias, dtype=dtype, seed=7, overlap_comm=o,
                                comm_chunks=1) for o in (True, False))
            _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy), f"mlp bias={bias} {dtype_name}")
    return True


def _check_block_bitwise(rank, world):
    cfg = HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.bigbird(16, 3, 1, 1, seed=3),
                       block_size=32)
    params = init_params(cfg, 11)
    g = dist_utils.generator(1)
    x, dy = (torch.randn(2, 64, 64, generator=g) for _ in range(2))
    a, b = (HybridBlock.from_params(cfg, params, overlap_comm=o, comm_chunks=1)
            for o in (True, False))
    _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy), "hybrid block")
    return True


def _np(t):
    return t.detach().double().cpu().numpy()


def _agree(actual, expected, dtype, what, grad=False, reduced=1):
    """Forward overlap vs the plain schedule: split GEMMs and summation order only."""
    atol = CROSS_ATOL[dtype] * (2 if grad else 1)
    np.testing.assert_allclose(_np(actual), _np(expected), atol=atol * np.sqrt(reduced),
                               rtol=atol / 10, err_msg=what)


def _shard(a, rank, world, dim):
    n = a.shape[dim] // world
    return np.take(a, np.arange(rank * n, (rank + 1) * n), axis=dim)


def _check_forward_overlap_linears(rank, world):
    """Row (plain and SP) and column (SP) linears with the forward decomposed, against the
    plain schedule and the float64 oracle; batch 1 and 3, piece counts 2, 3 and 4."""
    rng = np.random.default_rng(0)  # the same unsharded problem on every rank
    for dtype_name, dtype in DTYPES.items():
        for b_ in (1, 3):
            t, d_in, d_out = 5 * world, 8 * world, 12
            tokens = b_ * t
            x = rng.standard_normal((b_, t, d_in))
            w, bias = rng.standard_normal((d_in, d_out)) / 4, rng.standard_normal(d_out)
            dy = rng.standard_normal((b_, t, d_out))
            y_ref, dx_ref = x @ w + bias, dy @ w.T
            dw_ref = np.einsum("bti,bto->io", x, dy)
            for sp in (False, True):
                for chunks in (2, 3, 4):
                    what = f"row sp={sp} chunks={chunks} batch={b_} {dtype_name}"
                    runs = []
                    for k in (chunks, 1):
                        lin = RowParallelLinear(d_in, d_out, sequence_parallel=sp, dtype=dtype,
                                                comm_chunks=k, seed=None)
                        lin.load_unsharded(w, bias)
                        xt = torch.tensor(_shard(x, rank, world, -1), dtype=dtype,
                                          requires_grad=True)
                        y = lin(xt)
                        y.backward(torch.tensor(_shard(dy, rank, world, -2) if sp else dy,
                                                dtype=dtype))
                        runs.append((y.detach(), xt.grad, lin.weight.grad, lin.bias.grad))
                    (y, dx, dw, db), plain = runs
                    assert_close(_np(y), _shard(y_ref, rank, world, -2) if sp else y_ref,
                                 dtype_name, what=f"{what} y")
                    assert_close(_np(dx), _shard(dx_ref, rank, world, -1), dtype_name,
                                 grad=True, what=f"{what} dx")
                    assert_close(_np(dw), _shard(dw_ref, rank, world, 0), dtype_name,
                                 grad=True, reduced=tokens, what=f"{what} dw")
                    assert_close(_np(db), dy.sum((0, 1)), dtype_name, grad=True,
                                 reduced=tokens, what=f"{what} db")
                    for name, u, v in zip(("y", "dx", "dw", "db"), (y, dx, dw, db), plain,
                                          strict=True):
                        _agree(u, v, dtype_name, f"{what} {name} vs plain",
                               grad=name != "y", reduced=tokens if name in ("dw", "db") else 1)
            # Column SP: the gather under this rank's own GEMM.
            what = f"column sp batch={b_} {dtype_name}"
            runs = []
            for k in (2, 1):
                lin = ColumnParallelLinear(d_in, d_out * world, sequence_parallel=True,
                                           dtype=dtype, comm_chunks=k, seed=3)
                xt = torch.tensor(_shard(x, rank, world, -2), dtype=dtype, requires_grad=True)
                y = lin(xt)
                y.backward(torch.tensor(_shard(np.tile(dy, world), rank, world, -1),
                                        dtype=dtype))
                runs.append((y.detach(), xt.grad, lin.weight.grad, lin.bias.grad))
            w_full, b_full = (t_.double().numpy() for t_ in lin.unsharded())
            assert_close(_np(runs[0][0]), _shard(x @ w_full + b_full, rank, world, -1),
                         dtype_name, what=f"{what} y")
            for name, u, v in zip(("y", "dx", "dw", "db"), runs[0], runs[1], strict=True):
                _agree(u, v, dtype_name, f"{what} {name} vs plain", grad=name != "y",
                       reduced=tokens if name in ("dw", "db") else 1)
    return True


def _check_forward_overlap_models(rank, world):
    """The MLP (float32 and float64) and the hybrid block (float32) with every forward
    decomposed (``comm_chunks=2``), plain TP and SP, against the oracle and ``comm_chunks=1``."""
    cfg = HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.bigbird(16, 3, 1, 1, seed=3),
                       block_size=16)
    params = init_params(cfg, 11)
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    rng = np.random.default_rng(12)
    b_, n = 2, 64
    x, dy = rng.standard_normal((b_, n, 64)), rng.standard_normal((b_, n, 64))
    names = ("mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")
    y_mlp, (dx_mlp, _) = reference.mlp(p64, x), reference.mlp_grad(p64, x, dy)
    y_blk, dx_blk, _ = reference.hybrid_block_value_and_grad(params, x, cfg, dy)
    own = slice(rank * n // world, (rank + 1) * n // world)
    cases = [("mlp", d) for d in DTYPES] + [("block", "float32")]
    for model, dtype_name in cases:
        dtype = DTYPES[dtype_name]
        y_ref, dx_ref = (y_mlp, dx_mlp) if model == "mlp" else (y_blk, dx_blk)
        for sp in (False, True):
            what = f"{model} sp={sp} {dtype_name}"
            runs, modules = [], []
            xs, dys = (torch.tensor(a[:, own] if sp else a, dtype=dtype) for a in (x, dy))
            for k in (2, 1):
                if model == "mlp":
                    m = ParallelMLP(64, 128, dtype=dtype, seed=None, sequence_parallel=sp,
                                    comm_chunks=k)
                    m.load_unsharded(*(p64[name] for name in names))
                else:
                    m = HybridBlock.from_params(cfg, params, sequence_parallel=sp, comm_chunks=k)
                modules.append(m)
                runs.append(_grads(m, xs, dys))
            got, plain = runs
            assert_close(_np(got[0]), y_ref[:, own] if sp else y_ref, dtype_name,
                         what=f"{what} y")
            assert_close(_np(got[1]), dx_ref[:, own] if sp else dx_ref, dtype_name, grad=True,
                         what=f"{what} dx")
            for i, (u, v) in enumerate(zip(got, plain, strict=True)):
                _agree(u, v, dtype_name, f"{what} tensor {i} vs plain", grad=i > 0,
                       reduced=b_ * n if i > 1 else 1)
            _assert_bitwise(_grads(modules[0], xs, dys), got, f"{what}: run twice")
    # Autocast (bf16 compute, fp32 parameters): the pieces cast as autocast would.
    for sp in (False, True):
        what = f"mlp sp={sp} bf16 autocast"
        m = ParallelMLP(64, 128, seed=None, sequence_parallel=sp, comm_chunks=2)
        m.load_unsharded(*(p64[name] for name in names))
        xs, dys = (torch.tensor(a[:, own] if sp else a, dtype=torch.float32) for a in (x, dy))
        xt = xs.clone().requires_grad_(True)
        with torch.autocast(xt.device.type, dtype=torch.bfloat16):
            y = m(xt)
        assert y.dtype == torch.bfloat16, (what, y.dtype)
        y.backward(dys.to(torch.bfloat16))
        assert xt.grad.dtype == torch.float32 and m.fc2.weight.grad.dtype == torch.float32
        assert_close(_np(y), y_mlp[:, own] if sp else y_mlp, "bfloat16", what=f"{what} y")
        assert_close(_np(xt.grad), dx_mlp[:, own] if sp else dx_mlp, "bfloat16", grad=True,
                     what=f"{what} dx")
    return True


def _forward_schedule(rank, world):
    """GEMMs and collectives, in order, of one forward of each decomposed layer."""
    gemm_names = ((torch, "mm"), (torch, "addmm"), (torch, "matmul"))
    real = {(dist, n): getattr(dist, n) for n in ("all_reduce", "all_gather_single",
                                                  "all_gather_into_tensor",
                                                  "batch_isend_irecv")
            if hasattr(dist, n)}
    real.update({(o, n): getattr(o, n) for o, n in gemm_names})
    events = []

    def wrap(owner, name, fn):
        def wrapped(*args, **kwargs):
            if owner is dist and name != "batch_isend_irecv":
                events.append(("all_gather" if "gather" in name else name)
                              + ("_async" if kwargs.get("async_op") else ""))
            else:
                events.append("send/recv" if owner is dist else "gemm")
            return fn(*args, **kwargs)
        return wrapped

    layers = {"row": RowParallelLinear(8 * world, 8, comm_chunks=2 * world, seed=0),
              "row_sp": RowParallelLinear(8 * world, 8, comm_chunks=2, sequence_parallel=True,
                                          seed=0),
              "column_sp": ColumnParallelLinear(8, 8 * world, comm_chunks=2,
                                                sequence_parallel=True, seed=0)}
    inputs = {"row": torch.randn(1, 6, 8), "row_sp": torch.randn(1, 2 * world, 8),
              "column_sp": torch.randn(1, 2, 8)}
    out = {}
    for name, layer in layers.items():
        events.clear()
        for (owner, attr), fn in real.items():
            setattr(owner, attr, wrap(owner, attr, fn))
        try:
            with torch.no_grad():
                layer(inputs[name])
        finally:
            for (owner, attr), fn in real.items():
                setattr(owner, attr, fn)
        out[name] = list(events)
    return out


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
    @classmethod
    def setUpClass(cls):
        """Every multi-process check of one size (and backend) runs in one launch
        (``dist_utils.SharedLaunches``): spawning costs more than most of these checks."""
        super().setUpClass()
        cls.launches = launches = dist_utils.SharedLaunches()
        for world in (2, 4):
            launches.add(f"layers_bitwise_{world}", world, _check_layers_bitwise)
        launches.add("block_bitwise", 2, _check_block_bitwise, timeout=180)
        for overlap in (True, False):
            launches.add(f"backward_schedule_{overlap}", 2, _backward_schedule, overlap)
        for world in (2, 4):
            launches.add(f"forward_linears_{world}", world, _check_forward_overlap_linears,
                         timeout=180)
        launches.add("forward_models", 2, _check_forward_overlap_models, timeout=240)
        launches.add("forward_schedule", 2, _forward_schedule)

    @parameterized.parameters(2, 4)
    def test_layers_bitwise_equal_to_plain_path(self, world):
        self.assertEqual(self.launches.result(f"layers_bitwise_{world}"), [True] * world)

    def test_block_bitwise_equal_to_plain_path(self):
        self.assertEqual(self.launches.result("block_bitwise"), [True] * 2)

    def test_all_reduce_starts_before_weight_gradient(self):
        overlapped = self.launches.result("backward_schedule_True")[0]
        plain = self.launches.result("backward_schedule_False")[0]
        # d(x) GEMM, then the asynchronous all-reduce, then the d(W) GEMM it overlaps with.
        self.assertEqual(overlapped, ["gemm", "all_reduce_async", "gemm"])
        # Plain path: autograd's matmul backward (in ATen, so not recorded) finishes both GEMMs,
        # then copy_to_region's backward reduces synchronously.
        self.assertEqual(plain, ["all_reduce"])

    @parameterized.parameters(2, 4)
    def test_forward_overlap_layers_match_plain_and_oracle(self, world):
        self.assertEqual(self.launches.result(f"forward_linears_{world}"), [True] * world)

    def test_forward_overlap_models_match_plain_and_oracle(self):
        self.assertEqual(self.launches.result("forward_models"), [True] * 2)

    def test_forward_collectives_run_between_gemm_pieces(self):
        got = self.launches.result("forward_schedule")[0]
        # Two waves, each: the other rank's partial sum, sent while this rank's own piece
        # multiplies, then the summed piece's all-gather (under the next wave's GEMMs).
        self.assertEqual(got["row"], ["gemm", "send/recv", "gemm", "send/recv"] * 2)
        # Ring of 2: the other rank's partial sum first, sent while the own one multiplies.
        self.assertEqual(got["row_sp"], ["gemm", "send/recv", "gemm"])
        # The gather starts, the own shard multiplies under it, then the other shard.
        self.assertEqual(got["column_sp"], ["send/recv", "gemm", "gemm"])

    def test_forward_chunks_policy(self):
        big = 2.0 * 8192 * 16384 * 8192  # fc2 of the d=8192, ff=32768 MLP at TP=2: 2**41
        self.assertEqual(forward_chunks(None, 8192, 2, big), 4)
        self.assertEqual(forward_chunks(None, 8192, 2, big / 4), 1)   # d=4096: no split
        self.assertEqual(forward_chunks(None, 8192, 2, big / 2), 2)
        self.assertEqual(forward_chunks(None, 10 ** 6, 8, 1e15), 4)   # at most MAX_CHUNKS
        self.assertEqual(forward_chunks(3, 2, 2, 0.0), 2)            # never more than tokens
        self.assertEqual(forward_chunks(4, 8192, 1, big), 1)         # one rank: no overlap
        for bad in (0, -1, 1.5, True, "2"):
            with self.assertRaisesRegex(ValueError, "comm_chunks must be"):
                RowParallelLinear(8, 8, comm_chunks=bad)

    def test_sequence_parallel_ring_policy(self):
        def layer(d_in_local, d_out, world=2, comm_chunks=None):
            return types.SimpleNamespace(weight=torch.empty(d_in_local, d_out, device="meta"),
                                         world_size=world, comm_chunks=comm_chunks)

        def x(tokens, width):
            return torch.empty(1, tokens, width, device="meta")
        # Row layer (input: all tokens, this rank's columns): the attention output projection
        # of the d=8192 block at TP=2 is 2**39 FLOPs, a ring; at d=4096 (2**37) it is not.
        self.assertTrue(_sp_ring(layer(4096, 8192), x(8192, 4096)))
        self.assertFalse(_sp_ring(layer(2048, 4096), x(8192, 2048)))
        # Column layer (input: this rank's token shard, ``shards`` of them make the sequence).
        self.assertTrue(_sp_ring(layer(8192, 4096), x(4096, 8192), shards=2))
        self.assertFalse(_sp_ring(layer(8192, 4096), x(4096, 8192), shards=1))
        # An explicit comm_chunks decides; one rank never rings.
        self.assertFalse(_sp_ring(layer(4096, 8192, comm_chunks=1), x(8192, 4096)))
        self.assertTrue(_sp_ring(layer(2048, 4096, comm_chunks=2), x(8192, 2048)))
        self.assertFalse(_sp_ring(layer(4096, 8192, world=1), x(8192, 4096)))
        # Under torch.compile (no async collectives) every layer takes the plain path.
        with mock.patch.object(layers_module, "_can_overlap", lambda: False):
            self.assertFalse(_sp_ring(layer(4096, 8192), x(8192, 4096)))
            self.assertFalse(_sp_ring(layer(4096, 8192, comm_chunks=2), x(8192, 4096)))

    def test_single_process_is_a_plain_linear(self):
        # No process group: the overlap option changes nothing and needs no collective.
        x = torch.randn(2, 3, 8, dtype=torch.float64)
        dy = torch.randn(2, 3, 16, dtype=torch.float64)
        a, b = (ColumnParallelLinear(8, 16, dtype=torch.float64, seed=2, overlap_comm=o)
                for o in (True, False))
        _assert_bitwise(_grads(a, x, dy), _grads(b, x, dy), "single process")


if __name__ == "__main__":
    absltest.main()
