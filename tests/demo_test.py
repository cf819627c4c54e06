"""The main job (`python -m sparsetp demo`) end to end at a tiny size, and its argument checks."""

import os
import subprocess
import sys
from unittest import mock

from absl.testing import absltest

from sparsetp import demo

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tiny sizes for the subprocess runs (which test the launch forms; the sparse paths are tested
# elsewhere): one head of 16 per rank, 2x2 tiles of 16, one step; ~5 s of startup each.
_TINY = ["--seq_len", "32", "--d_model", "32", "--num_heads", "2", "--d_ff", "32",
         "--block_size", "16", "--steps", "1"]


def _fresh_env() -> dict:
    """This environment, minus what would make the child skip its own set-up: an outer
    torchrun's rank variables and a JAX host-device count fixed from outside."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _run(cmd: list, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=_ROOT, env=_fresh_env(), capture_output=True, text=True,
                          timeout=timeout)


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

    def test_torchrun_form_runs_and_passes(self):
        # torchrun starts the ranks (env:// rendezvous on a free port: --standalone); the demo
        # takes WORLD_SIZE as tp and each rank joins torchrun's group instead of spawning.
        proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node", "2", "-m", "sparsetp", "demo", "--backend", "torch",
                     "--device", "cpu", *_TINY])
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        for text in ("TP=2 over gloo on cpu", "N=32 d_model=32", "PASS", "r0: ", "r1: "):
            self.assertIn(text, proc.stdout)

    def test_jax_demo_runs_and_passes_in_a_fresh_process(self):
        # A fresh interpreter with no device count set from outside: the demo itself must give
        # JAX 2 CPU host devices before the backend starts.
        proc = _run([sys.executable, "-m", "sparsetp", "demo", "--backend", "jax", "--tp", "2",
                     "--device", "cpu", *_TINY])
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        for text in ("TP=2 via shard_map on cpu", "N=32 d_model=32", "PASS", "d0: ", "d1: "):
            self.assertIn(text, proc.stdout)

    def test_bad_head_dim_fails_before_spawning(self):
        # d_model=32 over 4 heads is head dim 8 (tl.dot needs >= 16): one clear error in the
        # parent, not a kernel error in every rank after the process group is up.
        msg = r"d_model=32 / num_heads=4 has head dim 8; supported head dims are \(16, 32"
        args = demo.DemoArgs(tp=2, device="cpu", d_model=32, num_heads=4, seq_len=64,
                             block_size=16, d_ff=64)
        with mock.patch("torch.multiprocessing.spawn",
                        side_effect=AssertionError("spawned")) as spawn:
            with self.assertRaisesRegex(ValueError, msg):
                demo.main(args)
        spawn.assert_not_called()
        from sparsetp.backends.jax import block as jax_block  # noqa: PLC0415

        with mock.patch.object(jax_block, "make_mesh",
                               side_effect=AssertionError("mesh built")) as make_mesh:
            with self.assertRaisesRegex(ValueError, msg):
                demo.main(demo.DemoArgs(**{**vars(args), "backend": "jax"}))
        make_mesh.assert_not_called()


if __name__ == "__main__":
    absltest.main()
