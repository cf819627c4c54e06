"""Data x tensor parallelism in JAX: a 2 x 2 ("data", "model") mesh against one device.

"The model" is a stack of two ``hybrid_block``s with the loss ``mean((model(x) - t) ** 2)`` over
the global batch; on the mesh the batch is split over "data" (``batch_axis``) and each block
over "model" (``axis_name``). ``jax.grad`` must give the single-device gradients (the data
all-reduce is the transpose of the parameters' implicit replication over "data"), and one SGD
step the same parameters. A second case runs the same mesh as 2 processes with 2 CPU devices
each under ``jax.distributed.initialize`` (gloo CPU collectives), as a multi-host job would.

Tolerance (float32): the conventions' table through ``testing_utils.tolerance``, gradients at
2x with ``reduced = B * N`` (a weight gradient sums that many token contributions). Only the
order of the sums differs from one device (two half-batch partial gradients, two half-width
partial products), a few float32 ulps; a missing psum over "data" halves a gradient, a doubled
one doubles it: O(1) errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import dist_utils  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_test_utils as jtu  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from dp_tp_common import BATCH, DP, LR, SEEDS, SEQ, TP, D, config, data  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_dp_tp_worker import loss as _loss  # noqa: E402
from jax_dp_tp_worker import sgd  # noqa: E402
from testing_utils import tolerance  # noqa: E402

from sparsetp.backends.jax import block as B  # noqa: E402
from sparsetp.core import init_params  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_dp_tp_worker.py")


def _reference():
    """One device, unsharded: loss, gradients and the parameters after one SGD step."""
    cfg = config()
    params = tuple({n: jnp.asarray(a) for n, a in init_params(cfg, s).items()} for s in SEEDS)
    x, t = data()
    value, grads = jax.jit(jax.value_and_grad(lambda p: _loss(p, x, t, cfg)))(params)
    return (float(value), [B.export_params(g) for g in grads],
            [B.export_params(p) for p in sgd(params, grads, LR)])


class _MatchesOneDevice(parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ref_loss, cls.ref_grads, cls.ref_params = _reference()

    def assert_matches(self, loss, grads, params, who=""):
        atol, rtol = tolerance("float32", grad=True, reduced=BATCH * SEQ)
        self.assertAlmostEqual(loss, self.ref_loss, delta=1e-5 * abs(self.ref_loss))
        for i in range(len(SEEDS)):
            for name, ref in self.ref_grads[i].items():
                np.testing.assert_allclose(grads[i][name], ref, atol=atol, rtol=rtol,
                                           err_msg=f"{who}block {i} grad {name}")
            for name, ref in self.ref_params[i].items():
                np.testing.assert_allclose(params[i][name], ref, atol=LR * atol, rtol=rtol,
                                           err_msg=f"{who}block {i} {name}")


class JaxDataTensorParallelTest(_MatchesOneDevice):
    @parameterized.named_parameters(("tp", False), ("tp_sp", True))
    def test_grads_and_step_equal_one_device(self, sequence_parallel):
        cfg = config()
        mesh = B.make_2d_mesh(DP, TP, devices=jtu.devices(DP * TP))
        self.assertEqual(dict(mesh.shape), {"data": DP, "model": TP})
        params = tuple(B.shard_params(init_params(cfg, s), cfg, mesh, "model") for s in SEEDS)
        x, t = B.shard_batch(data(), mesh)
        self.assertEqual(x.sharding.spec, P("data"))
        kw = dict(mesh=mesh, axis_name="model", batch_axis="data",
                  sequence_parallel=sequence_parallel)

        @jax.jit
        def step(params, x, t):
            value, grads = jax.value_and_grad(lambda p: _loss(p, x, t, cfg, **kw))(params)
            return value, grads, sgd(params, grads, LR)

        value, grads, new = step(params, x, t)
        # Gradients come out laid out like the parameters: split over "model" where the
        # parameter is, replicated over "data" (already summed over the data shards).
        specs = B.param_specs(cfg, "model")
        for name, g in grads[0].items():
            self.assertTrue(g.sharding.is_equivalent_to(NamedSharding(mesh, specs[name]), g.ndim),
                            f"{name}: {g.sharding.spec}")
        self.assert_matches(float(value), [B.export_params(g) for g in grads],
                            [B.export_params(p) for p in new])

    def test_output_split_over_data(self):
        cfg = config()
        mesh = B.make_2d_mesh(DP, TP, devices=jtu.devices(DP * TP))
        params = B.shard_params(init_params(cfg, 0), cfg, mesh, "model")
        x = data()[0]
        y = jax.jit(lambda p, x: B.hybrid_block(p, x, cfg, mesh=mesh, axis_name="model",
                                                batch_axis="data"))(params, B.shard_batch(x, mesh))
        self.assertTrue(y.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3),
                        y.sharding)
        ref = B.hybrid_block({n: jnp.asarray(a) for n, a in init_params(cfg, 0).items()}, x, cfg)
        atol, rtol = tolerance("float32")
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), atol=atol, rtol=rtol)


class JaxMultiProcessTest(_MatchesOneDevice):
    """2 processes x 2 CPU devices, one (data, model) mesh: what a 2-host job does."""

    def test_two_processes_match_one_device(self):
        coordinator = f"127.0.0.1:{dist_utils.free_port()}"
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [
                       os.path.dirname(os.path.dirname(WORKER)), os.environ.get("PYTHONPATH")])))
        env.pop("XLA_FLAGS", None)  # each process sets its own 2 devices
        with tempfile.TemporaryDirectory() as tmp:
            outs = [os.path.join(tmp, f"process{i}.npy") for i in range(2)]
            procs = [subprocess.Popen([sys.executable, WORKER, coordinator, str(i), outs[i]],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True) for i in range(2)]
            logs = []
            try:
                logs = [p.communicate(timeout=240)[0] for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.communicate()
            for i, p in enumerate(procs):
                self.assertEqual(p.returncode, 0, f"process {i}:\n{logs[i][-4000:]}")
            results = [np.load(o, allow_pickle=True).item() for o in outs]
        for i, r in enumerate(results):
            self.assertEqual(r["local"], [i])
            self.assertEqual(r["rows"], [[0], [1]])  # each TP group inside one process
            self.assert_matches(r["loss"], r["grads"], r["params"], who=f"process {i} ")


class JaxDataTensorParallelBadInputTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = B.make_2d_mesh(DP, TP, devices=jtu.devices(DP * TP))
        self.params = init_params(config(), 0)

    def _call(self, x=None, **kw):
        x = np.zeros((BATCH, SEQ, D), np.float32) if x is None else x
        kw = dict(mesh=self.mesh, axis_name="model", batch_axis="data") | kw
        return B.hybrid_block(self.params, x, config(), **kw)

    def test_batch_not_divisible(self):
        with self.assertRaisesRegex(ValueError, r"batch_axis='data' splits the B=3 sequences of "
                                                r"x over 2 data shards"):
            self._call(np.zeros((3, SEQ, D), np.float32))
        with self.assertRaisesRegex(ValueError, r"batch\[1\] has batch 3, not divisible by mesh "
                                                r"axis 'data' of size 2"):
            B.shard_batch((np.zeros((4, 2)), np.zeros((3, 2))), self.mesh)

    def test_missing_axes(self):
        with self.assertRaisesRegex(ValueError, r"batch_axis='dp' is not an axis of the mesh"):
            self._call(batch_axis="dp")
        with self.assertRaisesRegex(ValueError, r"batch_axis='data' is not an axis of the mesh"):
            B.shard_batch(np.zeros((4, 2)), B.make_mesh(2, devices=jtu.devices(2)))
        with self.assertRaisesRegex(ValueError, r"mesh has axes \('data', 'model'\), not 'tp'"):
            self._call(axis_name="tp")
        with self.assertRaisesRegex(ValueError, r"batch_axis and axis_name are both 'model'"):
            self._call(batch_axis="model")
        with self.assertRaisesRegex(ValueError, r"batch_axis='data' needs a mesh"):
            self._call(mesh=None)

    def test_model_axis_not_dividing_heads_or_d_ff(self):
        mesh14 = B.make_2d_mesh(1, 4, devices=jtu.devices(4))
        with self.assertRaisesRegex(ValueError, r"num_heads=2 is not divisible by the "
                                                r"tensor-parallel size 4"):
            cfg = config(num_heads=2)
            B.hybrid_block(init_params(cfg, 0), np.zeros((4, SEQ, D), np.float32), cfg,
                           mesh=mesh14, axis_name="model", batch_axis="data")
        with self.assertRaisesRegex(ValueError, r"d_ff=130 is not divisible by the "
                                                r"tensor-parallel size 4"):
            cfg = config(d_ff=130)
            B.shard_params(init_params(cfg, 0), cfg, mesh14, "model")

    def test_make_2d_mesh_arguments(self):
        with self.assertRaisesRegex(ValueError, r"dp must be a positive int, got 0"):
            B.make_2d_mesh(0, 2)
        with self.assertRaisesRegex(ValueError, r"tp must be a positive int, got 2.0"):
            B.make_2d_mesh(2, 2.0)
        with self.assertRaisesRegex(ValueError, r"dp=8 x tp=8 needs 64 devices"):
            B.make_2d_mesh(8, 8)
        with self.assertRaisesRegex(ValueError, r"needs 4 devices, got 2"):
            B.make_2d_mesh(2, 2, devices=jtu.devices(2))
        with self.assertRaisesRegex(ValueError, r"axis_names must be two distinct axis names"):
            B.make_2d_mesh(2, 2, axis_names=("x", "x"))


if __name__ == "__main__":
    absltest.main()
