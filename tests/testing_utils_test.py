"""The token-reduction tolerance (``testing_utils.tolerance(..., reduced=T)``) has teeth.

Parameter gradients sum T per-token contributions; the parity suite compares them with atol
scaled by sqrt(T). These tests pin down both sides of that choice on float32 data shaped like
a bias/weight gradient (T = 2000 tokens, as in the GPU parity run that motivated it): errors of
the size the per-token check allows, accumulated over T tokens, pass; real bugs in one token or
in every token do not.
"""

import numpy as np
from absl.testing import absltest
from testing_utils import assert_close, tolerance

T, D = 2000, 512


def _terms(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((T, D)) * rng.standard_normal((T, D))  # x_t * dy_t, float64


class ReductionToleranceTest(absltest.TestCase):
    def test_scaling(self):
        self.assertEqual(tolerance("float32", True, 1), tolerance("float32", True))
        atol, rtol = tolerance("float32", True, 400)
        self.assertAlmostEqual(atol, 20 * tolerance("float32", True)[0])
        self.assertEqual(rtol, tolerance("float32", True)[1])
        with self.assertRaises(ValueError):
            tolerance("float32", True, 0)

    def test_float32_accumulation_passes(self):
        # float32 terms summed in float32 (what a GPU reduction does) vs the float64 sum.
        terms = _terms()
        exact = terms.sum(0)
        got = terms.astype(np.float32).sum(0, dtype=np.float32)
        assert_close(got, exact, "float32", grad=True, reduced=T, what="float32 sum")

    def test_random_walk_of_per_token_errors_passes_only_when_scaled(self):
        # Each token's contribution off by a random error of rms atol/4 (the GPU parity run saw
        # input-gradient errors of at most atol/7 per element): the summed error is a random
        # walk of T steps, ~11x the unscaled atol, and stays below the sqrt(T)-scaled bound with
        # a margin of ~4 standard deviations of the sum (~1 sigma above the max over 512).
        # Errors *at* the per-token bound in every token would not pass: the bound is a model
        # of accumulated rounding, not a worst case.
        terms = _terms()
        atol1, _ = tolerance("float32", True)
        noise = np.random.default_rng(1).normal(0, atol1 / 4, terms.shape)
        got, exact = (terms + noise).sum(0), terms.sum(0)
        assert_close(got, exact, "float32", grad=True, reduced=T, what="scaled")
        with self.assertRaises(AssertionError):
            assert_close(got, exact, "float32", grad=True, what="unscaled")

    def test_dropped_token_fails(self):
        terms = _terms()
        with self.assertRaises(AssertionError):
            assert_close(terms[1:].sum(0), terms.sum(0), "float32", grad=True, reduced=T)

    def test_one_percent_error_in_one_token_fails(self):
        terms = _terms()
        bad = terms.copy()
        bad[7] *= 1.01
        with self.assertRaises(AssertionError):
            assert_close(bad.sum(0), terms.sum(0), "float32", grad=True, reduced=T)

    def test_small_relative_error_in_every_token_fails(self):
        terms = _terms()
        with self.assertRaises(AssertionError):
            assert_close((terms * (1 + 1e-4)).sum(0), terms.sum(0), "float32", grad=True,
                         reduced=T)


if __name__ == "__main__":
    absltest.main()
