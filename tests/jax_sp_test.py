"""JAX sequence parallelism (Megatron SP, ``sequence_parallel=True``) against the float64 oracle.

The same checks as the plain tensor-parallel tests (``tests/jax_tp_test.py``): one unsharded
problem from fixed seeds, the JAX layers inside ``shard_map`` (``check_vma=True``) under ``jit``,
the output, the input gradient and every (gathered) weight gradient compared with
:mod:`sparsetp.core.reference` for a random cotangent, on the devices of the suite's rule
(``tests/jax_test_utils.py``: the default backend's when it has enough, else CPU host devices).
With SP the activations between the parallel layers are split along the tokens, so on top of
that:

* the replicated parameters (layer norms, row-parallel biases) see only their shard's tokens on
  each device, and their gradients must come out summed over all shards: a missing all-reduce
  gives ``1/tp`` of the gradient, a doubled one ``tp`` times it (both O(1) errors);
* the SP block equals the plain block on the same mesh (same kernel per head; only the order of
  the sums differs);
* the compiled fwd+bwd holds all-gathers and reduce-scatters of the token-split activations and
  no all-reduce of activations (only of the replicated parameters' ``[d]`` gradients).

Tolerances: the shared table of ``tests/testing_utils.py`` (float32 atol 2e-5, rtol atol/10,
gradients 2x), as in ``tests/jax_tp_test.py``. A wrong token order in a gather or scatter, a
bias added per shard before the reduce-scatter, or a missing reduction all give O(0.1-1) errors.
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
from sparsetp.core import HybridConfig, init_params, reference  # noqa: E402
from sparsetp.core.examples import example_pattern  # noqa: E402

MESH_SIZES = (1, 2, 4)
TOKENS = P(None, "tp", None)  # [B, N, d] split along N: the SP activation layout


def _collectives(fn, *args) -> tuple[int, int, int]:
    """``(all-gathers, reduce-scatters, all-reduces)`` in the jaxpr of ``fn(*args)``."""
    return tuple(count_primitives(fn, *args, names=names)
                 for names in (("all_gather",), ("reduce_scatter",), jtu.PSUMS))


class SequenceParallelLayersTest(parameterized.TestCase):
    """column/row-parallel linear and the parallel MLP with sequence_parallel, 1, 2, 4 shards."""

    d_in, d_out, tokens = 16, 32, 8  # 8 tokens: 8, 4 or 2 per shard

    def _linear_problem(self, seed):
        return rng_arrays(seed, (2, self.tokens, self.d_in), (self.d_in, self.d_out),
                           (self.d_out,), (2, self.tokens, self.d_out))

    @parameterized.parameters(*MESH_SIZES)
    def test_column_parallel_linear(self, tp):
        x, w, b, dy = self._linear_problem(1)
        mesh = jtu.mesh(tp)
        fn = jax.jit(jax.shard_map(
            functools.partial(column_parallel_linear, axis_name="tp", sequence_parallel=True),
            mesh=mesh, in_specs=(TOKENS, P(None, "tp"), P("tp")),
            out_specs=P(None, None, "tp")))  # all tokens, this shard's columns
        y, vjp = jax.vjp(fn, x, w, b)
        dx, dw, db = vjp(jax.device_put(dy, y.sharding))
        ref_dx, ref_dw, ref_db = reference._linear_grad(x.astype(np.float64),
                                                        w.astype(np.float64), dy, True)
        assert_close(y, x.astype(np.float64) @ w + b, "float32", what="y")
        assert_close(dx, ref_dx, "float32", grad=True, what="dx")
        assert_close(dw, ref_dw, "float32", grad=True, what="dw")
        assert_close(db, ref_db, "float32", grad=True, what="db")
        # All-gather forward, its transpose (a reduce-scatter of dx) backward, no all-reduce.
        self.assertEqual(_collectives(fn, x, w, b), (1, 0, 0))
        bwd = (lambda c: vjp(c), jnp.asarray(dy))
        self.assertEqual(_collectives(*bwd), (0, 1, 0))

    @parameterized.product(tp=MESH_SIZES, bias=(True, False))
    def test_row_parallel_linear(self, tp, bias):
        x, w, b, dy = self._linear_problem(2)
        mesh = jtu.mesh(tp)
        fn = jax.jit(jax.shard_map(
            functools.partial(row_parallel_linear, axis_name="tp", sequence_parallel=True),
            mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None), P() if bias else None),
            out_specs=TOKENS))
        b = b if bias else None
        y, vjp = jax.vjp(fn, x, w, b)
        dx, dw, db = vjp(jax.device_put(dy, y.sharding))
        ref_dx, ref_dw, ref_db = reference._linear_grad(x.astype(np.float64),
                                                        w.astype(np.float64), dy, bias)
        ref_y = x.astype(np.float64) @ w + (b if bias else 0.0)
        assert_close(y, ref_y, "float32", what="y (bias added once, after the scatter)")
        assert_close(dx, ref_dx, "float32", grad=True, what="dx")
        assert_close(dw, ref_dw, "float32", grad=True, what="dw")
        if bias:
            # Each shard adds b to its own tokens: d b must be summed over all shards' tokens.
            assert_close(db, ref_db, "float32", grad=True, what="db (summed over token shards)")
        else:
            self.assertIsNone(db)
        self.assertEqual(_collectives(fn, x, w, b), (0, 1, 0))
        # Backward: all-gather of dy (psum_scatter's transpose); the bias gradient's all-reduce.
        bwd = (lambda c: vjp(c), jnp.asarray(dy))
        self.assertEqual(_collectives(*bwd), (1, 0, int(bias)))

    @parameterized.product(tp=MESH_SIZES, bias=(True, False))
    def test_parallel_mlp(self, tp, bias):
        d, ff = 16, 64
        x, w1, b1, w2, b2, dy = rng_arrays(3, (2, 8, d), (d, ff), (ff,), (ff, d), (d,), (2, 8, d))
        w1, w2 = w1 / np.sqrt(d), w2 / np.sqrt(ff)
        if not bias:
            b1 = b2 = None
        mesh = jtu.mesh(tp)

        def mlp(x, w1, b1, w2, b2):
            return parallel_mlp(x, w1, b1, w2, b2, axis_name="tp", sequence_parallel=True)

        bias_spec = (lambda s: s) if bias else (lambda s: None)
        fn = jax.jit(jax.shard_map(
            mlp, mesh=mesh, out_specs=TOKENS,
            in_specs=(TOKENS, P(None, "tp"), bias_spec(P("tp")), P("tp", None), bias_spec(P()))))
        args = (x, w1, b1, w2, b2)
        y, vjp = jax.vjp(fn, *args)
        grads = vjp(jax.device_put(dy, y.sharding))
        ref_y = reference.mlp((w1, b1, w2, b2), x)
        ref_dx, ref_g = reference.mlp_grad((w1, b1, w2, b2), x, dy)
        assert_close(y, ref_y, "float32", what="y")
        assert_close(grads[0], ref_dx, "float32", grad=True, what="dx")
        for name, g, r in zip(("dw1", "db1", "dw2", "db2"), grads[1:], ref_g, strict=True):
            if r is None:
                self.assertIsNone(g)
            else:
                assert_close(g, r, "float32", grad=True, what=name)
        # One all-gather and one reduce-scatter each way; the only all-reduce is of d b2.
        self.assertEqual(_collectives(fn, *args), (1, 1, 0))
        bwd = (lambda c: vjp(c), jnp.asarray(dy))
        self.assertEqual(_collectives(*bwd), (1, 1, int(bias)))

    def test_bad_inputs(self):
        mesh = jtu.mesh(2)
        x, w, b, _ = self._linear_problem(4)
        with self.assertRaisesRegex(ValueError, "sequence_parallel=True needs an axis_name"):
            column_parallel_linear(x, w, b, axis_name=None, sequence_parallel=True)
        with self.assertRaisesRegex(ValueError, "sequence_parallel=True needs an axis_name"):
            row_parallel_linear(x, w, b, axis_name=None, sequence_parallel=True)
        # A replicated input is not a token shard: gathering it would repeat every token tp times.
        fn = jax.shard_map(
            functools.partial(column_parallel_linear, axis_name="tp", sequence_parallel=True),
            mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp")), out_specs=P(None, None, "tp"))
        with self.assertRaisesRegex(ValueError, "must be split along its tokens over mesh axis"):
            fn(x, w, b)
        # 5 tokens cannot be reduce-scattered over 2 shards.
        fn = jax.shard_map(
            functools.partial(row_parallel_linear, axis_name="tp", sequence_parallel=True),
            mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None), P()), out_specs=TOKENS)
        with self.assertRaisesRegex(ValueError, r"5 tokens of x_shard .* size 2: not divisible"):
            fn(x[:, :5], w, b)


def _block_config(bias=True, pattern="causal", seq_len=128):
    return HybridConfig(d_model=64, num_heads=4, d_ff=128, bias=bias, block_size=32,
                        pattern=example_pattern(pattern, seq_len, 32))


_block_fn = jax.jit(B.hybrid_block,
                    static_argnames=("config", "mesh", "axis_name", "sequence_parallel"))


class SequenceParallelBlockTest(parameterized.TestCase):
    """hybrid_block(sequence_parallel=True) on 2 and 4 shards vs the plain block and the oracle."""

    # 4 tiles of 32 (32 tokens per shard at tp=4), B=2, 4 heads of 16. Causal by default: every
    # token attends to tokens of earlier shards, so attention run on a token shard instead of
    # the gathered sequence fails on every shard but the first; 10 of 16 tiles keep the
    # interpreter's fwd+bwd at ~3 s.
    seq_len = 128

    def _problem(self, config, seed=0):
        params = init_params(config, seed)
        x, dy = rng_arrays(seed + 100, (2, self.seq_len, config.d_model),
                            (2, self.seq_len, config.d_model))
        return params, x, dy

    def _run(self, params, x, dy, config, tp, sequence_parallel):
        mesh = jtu.mesh(tp)
        p = B.shard_params(params, config, mesh)
        y, vjp = jax.vjp(lambda p, x: _block_fn(p, x, config, mesh=mesh,
                                                sequence_parallel=sequence_parallel), p, x)
        # The caller's global arrays: SP hands back y split along N, the plain mode replicated.
        self.assertEqual(y.sharding.spec, P(None, "tp") if sequence_parallel else P())
        gp, gx = vjp(jax.device_put(dy, y.sharding))
        return np.asarray(y), np.asarray(gx), B.export_params(gp)

    def _assert_matches(self, got, ref, label):
        jtu.assert_block_matches(got, ref, label)

    @parameterized.parameters(2, 4)
    def test_matches_oracle_and_plain_block(self, tp):
        config = _block_config()
        params, x, dy = self._problem(config)
        sp = self._run(params, x, dy, config, tp, sequence_parallel=True)
        oracle = reference.hybrid_block_value_and_grad(params, x, config, dy)
        # Every gradient, including the replicated ln*.weight/bias and attn.out/mlp.fc2 biases,
        # which each shard sees only through its N/tp tokens.
        self._assert_matches(sp, oracle, f"SP tp={tp} vs oracle")
        plain = self._run(params, x, dy, config, tp, sequence_parallel=False)
        self._assert_matches(sp, plain, f"SP vs plain tp={tp}")

    def test_no_bias_per_head_patterns(self):
        config = _block_config(bias=False, pattern="per_head_mix")
        params, x, dy = self._problem(config, seed=1)
        sp = self._run(params, x, dy, config, 4, sequence_parallel=True)
        self._assert_matches(sp, reference.hybrid_block_value_and_grad(params, x, config, dy),
                             "SP tp=4 no bias vs oracle")

    def test_explicit_mesh(self):
        # jax.make_mesh's default (Explicit axes on JAX >= 0.10): x is resharded along N.
        config = _block_config()
        params, x, _ = self._problem(config, seed=2)
        mesh = jtu.mesh(2, explicit=True)
        y = B.hybrid_block(B.shard_params(params, config, mesh), x, config, mesh=mesh,
                           sequence_parallel=True)
        assert_close(y, reference.hybrid_block(params, x, config), "float32", what="y")

    @parameterized.parameters(2, 4)
    def test_compiled_collectives(self, tp):
        """Compiled fwd+bwd HLO: SP moves activations only by all-gather / reduce-scatter."""
        config = _block_config()
        params, x, dy = self._problem(config, seed=3)
        mesh = jtu.mesh(tp)
        p = B.shard_params(params, config, mesh)
        b, n, d = x.shape

        def collectives(sequence_parallel):
            def fwd_bwd(p, x, dy):
                y, vjp = jax.vjp(lambda p, x: B.hybrid_block(
                    p, x, config, mesh=mesh, sequence_parallel=sequence_parallel), p, x)
                return y, vjp(dy)

            hlo = jax.jit(fwd_bwd).lower(p, x, dy).compile().as_text()
            return jtu.hlo_collectives(hlo)

        plain = collectives(False)
        # The parser sees the plain mode's activation all-reduces (2 forward, 2 backward).
        self.assertLen([s for s in plain["all-reduce"] if s == (b, n, d)], 4)
        self.assertEqual(plain["all-gather"] + plain["reduce-scatter"], [])

        sp = collectives(True)
        # qkv and fc1 gather their input's tokens (fwd), attn.out and fc2 gather the cotangent
        # of their output (bwd); attn.out and fc2 scatter their output (fwd), qkv and fc1 the
        # gradient of their input (bwd).
        self.assertEqual(sorted(sp["all-gather"]), [(b, n, d)] * 4)
        self.assertEqual(sorted(sp["reduce-scatter"]), [(b, n // tp, d)] * 4)
        # All-reduces only of the replicated parameters' [d] gradients, none of activations.
        self.assertNotEmpty(sp["all-reduce"])
        for shape in sp["all-reduce"]:
            self.assertLessEqual(int(np.prod(shape)), d, f"all-reduce of {shape}")

    def test_bad_inputs(self):
        config = _block_config()
        params, x, _ = self._problem(config)
        with self.assertRaisesRegex(ValueError, "sequence_parallel=True needs a mesh"):
            B.hybrid_block(params, x, config, sequence_parallel=True)
        odd = _block_config(seq_len=126)
        with self.assertRaisesRegex(ValueError, r"N=126 tokens .* size 4: N must be divisible"):
            B.hybrid_block(params, x[:, :126], odd, mesh=jtu.mesh(4), sequence_parallel=True)


if __name__ == "__main__":
    absltest.main()
