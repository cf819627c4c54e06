"""The main job (`python -m sparsetp demo`) end to end at a tiny size, and its argument checks."""

import os
import subprocess
import sys

from absl.testing import absltest

from sparsetp import demo

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DemoTest(absltest.TestCase):
    def test_torch_demo_runs_and_passes(self):
        cmd = [sys.executable, "-m", "sparsetp", "demo", "--backend", "torch", "--tp", "2",
               "--device", "cpu", "--seq_len", "64", "--d_model", "32", "--num_heads", "2",
               "--d_ff", "64", "--block_size", "16", "--steps", "2"]
        env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True,
                              timeout=180)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        out = proc.stdout
        for text in ("TP=2 over gloo on cpu", "B=1 N=64 d_model=32", "density", "PASS",
                     "r0: ", "r1: "):
            self.assertIn(text, out)

    def test_args_validation(self):
        with self.assertRaisesRegex(ValueError, "backend must be"):
            demo.DemoArgs(backend="mxnet")
        with self.assertRaisesRegex(ValueError, "steps must be >= 1"):
            demo.DemoArgs(steps=0)
        with self.assertRaisesRegex(ValueError, "dtype must be one of"):
            demo.DemoArgs(dtype="int8")
        args = demo.DemoArgs(tp=2).with_defaults(on_gpu=False)
        self.assertEqual((args.seq_len, args.d_model, args.num_heads, args.block_size),
                         (256, 64, 4, 32))
        cfg = args.config()
        self.assertEqual(cfg.d_ff, 256)
        self.assertIn("bigbird(block=32", args.pattern_description())

    def test_bad_tp_fails_before_spawning(self):
        with self.assertRaisesRegex(ValueError, "num_heads=4 is not divisible by the "
                                                "tensor-parallel size 3"):
            demo.main(demo.DemoArgs(tp=3, device="cpu"))


if __name__ == "__main__":
    absltest.main()
