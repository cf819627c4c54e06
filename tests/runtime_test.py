"""sparsetp._runtime: the interpreter decision, env overrides and the import-order error."""

import os
import subprocess
import sys

from absl.testing import absltest

from sparsetp import _runtime


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items()
            if k not in ("TRITON_INTERPRET", "SPARSETP_INTERPRET")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=full)


class RuntimeTest(absltest.TestCase):
    def test_one_interpreter_lock_for_both_frontends(self):
        """The interpreter is not thread-safe: torch's and JAX's interpreted launches must
        exclude each other, so they hold the same (re-entrant) lock."""
        r = _python("from sparsetp import _runtime\n"
                    "from sparsetp.backends.torch import attention as t\n"
                    "from sparsetp.backends.jax import launch as j\n"
                    "assert t._INTERPRET_LOCK is j.INTERPRETER_LOCK is _runtime.INTERPRETER_LOCK\n"
                    "with t._INTERPRET_LOCK:\n"
                    "    with j.INTERPRETER_LOCK:\n"
                    "        print('nested ok')\n", SPARSETP_INTERPRET="1")
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn("nested ok", r.stdout)

    def test_flag_parsing(self):
        self.assertIsNone(_runtime._flag(None))
        self.assertIsNone(_runtime._flag(" "))
        self.assertTrue(_runtime._flag("On"))
        self.assertFalse(_runtime._flag("0"))
        with self.assertRaisesRegex(ValueError, "SPARSETP_INTERPRET"):
            _runtime._flag("maybe")

    def test_forced_interpreter_sets_triton_env(self):
        proc = _python("import os, sparsetp.kernels; from sparsetp import _runtime; "
                       "print(_runtime.interpret_mode(), os.environ['TRITON_INTERPRET'])",
                       SPARSETP_INTERPRET="1")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.split(), ["True", "1"])

    def test_triton_imported_first_with_interpreter_needed_is_a_clear_error(self):
        proc = _python("import triton.language\nimport sparsetp.kernels", SPARSETP_INTERPRET="1")
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("Import sparsetp (or sparsetp.torch / sparsetp.jax) before triton",
                      proc.stderr)

    def test_triton_imported_first_under_triton_interpret_works(self):
        proc = _python("import triton.language\nimport sparsetp.kernels\n"
                       "from sparsetp import _runtime; print(_runtime.interpret_mode())",
                       TRITON_INTERPRET="1")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.split(), ["True"])


if __name__ == "__main__":
    absltest.main()
