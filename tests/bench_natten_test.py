"""The ``natten`` preset of the attention benchmark (issue #32; ``sparsetp/bench/natten.py``).

Its CPU variant runs end to end in-process (native CPU path, tiny grids, ~15 s on 2 cores);
the tests check what it recorded against the layouts and its own timings. The NATTEN
``mask_mod`` the GPU run gives Flex is checked element by element against the layouts, and the
correctness check that gates every timing of ours is shown to catch a wrong layout.
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest, parameterized
from bench_attention_test import _mask_mod_on_grid, run_preset_on_cpu

from sparsetp.bench import attention as A
from sparsetp.bench import natten
from sparsetp.core import make_layout
from sparsetp.core import patterns as P


class NattenPresetCpuTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # No wall-clock budget: on a loaded machine (the GPU suite's 14 workers) the preset's
        # own would skip jobs, and these tests check every job's record.
        cls.cfg, _, cls.res = run_preset_on_cpu("natten", "bench_natten_test", plots=False,
                                                budget_s=float("inf"))
        cls.timed = [r for r in cls.res["records"] if "fwd_ms" in r]

    def test_every_job_ran_or_is_a_gpu_only_skip(self):
        self.assertEqual(self.res["errors"], [])
        self.assertEqual({(s["impl"], s["reason"]) for s in self.res["skipped"]},
                         {("flex", "flex needs a GPU")})
        want = {(i, c["pattern"], c["block"]) for _, cases, impls in self.cfg.sections
                for i in impls for c in cases if i != "flex"}
        got = {(r["impl"], r["pattern"], r["block"]) for r in self.timed}
        dense = {w for w in want if w[0] == "sdpa"}
        self.assertEqual(got - {("sdpa", "dense", 32)}, want - dense)
        self.assertIn(("sdpa", "dense", 32), got)
        tiled = {r["pattern"] for r in self.timed if ":tile" in r["pattern"]}
        self.assertLen(tiled, 2)  # the 2-D and 3-D cases in tiled order

    def test_ours_was_checked_before_timing(self):
        for r in self.timed:
            if r["impl"] != "sparsetp":
                continue
            checks = r["checks"]
            names = {"oracle_rows_out", "oracle_rows_dq"}
            if ":tile" in r["pattern"]:
                names |= {f"tiled_vs_row_major_{x}" for x in ("out", "dq", "dk", "dv")}
            self.assertEqual(set(checks), names, r["pattern"])
            for name, c in checks.items():
                self.assertTrue(c["ok"], (r["pattern"], name, c))
                self.assertLessEqual(c["max_abs"], c["atol"])
            self.assertIn(0, checks["oracle_rows_out"]["rows"])
            self.assertIn(r["N"] - 1, checks["oracle_rows_out"]["rows"])

    def test_jax_agrees_with_torch(self):
        jax_recs = [r for r in self.timed if r["impl"] == "sparsetp_jax"]
        self.assertLen(jax_recs, len([r for r in self.timed if r["impl"] == "sparsetp"]))
        for r in jax_recs:
            self.assertLessEqual(r["max_abs_diff_vs_sparsetp"], natten.ATOL["float32"])

    def test_numbers_follow_from_the_layouts_and_the_ms(self):
        dense = next(r for r in self.timed if r["impl"] == "sdpa")
        for r in self.timed:
            if r["impl"] == "sdpa":
                continue
            s = natten.parse(r["pattern"])
            # No dilation or causal axis here: every query has prod(kernel) neighbours.
            self.assertEqual(r["allowed_elements"], r["H"] * r["N"] * int(np.prod(s["kernel"])))
            lay = make_layout(natten.pattern(r["pattern"]), r["N"], r["H"], r["block"])
            self.assertEqual(r["computed_elements"], lay.nnz_blocks * r["block"] ** 2)
            self.assertGreater(r["fwd_ms"], 0)
            self.assertGreater(r["fwd_bwd_ms"], 0)
            self.assertAlmostEqual(r["bwd_ms"], r["fwd_bwd_ms"] - r["fwd_ms"])
            self.assertAlmostEqual(r["speedup_vs_dense"]["fwd"], dense["fwd_ms"] / r["fwd_ms"])
            # bwd is a difference of two timings: on a loaded CPU it can come out <= 0, and
            # then the tool records no ratio rather than a negative one.
            if r["bwd_ms"] > 0:
                self.assertAlmostEqual(r["speedup_vs_dense"]["bwd"],
                                       dense["bwd_ms"] / r["bwd_ms"])
            else:
                self.assertIsNone(r["speedup_vs_dense"]["bwd"])
            self.assertAlmostEqual(r["bwd_over_fwd"], r["bwd_ms"] / r["fwd_ms"])
            self.assertAlmostEqual(r["true_fwd_tflops"],
                                   4 * r["D"] * r["allowed_elements"] / (r["fwd_ms"] * 1e9))

    def test_targets(self):
        rows = self.res["targets"]
        self.assertEqual({t["id"] for t in rows}, {"N0", "N1", "N2", "N3"})  # N4: GPU only
        sparse = [r for r in self.timed if r["impl"] != "sdpa"]
        for tid in ("N1", "N2", "N3"):
            self.assertLen([t for t in rows if t["id"] == tid], len(sparse))
        by_name = {f"{r['impl']}, {r['pattern']}, block {r['block']}": r for r in sparse}
        for t in rows:
            r = by_name[t["name"].split(", ", 1)[1]]
            value = {"N0": r.get("max_abs_diff_vs_sparsetp"),
                     "N1": r["speedup_vs_dense"]["fwd"], "N2": r["speedup_vs_dense"]["bwd"],
                     "N3": r["bwd_over_fwd"]}[t["id"]]
            self.assertEqual(t["value"], value, t)
            if t["id"] == "N0":
                self.assertEqual(t["status"], "pass", t)
            elif value is not None:  # None: a bwd time <= 0 (see the test above)
                self.assertTrue(t["status"].startswith("not applicable"), t)
        n1 = next(t for t in rows if t["id"] == "N1" and "32x32:7x7," in t["name"])
        self.assertEqual(n1["threshold"], 6.0)


class NattenSpecTest(parameterized.TestCase):
    @parameterized.parameters(
        ("neighborhood:37:7:dil2:causal1", 37, 16, 1),
        ("neighborhood:6x9:3x4:dil2x2", 54, 16, 2),
        ("neighborhood:8x12:3x5:dil1x2:causal1x0:tile4x4", 96, 16, 1),
        ("neighborhood:4x4x8:3x2x3:dil1x2x2:causal0x1x0:tile2x2x4", 128, 32, 1),
        ("neighborhood:5x6x7:3x4x2:dil1x1x3", 210, 64, 1),
        ("neighborhood:16x16:5x5:tile4x8", 256, 32, 2))
    def test_mask_mod_matches_layout(self, spec, n, bs, h):
        bp = A.bench_pattern(spec, n, bs, h)
        self.assertEqual(bp.kind, "neighborhood")
        lay = make_layout(bp.pattern, n, h, bs)
        np.testing.assert_array_equal(_mask_mod_on_grid(bp, lay), lay.dense_mask())

    def test_spec_round_trip_and_errors(self):
        text = natten.spec((4, 4, 8), (3, 2, 3), dilation=(1, 2, 2), causal=(0, 1, 0),
                           tile=(2, 2, 4))
        self.assertEqual(text, "neighborhood:4x4x8:3x2x3:dil1x2x2:causal0x1x0:tile2x2x4")
        self.assertEqual(natten.pattern(text), P.neighborhood(
            (4, 4, 8), (3, 2, 3), (1, 2, 2), (False, True, False), tile_shape=(2, 2, 4)))
        with self.assertRaisesRegex(ValueError, "not N=100"):
            A.bench_pattern("neighborhood:8x8:3x3", 100, 32)
        with self.assertRaisesRegex(ValueError, "unknown part 'stride2'"):
            natten.parse("neighborhood:8x8:3x3:stride2")

    def test_gpu_preset_is_the_issue(self):
        cfg = A.preset_config("natten", "cuda")
        cases = {(c["pattern"], c["N"], c["block"]) for _, cs, _ in cfg.sections for c in cs}
        for c in cases:
            self.assertEqual(natten.pattern(c[0]).seq_len, c[1])
        self.assertIn(("neighborhood:32768:2048", 32768, 128), cases)
        self.assertIn(("neighborhood:128x128:31x31", 16384, 128), cases)
        self.assertIn(("neighborhood:16x32x32:7x15x15", 16384, 128), cases)
        self.assertEqual({(c["B"], c["H"], c["D"], c["dtype"]) for _, cs, _ in cfg.sections
                          for c in cs}, {(1, 16, 128, "bfloat16")})
        self.assertEqual([im for _, _, im in cfg.sections],
                         [["sdpa_cudnn", "sparsetp"], ["sdpa_flash"], ["sparsetp_jax"], ["flex"],
                          ["flex"]])
        self.assertEqual(cfg.dense_order[0], "sdpa_cudnn")  # the issue's dense anchor
        self.assertEqual(len(cfg.sections[0][1]), 7)  # 3 row-major, 2 tiled at block 128 and 64
        self.assertEqual([":tile" in c["pattern"] for c in cfg.sections[3][1] + cfg.sections[4][1]],
                         [False] * 3 + [True] * 2)

    def test_dense_is_cudnn_where_both_ran(self):
        """speedup_vs_dense uses cuDNN's dense time when cuDNN and flash both ran, flash's when
        only flash did (synthetic GPU records)."""
        def rec(impl, fwd, pattern="neighborhood:128x128:31x31"):
            return {"section": "natten", "impl": impl, "pattern": pattern, "N": 16384, "B": 1,
                    "H": 16, "D": 128, "dtype": "bfloat16", "block": 128, "fwd_ms": fwd,
                    "fwd_bwd_ms": 3 * fwd, "flop_elements": 10**9}
        cfg = A.preset_config("natten", "cuda")
        config = {"dense_order": list(cfg.dense_order)}
        recs = [rec("sdpa_flash", 8.0, "dense"), rec("sdpa_cudnn", 6.0, "dense"),
                rec("sparsetp", 1.0)]
        A.add_derived({"records": recs, "config": config})
        self.assertEqual(recs[-1]["dense_impl"], "sdpa_cudnn")
        self.assertAlmostEqual(recs[-1]["speedup_vs_dense"]["fwd"], 6.0)
        recs = [rec("sdpa_flash", 8.0, "dense"), rec("sparsetp", 1.0)]
        A.add_derived({"records": recs, "config": config})
        self.assertEqual(recs[-1]["dense_impl"], "sdpa_flash")

    def test_check_catches_a_wrong_layout(self):
        import torch  # here: sparsetp picks Triton's mode before torch loads it

        case = A._case("neighborhood:16x16:5x5:tile4x8", 256, h=1, d=16, dtype="float32",
                       block=32)
        sets = A._Inputs.get(case, "cpu", 1)
        try:
            rec = {}
            good = make_layout(natten.pattern(case["pattern"]), 256, 1, 32)
            natten.check(good, sets, case, rec)
            self.assertTrue(all(c["ok"] for c in rec["checks"].values()))
            wrong = make_layout(natten.pattern("neighborhood:16x16:5x3:tile4x8"), 256, 1, 32)
            with self.assertRaisesRegex(RuntimeError, "check failed before timing"):
                natten.check(wrong, sets, case, rec)
            self.assertFalse(rec["checks"]["tiled_vs_row_major_out"]["ok"])
            self.assertFalse(rec["checks"]["oracle_rows_out"]["ok"])
        finally:
            A._Inputs.clear()
        self.assertIsInstance(sets[0][0], torch.Tensor)


if __name__ == "__main__":
    absltest.main()
