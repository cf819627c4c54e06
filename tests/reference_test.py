"""The float64 hybrid-block oracle: pieces against independent formulas, the hand-written
backward against central finite differences (directional, per parameter and for x)."""

import numpy as np
from absl.testing import absltest, parameterized

from sparsetp.core import HybridConfig, init_params, make_layout, reference
from sparsetp.core import patterns as P


def _cfg(bias=True, num_kv_heads=None):
    return HybridConfig(d_model=32, num_heads=4, d_ff=48, pattern=P.bigbird(8, 3, 1, 1, seed=3),
                        block_size=16, norm_eps=1e-5, bias=bias, num_kv_heads=num_kv_heads)


class PiecesTest(absltest.TestCase):
    def test_layer_norm_matches_statistics(self):
        rng = np.random.default_rng(0)
        x = rng.standard_normal((3, 5, 16)) * 4 + 2
        w, b = rng.standard_normal(16), rng.standard_normal(16)
        y = reference.layer_norm(x, np.ones(16), np.zeros(16), eps=0.0)
        np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
        np.testing.assert_allclose(y.var(-1), 1, atol=1e-12)
        np.testing.assert_allclose(reference.layer_norm(x, w, b, eps=0.0), y * w + b, atol=1e-12)

    def test_gelu_tanh_values(self):
        x = np.array([-3.0, -1.0, 0.0, 0.5, 2.0])
        c = np.sqrt(2 / np.pi)
        want = [0.5 * t * (1 + np.tanh(c * (t + 0.044715 * t ** 3))) for t in x]
        np.testing.assert_allclose(reference.gelu_tanh(x), want, rtol=1e-15)
        # Close to exact (erf) GELU, as the approximation promises: |diff| < 1e-3.
        from math import erf, sqrt
        exact = [0.5 * t * (1 + erf(t / sqrt(2))) for t in x]
        np.testing.assert_allclose(reference.gelu_tanh(x), exact, atol=1e-3)

    def test_mlp_dict_and_arrays_agree(self):
        cfg = _cfg()
        p = init_params(cfg, 1)
        x = np.random.default_rng(2).standard_normal((2, 7, 32))
        arrays = (p["mlp.fc1.weight"], p["mlp.fc1.bias"], p["mlp.fc2.weight"], p["mlp.fc2.bias"])
        want = reference.gelu_tanh(x @ arrays[0].astype(np.float64) + arrays[1]) @ arrays[2] \
            + arrays[3]
        np.testing.assert_allclose(reference.mlp(p, x), want, rtol=1e-12)
        np.testing.assert_array_equal(reference.mlp(p, x), reference.mlp(arrays, x))

    def test_block_matches_per_head_loop(self):
        """Independent restatement: per-head q/k/v column slices, dense masked softmax."""
        cfg = _cfg()
        p = {k: v.astype(np.float64) for k, v in init_params(cfg, 4).items()}
        rng = np.random.default_rng(5)
        x = rng.standard_normal((2, 40, 32))
        hd, n = cfg.head_dim, 40
        mask = make_layout(cfg.pattern, n, cfg.num_heads, cfg.block_size).dense_mask()
        h1 = reference.layer_norm(x, p["ln1.weight"], p["ln1.bias"], cfg.norm_eps)
        qkv = h1 @ p["attn.qkv.weight"] + p["attn.qkv.bias"]
        heads = []
        for h in range(cfg.num_heads):
            cols = lambda t, h=h: qkv[..., h * 3 * hd + t * hd: h * 3 * hd + (t + 1) * hd]
            s = cols(0) @ cols(1).transpose(0, 2, 1) / np.sqrt(hd)
            s = np.where(mask[h], s, -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            heads.append(e / e.sum(-1, keepdims=True) @ cols(2))
        y1 = x + np.concatenate(heads, -1) @ p["attn.out.weight"] + p["attn.out.bias"]
        h2 = reference.layer_norm(y1, p["ln2.weight"], p["ln2.bias"], cfg.norm_eps)
        y = y1 + reference.mlp(p, h2)
        np.testing.assert_allclose(reference.hybrid_block(p, x, cfg), y, rtol=1e-12, atol=1e-12)

    def test_gqa_block_matches_per_head_loop(self):
        """GQA restated: kv head g's columns are [q of heads 2g, 2g+1 | k_g | v_g] (group-major,
        G = 2); query head h uses k, v of kv head h // 2."""
        cfg = _cfg(num_kv_heads=2)
        p = {k: v.astype(np.float64) for k, v in init_params(cfg, 4).items()}
        x = np.random.default_rng(5).standard_normal((2, 40, 32))
        hd, n, g = cfg.head_dim, 40, 2
        mask = make_layout(cfg.pattern, n, cfg.num_heads, cfg.block_size).dense_mask()
        h1 = reference.layer_norm(x, p["ln1.weight"], p["ln1.bias"], cfg.norm_eps)
        qkv = h1 @ p["attn.qkv.weight"] + p["attn.qkv.bias"]
        self.assertEqual(qkv.shape[-1], 32 + 2 * 2 * hd)
        heads = []
        for h in range(cfg.num_heads):
            base = (h // g) * (g + 2) * hd
            q = qkv[..., base + (h % g) * hd: base + (h % g + 1) * hd]
            k = qkv[..., base + g * hd: base + (g + 1) * hd]
            v = qkv[..., base + (g + 1) * hd: base + (g + 2) * hd]
            s = np.where(mask[h], q @ k.transpose(0, 2, 1) / np.sqrt(hd), -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            heads.append(e / e.sum(-1, keepdims=True) @ v)
        y1 = x + np.concatenate(heads, -1) @ p["attn.out.weight"] + p["attn.out.bias"]
        y = y1 + reference.mlp(p, reference.layer_norm(y1, p["ln2.weight"], p["ln2.bias"],
                                                       cfg.norm_eps))
        np.testing.assert_allclose(reference.hybrid_block(p, x, cfg), y, rtol=1e-12, atol=1e-12)


class BlockGradTest(parameterized.TestCase):
    @parameterized.parameters((True, None), (False, None), (True, 2), (False, 1))
    def test_grad_matches_finite_differences(self, bias, num_kv_heads):
        cfg = _cfg(bias, num_kv_heads)
        rng = np.random.default_rng(6)
        params = {k: v.astype(np.float64) for k, v in init_params(cfg, 7).items()}
        x = rng.standard_normal((2, 40, 32))
        dy = rng.standard_normal((2, 40, 32))
        dx, dparams = reference.hybrid_block_grad(params, x, cfg, dy)
        self.assertEqual(set(dparams), set(params))
        y, dx2, dparams2 = reference.hybrid_block_value_and_grad(params, x, cfg, dy)
        np.testing.assert_array_equal(y, reference.hybrid_block(params, x, cfg))
        np.testing.assert_array_equal(dx2, dx)
        for name in params:
            np.testing.assert_array_equal(dparams2[name], dparams[name])
        eps = 1e-5

        def loss(pp, xx):
            return float((reference.hybrid_block(pp, xx, cfg) * dy).sum())

        # Directional derivative along a random direction, one parameter (and x) at a time:
        # central differences are O(eps^2) ~ 1e-10 relative, far below the 1e-6 asked.
        for name in [*params, "x"]:
            t = rng.standard_normal(x.shape if name == "x" else params[name].shape)
            if name == "x":
                fd = (loss(params, x + eps * t) - loss(params, x - eps * t)) / (2 * eps)
                an = float((dx * t).sum())
            else:
                plus = dict(params, **{name: params[name] + eps * t})
                minus = dict(params, **{name: params[name] - eps * t})
                fd = (loss(plus, x) - loss(minus, x)) / (2 * eps)
                an = float((dparams[name] * t).sum())
            self.assertAlmostEqual(an, fd, delta=1e-6 * max(1.0, abs(fd)), msg=name)

    def test_mlp_grad_matches_finite_differences(self):
        rng = np.random.default_rng(8)
        w1, b1 = rng.standard_normal((8, 12)), rng.standard_normal(12)
        w2, b2 = rng.standard_normal((12, 8)), rng.standard_normal(8)
        x, dy = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
        dx, grads = reference.mlp_grad((w1, b1, w2, b2), x, dy)
        eps = 1e-6
        args = [x, w1, b1, w2, b2]
        for i, g in enumerate([dx, *grads]):
            t = rng.standard_normal(args[i].shape)
            up = list(args)
            dn = list(args)
            up[i] = args[i] + eps * t
            dn[i] = args[i] - eps * t
            fd = ((reference.mlp(up[1:], up[0]) - reference.mlp(dn[1:], dn[0])) * dy).sum() / (
                2 * eps)
            self.assertAlmostEqual(float((g * t).sum()), fd, delta=1e-6 * max(1.0, abs(fd)))

    def test_bad_input_shape(self):
        cfg = _cfg()
        with self.assertRaisesRegex(ValueError, "d_model=32"):
            reference.hybrid_block(init_params(cfg, 0), np.zeros((2, 8, 16)), cfg)


if __name__ == "__main__":
    absltest.main()
