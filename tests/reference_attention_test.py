"""The float64 attention oracle against an independent dense softmax and finite differences."""

import numpy as np
from absl.testing import absltest

from sparsetp.core import make_layout, reference
from sparsetp.core.examples import example_pattern


def _naive(q, k, v, mask, scale):
    out = np.zeros_like(q)
    lse = np.full(q.shape[:-1], -np.inf)
    for b, h, i in np.ndindex(*q.shape[:3]):
        keys = np.nonzero(mask[h, i])[0]
        if keys.size:
            s = q[b, h, i] @ k[b, h, keys].T * scale
            lse[b, h, i] = np.log(np.exp(s - s.max()).sum()) + s.max()
            out[b, h, i] = np.exp(s - lse[b, h, i]) @ v[b, h, keys]
    return out, lse


class ReferenceAttentionTest(absltest.TestCase):
    def setUp(self):
        rng = np.random.default_rng(0)
        self.n, self.heads = 40, 2
        self.q, self.k, self.v, self.do = (rng.standard_normal((2, self.heads, self.n, 8))
                                           for _ in range(4))

    def test_matches_naive_softmax(self):
        for name in ("causal", "bigbird", "per_head_mix", "masked_rows"):
            lay = make_layout(example_pattern(name, self.n, 16), self.n, self.heads, 16)
            out, lse = reference.attention(self.q, self.k, self.v, lay, scale=0.3)
            ref_out, ref_lse = _naive(self.q, self.k, self.v, lay.dense_mask(), 0.3)
            np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
            np.testing.assert_allclose(lse[np.isfinite(lse)], ref_lse[np.isfinite(ref_lse)],
                                       rtol=1e-12)

    def test_fully_masked_rows(self):
        lay = make_layout(example_pattern("masked_rows", self.n, 16), self.n, self.heads, 16)
        out, lse = reference.attention(self.q, self.k, self.v, lay)
        dq, dk, dv = reference.attention_grad(self.q, self.k, self.v, lay, self.do)
        self.assertTrue(np.isneginf(lse[:, :, :16]).all())
        self.assertTrue((out[:, :, :16] == 0).all())
        self.assertTrue((dq[:, :, :16] == 0).all())
        for t in (out, dq, dk, dv):
            self.assertFalse(np.isnan(t).any())

    def test_grad_matches_finite_differences(self):
        lay = make_layout(example_pattern("strided_causal", self.n, 16), self.n, self.heads, 16)
        grads = reference.attention_grad(self.q, self.k, self.v, lay, self.do, scale=0.5)
        rng = np.random.default_rng(1)
        eps = 1e-6
        for which in range(3):
            args = [self.q, self.k, self.v]
            direction = rng.standard_normal(args[which].shape)
            plus, minus = list(args), list(args)
            plus[which] = args[which] + eps * direction
            minus[which] = args[which] - eps * direction
            f = lambda a: (reference.attention(*a, lay, scale=0.5)[0] * self.do).sum()
            numeric = (f(plus) - f(minus)) / (2 * eps)
            np.testing.assert_allclose((grads[which] * direction).sum(), numeric, rtol=1e-6)

    def test_gqa_and_kv_len_match_naive_softmax(self):
        """GQA (query head h uses kv head h // group) with N_q != N_kv: out and LSE against the
        naive per-row softmax over the layout's dense mask, k and v indexed by hand."""
        rng = np.random.default_rng(2)
        for (h, h_kv, nq, nk) in ((6, 2, 24, 40), (3, 1, 40, 17), (4, 4, 9, 9)):
            lay = make_layout(example_pattern("per_head_mix", max(nq, nk), 16), nq, h, 16,
                              kv_len=nk)
            q = rng.standard_normal((2, h, nq, 8))
            k, v = (rng.standard_normal((2, h_kv, nk, 8)) for _ in range(2))
            out, lse = reference.attention(q, k, v, lay, scale=0.4)
            idx = np.arange(h) // (h // h_kv)
            ref_out, ref_lse = _naive(q, k[:, idx], v[:, idx], lay.dense_mask(), 0.4)
            np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))

    def test_gqa_grad_matches_finite_differences(self):
        """dk, dv of GQA (summed over each group) and N_q != N_kv, by central differences."""
        rng = np.random.default_rng(3)
        lay = make_layout(example_pattern("strided_causal", 40, 16), 24, 4, 16, kv_len=40)
        q, do = (rng.standard_normal((1, 4, 24, 8)) for _ in range(2))
        k, v = (rng.standard_normal((1, 2, 40, 8)) for _ in range(2))
        grads = reference.attention_grad(q, k, v, lay, do, scale=0.5)
        self.assertEqual([g.shape for g in grads], [q.shape, k.shape, v.shape])
        eps = 1e-6
        for which in range(3):
            args = [q, k, v]
            direction = rng.standard_normal(args[which].shape)
            plus, minus = list(args), list(args)
            plus[which] = args[which] + eps * direction
            minus[which] = args[which] - eps * direction
            f = lambda a: (reference.attention(*a, lay, scale=0.5)[0] * do).sum()
            numeric = (f(plus) - f(minus)) / (2 * eps)
            np.testing.assert_allclose((grads[which] * direction).sum(), numeric, rtol=1e-6)

    def test_bad_shapes(self):
        lay = make_layout(example_pattern("causal", self.n, 16), self.n, self.heads, 16)
        with self.assertRaisesRegex(ValueError, "layout"):
            reference.attention(self.q[:, :, :32], self.k[:, :, :32], self.v[:, :, :32], lay)
        with self.assertRaisesRegex(ValueError, "shape"):
            reference.attention(self.q, self.k[..., :4], self.v, lay)
        with self.assertRaisesRegex(ValueError, "H_kv"):
            three = np.concatenate([self.q, self.q[:, :1]], axis=1)
            lay3 = make_layout(example_pattern("causal", self.n, 16), self.n, 3, 16)
            reference.attention(three, self.k, self.v, lay3)
        with self.assertRaisesRegex(ValueError, "kv_len"):
            reference.attention(self.q, self.k[:, :, :32], self.v[:, :, :32], lay)


if __name__ == "__main__":
    absltest.main()
