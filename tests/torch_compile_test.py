"""torch.compile: sparse_attention, SparseAttention and HybridBlock trace with fullgraph=True (no
graph break: one compiled frame), forward and backward as in eager.

The attention enters the graph as the operators ``sparsetp.attention`` /
``sparsetp.attention_backward`` (``backends/torch/attention.py``). With the ``aot_eager`` backend
the compiled program runs the very same kernels and torch ops as eager, so results must be
bitwise equal; with inductor the surrounding ops may be fused differently (float32 tolerance).
CPU classes always run (the kernels in Triton's interpreter); the CUDA class needs a GPU and adds
``mode="reduce-overhead"`` (CUDA graphs). Tensor parallelism: TP=2 over gloo (NCCL with 2 GPUs),
with and without sequence parallelism.
"""

from __future__ import annotations

import unittest

import numpy as np
import testing_utils as tu
import torch
from absl.testing import absltest, parameterized
from dist_utils import SharedLaunches, backend_for
from torch._dynamo.testing import AotEagerAndRecordGraphs, CompileCounterWithBackend

from sparsetp.backends.torch import comm
from sparsetp.backends.torch.attention import SparseAttention, sparse_attention
from sparsetp.core import HybridConfig, init_params, make_layout
from sparsetp.core import patterns as P
from sparsetp.torch import HybridBlock

_PATTERN = P.causal() & P.local(40, 0) | P.global_tokens(8)


def _inputs(shape, device, seed=0, grad=True):
    rng = np.random.default_rng(seed)
    out = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device)
           for _ in range(4)]
    if grad:
        for t in out[:3]:
            t.requires_grad_(True)
    return out


def _fwd_bwd(fn, q, k, v, g):
    """Output and input gradients of ``fn(q, k, v)`` for the cotangent ``g`` (fresh leaves)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    if isinstance(out, tuple):  # (out, lse): a cotangent on both
        out, lse = out
        (out * g).sum().backward(retain_graph=True)
        torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()
    else:
        (out * g).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _block_fwd_bwd(block, x, g, autocast=False, **kw):
    x = x.detach().clone().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = block(x, **kw)
    (y.float() * g).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for _, p in block.named_parameters()]


class _CompileTestBase(parameterized.TestCase):
    device = "cpu"

    def setUp(self):
        super().setUp()
        torch._dynamo.reset()

    def assert_bitwise(self, actual, expected):
        self.assertEqual(len(actual), len(expected))
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            self.assertTrue(torch.equal(a, e), f"entry {i}: max |diff| "
                            f"{(a.float() - e.float()).abs().max().item()}")

    def _compile(self, fn, backend="aot_eager", **kw):
        counter = CompileCounterWithBackend(backend) if isinstance(backend, str) else backend
        return torch.compile(fn, fullgraph=True, backend=counter, **kw), counter

    @parameterized.parameters(False, True)
    def test_function_is_one_graph_and_matches_eager(self, return_lse):
        lay = make_layout(_PATTERN, seq_len=96, num_heads=2, block_size=32)
        q, k, v, g = _inputs((2, 2, 96, 32), self.device)

        def fn(q, k, v):
            return sparse_attention(q, k, v, lay, return_lse=return_lse)

        backend = AotEagerAndRecordGraphs()
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        self.assert_bitwise(_fwd_bwd(compiled, q, k, v, g), _fwd_bwd(fn, q, k, v, g))
        self.assertLen(backend.graphs, 1)  # fullgraph: a break would have raised
        self.assertIn("sparsetp.attention.default", str(backend.fw_graphs[0].code))
        self.assertIn("sparsetp.attention_backward.default", str(backend.bw_graphs[0].code))

    def test_a_new_layout_argument_recompiles(self):
        q, k, v, _ = _inputs((1, 2, 64, 16), self.device, grad=False)
        layouts = [make_layout(p, 64, 2, 32) for p in (P.causal(), P.local(5, 5))]
        compiled, counter = self._compile(lambda q, k, v, lay: sparse_attention(q, k, v, lay))
        for lay in (*layouts, layouts[0]):
            self.assertTrue(torch.equal(compiled(q, k, v, lay), sparse_attention(q, k, v, lay)))
        self.assertEqual(counter.frame_count, 2)  # the third call reuses the first graph

    def test_module_follows_the_sequence_length(self):
        attn = SparseAttention(_PATTERN, block_size=32)
        compiled, _ = self._compile(attn)
        for n, b in ((64, 1), (96, 2), (64, 3)):
            q, k, v, g = _inputs((b, 2, n, 16), self.device, seed=n + b)
            self.assert_bitwise(_fwd_bwd(compiled, q, k, v, g), _fwd_bwd(attn, q, k, v, g))

    @parameterized.parameters(False, True)
    def test_hybrid_block(self, autocast):
        cfg = HybridConfig(d_model=64, num_heads=2, d_ff=128, pattern=_PATTERN, block_size=32)
        block = HybridBlock.from_params(cfg, init_params(cfg, seed=0)).to(self.device)
        x, g = (t[:, 0] for t in _inputs((2, 1, 96, 64), self.device, grad=False)[:2])
        compiled, counter = self._compile(block)
        self.assert_bitwise(_block_fwd_bwd(compiled, x, g, autocast),
                            _block_fwd_bwd(block, x, g, autocast))
        self.assertEqual(counter.frame_count, 1)

    def test_per_batch_row_layout_is_one_graph(self):
        """A per-batch-row layout (each row its own packed documents): batch folded into heads
        inside the graph, one graph, bitwise the eager result (forward and gradients)."""
        lay = make_layout(P.documents([[30, 66], [96]]) & _PATTERN, 96, 2, 32)
        q, k, v, g = _inputs((2, 2, 96, 32), self.device, seed=3)

        def fn(q, k, v):
            return sparse_attention(q, k, v, lay)

        compiled, counter = self._compile(fn)
        self.assert_bitwise(_fwd_bwd(compiled, q, k, v, g), _fwd_bwd(fn, q, k, v, g))
        self.assertEqual(counter.frame_count, 1)

    def test_hybrid_block_document_lengths(self):
        """HybridBlock(x, document_lengths=...) compiles to one graph per lengths value (Python
        ints are graph constants: a new packing is a new graph, never a new kernel), each
        bitwise the eager block; a repeated value reuses its graph."""
        cfg = HybridConfig(d_model=64, num_heads=2, d_ff=128, pattern=_PATTERN, block_size=32)
        block = HybridBlock.from_params(cfg, init_params(cfg, seed=0)).to(self.device)
        x, g = (t[:, 0] for t in _inputs((2, 1, 96, 64), self.device, grad=False)[:2])
        compiled, counter = self._compile(block)
        packings = ([[30, 66], [96]], [40, 56], [[30, 66], [96]])
        for lengths in packings:
            self.assert_bitwise(_block_fwd_bwd(compiled, x, g, document_lengths=lengths),
                                _block_fwd_bwd(block, x, g, document_lengths=lengths))
        self.assertEqual(counter.frame_count, 2)

    def test_inductor_matches_eager(self):
        lay = make_layout(_PATTERN, seq_len=96, num_heads=2, block_size=32)
        q, k, v, g = _inputs((1, 2, 96, 32), self.device)

        def fn(q, k, v):
            return torch.nn.functional.gelu(sparse_attention(q * 0.5, k, v, lay))

        compiled, counter = self._compile(fn, backend="inductor")
        for a, e in zip(_fwd_bwd(compiled, q, k, v, g), _fwd_bwd(fn, q, k, v, g), strict=True):
            tu.assert_close(a.detach().cpu().numpy(), e.detach().cpu().numpy(), "float32",
                            grad=True)
        self.assertEqual(counter.frame_count, 1)

    def test_operator_registration(self):
        lay = make_layout(_PATTERN, seq_len=64, num_heads=2, block_size=32)
        q, k, v, _ = _inputs((1, 2, 64, 16), self.device)
        torch.library.opcheck(torch.ops.sparsetp.attention.default,
                              (q, k, v, lay.handle, 0.25),
                              test_utils=("test_schema", "test_faketensor",
                                          "test_autograd_registration"))


class CpuCompileTest(_CompileTestBase):
    device = "cpu"


class CudaCompileTest(_CompileTestBase):
    device = "cuda"

    def setUp(self):
        if not torch.cuda.is_available():
            raise unittest.SkipTest("needs a CUDA GPU")
        super().setUp()

    def test_reduce_overhead_mode(self):
        """CUDA graphs (inductor's cudagraph trees) around the attention, forward and backward,
        over several steps (the first ones warm up, later ones replay)."""
        lay = make_layout(_PATTERN, seq_len=256, num_heads=2, block_size=64)

        def fn(q, k, v):
            return sparse_attention(q, k, v, lay) * 2.0

        compiled = torch.compile(fn, fullgraph=True, mode="reduce-overhead")
        for step in range(4):
            q, k, v, g = _inputs((1, 2, 256, 64), self.device, seed=step)
            for a, e in zip(_fwd_bwd(compiled, q, k, v, g), _fwd_bwd(fn, q, k, v, g),
                            strict=True):
                tu.assert_close(a.detach().cpu().numpy(), e.detach().cpu().numpy(), "float32",
                                grad=True)


del _CompileTestBase  # a base only: its tests run in the device classes above


# ----------------------------------------------------------------------------- TP=2
def _compiled_block_rank(rank, world, sequence_parallel, outside_graph):
    """Compiled vs eager TP block on this rank. ``outside_graph``: the Functions run outside
    the graph, as on torch < 2.13 (``comm.TRACES_FUNCTIONS``): compiled without fullgraph."""
    from sparsetp.backends.torch import comm, layers  # noqa: PLC0415

    # One launch runs every case (SharedLaunches): each compiles afresh, as the in-process
    # classes' setUp does, and leaves the Functions as it found them.
    torch._dynamo.reset()
    real = comm.apply_function, layers.apply_function
    if outside_graph:
        gated = torch.compiler.disable(comm.apply_function)
        comm.apply_function = layers.apply_function = gated
    try:
        return _compiled_block_case(rank, world, sequence_parallel, outside_graph)
    finally:
        comm.apply_function, layers.apply_function = real


def _compiled_block_case(rank, world, sequence_parallel, outside_graph):
    cfg = HybridConfig(d_model=64, num_heads=2, d_ff=128, pattern=_PATTERN, block_size=32)
    device = torch.get_default_device()
    block = HybridBlock.from_params(cfg, init_params(cfg, seed=0),
                                    sequence_parallel=sequence_parallel).to(device)
    rng = np.random.default_rng(1)
    x, g = (torch.from_numpy(rng.standard_normal((2, 96, 64)).astype(np.float32)).to(device)
            for _ in range(2))
    if sequence_parallel:
        x, g = (t.chunk(world, 1)[rank].contiguous() for t in (x, g))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=not outside_graph, backend=counter)
    got = _block_fwd_bwd(compiled, x, g)
    want = _block_fwd_bwd(block, x, g)
    return (counter.frame_count,
            [bool(torch.equal(a, e)) for a, e in zip(got, want, strict=True)])


class DistributedCompileTest(parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        """The four TP=2 cases in one launch of 2 ranks (SharedLaunches): spawning and warming
        up the compiler cost more than a case."""
        super().setUpClass()
        cls.launches = SharedLaunches()
        for outside_graph in (False, True):
            if not (outside_graph or comm.TRACES_FUNCTIONS):
                continue  # the in-graph test skips itself
            for sequence_parallel in (False, True):
                cls.launches.add(f"sp{sequence_parallel}_outside{outside_graph}", 2,
                                 _compiled_block_rank, sequence_parallel, outside_graph,
                                 backend=backend_for(2), timeout=600)

    @parameterized.parameters(False, True)
    def test_tp2_block_is_one_graph_and_bitwise_eager(self, sequence_parallel):
        if not comm.TRACES_FUNCTIONS:
            self.skipTest(f"torch {torch.__version__} runs the TP Functions outside the graph "
                          "(comm.TRACES_FUNCTIONS); test_tp2_functions_outside_the_graph covers it")
        results = self.launches.result(f"sp{sequence_parallel}_outsideFalse")
        self.assertLen(results, 2)
        for frames, equal in results:
            self.assertEqual(frames, 1)
            self.assertTrue(all(equal), equal)

    @parameterized.parameters(False, True)
    def test_tp2_functions_outside_the_graph(self, sequence_parallel):
        """The torch < 2.13 path (forced here on any version): graph breaks around the TP
        Functions, eager numbers."""
        results = self.launches.result(f"sp{sequence_parallel}_outsideTrue")
        self.assertLen(results, 2)
        for frames, equal in results:
            self.assertGreater(frames, 1)
            self.assertTrue(all(equal), equal)


if __name__ == "__main__":
    absltest.main()
