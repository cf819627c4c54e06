"""The sm_90 forward and backward (:mod:`sparsetp.kernels.hopper`) and the rules that dispatch
to them.

* On every machine: :func:`forward_choice` and :func:`backward_choice` take the fast path only
  where it is eligible (and, under ``"auto"``, measured faster), name the reason otherwise, and
  refuse a forced fast path they cannot run; both frontends report the portable kernels on
  CPU.
* On an sm_90 GPU: both fast paths, forced, against the float64 oracle and the portable kernels
  for every example pattern (fully masked rows included), bf16 and fp16, GQA, more keys than
  queries, a block-64 layout (re-laid at 128), a tensor-parallel head slice; bitwise
  deterministic, forward and gradients; an LSE cotangent and a non-contiguous output gradient
  in the backward; ``auto`` picks them where the rule says; later calls launch the compiled
  kernels directly with the same results; a failing fast path warns and falls back to the
  portable kernel with the same answer.
* On an sm_90 GPU seen by JAX: JAX launches the same kernels (the same binaries as torch),
  bitwise equal to torch's outputs and gradients for every example pattern, GQA and more keys
  than queries, under ``jit`` and ``vmap``, and in a process without torch; its rule and
  fall-backs as torch's; a launch whose plan this process never registered fails with the
  reason. Head dim 256 takes the sm_90 forward in torch (the portable backward after it), not
  in JAX.
* On every machine with a C++ compiler: JAX's launcher handler builds into the cache
  directory and registers a plan once per key; a failing build warns and names the reason.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
import unittest
import warnings
from unittest import mock

import numpy as np
import testing_utils as tu
import torch
from absl.testing import absltest, parameterized

from sparsetp.backends.torch import hopper as thopper
from sparsetp.core import make_layout, reference
from sparsetp.core import patterns as P
from sparsetp.core.examples import EXAMPLE_PATTERNS, example_pattern
from sparsetp.kernels import abi, hopper
from sparsetp.kernels.options import launch_options
from sparsetp.torch import backward_kernel, forward_kernel, sparse_attention

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
NEEDS_SM90 = "needs an sm_90 (Hopper) GPU"
TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _rule(rule=hopper.forward_choice, **changes):
    """forward_choice (or ``rule``) on an eligible call (changes make it otherwise)."""
    kw = dict(framework="torch", device_kind="cuda", capability=(9, 0),
              triton_version="3.6.0", dtype="bfloat16", head_dim=128, seq_len=8192,
              kv_len=8192, batch_heads=16, mean_tiles=32.0, layout_ok=True, contiguous=True,
              scale=128 ** -0.5)
    kw.update(changes)
    return rule(**kw)


class ForwardChoiceTest(parameterized.TestCase):

    def test_eligible_long_lists_take_the_fast_path(self):
        self.assertEqual(_rule().name, "hopper")

    @parameterized.named_parameters(
        ("launcher", {"launcher": "no launcher here (test)"}, "no launcher here"),
        ("framework", {"framework": "mlx"}, "no sm_90 launcher"),
        ("cpu", {"device_kind": "cpu"}, "CUDA kernel"),
        ("ampere", {"capability": (8, 0)}, "9.0"),
        ("blackwell", {"capability": (10, 0)}, "9.0"),
        ("untested_triton", {"triton_version": "3.9.0"}, "Triton 3.9.0"),
        ("float32", {"dtype": "float32"}, "dtype float32"),
        ("head_dim_64", {"head_dim": 64}, "head dim 64"),
        ("ragged_queries", {"seq_len": 8000}, "multiples of 128"),
        ("ragged_keys", {"kv_len": 8100}, "multiples of 128"),
        ("hand_built_layout", {"layout_ok": False}, "128-block form"),
        ("strided", {"contiguous": False}, "C-contiguous"),
        ("zero_scale", {"scale": 0.0}, "not positive"),
        ("negative_scale", {"scale": -0.3}, "not positive"),
    )
    def test_ineligible_names_the_reason_and_forcing_raises(self, changes, words):
        for rule, option in ((hopper.forward_choice, "fwd_kernel"),
                             (hopper.backward_choice, "bwd_kernel")):
            choice = _rule(rule, **changes)
            self.assertEqual(choice.name, "portable")
            self.assertIn(words, choice.reason)
            with launch_options(**{option: "hopper"}):
                with self.assertRaisesRegex(ValueError, f"{option}='hopper' cannot run"):
                    _rule(rule, **changes)

    def test_head_dim_256_takes_the_fast_forward_only(self):
        self.assertEqual(_rule(head_dim=256).name, "hopper")
        choice = _rule(hopper.backward_choice, head_dim=256)
        self.assertEqual(choice.name, "portable")
        self.assertIn("sm_90 backward runs (128,)", choice.reason)
        with launch_options(bwd_kernel="hopper"):
            with self.assertRaisesRegex(ValueError, "bwd_kernel='hopper' cannot run"):
                _rule(hopper.backward_choice, head_dim=256)

    def test_the_options_choose_each_pass_apart(self):
        with launch_options(fwd_kernel="portable"):
            self.assertEqual(_rule().name, "portable")
            self.assertEqual(_rule(hopper.backward_choice).name, "hopper")
        with launch_options(bwd_kernel="portable"):
            self.assertEqual(_rule().name, "hopper")
            choice = _rule(hopper.backward_choice)
            self.assertEqual((choice.name, choice.reason),
                             ("portable", "LaunchOptions.bwd_kernel='portable'"))

    def test_auto_rule_thresholds(self):
        few = 16 * 4096 // 128  # 512 programs
        self.assertLess(few, hopper.AUTO_MIN_PROGRAMS)
        short = _rule(mean_tiles=hopper.AUTO_MIN_MEAN_TILES - 0.5, seq_len=4096, kv_len=4096)
        self.assertEqual(short.name, "portable")
        self.assertIn("short lists", short.reason)
        self.assertEqual(_rule(mean_tiles=hopper.AUTO_MIN_MEAN_TILES, seq_len=4096,
                               kv_len=4096).name, "hopper")
        many = _rule(mean_tiles=4.0, seq_len=8192, kv_len=8192)
        self.assertEqual(many.name, "hopper")
        with launch_options(fwd_kernel="hopper"):
            self.assertEqual(_rule(mean_tiles=1.0).name, "hopper")
        with launch_options(fwd_kernel="portable"):
            self.assertEqual(_rule().name, "portable")

    def test_kernel_options_are_checked(self):
        for option in ("fwd_kernel", "bwd_kernel"):
            with self.assertRaisesRegex(ValueError, f"{option} must be one of"):
                with launch_options(**{option: "fast"}):
                    pass

    def test_torch_frontend_on_cpu_reports_portable(self):
        q = torch.randn(1, 2, 256, 128)
        for ask in (forward_kernel, backward_kernel):
            choice = ask(q, q, q, make_layout(P.causal(), 256, 2, 128))
            self.assertEqual(choice.name, "portable")
            self.assertIn("'cpu'", choice.reason)

    def test_jax_frontend_on_cpu_reports_portable_and_refuses_a_forced_fast_path(self):
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp import jax as sjax  # noqa: PLC0415

        q = jax.device_put(jnp.zeros((1, 2, 256, 128), jnp.bfloat16), jax.devices("cpu")[0])
        layout = make_layout(P.causal(), 256, 2, 128)
        for ask, option in ((sjax.forward_kernel, "fwd_kernel"),
                            (sjax.backward_kernel, "bwd_kernel")):
            choice = ask(q, q, q, layout)
            self.assertEqual(choice.name, "portable")
            self.assertIn("'cpu'", choice.reason)
            with launch_options(**{option: "hopper"}):
                with self.assertRaisesRegex(ValueError, f"{option}='hopper'.*CUDA kernel"):
                    sjax.sparse_attention(q, q, q, layout)

    def test_jax_layout_arrays_carry_the_list_length_rule(self):
        from sparsetp import jax as sjax  # noqa: PLC0415

        # Static, so jitted and eager calls take the same kernel.
        self.assertTrue(sjax.layout_arrays(make_layout(P.dense(), 4096, 2, 128)).long_lists)
        self.assertFalse(sjax.layout_arrays(make_layout(P.causal(), 4096, 2, 128)).long_lists)
        self.assertFalse(sjax.layout_arrays(make_layout(P.dense(), 4096, 2, 64)).long_lists)

    def test_skip_quarters_reach_the_backward_launches(self):
        # Only a layout with enough empty quarters compiles the passes' skip; GQA's dK/dV pass
        # runs MHA's program on its merged lists, so it skips alike.
        from sparsetp import jax as sjax  # noqa: PLC0415

        for pattern, n, want in ((P.causal(), 4096, False), (P.dense(), 512, False),
                                 (P.neighborhood((16, 32), (5, 9)), 512, True)):
            lay = make_layout(pattern, n, 4, 128)
            self.assertEqual(lay.skip_quarters, want)
            # Static in JAX, so only where the sm_90 kernels run the layout (not without a
            # head dim and dtype, not on a CPU): elsewhere patterns of one shape share a trace.
            self.assertFalse(sjax.layout_arrays(lay).skip_quarters)
            meta = {**lay.metadata(), "q_head_group": None, "k_head_group": None}
            for kv_heads in (4, 2):
                merged = hopper.group_key_lists(np, meta, 4 // kv_heads, n // 128)
                launches = hopper.launches({**meta, **merged}, 1, 4, kv_heads, n, n, 0.1,
                                           False, skip_quarters=lay.skip_quarters,
                                           skip_halves=lay.skip_halves)
                self.assertEqual([launches[n].constexprs["SKIP"]
                                  for n in ("dq", "dq_dlse", "dkdv")],
                                 [2, 2, 2] if want else [0, 0, 0])
                self.assertNotIn("SKIP", launches["fwd"].constexprs)

    def test_gqa_dkdv_launch_runs_the_merged_lists_as_mha(self):
        # One program per (key tile, kv head) over the group's lists merged (group_key_lists):
        # MHA's program over q viewed as [B, H_kv, G * N, D]. Without the merged lists there
        # is no GQA dK/dV launch.
        n, h, h_kv = 1024, 8, 2
        lay = make_layout(P.per_head([P.causal(), P.local(200, 100)] * 4), n, h, 128)
        meta = {**lay.metadata(), "q_head_group": None, "k_head_group": None}
        kw = dict(skip_quarters=lay.skip_quarters, skip_halves=lay.skip_halves)
        self.assertNotIn("dkdv", hopper.launches(meta, 2, h, h_kv, n, n, 0.1, True, **kw))
        merged = hopper.group_key_lists(np, meta, h // h_kv, n // 128)
        launch = hopper.launches({**meta, **merged}, 2, h, h_kv, n, n, 0.1, True, **kw)["dkdv"]
        # k_count, k_partial, k_index, k_mask_id, masks, k_order, mask_quarters, qk_scale,
        # scale, N, N_KV, H, strides (the kernel's order after its descriptors).
        self.assertEqual(launch.args[9:12], (4 * n, n, h_kv))
        self.assertIs(launch.args[2], merged["kg_index"])
        self.assertIs(launch.args[5], merged["kg_order"])
        self.assertEqual(launch.grid[0] * launch.grid[1] * launch.grid[2], 2 * h_kv * n // 128)

    def test_group_key_lists_merge_each_groups_lists(self):
        # Against a loop over (kv head, key tile): partial entries of every head, then full
        # ones, head by head, query tiles offset by head; numpy and jax.numpy alike.
        import jax.numpy as jnp  # noqa: PLC0415

        n, h = 768, 6
        pattern = P.per_head([P.causal(), P.strided(512, 128) & P.causal(),
                              P.documents([300, 468]) & P.causal(), P.local(200, 100),
                              P.strided(256, 128, offset=640), P.neighborhood((24, 32), (5, 9))])
        lay = make_layout(pattern, n, h, 128)
        nt = lay.num_blocks
        for group in (1, 2, 3, 6):
            want_index, want_mid = [], []
            for g in range(h // group):
                for j in range(nt):
                    heads = [(r, g * group + r) for r in range(group)]
                    cut = [(r, x, lay.k_partial[x, j], lay.k_count[x, j]) for r, x in heads]
                    want_index.append([int(i) + r * nt for part in (0, 1) for r, x, p, c in cut
                                       for i in lay.k_index[x, j, (0, p)[part]:(p, c)[part]]])
                    want_mid.append([int(m) for part in (0, 1) for r, x, p, c in cut
                                     for m in lay.k_mask_id[x, j, (0, p)[part]:(p, c)[part]]])
            for xp in (np, jnp):
                got = hopper.group_key_lists(
                    xp, {k: xp.asarray(v) for k, v in lay.metadata().items()}, group, nt)
                got = {k: np.asarray(v) for k, v in got.items()}
                count = lay.k_count.reshape(-1, group, nt).sum(1)
                np.testing.assert_array_equal(got["kg_count"], count)
                np.testing.assert_array_equal(
                    got["kg_partial"], lay.k_partial.reshape(-1, group, nt).sum(1))
                np.testing.assert_array_equal(got["kg_order"],
                                              np.argsort(-count, axis=-1, kind="stable"))
                index = got["kg_index"].reshape(-1, got["kg_index"].shape[-1])
                mid = got["kg_mask_id"].reshape(index.shape)
                for row, (wi, wm) in enumerate(zip(want_index, want_mid, strict=True)):
                    self.assertEqual(index[row, :len(wi)].tolist(), wi)
                    self.assertEqual(mid[row, :len(wm)].tolist(), wm)
                    self.assertTrue((index[row, len(wi):] == 0).all())
                    self.assertTrue((mid[row, len(wm):] == -1).all())
                self.assertTrue(all(a.dtype == np.int32 for a in got.values()))
        with self.assertRaisesRegex(ValueError, "group 4 must be >= 1 and divide"):
            hopper.group_key_lists(np, lay.metadata(), 4, nt)

    def test_skip_halves_reach_the_forward_launch(self):
        # Only a layout with enough half entries compiles the forward's pairing of them, with
        # 64-row K/V boxes; head dim 256 walks 64-key steps anyway and never does.
        from sparsetp import jax as sjax  # noqa: PLC0415

        for pattern, n, want in ((P.causal(), 4096, False), (P.local(320, 320), 2048, True),
                                 (P.neighborhood((8, 16, 16), (3, 9, 9), tile_shape=(2, 8, 8)),
                                  2048, True)):
            lay = make_layout(pattern, n, 2, 128)
            self.assertEqual(lay.skip_halves, want)
            self.assertFalse(sjax.layout_arrays(lay).skip_halves)  # as skip_quarters
            meta = {**lay.metadata(), "q_head_group": None, "k_head_group": None}
            for d, halves in ((128, want), (256, False)):
                fwd = hopper.launches(meta, 1, 2, 2, n, n, 0.1, False, d,
                                      skip_quarters=lay.skip_quarters,
                                      skip_halves=lay.skip_halves)["fwd"]
                self.assertEqual(fwd.constexprs["PAIRS"], halves)
                self.assertEqual(dict(fwd.boxes)["k"], 64 if halves or d == 256 else 128)

    def test_layout_128(self):
        lay64 = make_layout(P.causal(), 512, 4, 64)
        lay = thopper.layout_128(lay64)
        self.assertEqual(lay.block_size, 128)
        np.testing.assert_array_equal(lay.dense_mask(), lay64.dense_mask())
        self.assertIs(thopper.layout_128(lay64), lay)  # cached
        self.assertIs(thopper.layout_128(lay), lay)
        part = thopper.layout_128(lay64.heads(2, 4))
        np.testing.assert_array_equal(part.dense_mask(), lay64.heads(2, 4).dense_mask())


def _inputs(seed, b, h, h_kv, n, n_kv, d, dtype):
    xs = tu.random_inputs(seed, (b, h, n, d), dtype, 2) + tu.random_inputs(
        seed + 100, (b, h_kv, n_kv, d), dtype, 2)
    q, d_out, k, v = xs
    return q, k, v, d_out


def _cuda(x, dtype, grad=False):
    return torch.tensor(x, dtype=TORCH_DTYPE[dtype], device="cuda", requires_grad=grad)


def _causal_case(seed, n=512, h=2, grad=False):
    """(causal layout at block 128, q, k, v, d_out): bf16 CUDA tensors, B=1, D=128."""
    return (make_layout(P.causal(), n, h, 128),
            *(_cuda(x, "bfloat16", grad=grad)
              for x in _inputs(seed, 1, h, h, n, n, 128, "bfloat16")))


@unittest.skipUnless(SM90, NEEDS_SM90)
class Sm90ForwardTest(parameterized.TestCase):

    def _check(self, layout, q, k, v, d_out, dtype, grads=True):
        """The forced fast paths (forward, dQ pass) against the float64 oracle and the portable
        kernels; bitwise deterministic, forward and gradients."""
        tq, tk, tv = (_cuda(x, dtype, grad=grads) for x in (q, k, v))
        # A fast path that failed would warn and run the portable kernel: make that an error,
        # and ask again afterwards which kernels the plan runs.
        with launch_options(fwd_kernel="hopper", bwd_kernel="hopper"), \
                warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            self.assertEqual(forward_kernel(tq, tk, tv, layout).name, "hopper")
            self.assertEqual(backward_kernel(tq, tk, tv, layout).name, "hopper")
            out, lse = sparse_attention(tq, tk, tv, layout, return_lse=True)
            again = sparse_attention(tq, tk, tv, layout)
            if grads:
                tdo = _cuda(d_out, dtype)
                got = torch.autograd.grad(out, (tq, tk, tv), tdo)
                got_again = torch.autograd.grad(again, (tq, tk, tv), tdo)
            self.assertEqual(forward_kernel(tq, tk, tv, layout).name, "hopper")
            self.assertEqual(backward_kernel(tq, tk, tv, layout).name, "hopper")
        self.assertTrue(torch.equal(out, again), "not deterministic")
        with launch_options(fwd_kernel="portable", bwd_kernel="portable"):
            ref_out, ref_lse = sparse_attention(tq, tk, tv, layout, return_lse=True)
            if grads:
                ref = torch.autograd.grad(ref_out, (tq, tk, tv), tdo)
        ora_out, ora_lse = reference.attention(q, k, v, layout)
        tu.assert_close(out.detach().float().cpu(), ora_out, dtype, what="out vs oracle")
        tu.assert_close(lse.detach().cpu(), ora_lse, dtype, what="lse vs oracle")
        tu.assert_close(out.detach().float().cpu(), ref_out.detach().float().cpu(), dtype,
                        what="out vs portable")
        self.assertTrue(torch.equal(torch.isinf(lse), torch.isinf(ref_lse)))
        if grads:
            ora = reference.attention_grad(q, k, v, layout, d_out)
            for name, g, g2, r, e in zip(("dq", "dk", "dv"), got, got_again, ref, ora,
                                         strict=True):
                self.assertTrue(torch.equal(g, g2), f"{name} not deterministic")
                tu.assert_close(g.float().cpu(), e, dtype, grad=True, what=f"{name} vs oracle")
                tu.assert_close(g.float().cpu(), r.float().cpu(), dtype, grad=True,
                                what=f"{name} vs portable")
        return out

    @parameterized.named_parameters((name, name) for name in sorted(EXAMPLE_PATTERNS))
    def test_example_patterns_bf16(self, name):
        n, h = 512, 2
        layout = make_layout(example_pattern(name, n, 128), n, h, 128)
        self._check(layout, *_inputs(1, 1, h, h, n, n, 128, "bfloat16"), "bfloat16")

    @parameterized.named_parameters(("causal", "causal"), ("per_head_mix", "per_head_mix"),
                                    ("masked_rows", "masked_rows"))
    def test_float16(self, name):
        n, h = 384, 3
        layout = make_layout(example_pattern(name, n, 128), n, h, 128)
        self._check(layout, *_inputs(2, 2, h, h, n, n, 128, "float16"), "float16")

    def test_fully_masked_rows_are_zero_with_lse_minus_inf(self):
        n = 512
        layout = make_layout(example_pattern("masked_rows", n, 128), n, 2, 128)
        q, k, v, d_out = _inputs(3, 1, 2, 2, n, n, 128, "bfloat16")
        out = self._check(layout, q, k, v, d_out, "bfloat16")
        empty = ~layout.dense_mask().any(-1)  # [H, N]
        self.assertTrue(empty.any(), "the pattern should have fully masked rows")
        self.assertEqual(float(out.detach()[0][torch.from_numpy(empty).cuda()].abs().max()), 0.0)

    def test_gqa(self):
        n, h, h_kv = 512, 4, 2
        layout = make_layout(example_pattern("per_head_mix", n, 128), n, h, 128)
        self._check(layout, *_inputs(4, 2, h, h_kv, n, n, 128, "bfloat16"), "bfloat16")

    def test_gqa_groups_with_empty_heads(self):
        # dK/dV programs whose group has a first, a last or every head without entries (the
        # group's merged lists leave no gap for them, group_key_lists).
        n = 512
        some = P.strided(512, 128) & P.causal()  # key tile 0 only, its diagonal partial
        none = P.strided(512, 128, offset=384)  # no key tile at N=512
        pattern = P.per_head([some, P.causal(), P.causal(), none, some, some])
        layout = make_layout(pattern, n, 6, 128)
        counts = np.asarray(layout.k_count)
        self.assertTrue((counts[0, 1:] == 0).all() and (counts[1] > 0).all())
        self.assertTrue((counts[3] == 0).all() and (counts[4:, 1:] == 0).all())
        self._check(layout, *_inputs(31, 1, 6, 3, n, n, 128, "bfloat16"), "bfloat16")

    @parameterized.named_parameters(("mha", 4), ("gqa", 2))
    def test_steps_and_quarters_without_keys_are_skipped_alike(self, h_kv):
        # Partial tiles with a 64-row half that has no key, or a 64 x 64 quarter with no pair:
        # the passes' producers and consumers skip those steps and quarters (each consumer
        # its own; GQA's dK/dV over its group's merged lists) and must stay in step.
        n, h = 512, 4
        halves = P.neighborhood((16, 32), (5, 9))
        pattern = P.per_head([halves, P.causal(), halves & P.causal(), halves])
        layout = make_layout(pattern, n, h, 128)
        quarters = np.asarray(layout.mask_quarters)
        # Steps with no key (a row half empty), and steps one consumer skips (a quarter).
        self.assertTrue(((quarters & 3) == 0).any() and ((quarters >> 2) == 0).any())
        self.assertTrue(np.isin(quarters & 3, (1, 2)).any() and layout.skip_quarters)
        self._check(layout, *_inputs(5, 3, h, h_kv, n, n, 128, "bfloat16"), "bfloat16")

    @parameterized.named_parameters(("mha", 6), ("gqa", 3))
    def test_half_entries_are_paired_two_to_a_step(self, h_kv):
        # The forward packs half entries (one 64-key half of the tile holds every pair) two to
        # a ring stage before the whole tiles: rows with more pairs than the ring has stages
        # (it wraps), with an odd count (the last half entry's copy is masked out), with none,
        # and heads without any.
        n, h = 2048, 6
        many = P.neighborhood((8, 16, 16), (3, 9, 9), tile_shape=(2, 8, 8))
        some = P.neighborhood((16, 16, 8), (5, 9, 5), tile_shape=(2, 8, 8))
        odd = P.local(320, 320)
        layout = make_layout(P.per_head([many, P.causal(), many & P.causal(), some, odd,
                                         odd & P.causal()]), n, h, 128)
        halves = np.asarray(layout.q_halves)
        self.assertTrue(layout.skip_halves and halves.max() > 2 * hopper.STAGES)
        self.assertTrue((halves[3] == 0).any() and (halves[3] > 0).any())
        self.assertTrue((halves[1] == 0).all() and (halves[4] % 2 == 1).any())
        self._check(layout, *_inputs(6, 3, h, h_kv, n, n, 128, "bfloat16"), "bfloat16")

    @parameterized.named_parameters(("causal_bf16", "causal", "bfloat16"),
                                    ("masked_rows_bf16", "masked_rows", "bfloat16"),
                                    ("local_fp16", "local", "float16"))
    def test_head_dim_256_forward(self, name, dtype):
        n, h, d = 512, 2, 256
        layout = make_layout(example_pattern(name, n, 128), n, h, 128)
        q, k, v, d_out = _inputs(30, 1, h, h, n, n, d, dtype)
        tq, tk, tv = (_cuda(x, dtype, grad=True) for x in (q, k, v))
        with launch_options(fwd_kernel="hopper"), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            self.assertEqual(forward_kernel(tq, tk, tv, layout).name, "hopper")
            bwd = backward_kernel(tq, tk, tv, layout)
            out, lse = sparse_attention(tq, tk, tv, layout, return_lse=True)
            again = sparse_attention(tq, tk, tv, layout)
            got = torch.autograd.grad(out, (tq, tk, tv), _cuda(d_out, dtype))
            self.assertEqual(forward_kernel(tq, tk, tv, layout).name, "hopper")
        self.assertEqual(bwd.name, "portable")
        self.assertIn("sm_90 backward", bwd.reason)
        self.assertTrue(torch.equal(out, again), "not deterministic")
        with launch_options(fwd_kernel="portable"):
            ref_out = sparse_attention(tq, tk, tv, layout)
        ora_out, ora_lse = reference.attention(q, k, v, layout)
        tu.assert_close(out.detach().float().cpu(), ora_out, dtype, what="out vs oracle")
        tu.assert_close(lse.detach().cpu(), ora_lse, dtype, what="lse vs oracle")
        tu.assert_close(out.detach().float().cpu(), ref_out.detach().float().cpu(), dtype,
                        what="out vs portable")
        # The portable backward on the sm_90 forward's out and LSE.
        for nm, g, e in zip(("dq", "dk", "dv"), got,
                            reference.attention_grad(q, k, v, layout, d_out), strict=True):
            tu.assert_close(g.float().cpu(), e, dtype, grad=True, what=f"{nm} vs oracle")

    def test_more_keys_than_queries(self):
        n, n_kv, h = 256, 640, 2
        layout = make_layout(P.causal(), n, h, 128, kv_len=n_kv)
        self._check(layout, *_inputs(5, 1, h, h, n, n_kv, 128, "bfloat16"), "bfloat16")

    def test_block_64_layout_runs_at_128(self):
        n, h = 512, 2
        layout = make_layout(example_pattern("bigbird", n, 64), n, h, 64)
        self._check(layout, *_inputs(6, 1, h, h, n, n, 128, "bfloat16"), "bfloat16")

    def test_head_slice(self):
        n = 512
        whole = make_layout(example_pattern("per_head_mix", n, 128), n, 4, 128)
        self._check(whole.heads(2, 4), *_inputs(7, 1, 2, 2, n, n, 128, "bfloat16"),
                    "bfloat16")

    def test_auto_takes_the_fast_path_where_the_rule_says(self):
        n = 2048
        q = torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16)
        long = make_layout(P.causal(), n, 2, 128)  # 8.5 key tiles a row, 32 programs
        self.assertEqual(forward_kernel(q, q, q, long).name, "portable")
        q16 = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)  # 512 programs
        lay16 = make_layout(P.causal(), n, 32, 128)
        self.assertEqual(forward_kernel(q16, q16, q16, lay16).name, "portable")
        q_many = torch.randn(2, 32, n, 128, device="cuda", dtype=torch.bfloat16)  # 1024
        self.assertEqual(forward_kernel(q_many, q_many, q_many, lay16).name, "hopper")
        self.assertEqual(backward_kernel(q_many, q_many, q_many, lay16).name, "hopper")
        self.assertEqual(backward_kernel(q16, q16, q16, lay16).name, "portable")
        ragged = make_layout(P.causal(), n - 8, 2, 128)
        self.assertIn("multiples of 128",
                      forward_kernel(q[:, :, 8:], q[:, :, 8:], q[:, :, 8:], ragged).reason)
        strided = q.transpose(1, 2).contiguous().transpose(1, 2)
        self.assertIn("C-contiguous", forward_kernel(strided, strided, strided, long).reason)
        f32 = q.float()
        self.assertIn("dtype", forward_kernel(f32, f32, f32, long).reason)

    def test_later_calls_launch_the_compiled_kernel_directly(self):
        layout, q, k, v, _ = _causal_case(9)
        with launch_options(fwd_kernel="hopper"):
            first = sparse_attention(q, k, v, layout)  # through Triton's JIT entry
            entry = mock.MagicMock()
            with mock.patch.object(hopper, "_attn_fwd_kernel_sm90", entry):
                later = [sparse_attention(q, k, v, layout) for _ in range(2)]
            q2 = torch.randn_like(q)  # other storage and values: pointers are read per call
            moved = sparse_attention(q2, k, v, layout)
        entry.__getitem__.assert_not_called()
        for out in later:
            self.assertTrue(torch.equal(out, first))
        with launch_options(fwd_kernel="portable"):
            moved_ref = sparse_attention(q2, k, v, layout)
        self.assertFalse(torch.equal(moved, first))
        tu.assert_close(moved.float().cpu(), moved_ref.float().cpu(), "bfloat16",
                        what="direct launch on new inputs vs portable")

    def test_misaligned_inputs_run_portable_and_say_so(self):
        n = 8192  # causal: 32.5 key tiles a row, so "auto" takes the fast path when it can
        layout = make_layout(P.causal(), n, 1, 128)
        q, k, v = (torch.randn(1, 1, n, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
        q_odd = buf[1:].view(q.shape)  # contiguous, 2 bytes past a 16-byte boundary
        q_odd.copy_(q)
        self.assertEqual(forward_kernel(q, k, v, layout).name, "hopper")
        choice = forward_kernel(q_odd, k, v, layout)
        self.assertEqual(choice.name, "portable")
        self.assertIn("16-byte boundary", choice.reason)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out = sparse_attention(q_odd, k, v, layout)
        with launch_options(fwd_kernel="portable"):
            self.assertTrue(torch.equal(out, sparse_attention(q_odd, k, v, layout)))
        with launch_options(fwd_kernel="hopper"):
            with self.assertRaisesRegex(ValueError, "16-byte boundary"):
                sparse_attention(q_odd, k, v, layout)

    def _bwd_pair(self, layout, q, k, v, loss):
        """Gradients of ``loss(out, lse)`` with the forced sm_90 backward and with the portable
        one (the forward portable in both, so only the backward differs). The sm_90 backward
        runs twice (through Triton's JIT entry, then launched directly), bitwise alike."""
        grads = []
        for mode in ("hopper", "portable"):
            with launch_options(fwd_kernel="portable", bwd_kernel=mode), \
                    warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                runs = [torch.autograd.grad(loss(*sparse_attention(q, k, v, layout,
                                                                  return_lse=True)), (q, k, v))
                        for _ in range(2 if mode == "hopper" else 1)]
                self.assertEqual(backward_kernel(q, k, v, layout).name, mode)
            for a, b in zip(runs[0], runs[-1], strict=True):
                self.assertTrue(torch.equal(a, b), "not deterministic")
            grads.append(runs[0])
        return grads

    def test_backward_with_an_lse_cotangent(self):
        n, h = 512, 2
        layout = make_layout(example_pattern("masked_rows", n, 128), n, h, 128)
        q, k, v, d_out = (_cuda(x, "bfloat16", grad=True)
                          for x in _inputs(10, 1, h, h, n, n, 128, "bfloat16"))
        d_lse = torch.randn(1, h, n, device="cuda")

        def loss(out, lse):
            # The cotangent reaches the rows with no key (LSE -inf) too: the kernels must keep
            # it out of their gradients (the loss value is not finite; its gradients are).
            return (out * d_out).sum() + (lse * d_lse).sum()

        (got, ref) = self._bwd_pair(layout, q, k, v, loss)
        # float64 oracle by autograd of a dense masked attention (rows with a key only).
        mask = torch.from_numpy(layout.dense_mask()).cuda()
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        s = (q64 @ k64.transpose(-1, -2) * 128 ** -0.5).masked_fill(~mask, float("-inf"))
        has = mask.any(-1)
        s = torch.where(has[..., None], s, 0.0)
        lse = torch.logsumexp(s, -1)
        out = torch.where(has[..., None], torch.softmax(s, -1), 0.0) @ v64
        ora = torch.autograd.grad(
            (out * d_out.double()).sum() + torch.where(has, lse * d_lse.double(), 0.0).sum(),
            (q64, k64, v64))
        for name, g, r, e in zip(("dq", "dk", "dv"), got, ref, ora, strict=True):
            tu.assert_close(g.float().cpu(), e.cpu(), "bfloat16", grad=True,
                            what=f"{name} vs oracle")
            tu.assert_close(g.float().cpu(), r.float().cpu(), "bfloat16", grad=True,
                            what=f"{name} vs portable")

    def test_backward_with_a_transposed_output_gradient(self):
        n, h = 512, 2
        layout, q, k, v, _ = _causal_case(11, n, h, grad=True)
        w = torch.randn(1, n, h * 128, device="cuda", dtype=torch.bfloat16)

        def loss(out, lse):
            # A block's output projection: the gradient reaching attention is not contiguous.
            return (out.transpose(1, 2).reshape(1, n, h * 128) * w).float().sum()

        got, ref = self._bwd_pair(layout, q, k, v, loss)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
            tu.assert_close(g.float().cpu(), r.float().cpu(), "bfloat16", grad=True,
                            what=f"{name} vs portable")

    def test_backward_with_a_broadcast_lse_cotangent(self):
        layout, q, k, v, _ = _causal_case(14, n=256, grad=True)
        # lse.sum() sends a stride-0 cotangent, copied before the sm_90 dQ pass reads it.
        got, ref = self._bwd_pair(layout, q, k, v, lambda out, lse: out.sum() + lse.sum())
        for name, g, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
            tu.assert_close(g.float().cpu(), r.float().cpu(), "bfloat16", grad=True,
                            what=f"{name} vs portable")

    def test_backward_with_misaligned_tensors(self):
        layout, q, k, v, d_out = _causal_case(15, n=256, grad=True)

        def odd(t):  # contiguous, 2 bytes past a 16-byte boundary
            buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
            return buf[1:].view(t.shape).copy_(t.detach())

        with launch_options(bwd_kernel="portable"):
            ref = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_out)
        # A misaligned output gradient is copied: the sm_90 backward still runs.
        with launch_options(bwd_kernel="hopper"), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), odd(d_out))
        for name, a, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
            tu.assert_close(a.float().cpu(), r.float().cpu(), "bfloat16", grad=True,
                            what=f"{name}, misaligned output gradient")
        # A misaligned q: the plan's sm_90 backward cannot run this call, which backward_kernel
        # says, and forcing it raises.
        q_odd = odd(q).requires_grad_()
        with launch_options(bwd_kernel="hopper"):
            choice = backward_kernel(q_odd, k, v, layout)
        self.assertEqual(choice.name, "portable")
        self.assertIn("16-byte boundary", choice.reason)
        with launch_options(fwd_kernel="portable", bwd_kernel="hopper"):
            out = sparse_attention(q_odd, k, v, layout)
            with self.assertRaisesRegex(ValueError, "bwd_kernel='hopper' cannot run"):
                torch.autograd.grad(out, (q_odd, k, v), d_out)

    def test_later_backwards_launch_the_compiled_kernels_directly(self):
        layout, q, k, v, d_out = _causal_case(12, grad=True)
        with launch_options(bwd_kernel="hopper"):
            first = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_out)
            entries = mock.MagicMock(), mock.MagicMock()
            with mock.patch.object(hopper, "_attn_bwd_dq_kernel_sm90", entries[0]), \
                    mock.patch.object(hopper, "_attn_bwd_dkdv_kernel_sm90", entries[1]):
                later = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_out)
            d_new = torch.randn_like(d_out)  # other storage and values: pointers read per call
            moved = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_new)
        for entry in entries:
            entry.__getitem__.assert_not_called()
        for a, b in zip(first, later, strict=True):
            self.assertTrue(torch.equal(a, b))
        with launch_options(bwd_kernel="portable"):
            ref = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_new)
        for name, a, r in zip(("dq", "dk", "dv"), moved, ref, strict=True):
            tu.assert_close(a.float().cpu(), r.float().cpu(), "bfloat16", grad=True,
                            what=f"{name}: direct launch on new inputs vs portable")

    @parameterized.named_parameters(("dq", "_attn_bwd_dq_kernel_sm90", "dQ pass"),
                                    ("dkdv", "_attn_bwd_dkdv_kernel_sm90", "dK/dV pass"))
    def test_a_failing_backward_pass_warns_and_falls_back(self, kernel, what):
        layout, q, k, v, d_out = _causal_case(13, grad=True)
        with launch_options(bwd_kernel="portable"):
            ref = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_out)
        broken = mock.MagicMock()
        broken.__getitem__.side_effect = RuntimeError("compile failed (simulated)")
        with launch_options(bwd_kernel="hopper"), mock.patch.object(hopper, kernel, broken), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_out)
            choice = backward_kernel(q, k, v, layout)
        for name, a, b in zip(("dq", "dk", "dv"), got, ref, strict=True):
            if what == "dQ pass":  # the whole backward ran portable
                self.assertTrue(torch.equal(a, b), name)
            else:  # the sm_90 dQ pass ran (dQ, and Delta for dK, summed in its own order)
                tu.assert_close(a.float().cpu(), b.float().cpu(), "bfloat16", grad=True,
                                what=name)
        self.assertTrue(any(f"sm_90 {what} failed" in str(w.message) for w in caught))
        self.assertEqual(choice.name, "portable")
        self.assertIn("compile failed (simulated)", choice.reason)

    def test_a_failing_fast_path_warns_and_falls_back(self):
        layout, q, k, v, _ = _causal_case(8)
        with launch_options(fwd_kernel="portable"):
            ref = sparse_attention(q, k, v, layout)
        broken = mock.MagicMock()
        broken.__getitem__.side_effect = RuntimeError("compile failed (simulated)")
        with launch_options(fwd_kernel="hopper"), \
                mock.patch.object(hopper, "_attn_fwd_kernel_sm90", broken), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sparse_attention(q, k, v, layout)
            choice = forward_kernel(q, k, v, layout)
        self.assertTrue(torch.equal(out, ref))
        self.assertTrue(any("sm_90 forward failed" in str(w.message) for w in caught))
        self.assertEqual(choice.name, "portable")
        self.assertIn("compile failed (simulated)", choice.reason)



def _python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python process (the repository on its path), with ``env`` added."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full, timeout=300, check=False)


@unittest.skipUnless(shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"),
                     "no C++ compiler on this machine")
class JaxLauncherBuildTest(absltest.TestCase):
    """The C++ handler JAX launches the sm_90 kernels with builds on any machine (it needs no
    GPU to build or load): here, in a fresh process and cache directory each."""

    def test_builds_into_the_cache_and_registers_a_plan_once(self):
        with tempfile.TemporaryDirectory() as cache:
            done = _python("""
                import ctypes
                from sparsetp.backends.jax import hopper
                assert hopper.unavailable() is None, hopper.unavailable()
                lib = hopper._library()
                def register(key):
                    return lib.sparsetp_sm90_register(
                        key, b"not a cubin", 11, b"k", (ctypes.c_int64 * 5)(1, 1, 1, 128, 0),
                        1, (ctypes.c_int32 * 1)(0), (ctypes.c_int64 * 1)(7), 0,
                        (ctypes.c_int64 * 1)(0))
                before = lib.sparsetp_sm90_plans()
                print(register(-12345), register(-12345), register(6789),
                      lib.sparsetp_sm90_plans() - before)
                """, SPARSETP_CACHE_DIR=cache)
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertEqual(done.stdout.split(), ["1", "0", "1", "2"])
            built = os.listdir(cache)
            self.assertEqual(len(built), 1)
            self.assertRegex(built[0], r"^sm90_launch-[0-9a-f]{16}\.so$")

    def test_a_failing_build_warns_and_names_the_reason(self):
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as bin_dir:
            cxx = os.path.join(bin_dir, "cxx")  # a compiler that fails as a missing header does
            with open(cxx, "w") as f:
                f.write("#!/bin/sh\necho 'x.cc:3:10: fatal error: cuda.h: No such file' >&2\n"
                        "echo 'compilation terminated.' >&2\nexit 1\n")
            os.chmod(cxx, 0o755)
            done = _python("""
                import warnings
                from sparsetp.backends.jax import hopper
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    why = hopper.unavailable()
                print(why)
                print(sum("did not build" in str(w.message) for w in caught))
                """, SPARSETP_CACHE_DIR=cache, CXX=cxx)
            self.assertEqual(done.returncode, 0, done.stderr)
            why, warned = done.stdout.strip().splitlines()
            self.assertEqual(why, "the launcher's C++ handler did not build: RuntimeError: "
                                  "x.cc:3:10: fatal error: cuda.h: No such file")
            self.assertEqual(warned, "1")
            self.assertEqual(os.listdir(cache), [])  # no partial library left behind


class UnlaunchableTest(absltest.TestCase):
    """A binary that asks for launch features the library's C++ launchers (torch's native path,
    JAX's FFI handler) do not set up is refused before launch (JAX then runs the portable
    kernels with a warning; torch keeps its Python launch path), never launched wrongly."""

    @staticmethod
    def _md(**kw):
        base = dict(name="k", global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
                    launch_cooperative_grid=False, launch_pdl=False, instrumentation_mode="")
        return types.SimpleNamespace(**{**base, **kw})

    def test_a_plain_binary_is_launchable(self):
        self.assertEqual(abi.unlaunchable(self._md()), [])

    def test_each_unsupported_feature_is_named(self):
        for field, value, words in (("global_scratch_size", 256, "scratch memory"),
                                    ("profile_scratch_size", 64, "scratch memory"),
                                    ("instrumentation_mode", "gsan",
                                     "instrumentation parameters"),
                                    ("num_ctas", 2, "thread-block clusters"),
                                    ("launch_cooperative_grid", True, "a cooperative grid"),
                                    ("launch_pdl", True, "programmatic dependent launch")):
            with self.subTest(field):
                self.assertEqual(abi.unlaunchable(self._md(**{field: value})), [words])


class BuildDiagnosticTest(absltest.TestCase):
    """The reason a failed launcher build gives is the compiler's first diagnostic."""

    def test_first_diagnostic(self):
        cases = (
            ("In file included from /usr/include/c++/13/system_error:39,\n"
             "x.cc:3:10: fatal error: cuda.h: No such file\ncompilation terminated.",
             "x.cc:3:10: fatal error: cuda.h: No such file"),
            ("/usr/bin/ld: x.o: undefined reference to `dlopen'\n"
             "collect2: error: ld returned 1 exit status",
             "/usr/bin/ld: x.o: undefined reference to `dlopen'"),
            ("Error building extension 'x': [1/2] c++ -c x.cc\nFAILED: x.o\n"
             "x.cc:7:1: error: expected ';'\nninja: build stopped: subcommand failed.",
             "x.cc:7:1: error: expected ';'"),
            ("something went wrong\nstill wrong", "still wrong"),
            ("", "(no output)"))
        for stderr, want in cases:
            with self.subTest(want):
                self.assertEqual(abi.first_diagnostic(stderr), want)


def _jax_gpu():
    """(jax, JAX's first GPU) or a skip: the JAX fast path needs a GPU seen by JAX and a
    launcher (:func:`sparsetp.backends.jax.hopper.unavailable`)."""
    import jax  # noqa: PLC0415

    from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415

    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as exc:
        raise unittest.SkipTest(f"JAX sees no GPU: {exc}") from None
    why = jhopper.unavailable()
    if why is not None:
        raise unittest.SkipTest(why)
    return jax, device


@unittest.skipUnless(SM90, NEEDS_SM90)
class JaxSm90Test(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.jax, self.device = _jax_gpu()

    def _jax(self, layout, q, k, v, d_out, mode="hopper", dtype="bfloat16", d_lse=None):
        """out, lse, dq, dk, dv (float32 NumPy) of the JAX frontend under ``mode``, and its
        (forward, backward) choices; RuntimeWarnings (a fast path that fell back) fail."""
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp import jax as sjax  # noqa: PLC0415

        jq, jk, jv, jdo = (jax.device_put(jnp.asarray(x, dtype), self.device)
                           for x in (q, k, v, d_out))
        with launch_options(fwd_kernel=mode, bwd_kernel=mode), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            choices = (sjax.forward_kernel(jq, jk, jv, layout).name,
                       sjax.backward_kernel(jq, jk, jv, layout).name)
            (out, lse), vjp = jax.vjp(lambda q, k, v: sjax.sparse_attention(
                q, k, v, layout, return_lse=True), jq, jk, jv)
            cot = jnp.zeros(lse.shape, lse.dtype) if d_lse is None else jnp.asarray(d_lse)
            grads = vjp((jdo, cot))
        return [np.asarray(a.astype(jnp.float32)) for a in (out, lse, *grads)], choices

    def _torch(self, layout, q, k, v, d_out, dtype="bfloat16", d_lse=None):
        tq, tk, tv = (_cuda(x, dtype, grad=True) for x in (q, k, v))
        with launch_options(fwd_kernel="hopper", bwd_kernel="hopper"):
            out, lse = sparse_attention(tq, tk, tv, layout, return_lse=True)
            loss = (out * _cuda(d_out, dtype)).sum()
            if d_lse is not None:
                loss = loss + (lse * torch.tensor(d_lse, device="cuda")).sum()
            grads = torch.autograd.grad(loss, (tq, tk, tv))
        return [t.detach().float().cpu().numpy() for t in (out, lse, *grads)]

    def _check(self, layout, q, k, v, d_out, dtype="bfloat16"):
        got, choices = self._jax(layout, q, k, v, d_out, dtype=dtype)
        self.assertEqual(choices, ("hopper", "hopper"))
        want = self._torch(layout, q, k, v, d_out, dtype=dtype)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: JAX vs torch, same kernel")
        ora_out, ora_lse = reference.attention(q, k, v, layout)
        tu.assert_close(got[0], ora_out, dtype, what="out vs oracle")
        tu.assert_close(got[1], ora_lse, dtype, what="lse vs oracle")
        ora = reference.attention_grad(q, k, v, layout, d_out)
        for name, g, e in zip(("dq", "dk", "dv"), got[2:], ora, strict=True):
            tu.assert_close(g, e, dtype, grad=True, what=f"{name} vs oracle")

    @parameterized.named_parameters((name, name) for name in sorted(EXAMPLE_PATTERNS))
    def test_example_patterns_match_torch_bitwise(self, name):
        n, h = 512, 2
        layout = make_layout(example_pattern(name, n, 128), n, h, 128)
        self._check(layout, *_inputs(20, 1, h, h, n, n, 128, "bfloat16"))

    def test_half_entries_match_torch_bitwise(self):
        # JAX launches the forward's half-entry steps too (skip_halves is static there).
        n, h = 2048, 2
        pattern = P.per_head([P.neighborhood((8, 16, 16), (3, 9, 9), tile_shape=(2, 8, 8)),
                              P.local(320, 320)])  # even and odd counts of half entries
        layout = make_layout(pattern, n, h, 128)
        self.assertTrue(layout.skip_halves and (np.asarray(layout.q_halves) % 2 == 1).any())
        self._check(layout, *_inputs(22, 1, h, h, n, n, 128, "bfloat16"))

    def test_float16_gqa_and_more_keys_than_queries(self):
        h, h_kv, n, n_kv = 4, 2, 256, 512
        layout = make_layout(P.causal(), n, h, 128, kv_len=n_kv)
        self._check(layout, *_inputs(21, 2, h, h_kv, n, n_kv, 128, "float16"), dtype="float16")

    def test_runs_in_a_process_without_torch(self):
        # The launcher loads and launches the kernels itself: torch is not imported in the
        # child, and an import of it would fail there.
        n, h = 512, 2
        layout = make_layout(P.causal(), n, h, 128)
        q, k, v, d_out = tu.random_inputs(27, (1, h, n, 128), "bfloat16")
        with tempfile.TemporaryDirectory() as tmp:
            np.savez(os.path.join(tmp, "in.npz"), q=q, k=k, v=v, d_out=d_out)
            done = _python("""
                import os, sys, warnings
                import numpy as np
                sys.modules["torch"] = None
                import jax, jax.numpy as jnp
                from sparsetp import jax as sjax
                from sparsetp.core import make_layout
                from sparsetp.core import patterns as P
                from sparsetp.kernels.options import launch_options
                tmp = os.environ["CASE_DIR"]
                x = np.load(os.path.join(tmp, "in.npz"))
                q, k, v, do = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "d_out"))
                layout = make_layout(P.causal(), q.shape[2], q.shape[1], 128)
                with launch_options(fwd_kernel="hopper", bwd_kernel="hopper"):
                    with warnings.catch_warnings():
                        warnings.simplefilter("error", RuntimeWarning)
                        kinds = (sjax.forward_kernel(q, k, v, layout).name,
                                 sjax.backward_kernel(q, k, v, layout).name)
                        out, vjp = jax.vjp(
                            lambda q, k, v: sjax.sparse_attention(q, k, v, layout), q, k, v)
                        grads = vjp(do)
                np.savez(os.path.join(tmp, "out.npz"), **{
                    n: np.asarray(a.astype(jnp.float32))
                    for n, a in zip(("out", "dq", "dk", "dv"), (out, *grads))})
                print(kinds, sys.modules.get("torch") is not None)
                """, CASE_DIR=tmp)
            self.assertEqual(done.returncode, 0, done.stderr[-3000:])
            self.assertEqual(done.stdout.strip().splitlines()[-1], "('hopper', 'hopper') False")
            got = np.load(os.path.join(tmp, "out.npz"))
            want_out, _ = reference.attention(q, k, v, layout)
            want = dict(zip(("dq", "dk", "dv"),
                            reference.attention_grad(q, k, v, layout, d_out), strict=True))
            tu.assert_close(got["out"], want_out, "bfloat16", what="out vs oracle")
            for name, e in want.items():
                tu.assert_close(got[name], e, "bfloat16", grad=True, what=f"{name} vs oracle")

    def test_an_executable_from_the_persistent_cache_finds_its_plan(self):
        # The custom call names its plan by a hash of the plan's contents, so a second process
        # that loads the first one's executable from XLA's persistent cache (no compile) finds
        # the plan its own trace registered.
        n, h = 512, 2
        q, k, v = tu.random_inputs(28, (1, h, n, 128), "bfloat16", 3)
        with tempfile.TemporaryDirectory() as tmp:
            np.savez(os.path.join(tmp, "in.npz"), q=q, k=k, v=v)
            code = """
                import os
                import numpy as np
                import jax, jax.numpy as jnp
                tmp = os.environ["CASE_DIR"]
                jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "xla"))
                jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
                jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
                from sparsetp import jax as sjax
                from sparsetp.core import make_layout
                from sparsetp.core import patterns as P
                from sparsetp.kernels.options import launch_options
                x = np.load(os.path.join(tmp, "in.npz"))
                q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
                arrays = sjax.layout_arrays(make_layout(P.causal(), q.shape[2], q.shape[1], 128))
                with launch_options(fwd_kernel="hopper"):
                    f = jax.jit(lambda q, k, v, lay: sjax.sparse_attention(q, k, v, lay))
                    out = f(q, k, v, arrays)
                np.save(os.path.join(tmp, os.environ["RUN"] + ".npy"),
                        np.asarray(out.astype(jnp.float32)))
                print(len(os.listdir(os.path.join(tmp, "xla"))))
                """
            first = _python(code, CASE_DIR=tmp, RUN="first")
            self.assertEqual(first.returncode, 0, first.stderr[-3000:])
            second = _python(code, CASE_DIR=tmp, RUN="second")
            self.assertEqual(second.returncode, 0, second.stderr[-3000:])
            # The second process compiled nothing new: it ran the cached executable.
            self.assertEqual(first.stdout.split()[-1], second.stdout.split()[-1])
            np.testing.assert_array_equal(np.load(os.path.join(tmp, "first.npy")),
                                          np.load(os.path.join(tmp, "second.npy")))

    def test_a_plan_not_registered_here_fails_with_the_reason(self):
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415

        x = jax.device_put(jnp.zeros((128, 128), jnp.bfloat16), self.device)
        call = jax.ffi.ffi_call(jhopper._TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
        with self.assertRaisesRegex(Exception, "is not registered in this process"):
            jax.block_until_ready(call(x, plan=np.int64(-1)))

    def test_an_empty_grid_launches_nothing_and_a_bad_cubin_names_the_driver_call(self):
        # As Triton's launcher, an empty grid returns before loading anything (so even a plan
        # whose cubin is not one succeeds) where its outputs are empty too, and refuses where
        # one is not; with a grid, a bad cubin fails naming cuModuleLoadData.
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415

        lib = jhopper._library()
        for grid, key in (((0, 4, 1), -771), ((1, 1, 1), -772)):
            lib.sparsetp_sm90_register(key, b"not a cubin", 11, b"k",
                                       (ctypes.c_int64 * 5)(*grid, 128, 0), 0,
                                       (ctypes.c_int32 * 1)(0), (ctypes.c_int64 * 1)(0), 0,
                                       (ctypes.c_int64 * 1)(0))

        def call(key, out_len):
            x = jax.device_put(jnp.zeros((128,), jnp.float32), self.device)
            return jax.block_until_ready(jax.ffi.ffi_call(
                jhopper._TARGET, jax.ShapeDtypeStruct((out_len,), jnp.float32))(
                    x, plan=np.int64(key)))

        self.assertEqual(call(-771, 0).shape, (0,))
        with self.assertRaisesRegex(Exception, "an empty grid with a non-empty output"):
            call(-771, 128)
        with self.assertRaisesRegex(Exception, "sparsetp sm_90 launch: cuModuleLoadData"):
            call(-772, 128)

    def test_plans_of_one_binary_share_its_module(self):
        # Two lengths are two plans (grids differ) of one binary (lengths are specialised
        # only as "divisible by 16"), loaded once on this device.
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp import jax as sjax  # noqa: PLC0415
        from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415

        lib = jhopper._library()
        counts = []
        with launch_options(fwd_kernel="hopper"):
            for n in (384, 640):  # with H=5: shapes no other test runs, so new plans
                q, k, v = (jax.device_put(jnp.asarray(x, jnp.bfloat16), self.device)
                           for x in tu.random_inputs(29, (1, 5, n, 128), "bfloat16", 3))
                layout = make_layout(P.causal(), n, 5, 128)
                before = (lib.sparsetp_sm90_plans(), lib.sparsetp_sm90_modules(),
                          len(jhopper._COMPILED))
                sjax.sparse_attention(q, k, v, layout).block_until_ready()
                counts.append((lib.sparsetp_sm90_plans() - before[0],
                               lib.sparsetp_sm90_modules() - before[1],
                               len(jhopper._COMPILED) - before[2]))
        self.assertEqual(counts[0][0], 1)  # a new plan (its binary may be loaded already)
        self.assertEqual(counts[1], (1, 0, 0))  # a new plan; no new binary, no new module

    def test_lse_cotangent(self):
        n, h = 256, 2
        layout = make_layout(example_pattern("masked_rows", n, 128), n, h, 128)
        q, k, v, d_out = _inputs(22, 1, h, h, n, n, 128, "bfloat16")
        d_lse = np.random.default_rng(5).standard_normal((1, h, n)).astype(np.float32)
        got, _ = self._jax(layout, q, k, v, d_out, d_lse=d_lse)
        want = self._torch(layout, q, k, v, d_out, d_lse=d_lse)
        for name, a, b in zip(("dq", "dk", "dv"), got[2:], want[2:], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: JAX vs torch")

    def test_same_binaries_as_torch(self):
        from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415
        from sparsetp.backends.torch import attention as tattn  # noqa: PLC0415
        from sparsetp.kernels import schedule  # noqa: PLC0415

        layout, q, k, v, d_out = _causal_case(23, grad=True)
        with launch_options(fwd_kernel="hopper", bwd_kernel="hopper"):
            torch.autograd.grad(sparse_attention(q, k, v, layout), (q, k, v), d_out)
            plan = tattn._plan(q, k, v, layout, None)  # the call's plan (scale as passed)
            meta = {**layout.metadata()}
            meta["q_head_group"], meta["k_head_group"] = schedule.head_groups(layout)
            launches = hopper.launches(meta, *q.shape[:2], k.shape[1], q.shape[2],
                                       k.shape[2], 128 ** -0.5, plan.sm90.ordered,
                                       skip_quarters=layout.skip_quarters,
                                       skip_halves=layout.skip_halves)
        for name in ("fwd", "dq", "dkdv"):
            self.assertEqual(jhopper.compile_launch(launches[name], "bfloat16", 128).hash,
                             plan.sm90.compiled[name].hash, name)

    def test_jit_vmap_and_layout_arrays(self):
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp import jax as sjax  # noqa: PLC0415

        n, h = 256, 2
        layout = make_layout(P.causal(), n, h, 128)
        arrays = sjax.layout_arrays(layout)
        self.assertEqual(arrays.block_size, 128)
        xs = [jax.device_put(jnp.asarray(x, jnp.bfloat16), self.device)
              for x in _inputs(24, 3, h, h, n, n, 128, "bfloat16")[:3]]

        def loss(q, k, v, lay):
            return sjax.sparse_attention(q, k, v, lay).astype(jnp.float32).sum()

        with launch_options(fwd_kernel="hopper", bwd_kernel="hopper"), \
                warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            eager = jax.grad(loss, argnums=(0, 1, 2))(*xs, layout)
            jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs, arrays)
            out = sjax.sparse_attention(*xs, layout)
            mapped = jax.vmap(lambda q, k, v: sjax.sparse_attention(
                q[None], k[None], v[None], layout)[0])(*xs)
        for a, b in zip(eager, jitted, strict=True):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                          np.asarray(b.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                      np.asarray(mapped.astype(jnp.float32)))

    def test_two_gpus_in_shard_map(self):
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415
        from jax.sharding import PartitionSpec as Spec  # noqa: PLC0415

        from sparsetp import jax as sjax  # noqa: PLC0415
        from sparsetp.backends.jax import compat  # noqa: PLC0415

        gpus = jax.devices("gpu")
        if len(gpus) < 2:
            self.skipTest(f"needs 2 GPUs seen by JAX, got {len(gpus)}")
        n, h = 512, 4
        layout = make_layout(P.causal(), n, h, 128)
        arrays = sjax.layout_arrays(layout)
        xs = [jnp.asarray(x, jnp.bfloat16) for x in _inputs(26, 1, h, h, n, n, 128, "bfloat16")]

        heads = Spec(None, "tp")
        mesh = compat.auto_mesh((2,), ("tp",), devices=gpus[:2])
        sharded = jax.jit(jax.shard_map(
            lambda q, k, v, lay, do: jax.vjp(lambda q, k, v: sjax.sparse_attention(
                q, k, v, lay), q, k, v)[1](do), mesh=mesh,
            in_specs=(heads,) * 3 + (arrays.partition_specs("tp"), heads),
            out_specs=(heads,) * 3))
        whole = jax.jit(lambda q, k, v, lay, do: jax.vjp(lambda q, k, v: sjax.sparse_attention(
            q, k, v, lay), q, k, v)[1](do))
        with launch_options(fwd_kernel="hopper", bwd_kernel="hopper"), \
                warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = sharded(*xs[:3], arrays, xs[3])
            want = whole(*(jax.device_put(x, gpus[0]) for x in xs[:3]), arrays,
                         jax.device_put(xs[3], gpus[0]))
        for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
            self.assertEqual({d.id for d in a.devices()}, {gpus[0].id, gpus[1].id})
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                          np.asarray(b.astype(jnp.float32)), err_msg=name)

    def test_rule_and_reasons(self):
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp import jax as sjax  # noqa: PLC0415

        q = jax.device_put(jnp.zeros((1, 2, 256, 128), jnp.bfloat16), self.device)
        small = make_layout(P.causal(), 256, 2, 128)
        choice = sjax.forward_kernel(q, q, q, small)
        self.assertEqual(choice.name, "portable")
        self.assertIn("short lists", choice.reason)
        at64 = sjax.layout_arrays(make_layout(P.causal(), 256, 2, 64))
        with launch_options(fwd_kernel="hopper"):
            self.assertEqual(sjax.forward_kernel(q, q, q, small).name, "hopper")
            with self.assertRaisesRegex(ValueError, "at block 64"):
                sjax.sparse_attention(q, q, q, at64)
        # The rule counts B * H programs, as torch's: 2 x 16 heads x 32 tiles = 1024.
        q2 = jax.device_put(jnp.zeros((2, 16, 4096, 128), jnp.bfloat16), self.device)
        lay64 = make_layout(P.causal(), 4096, 16, 64)
        self.assertEqual(sjax.forward_kernel(q2, q2, q2, lay64).name, "hopper")
        self.assertEqual(sjax.forward_kernel(q2[:1], q2[:1], q2[:1], lay64).name, "portable")
        tq = torch.zeros(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
        self.assertEqual(forward_kernel(tq, tq, tq, lay64).name, "hopper")
        # Head dim 256: the sm_90 forward needs the block-128 arrays, the portable backward
        # block 64, and one LayoutArrays serves both, so JAX keeps the portable kernels.
        q256 = jax.device_put(jnp.zeros((1, 16, 8192, 256), jnp.bfloat16), self.device)
        wide = make_layout(P.causal(), 8192, 16, 128)
        choice = sjax.forward_kernel(q256, q256, q256, wide)
        self.assertEqual(choice.name, "portable")
        self.assertIn("head dim 256: JAX runs the sm_90 forward only", choice.reason)
        # Where the rule takes the fast path, layout_arrays lays a block-64 layout out at 128.
        big = make_layout(P.causal(), 8192, 16, 64)
        self.assertEqual(sjax.layout_arrays(big, head_dim=128, dtype="bfloat16").block_size,
                         128)
        from sparsetp.kernels import schedule  # noqa: PLC0415

        for d, opts in ((64, {}), (128, dict(fwd_kernel="portable", bwd_kernel="portable"))):
            with launch_options(**opts):  # elsewhere the portable kernels' tile, as before
                self.assertEqual(
                    sjax.layout_arrays(big, head_dim=d, dtype="bfloat16").block_size,
                    schedule.kernel_layout(big, "cuda", head_dim=d,
                                           dtype="bfloat16").block_size)

    def test_jit_runs_the_kernel_the_eager_rule_reports(self):
        jax = self.jax
        import jax.numpy as jnp  # noqa: PLC0415

        from sparsetp import jax as sjax  # noqa: PLC0415
        from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415

        # Few programs (4 heads x 32 tiles), long lists (32 tiles a row): the list-length
        # threshold decides, and traced arrays must read it as the eager call does.
        n, h = 4096, 4
        layout = make_layout(P.dense(), n, h, 128)
        arrays = sjax.layout_arrays(layout, head_dim=128, dtype="bfloat16")
        q = jax.device_put(jnp.zeros((1, h, n, 128), jnp.bfloat16), self.device)
        self.assertEqual(sjax.forward_kernel(q, q, q, layout).name, "hopper")
        launched = []
        real = jhopper.call
        with mock.patch.object(jhopper, "call",
                               lambda launch, *a: launched.append(launch.kernel) or real(
                                   launch, *a)):
            jax.jit(lambda q, lay: sjax.sparse_attention(q, q, q, lay))(q, arrays)
        self.assertEqual(launched, ["_attn_fwd_kernel_sm90"])

    def test_a_failing_compile_warns_and_falls_back(self):
        from sparsetp import jax as sjax  # noqa: PLC0415
        from sparsetp.backends.jax import hopper as jhopper  # noqa: PLC0415

        n, h = 384, 3  # shapes no other test traces: the fast path compiles at trace time
        # The arrays at block 128 (the fall-back runs them; a BlockLayout the portable kernels
        # alone would run might be laid out at another tile).
        layout = sjax.layout_arrays(make_layout(P.causal(), n, h, 128))
        q, k, v, d_out = _inputs(25, 1, h, h, n, n, 128, "bfloat16")
        ref, _ = self._jax(layout, q, k, v, d_out, mode="portable")
        with mock.patch.dict(jhopper._COMPILED, clear=True), \
                mock.patch.object(jhopper, "_compile",
                                  side_effect=RuntimeError("compile failed (simulated)")), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax = self.jax
            import jax.numpy as jnp  # noqa: PLC0415

            jq, jk, jv = (jax.device_put(jnp.asarray(x, jnp.bfloat16), self.device)
                          for x in (q, k, v))
            with launch_options(fwd_kernel="hopper", bwd_kernel="hopper"):
                out = sjax.sparse_attention(jq, jk, jv, layout)
                choice = sjax.forward_kernel(jq, jk, jv, layout)
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), ref[0])
        self.assertTrue(any("sm_90 forward failed" in str(w.message) for w in caught))
        self.assertEqual(choice.name, "portable")
        self.assertIn("compile failed (simulated)", choice.reason)


if __name__ == "__main__":
    absltest.main()
