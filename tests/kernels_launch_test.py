"""The framework-neutral launch layer (sparsetp.kernels: abi, tiles, schedule, options).

No kernel runs here: launch descriptions are built from numpy arrays (only shapes are read),
so every case is cheap and device-independent. The launches themselves are tested per frontend
(``torch_attention_test.py``, ``jax_attention_test.py``).
"""

from __future__ import annotations

import dataclasses
import threading
from unittest import mock

import numpy as np
from absl.testing import absltest, parameterized

from sparsetp.core import make_layout
from sparsetp.core import patterns as P
from sparsetp.core.patterns import EMPTY
from sparsetp.kernels import abi, options, schedule, tiles
from sparsetp.kernels.tiles import TileConfig


def _list_calls(meta, x, **kw):
    """fwd, dQ and dK/dV launch descriptions for q = k = v = ``x`` (shapes only)."""
    stats = x[..., 0]
    return (abi.fwd_call(x, x, x, meta, **kw),
            abi.bwd_dq_call(x, x, x, x, stats, x, None, meta, **kw),
            abi.bwd_dkdv_call(x, x, x, x, stats, stats, meta, **kw))


class WorkOrderTest(absltest.TestCase):
    """Launch grids: work orders and head groups, as the launch descriptions carry them."""

    def test_auto_work_order_follows_the_layout(self):
        """Under the default work order "auto", each launch takes its view's head groups from
        the mapping (query-major: forward and dQ; key-major: dK/dV): grid (G, tiles, B*H / G)
        for groups of G heads, (B*H, tiles, 1) when all interleave, the one-axis grid
        (B*H*tiles,) for G = 1. A mapping without the groups interleaves all heads; the other
        work orders and the head_group option force theirs."""
        self.assertEqual(options.current().work_order, "auto")
        lay = make_layout(P.causal(), 2048, 4, 64)
        meta = {**lay.metadata(), "q_head_group": 2, "k_head_group": 4}
        x = np.zeros((3, 4, 2048, 32), np.float32)  # launch reads shapes only
        kw = dict(scale=1.0, dtype="float32", device_kind="cuda")
        fwd, dq, dkdv = _list_calls(meta, x, **kw)
        # B*H = 12, 32 tiles.
        pairs, every, one_axis = (2, 32, 6), (12, 32, 1), (384, 1, 1)
        for call, grid in ((fwd, pairs), (dq, pairs), (dkdv, every)):
            self.assertEqual(call.grid, grid, call.name)
            self.assertTrue(call.constexprs["ORDERED"], call.name)
        # The order is the grid's shape only: the kernels compile the same either way.
        bare = {n: a for n, a in meta.items() if not n.endswith("_head_group")}
        self.assertEqual(fwd.constexprs, abi.fwd_call(x, x, x, bare, **kw).constexprs)
        self.assertEqual(abi.fwd_call(x, x, x, bare, **kw).grid, every)
        self.assertEqual(abi.fwd_call(x, x, x, {**bare, "q_head_group": None}, **kw).grid, every)
        with options.launch_options(work_order="longest_first_bh"):
            self.assertEqual(abi.fwd_call(x, x, x, meta, **kw).grid, every)
        with options.launch_options(work_order="longest_first"):
            self.assertEqual(_list_calls(meta, x, **kw)[2].grid, one_axis)
        with options.launch_options(work_order="natural"):
            natural = _list_calls(meta, x, **kw)
        for call in natural:
            self.assertEqual(call.grid, one_axis, call.name)
            self.assertFalse(call.constexprs["ORDERED"], call.name)
        for group, grid in ((1, one_axis), (2, pairs), (3, one_axis), (8, every)):
            with options.launch_options(head_group=group):  # gcd(G, H) heads; G >= H: all
                self.assertEqual(_list_calls(meta, x, **kw)[2].grid, grid, group)
        # A tensor-parallel slice of 2 heads keeps the layout's G = 4 >= 2: all pairs.
        x2, meta2 = x[:, :2], {**lay.heads(0, 2).metadata(), "k_head_group": 4}
        self.assertEqual(_list_calls(meta2, x2, **kw)[2].grid, (6, 32, 1))
        with self.assertRaisesRegex(ValueError, "head_group"):
            with options.launch_options(head_group=0):
                pass
        with self.assertRaisesRegex(ValueError, "divide"):
            schedule.list_grid(3, 2, 32, 4)

    def test_list_grid_and_grid_group(self):
        """list_grid's three forms and grid_group's choice per work order."""
        self.assertEqual(schedule.list_grid(2, 8, 32, 16), (16, 32, 1))
        self.assertEqual(schedule.list_grid(2, 8, 32, 4), (4, 32, 4))
        self.assertEqual(schedule.list_grid(2, 8, 32, 1), (512, 1, 1))
        self.assertEqual(schedule.list_grid(2, 8, 1, 4), (16, 1, 1))  # one rank per head
        self.assertEqual(schedule.list_grid(2, 8, 32, 64), (16, 32, 1))  # clipped to B*H
        with self.assertRaisesRegex(ValueError, "divide"):
            schedule.list_grid(2, 8, 32, 0)
        meta = {"q_head_group": 2, "k_head_group": None}
        self.assertEqual(schedule.grid_group(meta, "q", 3, 4), 2)
        self.assertEqual(schedule.grid_group(meta, "k", 3, 4), 12)  # None: all pairs
        self.assertEqual(schedule.grid_group({}, "q", 3, 4), 12)
        self.assertEqual(schedule.grid_group({"q_head_group": 3}, "q", 1, 4), 1)  # gcd(3, 4)
        for order, want in (("natural", 1), ("longest_first", 1), ("longest_first_bh", 12)):
            with options.launch_options(work_order=order):
                self.assertEqual(schedule.grid_group(meta, "q", 3, 4), want, order)
        with options.launch_options(work_order="natural", head_group=4):
            self.assertEqual(schedule.grid_group(meta, "q", 3, 4), 12)  # the option wins

    def test_dq_launch_writes_delta(self):
        """dQ's outputs are dq and delta (lse's shape, stats dtype); the LSE cotangent is a
        constexpr switch whose slot carries lse when absent, and its strides never decide
        ALIGNED (a cotangent of lse.sum() is an expanded, stride-0 tensor)."""
        q = np.zeros((2, 4, 128, 32), np.float32)
        lse = np.zeros((2, 4, 128), np.float32)
        meta = make_layout(P.causal(), 128, 4, 32).metadata()
        kw = dict(scale=0.2, dtype="float32", device_kind="interpreter")
        call = abi.bwd_dq_call(q, q, q, q, lse, q, None, meta, **kw)
        self.assertEqual([(o.name, o.shape, o.dtype) for o in call.outputs],
                         [("dq", (2, 4, 128, 32), "float32"), ("delta", (2, 4, 128), "float32")])
        self.assertIs(call.args[6], lse)
        self.assertFalse(call.constexprs["HAS_DLSE"])
        self.assertTrue(call.constexprs["ALIGNED"])
        d_lse = np.zeros((2, 4, 128), np.float32)
        with_dlse = abi.bwd_dq_call(q, q, q, q, lse, q, d_lse, meta, **kw,
                                    strides={"d_lse": (0, 0, 0)})
        self.assertIs(with_dlse.args[6], d_lse)
        self.assertTrue(with_dlse.constexprs["HAS_DLSE"])
        self.assertTrue(with_dlse.constexprs["ALIGNED"])
        self.assertEqual(len(with_dlse.args), len(call.args))
        self.assertEqual(len(call.args) + len(call.outputs) + len(call.constexprs),
                         len(call.kernel.arg_names))


class HeadGroupsTest(absltest.TestCase):
    """schedule.head_group's model and schedule.head_groups per layout and head slice."""

    def test_head_groups_of_layouts_and_head_slices(self):
        """Heads in groups, each group's heads interleaved and the groups one after another:
        the smallest group whose tail (head_group's model, CONCURRENT_PROGRAMS at once) stays
        within HEAD_MAJOR_TAIL. Causal with many tiles per head runs its heads one after
        another, with few in small groups; BigBird (global rows) interleaves all. Head slices
        keep the whole layout's choice, so tensor-parallel ranks launch alike."""
        bigbird = make_layout(P.bigbird(16, 3, 1, 2, seed=0), 4096, 16, 16)
        self.assertEqual(schedule.head_groups(bigbird), (16, 16))
        long_causal = make_layout(P.causal(), 8192, 16, 16)  # 512 tiles: 264*512/W = 0.064
        self.assertEqual(schedule.head_groups(long_causal), (1, 1))
        short_causal = make_layout(P.causal(), 2048, 16, 16)  # 128 tiles: 0.256 -> G >= 3.8
        self.assertEqual(schedule.head_groups(short_causal), (4, 4))
        # Block 128: one program per SM (132): 132 * 64 / (16 * 64 * 65 / 2) = 0.254 -> G = 4;
        # at 264 programs (block 64) the same load needs twice the tiles per head.
        causal_128 = make_layout(P.causal(), 8192, 16, 128)
        self.assertEqual(schedule.head_groups(causal_128)[0], 4)
        self.assertEqual(schedule.CONCURRENT_PROGRAMS[128], 132)
        # A head slice: the whole layout's groups, not those of its own heads (one head of
        # short_causal alone would be "all heads" = 1; its source says 4).
        for whole, start, stop in ((long_causal, 0, 1), (short_causal, 0, 2),
                                   (short_causal, 3, 5)):
            piece = whole.heads(start, stop)
            self.assertIs(piece.source, whole)
            self.assertEqual(schedule.head_groups(piece), schedule.head_groups(whole))
        # A slice of a slice still points at the whole layout.
        self.assertIs(short_causal.heads(0, 4).heads(1, 2).source, short_causal)
        self.assertEqual(schedule.head_groups(short_causal.heads(0, 4).heads(1, 2)), (4, 4))
        # Cached per whole layout.
        self.assertIs(schedule.head_groups(short_causal), schedule.head_groups(short_causal))

    def test_head_group_model(self):
        self.assertEqual(schedule.head_group(np.zeros((2, 3)), 132), 2)  # nothing listed: all
        # tail(G) = L_max * P / W - G / H: 9 * 132 / (16 * 256 * 9) - 1/16 < 0; with 64 tiles
        # per head 0.129 - G/16 <= 0.02 from G = 2; H = 12: the divisors 1, 2, 3, 4, 6, 12.
        self.assertEqual(schedule.head_group(np.full((16, 256), 9), 132), 1)
        self.assertEqual(schedule.head_group(np.full((16, 64), 9), 132), 2)
        self.assertEqual(schedule.head_group(np.full((12, 64), 9), 264), 4)  # 0.344 - 4/12
        self.assertEqual(schedule.head_group(np.full((16, 8), 9), 264), 16)  # all: tail > 0.02
        self.assertEqual(schedule.HEAD_MAJOR_TAIL, 0.02)
        with self.assertRaisesRegex(ValueError, "count"):
            schedule.head_group(np.zeros(3), 132)


class TileConfigTest(absltest.TestCase):

    def test_override_restores_and_validates(self):
        before = tiles.tile_config("bwd_dkdv", head_dim=64, dtype="bfloat16", block_size=128,
                                   device_kind="cuda")
        order = options.current().work_order
        with options.launch_options(work_order="natural",
                                    tiles={"bwd_dkdv": TileConfig(128, 128, 8, 2, sub=64)}):
            self.assertEqual(options.current().work_order, "natural")
            self.assertEqual(tiles.tile_config("bwd_dkdv", head_dim=64, dtype="bfloat16",
                                               block_size=128, device_kind="cuda").sub, 64)
            with self.assertRaisesRegex(ValueError, "layout block"):
                tiles.tile_config("bwd_dkdv", head_dim=64, dtype="bfloat16", block_size=64,
                                  device_kind="cuda")
        self.assertEqual(tiles.tile_config("bwd_dkdv", head_dim=64, dtype="bfloat16",
                                           block_size=128, device_kind="cuda"), before)
        self.assertEqual(options.current().work_order, order)
        self.assertNotEqual(order, "natural")
        with self.assertRaisesRegex(ValueError, "work_order"):
            with options.launch_options(work_order="random"):
                pass
        for bad in (8, 24, 256):
            with self.assertRaisesRegex(ValueError, "sub"):
                TileConfig(128, 128, 4, 2, sub=bad)
        self.assertEqual(TileConfig(64, 64, 4, 2).sub, 64)

    def test_tile_config_choices_and_errors(self):
        """The interpreter walks whole tiles; a launch's constexprs take the config's sub-tile;
        bad kernels, device kinds, blocks, head dims and dtypes are refused by name."""
        self.assertEqual(tiles.tile_config("fwd", head_dim=64, dtype="float32", block_size=32,
                                           device_kind="interpreter"),
                         TileConfig(32, 32, 1, 1, sub=32))
        x = np.zeros((1, 2, 256, 64), np.float32)
        meta = make_layout(P.causal(), 256, 2, 128).metadata()
        kw = dict(scale=0.1, dtype="bfloat16", device_kind="cuda")
        calls = _list_calls(meta, x, **kw)
        for call, sub in zip(calls, ("SUB_N", "SUB_N", "SUB_M"), strict=True):
            cfg = tiles.tile_config(call.name, head_dim=64, dtype="bfloat16", block_size=128,
                                    device_kind="cuda")
            self.assertEqual(call.constexprs[sub], cfg.sub, call.name)
            self.assertEqual((call.num_warps, call.num_stages),
                             (cfg.num_warps, cfg.num_stages), call.name)
        for kwargs, regex in ((dict(kernel_name="nope"), "kernel"),
                              (dict(device_kind="tpu"), "device_kind"),
                              (dict(block_size=48), "block_size"),
                              (dict(head_dim=24), "head dim"),
                              (dict(dtype="int8"), "dtype")):
            args = {**dict(kernel_name="fwd", head_dim=64, dtype="float32", block_size=64,
                           device_kind="cuda"), **kwargs}
            with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, regex):
                tiles.tile_config(args.pop("kernel_name"), **args)
        with self.assertRaisesRegex(ValueError, "kernel must be one of"):
            abi.kernel("fwd_split")
        self.assertLen({abi.kernel(n) for n in tiles.KERNEL_NAMES}, 3)
        for bad, regex in ((dict(block_m=64, block_n=32), "block_m == block_n"),
                           (dict(block_m=48, block_n=48), "block_m"),
                           (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages")):
            cfg = {**dict(block_m=64, block_n=64, num_warps=4, num_stages=2), **bad}
            with self.subTest(**bad), self.assertRaisesRegex(ValueError, regex):
                TileConfig(**cfg)


class LaunchOptionsTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("work_order", dict(work_order="random"), "work_order"),
        ("head_group_zero", dict(head_group=0), "head_group"),
        ("head_group_bool", dict(head_group=True), "head_group"),
        ("head_group_str", dict(head_group="2"), "head_group"),
        ("kernel_tile_48", dict(kernel_tile=48), "kernel_tile"),
        ("kernel_tile_bool", dict(kernel_tile=True), "kernel_tile"),
        ("kernel_tile_name", dict(kernel_tile="big"), "kernel_tile"),
        ("tiles_name", dict(tiles={"fwd_split": TileConfig(64, 64, 4, 2)}), "tiles"),
        ("tiles_value", dict(tiles={"fwd": (64, 64, 4, 2)}), "tiles"),
        ("direct_launch", dict(direct_launch=1), "direct_launch"),
        ("parallel_compile", dict(parallel_compile="yes"), "parallel_compile"),
    )
    def test_invalid_values_are_refused(self, changes, regex):
        with self.assertRaisesRegex(ValueError, regex):
            options.LaunchOptions(**changes)
        with self.assertRaisesRegex(ValueError, regex):
            with options.launch_options(**changes):
                pass
        self.assertEqual(options.current(), options.LaunchOptions())

    def test_defaults_frozen_and_keyed(self):
        opts = options.current()
        self.assertEqual(opts, options.LaunchOptions())
        self.assertEqual((opts.work_order, opts.head_group, opts.kernel_tile, dict(opts.tiles),
                          opts.direct_launch, opts.parallel_compile),
                         ("auto", None, "auto", {}, True, True))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            opts.work_order = "natural"
        cfg = TileConfig(64, 64, 4, 2, sub=16)
        given = {"fwd": cfg}
        changed = options.LaunchOptions(tiles=given)
        given["bwd_dq"] = cfg  # the options keep their own copy ...
        self.assertEqual(set(changed.tiles), {"fwd"})
        with self.assertRaises(TypeError):  # ... which is read-only
            changed.tiles["bwd_dq"] = cfg
        hash(changed.key())
        keys = {options.LaunchOptions(**c).key() for c in (
            {}, {"work_order": "natural"}, {"head_group": 2}, {"kernel_tile": 64},
            {"tiles": {"fwd": cfg}}, {"direct_launch": False}, {"parallel_compile": False})}
        self.assertLen(keys, 7)  # every field changes the key
        self.assertEqual(options.LaunchOptions(tiles={"fwd": cfg}).key(), changed.key())

    def test_nesting_restores_on_exit_and_error(self):
        with options.launch_options(work_order="natural") as outer:
            self.assertIs(options.current(), outer)
            with options.launch_options(head_group=2) as inner:
                self.assertEqual((inner.work_order, inner.head_group), ("natural", 2))
            self.assertIs(options.current(), outer)
            with self.assertRaisesRegex(KeyError, "boom"):
                with options.launch_options(kernel_tile="layout"):
                    raise KeyError("boom")
            self.assertIs(options.current(), outer)
        self.assertEqual(options.current(), options.LaunchOptions())

    def test_options_are_process_wide(self):
        """Another thread (torch's autograd thread runs a CUDA backward) sees the options the
        caller set."""
        seen = []
        with options.launch_options(work_order="natural"):
            thread = threading.Thread(target=lambda: seen.append(options.current().work_order))
            thread.start()
            thread.join()
        self.assertEqual(seen, ["natural"])
        self.assertEqual(options.current().work_order, "auto")

    def test_using_given_options(self):
        """options.using(opts): exactly those options within the block (a backward runs with
        its forward's), restored after; anything else is refused."""
        saved = options.LaunchOptions(work_order="longest_first", head_group=2)
        with options.launch_options(kernel_tile=64):
            with options.using(saved) as opts:
                self.assertIs(opts, saved)
                self.assertIs(options.current(), saved)  # not merged with kernel_tile=64
            self.assertEqual(options.current().kernel_tile, 64)
        self.assertEqual(options.current(), options.LaunchOptions())
        with self.assertRaisesRegex(ValueError, "LaunchOptions"):
            with options.using({"work_order": "natural"}):
                pass


class KernelLayoutTest(absltest.TestCase):

    def test_kernel_layout_policy(self):
        """kernel_layout: the same token mask at the block the cost model picks; the
        interpreter and 'layout' keep the layout's block; hand-built layouts stay as they are;
        the result is cached per layout."""
        window = make_layout(P.local(511, 511), 4096, 2, 32)
        coarse = schedule.kernel_layout(window, "cuda")
        self.assertEqual(coarse.block_size, 64)  # the cheapest modelled cost (_TILE_MODEL)
        self.assertIs(schedule.kernel_layout(window, "cuda"), coarse)
        np.testing.assert_array_equal(coarse.dense_mask(), window.dense_mask())
        self.assertIs(schedule.kernel_layout(window, "interpreter"), window)
        with options.launch_options(kernel_tile="layout"):
            self.assertIs(schedule.kernel_layout(window, "cuda"), window)
        with options.launch_options(kernel_tile=128):
            self.assertEqual(schedule.kernel_layout(window, "interpreter").block_size, 128)
            self.assertEqual(schedule.kernel_layout(window, "cuda").block_size, 128)
            # The native CPU path runs no kernel tile: the layout itself, whatever the option.
            self.assertIs(schedule.kernel_layout(window, "cpu"), window)
        # Random 32-token blocks: a 128 tile would compute ~16x the listed elements.
        rand = make_layout(P.random_blocks(2, 32, seed=0), 4096, 2, 32)
        self.assertIs(schedule.kernel_layout(rand, "cuda"), rand)
        big = make_layout(P.causal(), 4096, 2, 128)
        self.assertIs(schedule.kernel_layout(big, "cuda"), big)
        # Smaller tiles than the layout's only in the measured regime (D=128 and 64,
        # bf16/fp16): the window's short rows run in 64-token tiles, causal's long rows
        # (N=65536) stay at 128.
        wide = make_layout(P.local(511, 511), 4096, 2, 128)
        for d in (128, 64):
            self.assertEqual(schedule.kernel_layout(wide, "cuda", head_dim=d, dtype="bfloat16")
                             .block_size, 64, d)
        self.assertIs(schedule.kernel_layout(wide, "cuda", head_dim=32, dtype="bfloat16"), wide)
        self.assertIs(schedule.kernel_layout(wide, "cuda", head_dim=128, dtype="float32"), wide)
        long_rows = make_layout(P.causal(), 65536, 2, 128)
        self.assertIs(schedule.kernel_layout(long_rows, "cuda", head_dim=128, dtype="float16"),
                      long_rows)
        # ... because the modelled gain of refining it (1.95 %) is below _REFINE's min_gain;
        # with no minimum the model alone would refine it. At N=8192 the gain (3.9 %) is enough.
        with mock.patch.dict(schedule._REFINE, min_gain=0.0):
            self.assertEqual(schedule.kernel_layout(make_layout(P.causal(), 65536, 2, 128),
                                                    "cuda", head_dim=128,
                                                    dtype="float16").block_size, 64)
        self.assertEqual(schedule.kernel_layout(make_layout(P.causal(), 8192, 2, 128), "cuda",
                                                head_dim=128, dtype="bfloat16").block_size, 64)
        literal = dataclasses.replace(window, pattern=None)
        self.assertIs(schedule.kernel_layout(literal, "cuda"), literal)
        with self.assertRaisesRegex(ValueError, "kernel_tile"):
            with options.launch_options(kernel_tile=48):
                pass
        with self.assertRaisesRegex(ValueError, "device_kind"):
            schedule.kernel_layout(window, "tpu")

    def test_modelled_cost_uses_the_public_block_kinds(self):
        """The cost model counts tiles from Pattern.block_kinds (no layout is built for the
        blocks it only considers)."""
        pattern = P.local(511, 511)
        kinds = np.asarray(pattern.block_kinds(0, 64, 4096))
        a, b = schedule._TILE_MODEL[64]
        tiles_64 = int(np.count_nonzero(kinds != EMPTY))
        self.assertAlmostEqual(schedule._modelled_ms(pattern, 4096, 2, 64),
                               a * 2 * 64 + b * 2 * tiles_64 * 64 * 64 / 1e6)


class AbiTest(absltest.TestCase):

    def test_aligned_decision(self):
        """ALIGNED only when N % 16 == 0, last strides are 1 and the others multiples of 16."""
        c4, c3 = abi.contiguous_strides((1, 2, 64, 32)), abi.contiguous_strides((1, 2, 64))
        self.assertEqual(c4, (4096, 2048, 32, 1))
        self.assertEqual(c3, (128, 64, 1))
        self.assertTrue(abi.aligned(64, {"q": c4, "lse": c3}))
        self.assertFalse(abi.aligned(72, {"q": abi.contiguous_strides((1, 2, 72, 32))}))
        self.assertTrue(abi.aligned(64, {"q": (4096, 32, 64, 1)}))  # [B, N, H, D] view
        self.assertFalse(abi.aligned(64, {"q": (5120, 2560, 40, 1)}))  # rows padded to 40
        self.assertFalse(abi.aligned(64, {"q": (4096, 2048, 1, 64)}))  # transposed: d-stride 64
        self.assertFalse(abi.aligned(64, {"q": c4, "lse": (136, 68, 1)}))

    def test_reexports_match_their_modules(self):
        """abi re-exports the tile module's constants and checks (one definition each)."""
        for name in ("SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES", "SUPPORTED_BLOCK_SIZES",
                     "DEVICE_KINDS", "KERNEL_NAMES", "check_head_dim", "check_dtype"):
            self.assertIs(getattr(abi, name), getattr(tiles, name), name)
        self.assertEqual(abi.check_dtype("torch.bfloat16"), "bfloat16")
        self.assertEqual(abi.stats_dtype("float64"), "float64")
        self.assertEqual(abi.stats_dtype("bfloat16"), "float32")
        self.assertTrue(abi.dot_upcast("bfloat16", "interpreter"))
        self.assertFalse(abi.dot_upcast("bfloat16", "cuda"))
        self.assertEqual(abi.mask_words(128), 4)
        self.assertEqual(abi.mask_words(16), 1)



class RealModelLaunchTest(parameterized.TestCase):
    """Launch descriptions of GQA/MQA, N_q != N_kv and head dims past 128 (shapes only)."""

    def test_gqa_and_kv_len_launches(self):
        """q [B, H, N, D] with k, v [B, H_kv, N_kv, D]: forward and dQ run a program per
        (query tile, b, query head), dK/dV one per (key tile, b, kv head), with outputs in k's
        shape; N, N_kv, H and the group size are runtime ints (no compile per group size),
        GROUPED (group > 1) is dK/dV's only new constexpr."""
        b, h, h_kv, n, n_kv, d = 2, 6, 2, 128, 320, 64
        lay = make_layout(P.causal(), n, h, 64, kv_len=n_kv)
        meta = lay.metadata()  # no head groups: every head interleaved
        q = np.zeros((b, h, n, d), np.float32)
        kv = np.zeros((b, h_kv, n_kv, d), np.float32)
        stats = q[..., 0]
        kw = dict(scale=0.125, dtype="float32", device_kind="cuda")
        fwd = abi.fwd_call(q, kv, kv, meta, **kw)
        dq = abi.bwd_dq_call(q, kv, kv, q, stats, q, None, meta, **kw)
        dkdv = abi.bwd_dkdv_call(q, kv, kv, q, stats, stats, meta, **kw)
        self.assertEqual(fwd.grid, (b * h, 2, 1))
        self.assertEqual(dq.grid, (b * h, 2, 1))
        self.assertEqual(dkdv.grid, (b * h_kv, 5, 1))
        self.assertEqual([o.shape for o in dkdv.outputs], [kv.shape, kv.shape])
        self.assertEqual(dq.outputs[0].shape, q.shape)
        self.assertTrue(dkdv.constexprs["GROUPED"])
        self.assertNotIn("GROUPED", fwd.constexprs)
        # (N, N_kv, H, GROUP) follow the two scale parts.
        for call, n_meta in ((fwd, 6), (dkdv, 6)):
            pos = 3 + (3 if call.name != "fwd" else 0) + n_meta + 2
            self.assertEqual(call.args[pos:pos + 4], (n, n_kv, h, h // h_kv), call.name)
        mha = abi.bwd_dkdv_call(q, q, q, q, stats, stats, make_layout(P.causal(), n, h, 64)
                                .metadata(), **kw)
        self.assertFalse(mha.constexprs["GROUPED"])
        with self.assertRaisesRegex(ValueError, "H_kv"):
            abi.check_attention_shapes(q.shape, (b, 4, n_kv, d), (b, 4, n_kv, d), lay, None)
        with self.assertRaisesRegex(ValueError, "kv_len"):
            abi.check_attention_shapes(q.shape, (b, 2, 64, d), (b, 2, 64, d), lay, None)

    @parameterized.parameters(16, 48, 80, 96, 128, 144, 192, 256)
    def test_head_dims_supported(self, d):
        """Every multiple of 16 up to 256; HEAD_DIM_PAD the next power of two; above 128 the
        CUDA tiles stay at block 64 and their pipelined operand stages fit an H100's 227 KB of
        shared memory (two [sub, 256] operands per stage), and schedule.kernel_layout runs a
        block-128 layout at block 64."""
        self.assertEqual(tiles.check_head_dim(d), d)
        self.assertEqual(abi.head_dim_padded(d), 1 << (d - 1).bit_length())
        lay = make_layout(P.causal(), 512, 2, 128)
        kernel_lay = schedule.kernel_layout(lay, "cuda", head_dim=d, dtype="bfloat16")
        if d > 128:
            self.assertEqual(kernel_lay.block_size, 64)
            for name in tiles.KERNEL_NAMES:
                for dtype, size in (("bfloat16", 2), ("float32", 4)):
                    cfg = tiles.tile_config(name, head_dim=d, dtype=dtype, block_size=64,
                                            device_kind="cuda")
                    stage_bytes = 2 * cfg.num_stages * cfg.sub * 256 * size
                    self.assertLessEqual(stage_bytes, 128 * 1024, (name, dtype, cfg))
            with self.assertRaisesRegex(ValueError, "head dim"):
                tiles.tile_config("fwd", head_dim=d, dtype="bfloat16", block_size=128,
                                  device_kind="cuda")
        # The interpreter runs any layout block at any head dim.
        self.assertIs(schedule.kernel_layout(lay, "interpreter", head_dim=d), lay)

    @parameterized.parameters(8, 24, 200, 272, 512)
    def test_head_dims_rejected(self, d):
        with self.assertRaisesRegex(ValueError, "head dim"):
            tiles.check_head_dim(d)

if __name__ == "__main__":
    absltest.main()
