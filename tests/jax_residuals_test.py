"""What the JAX layers keep for the backward (activation memory and HBM traffic).

torch's MLP keeps, per token, the fc1 output (GELU's input) and the GELU output in the compute
dtype, and LayerNorm keeps its input plus a per-row mean and rstd. JAX autodiff, left alone,
kept five fp32 ``[T, ff]`` intermediates of the tanh-GELU and three fp32 ``[T, d]`` ones per
LayerNorm (5 GiB more traffic each way for the T=8192, ff=32768 MLP on one GPU). The layers
checkpoint those two functions; these tests pin the saved residuals in bf16.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

from sparsetp.backends.jax import block as jblock  # noqa: E402
from sparsetp.backends.jax import layers  # noqa: E402
from sparsetp.core import HybridConfig, init_params  # noqa: E402
from sparsetp.core import patterns as P  # noqa: E402


def _residuals(fn, *args):
    """The arrays ``jax.vjp`` closes over for the backward (its residuals)."""
    _, vjp = jax.vjp(fn, *args)
    return [r for r in jax.tree_util.tree_leaves(vjp) if hasattr(r, "shape") and r.ndim > 0]


class ResidualsTest(absltest.TestCase):
    def test_mlp_keeps_what_torch_keeps(self):
        t, d, ff = 48, 16, 64
        bf = jnp.bfloat16
        rng = np.random.default_rng(0)
        w1, b1, w2, b2, x = (jnp.asarray(rng.standard_normal(s), bf)
                             for s in ((d, ff), (ff,), (ff, d), (d,), (1, t, d)))
        res = _residuals(lambda *a: layers.parallel_mlp(a[4], *a[:4], axis_name=None),
                         w1, b1, w2, b2, x)
        big = sorted((tuple(r.shape), str(r.dtype)) for r in res if r.size >= t * ff)
        # fc1 output (GELU input) and GELU output, both bf16: nothing in fp32.
        self.assertEqual(big, [((1, t, ff), "bfloat16")] * 2)

    def test_layer_norm_keeps_no_fp32_rows(self):
        cfg = HybridConfig(32, 2, 64, P.causal(), block_size=16, dtype="bfloat16")
        p = jblock.load_params(init_params(cfg, 0), cfg)
        x = jnp.ones((1, 48, 32), jnp.bfloat16)
        res = _residuals(lambda p, x: jblock.hybrid_block(p, x, cfg), p, x)
        shapes = [(tuple(r.shape), str(r.dtype)) for r in res]
        self.assertIn(((1, 48, 32), "bfloat16"), shapes)  # the LayerNorm inputs are kept ...
        self.assertNotIn(((1, 48, 32), "float32"), shapes)  # ... and no fp32 [T, d] row stats

    def test_checkpointed_gelu_same_values_and_grads(self):
        x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 32)), jnp.float32)
        ref = lambda x: jax.nn.gelu(x, approximate=True)  # noqa: E731
        np.testing.assert_array_equal(layers.gelu_tanh(x), ref(x))
        g, g_ref = (jax.grad(lambda x, f=f: f(x).sum())(x) for f in (layers.gelu_tanh, ref))
        np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-7)


if __name__ == "__main__":
    absltest.main()
