"""Sequence parallelism (``sequence_parallel=True``) of the PyTorch TP layers, on 2 and 4
processes, against the float64 oracle and against plain tensor parallelism. Processes follow the
suite's rule (``tests/dist_utils.py``): NCCL with one GPU per rank when torch sees enough GPUs,
else gloo with CPU ranks.

Every rank builds the same unsharded float64 problem (same seeds) and feeds its contiguous
sequence shard (tokens ``[r T / tp, (r + 1) T / tp)``) to the SP layer, then checks, for a
random cotangent shard:

* output shard and input-gradient shard == this rank's tokens of the oracle's output and input
  gradient, and every parameter gradient == this rank's shard (``sparsetp.core.shard_param``) of
  the oracle's: the replicated ones (layer norms, row biases) as the FULL sum on every rank,
  which is what the ``copy_to_region`` inside the SP layers promises;
* the same numbers agree with the plain-TP layer (``sequence_parallel=False``) run on the full
  sequence, much more tightly than with the oracle;
* ``overlap_comm=True`` (re-gather + async reduce-scatter) is **bitwise** ``overlap_comm=False``;
* the collectives issued (count, kind, message size) and the overlapped backward's schedule.

Tolerances: the oracle comparisons use ``tests/testing_utils.py`` unchanged (float32 atol 2e-5,
float64 1e-10, rtol atol/10, gradients 2x; parameter gradients summed over T tokens get the
helper's ``reduced=T``). SP vs plain TP differ only in float summation order (reduce-scatter vs
all-reduce; per-shard sums of the replicated-parameter gradients then an all-reduce), a few ulp,
so they are compared with ``CROSS_ATOL`` (float32 1e-5, float64 1e-13; rtol atol/10, gradients
2x, token-summed gradients sqrt(T)x, as above), the TP-invariance tolerance of
``tests/torch_tp_test.py`` and ~1000x below the O(0.01-1) error of a wrong shard, a missing
collective or a bias gradient summed on one shard only.

Runtime on 2 CPU cores: ~5 s (one launch of 2 ranks runs every TP 2 check, the collective
counts included) + ~10 s (TP 4), mostly spawning and importing; shapes are small for the
hybrid blocks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import unittest

import numpy as np
import torch
import torch.distributed as dist
from absl.testing import absltest, parameterized

from sparsetp.backends.torch.block import HybridBlock
from sparsetp.backends.torch.comm import (
    all_gather_to_region,
    copy_many_to_region,
    gather_from_sequence_region,
    reduce_scatter_from_region,
    scatter_to_sequence_region,
)
from sparsetp.backends.torch.layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear
from sparsetp.core import HybridConfig, init_params, param_shapes, reference, shard_param
from sparsetp.core import patterns as P

try:  # pytest puts tests/ on sys.path (no package); a package layout reaches it as tests.*
    import dist_utils
    from testing_utils import assert_close
except ImportError:  # pragma: no cover
    from tests import dist_utils
    from tests.testing_utils import assert_close

TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64}
CROSS_ATOL = {"float32": 1e-5, "float64": 1e-13}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _t(a, dtype, grad=False):
    return torch.tensor(a, dtype=TORCH_DTYPE[dtype], requires_grad=grad)


def _seq_shard(a, rank, world, dim=-2):
    """This rank's contiguous tokens of the numpy array ``a``."""
    n = a.shape[dim] // world
    return np.take(a, np.arange(rank * n, (rank + 1) * n), axis=dim)


def _cols(a, rank, world, dim=-1):
    return _seq_shard(a, rank, world, dim)


def _oracle(actual, expected, dtype, what, grad=False, reduced=1):
    assert_close(_np(actual), expected, dtype, grad=grad, reduced=reduced, what=what)


def _agree(actual, expected, dtype, what, grad=False, reduced=1):
    """SP vs plain TP: only summation order differs (see the module docstring)."""
    atol = CROSS_ATOL[dtype] * (2 if grad else 1)
    np.testing.assert_allclose(_np(actual), _np(expected), atol=atol * np.sqrt(reduced),
                               rtol=atol / 10, err_msg=what)


def _fwd_bwd(module, x, dy, **kw):
    """Output, input gradient and every parameter gradient of one forward+backward."""
    module.zero_grad(set_to_none=True)
    xt = x.detach().clone().requires_grad_(True)
    y = module(xt, **kw)
    y.backward(dy)
    return [y.detach(), xt.grad] + [p.grad for p in module.parameters()]


def _assert_bitwise(a, b, what):
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert u.dtype == v.dtype and u.shape == v.shape, (what, i, u.shape, v.shape)
        if not torch.equal(u, v):
            raise AssertionError(f"{what}: tensor {i} differs, max |diff| "
                                 f"{(u.double() - v.double()).abs().max().item():.3e}")


# ---------------------------------------------------------------------------------------------
# Rank functions (module level: pickled by name into the spawned processes). They create
# tensors on torch's default device, which the harness sets per rank: cuda:<rank> under NCCL,
# cpu under gloo.


def _check_comm(rank, world):
    """The four SP mappings, forward and backward, on integer-valued float64 tensors (every sum
    is exact, so the checks are bitwise whatever order a backend sums in); batch 1 (the
    gathered buffer is a view) and batch 3 (rank-major buffers are copied), 2-D and 3-D."""
    for shape in ((1, 2, 3), (3, 2, 3), (2, 3)):
        t = shape[-2]
        full_shape = (*shape[:-2], t * world, shape[-1])

        def ints(seed, shp=full_shape):  # on torch's default device (cuda:<rank> under NCCL)
            return torch.tensor(np.random.default_rng(seed).integers(-50, 50, shp),
                                dtype=torch.float64)

        own = slice(rank * t, (rank + 1) * t)
        # all_gather_to_region: every rank's shard is its tokens of `full`.
        full = ints(0)
        x = full[..., own, :].clone().requires_grad_(True)
        y = all_gather_to_region(x)
        assert torch.equal(y.detach(), full), "all-gather concatenates in rank order"
        grads = [ints(10 + r) for r in range(world)]  # rank r's (partial) gradient
        y.backward(grads[rank])
        assert torch.equal(x.grad, sum(grads)[..., own, :]), "backward reduce-scatters"

        # reduce_scatter_from_region: the sum over ranks, this rank's tokens.
        parts = [ints(20 + r) for r in range(world)]
        z = parts[rank].clone().requires_grad_(True)
        s = reduce_scatter_from_region(z)
        assert torch.equal(s.detach(), sum(parts)[..., own, :]), "reduce-scatter"
        gs = [ints(30 + r, s.shape) for r in range(world)]
        s.backward(gs[rank])
        assert torch.equal(z.grad, torch.cat(gs, dim=-2)), "backward all-gathers"

        # scatter_to / gather_from_sequence_region: replicated <-> shards.
        w = full.clone().requires_grad_(True)
        sh = scatter_to_sequence_region(w)
        assert torch.equal(sh.detach(), full[..., own, :])
        sh.backward(gs[rank])
        assert torch.equal(w.grad, torch.cat(gs, dim=-2)), "scatter backward all-gathers"
        v = full[..., own, :].clone().requires_grad_(True)
        g = gather_from_sequence_region(v)
        assert torch.equal(g.detach(), full)
        g.backward(grads[0])  # the same (replicated) cotangent on every rank
        assert torch.equal(v.grad, grads[0][..., own, :]), "gather backward keeps own tokens"

    # copy_many_to_region: identity forward; each gradient summed over ranks, one all-reduce
    # per dtype (float64 twice, float32 once, one unused: its gradient is zero).
    ts = [ints(40 + i, shp).to(dt).requires_grad_(True) for i, (shp, dt) in enumerate(
        [((3,), torch.float64), ((2, 2), torch.float32), ((4, 1), torch.float64),
         ((2,), torch.float32)])]
    frozen = ints(49, (5,))  # no grad: returned as is, not reduced
    with _recording() as calls:
        *views, same = copy_many_to_region([*ts, frozen])
        assert same is frozen
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(views, ts, strict=True))
        cots = [[ints(50 + 10 * r + i, t.shape).to(t.dtype) for i, t in enumerate(ts)]
                for r in range(world)]
        sum((u * c).sum() for u, c in zip(views[:3], cots[rank][:3], strict=True)).backward()
    for i, t in enumerate(ts[:3]):
        assert torch.equal(t.grad, sum(c[i] for c in cots)), f"tensor {i}: the sum over ranks"
    assert torch.equal(ts[3].grad, torch.zeros(2)), "an unused tensor's gradient is zero"
    assert sorted(calls) == [("all_reduce", 6), ("all_reduce", 7)], calls
    # Each gradient owns its storage (not a view of the all-reduced buffer).
    ptrs = {t.grad.untyped_storage().data_ptr() for t in ts}
    assert len(ptrs) == len(ts), "gradients share a buffer"
    try:
        copy_many_to_region([ts[0], None])
    except ValueError as e:
        assert "tensors[1] must be a torch.Tensor" in str(e), e
    else:
        raise AssertionError("None in tensors was accepted")
    return True


def _check_bad_sizes(rank, world):
    tc = unittest.TestCase()
    bad = torch.zeros(2, 4 * world + 1, 8)  # no TP size > 1 divides 4 world + 1
    n = bad.shape[1]
    msg = f"dim -2 of x \\(length {n}\\) over the tensor-parallel size {world}"
    with tc.assertRaisesRegex(ValueError, msg):
        scatter_to_sequence_region(bad)
    with tc.assertRaisesRegex(ValueError, msg):
        reduce_scatter_from_region(bad)
    with tc.assertRaisesRegex(ValueError, msg):  # the row layer's reduce-scatter of its output
        RowParallelLinear(8 * world, 8, sequence_parallel=True)(torch.zeros(2, n, 8))
    # An SP block takes shards; a full [B, N, d] input is sharded by scatter_to_sequence_region
    # (the docstring's recipe), which names N and the TP size when N does not split.
    with tc.assertRaisesRegex(ValueError, f"length 65\\) over the tensor-parallel size {world}"):
        scatter_to_sequence_region(torch.zeros(1, 65, 64))
    return True


def _check_linears(rank, world, dtype):
    rng = np.random.default_rng(0)  # same draws on every rank: the unsharded problem
    b_, t, d_in, d_out = 2, 4 * world, 16, 24
    x = rng.standard_normal((b_, t, d_in))
    w, bias = rng.standard_normal((d_in, d_out)) / 4, rng.standard_normal(d_out)
    dy = rng.standard_normal((b_, t, d_out))
    tokens = b_ * t
    dx_ref = dy @ w.T
    dw_ref = np.einsum("bti,bto->io", x, dy)

    for gather in (False, True):
        for overlap in (True, False):
            what = f"column SP gather={gather} overlap={overlap} {dtype}"
            lin = ColumnParallelLinear(d_in, d_out, gather_output=gather, overlap_comm=overlap,
                                       sequence_parallel=True, dtype=TORCH_DTYPE[dtype])
            lin.load_unsharded(w, bias)
            xt = _t(_seq_shard(x, rank, world), dtype, grad=True)
            y = lin(xt)  # the FULL sequence: [B, T, out / tp] or gathered [B, T, out]
            y_ref = x @ w + bias
            _oracle(y, y_ref if gather else _cols(y_ref, rank, world), dtype, f"{what} y")
            y.backward(_t(dy if gather else _cols(dy, rank, world), dtype))
            _oracle(xt.grad, _seq_shard(dx_ref, rank, world), dtype, f"{what} dx", grad=True)
            _oracle(lin.weight.grad, _cols(dw_ref, rank, world), dtype, f"{what} dw", True,
                    tokens)
            _oracle(lin.bias.grad, _cols(dy.sum((0, 1)), rank, world), dtype, f"{what} db",
                    True, tokens)

    # Row SP: [B, T, in / tp] column slice in, [B, T / tp, out] token shard out.
    w2, b2 = w.T.copy(), rng.standard_normal(d_in)
    x2, dy2 = dy, rng.standard_normal((b_, t, d_in))
    lin = RowParallelLinear(d_out, d_in, sequence_parallel=True, dtype=TORCH_DTYPE[dtype])
    lin.load_unsharded(w2, b2)
    xt = _t(_cols(x2, rank, world), dtype, grad=True)
    y = lin(xt)
    _oracle(y, _seq_shard(x2 @ w2 + b2, rank, world), dtype, f"row SP y {dtype}")
    y.backward(_t(_seq_shard(dy2, rank, world), dtype))
    _oracle(xt.grad, _cols(dy2 @ w2.T, rank, world), dtype, f"row SP dx {dtype}", grad=True)
    _oracle(lin.weight.grad, _seq_shard(np.einsum("bti,bto->io", x2, dy2), rank, world, 0),
            dtype, f"row SP dw {dtype}", True, tokens)
    # The replicated bias saw only this rank's tokens; its .grad is the full sum everywhere.
    _oracle(lin.bias.grad, dy2.sum((0, 1)), dtype, f"row SP db {dtype}", True, tokens)
    return True


def _mlp_names():
    return ("mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")


def _check_mlp(rank, world, dtype, bias):
    cfg = HybridConfig(d_model=16, num_heads=4, d_ff=32, pattern=P.causal(), block_size=16,
                       dtype=dtype, bias=bias)
    params = {k: v.astype(np.float64) for k, v in init_params(cfg, 1).items()}
    rng = np.random.default_rng(2)
    b_, t = 2, 3 * world
    x, dy = rng.standard_normal((b_, t, 16)), rng.standard_normal((b_, t, 16))
    y_ref = reference.mlp(params, x)
    dx_ref, grads_ref = reference.mlp_grad(params, x, dy)
    names = _mlp_names()
    kw = dict(bias=bias, dtype=TORCH_DTYPE[dtype], seed=None)
    plain = ParallelMLP(16, 32, **kw)
    plain.load_unsharded(*(params.get(n) for n in names))
    want = _fwd_bwd(plain, _t(x, dtype), _t(dy, dtype))
    x_shard, dy_shard = (_t(_seq_shard(a, rank, world), dtype) for a in (x, dy))
    own = slice(rank * 3, (rank + 1) * 3)
    runs = {}
    for overlap in (True, False):
        sp = ParallelMLP(16, 32, overlap_comm=overlap, sequence_parallel=True, **kw)
        sp.load_unsharded(*(params.get(n) for n in names))
        got = runs[overlap] = _fwd_bwd(sp, x_shard, dy_shard)
        what = f"SP mlp bias={bias} overlap={overlap} {dtype}"
        _oracle(got[0], _seq_shard(y_ref, rank, world), dtype, f"{what} y")
        _oracle(got[1], _seq_shard(dx_ref, rank, world), dtype, f"{what} dx", grad=True)
        _agree(got[0], want[0][:, own], dtype, f"{what} y vs plain")
        _agree(got[1], want[1][:, own], dtype, f"{what} dx vs plain", True)
        present = [(n, g) for n, g in zip(names, grads_ref, strict=True) if g is not None]
        assert len(present) == len(got) - 2, what
        for (name, g), p_grad, p_plain in zip(present, got[2:], want[2:], strict=True):
            _oracle(p_grad, shard_param(name, g, cfg, rank, world), dtype, f"{what} d{name}",
                    True, b_ * t)
            _agree(p_grad, p_plain, dtype, f"{what} d{name} vs plain", True, b_ * t)
        with torch.no_grad():  # determinism: bitwise the same output again
            assert torch.equal(sp(x_shard), got[0]), what
    _assert_bitwise(runs[True], runs[False], f"SP mlp overlap vs not, bias={bias} {dtype}")
    return True


def _block_config(dtype="float32"):
    # N=64 in 16-token tiles with a BigBird of 16-token blocks (window 3, 1 global, 1 random):
    # full, partial and empty tiles; d=64, 4 heads of 16 (1 head per rank at TP 4). Small for
    # the interpreter (~1.5 s of fwd+bwd per rank on 2 cores).
    return HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.bigbird(16, 3, 1, 1, seed=3),
                        block_size=16, dtype=dtype)


def _check_block(rank, world, dtype, overlap_both):
    """SP block vs the oracle and vs the plain-TP block; optionally SP overlap vs no overlap,
    bitwise. Returns this rank's output shard."""
    cfg = _block_config(dtype)
    params = init_params(cfg, 11)
    rng = np.random.default_rng(12)
    b_, n = 1, 64
    x, dy = rng.standard_normal((b_, n, cfg.d_model)), rng.standard_normal((b_, n, cfg.d_model))
    y_ref, dx_ref, dparams_ref = reference.hybrid_block_value_and_grad(params, x, cfg, dy)

    plain = _fwd_bwd(HybridBlock.from_params(cfg, params), _t(x, dtype), _t(dy, dtype))
    own = slice(rank * n // world, (rank + 1) * n // world)
    x_shard, dy_shard = (_t(_seq_shard(a, rank, world), dtype) for a in (x, dy))
    runs = {}
    for overlap in ((True, False) if overlap_both else (True,)):
        block = HybridBlock.from_params(cfg, params, overlap_comm=overlap, sequence_parallel=True)
        got = runs[overlap] = _fwd_bwd(block, x_shard, dy_shard)
        what = f"SP block overlap={overlap} {dtype}"
        _oracle(got[0], _seq_shard(y_ref, rank, world), dtype, f"{what} y")
        _oracle(got[1], _seq_shard(dx_ref, rank, world), dtype, f"{what} dx", grad=True)
        _agree(got[0], plain[0][:, own], dtype, f"{what} y vs plain")
        _agree(got[1], plain[1][:, own], dtype, f"{what} dx vs plain", grad=True)
        names = [name for name, _ in block.named_parameters()]
        assert set(names) == set(param_shapes(cfg)), names
        for name, p_grad, p_plain in zip(names, got[2:], plain[2:], strict=True):
            want = shard_param(name, dparams_ref[name], cfg, rank, world)
            assert tuple(p_grad.shape) == want.shape, (name, p_grad.shape, want.shape)
            _oracle(p_grad, want, dtype, f"{what} d{name}", True, b_ * n)
            _agree(p_grad, p_plain, dtype, f"{what} d{name} vs plain", True, b_ * n)
    if overlap_both:
        _assert_bitwise(runs[True], runs[False], f"SP block overlap vs not {dtype}")
    return _np(runs[True][0])


def _check_block_documents(rank, world):
    """SP block with per-row document lengths (each of 2 rows its own packing over all N
    tokens, while each rank holds N / tp of them) vs the oracle given the same lengths."""
    cfg = _block_config()
    params = init_params(cfg, 13)
    rng = np.random.default_rng(14)
    b_, n = 2, 64
    lengths = [[5, 40, 19], [64]]
    x, dy = rng.standard_normal((b_, n, cfg.d_model)), rng.standard_normal((b_, n, cfg.d_model))
    y_ref, dx_ref, dparams_ref = reference.hybrid_block_value_and_grad(params, x, cfg, dy,
                                                                       lengths)
    block = HybridBlock.from_params(cfg, params, sequence_parallel=True)
    x_shard, dy_shard = (_t(_seq_shard(a, rank, world), "float32") for a in (x, dy))
    got = _fwd_bwd(block, x_shard, dy_shard, document_lengths=lengths)
    _oracle(got[0], _seq_shard(y_ref, rank, world), "float32", "SP documents y")
    _oracle(got[1], _seq_shard(dx_ref, rank, world), "float32", "SP documents dx", grad=True)
    for (name, _), p_grad in zip(block.named_parameters(), got[2:], strict=True):
        _oracle(p_grad, shard_param(name, dparams_ref[name], cfg, rank, world), "float32",
                f"SP documents d{name}", True, b_ * n)
    return True


def _check_all(rank, world):
    """One spawn per TP size (spawning costs ~1-5 s on 2 cores): every check above."""
    _check_comm(rank, world)
    _check_bad_sizes(rank, world)
    for dtype in ("float32", "float64"):
        _check_linears(rank, world, dtype)
        _check_mlp(rank, world, dtype, bias=True)
    _check_mlp(rank, world, "float32", bias=False)
    # The block in float32 only: the attention kernel accumulates float64 inputs in float32
    # (kernels/attention.py), ~1e-8 from the float64 oracle with or without SP, so a float64
    # block cannot meet the float64 row of the table; the float64 SP path is the linears' and
    # the MLP's above.
    return _check_block(rank, world, "float32", overlap_both=world == 2)


# Every torch.distributed collective a layer could issue, under both spellings of the flat
# ones; a stray broadcast or extra gather shows up too.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
                "all_to_all", "all_to_all_single", "reduce")
_CANONICAL = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}


@contextlib.contextmanager
def _recording(extra=None):
    """Wrap the collectives of ``torch.distributed`` (in this spawned rank only); yield the list
    of ``(kind, elements)`` of every call in order: ``kind`` is ``all_reduce``, ``all_gather``
    or ``reduce_scatter`` (either spelling of the flat ones) with ``_async`` appended for
    ``async_op=True``; ``elements`` is the size of the full (unsharded) message. ``extra`` maps
    more ``(owner, attribute)`` to a label recorded on each call (GEMMs for the schedule test).
    ``sparsetp.backends.torch.comm`` looks the functions up at call time."""
    calls = []
    real = {(dist, n): getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def wrap(name, fn):
        def wrapped(*args, **kwargs):
            kind = _CANONICAL.get(name, name) + ("_async" if kwargs.get("async_op") else "")
            sizes = [a.numel() for a in args[:2] if isinstance(a, torch.Tensor)]
            calls.append((kind, max(sizes) if sizes else None))
            return fn(*args, **kwargs)
        return wrapped

    def label(text, fn):
        def wrapped(*args, **kwargs):
            calls.append(text)
            return fn(*args, **kwargs)
        return wrapped

    for (owner, name), fn in list(real.items()):
        setattr(owner, name, wrap(name, fn))
    for (owner, name), text in (extra or {}).items():
        real[owner, name] = getattr(owner, name)
        setattr(owner, name, label(text, real[owner, name]))
    try:
        yield calls
    finally:
        for (owner, name), fn in real.items():
            setattr(owner, name, fn)


def _count_collectives(rank, world):
    """Collectives of the SP MLP and SP block forward and backward, both overlap modes;
    returns ``{(layer, overlap, pass): [(kind, elements), ...]}``."""
    cfg = HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.causal(), block_size=16)
    nobias = dataclasses.replace(cfg, bias=False)
    params = init_params(cfg, 5)
    g = dist_utils.generator(3)
    x0, dy = (torch.randn(1, 32 // world, 64, generator=g) for _ in range(2))
    out = {}
    for overlap in (True, False):
        layers = {"mlp": ParallelMLP(64, 128, seed=1, overlap_comm=overlap,
                                     sequence_parallel=True),
                  "block": HybridBlock.from_params(cfg, params, overlap_comm=overlap,
                                                   sequence_parallel=True),
                  "block_nobias": HybridBlock.from_params(
                      nobias, init_params(nobias, 5), overlap_comm=overlap,
                      sequence_parallel=True)}
        for name, layer in layers.items():
            x = x0.clone().requires_grad_(True)
            with _recording() as fwd:
                y = layer(x)
            with _recording() as bwd:
                y.backward(dy)
            assert x.grad is not None and all(p.grad is not None for p in layer.parameters())
            out[name, overlap, "fwd"], out[name, overlap, "bwd"] = fwd, bwd
    return out


def _backward_schedule(rank, world, overlap):
    """Order of GEMMs and collectives in one SP column-linear backward. ``torch.matmul`` and
    ``Tensor.mm`` are recorded as ``gemm``; autograd's own matmul backward calls ATen directly
    and is invisible, so the plain path shows only its reduce-scatter."""
    lin = ColumnParallelLinear(8, 8, overlap_comm=overlap, sequence_parallel=True, seed=0)
    x = torch.randn(1, 4, 8, requires_grad=True)
    y = lin(x)
    gemms = {(torch, "matmul"): "gemm", (torch.Tensor, "mm"): "gemm"}
    with _recording(gemms) as events:
        y.backward(torch.randn(y.shape, generator=dist_utils.generator(1)))
    return [e if isinstance(e, str) else e[0] for e in events]


def _sp_and_counts(rank, world):
    return _count_collectives(rank, world), _backward_schedule(rank, world, True), \
        _backward_schedule(rank, world, False)


# ---------------------------------------------------------------------------------------------


class SingleProcessTest(parameterized.TestCase):
    """No process group: sequence parallelism over one rank is plain TP, bitwise."""

    def test_mappings_are_identity(self):
        x = torch.randn(2, 5, 4, requires_grad=True)
        for f in (all_gather_to_region, reduce_scatter_from_region, scatter_to_sequence_region,
                  gather_from_sequence_region):
            self.assertTrue(torch.equal(f(x), x))

    def test_sp_layers_equal_plain_layers(self):
        """One process: SP and plain layers compute the same thing. Not bitwise: the plain row
        layer adds its bias inside the GEMM (``layers._RowLinear``), the SP one after the
        reduce-scatter, so the two round differently; compared, like the distributed SP-vs-plain
        checks, with the cross-implementation tolerance ``CROSS_ATOL``."""
        g = torch.Generator().manual_seed(0)
        cases = []
        x, dy = (torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
        a, b = (ParallelMLP(8, 16, dtype=torch.float64, seed=2, sequence_parallel=sp)
                for sp in (True, False))
        cases.append(("single-process SP MLP", "float64", 10, a, b, x, dy))
        cfg = HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=P.causal(), block_size=16)
        x, dy = (torch.randn(1, 32, 32, generator=g) for _ in range(2))
        a, b = (HybridBlock(cfg, seed=4, sequence_parallel=sp) for sp in (True, False))
        cases.append(("single-process SP block", "float32", 32, a, b, x, dy))
        for what, dtype, tokens, a, b, x, dy in cases:
            got, want = _fwd_bwd(a, x, dy), _fwd_bwd(b, x, dy)
            self.assertEqual(len(got), len(want))
            _agree(got[0], want[0], dtype, f"{what} y")
            _agree(got[1], want[1], dtype, f"{what} dx", grad=True)
            for i, (u, v) in enumerate(zip(got[2:], want[2:], strict=True)):
                _agree(u, v, dtype, f"{what} param grad {i}", grad=True, reduced=tokens)
        self.assertIn("sequence_parallel=True", repr(a))

    def test_synced_bias_errors_name_the_argument(self):
        sp = RowParallelLinear(8, 4, sequence_parallel=True, seed=0)
        x = torch.randn(1, 3, 8)
        self.assertTrue(torch.equal(sp(x, synced_bias=sp.bias), sp(x)))
        cases = [(sp, torch.ones(1), "must have the bias's shape"),
                 (sp, sp.bias.double(), "must have the bias's shape"),
                 (sp, 3.0, "must be a torch.Tensor"),
                 (RowParallelLinear(8, 4, seed=0), torch.ones(4), "sequence_parallel=True"),
                 (RowParallelLinear(8, 4, bias=False, sequence_parallel=True, seed=0),
                  torch.ones(4), "has no bias")]
        for layer, bad, msg in cases:
            with self.assertRaisesRegex(ValueError, "synced_bias.*" + msg):
                layer(x, synced_bias=bad)
        mlp = ParallelMLP(8, 16, sequence_parallel=True, seed=0)
        with self.assertRaisesRegex(ValueError, "synced_bias must have"):
            mlp(x, synced_bias=torch.ones(2))

    def test_row_sp_needs_parallel_input(self):
        with self.assertRaisesRegex(ValueError, "sequence_parallel=True needs "
                                                "input_is_parallel=True"):
            RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True)


class DistributedSequenceParallelTest(parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        """Every check of one TP size (and backend) runs in one launch
        (``dist_utils.SharedLaunches``): spawning costs ~4 s per launch on 2 cores."""
        super().setUpClass()
        cls.launches = launches = dist_utils.SharedLaunches()
        for world in (2, 4):
            launches.add(f"all_tp{world}", world, _check_all, timeout=240)
        launches.add("documents", 2, _check_block_documents, timeout=240)
        launches.add("counts", 2, _sp_and_counts, timeout=120)

    @parameterized.parameters(2, 4)
    def test_matches_oracle_and_plain_tp(self, world):
        """Mappings, linears and MLP (fp32, fp64, with/without bias), the hybrid block (fp32)
        and the bad-size errors; overlap vs no overlap bitwise (MLP; block at TP 2)."""
        results = self.launches.result(f"all_tp{world}")
        self.assertLen(results, world)

    def test_block_document_lengths(self):
        """Per-row document lengths (over all N tokens) through the SP block at TP 2."""
        self.assertEqual(self.launches.result("documents"), [True, True])

    def _counts(self):
        return self.launches.result("counts")[0]

    def test_collective_budget(self):
        """At TP 2 (B=1, N=32, d=64): an SP region opens with one all-gather and closes with
        one reduce-scatter, each of the full [B, N, d] activation (together the bytes of plain
        TP's all-reduce on a ring); backward mirrors them. The replicated parameters trained on
        token shards add all-reduces of their gradients: the MLP's fc2.bias one of its d
        elements; the block's six (ln1.weight, ln1.bias, attn.out.bias, ln2.weight, ln2.bias,
        mlp.fc2.bias) one of 6 d elements for all of them. The overlapped column
        backward re-gathers its input (one more all-gather) and issues the gather and the
        reduce-scatter asynchronously. Nothing else runs."""
        counts = self._counts()[0]
        act, d = 32 * 64, 64
        ag, rs, ar = ("all_gather", act), ("reduce_scatter", act), ("all_reduce", d)
        ar6 = ("all_reduce", 6 * d)
        ag_async, rs_async = ("all_gather_async", act), ("reduce_scatter_async", act)
        want = {
            ("mlp", "fwd"): {False: [ag, rs], True: [ag, rs]},
            ("mlp", "bwd"): {False: [ar, ag, rs], True: [ar, ag, ag_async, rs_async]},
            ("block", "fwd"): {False: [ag, rs] * 2, True: [ag, rs] * 2},
            ("block", "bwd"): {False: [ar6] + [ag, rs] * 2,
                               True: [ar6] + [ag, ag_async, rs_async] * 2},
            # bias=False: only the four layer-norm parameters, 4 d elements.
            ("block_nobias", "fwd"): {False: [ag, rs] * 2, True: [ag, rs] * 2},
            ("block_nobias", "bwd"): {False: [("all_reduce", 4 * d)] + [ag, rs] * 2,
                                      True: [("all_reduce", 4 * d)]
                                      + [ag, ag_async, rs_async] * 2},
        }
        for (layer, pass_), per_mode in want.items():
            for overlap, calls in per_mode.items():
                got = counts[layer, overlap, pass_]
                # Compared as multisets: when autograd reaches the replicated parameters'
                # all-reduce is its business; the order that matters is checked below.
                self.assertEqual(collections.Counter(got), collections.Counter(calls),
                                 f"{layer} {pass_} overlap_comm={overlap}: {got}")

    def test_overlapped_backward_schedule(self):
        _, overlapped, plain = self._counts()
        # Start the input re-gather, compute d(x) meanwhile; then start the reduce-scatter of
        # d(x) and compute d(W) meanwhile.
        self.assertEqual(overlapped, ["all_gather_async", "gemm", "reduce_scatter_async",
                                      "gemm"])
        # Plain path: autograd's matmul backward (in ATen, not recorded) finishes both GEMMs,
        # then all_gather_to_region's backward reduce-scatters synchronously.
        self.assertEqual(plain, ["reduce_scatter"])


if __name__ == "__main__":
    absltest.main()
