"""The kernels' sm_90 code generation, read without a GPU (``benchmarks/ptx_probe.py``).

Triton compiles for sm_90 on a CPU-only machine (ptxas ships in its wheel), so properties of
the generated code that the GPU timings depend on can be guarded in CI: every kernel fits an
H100/H200 (registers, shared memory), the forward and dQ do not spill, and the K/V (or Q/dO)
tiles are pipelined in 16-byte copies. Facts that hold for one Triton version only (spills and
copy widths of the GPU machine's Triton) are recorded in ``benchmarks/KERNEL_NOTES.md``, not
asserted here.

Each probe runs in its own process: compiled (not interpreted) kernel objects must be created
before Triton picks the interpreter, which the rest of the test suite does.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
_SHARED_MAX = 227 * 1024  # dynamic shared memory per block on sm_90 (H100 / H200)


def _probe(*flags: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        env = {**os.environ, "PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("TRITON_INTERPRET", None)
        proc = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", "ptx_probe.py"),
                               f"--out={out}", *flags], capture_output=True, text=True,
                              timeout=600, env=env)
        if proc.returncode != 0:
            raise AssertionError(f"ptx_probe failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)["kernels"]


class PtxProbeTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # The launch's bf16 configs at tile 64 (what every issue-8 pattern runs) and 128.
        cls.tile64 = _probe("--block=64", "--head_dim=128")
        cls.tile128 = _probe("--block=128", "--head_dim=128", "--kernels=fwd")

    def test_every_kernel_fits_the_gpu(self):
        for name, rec in {**self.tile64, "fwd@128": self.tile128["fwd"]}.items():
            with self.subTest(kernel=name):
                self.assertLessEqual(rec["registers"], 255)
                self.assertLessEqual(rec["shared_bytes"], _SHARED_MAX)

    def test_forward_and_dq_do_not_spill(self):
        for name in ("fwd", "bwd_dq"):
            with self.subTest(kernel=name):
                self.assertEqual(self.tile64[name]["stack_bytes"], 0)

    def test_tiles_move_in_pipelined_16_byte_copies(self):
        # Each step loads two [64, 128] bf16 tiles (K and V, or Q and dO): 8 16-byte cp.async
        # per thread each. Pipelined in both loops (partial and full tiles), with at least a
        # prologue and a loop-body copy, that is >= 2 * 8 * 2 * 2 = 64 static copies. A lost
        # alignment or contiguity hint shows here: dropping dQ's ``_hint16(stride_kn)`` took
        # its K tile out of the pipeline (32 copies left) without changing any result.
        for name, rec in self.tile64.items():
            with self.subTest(kernel=name):
                widths = {int(w): c for w, c in rec["cp_async_static_by_bytes"].items()}
                self.assertGreaterEqual(widths.get(16, 0), 64, widths)

    def test_float64_kernels_compile_for_the_gpu(self):
        """Every kernel compiles for sm_90 at float64: the interpreter does not apply the
        compiler's typing rules (an fp32 argument rebound to fp64 inside a runtime ``if`` passes
        every CPU test and fails to compile for the GPU)."""
        names = ("fwd", "bwd_dq", "bwd_dkdv")
        got = _probe("--dtype=float64", "--block=32", "--head_dim=32",
                     f"--kernels={','.join(names)}")
        self.assertEqual(sorted(got), sorted(names))
        for name, rec in got.items():
            with self.subTest(kernel=name):
                self.assertLessEqual(rec["registers"], 255)
                self.assertLessEqual(rec["shared_bytes"], _SHARED_MAX)


if __name__ == "__main__":
    absltest.main()
