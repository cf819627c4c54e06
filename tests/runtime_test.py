"""sparsetp._runtime: where the kernels run (CUDA data compiled, CPU data on the native CPU path,
the interpreter when forced), the SPARSETP_INTERPRET override, and no import-order requirement
any more."""

import os
import subprocess
import sys
import textwrap
from unittest import mock

from absl.testing import absltest, parameterized

from sparsetp import _runtime

_CLEAN = ("TRITON_INTERPRET", "SPARSETP_INTERPRET")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with neither interpreter variable set (plus ``env``)."""
    full = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=full)


class ForceInterpreterTest(parameterized.TestCase):

    @parameterized.parameters(None, "", " ", "0", "false", "No", "OFF")
    def test_off(self, value):
        env = {k: v for k, v in os.environ.items() if k != "SPARSETP_INTERPRET"}
        if value is not None:
            env["SPARSETP_INTERPRET"] = value
        with mock.patch.dict(os.environ, env, clear=True):
            self.assertFalse(_runtime.force_interpreter())

    @parameterized.parameters("1", "true", "YES", " on ")
    def test_on(self, value):
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": value}):
            self.assertTrue(_runtime.force_interpreter())

    @parameterized.parameters("maybe", "2", "interpret")
    def test_garbage_is_an_error_naming_the_variable(self, value):
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": value}):
            with self.assertRaisesRegex(ValueError, rf"SPARSETP_INTERPRET must be 1 or 0, got "
                                                    rf"'{value}'"):
                _runtime.force_interpreter()

    def test_read_per_call(self):
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}):
            self.assertTrue(_runtime.force_interpreter())
            os.environ["SPARSETP_INTERPRET"] = "0"
            self.assertFalse(_runtime.force_interpreter())


class DeviceKindTest(absltest.TestCase):

    def test_cpu_is_native_unless_the_interpreter_is_forced(self):
        for value, kind in (("0", "cpu"), ("1", "interpreter")):
            with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": value}):
                self.assertEqual(_runtime.device_kind("cpu"), kind)

    def test_cuda_is_the_interpreter_when_forced(self):
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}):
            self.assertEqual(_runtime.device_kind("cuda"), "interpreter")

    def test_other_platforms_are_refused(self):
        for platform in ("tpu", "meta", "mps", "gpu"):
            with self.assertRaisesRegex(ValueError, rf"got platform '{platform}'"):
                _runtime.device_kind(platform)
        self.assertEqual(_runtime.PLATFORMS, ("cpu", "cuda"))
        self.assertEqual(sorted(_runtime.__all__),
                         ["PLATFORMS", "device_kind", "force_interpreter"])

    def test_cuda_compiled_in_a_plain_process_interpreted_under_triton_interpret(self):
        """A process started without TRITON_INTERPRET creates the kernels compiled: CUDA data
        runs them compiled (no GPU needed to decide). With TRITON_INTERPRET=1 at start every
        kernel is created interpreted, so CUDA data runs in the interpreter too; CPU data runs
        the native path either way (no Triton). Neither process sets TRITON_INTERPRET itself."""
        code = """
            import os
            from sparsetp import _runtime
            print(_runtime.device_kind("cpu"), _runtime.device_kind("cuda"),
                  os.environ.get("TRITON_INTERPRET", "unset"))
            """
        plain = _python(code)
        self.assertEqual(plain.returncode, 0, plain.stderr[-3000:])
        self.assertEqual(plain.stdout.split(), ["cpu", "cuda", "unset"])
        forced = _python(code, TRITON_INTERPRET="1")
        self.assertEqual(forced.returncode, 0, forced.stderr[-3000:])
        self.assertEqual(forced.stdout.split(), ["cpu", "interpreter", "1"])

    def test_imports_no_framework(self):
        """_runtime imports neither torch, jax nor triton; deciding for CPU data needs none."""
        proc = _python("""
            import sys
            from sparsetp import _runtime
            _runtime.device_kind("cpu"); _runtime.force_interpreter()
            print(sorted(m for m in ("torch", "jax", "triton") if m in sys.modules))
            """)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(proc.stdout.strip(), "[]")


class ImportOrderTest(absltest.TestCase):

    def test_triton_imported_before_sparsetp_runs_cpu_attention(self):
        """Importing triton first used to be an error (the interpreter had to be chosen before
        Triton's import); now CPU tensors run correctly whatever the order."""
        proc = _python("""
            import triton
            import triton.language
            import numpy as np
            import torch
            import sparsetp.torch as st
            from sparsetp.core import make_layout, patterns as P, reference
            lay = make_layout(P.causal() | P.global_tokens(8), 80, 2, 16)
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((1, 2, 80, 32)).astype(np.float32) for _ in range(3))
            out, lse = st.sparse_attention(*(torch.from_numpy(x) for x in (q, k, v)), lay,
                                           return_lse=True)
            ref_out, ref_lse = reference.attention(q, k, v, lay)
            np.testing.assert_allclose(out.numpy(), ref_out, atol=2e-5, rtol=2e-6)
            np.testing.assert_allclose(lse.numpy(), ref_lse, atol=2e-5, rtol=2e-6)
            print("ok", out.device)
            """)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(proc.stdout.split(), ["ok", "cpu"])


if __name__ == "__main__":
    absltest.main()
