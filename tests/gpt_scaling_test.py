"""``benchmarks/gpt_scaling.py --preset=cpu`` end to end: 2 gloo ranks, 2 JAX host devices.

The CPU timings mean nothing (2 shared cores); what is checked is that the tool measures what
it says it measures:

* every row (torch and JAX x both N x TP=1 / DP=2 / TP=2) ran, with positive step times and
  tokens/s that are the global batch's tokens over the median step time;
* the three layouts train the same model on the same data: within each framework and N, the
  loss of every step agrees with TP=1's to fp32 rounding. The first step's loss is taken before
  any update (same weights, same global batch: a DP=2 loss that is one replica's, or a layout
  that saw other data or weights, is off by O(0.1)); the later ones follow Adam updates, so a
  replica that updates from its own half-batch gradient (no all-reduce) or a TP rank that drops
  a shard's contribution moves them too. Measured gaps: <= 1.4e-7 relative (torch against
  JAX: <= 3.1e-7); the tolerance is 1e-5, as ``tests/model_test.py``'s torch/JAX training
  parity;
* torch and JAX agree with each other the same way (the same canonical weights and batches);
* a case that fails is recorded with its error while the others still run, and the tool exits
  1 (DP=2 with a global batch of 1 sequence: ``shard_batch`` refuses it on both ranks).

Runs in ~35 s on the 2-core machine (the full preset ~27 s, the failing run ~8 s).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import testing_utils as tu
from absl.testing import absltest

SCRIPT = os.path.join(tu.REPO, "benchmarks", "gpt_scaling.py")
LAYOUTS = ("tp1", "dp2", "tp2")
FRAMEWORKS = ("torch", "jax")
RTOL = 1e-5


def _run(out_dir: str, *extra: str, timeout: float = 150.0):
    return tu.run_json_script([SCRIPT, "--preset=cpu", f"--out_dir={out_dir}", "--noplots",
                               "--noprogress", "--budget_s=600", *extra],
                              os.path.join(out_dir, "gpt_scaling.json"), timeout)


class GptScalingCpuPresetTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        out_dir = tempfile.mkdtemp(prefix="gpt_scaling_test_")
        cls.addClassCleanup(shutil.rmtree, out_dir, ignore_errors=True)
        cls.proc, cls.res = _run(out_dir)
        cls.rows = {(r["framework"], r["seq_len"], r["layout"]): r for r in cls.res["rows"]}

    def _log(self) -> str:
        return self.proc.stdout[-3000:] + self.proc.stderr[-5000:]

    def test_every_row_ran(self):
        self.assertEqual(self.proc.returncode, 0, self._log())
        spec = self.res["spec"]
        self.assertEqual(spec["preset"], "cpu")
        want = {(f, n, lay) for f in FRAMEWORKS for n in spec["seq_lens"] for lay in LAYOUTS}
        self.assertEqual(set(self.rows), want)
        self.assertEqual(self.res["failed_or_skipped"], [])
        for key, r in self.rows.items():
            with self.subTest(key=key):
                self.assertTrue(r["ok"], r.get("error"))
                self.assertEqual(r["timed_steps"], spec["steps"])
                self.assertGreater(r["step_ms"], 0.0)
                self.assertGreater(r["tokens_per_s"], 0.0)
                self.assertAlmostEqual(r["tokens_per_s"],
                                       spec["batch"] * r["seq_len"] / (r["step_ms"] / 1e3),
                                       delta=1e-6 * r["tokens_per_s"])
                self.assertEqual(r["gpus"], r["dp"] * r["tp"])
                self.assertLen(r["losses"], spec["warmup"] + spec["steps"])
                self.assertIsNone(r["mfu_per_gpu"])  # no peak FLOP/s for a CPU
                self.assertGreater(r["train_flops_per_step"], 0.0)
                self.assertIn("speedup_vs_tp1", r)

    def test_layouts_agree_within_each_framework(self):
        for (framework, n, layout), r in self.rows.items():
            if layout == "tp1":
                continue
            base = self.rows[(framework, n, "tp1")]
            with self.subTest(framework=framework, n=n, layout=layout):
                self.assertAlmostEqual(r["first_loss"], base["first_loss"],
                                       delta=RTOL * abs(base["first_loss"]))
                for step, (a, b) in enumerate(zip(r["losses"], base["losses"], strict=True)):
                    self.assertAlmostEqual(a, b, delta=RTOL * abs(b), msg=f"step {step}")

    def test_frameworks_agree(self):
        for (framework, n, layout), r in self.rows.items():
            if framework != "jax":
                continue
            ref = self.rows[("torch", n, layout)]
            with self.subTest(n=n, layout=layout):
                for step, (a, b) in enumerate(zip(r["losses"], ref["losses"], strict=True)):
                    self.assertAlmostEqual(a, b, delta=RTOL * abs(b), msg=f"step {step}")

    def test_tensor_parallel_shards_the_blocks(self):
        """TP=2 holds fewer parameters per device than TP=1 and DP=2 (which hold them all)."""
        for framework in FRAMEWORKS:
            for n in self.res["spec"]["seq_lens"]:
                full = self.rows[(framework, n, "tp1")]["local_param_count"]
                full = full[0] if isinstance(full, list) else full
                for layout, smaller in (("dp2", False), ("tp2", True)):
                    count = self.rows[(framework, n, layout)]["local_param_count"]
                    count = count[0] if isinstance(count, list) else count
                    with self.subTest(framework=framework, n=n, layout=layout):
                        if smaller:
                            self.assertLess(count, full)
                        else:
                            self.assertEqual(count, full)


class GptScalingFailureTest(absltest.TestCase):
    def test_a_failing_case_is_recorded_and_the_rest_run(self):
        out_dir = tempfile.mkdtemp(prefix="gpt_scaling_fail_")
        self.addCleanup(shutil.rmtree, out_dir, ignore_errors=True)
        proc, res = _run(out_dir, "--batch=1", "--seq_lens=128", "--frameworks=torch")
        self.assertEqual(proc.returncode, 1, proc.stderr[-3000:])
        rows = {r["layout"]: r for r in res["rows"]}
        self.assertEqual(sorted(rows), sorted(LAYOUTS))
        self.assertTrue(rows["tp1"]["ok"], rows["tp1"].get("error"))
        self.assertTrue(rows["tp2"]["ok"], rows["tp2"].get("error"))
        self.assertFalse(rows["dp2"]["ok"])
        self.assertIn("not divisible by the data-parallel size", rows["dp2"]["error"])
        self.assertEqual(res["failed_or_skipped"], ["torch:dp2:128"])
        self.assertAlmostEqual(rows["tp2"]["first_loss"], rows["tp1"]["first_loss"],
                               delta=RTOL * abs(rows["tp1"]["first_loss"]))


if __name__ == "__main__":
    absltest.main()
