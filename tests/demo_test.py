"""The main job (`python -m sparsetp demo`) end to end at a tiny size, its device rule and its
argument checks."""

import io
import os
import subprocess
import sys
import types
from unittest import mock

from absl.testing import absltest

from sparsetp import demo
from sparsetp.__main__ import run_demo

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
    def test_readme_main_job_runs_and_passes(self):
        """README's main job, `--backend torch --tp 4` with the default device choice, at small
        sizes: 4 GPUs over NCCL if torch sees 4, else 4 gloo processes on CPU; the table says
        which, why, and how the kernels ran."""
        import torch  # noqa: PLC0415

        cmd = [sys.executable, "-m", "sparsetp", "demo", "--backend", "torch", "--tp", "4",
               "--seq_len", "64", "--d_model", "64", "--num_heads", "4", "--d_ff", "64",
               "--block_size", "16", "--steps", "2"]
        proc = _run(cmd, timeout=240)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        want = demo.choose_device("auto", 4, torch.cuda.device_count(), "torch")
        backend = "nccl" if want.on_gpu else "gloo"
        out = proc.stdout
        for text in (f"TP=4 over {backend} on {want.device}", "B=1 N=64 d_model=64", "density",
                     "PASS", "r0: ", "r3: ", f"{want.device}: 4 {backend} processes "
                     f"({want.reason})", demo.kernels_path(want.device),
                     f"sparsetp demo (torch): TP=4 on {want.device} ({want.reason})"):
            self.assertIn(text, out)

    def test_args_validation(self):
        with self.assertRaisesRegex(ValueError, "backend must be"):
            demo.DemoArgs(backend="mxnet")
        with self.assertRaisesRegex(ValueError, "steps must be >= 1"):
            demo.DemoArgs(steps=0)
        with self.assertRaisesRegex(ValueError, "dtype must be one of"):
            demo.DemoArgs(dtype="int8")
        with self.assertRaisesRegex(ValueError, "device must be"):
            demo.DemoArgs(device="tpu")
        args = demo.DemoArgs(tp=2).with_defaults(on_gpu=False)
        self.assertEqual((args.seq_len, args.d_model, args.num_heads, args.block_size),
                         (256, 64, 4, 32))
        cfg = args.config()
        self.assertEqual(cfg.d_ff, 256)
        self.assertIn("bigbird(block=32", args.pattern_description())
        with self.assertRaisesRegex(ValueError, "runs --backend torch"):
            demo.main(demo.DemoArgs(backend="jax"))

    def test_device_rule(self):
        """`choose_device`: GPUs when there are tp of them, else CPU workers, said in reason."""
        rule = demo.choose_device
        for n_gpus, tp, want in (
                (0, None, ("cpu", 4)), (0, 2, ("cpu", 2)),
                (1, None, ("cuda", 1)), (1, 1, ("cuda", 1)), (1, 4, ("cpu", 4)),
                (2, 2, ("cuda", 2)), (2, 4, ("cpu", 4)), (8, None, ("cuda", 8)),
                (8, 4, ("cuda", 4))):
            got = rule("auto", tp, n_gpus, "torch")
            self.assertEqual((got.device, got.tp), want, (n_gpus, tp))
            self.assertIn(f"torch sees {n_gpus} GPU", got.reason)
        self.assertEqual(rule("auto", 4, 1, "torch").reason,
                         "auto: --tp 4 needs 4 GPUs, torch sees 1 GPU; 4 CPU workers instead "
                         "(--device cuda would refuse)")
        self.assertEqual(rule("cpu", None, 8, "JAX"), demo.Placement("cpu", 4, "--device cpu"))
        self.assertEqual(rule("cuda", None, 2, "JAX").tp, 2)
        with self.assertRaisesRegex(ValueError, "--tp=4 with --device cuda needs 4 GPUs; JAX "
                                                "sees 1 GPU"):
            rule("cuda", 4, 1, "JAX")
        with self.assertRaisesRegex(RuntimeError, "--device cuda but torch sees 0 GPUs"):
            rule("cuda", None, 0, "torch")
        self.assertEqual(demo.kernels_path("cuda"), "compiled Triton kernels on CUDA")
        self.assertEqual(demo.kernels_path("cpu"), "the native CPU path (no Triton)")
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}):
            self.assertIn("Triton's interpreter on CPU", demo.kernels_path("cpu"))

    def test_one_gpu_machine_runs_tp4_on_cpu(self):
        """With one (mocked) GPU, `--tp 4` spawns 4 CPU ranks and says so before spawning; with
        `--tp` unset it spawns one rank on the GPU."""
        import torch  # noqa: PLC0415

        tiny = dict(seq_len=64, d_model=64, num_heads=4, d_ff=64, block_size=16)
        for tp, device, nprocs in ((4, "cpu", 4), (None, "cuda", 1)):
            with mock.patch.object(torch.cuda, "device_count", return_value=1), \
                    mock.patch("torch.multiprocessing.spawn") as spawn, \
                    mock.patch("sys.stdout", new_callable=io.StringIO) as out:
                spawn.return_value.join.return_value = True
                self.assertEqual(demo.main(demo.DemoArgs(tp=tp, **tiny)), 0)
            (_fn,), kw = spawn.call_args
            args, place, _port = kw["args"]
            self.assertEqual((place.device, place.tp, args.tp, kw["nprocs"]),
                             (device, nprocs, nprocs, nprocs))
            self.assertIn(f"TP={nprocs} on {device} ({place.reason}); "
                          f"{demo.kernels_path(device)}", out.getvalue())
        self.assertIn("needs 4 GPUs, torch sees 1 GPU", demo.choose_device(
            "auto", 4, 1, "torch").reason)

    def test_jax_placement_with_one_gpu(self):
        """The JAX demo's devices with one (fake) GPU: --tp 2 -> 2 CPU devices, --tp unset ->
        the GPU, --device cuda --tp 2 -> the rule's error."""
        import jax  # noqa: PLC0415

        from sparsetp.backends.jax import demo as jax_demo  # noqa: PLC0415

        real = jax.devices
        gpu = types.SimpleNamespace(platform="gpu", id=0, device_kind="fake GPU")

        def devices(backend=None):
            return [gpu] if backend in (None, "gpu") else real(backend)

        with mock.patch.object(jax, "devices", devices):
            _, place, devs = jax_demo.placement(demo.DemoArgs(backend="jax", tp=2))
            self.assertEqual((place.device, devs), ("cpu", real("cpu")[:2]))
            self.assertIn("--tp 2 needs 2 GPUs, JAX sees 1 GPU", place.reason)
            _, place, devs = jax_demo.placement(demo.DemoArgs(backend="jax"))
            self.assertEqual((place.device, place.tp, devs), ("cuda", 1, [gpu]))
            with self.assertRaisesRegex(ValueError, "needs 2 GPUs; JAX sees 1 GPU"):
                jax_demo.placement(demo.DemoArgs(backend="jax", tp=2, device="cuda"))

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
        for text in ("TP=2 over gloo on cpu", "N=32 d_model=32", "PASS", "r0: ", "r1: ",
                     "cpu: 2 gloo processes (--device cpu)"):
            self.assertIn(text, proc.stdout)

    def test_jax_demo_runs_and_passes_in_a_fresh_process(self):
        # A fresh interpreter with no device count set from outside: the demo itself must give
        # JAX 2 CPU host devices before the backend starts.
        proc = _run([sys.executable, "-m", "sparsetp", "demo", "--backend", "jax", "--tp", "2",
                     "--device", "cpu", *_TINY])
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        for text in ("TP=2 via shard_map on cpu", "N=32 d_model=32", "PASS", "d0: ", "d1: ",
                     "cpu: 2 cpu devices (--device cpu)", demo.kernels_path("cpu")):
            self.assertIn(text, proc.stdout)

    def test_bad_head_dim_fails_before_spawning(self):
        # d_model=32 over 4 heads is head dim 8 (tl.dot needs >= 16): one clear error in the
        # parent, not a kernel error in every rank after the process group is up.
        msg = (r"d_model=32 / num_heads=4 has head dim 8; supported head dims are the "
               r"multiples of 16")
        args = demo.DemoArgs(tp=2, device="cpu", d_model=32, num_heads=4, seq_len=64,
                             block_size=16, d_ff=64)
        with mock.patch("torch.multiprocessing.spawn",
                        side_effect=AssertionError("spawned")) as spawn:
            with self.assertRaisesRegex(ValueError, msg):
                run_demo(args)
        spawn.assert_not_called()
        from sparsetp.backends.jax import block as jax_block  # noqa: PLC0415

        with mock.patch.object(jax_block, "make_mesh",
                               side_effect=AssertionError("mesh built")) as make_mesh:
            with self.assertRaisesRegex(ValueError, msg):
                run_demo(demo.DemoArgs(**{**vars(args), "backend": "jax"}))
        make_mesh.assert_not_called()


if __name__ == "__main__":
    absltest.main()
