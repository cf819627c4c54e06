"""Torch frontend of block-sparse attention: the shared AttentionTestBase plus torch-only tests.

Every device-dependent class runs on CPU tensors (the native CPU path, and the kernel-facing
classes also with ``SPARSETP_INTERPRET=1``: the Triton kernels in the interpreter) always, and
on CUDA tensors (the compiled kernels) where ``torch.cuda.is_available()``; the CUDA classes skip
with "needs a CUDA GPU" elsewhere, and add the GPU-only cases
(``attention_test_base.CompiledAttentionTestBase``). Both run in one process
(:mod:`sparsetp._runtime`). The framework-neutral launch layer is tested in
``kernels_launch_test.py``.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import attention_test_base as base
import numpy as np
import testing_utils as tu
import torch
import triton
from absl.testing import absltest, parameterized

from sparsetp import _runtime
from sparsetp.backends.torch import attention as tattn
from sparsetp.backends.torch import launch as tlaunch
from sparsetp.core import make_layout, reference
from sparsetp.core import patterns as P
from sparsetp.core.examples import example_pattern
from sparsetp.kernels import abi, options, schedule
from sparsetp.kernels.tiles import TileConfig

CUDA = torch.cuda.is_available()
NEEDS_CUDA = "needs a CUDA GPU"


def _to(x: np.ndarray, dtype: str, device: str, requires_grad: bool = False) -> torch.Tensor:
    # from_numpy keeps the numpy strides; .to() preserves them for dense views.
    t = torch.from_numpy(x).to(device=device, dtype=getattr(torch, dtype))
    return t.requires_grad_(requires_grad)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def _nan_output(shape, dtype, device):
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


class _TorchHooks:
    """AttentionTestBase's hooks for torch tensors on ``self.device``."""

    device: str
    dtypes = ("float32", "bfloat16")

    @property
    def device_kind(self) -> str:
        return tlaunch.device_kind(torch.empty(0, device=self.device))

    def forward(self, q, k, v, layout, scale, dtype):
        dev = self.device
        out, lse = tattn.sparse_attention(_to(q, dtype, dev), _to(k, dtype, dev),
                                          _to(v, dtype, dev), layout, scale=scale,
                                          return_lse=True)
        self.assertEqual(out.dtype, getattr(torch, dtype))
        self.assertEqual((out.device.type, lse.device.type), (dev, dev))
        return _np(out), _np(lse)

    def backward(self, q, k, v, layout, scale, dtype, d_out):
        tq, tk, tv = (_to(x, dtype, self.device, requires_grad=True) for x in (q, k, v))
        out = tattn.sparse_attention(tq, tk, tv, layout, scale=scale)
        out.backward(_to(d_out, dtype, self.device))
        return _np(tq.grad), _np(tk.grad), _np(tv.grad)

    def poison_outputs(self):
        # Every output buffer (out, lse, delta, dq, dk, dv) comes from launch.new_output, on
        # either device; attention.py calls it through the module, so patching it reaches all.
        return mock.patch.object(tlaunch, "new_output", _nan_output)

    def call_raw(self, q, k, v, layout, **kwargs):
        return tattn.sparse_attention(*(torch.from_numpy(x).to(self.device) for x in (q, k, v)),
                                      layout, **kwargs)


class Interpreted:
    """Mixin: the test runs with ``SPARSETP_INTERPRET=1`` (CPU tensors run the Triton kernel
    sources in the interpreter instead of the native CPU path)."""

    def setUp(self):
        super().setUp()
        self.enter_context(mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}))


class TorchCpuAttentionTest(_TorchHooks, base.AttentionTestBase):
    """CPU tensors: the native CPU path (sparsetp.backends.torch.cpu)."""

    device = "cpu"

    def test_runs_native(self):
        self.assertEqual(self.device_kind, "cpu")


class TorchInterpreterAttentionTest(Interpreted, _TorchHooks, base.AttentionTestBase):
    """CPU tensors under SPARSETP_INTERPRET=1: the kernels in Triton's interpreter."""

    device = "cpu"

    def test_runs_interpreted(self):
        self.assertEqual(self.device_kind, "interpreter")


@unittest.skipUnless(CUDA, NEEDS_CUDA)
class TorchCudaAttentionTest(_TorchHooks, base.CompiledAttentionTestBase):
    """CUDA tensors: the compiled kernels, plus the GPU-only cases."""

    device = "cuda"


def _cfgs(bs, fwd, dq, dkdv):
    return {"fwd": TileConfig(bs, bs, 4, 2, sub=fwd),
            "bwd_dq": TileConfig(bs, bs, 4, 2, sub=dq),
            "bwd_dkdv": TileConfig(bs, bs, 4, 2, sub=dkdv)}


class _PerDevice:
    """Holds the per-device test bases, so that neither pytest nor unittest collects them
    (they are not module attributes); the classes below the holder pick the device."""

    class ExtrasTest(parameterized.TestCase):
        """Torch-only behaviour: baselines, gradcheck, LSE gradient, module, devices, caching."""

        device: str

        def _to(self, x, dtype, requires_grad=False):
            return _to(x, dtype, self.device, requires_grad)

        @parameterized.named_parameters(
            ("naive_bigbird", "naive", "bigbird", "float32"),
            ("naive_masked_rows", "naive", "masked_rows", "float32"),
            ("naive_per_head_mix_bf16", "naive", "per_head_mix", "bfloat16"),
            ("dense_strided_causal", "dense", "strided_causal", "float32"),
            ("dense_masked_rows", "dense", "masked_rows", "float32"),
            ("dense_local_bf16", "dense", "local", "bfloat16"),
        )
        def test_baseline_matches_oracle(self, which, name, dtype):
            fn = tattn.naive_sparse_attention if which == "naive" else tattn.dense_attention
            n, bs, h = 100, 32, 3
            layout = make_layout(example_pattern(name, n, bs), n, h, bs)
            q, k, v, d_out = tu.random_inputs(4, (2, h, n, 32), dtype)
            tq, tk, tv = (self._to(x, dtype, requires_grad=True) for x in (q, k, v))
            out = fn(tq, tk, tv, layout, scale=0.2)
            out.backward(self._to(d_out, dtype))
            tu.assert_close(_np(out), reference.attention(q, k, v, layout, 0.2)[0], dtype,
                            what=f"{which} out")
            refs = reference.attention_grad(q, k, v, layout, d_out, 0.2)
            for g_name, t, r in zip(("dq", "dk", "dv"), (tq, tk, tv), refs, strict=True):
                tu.assert_close(_np(t.grad), r, dtype, grad=True, what=f"{which} {g_name}")

        @parameterized.parameters("naive", "dense")
        def test_baseline_per_batch_row_documents(self, which):
            """The baselines on a per-batch-row layout (each row its own packing, GQA): batch
            folded into heads as in sparse_attention; out and grads vs the oracle."""
            fn = tattn.naive_sparse_attention if which == "naive" else tattn.dense_attention
            n, bs, h = 100, 32, 4
            layout = make_layout(P.documents([[30, 70], [100], [1, 98, 1]]) & P.causal(), n, h,
                                 bs)
            q, d_out = tu.random_inputs(6, (3, h, n, 32), "float32", 2)
            k, v = tu.random_inputs(7, (3, 2, n, 32), "float32", 2)
            tq, tk, tv = (self._to(x, "float32", requires_grad=True) for x in (q, k, v))
            out = fn(tq, tk, tv, layout)
            out.backward(self._to(d_out, "float32"))
            tu.assert_close(_np(out), reference.attention(q, k, v, layout)[0], "float32",
                            what=f"{which} out")
            refs = reference.attention_grad(q, k, v, layout, d_out)
            for g_name, t, r in zip(("dq", "dk", "dv"), (tq, tk, tv), refs, strict=True):
                tu.assert_close(_np(t.grad), r, "float32", grad=True,
                                reduced=1 if g_name == "dq" else 2, what=f"{which} {g_name}")

        def test_per_batch_row_checks_after_a_good_call(self):
            """A per-row layout's checks are cached per (shapes, dtypes, devices, scale): after
            a good call, calls with another batch, dtype or head count still raise by name."""
            layout = make_layout(P.documents([[20, 44], [64]]) & P.causal(), 64, 2, 32)
            q = self._to(np.random.default_rng(0).standard_normal((2, 2, 64, 16)), "float32")
            self.assertEqual(tuple(tattn.sparse_attention(q, q, q, layout).shape), (2, 2, 64, 16))
            with self.assertRaisesRegex(ValueError, r"per-batch-row for batch=2 but q has B=1"):
                tattn.sparse_attention(q[:1], q[:1], q[:1], layout)
            with self.assertRaisesRegex(ValueError, r"\bk has dtype"):
                tattn.sparse_attention(q, q.double(), q, layout)
            with self.assertRaisesRegex(ValueError, r"layout is for num_heads=2 but q has H=1"):
                tattn.sparse_attention(q[:, :1], q[:, :1], q[:, :1], layout)

        def test_gradcheck_float64(self):
            """torch.autograd.gradcheck in float64 (fp64 dots in the kernels), out and LSE."""
            layout = make_layout(P.local(20, 3), seq_len=40, num_heads=1, block_size=16)
            rng = np.random.default_rng(1)
            q, k, v = (self._to(rng.standard_normal((1, 1, 40, 16)), "float64",
                                requires_grad=True) for _ in range(3))
            fn = lambda q, k, v: tattn.sparse_attention(q, k, v, layout, scale=0.5,
                                                        return_lse=True)
            self.assertTrue(torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True))

        def test_gradcheck_float64_masked_rows(self):
            """gradcheck of the output where some rows attend to nothing (their LSE is -inf, so
            it is left out: finite differences of -inf are NaN)."""
            n = 36
            layout = make_layout(example_pattern("masked_rows", n, 16), n, 1, 16)
            rng = np.random.default_rng(2)
            q, k, v = (self._to(rng.standard_normal((1, 1, n, 16)), "float64",
                                requires_grad=True) for _ in range(3))
            fn = lambda q, k, v: tattn.sparse_attention(q, k, v, layout)
            self.assertTrue(torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True))

        def test_lse_gradient_float32(self):
            """A cotangent on LSE flows into q and k (d lse / d s = P) and matches float64
            autograd of the naive baseline."""
            n, h = 70, 2
            layout = make_layout(example_pattern("bigbird", n, 16), n, h, 16)
            q, k, v, d_out = tu.random_inputs(8, (1, h, n, 16), "float32")
            d_lse = np.random.default_rng(9).standard_normal((1, h, n)).astype(np.float32)
            tq, tk, tv = (self._to(x, "float32", requires_grad=True) for x in (q, k, v))
            out, lse = tattn.sparse_attention(tq, tk, tv, layout, return_lse=True)
            torch.autograd.backward((out, lse), (self._to(d_out, "float32"),
                                                 self._to(d_lse, "float32")))
            rq, rk, rv = (torch.tensor(x, dtype=torch.float64, requires_grad=True)
                          for x in (q, k, v))
            mask = torch.from_numpy(layout.dense_mask())[None]
            s = (rq @ rk.transpose(-1, -2) * 16 ** -0.5).masked_fill(~mask, float("-inf"))
            r_lse = torch.logsumexp(s, -1)
            r_out = torch.softmax(s, -1) @ rv
            torch.autograd.backward((r_out, r_lse), (torch.from_numpy(d_out).double(),
                                                     torch.from_numpy(d_lse).double()))
            for name, t, r in (("dq", tq, rq), ("dk", tk, rk), ("dv", tv, rv)):
                tu.assert_close(_np(t.grad), r.grad.numpy(), "float32", grad=True, what=name)

        def test_expanded_lse_cotangent_matches_a_contiguous_one(self):
            """``lse.sum()`` hands backward a stride-0 (expanded) cotangent, which the dQ
            launch reads through its own strides: the gradients equal those of the same
            cotangent made contiguous, bit for bit (rows with no key included)."""
            n = 36
            layout = make_layout(example_pattern("masked_rows", n, 16), n, 2, 16)
            grads = []
            for contiguous in (False, True):
                q, k, v = (self._to(x, "float32", requires_grad=True)
                           for x in tu.random_inputs(5, (1, 2, n, 16), "float32", count=3))
                out, lse = tattn.sparse_attention(q, k, v, layout, return_lse=True)
                d_lse = torch.ones((), dtype=lse.dtype, device=lse.device).expand(lse.shape)
                if contiguous:
                    d_lse = d_lse.contiguous()
                self.assertEqual(d_lse.stride(), (n * 2, n, 1) if contiguous else (0, 0, 0))
                torch.autograd.backward((out, lse), (torch.ones_like(out), d_lse))
                grads.append([_np(t.grad) for t in (q, k, v)])
            for name, a, b in zip(("dq", "dk", "dv"), *grads, strict=True):
                self.assertTrue(np.isfinite(a).all(), name)
                np.testing.assert_array_equal(a, b, err_msg=name)

        def test_module_caches_layouts_and_matches_function(self):
            attn = tattn.SparseAttention(P.causal(), block_size=32, scale=0.4)
            q, k, v = (torch.from_numpy(x).to(self.device)
                       for x in tu.random_inputs(2, (1, 2, 50, 16), "float32", count=3))
            out = attn(q, k, v)
            self.assertIs(attn.layout(50, 2), attn.layout(50, 2))
            expected = tattn.sparse_attention(q, k, v, attn.layout(50, 2), scale=0.4)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            out2, lse = attn(q, k, v, return_lse=True)
            self.assertEqual(tuple(lse.shape), (1, 2, 50))
            with self.assertRaisesRegex(ValueError, r"block_size"):
                tattn.SparseAttention(P.causal(), block_size=48)
            with self.assertRaisesRegex(ValueError, r"pattern"):
                tattn.SparseAttention("causal")

        def test_metadata_cached_per_layout_and_device(self):
            """One set of int32 tensors per (kernel layout, device), on that device, with the
            layout's head groups (schedule.head_groups) beside them."""
            layout = make_layout(P.causal(), 64, 1, 32)
            q = torch.empty((1, 1, 64, 16), device=self.device)
            kind = tlaunch.device_kind(q)
            a = tlaunch.metadata(layout, q, kind)
            b = tlaunch.metadata(layout, q, kind)
            self.assertIs(a["q_index"], b["q_index"])
            self.assertEqual(a["q_index"].dtype, torch.int32)
            self.assertEqual(a["q_index"].device.type, self.device)
            self.assertTrue(a["q_index"].is_contiguous())
            ran = schedule.kernel_layout(layout, kind, head_dim=16, dtype="float32")
            self.assertEqual((a["q_head_group"], a["k_head_group"]), schedule.head_groups(ran))
            self.assertEqual(set(a), {*layout.metadata(), "q_head_group", "k_head_group"})
            if self.device != "cpu":  # the CPU tensors of the same layout are another entry
                c = tlaunch.metadata(layout, q.cpu(), "interpreter")
                self.assertIsNot(c["q_index"], a["q_index"])
                self.assertEqual(c["q_index"].device.type, "cpu")

        def test_device_kind_follows_the_tensor(self):
            """CPU tensors run the native path (the interpreter when forced); CUDA tensors
            compiled (unless the process forces the interpreter); other devices are refused,
            naming the device."""
            kind = tlaunch.device_kind(torch.empty(0, device=self.device))
            if self.device == "cpu":
                self.assertEqual(kind, "cpu")
                with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}):
                    self.assertEqual(tlaunch.device_kind(torch.empty(0)), "interpreter")
            else:
                self.assertEqual(kind, _runtime.device_kind("cuda"))
            with self.assertRaisesRegex(ValueError, r"q is on device meta"):
                tlaunch.device_kind(torch.empty(0, device="meta"))

        def test_device_mismatch_names_argument(self):
            q = torch.randn(1, 1, 32, 16, device=self.device)
            k = torch.randn(1, 1, 32, 16, device="meta")
            layout = make_layout(P.causal(), 32, 1, 16)
            with self.assertRaisesRegex(ValueError, r"\bk\b is on meta"):
                tattn.sparse_attention(q, k, q, layout)

        def test_scale_type_checked(self):
            q = torch.randn(1, 1, 32, 16, device=self.device)
            layout = make_layout(P.causal(), 32, 1, 16)
            with self.assertRaisesRegex(ValueError, r"scale"):
                tattn.sparse_attention(q, q, q, layout, scale="0.5")

        def test_dense_attention_masked_rows_finite_grads(self):
            """SDPA alone gives NaN on fully masked rows; dense_attention gives 0 and 0 grads."""
            n = 48
            layout = make_layout(example_pattern("masked_rows", n, 16), n, 1, 16)
            q = torch.randn(1, 1, n, 16, device=self.device, requires_grad=True)
            out = tattn.dense_attention(q, q, q, layout)
            out.backward(torch.randn_like(out))
            self.assertFalse(torch.isnan(out).any() or torch.isnan(q.grad).any())
            dead = torch.from_numpy(~layout.dense_mask().any(-1))[None].to(self.device)
            self.assertTrue(bool((out[dead] == 0).all()))

    class LaunchConfigTest(parameterized.TestCase):
        """Non-default sub-tiles and work orders (the interpreter's default walks whole tiles
        in tile order): every mask-slice path of ``_mask_bits`` (one word with and without a
        bit offset, several words via reshape, transposed for dK/dV) and every grid mapping vs
        the oracle."""

        device: str

        def _to(self, x, dtype, requires_grad=False):
            return _to(x, dtype, self.device, requires_grad)

        @parameterized.named_parameters(
            # sub 16 of 64: one-word slices at bit offsets 0/16/32/48; heads-fastest grid.
            ("strided_causal_bs64_sub16_bh", "strided_causal", 200, 64, 32, "float32",
             (16, 16, 16), "longest_first_bh"),
            # block 128: fwd two-word slices at word 2, dQ one-word slices, dK/dV 16-query
            # sub-tiles against the 4-word transposed expansion; N % 16 == 0, so ALIGNED is on.
            ("bigbird_bs128_mixed_natural", "bigbird", 256, 128, 16, "bfloat16",
             (64, 32, 16), "natural"),
            # sub 16 of 32 at bit offset 16, rows with no key, per-head longest-first order.
            ("masked_rows_bs32_sub16", "masked_rows", 100, 32, 16, "float32", (16, 16, 16),
             "longest_first"),
            ("per_head_mix_bs64_sub32", "per_head_mix", 130, 64, 32, "bfloat16", (32, 32, 32),
             "longest_first_bh"),
        )
        def test_sub_tiles_and_work_order(self, name, n, bs, d, dtype, subs, order):
            layout = make_layout(example_pattern(name, n, bs), n, 2, bs)
            q, k, v, d_out = tu.random_inputs(n + bs, (1, 2, n, d), dtype)
            tq, tk, tv = (self._to(x, dtype, requires_grad=True) for x in (q, k, v))
            with options.launch_options(work_order=order, tiles=_cfgs(bs, *subs)):
                out, lse = tattn.sparse_attention(tq, tk, tv, layout, return_lse=True)
                out.backward(self._to(d_out, dtype))
            ref_out, ref_lse = reference.attention(q, k, v, layout, None)
            tu.assert_close(_np(out), ref_out, dtype, what=f"{name} out")
            tu.assert_close(_np(lse), ref_lse, dtype, what=f"{name} lse")
            refs = reference.attention_grad(q, k, v, layout, d_out, None)
            for g_name, t, r in zip(("dq", "dk", "dv"), (tq, tk, tv), refs, strict=True):
                tu.assert_close(_np(t.grad), r, dtype, grad=True, what=f"{name} {g_name}")

        def test_backward_launches_with_the_forwards_options(self):
            """Every mode the forward ran with is honoured in its backward: backward() called
            outside the ``with`` (on CUDA: on torch's autograd thread) still launches the
            forward's sub-tiles and work order, and the gradients are right."""
            n, bs = 100, 32
            layout = make_layout(example_pattern("bigbird", n, bs), n, 2, bs)
            q, k, v, d_out = tu.random_inputs(5, (1, 2, n, 16), "float32")
            tq, tk, tv = (self._to(x, "float32", requires_grad=True) for x in (q, k, v))
            calls, real = [], tlaunch.run

            def record(desc, *args):
                calls.append(desc.call)
                return real(desc, *args)

            with mock.patch.object(tlaunch, "run", record):
                with options.launch_options(work_order="natural", tiles=_cfgs(bs, 16, 16, 16)):
                    out = tattn.sparse_attention(tq, tk, tv, layout)
                self.assertEqual(options.current(), options.LaunchOptions())
                out.backward(self._to(d_out, "float32"))
            by_name = {c.name: c for c in calls}
            self.assertEqual(sorted(by_name), sorted(abi.KERNEL_NAMES))
            for name, sub in (("fwd", "SUB_N"), ("bwd_dq", "SUB_N"), ("bwd_dkdv", "SUB_M")):
                self.assertEqual(by_name[name].constexprs[sub], 16, name)  # default: 32
                self.assertFalse(by_name[name].constexprs["ORDERED"], name)
            refs = reference.attention_grad(q, k, v, layout, d_out, None)
            for g_name, t, r in zip(("dq", "dk", "dv"), (tq, tk, tv), refs, strict=True):
                tu.assert_close(_np(t.grad), r, "float32", grad=True, what=g_name)

        def test_head_order_never_changes_the_numbers(self):
            """Every program computes its own rows and columns whatever the dispatch order, so
            the work orders and head groups (three grid forms, ordered or not) give
            bitwise-equal outputs and grads."""
            n, h, d, bs = 96, 3, 16, 32
            layout = make_layout(example_pattern("bigbird", n, bs), n, h, bs)
            q, k, v, d_out = tu.random_inputs(7, (2, h, n, d), "float32")
            results = {}
            for order, group in (("natural", None), ("longest_first", None),
                                 ("longest_first_bh", None), ("longest_first_bh", 2),
                                 ("longest_first_bh", 3)):
                tq, tk, tv = (self._to(x, "float32", requires_grad=True) for x in (q, k, v))
                with options.launch_options(work_order=order, head_group=group):
                    out, lse = tattn.sparse_attention(tq, tk, tv, layout, return_lse=True)
                    out.backward(self._to(d_out, "float32"))
                results[order, group] = [t.detach()
                                         for t in (out, lse, tq.grad, tk.grad, tv.grad)]
            for order, got in results.items():
                for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got,
                                      results["natural", None], strict=True):
                    self.assertTrue(torch.equal(a, b), f"{order} {name}")


class TorchCpuAttentionExtrasTest(_PerDevice.ExtrasTest):
    device = "cpu"


@unittest.skipUnless(CUDA, NEEDS_CUDA)
class TorchCudaAttentionExtrasTest(_PerDevice.ExtrasTest):
    device = "cuda"


class TorchInterpreterLaunchConfigTest(Interpreted, _PerDevice.LaunchConfigTest):
    """Kernel launch options only concern the kernels: on CPU tensors, in the interpreter."""

    device = "cpu"


@unittest.skipUnless(CUDA, NEEDS_CUDA)
class TorchCudaLaunchConfigTest(_PerDevice.LaunchConfigTest):
    device = "cuda"


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records the direct launches it receives."""

    function, packed_metadata = "fn", "packed"

    def __init__(self):
        self.runs, self.metadata_calls = [], 0

    def run(self, *a):
        self.runs.append(a)

    def launch_metadata(self, grid, stream, *args):
        self.metadata_calls += 1
        return "meta"


def fwd_description():
    """A forward launch description built as the CUDA path builds one (causal, N=64, H=2,
    D=16; CPU tensors, metadata as tensors), with its tensors: ``(desc, q, k, v, out, lse)``.
    For the launch tests that run without a GPU (here and ``torch_native_test.py``)."""
    layout = make_layout(P.causal(), 64, 2, 32)
    q, k, v = (torch.zeros(1, 2, 64, 16) for _ in range(3))
    out, lse = torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64)
    meta = {name: torch.tensor(arr) for name, arr in layout.metadata().items()}
    meta.update(q_head_group=2, k_head_group=2)
    strides = {n: t.stride() for n, t in (("q", q), ("k", k), ("v", v), ("out", out),
                                          ("lse", lse))}
    desc = tlaunch._Description(abi.fwd_call(q, k, v, meta, scale=0.25, dtype="float32",
                                             device_kind="cuda", strides=strides), 3, meta)
    return desc, q, k, v, out, lse


class DirectLaunchTest(absltest.TestCase):
    """The CUDA direct-launch path of ``launch.run`` without a GPU: the JIT entry point
    (``launch._launch``) is replaced by a fake that returns a fake compiled kernel. The GPU
    check (benchmarks/gpu_correctness.py, direct_launch) compares the real paths bitwise."""

    def setUp(self):
        super().setUp()
        self.desc, self.q, self.k, self.v, self.out, self.lse = fwd_description()
        self.jit_calls, self.compiled = [], []

        def fake_launch(call, outputs, kind):
            self.jit_calls.append(call)
            self.compiled.append(_FakeCompiled())
            return self.compiled[-1]

        for patcher in (mock.patch.object(tlaunch, "_launch", fake_launch),
                        mock.patch.object(tlaunch, "_current_stream", lambda device: 7),
                        # The private launch API is only used for the tested Triton versions.
                        mock.patch.object(tlaunch, "_DIRECT_OK", True),
                        # CPU tensors have device index None: make that the "current" one.
                        mock.patch.object(torch.cuda, "current_device", lambda: None)):
            patcher.start()
            self.addCleanup(patcher.stop)

    def run_once(self, tensors=None):
        tlaunch.run(self.desc, tensors or (self.q, self.k, self.v), (self.out, self.lse), "cuda")

    def _direct_args(self):
        """The arguments of the one direct launch after a JIT launch: (launcher's 9, kernel's)."""
        self.run_once()
        self.assertLen(self.jit_calls, 1)
        self.assertIs(self.jit_calls[0].args[0], self.q)
        self.run_once()
        self.assertLen(self.jit_calls, 1)  # no second JIT launch
        (args,) = self.compiled[0].runs
        grid = self.desc.call.grid
        self.assertEqual(args[:6], (grid[0], grid[1], grid[2], 7, "fn", "packed"))
        call, names = self.desc.call, self.desc.call.kernel.arg_names
        self.assertLen(args[9:], len(names))  # JITFunction.run's: every parameter in order
        expect = (self.q, self.k, self.v, *call.args[3:], self.out, self.lse,
                  *(call.constexprs[n] for n in names[len(call.args) + 2:]))
        return args[6:9], list(zip(names, args[9:], expect, strict=True))

    def test_second_call_goes_direct_with_pointers_when_no_hook_runs(self):
        # Triton's default hooks: empty HookChains (Triton >= 3.6) or None.
        rt = triton.knobs.runtime
        for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
            self.assertTrue(hook is None or not hook.calls)
        launcher, launched = self._direct_args()
        self.assertEqual(launcher, (None, None, None))  # no metadata, no hooks to call
        self.assertEqual(self.compiled[0].metadata_calls, 0)
        for name, got, want in launched:
            if isinstance(want, torch.Tensor):
                self.assertIsInstance(got, int, name)
                self.assertEqual(got, want.data_ptr(), name)
            elif isinstance(want, (bool, int, float, str)):
                self.assertEqual(got, want, name)
            else:  # any other argument is passed as it is
                self.assertIs(got, want, name)

    def test_an_enter_hook_gets_metadata_and_the_tensors(self):
        def hook(meta):
            return None

        with mock.patch.object(triton.knobs.runtime, "launch_enter_hook", hook):
            launcher, launched = self._direct_args()
        self.assertEqual(launcher, ("meta", hook, triton.knobs.runtime.launch_exit_hook))
        self.assertEqual(self.compiled[0].metadata_calls, 1)
        for name, got, want in launched:
            if isinstance(want, (bool, int, float, str)):
                self.assertEqual(got, want, name)
            else:  # tensors and metadata arrays: the very objects
                self.assertIs(got, want, name)

    def test_other_alignment_disabled_or_other_device_uses_the_jit_entry(self):
        self.run_once()
        flat = torch.zeros(1 * 2 * 64 * 16 + 1)
        misaligned = flat[1:].view(1, 2, 64, 16)  # 4-byte offset: another specialisation
        self.run_once((misaligned, self.k, self.v))
        self.assertLen(self.jit_calls, 2)
        self.run_once((misaligned, self.k, self.v))
        self.assertLen(self.jit_calls, 2)  # that alignment is cached too
        self.assertLen(self.compiled[1].runs, 1)
        with options.launch_options(direct_launch=False):
            self.run_once()
        self.assertLen(self.jit_calls, 3)
        with mock.patch.object(tlaunch, "_DIRECT_OK", False):  # an untested Triton version
            self.run_once()
        self.assertLen(self.jit_calls, 4)
        with mock.patch.object(torch.cuda, "current_device", lambda: 3):
            self.run_once()
        self.assertLen(self.jit_calls, 5)

    def test_launch_metadata_only_for_an_active_hook(self):
        self.run_once()
        for idle in (None, type(triton.knobs.runtime.launch_enter_hook)()):
            with mock.patch.object(triton.knobs.runtime, "launch_enter_hook", idle):
                self.run_once()
        self.assertEqual(self.compiled[0].metadata_calls, 0)
        self.assertEqual([r[6:9] for r in self.compiled[0].runs], [(None, None, None)] * 2)
        with mock.patch.object(triton.knobs.runtime, "launch_exit_hook", lambda m: None):
            self.run_once()
        self.assertEqual(self.compiled[0].metadata_calls, 1)
        self.assertEqual(self.compiled[0].runs[2][6], "meta")

if __name__ == "__main__":
    absltest.main()
