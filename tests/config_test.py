"""HybridConfig validation, canonical parameters, and the one TP partition description."""

import numpy as np
from absl.testing import absltest, parameterized

from sparsetp.core import (
    PARAM_NAMES,
    HybridConfig,
    check_tp_size,
    init_params,
    param_shapes,
    partition_dim,
    shard_param,
    shard_params,
    unshard_param,
)
from sparsetp.core import patterns as P

CFG = HybridConfig(d_model=64, num_heads=4, d_ff=256, pattern=P.causal(), block_size=32)


class ConfigTest(parameterized.TestCase):
    def test_head_dim_and_frozen(self):
        self.assertEqual(CFG.head_dim, 16)
        with self.assertRaises(AttributeError):
            CFG.d_model = 8

    @parameterized.named_parameters(
        ("d_model", dict(d_model=0), "d_model"),
        ("d_model_type", dict(d_model=64.0), "d_model"),
        ("num_heads", dict(num_heads=-1), "num_heads"),
        ("divisible", dict(num_heads=5), "num_heads=5"),
        ("d_ff", dict(d_ff=True), "d_ff"),
        ("pattern", dict(pattern="causal"), "pattern"),
        ("block_size", dict(block_size=48), "block_size"),
        ("norm_eps", dict(norm_eps=0.0), "norm_eps"),
        ("bias", dict(bias=1), "bias"),
        ("dtype", dict(dtype="float8"), "dtype"),
        ("num_kv_heads", dict(num_kv_heads=0), "num_kv_heads"),
        ("num_kv_heads_divides", dict(num_kv_heads=3), "num_kv_heads=3"),
    )
    def test_validation_names_field(self, change, regex):
        kw = dict(d_model=64, num_heads=4, d_ff=256, pattern=P.causal(), block_size=32)
        kw.update(change)
        with self.assertRaisesRegex(ValueError, regex):
            HybridConfig(**kw)


class ParamsTest(parameterized.TestCase):
    def test_shapes_and_dtype(self):
        params = init_params(CFG, 0)
        self.assertEqual(list(params), list(PARAM_NAMES))
        for name, shape in param_shapes(CFG).items():
            self.assertEqual(params[name].shape, shape, name)
            self.assertEqual(params[name].dtype, np.float32, name)

    def test_deterministic_and_nontrivial(self):
        a, b, c = init_params(CFG, 3), init_params(CFG, 3), init_params(CFG, 4)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
            self.assertFalse(np.array_equal(a[name], c[name]), name)
            self.assertGreater(np.abs(a[name]).min(initial=1.0) + np.abs(a[name]).max(), 0)
        self.assertGreater(np.abs(a["ln1.weight"] - 1).max(), 0.01)
        self.assertGreater(np.abs(a["mlp.fc2.bias"]).max(), 0.01)

    def test_no_bias(self):
        cfg = HybridConfig(64, 4, 256, P.causal(), block_size=32, bias=False)
        names = set(init_params(cfg, 0))
        self.assertEqual(names, set(PARAM_NAMES) - {"attn.qkv.bias", "attn.out.bias",
                                                    "mlp.fc1.bias", "mlp.fc2.bias"})

    @parameterized.parameters(1, 2, 4)
    def test_shard_unshard_round_trip(self, world):
        params = init_params(CFG, 0)
        shards = [shard_params(params, CFG, r, world) for r in range(world)]
        for name, full in params.items():
            np.testing.assert_array_equal(unshard_param(name, [s[name] for s in shards]), full)

    def test_qkv_shard_holds_whole_heads(self):
        params = init_params(CFG, 0)
        w = params["attn.qkv.weight"]
        hd = CFG.head_dim
        shard = shard_param("attn.qkv.weight", w, CFG, rank=1, world_size=2)
        # rank 1 of 2 holds heads 2 and 3: their q, k, v columns, in order.
        for local_h, h in enumerate((2, 3)):
            for t in range(3):
                np.testing.assert_array_equal(
                    shard[:, local_h * 3 * hd + t * hd: local_h * 3 * hd + (t + 1) * hd],
                    w[:, h * 3 * hd + t * hd: h * 3 * hd + (t + 1) * hd])
        out = shard_param("attn.out.weight", params["attn.out.weight"], CFG, 1, 2)
        np.testing.assert_array_equal(out, params["attn.out.weight"][2 * hd: 4 * hd])

    def test_gqa_qkv_shapes_and_shards_hold_whole_groups(self):
        """num_kv_heads=2 of 8 query heads: qkv is [d, d + 2 * 2 * hd], group-major (per kv head
        its 4 query heads, its key, its value), and a TP-2 shard holds one whole group."""
        cfg = HybridConfig(64, 8, 128, P.causal(), block_size=32, num_kv_heads=2)
        hd = cfg.head_dim
        self.assertEqual((cfg.kv_group, cfg.kv_dim), (4, 2 * hd))
        self.assertEqual(param_shapes(cfg)["attn.qkv.weight"], (64, 64 + 4 * hd))
        w = init_params(cfg, 0)["attn.qkv.weight"]
        shard = shard_param("attn.qkv.weight", w, cfg, rank=1, world_size=2)
        np.testing.assert_array_equal(shard, w[:, 6 * hd:])  # group 1: 4 q, 1 k, 1 v heads
        with self.assertRaisesRegex(ValueError, "num_kv_heads=2 is not divisible"):
            check_tp_size(cfg, 4)
        check_tp_size(cfg, 2)
        mha = HybridConfig(64, 4, 128, P.causal(), block_size=32)
        self.assertEqual((mha.num_kv_heads, mha.kv_group), (4, 1))
        self.assertEqual(param_shapes(mha)["attn.qkv.weight"], (64, 192))

    def test_partition_dims(self):
        self.assertEqual({n: partition_dim(n) for n in PARAM_NAMES}, {
            "ln1.weight": None, "ln1.bias": None, "attn.qkv.weight": 1, "attn.qkv.bias": 0,
            "attn.out.weight": 0, "attn.out.bias": None, "ln2.weight": None, "ln2.bias": None,
            "mlp.fc1.weight": 1, "mlp.fc1.bias": 0, "mlp.fc2.weight": 0, "mlp.fc2.bias": None})

    def test_bad_tp(self):
        params = init_params(CFG, 0)
        with self.assertRaisesRegex(ValueError, "num_heads=4 is not divisible"):
            check_tp_size(CFG, 3)
        cfg = HybridConfig(64, 4, 250, P.causal(), block_size=32)
        with self.assertRaisesRegex(ValueError, "d_ff=250 is not divisible"):
            check_tp_size(cfg, 4)
        with self.assertRaisesRegex(ValueError, "rank must be"):
            shard_param("ln1.weight", params["ln1.weight"], CFG, 2, 2)
        with self.assertRaisesRegex(ValueError, "must have shape"):
            shard_param("ln1.weight", params["ln2.weight"][:3], CFG, 0, 2)
        with self.assertRaisesRegex(ValueError, "unknown parameter name"):
            partition_dim("attn.qkv")
        with self.assertRaisesRegex(ValueError, "missing"):
            shard_params({"ln1.weight": params["ln1.weight"]}, CFG, 0, 1)


if __name__ == "__main__":
    absltest.main()
