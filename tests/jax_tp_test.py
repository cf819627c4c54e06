"""JAX tensor parallelism (``shard_map`` over 1 / 2 / 4 devices) against the float64 oracle.

Every case builds one unsharded problem from fixed seeds, runs the JAX layers inside
``shard_map`` (``check_vma=True``) under ``jit``, and compares the output, the input gradient and
every (gathered) weight gradient with :mod:`sparsetp.core.reference`, for a random cotangent.
Devices follow the suite's rule (``tests/jax_test_utils.py``): a mesh of ``n`` devices is the
default backend's (the GPUs) when it has ``n``, else ``n`` CPU host devices.

Tolerances: the shared table of ``tests/testing_utils.py`` (float32 atol 2e-5, rtol atol/10,
gradients 2x). Values are O(1) and reductions short (<= 256 terms), so float32 error is ~1e-6;
a missing or doubled all-reduce, a wrong shard or head order all give O(0.1-1) errors.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import functools  # noqa: E402
import types  # noqa: E402
import unittest  # noqa: E402
from unittest import mock  # noqa: E402

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
from sparsetp.core import patterns as PT  # noqa: E402
from sparsetp.core.examples import example_pattern  # noqa: E402

MESH_SIZES = (1, 2, 4)


class LayersTest(parameterized.TestCase):
    """column/row-parallel linear and the parallel MLP on 1, 2, 4 shards."""

    d_in, d_out = 16, 32

    def _linear_problem(self, seed):
        x, w, b, dy = rng_arrays(seed, (2, 5, self.d_in), (self.d_in, self.d_out),
                                  (self.d_out,), (2, 5, self.d_out))
        return x, w, b, dy

    @parameterized.parameters(*MESH_SIZES)
    def test_column_parallel_linear(self, tp):
        x, w, b, dy = self._linear_problem(1)
        mesh = jtu.mesh(tp)
        fn = jax.jit(jax.shard_map(
            functools.partial(column_parallel_linear, axis_name="tp"), mesh=mesh,
            in_specs=(P(), P(None, "tp"), P("tp")), out_specs=P(None, None, "tp")))
        y, vjp = jax.vjp(fn, x, w, b)
        dx, dw, db = vjp(jax.device_put(dy, y.sharding))
        ref_dx, ref_dw, ref_db = reference._linear_grad(x.astype(np.float64),
                                                        w.astype(np.float64), dy, True)
        assert_close(y, x.astype(np.float64) @ w + b, "float32", what="y")
        assert_close(dx, ref_dx, "float32", grad=True, what="dx")
        assert_close(dw, ref_dw, "float32", grad=True, what="dw")
        assert_close(db, ref_db, "float32", grad=True, what="db")
        # Megatron's f: exactly one all-reduce in the backward (of dx), none forward.
        self.assertEqual(count_primitives(fn, x, w, b), 0)
        self.assertEqual(count_primitives(lambda c: vjp(c), jnp.asarray(dy)), 1)

    @parameterized.parameters(*MESH_SIZES)
    def test_row_parallel_linear(self, tp):
        x, w, b, dy = self._linear_problem(2)
        mesh = jtu.mesh(tp)
        fn = jax.jit(jax.shard_map(
            functools.partial(row_parallel_linear, axis_name="tp"), mesh=mesh,
            in_specs=(P(None, None, "tp"), P("tp", None), P()), out_specs=P()))
        y, vjp = jax.vjp(fn, x, w, b)
        dx, dw, db = vjp(jax.device_put(dy, y.sharding))
        ref_dx, ref_dw, ref_db = reference._linear_grad(x.astype(np.float64),
                                                        w.astype(np.float64), dy, True)
        assert_close(y, x.astype(np.float64) @ w + b, "float32", what="y")
        assert_close(dx, ref_dx, "float32", grad=True, what="dx")
        assert_close(dw, ref_dw, "float32", grad=True, what="dw")
        assert_close(db, ref_db, "float32", grad=True, what="db (bias added once)")
        # Megatron's g: one all-reduce forward, none backward.
        self.assertEqual(count_primitives(fn, x, w, b), 1)
        self.assertEqual(count_primitives(lambda c: vjp(c), jnp.asarray(dy)), 0)

    @parameterized.product(tp=MESH_SIZES, bias=(True, False))
    def test_parallel_mlp(self, tp, bias):
        d, ff = 16, 64
        x, w1, b1, w2, b2, dy = rng_arrays(3, (2, 7, d), (d, ff), (ff,), (ff, d), (d,), (2, 7, d))
        w1, w2 = w1 / np.sqrt(d), w2 / np.sqrt(ff)
        if not bias:
            b1 = b2 = None
        mesh = jtu.mesh(tp)

        def mlp(x, w1, b1, w2, b2):
            return parallel_mlp(x, w1, b1, w2, b2, axis_name="tp")

        bias_spec = (lambda s: s) if bias else (lambda s: None)
        fn = jax.jit(jax.shard_map(
            mlp, mesh=mesh, out_specs=P(),
            in_specs=(P(), P(None, "tp"), bias_spec(P("tp")), P("tp", None), bias_spec(P()))))
        y, vjp = jax.vjp(fn, x, w1, b1, w2, b2)
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
        self.assertEqual(count_primitives(fn, x, w1, b1, w2, b2), 1)
        self.assertEqual(count_primitives(lambda c: vjp(c), jnp.asarray(dy)), 1)

    @parameterized.parameters("bfloat16", "float16")
    def test_low_precision_mlp_gemms_stay_low_precision(self, dtype):
        # Every GEMM of the sharded bf16/fp16 MLP's fwd+bwd (and its psums) in the input dtype,
        # as torch's Megatron layers run them: a fp32 output requested from the forward GEMMs
        # made all backward GEMMs fp32 (26x slower on an H200) and doubled the psum bytes.
        d, ff = 16, 64
        arrays = [jnp.asarray(a, dtype) for a in rng_arrays(
            4, (2, 8, d), (d, ff), (ff,), (ff, d), (d,), (2, 8, d))]
        mesh = jtu.mesh(2)
        fn = jax.shard_map(lambda x, w1, b1, w2, b2: parallel_mlp(x, w1, b1, w2, b2,
                                                                  axis_name="tp"),
                           mesh=mesh, out_specs=P(),
                           in_specs=(P(), P(None, "tp"), P("tp"), P("tp", None), P()))

        def fwd_bwd(x, w1, b1, w2, b2, dy):
            y, vjp = jax.vjp(fn, x, w1, b1, w2, b2)
            return y, vjp(dy)

        hlo = jax.jit(fwd_bwd).lower(*arrays).as_text()
        ops = [ln for ln in hlo.splitlines()
               if "dot_general" in ln or "all_reduce" in ln or "psum" in ln]
        self.assertGreaterEqual(sum("dot_general" in ln for ln in ops), 6)  # 2 fwd + 4 bwd
        short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
        for ln in ops:
            if "dot_general" in ln:
                self.assertNotIn("f32", ln, ln)
                self.assertIn(f"x{short}>", ln, ln)

    def test_bad_inputs(self):
        mesh = jtu.mesh(2)
        x, w, b, _ = self._linear_problem(4)
        with self.assertRaisesRegex(ValueError, "input features"):
            column_parallel_linear(x[..., :-1], w, b, axis_name=None)
        with self.assertRaisesRegex(ValueError, "b_shard must have shape"):
            column_parallel_linear(x, w, b[:-1], axis_name=None)
        with self.assertRaisesRegex(ValueError, "features but w_shard"):
            row_parallel_linear(x[..., :-1], w, b, axis_name=None)
        with self.assertRaisesRegex(ValueError, "b must have shape"):
            row_parallel_linear(x, w, b[:-1], axis_name=None)
        # A column-parallel input that varies over the axis is not Megatron's replicated input.
        fn = jax.shard_map(functools.partial(column_parallel_linear, axis_name="tp"), mesh=mesh,
                           in_specs=(P(None, None, "tp"), P(), P()), out_specs=P())
        with self.assertRaisesRegex(ValueError, "must be replicated over mesh axis 'tp'"):
            fn(np.concatenate([x, x], -1), w, b)  # each shard: [2, 5, d_in], varying


def _block_config(bias=True, pattern="bigbird", num_kv_heads=None):
    return HybridConfig(d_model=64, num_heads=4, d_ff=128, bias=bias, block_size=32,
                        pattern=example_pattern(pattern, 96, 32), num_kv_heads=num_kv_heads)


class HybridBlockTest(parameterized.TestCase):
    """hybrid_block: unsharded and on 1, 2, 4 shards, forward and every gradient vs the oracle."""

    seq_len = 96  # 3 tiles of 32, B=2, 4 heads of 16: ~1 s per fwd+bwd in the interpreter

    def _problem(self, config, seed=0):
        params = init_params(config, seed)
        x, dy = rng_arrays(seed + 100, (2, self.seq_len, config.d_model),
                            (2, self.seq_len, config.d_model))
        return params, x, dy

    def _run(self, params, x, dy, config, tp, **kw):
        mesh = None if tp is None else jtu.mesh(tp)
        p = params if mesh is None else B.shard_params(params, config, mesh)
        if mesh is not None:
            for name, a in p.items():  # placed as the torch ranks shard them
                self.assertEqual(a.sharding.spec, B.param_specs(config)[name], name)
        fn = jax.jit(B.hybrid_block, static_argnames=("config", "mesh", "axis_name",
                                                      "document_lengths"))
        y, vjp = jax.vjp(lambda p, x: fn(p, x, config, mesh=mesh, **kw), p, x)
        gp, gx = vjp(jax.device_put(dy, y.sharding))
        return np.asarray(y), np.asarray(gx), B.export_params(gp)

    @parameterized.parameters(None, *MESH_SIZES)
    def test_matches_oracle(self, tp):
        config = _block_config()
        params, x, dy = self._problem(config)
        y, dx, grads = self._run(params, x, dy, config, tp)
        assert_close(y, reference.hybrid_block(params, x, config), "float32", what="y")
        ref_dx, ref_grads = reference.hybrid_block_grad(params, x, config, dy)
        assert_close(dx, ref_dx, "float32", grad=True, what="dx")
        self.assertEqual(set(grads), set(ref_grads))
        for name in ref_grads:
            assert_close(grads[name], ref_grads[name], "float32", grad=True, what=f"d {name}")

    @parameterized.named_parameters(("unsharded", None), ("tp2", 2))
    def test_gqa_matches_oracle(self, tp):
        """num_kv_heads=2 of 4 (group-major qkv columns): unsharded and on 2 shards, each shard
        one whole kv group; y, dx and every parameter gradient vs the oracle."""
        config = _block_config(pattern="per_head_mix", num_kv_heads=2)
        params, x, dy = self._problem(config, seed=2)
        y, dx, grads = self._run(params, x, dy, config, tp)
        assert_close(y, reference.hybrid_block(params, x, config), "float32", what="y")
        ref_dx, ref_grads = reference.hybrid_block_grad(params, x, config, dy)
        assert_close(dx, ref_dx, "float32", grad=True, what="dx")
        for name in ref_grads:
            assert_close(grads[name], ref_grads[name], "float32", grad=True, what=f"d {name}")

    def _check_oracle(self, got, params, x, dy, config, lengths, tag):
        y, dx, grads = got
        assert_close(y, reference.hybrid_block(params, x, config, lengths), "float32",
                     what=f"{tag} y")
        ref_dx, ref_grads = reference.hybrid_block_grad(params, x, config, dy, lengths)
        assert_close(dx, ref_dx, "float32", grad=True, what=f"{tag} dx")
        for name in ref_grads:
            assert_close(grads[name], ref_grads[name], "float32", grad=True,
                         what=f"{tag} d {name}")

    @parameterized.named_parameters(
        ("per_row_unsharded", ((10, 50, 36), (96,)), None),
        ("per_row_tp2", ((10, 50, 36), (96,)), 2),
        ("shared_tp2", (40, 1, 55), 2),
    )
    def test_document_lengths_match_oracle(self, lengths, tp):
        """document_lengths per call (per row: each batch row its own packing; or shared),
        composed with the config's pattern (GQA, 2 kv heads): y, dx and every parameter
        gradient vs the float64 oracle with the same lengths, unsharded and on 2 shards (the
        per-row layout's heads split with the query heads); then another packing of the same
        total."""
        config = _block_config(pattern="causal", num_kv_heads=2)
        params, x, dy = self._problem(config, seed=5)
        tag = f"documents {lengths} tp={tp}"
        got = self._run(params, x, dy, config, tp, document_lengths=lengths)
        self._check_oracle(got, params, x, dy, config, lengths, tag)
        # The documents matter: without them the output differs by O(1).
        self.assertGreater(np.abs(got[0] - reference.hybrid_block(params, x, config)).max(),
                           0.1)
        other = tuple(tuple(reversed(r)) for r in lengths) if isinstance(lengths[0], tuple) \
            else tuple(reversed(lengths))
        got = self._run(params, x, dy, config, tp, document_lengths=other)
        self._check_oracle(got, params, x, dy, config, other, f"documents {other} tp={tp}")

    def test_per_row_documents_data_and_model_parallel(self):
        """Per-row documents on a 2 x 2 (data x model) mesh: the per-row layout's rows split
        over "data" like x's batch, its heads over "model"; y vs the oracle."""
        config = _block_config(pattern="causal", num_kv_heads=2)
        params, x, _ = self._problem(config, seed=6)
        x = np.concatenate([x, x[::-1] * 0.5])  # B=4: two rows per data shard
        lengths = ((96,), (3, 93), (50, 46), (1, 1, 94))
        mesh = B.make_2d_mesh(2, 2, devices=jtu.devices(4))
        fn = jax.jit(functools.partial(B.hybrid_block, config=config, mesh=mesh,
                                       axis_name="model", batch_axis="data",
                                       document_lengths=lengths))
        y = fn(B.shard_params(params, config, mesh, axis_name="model"), B.shard_batch(x, mesh))
        assert_close(np.asarray(y), reference.hybrid_block(params, x, config, lengths),
                     "float32", what="y dp2 x tp2")

    def test_document_lengths_bad_inputs(self):
        """Lengths that do not cover N, a per-row count other than B, non-positive or
        non-int lengths: ValueError naming document_lengths."""
        config = _block_config(pattern="causal")
        params, x, _ = self._problem(config)
        for lengths, regex in (
                ((50, 40), r"document_lengths sums to 90 but x has N=96"),
                (((96,), (90,)), r"document_lengths\[1\] sums to 90 but x has N=96"),
                (((96,),) * 3, r"document_lengths has 3 rows .* B=2"),
                ((0, 96), r"document_lengths must hold positive"),
                ((48.0, 48), r"document_lengths\[0\] must be an int"),
                (96, r"document_lengths must be a sequence")):
            with self.subTest(lengths=lengths):
                with self.assertRaisesRegex(ValueError, regex):
                    B.hybrid_block(params, x, config, document_lengths=lengths)

    # The biased case checks one mesh size (test_matches_oracle covers bias on every size):
    # a row-parallel bias added per shard instead of once after the all-reduce shows at any tp.
    @parameterized.named_parameters(("no_bias", False, (2, 4)), ("bias", True, (4,)))
    def test_sharded_equals_unsharded(self, bias, mesh_sizes):
        config = _block_config(bias=bias, pattern="per_head_mix")
        params, x, dy = self._problem(config, seed=1)
        with jtu.on_devices_of(max(mesh_sizes)):  # the platform of the sharded runs
            y0, dx0, g0 = self._run(params, x, dy, config, None)
        assert_close(y0, reference.hybrid_block(params, x, config), "float32", what="y")
        for tp in mesh_sizes:
            y, dx, g = self._run(params, x, dy, config, tp)
            # Same kernel per head; only the summation order of the all-reduces differs.
            assert_close(y, y0, "float32", what=f"y tp={tp}")
            assert_close(dx, dx0, "float32", grad=True, what=f"dx tp={tp}")
            for name in g0:
                assert_close(g[name], g0[name], "float32", grad=True, what=f"d {name} tp={tp}")

    def test_deterministic(self):
        config = _block_config()
        params, x, dy = self._problem(config, seed=2)
        first = self._run(params, x, dy, config, 2)
        second = self._run(params, x, dy, config, 2)
        np.testing.assert_array_equal(first[0], second[0])
        np.testing.assert_array_equal(first[1], second[1])
        for name in first[2]:
            np.testing.assert_array_equal(first[2][name], second[2][name])

    def test_params_round_trip_bitwise(self):
        config = _block_config()
        params = init_params(config, 3)
        for loaded in (B.load_params(params, config),
                       B.shard_params(params, config, jtu.mesh(4)),
                       B.shard_params(B.load_params(params, config), config, jtu.mesh(2))):
            out = B.export_params(loaded)
            self.assertEqual(list(out), list(params))
            for name in params:
                self.assertEqual(out[name].dtype, params[name].dtype)
                np.testing.assert_array_equal(out[name].view(np.uint32),
                                              params[name].view(np.uint32), err_msg=name)

    def test_explicit_mesh(self):
        # jax.make_mesh's default (Explicit axes on JAX >= 0.10) works too, forward only.
        config = _block_config()
        params, x, _ = self._problem(config, seed=4)
        mesh = jtu.mesh(2, explicit=True)
        y = B.hybrid_block(B.shard_params(params, config, mesh), x, config, mesh=mesh)
        assert_close(y, reference.hybrid_block(params, x, config), "float32", what="y")

    def test_bad_inputs(self):
        config = _block_config()
        params, x, _ = self._problem(config)
        with self.assertRaisesRegex(ValueError, r"x must be \[B, N, d_model=64\]"):
            B.hybrid_block(params, x[..., :-1], config)
        with self.assertRaisesRegex(ValueError, r"x must be \[B, N, d_model=64\]"):
            B.hybrid_block(params, x[0], config)
        bad = dict(params)
        del bad["ln1.bias"]
        with self.assertRaisesRegex(ValueError, "missing \\['ln1.bias'\\]"):
            B.hybrid_block(bad, x, config)
        bad = dict(params, **{"attn.out.weight": params["attn.out.weight"][:, :-1]})
        with self.assertRaisesRegex(ValueError, r"attn.out.weight must have shape \(64, 64\)"):
            B.hybrid_block(bad, x, config)
        with self.assertRaisesRegex(ValueError, "config must be a HybridConfig"):
            B.hybrid_block(params, x, "config")
        three = HybridConfig(d_model=48, num_heads=3, d_ff=96, pattern=PT.causal(), block_size=32)
        with self.assertRaisesRegex(ValueError, "num_heads=3 is not divisible"):
            B.hybrid_block(init_params(three, 0), x[..., :48], three, mesh=jtu.mesh(2))
        with self.assertRaisesRegex(ValueError, "num_heads=3 is not divisible"):
            B.shard_params(init_params(three, 0), three, jtu.mesh(2))
        with self.assertRaisesRegex(ValueError, "not 'model'"):
            B.hybrid_block(params, x, config, mesh=jtu.mesh(2), axis_name="model")
        with self.assertRaisesRegex(ValueError, "tp=64 needs 64 devices; JAX sees .*"
                                                "jax_num_cpu_devices', 64"):
            B.make_mesh(64)


class MeshDevicesTest(absltest.TestCase):
    """make_mesh's device rule (``B.mesh_devices``), which every mesh of these tests follows."""

    def test_default_backend_first(self):
        default = jax.devices()
        for n in range(1, len(default) + 1):
            self.assertEqual(B.mesh_devices(n), default[:n])
        mesh = B.make_mesh(1)
        self.assertEqual(list(mesh.devices.flat), default[:1])
        self.assertEqual(mesh.axis_names, ("tp",))
        with self.assertRaisesRegex(ValueError, "make_mesh\\(tp=2\\) got 1 devices"):
            B.make_mesh(2, devices=default[:1])
        with self.assertRaisesRegex(ValueError, "tp must be a positive int"):
            B.mesh_devices(0)

    def test_one_gpu_falls_back_to_cpu_devices(self):
        """With one (fake) GPU as the default backend: tp=1 is the GPU, tp=2 and 4 the CPU host
        devices, more the error naming how to get CPU devices; the tests' helper skips then."""
        real = jax.devices
        gpu = types.SimpleNamespace(platform="gpu", id=0)
        cpu = real("cpu")

        def devices(backend=None):
            return [gpu] if backend in (None, "gpu") else real(backend)

        with mock.patch.object(jax, "devices", devices):
            self.assertEqual(B.mesh_devices(1), [gpu])
            self.assertEqual(B.mesh_devices(2), cpu[:2])
            self.assertEqual(B.mesh_devices(4), cpu[:4])
            self.assertEqual(jtu.devices(4), cpu[:4])
            with mock.patch.object(B.compat, "auto_mesh") as auto:
                B.make_mesh(4, "model")
            auto.assert_called_once_with((4,), ("model",), devices=cpu[:4])
            n = len(cpu) + 1
            msg = (f"tp={n} needs {n} devices; JAX sees 1 gpu and {len(cpu)} cpu. For {n} CPU "
                   f"devices set XLA_FLAGS=--xla_force_host_platform_device_count={n} or "
                   f"jax.config.update('jax_num_cpu_devices', {n}) before JAX starts.")
            with self.assertRaises(ValueError) as err:
                B.mesh_devices(n)
            self.assertEqual(str(err.exception), msg)
            with self.assertRaisesRegex(unittest.SkipTest, f"needs {n} JAX devices: tp={n}"):
                jtu.devices(n)


class DemoTest(absltest.TestCase):
    def test_small_demo_passes(self):
        """The --backend jax main job on 2 devices (small sizes; the demos' device rule picks
        them) checks out vs the oracle."""
        from sparsetp.backends.jax import demo  # noqa: PLC0415
        from sparsetp.demo import DemoArgs  # noqa: PLC0415

        args = DemoArgs(backend="jax", tp=2, steps=1, batch=1, seq_len=64, d_model=32,
                        num_heads=2, d_ff=64, block_size=16)
        self.assertEqual(demo.main(args), 0)


if __name__ == "__main__":
    absltest.main()
