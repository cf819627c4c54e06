"""sparsetp.kernels.interpreter: the kernels in Triton's interpreter beside compiled ones.

* In a process whose kernels are compiled (TRITON_INTERPRET unset: the normal case), CPU
  launches wrap them in the interpreter, nested ``@triton.jit`` helpers and Triton's own
  library functions (``tl.sum``) included, and leave Triton's compiled mode as it was.
* A Triton outside the tested versions refuses that with a RuntimeError naming the public way
  (TRITON_INTERPRET=1), and a TRITON_INTERPRET=1 process runs everything interpreted.
* SPARSETP_INTERPRET=1 sends every torch launch to the interpreter.
* Torch on CPU tensors and JAX on CPU arrays share the interpreter in one process, serialised
  by one lock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import numpy as np
import testing_utils as tu
import torch
import triton
import triton.language as tl
from absl.testing import absltest
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.jit import JITFunction

from sparsetp.backends.torch import attention as tattn
from sparsetp.backends.torch import launch as tlaunch
from sparsetp.core import make_layout, reference
from sparsetp.core.examples import example_pattern
from sparsetp.kernels import abi, interpreter

TESTS = os.path.dirname(os.path.abspath(__file__))


@triton.jit
def _scaled(x, factor):
    return x * factor


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, N: tl.constexpr, FACTOR: tl.constexpr):
    # x: [R, N] -> out: [R], out[r] = sum(x[r] * FACTOR); one program per row.
    row = tl.program_id(0)
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + row * N + offs)
    tl.store(out_ptr + row, tl.sum(_scaled(x, FACTOR), axis=0))


def _run_row_sum(kernel=_row_sum_kernel):
    """Launch ``kernel`` in the interpreter on a NaN-filled output; returns (out, expected)."""
    x = torch.arange(24.0).reshape(3, 8) - 5.0
    out = torch.full((3,), float("nan"))
    interpreter.launch(kernel, (3,), (x, out), {"N": 8, "FACTOR": 2.0})
    return out, (x * 2.0).sum(1)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (tests/ on the path) with neither interpreter variable
    set, plus ``env``."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("TRITON_INTERPRET", "SPARSETP_INTERPRET")}
    full["PYTHONPATH"] = os.pathsep.join([TESTS, full.get("PYTHONPATH", "")])
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=full)


def _attention_case(name="bigbird", n=96, bs=32, h=2, d=16, seed=0):
    layout = make_layout(example_pattern(name, n, bs), n, h, bs)
    return (layout, *tu.random_inputs(seed, (1, h, n, d), "float32"))


class SideBySideTest(absltest.TestCase):

    def test_tested_triton_versions_run_side_by_side(self):
        """Every Triton sparsetp supports (pyproject: >=3.6, <3.10) is a tested one."""
        self.assertTrue(interpreter.side_by_side(), triton.__version__)

    def test_nested_helper_and_tl_sum_in_a_compiled_mode_process(self):
        """A fresh process without TRITON_INTERPRET: the kernel, its helper and tl.sum are
        compiled-mode objects, yet the launch interprets them all and gives the right sums;
        afterwards Triton is in compiled mode as before (a helper called outside a kernel
        still raises Triton's compiled-mode error)."""
        proc = _python(
            "import os\n"
            "import torch\n"
            "from triton.runtime.jit import JITFunction\n"
            "from triton.runtime import interpreter as ti\n"
            "import interpreter_test as t\n"
            "from sparsetp.kernels import interpreter\n"
            "assert 'TRITON_INTERPRET' not in os.environ\n"
            "assert type(t._row_sum_kernel) is JITFunction, type(t._row_sum_kernel)\n"
            "assert not interpreter.is_interpreted(t._row_sum_kernel)\n"
            "call, patch = JITFunction.__call__, ti._patch_lang_tensor\n"
            "out, want = t._run_row_sum()\n"
            "torch.testing.assert_close(out, want, rtol=0, atol=0)\n"
            "assert JITFunction.__call__ is call and ti._patch_lang_tensor is patch\n"
            "try:\n"
            "    t._scaled(torch.ones(2), 2.0)\n"
            "except RuntimeError as e:\n"
            "    assert 'outside of the scope of a kernel' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('a compiled-mode helper ran outside a kernel')\n"
            "print('ok', out.tolist())\n")
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(proc.stdout.strip(), "ok [-24.0, 104.0, 232.0]")

    def test_compiles_after_an_interpreted_launch(self):
        """An interpreted launch whose kernel calls device functions (a helper, tl.sum) leaves
        Triton's language as it found it: the same kernel then still compiles (for sm_90, no GPU
        needed; a fresh cache so the code generator really runs). Triton's own nested-call path
        leaves its patches in place, which broke every later compile in the process."""
        proc = _python(
            "import triton\n"
            "from triton.backends.compiler import GPUTarget\n"
            "from triton.compiler import ASTSource\n"
            "import interpreter_test as t\n"
            "out, want = t._run_row_sum()\n"
            "assert (out == want).all()\n"
            "sig = {'x_ptr': '*fp32', 'out_ptr': '*fp32', 'N': 'constexpr',\n"
            "       'FACTOR': 'constexpr'}\n"
            "src = ASTSource(t._row_sum_kernel, sig, {'N': 16, 'FACTOR': 3.0}, {})\n"
            "compiled = triton.compile(src, target=GPUTarget('cuda', 90, 32))\n"
            "assert 'ld.global' in compiled.asm['ptx']\n"
            "print('ok')\n",
            TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="sparsetp_interp_compile_"))
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(proc.stdout.strip(), "ok")

    def test_launch_in_this_process(self):
        out, want = _run_row_sum()
        torch.testing.assert_close(out, want, rtol=0, atol=0)

    def test_triton_hooks_restored_after_a_failed_launch(self):
        call, patch = JITFunction.__call__, triton_interpreter._patch_lang_tensor
        x, out = torch.ones(2, 8), torch.empty(2)
        with self.assertRaisesRegex(TypeError, "FACTOR"):
            interpreter.launch(_row_sum_kernel, (2,), (x, out), {"N": 8})  # FACTOR missing
        self.assertIs(JITFunction.__call__, call)
        self.assertIs(triton_interpreter._patch_lang_tensor, patch)

    def test_untested_triton_refuses_with_the_public_way(self):
        """Outside SIDE_BY_SIDE_TRITON a compiled-mode kernel cannot be interpreted beside
        compiled ones: a RuntimeError that says to start with TRITON_INTERPRET=1."""
        compiled = JITFunction(_row_sum_kernel.fn)  # compiled-mode whatever this process's env
        self.assertFalse(interpreter.is_interpreted(compiled))
        for version in ("3.10.0", "3.5.1", "4.0.0"):
            with self.subTest(version=version), mock.patch.object(triton, "__version__",
                                                                  version):
                self.assertFalse(interpreter.side_by_side())
                with self.assertRaisesRegex(RuntimeError, r"Triton .* TRITON_INTERPRET=1"):
                    _run_row_sum(compiled)
        self.assertTrue(interpreter.side_by_side())

    def test_triton_interpret_process_runs_attention(self):
        """TRITON_INTERPRET=1 before import: every kernel is created interpreted, and
        sparse_attention on CPU tensors run through those kernels (SPARSETP_INTERPRET=1: CPU
        data otherwise takes the native path) is right (fwd and bwd vs the oracle)."""
        proc = _python(
            "from sparsetp.kernels import abi, interpreter\n"
            "import interpreter_test as t\n"
            "assert all(interpreter.is_interpreted(abi.kernel(n)) for n in abi.KERNEL_NAMES)\n"
            "layout, q, k, v, d_out = t._attention_case()\n"
            "from unittest import mock\n"
            "with mock.patch.object(interpreter, 'launch', wraps=interpreter.launch) as spy:\n"
            "    res = t._torch_attention(layout, q, k, v, d_out)\n"
            "assert spy.call_count == 3, spy.call_count  # fwd, dq, dk/dv\n"
            "t.check_attention(layout, q, k, v, d_out, *res)\n"
            "print('ok')\n",
            TRITON_INTERPRET="1", SPARSETP_INTERPRET="1")
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(proc.stdout.strip(), "ok")

    def test_triton_interpret_process_takes_the_public_path_for_an_untested_triton(self):
        """In a TRITON_INTERPRET=1 process with a Triton outside SIDE_BY_SIDE_TRITON, launch
        calls the interpreted kernel through Triton's public entry point (kernel[grid](...)),
        never the side-by-side wrapping, and a kernel with a nested helper and tl.sum gives the
        right result. (The version is faked, so the installed interpreter runs: kernels whose
        loop bounds are tensors need that Triton's own handling of them, which Triton 3.6's
        lacks under NumPy >= 2.3; the row-sum kernel has none.)"""
        proc = _python(
            "import torch, triton\n"
            "from unittest import mock\n"
            "from sparsetp.kernels import interpreter\n"
            "import interpreter_test as t\n"
            "assert interpreter.is_interpreted(t._row_sum_kernel)\n"
            "with mock.patch.object(triton, '__version__', '3.10.0'), \\\n"
            "        mock.patch.object(interpreter, '_interpreted',\n"
            "                          side_effect=AssertionError('side-by-side path')):\n"
            "    assert not interpreter.side_by_side()\n"
            "    out, want = t._run_row_sum()\n"
            "torch.testing.assert_close(out, want, rtol=0, atol=0)\n"
            "print('ok', out.tolist())\n",
            TRITON_INTERPRET="1")
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(proc.stdout.strip(), "ok [-24.0, 104.0, 232.0]")


def check_attention(layout, q, k, v, d_out, out, lse, dq, dk, dv, tag=""):
    """out, LSE and gradients (float32) against the float64 oracle."""
    ref_out, ref_lse = reference.attention(q, k, v, layout)
    tu.assert_close(out, ref_out, "float32", what=f"{tag} out")
    tu.assert_close(lse, ref_lse, "float32", what=f"{tag} lse")
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv),
                          reference.attention_grad(q, k, v, layout, d_out), strict=True):
        tu.assert_close(g, r, "float32", grad=True, what=f"{tag} {name}")


def _torch_attention(layout, q, k, v, d_out, device="cpu"):
    tq, tk, tv = (torch.from_numpy(x).to(device).requires_grad_() for x in (q, k, v))
    out, lse = tattn.sparse_attention(tq, tk, tv, layout, return_lse=True)
    out.backward(torch.from_numpy(d_out).to(device))
    return [a.detach().cpu().numpy() for a in (out, lse, tq.grad, tk.grad, tv.grad)]


class ForcedInterpreterTest(absltest.TestCase):

    def _spy(self):
        return mock.patch.object(interpreter, "launch", wraps=interpreter.launch)

    def test_sparsetp_interpret_sends_torch_launches_to_the_interpreter(self):
        """SPARSETP_INTERPRET=1: every torch launch (the four kernels) goes through
        interpreter.launch, and CUDA tensors get the interpreter's device kind too."""
        layout, q, k, v, d_out = _attention_case(seed=1)
        cuda_like = SimpleNamespace(device=torch.device("cuda", 0))  # no GPU needed to decide
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}), self._spy() as spy:
            self.assertEqual(tlaunch.device_kind(cuda_like), "interpreter")
            got = _torch_attention(layout, q, k, v, d_out)
        self.assertEqual({c.args[0] for c in spy.call_args_list},
                         {abi.kernel(n) for n in abi.KERNEL_NAMES})
        check_attention(layout, q, k, v, d_out, *got, tag="forced")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
    def test_sparsetp_interpret_on_cuda_tensors(self):
        """On a GPU, SPARSETP_INTERPRET=1 runs CUDA tensors in the interpreter (Triton copies
        them to the host and back), with the results of the compiled kernels."""
        layout, q, k, v, d_out = _attention_case(seed=2)
        with self._spy() as spy:
            compiled = _torch_attention(layout, q, k, v, d_out, device="cuda")
        self.assertEqual(spy.call_count, 0)  # compiled kernels, no interpreter
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}), self._spy() as spy:
            forced = _torch_attention(layout, q, k, v, d_out, device="cuda")
        self.assertEqual(spy.call_count, 3)  # fwd, dQ, dK/dV
        check_attention(layout, q, k, v, d_out, *compiled, tag="compiled")
        check_attention(layout, q, k, v, d_out, *forced, tag="interpreted")


class OneProcessTest(absltest.TestCase):

    def test_torch_cpu_and_jax_cpu_share_the_interpreter(self):
        """Torch CPU tensors and JAX CPU arrays in one process under SPARSETP_INTERPRET=1 (CPU
        data otherwise takes the native path): both run the same kernel objects through
        interpreter.launch, agree bitwise in the forward (same kernels, same arguments) and
        match the oracle."""
        import jax  # noqa: PLC0415  (the JAX half only)
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp.backends.jax import attention as jattn  # noqa: PLC0415

        layout, q, k, v, d_out = _attention_case(name="per_head_mix", n=100, seed=3)
        self.enter_context(mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}))
        with mock.patch.object(interpreter, "launch", wraps=interpreter.launch) as spy:
            t_res = _torch_attention(layout, q, k, v, d_out)
            torch_kernels = [c.args[0] for c in spy.call_args_list]
            spy.reset_mock()
            cpu = jax.devices("cpu")[0]
            with jax.default_device(cpu):
                args = [jax.device_put(x, cpu) for x in (q, k, v)]
                fn = jax.jit(lambda q, k, v: jattn.sparse_attention(q, k, v, layout,
                                                                    return_lse=True))
                (out, lse), vjp = jax.vjp(fn, *args)
                grads = vjp((jax.device_put(d_out, cpu), jnp.zeros(lse.shape, lse.dtype)))
            jax_kernels = [c.args[0] for c in spy.call_args_list]
        j_res = [np.asarray(a) for a in (out, lse, *grads)]
        self.assertEqual(out.devices(), {cpu})
        every = {abi.kernel(n) for n in abi.KERNEL_NAMES}
        self.assertEqual(set(torch_kernels), every)
        self.assertEqual(set(jax_kernels), every)
        check_attention(layout, q, k, v, d_out, *t_res, tag="torch")
        check_attention(layout, q, k, v, d_out, *j_res, tag="jax")
        for name, a, b in zip(("out", "lse"), t_res, j_res, strict=False):
            np.testing.assert_array_equal(a, b, err_msg=name)

    def test_one_lock_serialises_interpreted_launches(self):
        """The interpreter is not thread-safe: a launch waits while another thread holds
        interpreter.LOCK, and the lock is re-entrant (a launch inside a held section runs)."""
        done = threading.Event()

        def launch():
            _run_row_sum()
            done.set()

        with interpreter.LOCK:
            out, want = _run_row_sum()  # re-entrant: same thread
            torch.testing.assert_close(out, want, rtol=0, atol=0)
            thread = threading.Thread(target=launch)
            thread.start()
            self.assertFalse(done.wait(1.0), "a launch ran while another thread held LOCK")
        thread.join(60)
        self.assertTrue(done.is_set())


if __name__ == "__main__":
    absltest.main()
