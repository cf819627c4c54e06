"""JAX communication/computation overlap (``overlap_comm=True``) against the plain path and the
float64 oracle.

``overlap_comm`` rewrites the tensor-parallel collectives (``sparsetp.backends.jax.layers``):
with sequence parallelism the column layer's all-gather becomes an all-gather-matmul ring and
the row layer's reduce-scatter a matmul-reduce-scatter ring, both of ``ppermute`` s, whose
backward rings autodiff derives; without it the row layer all-reduces in ``comm_chunks`` token
chunks. Each case here runs both paths on the same problem on 2 and 4 shards (``shard_map``,
``check_vma=True``, under ``jit``) and compares the output, the input gradient and every weight
gradient for a random cotangent with the plain path and with :mod:`sparsetp.core.reference`.
The rings' classic bugs all give O(0.1-1) errors: a chunk written to the wrong token slot, an
accumulator that skips or doubles a shard, a ring that runs the wrong way, a bias added per
chunk before the reduction, a gradient ring that is not the transpose of the forward one.

Then the compiled HLO: the sequence-parallel overlap path moves activations only by
collective-permutes (no all-gather, reduce-scatter or all-reduce of activations), forward and
backward; the chunked path has one all-reduce per chunk in its jaxpr.

Tolerances: the shared table of ``tests/testing_utils.py`` (float32 atol 2e-5, rtol atol/10,
gradients 2x), as in ``tests/jax_tp_test.py`` and ``tests/jax_sp_test.py``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_test_utils as jtu  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_test_utils import count_primitives, rng_arrays  # noqa: E402
from testing_utils import assert_close  # noqa: E402

from sparsetp.backends.jax import block as B  # noqa: E402
from sparsetp.backends.jax.layers import (  # noqa: E402
    column_parallel_linear,
    parallel_mlp,
    row_parallel_linear,
)
from sparsetp.backends.jax.model import gpt, shard_gpt_params  # noqa: E402
from sparsetp.core import (  # noqa: E402
    GPTConfig,
    HybridConfig,
    init_gpt_params,
    init_params,
    reference,
)
from sparsetp.core.examples import example_pattern  # noqa: E402

TOKENS = P(None, "tp", None)  # [B, N, d] split along N: the SP activation layout


def _vjp(fn, args, dy):
    """``(y, grads)`` of ``fn(*args)`` for the cotangent ``dy`` (laid out as ``y``)."""
    y, vjp = jax.vjp(fn, *args)
    return np.asarray(y), [None if g is None else np.asarray(g)
                           for g in vjp(jax.device_put(dy, y.sharding))]


class OverlapLayersTest(parameterized.TestCase):
    """column/row-parallel linear and the parallel MLP, overlap_comm on vs off, 2 and 4 shards,
    with and without sequence parallelism."""

    d_in, d_out, tokens = 16, 32, 8  # 8 tokens: 4 or 2 per shard

    def _linear_problem(self, seed):
        return rng_arrays(seed, (2, self.tokens, self.d_in), (self.d_in, self.d_out),
                           (self.d_out,), (2, self.tokens, self.d_out))

    def _both(self, layer, in_specs, out_specs, args, dy, **kw):
        """``{overlap_comm: (y, grads)}`` of ``layer`` under shard_map on ``args``."""
        mesh = jtu.mesh(kw.pop("tp"))
        got = {}
        for overlap in (False, True):
            fn = jax.jit(jax.shard_map(functools.partial(layer, overlap_comm=overlap, **kw),
                                       mesh=mesh, in_specs=in_specs, out_specs=out_specs))
            got[overlap] = _vjp(fn, args, dy)
        return got

    def _assert_all_close(self, got, ref, names, label):
        (y, grads), (ref_y, ref_grads) = got, ref
        assert_close(y, ref_y, "float32", what=f"y {label}")
        for name, g, r in zip(names, grads, ref_grads, strict=True):
            if r is None:
                self.assertIsNone(g, name)
            else:
                assert_close(g, r, "float32", grad=True, what=f"{name} {label}")

    @parameterized.product(tp=(2, 4), sequence_parallel=(False, True))
    def test_column_parallel_linear(self, tp, sequence_parallel):
        x, w, b, dy = self._linear_problem(1)
        got = self._both(column_parallel_linear,
                         (TOKENS if sequence_parallel else P(), P(None, "tp"), P("tp")),
                         P(None, None, "tp"), (x, w, b), dy, tp=tp, axis_name="tp",
                         sequence_parallel=sequence_parallel)
        ref_dx, ref_dw, ref_db = reference._linear_grad(x.astype(np.float64),
                                                        w.astype(np.float64), dy, True)
        oracle = (x.astype(np.float64) @ w + b, (ref_dx, ref_dw, ref_db))
        label = f"tp={tp} sp={sequence_parallel}"
        self._assert_all_close(got[True], oracle, ("dx", "dw", "db"), f"overlap vs oracle {label}")
        self._assert_all_close(got[True], got[False], ("dx", "dw", "db"), f"vs plain {label}")
        if not sequence_parallel:  # nothing to decompose: the very same computation
            np.testing.assert_array_equal(got[True][0], got[False][0])

    @parameterized.product(tp=(2, 4), sequence_parallel=(False, True), bias=(True, False))
    def test_row_parallel_linear(self, tp, sequence_parallel, bias):
        x, w, b, dy = self._linear_problem(2)
        b = b if bias else None
        got = self._both(row_parallel_linear,
                         (P(None, None, "tp"), P("tp", None), P() if bias else None),
                         TOKENS if sequence_parallel else P(), (x, w, b), dy, tp=tp,
                         axis_name="tp", sequence_parallel=sequence_parallel)
        ref_dx, ref_dw, ref_db = reference._linear_grad(x.astype(np.float64),
                                                        w.astype(np.float64), dy, bias)
        oracle = (x.astype(np.float64) @ w + (b if bias else 0.0), (ref_dx, ref_dw, ref_db))
        label = f"tp={tp} sp={sequence_parallel} bias={bias}"
        # With SP each shard adds b to its own tokens: d b must come out summed over all shards.
        self._assert_all_close(got[True], oracle, ("dx", "dw", "db"), f"overlap vs oracle {label}")
        self._assert_all_close(got[True], got[False], ("dx", "dw", "db"), f"vs plain {label}")

    @parameterized.product(tp=(2, 4), sequence_parallel=(False, True), bias=(True, False))
    def test_parallel_mlp(self, tp, sequence_parallel, bias):
        d, ff = 16, 64
        x, w1, b1, w2, b2, dy = rng_arrays(3, (2, 8, d), (d, ff), (ff,), (ff, d), (d,), (2, 8, d))
        w1, w2 = w1 / np.sqrt(d), w2 / np.sqrt(ff)
        if not bias:
            b1 = b2 = None
        act = TOKENS if sequence_parallel else P()
        bias_spec = (lambda s: s) if bias else (lambda s: None)

        def mlp(x, w1, b1, w2, b2, **kw):
            return parallel_mlp(x, w1, b1, w2, b2, **kw)

        got = self._both(mlp, (act, P(None, "tp"), bias_spec(P("tp")), P("tp", None),
                               bias_spec(P())), act, (x, w1, b1, w2, b2), dy, tp=tp,
                         axis_name="tp", sequence_parallel=sequence_parallel)
        ref_dx, ref_g = reference.mlp_grad((w1, b1, w2, b2), x, dy)
        oracle = (reference.mlp((w1, b1, w2, b2), x), (ref_dx, *ref_g))
        names = ("dx", "dw1", "db1", "dw2", "db2")
        label = f"tp={tp} sp={sequence_parallel} bias={bias}"
        self._assert_all_close(got[True], oracle, names, f"overlap vs oracle {label}")
        self._assert_all_close(got[True], got[False], names, f"vs plain {label}")

    @parameterized.parameters(1, 2, 4)
    def test_comm_chunks(self, comm_chunks):
        """The chunked all-reduce: one psum per chunk forward, none backward (the cotangent is
        replicated), same values as one psum."""
        x, w, b, dy = self._linear_problem(4)
        mesh = jtu.mesh(2)
        specs = dict(mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None), P()),
                     out_specs=P())
        plain = jax.jit(jax.shard_map(functools.partial(row_parallel_linear, axis_name="tp"),
                                      **specs))
        fn = jax.jit(jax.shard_map(functools.partial(
            row_parallel_linear, axis_name="tp", overlap_comm=True, comm_chunks=comm_chunks),
            **specs))
        self._assert_all_close(_vjp(fn, (x, w, b), dy), _vjp(plain, (x, w, b), dy),
                               ("dx", "dw", "db"), f"comm_chunks={comm_chunks} vs plain")
        self.assertEqual(count_primitives(fn, x, w, b), comm_chunks)
        _, vjp = jax.vjp(fn, x, w, b)
        self.assertEqual(count_primitives(lambda c: vjp(c), jnp.asarray(dy)), 0)

    def test_one_shard_is_the_plain_path(self):
        # tp=1: no ring to run; bitwise the plain layers, SP or not.
        d, ff = 16, 64
        x, w1, b1, w2, b2 = rng_arrays(5, (2, 8, d), (d, ff), (ff,), (ff, d), (d,))
        mesh = jtu.mesh(1)
        for sp in (False, True):
            act = TOKENS if sp else P()
            outs = [jax.jit(jax.shard_map(
                functools.partial(parallel_mlp, axis_name="tp", sequence_parallel=sp,
                                  overlap_comm=overlap), mesh=mesh, out_specs=act,
                in_specs=(act, P(), P(), P(), P())))(x, w1, b1, w2, b2)
                for overlap in (False, True)]
            np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))

    @parameterized.parameters(False, True)
    def test_low_precision_gemms_stay_low_precision(self, sequence_parallel):
        # As tests/jax_tp_test.py checks for the plain path: every GEMM of the bf16 overlap
        # MLP's fwd+bwd, and every ring hop and psum, in bf16 (fp32 ones ran 26x slower).
        d, ff = 16, 64
        arrays = [jnp.asarray(a, "bfloat16") for a in rng_arrays(
            10, (2, 8, d), (d, ff), (ff,), (ff, d), (d,), (2, 8, d))]
        act = TOKENS if sequence_parallel else P()
        fn = jax.shard_map(functools.partial(parallel_mlp, axis_name="tp",
                                             sequence_parallel=sequence_parallel,
                                             overlap_comm=True),
                           mesh=jtu.mesh(2), out_specs=act,
                           in_specs=(act, P(None, "tp"), P("tp"), P("tp", None), P()))

        def fwd_bwd(x, w1, b1, w2, b2, dy):
            y, vjp = jax.vjp(fn, x, w1, b1, w2, b2)
            return y, vjp(dy)

        hlo = jax.jit(fwd_bwd).lower(*arrays).as_text()
        ops = [ln for ln in hlo.splitlines()
               if "dot_general" in ln or "collective_permute" in ln]
        self.assertGreaterEqual(sum("dot_general" in ln for ln in ops), 9)
        for ln in ops:
            self.assertNotIn("f32", ln, ln)
            self.assertIn("xbf16>", ln, ln)

    def test_deterministic(self):
        d, ff = 16, 64
        x, w1, b1, w2, b2, dy = rng_arrays(6, (2, 8, d), (d, ff), (ff,), (ff, d), (d,), (2, 8, d))
        fn = jax.jit(jax.shard_map(
            functools.partial(parallel_mlp, axis_name="tp", sequence_parallel=True,
                              overlap_comm=True), mesh=jtu.mesh(4), out_specs=TOKENS,
            in_specs=(TOKENS, P(None, "tp"), P("tp"), P("tp", None), P())))
        first, second = (_vjp(fn, (x, w1, b1, w2, b2), dy) for _ in range(2))
        np.testing.assert_array_equal(first[0], second[0])
        for g1, g2 in zip(first[1], second[1], strict=True):
            np.testing.assert_array_equal(g1, g2)

    @parameterized.parameters(2, 4)
    def test_compiled_sp_overlap_moves_activations_by_permutes_only(self, tp):
        """Compiled HLO of the SP MLP with overlap_comm: forward 2 (tp - 1) collective-permutes
        (fc1's ring of [B, N/tp, d] token shards, fc2's ring of [B, N/tp, d] partial sums) and
        no other collective; forward+backward twice that (the reverse rings), no all-gather or
        reduce-scatter, and all-reduces only of fc2's [d] bias gradient. The plain SP path
        (the control) all-gathers and reduce-scatters instead."""
        d, ff = 16, 64
        args = rng_arrays(7, (2, 8, d), (d, ff), (ff,), (ff, d), (d,), (2, 8, d))
        mesh = jtu.mesh(tp)

        def compiled(overlap, backward):
            fn = jax.shard_map(
                functools.partial(parallel_mlp, axis_name="tp", sequence_parallel=True,
                                  overlap_comm=overlap), mesh=mesh, out_specs=TOKENS,
                in_specs=(TOKENS, P(None, "tp"), P("tp"), P("tp", None), P()))

            def fwd_bwd(x, w1, b1, w2, b2, dy):
                y, vjp = jax.vjp(fn, x, w1, b1, w2, b2)
                return y, vjp(dy)

            f, a = (fwd_bwd, args) if backward else (fn, args[:5])
            return jtu.hlo_collectives(jax.jit(f).lower(*a).compile().as_text())

        shard = (2, 8 // tp, d)
        fwd = compiled(True, backward=False)
        self.assertEqual(fwd["collective-permute"], [shard] * (2 * (tp - 1)))
        self.assertEqual(fwd["all-gather"] + fwd["reduce-scatter"] + fwd["all-reduce"], [])
        step = compiled(True, backward=True)
        self.assertEqual(step["collective-permute"], [shard] * (4 * (tp - 1)))
        self.assertEqual(step["all-gather"] + step["reduce-scatter"], [])
        # d b2 (summed over the token shards), the only all-reduce.
        self.assertEqual([int(np.prod(s)) for s in step["all-reduce"]], [d])
        plain = compiled(False, backward=False)
        self.assertEqual((len(plain["all-gather"]), len(plain["reduce-scatter"]),
                          len(plain["collective-permute"])), (1, 1, 0))

    @parameterized.parameters(2, 4)
    def test_compiled_sp_overlap_single_layers(self, tp):
        """The single layers' rings: tp - 1 permutes each way, no gather or scatter."""
        x, w, b, dy = self._linear_problem(8)
        mesh = jtu.mesh(tp)
        cases = (
            (column_parallel_linear, (x, w, b), (TOKENS, P(None, "tp"), P("tp")),
             P(None, None, "tp"), (2, self.tokens // tp, self.d_in)),
            (row_parallel_linear, (np.concatenate([x, x], -1)[..., :self.d_in], w, None),
             (P(None, None, "tp"), P("tp", None), None), TOKENS,
             (2, self.tokens // tp, self.d_out)),
        )
        for layer, args, in_specs, out_specs, shard in cases:
            fn = jax.shard_map(functools.partial(layer, axis_name="tp", sequence_parallel=True,
                                                 overlap_comm=True),
                               mesh=mesh, in_specs=in_specs, out_specs=out_specs)
            y = jax.eval_shape(fn, *args)
            ct = np.ones(y.shape, np.float32)

            def fwd_bwd(*a, fn=fn, ct=ct):
                y, vjp = jax.vjp(fn, *a)
                return y, vjp(ct)

            got = jtu.hlo_collectives(jax.jit(fwd_bwd).lower(*args).compile().as_text())
            self.assertEqual(got["collective-permute"], [shard] * (2 * (tp - 1)), layer.__name__)
            self.assertEqual(got["all-gather"] + got["reduce-scatter"] + got["all-reduce"], [],
                             layer.__name__)

    def test_bad_inputs(self):
        mesh = jtu.mesh(2)
        x, w, b, _ = self._linear_problem(9)
        row = functools.partial(row_parallel_linear, axis_name=None)
        for chunks in (0, -1, 2.0, True, "2"):
            with self.assertRaisesRegex(ValueError, "comm_chunks must be a positive int"):
                row(x, w, b, overlap_comm=True, comm_chunks=chunks)
        with self.assertRaisesRegex(ValueError, "comm_chunks=2 needs overlap_comm=True"):
            row(x, w, b, comm_chunks=2)
        with self.assertRaisesRegex(ValueError, "comm_chunks=2 applies to sequence_parallel="
                                                "False only"):
            row_parallel_linear(x, w, b, axis_name="tp", sequence_parallel=True,
                                overlap_comm=True, comm_chunks=2)
        with self.assertRaisesRegex(ValueError, "comm_chunks=3 must divide the 8 tokens"):
            row(x, w, b, overlap_comm=True, comm_chunks=3)
        with self.assertRaisesRegex(ValueError, "comm_chunks=2 splits the tokens"):
            row(x[0, 0], w, b, overlap_comm=True, comm_chunks=2)
        # Inside shard_map too, and through the MLP.
        fn = jax.shard_map(functools.partial(row_parallel_linear, axis_name="tp",
                                             overlap_comm=True, comm_chunks=3),
                           mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None), P()),
                           out_specs=P())
        with self.assertRaisesRegex(ValueError, "comm_chunks=3 must divide the 8 tokens"):
            fn(x, w, b)
        with self.assertRaisesRegex(ValueError, "comm_chunks=2 applies to sequence_parallel"):
            parallel_mlp(x, w, None, w.T, None, axis_name="tp", sequence_parallel=True,
                         overlap_comm=True, comm_chunks=2)
        # The SP overlap path keeps the SP input checks: a replicated x is not a token shard.
        fn = jax.shard_map(functools.partial(column_parallel_linear, axis_name="tp",
                                             sequence_parallel=True, overlap_comm=True),
                           mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp")),
                           out_specs=P(None, None, "tp"))
        with self.assertRaisesRegex(ValueError, "must be split along its tokens over mesh axis"):
            fn(x, w, b)
        fn = jax.shard_map(functools.partial(parallel_mlp, axis_name="tp",
                                             sequence_parallel=True, overlap_comm=True),
                           mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp"), P("tp", None), P()),
                           out_specs=TOKENS)
        with self.assertRaisesRegex(ValueError, "must be split along its tokens over mesh axis"):
            fn(x, w, b, w.T, x[0, 0])


def _block_config(bias=True, pattern="causal", seq_len=128):
    return HybridConfig(d_model=64, num_heads=4, d_ff=128, bias=bias, block_size=32,
                        pattern=example_pattern(pattern, seq_len, 32))


_block_fn = jax.jit(B.hybrid_block, static_argnames=(
    "config", "mesh", "axis_name", "sequence_parallel", "overlap_comm", "comm_chunks"))


class OverlapBlockTest(parameterized.TestCase):
    """hybrid_block(overlap_comm=True) on 2 and 4 shards, with and without sequence
    parallelism, vs the float64 oracle and vs the plain block on the same mesh."""

    # 4 tiles of 32 (32 tokens per shard at tp=4), B=2, 4 heads of 16, causal: every token
    # attends to earlier shards' tokens, so a qkv ring that puts a shard's tokens in the wrong
    # slot fails on every shard but the first.
    seq_len = 128

    def _run(self, params, x, dy, config, tp, **kw):
        mesh = jtu.mesh(tp)
        p = B.shard_params(params, config, mesh)
        y, vjp = jax.vjp(lambda p, x: _block_fn(p, x, config, mesh=mesh, **kw), p, x)
        gp, gx = vjp(jax.device_put(dy, y.sharding))
        return np.asarray(y), np.asarray(gx), B.export_params(gp)

    def _assert_matches(self, got, ref, label):
        jtu.assert_block_matches(got, ref, label)

    @parameterized.product(tp=(2, 4), sequence_parallel=(False, True))
    def test_matches_oracle_and_plain_block(self, tp, sequence_parallel):
        config = _block_config()
        params = init_params(config, tp)
        x, dy = rng_arrays(100 + tp, (2, self.seq_len, config.d_model),
                            (2, self.seq_len, config.d_model))
        sp = dict(sequence_parallel=sequence_parallel)
        got = self._run(params, x, dy, config, tp, overlap_comm=True, **sp)
        label = f"tp={tp} sp={sequence_parallel}"
        self._assert_matches(got, reference.hybrid_block_value_and_grad(params, x, config, dy),
                             f"overlap vs oracle {label}")
        self._assert_matches(got, self._run(params, x, dy, config, tp, **sp),
                             f"overlap vs plain {label}")

    def test_comm_chunks_and_no_bias(self):
        config = _block_config(bias=False, pattern="per_head_mix")
        params = init_params(config, 7)
        x, dy = rng_arrays(107, (2, self.seq_len, config.d_model),
                            (2, self.seq_len, config.d_model))
        got = self._run(params, x, dy, config, 2, overlap_comm=True, comm_chunks=8)
        self._assert_matches(got, reference.hybrid_block_value_and_grad(params, x, config, dy),
                             "overlap comm_chunks=8 no bias vs oracle")

    def test_bad_inputs(self):
        config = _block_config()
        params = init_params(config, 0)
        x = np.zeros((2, self.seq_len, config.d_model), np.float32)
        mesh = jtu.mesh(2)
        with self.assertRaisesRegex(ValueError, r"comm_chunks=3 must divide the 128 tokens of "
                                                r"x \(its N\)"):
            B.hybrid_block(params, x, config, mesh=mesh, overlap_comm=True, comm_chunks=3)
        for chunks in (0, 1.5):
            with self.assertRaisesRegex(ValueError, "comm_chunks must be a positive int"):
                B.hybrid_block(params, x, config, overlap_comm=True, comm_chunks=chunks)
        with self.assertRaisesRegex(ValueError, "comm_chunks=2 needs overlap_comm=True"):
            B.hybrid_block(params, x, config, mesh=mesh, comm_chunks=2)
        with self.assertRaisesRegex(ValueError, "comm_chunks=2 applies to sequence_parallel"):
            B.hybrid_block(params, x, config, mesh=mesh, sequence_parallel=True,
                           overlap_comm=True, comm_chunks=2)


class OverlapGPTTest(absltest.TestCase):
    def test_gpt_forwards_overlap_comm(self):
        """gpt(..., overlap_comm=True) passes it to every block: logits on 2 shards vs the
        oracle; the GPT's block options include comm_chunks too."""
        block = HybridConfig(d_model=32, num_heads=2, d_ff=64, block_size=32,
                             pattern=example_pattern("causal", 64, 32))
        cfg = GPTConfig(vocab_size=24, num_layers=2, max_seq_len=64, block=block)
        params = init_gpt_params(cfg, seed=1)
        tokens = np.random.default_rng(2).integers(0, 24, (2, 64)).astype(np.int32)
        mesh = jtu.mesh(2)
        fn = jax.jit(gpt, static_argnames=("config", "mesh", "overlap_comm", "comm_chunks"))
        out = fn(shard_gpt_params(params, cfg, mesh), tokens, cfg, mesh=mesh, overlap_comm=True,
                 comm_chunks=2)
        assert_close(np.asarray(out), reference.gpt_forward(params, tokens, cfg), "float32",
                     what="tp=2 overlap logits")
        with self.assertRaisesRegex(ValueError, "comm_chunks=3 must divide the 64 tokens"):
            gpt(params, tokens, cfg, mesh=mesh, overlap_comm=True, comm_chunks=3)


if __name__ == "__main__":
    absltest.main()
