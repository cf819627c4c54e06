"""The training examples run at the tiny size (subprocesses, as a user runs them), write their
summary line and JSON record, agree between torch and JAX, and plot."""

import json
import os
import re
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
_EXAMPLES = os.path.join(_ROOT, "examples")


def _run(script, *args, timeout=120):
    # Both frameworks on the CPU (on a GPU machine too): the claims are about fp32 CPU runs.
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, os.path.join(_EXAMPLES, script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=_ROOT)


class ExamplesTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.out = tempfile.mkdtemp()
        cls.procs = {fw: _run(f"train_{fw}.py", "--size=tiny", "--pattern=global",
                              "--steps=6", "--progress=false", f"--out={cls.out}")
                     for fw in ("torch", "jax")}

    def _record(self, fw):
        proc = self.procs[fw]
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        path = os.path.join(self.out, f"{fw}_tiny_global.json")
        with open(path) as f:
            return proc.stdout, json.load(f)

    def test_summary_and_json(self):
        for fw in ("torch", "jax"):
            stdout, rec = self._record(fw)
            self.assertRegex(stdout, rf"SUMMARY {fw} size=tiny pattern=global steps=6: final "
                             r"loss [0-9.]+, accuracy [0-9.]+ \(chance 0\.062\), [0-9]+ tokens/s")
            self.assertLen(rec["loss"], 6)
            self.assertLen(rec["accuracy"], 6)
            self.assertGreater(rec["tokens_per_s"], 0)
            self.assertIsNone(rec["mfu"])  # no peak FLOP/s known for a CPU
            self.assertGreater(rec["train_flops_per_step"], 0)
            self.assertTrue(0 < rec["density"] < 1)

    def test_torch_and_jax_curves_agree(self):
        # Same initial parameters, batches and Adam settings (examples/common.py): the fp32
        # curves agree as in tests/model_test.py's parity test (there: rtol 1e-5 at 5 steps).
        _, t = self._record("torch")
        _, j = self._record("jax")
        for a, b in zip(t["loss"], j["loss"], strict=True):
            self.assertAlmostEqual(a, b, delta=1e-4 * abs(a))

    def test_plot(self):
        self._record("torch")
        png = os.path.join(self.out, "curves.png")
        proc = _run("plot_curves.py", f"--inputs={self.out}/*.json", f"--out={png}")
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_bad_flag_fails(self):
        proc = _run("train_torch.py", "--size=tiny", "--pattern=nope", "--steps=1")
        self.assertNotEqual(proc.returncode, 0)
        self.assertTrue(re.search("pattern", proc.stderr), proc.stderr[-2000:])


if __name__ == "__main__":
    absltest.main()
