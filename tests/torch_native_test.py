"""The native eager CUDA path of ``sparse_attention`` (:mod:`sparsetp.backends.torch.native`):
a C++ autograd node launching the same compiled Triton kernels.

* On every machine: the extension builds with torch's C++ toolchain (no CUDA needed), in a
  process of its own whose lock a killed builder never leaves held, and the
  kernel parameters it is handed are the ones Triton's launcher would pass (a fake compiled
  kernel stands in for Triton's).
* On a GPU: after a call signature's first forward + backward (the Python path), its later
  calls go native, and give the Python path's outputs and gradients bit for bit: patterns,
  dtypes, GQA, more keys than queries, ragged lengths, fully masked rows, head dims up to 256,
  output gradients of other strides (a transposed view, a broadcast from ``.sum()``),
  outputs left in reused NaN-filled memory, a dropped layout before the backward, CUDA-graph
  capture; and the cases that must stay on the Python path do.
* On an sm_90 GPU: the same node launching the sm_90 kernels, whose TMA descriptors it encodes
  per call (and their packing checked on every machine against a stand-in compiled kernel).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import unittest
import warnings
from types import SimpleNamespace
from unittest import mock

import attention_test_base as base
import testing_utils as tu
import torch
from absl.testing import absltest, parameterized
from torch_attention_test import _to, fwd_description

from sparsetp.backends.torch import attention as tattn
from sparsetp.backends.torch import launch as tlaunch
from sparsetp.backends.torch import native, native_build
from sparsetp.core import make_layout
from sparsetp.core import patterns as P
from sparsetp.kernels import abi, options
from sparsetp.kernels import hopper as hopper_kernels

CUDA = torch.cuda.is_available()
NEEDS_CUDA = "needs a CUDA GPU"
SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)
NEEDS_SM90 = "needs an sm_90 (Hopper) GPU"


def _fake_compiled(desc, *, scratch=0, one_is_constexpr=None):
    """A stand-in for Triton's CompiledKernel of ``desc``: its signature types every argument
    as Triton would (pointers, i32 ints, fp32 floats, constexprs); ``one_is_constexpr`` names
    an int argument Triton specialised away (an int equal to 1)."""
    names = desc.call.kernel.arg_names  # desc.call.args hold None for the per-call tensors
    values = (*desc.call.args, *desc.call.outputs, *desc.constexpr_values)
    n_params = len(desc.call.args) + len(desc.call.outputs)
    signature = {}
    for i, (name, value) in enumerate(zip(names, values, strict=True)):
        if i >= n_params or name == one_is_constexpr:
            signature[name] = "constexpr"
        elif i < desc.n_tensors or i >= len(desc.call.args) or isinstance(value, torch.Tensor):
            signature[name] = "*fp32"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    metadata = SimpleNamespace(num_warps=4, shared=1024, num_ctas=1, global_scratch_size=scratch,
                               profile_scratch_size=0, launch_cooperative_grid=False,
                               launch_pdl=False)
    return SimpleNamespace(name="fake", function=12345, src=SimpleNamespace(signature=signature),
                           metadata=metadata)


class NativeCellsTest(absltest.TestCase):
    """``native.plan_cells``: the parameter cells handed to C++, from a launch description."""

    def setUp(self):
        super().setUp()
        self.desc = fwd_description()[0]

    def test_cells_follow_the_signature(self):
        desc = self.desc
        tail_ints = [(i, name) for i, name in enumerate(desc.call.kernel.arg_names)
                     if 3 <= i < len(desc.call.args) and isinstance(desc.call.args[i], int)
                     and not isinstance(desc.call.args[i], bool)]
        self.assertNotEmpty(tail_ints)
        dropped = tail_ints[0][1]
        compiled = _fake_compiled(desc, one_is_constexpr=dropped)
        cells, per_call = native.plan_cells(desc, compiled)
        signature = compiled.src.signature
        kept = [n for n in desc.call.kernel.arg_names if signature[n] != "constexpr"]
        self.assertLen(cells, len(kept) + 2)
        self.assertEqual(cells[-2:], [0, 0])  # Triton's global and profile scratch pointers
        # q, k, v first, then out and lse: the per-call tensors in launch order.
        self.assertEqual([t for _, t in per_call], [0, 1, 2, 3, 4])
        values = dict(zip(desc.call.kernel.arg_names,
                          (*desc.call.args, None, None, *desc.constexpr_values), strict=True))
        slots = dict(per_call)
        for cell, name in enumerate(kept):
            value, ty = values[name], signature[name]
            if cell in slots:
                self.assertEqual(cells[cell], 0, name)
            elif isinstance(value, torch.Tensor):
                self.assertEqual(cells[cell], value.data_ptr(), name)
            elif ty == "fp32":
                self.assertEqual(cells[cell], struct.unpack("<I", struct.pack("<f", value))[0])
            else:
                self.assertEqual(cells[cell], int(value) & 0xFFFFFFFF, name)
        self.assertNotIn(dropped, kept)

    def test_negative_ints_are_twos_complement(self):
        self.assertEqual(abi.pack_cell("i32", -1), 0xFFFFFFFF)
        self.assertEqual(abi.pack_cell("i64", -2), 2**64 - 2)
        self.assertEqual(abi.pack_cell("bf16", 1.0), 0x3F80)
        self.assertEqual(abi.pack_cell("fp64", 0.5), struct.unpack("<Q", struct.pack("<d", 0.5))[0])
        with self.assertRaisesRegex(ValueError, "no native packing"):
            abi.pack_cell("nvTmaDesc", 0)

    def test_refuses_kernels_it_cannot_pass(self):
        with self.assertRaisesRegex(ValueError, "scratch"):
            native.plan_cells(self.desc, _fake_compiled(self.desc, scratch=256))
        compiled = _fake_compiled(self.desc)
        compiled.src.signature = dict(reversed(list(compiled.src.signature.items())))
        with self.assertRaisesRegex(ValueError, "argument order"):
            native.plan_cells(self.desc, compiled)


def _fake_sm90_compiled(launch):
    """A stand-in for Triton's CompiledKernel of sm_90 ``launch``: the Gluon kernel's own
    parameter names typed as Triton types them (descriptors, pointers, fp32 and i32 scalars,
    an int equal to 1 specialised into a constexpr, then the constexprs), and one TMA record per
    descriptor."""
    names = getattr(hopper_kernels, launch.kernel).arg_names
    values = ([("box", n) for n, _ in launch.boxes] + [("arg", a) for a in launch.args]
              + [("ptr", n) for n in launch.pointers])
    signature = {}
    for i, name in enumerate(names):
        what, value = values[i] if i < len(values) else ("constexpr", None)
        signature[name] = ("constexpr" if what == "constexpr" or (
                               type(value) is int and value == 1)
                           else "tensordesc" if what == "box"
                           else "*bf16" if what == "ptr" or isinstance(value, torch.Tensor)
                           else "fp32" if isinstance(value, float) else "i32")
    metadata = SimpleNamespace(
        name=launch.kernel, num_warps=4, shared=2048, num_ctas=1, global_scratch_size=0,
        profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False,
        tensordesc_meta=[dict(block_size=[rows, 128], elem_type=9, elem_size=2, swizzle=3)
                         for _, rows in launch.boxes])
    return SimpleNamespace(function=777, src=SimpleNamespace(signature=signature),
                           metadata=metadata)


class NativeSm90CellsTest(absltest.TestCase):
    """``native.sm90_kernel``: the cells, per-call tensors and TMA records handed to C++ for
    an sm_90 launch (Triton 3.6's packing, ``sparsetp.kernels.hopper.parameters``)."""

    def test_cells_per_call_tensors_and_descriptors(self):
        lay = make_layout(P.causal(), 256, 2, 128)
        meta = tlaunch.device_group_metadata(lay, 2, torch.device("cpu"))  # GQA, 2 : 1
        launches = hopper_kernels.launches(meta, 1, 2, 1, 256, 256, 0.125, False, 128,
                                           skip_quarters=lay.skip_quarters,
                                           skip_halves=lay.skip_halves)
        fake = SimpleNamespace(Kernel=lambda **kw: kw)  # what the C++ Kernel is handed
        rows = {"q": 512, "d_out": 512, "out": 512, "dq": 512, "k": 256, "v": 256, "dk": 256,
                "dv": 256}
        for which in ("fwd", "dq", "dkdv"):
            with self.subTest(which):
                launch = launches[which]
                compiled = _fake_sm90_compiled(launch)
                k = native.sm90_kernel(fake, which, launch, compiled, rows, 128)
                names = native.TENSORS[which]
                types = list(compiled.src.signature.values())
                self.assertIn("constexpr", types[:len(launch.args)])  # kv_heads = 1 is one
                # Every non-constexpr parameter a cell, a descriptor five, two scratch cells.
                self.assertLen(k["cells"], sum(t != "constexpr" for t in types)
                               + 4 * len(launch.boxes) + 2)
                # Each descriptor: its tensor, rows, d, box and dtype; the cell after it holds
                # the view's rows (i32), then d, then the strides d and 1 (i64).
                self.assertEqual([(names[t[1]], t[2], t[3], t[4], t[5], t[6], t[7])
                                  for t in k["tma"]],
                                 [(n, rows[n], 128, r, 128, 8, 2) for n, r in launch.boxes])
                for t in k["tma"]:
                    self.assertEqual(k["cells"][t[0]:t[0] + 5], [0, t[2], 128, 128, 1])
                self.assertEqual([names[i] for _, i in k["per_call"]], list(launch.pointers))
                arrays = [a.data_ptr() for a in launch.args if isinstance(a, torch.Tensor)]
                self.assertEqual([c for c in k["cells"] if c in arrays], arrays)
                self.assertEqual(k["cells"][-2:], [0, 0])  # the scratch pointers
                self.assertEqual((k["grid"], k["threads"], k["shared"], k["function"]),
                                 (list(launch.grid), 128, 2048, 777))
                scale_bits = struct.unpack("<I", struct.pack("<f", 0.125 * 1.4426950408889634))
                self.assertIn(scale_bits[0], k["cells"])

    def test_refuses_what_it_cannot_pass(self):
        lay = make_layout(P.causal(), 256, 1, 128)
        meta = tlaunch.device_metadata(lay, torch.device("cpu"))
        launch = hopper_kernels.launches(meta, 1, 1, 1, 256, 256, 0.125, False, 128,
                                         skip_quarters=lay.skip_quarters,
                                         skip_halves=lay.skip_halves)["fwd"]
        fake = SimpleNamespace(Kernel=lambda **kw: kw)
        rows = {"q": 256, "out": 256, "k": 256, "v": 256}
        compiled = _fake_sm90_compiled(launch)
        compiled.metadata.global_scratch_size = 64
        with self.assertRaisesRegex(ValueError, "scratch"):
            native.sm90_kernel(fake, "fwd", launch, compiled, rows, 128)
        compiled = _fake_sm90_compiled(launch)
        compiled.function = None
        with self.assertRaisesRegex(ValueError, "not loaded"):
            native.sm90_kernel(fake, "fwd", launch, compiled, rows, 128)
        compiled = _fake_sm90_compiled(launch)
        compiled.metadata.tensordesc_meta = None  # host-side descriptors: another packing
        with self.assertRaisesRegex(ValueError, "device-side descriptors"):
            native.sm90_kernel(fake, "fwd", launch, compiled, rows, 128)
        compiled = _fake_sm90_compiled(launch)
        compiled.src.signature["added"] = "i32"  # a parameter no value is given for
        with self.assertRaisesRegex(ValueError, "no value"):
            native.sm90_kernel(fake, "fwd", launch, compiled, rows, 128)
        compiled = _fake_sm90_compiled(launch)
        with self.assertRaisesRegex(ValueError, "not among"):
            native.sm90_kernel(fake, "dkdv", launch, compiled, rows, 128)  # no "out" there


class DistinctDenseTest(absltest.TestCase):
    """Which output gradients a native plan may be built for (their strides are kept)."""

    def test_strides(self):
        x = torch.randn(1, 2, 8, 4)
        self.assertTrue(tattn._distinct_dense(x))
        self.assertTrue(tattn._distinct_dense(x.transpose(1, 2).contiguous().transpose(1, 2)))
        self.assertTrue(tattn._distinct_dense(torch.randn(2, 1, 8, 4)[:, :, :, :]))
        self.assertFalse(tattn._distinct_dense(torch.ones(()).expand(1, 2, 8, 4)))  # .sum()
        self.assertFalse(tattn._distinct_dense(x[:, :, ::2]))


class SavedTensorHookStridesTest(absltest.TestCase):
    """The Python path keys its backward launches on q/k/v's strides too: a saved-tensor hook
    may give them back in another layout (save_on_cpu(pin_memory=True) packs contiguously),
    after a plain backward built a description for the forward's strides. Runs the kernels in
    Triton's interpreter on CPU tensors."""

    def test_save_on_cpu_after_a_plain_backward(self):
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}):
            layout = make_layout(P.causal(), 32, 2, 16)
            gen = torch.Generator().manual_seed(0)
            qkv = torch.randn(1, 32, 3, 2, 16, generator=gen)
            g = torch.randn(1, 2, 32, 16, generator=gen)

            def grads(attn, hooks):
                x = qkv.clone().requires_grad_()
                q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # non-dense [B, H, N, D] views
                with (torch.autograd.graph.save_on_cpu(pin_memory=True) if hooks
                      else mock.MagicMock()):
                    out = attn(q, k, v, layout)
                out.backward(g)
                return x.grad

            want = grads(tattn.naive_sparse_attention, False)
            for hooks in (False, True):  # the plain backward first: its description is cached
                got = grads(tattn.sparse_attention, hooks)
                tu.assert_close(got.numpy(), want.numpy(), "float32", grad=True,
                                what=f"save_on_cpu={hooks}")


class NativeBuildTest(absltest.TestCase):

    def test_builds_here(self):
        """The C++ source builds with torch's headers and toolchain, with or without CUDA."""
        self.assertEqual(native.wait(), "ready")
        module = native.load()
        self.assertTrue(hasattr(module, "attention") and hasattr(module, "Plan"))

    def test_a_failed_build_names_the_compilers_first_error(self):
        ninja = ("Error building extension 'sparsetp_native': [1/2] c++ -MMD -MF native.o.d "
                 "-c native.cpp -o native.o\nFAILED: native.o\n"
                 "native.cpp:12:3: error: 'at::Tensor' has no member named 'foo'\n"
                 "ninja: build stopped: subcommand failed.\n")
        # What native_build.py reports: a traceback-free JSON line last on stderr.
        failed = subprocess.CompletedProcess([], 1, "", "\n" + json.dumps(
            {"type": "RuntimeError", "message": ninja}) + "\n")
        status, _ = self._build_ending(failed, "has no member named 'foo'")
        self.assertEqual(status, "unavailable: RuntimeError: native.cpp:12:3: "
                                 "error: 'at::Tensor' has no member named 'foo'")

    def test_a_crashed_build_process_says_how_it_ended(self):
        crashed = subprocess.CompletedProcess([], -9, "", "Fatal Python error: Aborted\n")
        status, _ = self._build_ending(crashed, "did not build")
        self.assertEqual(status, "unavailable: build process exit -9: Fatal Python error: "
                                 "Aborted")

    def test_the_build_process_imports_what_this_process_imported(self):
        # A path added at run time (a notebook's sys.path.append) reaches the build process.
        path = [*sys.path, "", "/added/at/run/time"]
        with mock.patch.object(sys, "path", path), \
                mock.patch.dict(os.environ, {"PYTHONPATH": "/from/the/environment",
                                             "SPARSETP_TEST_MARK": "kept"}):
            _, run = self._build_ending(subprocess.CompletedProcess([], 1, "", ""),
                                        "did not build")
        env = run.call_args.kwargs["env"]
        self.assertEqual(env["PYTHONPATH"].split(os.pathsep),
                         [p for p in path if p] + ["/from/the/environment"])
        self.assertEqual(env["SPARSETP_TEST_MARK"], "kept")  # the rest of the environment

    def test_a_built_library_loads_at_once(self):
        """A process that finds the library in the cache imports it on its first call: no
        build process, no calls on the Python path meanwhile."""
        self.assertEqual(native.wait(), "ready")
        done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import torch
            from sparsetp.backends.torch import native
            module = native.load()
            print(native.status(), module is not None and hasattr(module, "Plan"),
                  native._STATE["thread"] is None)
            """)], capture_output=True, text=True, timeout=300, check=False)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.split(), ["ready", "True", "True"])

    def _build_ending(self, result, warning):
        """(status after, the mocked run) of a build whose process ends as ``result``
        (a ``subprocess.CompletedProcess``); its warning must match ``warning``."""
        with self._state(), \
                mock.patch.object(native.subprocess, "run", return_value=result) as run, \
                self.assertWarnsRegex(RuntimeWarning, warning):
            native._build()
            return native.status(), run

    @contextlib.contextmanager
    def _state(self):
        saved = dict(native._STATE)
        try:
            yield
        finally:
            native._STATE.clear()
            native._STATE.update(saved)

    def test_disabled_by_environment(self):
        with mock.patch.dict(os.environ, {"SPARSETP_NATIVE": "0"}):
            self.assertIsNone(native.load())
            self.assertEqual(native.status(), "disabled (SPARSETP_NATIVE=0)")
        with mock.patch.dict(os.environ, {"SPARSETP_NATIVE": "maybe"}):
            with self.assertRaisesRegex(ValueError, "SPARSETP_NATIVE"):
                native.status()


class NativeBuildProcessTest(absltest.TestCase):
    """``native_build.py``, the process that builds the library: one builder at a time on an
    ``flock`` the kernel releases when its holder dies, so a killed build never blocks the
    next (``cpp_extension``'s lock file did, forever); what a killed builder left is removed.
    The compile itself is faked here (``NativeBuildTest`` builds for real)."""

    def setUp(self):
        super().setUp()
        self.cache = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.cache, ignore_errors=True)
        self.target = os.path.join(self.cache, "torch_native-0123456789abcdef.so")
        self.compiled = []

    def _fake_compile(self, source, target, cflags):
        self.compiled.append(source)
        with open(target, "w") as f:
            f.write("library")

    def _build(self):
        with mock.patch.object(native_build, "_compile", self._fake_compile):
            native_build.build("native.cpp", self.target, ["-O2"])

    def test_builds_once_and_removes_what_a_killed_builder_left(self):
        left = os.path.join(self.cache, native_build._build_prefix(self.target) + "x1")
        os.makedirs(left)
        other = os.path.join(self.cache, ".build-torch_native-fedcba9876543210.so-y")
        os.makedirs(other)  # another library's build: not this builder's to remove
        open(self.target + ".lock", "w").close()  # a lock file no process holds
        self._build()
        self._build()  # built: nothing to do
        self.assertEqual(self.compiled, ["native.cpp"])
        self.assertFalse(os.path.exists(left))
        self.assertTrue(os.path.exists(other))
        with open(self.target) as f:
            self.assertEqual(f.read(), "library")

    def test_waits_for_a_live_builder_and_takes_over_from_a_killed_one(self):
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys, time
            lock = open({self.target + ".lock"!r}, "w")
            fcntl.flock(lock, fcntl.LOCK_EX)
            print("held", flush=True)
            time.sleep(600)
            """)], stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(holder.stdout.readline().strip(), "held")
            waiter = threading.Thread(target=self._build)
            waiter.start()
            waiter.join(timeout=1.0)
            self.assertTrue(waiter.is_alive())  # blocked on the live holder's lock
            self.assertEqual(self.compiled, [])
        finally:
            holder.kill()  # SIGKILL mid-build: its finally blocks never run
            holder.wait()
        waiter.join(timeout=30)
        self.assertFalse(waiter.is_alive())
        self.assertEqual(self.compiled, ["native.cpp"])
        self.assertTrue(os.path.exists(self.target))

    def test_reports_a_failure_as_json_last_on_stderr(self):
        def fail(source, target, cflags):
            raise RuntimeError("x.cpp:1:1: error: boom")

        err = io.StringIO()
        with mock.patch.object(native_build, "_compile", fail), \
                contextlib.redirect_stderr(err):
            code = native_build.main(["native.cpp", self.target, "-O2"])
        self.assertEqual(code, 1)
        self.assertEqual(json.loads(err.getvalue().strip().splitlines()[-1]),
                         {"type": "RuntimeError", "message": "x.cpp:1:1: error: boom"})
        self.assertFalse(os.path.exists(self.target))


def _inputs(name, n, n_kv, bs, h, h_kv, d, dtype, seed=0):
    """The shared test case (``attention_test_base.case``, B=1) as CUDA tensors."""
    layout, *arrays = base.case(name, n, bs, 1, h, d, dtype, seed, n_kv=n_kv, h_kv=h_kv)
    return (layout, *(_to(x, dtype, "cuda") for x in arrays))


def _grad_fn_name(out) -> str:
    return out.grad_fn.name() if out.grad_fn is not None else "None"


def _in_new_thread(fn):
    """``fn()`` run on a new host thread (no current CUDA context yet); its exception re-raised
    here."""
    import threading  # noqa: PLC0415

    got, errors = [], []

    def work():
        try:
            got.append(fn())
        except Exception as exc:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return got[0]


class _NativeCase(parameterized.TestCase):
    """Runs a call signature on the Python path and then natively, and compares."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        if native.wait() != "ready":
            raise AssertionError(f"the native extension did not build: {native.status()}")

    def _run(self, layout, q, k, v, d_out, *, want_native, grad_of=lambda out, g: (out, g)):
        """out, dq, dk, dv of one forward + backward; asserts which path ran."""
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = tattn.sparse_attention(*leaves, layout)
        name = _grad_fn_name(out)
        if want_native is not None:
            self.assertEqual(name == "SparseAttentionBackward", want_native, name)
        target, grad = grad_of(out, d_out)
        target.backward(grad)
        return (out.detach(), *(t.grad for t in leaves))

    def _both(self, layout, q, k, v, d_out, **kw):
        """The Python path's results, then the native path's (a call signature's first call
        runs on the Python path and builds its native plan; the next ones run natively)."""
        with options.launch_options(native_autograd=False):
            ref = self._run(layout, q, k, v, d_out, want_native=False, **kw)
        self._run(layout, q, k, v, d_out, want_native=None, **kw)
        got = self._run(layout, q, k, v, d_out, want_native=True, **kw)
        return ref, got

    def _assert_bitwise(self, ref, got, tag=""):
        for what, a, b in zip(("out", "dq", "dk", "dv"), ref, got, strict=True):
            self.assertTrue(torch.equal(a, b), f"{tag} {what}: max diff "
                            f"{(a.float() - b.float()).abs().max().item()}")

    def _check_gradient_strides(self, layout, q, k, v, d_out):
        """Output gradients as a transposed view and as a broadcast from .sum(): the Python
        path's gradients."""
        transposed = d_out.transpose(1, 2).contiguous().transpose(1, 2)
        for tag, grad_of in (("transposed", lambda out, g: (out, transposed)),
                             ("sum", lambda out, g: (out.float().sum(), None))):
            with self.subTest(tag):
                ref, got = self._both(layout, q, k, v, d_out, grad_of=grad_of)
                self._assert_bitwise(ref, got, tag)

    def _check_graph_capture(self, layout, q, k, v, d_out, options_used=contextlib.nullcontext):
        """A forward + backward captured in a CUDA graph (the node's launches, under
        ``options_used()``) and replayed: the Python path's results."""
        ref, _ = self._both(layout, q, k, v, d_out)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with options_used(), torch.cuda.stream(stream):
            out = tattn.sparse_attention(*leaves, layout)  # warm-up on the capture stream
            out.backward(d_out)
            for t in leaves:
                t.grad = None
            with torch.cuda.graph(graph, stream=stream):
                out = tattn.sparse_attention(*leaves, layout)
                self.assertEqual(_grad_fn_name(out), "SparseAttentionBackward")
                out.backward(d_out)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
        self._assert_bitwise(ref, (out.detach(), *(t.grad for t in leaves)), "graph replay")

    def _check_oracle(self, layout, q, k, v, d_out, dtype):
        """The native results against the float64 oracle, not only against the Python path."""
        from sparsetp.core import reference  # noqa: PLC0415

        _, got = self._both(layout, q, k, v, d_out)
        arrays = [t.double().cpu().numpy() for t in (q, k, v, d_out)]
        ref_out, _ = reference.attention(*arrays[:3], layout)
        refs = reference.attention_grad(*arrays[:3], layout, arrays[3])
        tu.assert_close(got[0].float().cpu().numpy(), ref_out, dtype, what="native out")
        for what, g, r in zip(("dq", "dk", "dv"), got[1:], refs, strict=True):
            tu.assert_close(g.float().cpu().numpy(), r, dtype, what=f"native {what}", grad=True)


@unittest.skipUnless(CUDA, NEEDS_CUDA)
class NativeCudaTest(_NativeCase):

    @parameterized.named_parameters(
        ("causal_bf16", "causal", 256, 256, 64, 2, 2, 64, "bfloat16"),
        ("bigbird_fp16_ragged", "bigbird", 300, 300, 64, 2, 2, 64, "float16"),
        ("gqa_more_keys_fp32", "causal", 96, 200, 32, 4, 2, 32, "float32"),
        ("per_head_mix_d128", "per_head_mix", 130, 130, 32, 3, 3, 128, "bfloat16"),
        ("masked_rows", "masked_rows", 100, 100, 64, 2, 2, 16, "bfloat16"),
        ("local_d256", "local", 128, 128, 64, 2, 1, 256, "bfloat16"),
    )
    def test_bitwise_equal_to_python_path(self, name, n, n_kv, bs, h, h_kv, d, dtype):
        layout, q, k, v, d_out = _inputs(name, n, n_kv, bs, h, h_kv, d, dtype)
        ref, got = self._both(layout, q, k, v, d_out)
        self._assert_bitwise(ref, got, name)
        again = self._run(layout, q, k, v, d_out, want_native=True)
        self._assert_bitwise(got, again, f"{name} deterministic")

    def test_other_output_gradient_strides(self):
        """The plan keeps the first backward's d_out strides; a transposed view and a broadcast
        from .sum() are copied to them, with the Python path's gradients."""
        self._check_gradient_strides(*_inputs("causal", 192, 192, 64, 2, 2, 64, "bfloat16", 1))

    def test_outputs_in_nan_filled_memory(self):
        """Outputs are allocated in C++: reused NaN-filled blocks must be overwritten."""
        layout, q, k, v, d_out = _inputs("masked_rows", 100, 100, 64, 2, 2, 16, "bfloat16", 2)
        ref, _ = self._both(layout, q, k, v, d_out)
        for _ in range(3):
            poison = torch.full((1 << 22,), float("nan"), device="cuda")  # 16 MiB of NaN
            del poison  # back to the caching allocator, which hands it out next
            got = self._run(layout, q, k, v, d_out, want_native=True)
            self._assert_bitwise(ref, got, "after NaN")

    def test_layout_dropped_before_backward(self):
        """A pending native backward keeps the layout's metadata alive."""
        layout, q, k, v, d_out = _inputs("bigbird", 256, 256, 64, 2, 2, 32, "bfloat16", 3)
        ref, _ = self._both(layout, q, k, v, d_out)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = tattn.sparse_attention(*leaves, layout)
        self.assertEqual(_grad_fn_name(out), "SparseAttentionBackward")
        del layout
        tattn._PLANS.clear()
        tlaunch._CALLS.clear()
        gc.collect()
        torch.cuda.empty_cache()
        out.backward(d_out)
        self._assert_bitwise(ref, (out.detach(), *(t.grad for t in leaves)), "dropped layout")

    def test_cuda_graph_capture(self):
        self._check_graph_capture(*_inputs("causal", 128, 128, 64, 2, 2, 64, "bfloat16", 4))

    def test_cases_that_stay_on_the_python_path(self):
        layout, q, k, v, d_out = _inputs("causal", 128, 128, 64, 2, 2, 64, "bfloat16", 5)
        self._both(layout, q, k, v, d_out)  # the plan is native now
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = tattn.sparse_attention(*leaves, layout, return_lse=True)
        self.assertEqual(_grad_fn_name(out), "_SparseAttentionFnBackward")  # lse is differentiable
        flat = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
        misaligned = flat[1:1 + q.numel()].view(q.shape).copy_(q).requires_grad_()
        out = tattn.sparse_attention(misaligned, *leaves[1:], layout)
        self.assertNotEqual(_grad_fn_name(out), "SparseAttentionBackward")
        with mock.patch.object(tlaunch, "_launch_hooks", lambda: (print, print)):
            self.assertFalse(tattn._native_ready(q, k, v))
        with torch.no_grad():  # nothing to differentiate: native too, no node
            out_ng, lse_ng = tattn.sparse_attention(q, k, v, layout, return_lse=True)
        with options.launch_options(native_autograd=False), torch.no_grad():
            ref_out, ref_lse = tattn.sparse_attention(q, k, v, layout, return_lse=True)
        self.assertTrue(torch.equal(out_ng, ref_out) and torch.equal(lse_ng, ref_lse))

    def test_a_backward_before_any_forward_of_its_plan(self):
        # ``_backward`` alone (the benchmarks call it so): the plan has no forward description
        # to hand to C++, so it stays on the Python path instead of failing.
        layout, q, k, v, d_out = _inputs("causal", 128, 128, 64, 2, 2, 64, "bfloat16", 6)
        scale = q.shape[-1] ** -0.5
        with options.launch_options(native_autograd=False):
            out, lse = tattn._forward(q, k, v, layout, scale)
            ref = tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)
        got = tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)  # a new plan
        for what, a, b in zip(("dq", "dk", "dv"), ref, got, strict=True):
            self.assertTrue(torch.equal(a, b), what)

    def test_no_double_backward_on_either_path(self):
        layout, q, k, v, d_out = _inputs("causal", 128, 128, 64, 2, 2, 64, "float32", 6)
        self._both(layout, q, k, v, d_out)
        for native_on in (True, False):
            with self.subTest(native=native_on), options.launch_options(
                    native_autograd=native_on):
                q_leaf = q.detach().clone().requires_grad_()
                out = tattn.sparse_attention(q_leaf, k, v, layout)
                with self.assertRaisesRegex(RuntimeError, "no double backward"):
                    torch.autograd.grad(out, q_leaf, d_out, create_graph=True)

    def test_saved_tensor_hooks_that_change_strides(self):
        """save_on_cpu(pin_memory=True) gives q, k, v back contiguous; here they are strided
        views of a packed qkv, so both paths must re-key (Python) or re-lay (C++) them."""
        layout, q, k, v, d_out = _inputs("causal", 128, 128, 64, 2, 2, 64, "bfloat16", 8)
        qkv = torch.stack([q, k, v], dim=3).transpose(2, 3).contiguous().transpose(2, 3)
        self.assertFalse(qkv.unbind(3)[0].is_contiguous())

        def run(native_on, hooks):
            base = qkv.detach().clone().requires_grad_()  # clone keeps the packed strides
            with options.launch_options(native_autograd=native_on), (
                    torch.autograd.graph.save_on_cpu(pin_memory=True) if hooks
                    else contextlib.nullcontext()):
                out = tattn.sparse_attention(*base.unbind(3), layout)
                name = _grad_fn_name(out)
                out.backward(d_out)
            return (out.detach(), *base.grad.unbind(3)), name

        ref, _ = run(False, False)
        run(True, False)  # builds the native plan for these strides
        for native_on in (True, False):
            with self.subTest(native=native_on):
                got, name = run(native_on, True)
                self.assertEqual(name == "SparseAttentionBackward", native_on, name)
                self._assert_bitwise(ref, got, f"save_on_cpu native={native_on}")

    def test_forward_mode_ad_and_unused_output(self):
        layout, q, k, v, d_out = _inputs("causal", 128, 128, 64, 2, 2, 64, "float32", 9)
        self._both(layout, q, k, v, d_out)
        import torch.autograd.forward_ad as fwAD  # noqa: PLC0415

        class DropGrad(torch.autograd.Function):  # hands the attention an undefined gradient
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return None

        for native_on in (True, False):
            with self.subTest(native=native_on), options.launch_options(
                    native_autograd=native_on):
                with fwAD.dual_level(), self.assertRaises((RuntimeError, NotImplementedError)):
                    dual = fwAD.make_dual(q, torch.randn_like(q))
                    tattn.sparse_attention(dual, k, v, layout)
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                out = tattn.sparse_attention(*leaves, layout)
                self.assertEqual(_grad_fn_name(out) == "SparseAttentionBackward", native_on)
                (DropGrad.apply(out) + leaves[0]).sum().backward()
                self.assertTrue(torch.equal(leaves[1].grad, torch.zeros_like(k)))
                self.assertTrue(torch.equal(leaves[0].grad, torch.ones_like(q)))

    def test_first_cuda_work_of_a_new_thread(self):
        """A host thread with no current CUDA context yet: the C++ launch binds one."""
        layout, q, k, v, d_out = _inputs("causal", 128, 128, 64, 2, 2, 64, "bfloat16", 10)
        ref, _ = self._both(layout, q, k, v, d_out)
        got = _in_new_thread(lambda: self._run(layout, q, k, v, d_out, want_native=True))
        self._assert_bitwise(ref, got, "new thread")

    def test_not_under_jit_trace(self):
        layout, q, k, v, d_out = _inputs("causal", 128, 128, 64, 2, 2, 64, "bfloat16", 11)
        self._both(layout, q, k, v, d_out)
        self.assertTrue(tattn._native_ready(q, k, v))
        with mock.patch.object(torch.jit, "is_tracing", lambda: True):
            self.assertFalse(tattn._native_ready(q, k, v))

    def test_matches_the_oracle(self):
        self._check_oracle(*_inputs("bigbird", 200, 200, 32, 2, 2, 32, "float32", 7), "float32")


@unittest.skipUnless(SM90, NEEDS_SM90)
class NativeSm90Test(_NativeCase):
    """The C++ node launching the sm_90 kernels (:mod:`sparsetp.kernels.hopper`), their TMA
    descriptors encoded in C++ per call: bitwise the Python path's sm_90 results. The fast paths
    are forced (the auto rule takes them from 1024 programs), and a fast path that failed would
    warn and fall back, which is an error here."""

    fwd_kernel = bwd_kernel = "hopper"

    def _run(self, *args, **kw):
        with options.launch_options(fwd_kernel=self.fwd_kernel, bwd_kernel=self.bwd_kernel), \
                warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            return super()._run(*args, **kw)

    def _kernels(self, layout, q, k, v):
        with options.launch_options(fwd_kernel=self.fwd_kernel, bwd_kernel=self.bwd_kernel):
            return (tattn.forward_kernel(q, k, v, layout).name,
                    tattn.backward_kernel(q, k, v, layout).name)

    @parameterized.named_parameters(
        ("causal_bf16", "causal", 512, 512, 128, 2, 2, 128, "bfloat16", "hopper", "hopper"),
        ("bigbird_fp16", "bigbird", 384, 384, 128, 2, 2, 128, "float16", "hopper", "hopper"),
        ("gqa_more_keys", "causal", 256, 512, 128, 4, 2, 128, "bfloat16", "hopper", "hopper"),
        ("masked_rows", "masked_rows", 256, 256, 128, 2, 2, 128, "bfloat16", "hopper",
         "hopper"),
        ("per_head_mix_block_64", "per_head_mix", 256, 256, 64, 3, 3, 128, "bfloat16",
         "hopper", "hopper"),
        # One node, both kinds: the sm_90 forward with the portable backward (head dim 256),
        # and the portable forward with the sm_90 backward.
        ("d256_portable_backward", "local", 256, 256, 128, 2, 1, 256, "bfloat16", "hopper",
         "auto"),
        ("portable_forward", "bigbird", 256, 256, 128, 2, 2, 128, "bfloat16", "portable",
         "hopper"),
    )
    def test_bitwise_equal_to_python_path(self, name, n, n_kv, bs, h, h_kv, d, dtype, fwd,
                                          bwd):
        self.fwd_kernel, self.bwd_kernel = fwd, bwd
        layout, q, k, v, d_out = _inputs(name, n, n_kv, bs, h, h_kv, d, dtype)
        ref, got = self._both(layout, q, k, v, d_out)
        self._assert_bitwise(ref, got, name)
        self.assertEqual(self._kernels(layout, q, k, v),
                         (fwd, "hopper" if bwd == "hopper" else "portable"))
        again = self._run(layout, q, k, v, d_out, want_native=True)
        self._assert_bitwise(got, again, f"{name} deterministic")

    def test_a_failed_sm90_pass_drops_the_native_plan(self):
        """A call that stays on the Python path (an LSE with gradients) fails its sm_90 dQ
        compile: the plan turns portable, and so does its native plan, rebuilt by the next
        backward from the portable passes."""
        layout, q, k, v, d_out = _inputs("causal", 256, 256, 128, 2, 2, 128, "bfloat16", 5)
        self._both(layout, q, k, v, d_out)  # native, on the sm_90 kernels
        broken = mock.MagicMock()
        broken.__getitem__.side_effect = RuntimeError("compile failed (simulated)")
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with options.launch_options(fwd_kernel="hopper", bwd_kernel="hopper"), \
                mock.patch.object(hopper_kernels, "_attn_bwd_dq_kernel_sm90", broken), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, lse = tattn.sparse_attention(*leaves, layout, return_lse=True)
            (out.float().sum() + lse.sum()).backward()  # the dQ pass with an LSE cotangent
        self.assertTrue(any("sm_90 dQ pass failed" in str(w.message) for w in caught))
        self.assertEqual(self._kernels(layout, q, k, v), ("hopper", "portable"))
        with options.launch_options(native_autograd=False, fwd_kernel="hopper",
                                    bwd_kernel="portable"):
            ref = _NativeCase._run(self, layout, q, k, v, d_out, want_native=False)
        self._run(layout, q, k, v, d_out, want_native=False)  # rebuilds the native plan
        self._assert_bitwise(ref, self._run(layout, q, k, v, d_out, want_native=True),
                             "portable backward after the failure")

    def test_first_cuda_work_of_a_new_thread(self):
        """A host thread with no current CUDA context yet, its tensors from the caching
        allocator: the sm_90 launches bind one on both paths (Triton encodes their TMA
        descriptors before its launcher would)."""
        layout, q, k, v, d_out = _inputs("causal", 256, 256, 128, 2, 2, 128, "bfloat16", 7)
        ref, _ = self._both(layout, q, k, v, d_out)
        scale = q.shape[-1] ** -0.5

        def python_path():
            with options.launch_options(native_autograd=False, fwd_kernel="hopper",
                                        bwd_kernel="hopper"), warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                out, lse = tattn._forward(q, k, v, layout, scale)
                return (out, *tattn._backward(q, k, v, out, lse, d_out, None, layout, scale))

        self._assert_bitwise(ref, _in_new_thread(python_path), "Python path, new thread")
        self._assert_bitwise(
            ref, _in_new_thread(lambda: self._run(layout, q, k, v, d_out, want_native=True)),
            "native, new thread")

    def test_a_backward_alone_builds_no_native_plan(self):
        """``_backward`` on a plan that never ran a forward (a benchmark entry) has no forward
        to pair with: it stays on the Python path, with the Python path's gradients."""
        layout, q, k, v, d_out = _inputs("causal", 256, 256, 128, 2, 2, 128, "bfloat16", 6)
        scale = q.shape[-1] ** -0.5
        with options.launch_options(fwd_kernel="hopper", bwd_kernel="hopper"):
            with options.launch_options(native_autograd=False):
                out, lse = tattn._forward(q, k, v, layout, scale)
                ref = tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)
            got = [tattn._backward(q, k, v, out, lse, d_out, None, layout, scale)
                   for _ in range(2)]
            self.assertIsNone(tattn._plan(q, k, v, layout, scale).native)
        for what, a, b, c in zip(("dq", "dk", "dv"), ref, *got, strict=True):
            self.assertTrue(torch.equal(a, b) and torch.equal(a, c), what)

    def test_pointers_and_descriptors_are_read_per_call(self):
        layout, q, k, v, d_out = _inputs("causal", 256, 256, 128, 2, 2, 128, "bfloat16", 1)
        self._both(layout, q, k, v, d_out)
        q2, k2, d_out2 = (torch.randn_like(t) for t in (q, k, d_out))  # new storage, values
        with options.launch_options(native_autograd=False):
            ref = self._run(layout, q2, k2, v, d_out2, want_native=False)
        self._assert_bitwise(ref, self._run(layout, q2, k2, v, d_out2, want_native=True),
                             "new inputs")

    def test_other_output_gradient_strides(self):
        """The sm_90 passes read a contiguous d_out: the node copies a transposed view and a
        broadcast from .sum() to it."""
        self._check_gradient_strides(*_inputs("causal", 256, 256, 128, 2, 2, 128, "bfloat16", 2))

    def test_cuda_graph_capture(self):
        self._check_graph_capture(
            *_inputs("causal", 256, 256, 128, 2, 2, 128, "bfloat16", 3),
            lambda: options.launch_options(fwd_kernel="hopper", bwd_kernel="hopper"))

    def test_matches_the_oracle(self):
        self._check_oracle(*_inputs("bigbird", 384, 384, 128, 2, 2, 128, "bfloat16", 4),
                           "bfloat16")


if __name__ == "__main__":
    absltest.main()
