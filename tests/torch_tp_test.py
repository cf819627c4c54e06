"""PyTorch tensor parallelism on 1, 2 and 4 processes against the float64 oracle.

Processes and devices follow the suite's rule (``tests/dist_utils.py``): NCCL with one GPU per
rank when torch sees enough GPUs, else gloo with CPU ranks (kernels in Triton's interpreter).

Every rank builds the same unsharded float64 problem (same seeds), runs its shard, and compares
its outputs, input gradients and *its shard* of every weight gradient with the oracle, for a
random cotangent. Sharding of the oracle goes through ``sparsetp.core.shard_param`` (the one
partition description both frontends use).

Tolerances (float32): values are O(1) (unit-variance inputs, 1/sqrt(fan_in) weights, layer
norms) and every reduction is at most 256 long, so float32 rounding (2^-24 ~ 6e-8 relative per
operation, growing ~sqrt(K)) leaves errors of ~1e-6; outputs use atol 1e-4, rtol 1e-5 and
gradients twice that, which is the conventions' table (rtol = atol/10, gradients 2*atol) and
still ~50x below the error of any real bug (a missing all-reduce or bias, a wrong shard or head
order all give O(0.1-1) errors). Weight gradients sum over B*N tokens; their relative error
stays ~1e-6, covered by rtol. float64 runs use atol 1e-10.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import unittest
import unittest.mock

import numpy as np
import torch
import torch.distributed as dist
from absl.testing import absltest, parameterized

from sparsetp.backends.torch.block import HybridBlock
from sparsetp.backends.torch.comm import (
    copy_to_region,
    gather_from_region,
    group_size,
    reduce_from_region,
    scatter_to_region,
)
from sparsetp.backends.torch.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSparseAttention,
    RowParallelLinear,
)
from sparsetp.core import HybridConfig, init_params, param_shapes, reference, shard_param
from sparsetp.core import patterns as P

try:  # pytest puts tests/ on sys.path (no package); a package layout reaches it as tests.*
    import dist_utils
except ImportError:  # pragma: no cover
    from tests import dist_utils

ATOL = {"float32": 1e-4, "float64": 1e-10}
TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64}


def _close(actual, expected, dtype, grad=False, msg=""):
    atol = ATOL[dtype] * (2 if grad else 1)
    a = actual.detach().double().cpu().numpy() if isinstance(actual, torch.Tensor) else actual
    np.testing.assert_allclose(a, expected, atol=atol, rtol=atol / 10, err_msg=msg)


def _t(a, dtype, grad=False):
    return torch.tensor(a, dtype=TORCH_DTYPE[dtype], requires_grad=grad)


def _narrow(a, dim, rank, world):
    size = a.shape[dim] // world
    return np.take(a, np.arange(rank * size, (rank + 1) * size), axis=dim)


# ---------------------------------------------------------------------------------------------
# Rank functions (module level: pickled by name into the spawned processes). They create
# tensors (and generators: dist_utils.generator) on torch's default device, which the harness
# sets: cuda:<rank> under NCCL, cpu under gloo; benchmarks/gpu_tp_check.py runs them with NCCL.


def _check_linears(rank, world, dtype):
    rng = np.random.default_rng(0)  # same draws on every rank: the unsharded problem
    d_in, d_out = 16, 24
    x = rng.standard_normal((2, 5, d_in))
    w, b = rng.standard_normal((d_in, d_out)) / 4, rng.standard_normal(d_out)
    dy = rng.standard_normal((2, 5, d_out))
    y_ref = x @ w + b
    dx_ref = dy @ w.T
    dw_ref = np.einsum("bti,bto->io", x, dy)
    db_ref = dy.sum((0, 1))

    for gather in (False, True):
        lin = ColumnParallelLinear(d_in, d_out, gather_output=gather, dtype=TORCH_DTYPE[dtype])
        lin.load_unsharded(w, b)
        xt = _t(x, dtype, grad=True)
        y = lin(xt)
        want = y_ref if gather else _narrow(y_ref, -1, rank, world)
        _close(y, want, dtype, msg=f"column gather={gather} y")
        y.backward(_t(dy if gather else _narrow(dy, -1, rank, world), dtype))
        _close(xt.grad, dx_ref, dtype, grad=True, msg="column dx")
        _close(lin.weight.grad, _narrow(dw_ref, 1, rank, world), dtype, True, "column dw shard")
        _close(lin.bias.grad, _narrow(db_ref, 0, rank, world), dtype, True, "column db shard")

    for parallel_in in (True, False):
        lin = RowParallelLinear(d_out, d_in, input_is_parallel=parallel_in,
                                dtype=TORCH_DTYPE[dtype])
        w2, b2 = w.T.copy(), rng.standard_normal(d_in)
        lin.load_unsharded(w2, b2)
        x2 = dy  # [2, 5, d_out]: reuse as an input of the right width
        dy2 = rng.standard_normal((2, 5, d_in))
        x_in = _narrow(x2, -1, rank, world) if parallel_in else x2
        xt = _t(x_in, dtype, grad=True)
        y = lin(xt)
        _close(y, x2 @ w2 + b2, dtype, msg=f"row parallel_in={parallel_in} y")
        y.backward(_t(dy2, dtype))
        dx2 = dy2 @ w2.T
        _close(xt.grad, _narrow(dx2, -1, rank, world) if parallel_in else dx2, dtype, True,
               "row dx")
        _close(lin.weight.grad, _narrow(np.einsum("bti,bto->io", x2, dy2), 0, rank, world),
               dtype, True, "row dw shard")
        _close(lin.bias.grad, dy2.sum((0, 1)), dtype, True, "row db (replicated)")

    # Gathering back gives the loaded tensors bitwise.
    lin = ColumnParallelLinear(d_in, d_out, dtype=TORCH_DTYPE[dtype])
    w_t, b_t = _t(w, dtype), _t(b, dtype)
    lin.load_unsharded(w_t, b_t)
    w_back, b_back = lin.unsharded()
    assert torch.equal(w_back, w_t) and torch.equal(b_back, b_t)
    return True


def _mlp_config(dtype="float32", bias=True):
    return HybridConfig(d_model=16, num_heads=4, d_ff=32, pattern=P.causal(), block_size=32,
                        dtype=dtype, bias=bias)


def _check_mlp(rank, world, dtype, bias):
    cfg = _mlp_config(dtype, bias)
    params = {k: v.astype(np.float64) for k, v in init_params(cfg, 1).items()}
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 7, cfg.d_model))
    dy = rng.standard_normal((2, 7, cfg.d_model))
    y_ref = reference.mlp(params, x)
    dx_ref, grads_ref = reference.mlp_grad(params, x, dy)
    names = ("mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")

    mlp = ParallelMLP(cfg.d_model, cfg.d_ff, bias=bias, dtype=TORCH_DTYPE[dtype], seed=None)
    mlp.load_unsharded(*(params.get(n) for n in names))
    xt = _t(x, dtype, grad=True)
    y = mlp(xt)
    _close(y, y_ref, dtype, msg="mlp y")
    y.backward(_t(dy, dtype))
    _close(xt.grad, dx_ref, dtype, grad=True, msg="mlp dx")
    local = (mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)
    for name, p, g in zip(names, local, grads_ref, strict=True):
        if not bias and name.endswith("bias"):
            assert p is None and g is None
            continue
        _close(p.grad, shard_param(name, g, cfg, rank, world), dtype, True, name)

    # Determinism: the same input twice gives bitwise the same output.
    with torch.no_grad():
        assert torch.equal(mlp(xt), mlp(xt))
    return y.detach().double().cpu().numpy()


def _check_collectives(rank, world):
    x = torch.arange(6.0).reshape(2, 3) + 10 * rank
    x.requires_grad_(True)
    g = _t(np.random.default_rng(rank).standard_normal((2, 3)), "float32")
    copy_to_region(x).backward(g)
    summed = g.clone()
    dist.all_reduce(summed)
    assert torch.equal(x.grad, summed), "copy_to_region backward is an all-reduce"
    x.grad = None
    y = reduce_from_region(x)
    assert torch.equal(y.detach(), sum(torch.arange(6.0).reshape(2, 3) + 10 * r
                                       for r in range(world)))
    y.backward(g)
    assert torch.equal(x.grad, g), "reduce_from_region backward is the identity"
    x.grad = None
    full = gather_from_region(x)
    assert full.shape == (2, 3 * world)
    assert torch.equal(full[:, 3 * rank:3 * rank + 3].detach(), x.detach())
    gf = _t(np.random.default_rng(7).standard_normal((2, 3 * world)), "float32")
    full.backward(gf)
    assert torch.equal(x.grad, gf[:, 3 * rank:3 * rank + 3]), "gather backward splits"
    z = _t(np.random.default_rng(9).standard_normal((2, 2 * world)), "float32", grad=True)
    part = scatter_to_region(z)
    assert torch.equal(part.detach(), z.detach()[:, 2 * rank:2 * rank + 2])
    part.backward(torch.full((2, 2), float(rank + 1)))
    want = torch.cat([torch.full((2, 2), float(r + 1)) for r in range(world)], dim=1)
    assert torch.equal(z.grad, want), "scatter backward all-gathers"
    return group_size()


def _check_bad_sizes(rank, world):
    tc = unittest.TestCase()
    # 5 and 3 divide neither 2 nor 4.
    with tc.assertRaisesRegex(ValueError, f"out_features=5 is not divisible by the tensor-parallel "
                                          f"size {world}"):
        ColumnParallelLinear(16, 5)
    with tc.assertRaisesRegex(ValueError, f"in_features=5 is not divisible .* {world}"):
        RowParallelLinear(5, 16)
    with tc.assertRaisesRegex(ValueError, f"out_features=5 is not divisible .* {world}"):
        ParallelMLP(16, 5)
    with tc.assertRaisesRegex(ValueError, f"num_heads=3 is not divisible .* {world}"):
        ParallelSparseAttention(48, 3, P.causal(), block_size=32)
    with tc.assertRaisesRegex(ValueError, f"num_heads=3 is not divisible .* {world}"):
        HybridBlock(HybridConfig(48, 3, 64, P.causal(), block_size=32))
    with tc.assertRaisesRegex(ValueError, f"d_ff=5 is not divisible .* {world}"):
        HybridBlock(HybridConfig(64, 4, 5, P.causal(), block_size=32))
    return True


def _check_layers(rank, world):
    """Collectives, Column/Row linears (float32, float64), MLP (with/without bias), bad sizes."""
    assert _check_collectives(rank, world) == world
    for dtype in ("float32", "float64"):
        _check_linears(rank, world, dtype)
    _check_mlp(rank, world, "float32", bias=False)
    if world > 1:
        _check_bad_sizes(rank, world)
    return _check_mlp(rank, world, "float32", bias=True)


def _block_config(bias=True, dtype="float32", num_kv_heads=None):
    # N=128 with 32-token tiles and a 16-token BigBird: full, partial and empty tiles (density
    # ~0.9 with ~0.6 partial); small enough for the interpreter (~4 s of fwd+bwd on 2 cores).
    return HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.bigbird(16, 3, 1, 1, seed=3),
                        block_size=32, bias=bias, dtype=dtype, num_kv_heads=num_kv_heads)


def _block_problem(cfg):
    params = init_params(cfg, 11)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 128, cfg.d_model))
    dy = rng.standard_normal((2, 128, cfg.d_model))
    return params, x, dy


def _check_block(rank, world, bias, num_kv_heads=None, document_lengths=None):
    cfg = _block_config(bias, num_kv_heads=num_kv_heads)
    params, x, dy = _block_problem(cfg)
    y_ref = reference.hybrid_block(params, x, cfg, document_lengths)
    dx_ref, dparams_ref = reference.hybrid_block_grad(params, x, cfg, dy, document_lengths)
    if document_lengths is not None:  # the documents matter: O(1) away from the plain block
        assert np.abs(y_ref - reference.hybrid_block(params, x, cfg)).max() > 0.1

    block = HybridBlock.from_params(cfg, params)
    exported = block.export_params()  # gathered back bitwise (a collective: every rank calls)
    assert list(exported) == list(params)
    for name in params:
        assert exported[name].dtype == np.float32 and np.array_equal(exported[name], params[name])

    xt = _t(x, "float32", grad=True)
    y = block(xt, document_lengths=document_lengths)
    _close(y, y_ref, "float32", msg="block y")
    y.backward(_t(dy, "float32"))
    _close(xt.grad, dx_ref, "float32", grad=True, msg="block dx")
    local = dict(block.named_parameters())
    assert set(local) == set(param_shapes(cfg))
    for name, p in local.items():
        want = shard_param(name, dparams_ref[name], cfg, rank, world)
        assert tuple(p.shape) == want.shape, (name, p.shape, want.shape)
        _close(p.grad, want, "float32", grad=True, msg=f"block d{name} shard")
    with torch.no_grad():  # determinism: bitwise the same output again
        assert torch.equal(block(xt, document_lengths=document_lengths), y)
    return y.detach().cpu().numpy(), xt.grad.cpu().numpy()


# Every torch.distributed collective a layer could issue; the counting test wraps them all, so
# a stray all-gather or broadcast shows up too, not only a missing or doubled all-reduce.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "reduce")


@contextlib.contextmanager
def _recording_collectives():
    """Wrap the collectives in ``torch.distributed`` (in this spawned rank only) and yield the
    list of ``(name, shape)`` of every call, in order; an ``all_reduce`` with ``async_op=True``
    (the overlapped backward of ``comm.all_reduce_async``) is recorded as ``all_reduce_async``.
    ``sparsetp.backends.torch.comm`` looks the functions up on the module at call time."""
    calls = []
    real = {name: getattr(dist, name) for name in _COLLECTIVES}

    def wrap(name):
        def wrapped(tensor, *args, **kwargs):
            tag = f"{name}_async" if kwargs.get("async_op") else name
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
            calls.append((tag, shape))
            return real[name](tensor, *args, **kwargs)
        return wrapped

    for name in _COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _count_collectives(rank, world):
    """Collectives issued by ParallelMLP and HybridBlock forward and backward, with and without
    the overlapped backward; returns ``{(layer, overlap, pass): [(name, shape), ...]}``."""
    cfg = HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=P.causal(), block_size=16)
    params = init_params(cfg, 5)
    g = dist_utils.generator(3)
    x0, dy = (torch.randn(1, 32, 32, generator=g) for _ in range(2))
    out = {}
    for overlap in (True, False):
        layers = {"mlp": ParallelMLP(32, 64, seed=1, overlap_comm=overlap),
                  "block": HybridBlock.from_params(cfg, params, overlap_comm=overlap)}
        for name, layer in layers.items():
            x = x0.clone().requires_grad_(True)
            with _recording_collectives() as fwd:
                y = layer(x)
            with _recording_collectives() as bwd:
                y.backward(dy)
            assert x.grad is not None and all(p.grad is not None for p in layer.parameters())
            out[name, overlap, "fwd"], out[name, overlap, "bwd"] = fwd, bwd
    return out


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()  # would wait forever for rank 1: the harness must kill us
    return True


def _default_device(rank, world):
    return torch.empty(()).device.type


def _draw(rank, world):
    return torch.rand(3)  # torch's global generator


def _sleep_forever(rank, world):
    import time
    time.sleep(3600)


# ---------------------------------------------------------------------------------------------


class SingleProcessTest(parameterized.TestCase):
    """No process group: group=None means a single process; layers are ordinary layers."""

    def test_collectives_are_identity(self):
        x = torch.randn(3, 4, requires_grad=True)
        for f in (copy_to_region, reduce_from_region, gather_from_region, scatter_to_region):
            self.assertTrue(torch.equal(f(x), x))
        self.assertEqual(group_size(), 1)

    def test_load_unsharded_errors(self):
        lin = ColumnParallelLinear(8, 4)
        with self.assertRaisesRegex(ValueError, r"unsharded shape \(8, 4\)"):
            lin.load_unsharded(np.zeros((4, 8), np.float32), np.zeros(4, np.float32))
        with self.assertRaisesRegex(ValueError, "bias must be given exactly"):
            lin.load_unsharded(np.zeros((8, 4), np.float32), None)
        with self.assertRaisesRegex(ValueError, r"bias must have shape \(4,\)"):
            lin.load_unsharded(np.zeros((8, 4), np.float32), np.zeros(5, np.float32))
        with self.assertRaisesRegex(ValueError, "weight must be a numpy array or a torch"):
            lin.load_unsharded([[0.0] * 4] * 8, np.zeros(4, np.float32))
        with self.assertRaisesRegex(ValueError, "in_features must be a positive int"):
            RowParallelLinear(0, 4)
        with self.assertRaisesRegex(ValueError, "pattern must be a sparsetp Pattern"):
            ParallelSparseAttention(16, 4, "causal")
        with self.assertRaisesRegex(ValueError, "d_model=18 must be a positive multiple"):
            ParallelSparseAttention(18, 4, P.causal())

    def test_block_params_round_trip_and_dtypes(self):
        cfg = _block_config()
        params = init_params(cfg, 5)
        exported = HybridBlock.from_params(cfg, params).export_params()
        for name in params:
            np.testing.assert_array_equal(exported[name], params[name])
            self.assertEqual(exported[name].dtype, np.float32)
        # HybridBlock(cfg, seed=s) is from_params(cfg, init_params(cfg, s)).
        seeded = HybridBlock(cfg, seed=5).export_params()
        for name in params:
            np.testing.assert_array_equal(seeded[name], params[name])
        for dtype, np_dtype in (("float64", np.float64), ("float16", np.float16),
                                ("bfloat16", np.float32)):
            cfg_d = _block_config(dtype=dtype)
            block = HybridBlock.from_params(cfg_d, params)
            self.assertTrue(all(p.dtype == getattr(torch, dtype) for p in block.parameters()))
            once = block.export_params()
            twice = HybridBlock.from_params(cfg_d, once).export_params()
            for name in params:
                self.assertEqual(once[name].dtype, np_dtype)
                np.testing.assert_array_equal(twice[name], once[name])
                rounded = torch.from_numpy(params[name]).to(getattr(torch, dtype)).float()
                np.testing.assert_array_equal(once[name].astype(np.float32), rounded.numpy())

    def test_block_bad_params(self):
        cfg = _block_config()
        params = init_params(cfg, 0)
        with self.assertRaisesRegex(ValueError, r"missing \['ln1.bias'\]"):
            HybridBlock.from_params(cfg, {k: v for k, v in params.items() if k != "ln1.bias"})
        with self.assertRaisesRegex(ValueError, r"unexpected \['extra'\]"):
            HybridBlock.from_params(cfg, dict(params, extra=params["ln1.bias"]))
        with self.assertRaisesRegex(ValueError, r"ln2.weight must have shape \(64,\)"):
            HybridBlock.from_params(cfg, dict(params, **{"ln2.weight": params["mlp.fc1.bias"]}))
        with self.assertRaisesRegex(ValueError, "config must be a HybridConfig"):
            HybridBlock({"d_model": 64})
        with self.assertRaisesRegex(ValueError, r"x must be \[B, N, d_model=64\]"):
            HybridBlock(cfg)(torch.zeros(2, 128, 32))

    def test_same_seed_same_function(self):
        a, b = ParallelMLP(8, 16, seed=3), ParallelMLP(8, 16, seed=3)
        x = torch.randn(2, 8)
        self.assertTrue(torch.equal(a(x), b(x)))


class DistributedTest(parameterized.TestCase):
    """The layer, collective-count and block checks on 1, 2 and 4 ranks. Spawning costs ~4 s
    per launch on 2 cores, more than most checks: every check of one (TP size, backend) runs in
    one launch (``dist_utils.SharedLaunches``), started by the first test that needs it."""

    _DOCUMENT_CASES = (  # (name, TP size, document_lengths)
        ("per_row_tp1", 1, ((10, 90, 28), (128,))),
        ("per_row_tp2", 2, ((10, 90, 28), (128,))),
        ("shared_tp2", 2, (64, 1, 63)),
    )

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.launches = launches = dist_utils.SharedLaunches()
        for world in (1, 2, 4):
            launches.add(f"layers_tp{world}", world, _check_layers)
        launches.add("count", 2, _count_collectives, timeout=120)
        # All sizes of the invariance check on one backend, the one TP 4 gets (see its test).
        for world in (1, 2, 4):
            launches.add(f"block_tp{world}", world, _check_block, True, timeout=180,
                         backend=dist_utils.backend_for(4))
        launches.add("block_without_bias", 2, _check_block, False, timeout=180)
        launches.add("block_gqa", 2, _check_block, True, 2, timeout=180)
        for name, world, lengths in cls._DOCUMENT_CASES:
            launches.add(f"documents_{name}", world, _check_block, True, 2, lengths,
                         timeout=180)

    @parameterized.parameters(1, 2, 4)
    def test_layers(self, world):
        results = self.launches.result(f"layers_tp{world}")
        self.assertLen(results, world)
        for mlp_out in results[1:]:  # every rank holds the same (replicated) output, bitwise
            np.testing.assert_array_equal(mlp_out, results[0])

    def test_all_reduces_per_forward_and_backward(self):
        """Megatron's budget at TP 2: ParallelMLP all-reduces once forward (fc2's output) and
        once backward (fc1's input gradient); HybridBlock twice each way (attention and MLP).
        The overlapped backward issues the same reduction asynchronously; nothing else runs."""
        counts = self.launches.result("count")
        act = (1, 32, 32)  # every reduction is of a full [B, N, d_model] activation or gradient
        for rank, got in enumerate(counts):
            for overlap in (True, False):
                bwd = "all_reduce_async" if overlap else "all_reduce"
                want = {("mlp", "fwd"): [("all_reduce", act)],
                        ("mlp", "bwd"): [(bwd, act)],
                        ("block", "fwd"): [("all_reduce", act)] * 2,
                        ("block", "bwd"): [(bwd, act)] * 2}
                for (layer, pass_), calls in want.items():
                    self.assertEqual(got[layer, overlap, pass_], calls,
                                     f"rank {rank} {layer} {pass_} overlap_comm={overlap}")

    def test_block_matches_oracle_and_is_invariant_across_tp(self):
        """TP 1, 2, 4: every rank checks output, dx and its weight-grad shards against the
        float64 oracle; then outputs and dx must agree ACROSS TP sizes much more tightly than
        with the oracle: only float32 summation order differs (K-split matmuls, all-reduce), a
        few ulp of O(1-10) values, so 1e-5 (2e-5 for dx) is 10x tighter than the oracle check.
        (One run per size serves both checks: the interpreter makes each run ~5-15 s.) All
        sizes on one backend, the one TP 4 gets, so that one device type computes them all."""
        base = None
        backend = dist_utils.backend_for(4)
        for world in (1, 2, 4):
            with self.subTest(tp=world, backend=backend):
                results = self.launches.result(f"block_tp{world}")
                self.assertLen(results, world)
                if base is None:
                    base = results[0]
                for rank, (y, dx) in enumerate(results):
                    np.testing.assert_allclose(y, base[0], atol=1e-5, rtol=1e-6,
                                               err_msg=f"tp{world} rank{rank} y vs tp1")
                    np.testing.assert_allclose(dx, base[1], atol=2e-5, rtol=2e-6,
                                               err_msg=f"tp{world} rank{rank} dx vs tp1")

    def test_block_without_bias(self):
        self.assertLen(self.launches.result("block_without_bias"), 2)

    def test_block_gqa(self):
        """num_kv_heads=2 of 4 query heads at TP 2: each rank holds one whole kv group (two
        query heads, one key and value head: the qkv weight's group-major columns) and checks
        y, dx and its qkv/out weight-grad shards against the float64 oracle."""
        self.assertLen(self.launches.result("block_gqa"), 2)

    @parameterized.named_parameters((name, name, world) for name, world, _ in _DOCUMENT_CASES)
    def test_block_document_lengths(self, name, world):
        """document_lengths per call (per batch row, or shared) composed with the config's
        BigBird, GQA (2 kv heads of 4): every rank checks y, dx and its weight-grad shards
        against the float64 oracle given the same lengths (at TP 2 each rank's per-row layout
        holds its heads of every row)."""
        self.assertLen(self.launches.result(f"documents_{name}"), world)


class HarnessTest(absltest.TestCase):
    def test_backend_rule(self):
        """NCCL when torch sees world_size GPUs, else gloo; NCCL with too few is an error."""
        import torch

        for gpus, want in ((0, ["gloo"] * 4), (1, ["nccl", "gloo", "gloo", "gloo"]),
                           (2, ["nccl", "nccl", "gloo", "gloo"]), (4, ["nccl"] * 4)):
            with unittest.mock.patch.object(torch.cuda, "is_available", return_value=gpus > 0), \
                    unittest.mock.patch.object(torch.cuda, "device_count", return_value=gpus), \
                    unittest.mock.patch.object(dist, "is_nccl_available", return_value=True):
                self.assertEqual([dist_utils.backend_for(w) for w in (1, 2, 3, 4)], want)
                if gpus < 2:
                    with self.assertRaisesRegex(ValueError, f"backend='nccl' with 2 ranks needs "
                                                            f"2 GPUs; torch sees {gpus}"):
                        dist_utils.run_distributed(_sleep_forever, 2, backend="nccl")
        self.assertEqual(multiprocessing.active_children(), [])

    def test_shared_launches_group_by_world_and_backend(self):
        """One run_distributed per (world, backend), on first need, its checks in registration
        order; the sum of their timeouts, the largest pg_timeout; a failed launch fails every
        one of its checks, naming them; duplicate names are refused."""
        launches = dist_utils.SharedLaunches()
        launches.add("a", 2, _default_device, 1, timeout=10)
        launches.add("b", 1, _default_device)
        launches.add("c", 2, _default_device, timeout=20, pg_timeout=50)
        launches.add("d", 2, _default_device, backend="nccl")
        with self.assertRaisesRegex(ValueError, "'a' is already registered"):
            launches.add("a", 2, _default_device)
        calls = []

        def fake(fn, world, checks, timeout, backend, pg_timeout):
            calls.append((world, [(n, a) for n, _, a in checks], timeout, backend, pg_timeout))
            if backend == "nccl":
                raise dist_utils.RankFailedError("rank 1 of 2 failed in _run_checks: boom")
            return [{n: (n, rank) for n, _, _ in checks} for rank in range(world)]

        with unittest.mock.patch.object(dist_utils, "run_distributed", side_effect=fake), \
                unittest.mock.patch.object(dist_utils, "backend_for", return_value="gloo"):
            self.assertEqual(launches.result("c"), [("c", 0), ("c", 1)])
            self.assertEqual(launches.result("a"), [("a", 0), ("a", 1)])
            self.assertEqual(launches.result("b"), [("b", 0)])
            for _ in range(2):
                with self.assertRaisesRegex(dist_utils.RankFailedError,
                                            r"shared launch of \['d'\] on 2 nccl ranks: rank 1 "
                                            r"of 2 failed in _run_checks: boom"):
                    launches.result("d")
        self.assertEqual(calls, [(2, [("a", (1,)), ("c", ())], 30, "gloo", 50),
                                 (1, [("b", ())], 120.0, "gloo", 120.0),
                                 (2, [("d", ())], 120.0, "nccl", 120.0)])

    def test_run_checks_reseeds_and_names_the_failing_check(self):
        """The launch's rank function: each check from a fresh process's generator state (the
        same draws as in a launch of its own), results by name, a failure naming its check."""
        state = torch.get_rng_state()  # _run_checks reseeds this process's generator
        try:
            out = dist_utils._run_checks(0, 1, [("x", _draw, ()), ("y", _draw, ())])
            self.assertEqual(set(out), {"x", "y"})
            self.assertTrue(torch.equal(out["x"], out["y"]))
            with self.assertRaisesRegex(RuntimeError, r"check 'bad' \(_fail_on_rank_one\) failed "
                                                      r"on rank 1 of 2") as cm:
                dist_utils._run_checks(1, 2, [("bad", _fail_on_rank_one, ())])
            self.assertRegex(str(cm.exception.__cause__), "deliberate failure on rank 1")
        finally:
            torch.set_rng_state(state)

    def test_gloo_ranks_compute_on_cpu(self):
        self.assertEqual(dist_utils.run_distributed(_default_device, 2, backend="gloo"),
                         ["cpu", "cpu"])

    def test_failing_rank_fails_promptly_with_its_traceback(self):
        import time
        timeout = 300.0
        start = time.monotonic()
        with self.assertRaisesRegex(dist_utils.RankFailedError,
                                    "(?s)rank 1 of 2 failed.*deliberate failure on rank 1"):
            dist_utils.run_distributed(_fail_on_rank_one, 2, timeout=timeout)
        # Ended by rank 1's error, not the timeout; the bound is wide because spawning two
        # torch processes on a host busy with other test workers takes tens of seconds.
        self.assertLess(time.monotonic() - start, timeout / 2)
        self.assertEqual(multiprocessing.active_children(), [])  # every rank reaped

    def test_timeout(self):
        with self.assertRaisesRegex(dist_utils.RankTimeoutError, "did not finish in 4 s"):
            dist_utils.run_distributed(_sleep_forever, 2, timeout=4)
        self.assertEqual(multiprocessing.active_children(), [])


if __name__ == "__main__":
    absltest.main()
