"""Checkpoints: one safetensors file of canonical unsharded parameters, read by both frameworks.

* Core (:mod:`sparsetp.core.checkpoint`): bitwise round trips in float32/float16/float64 and
  bfloat16 (stored ``BF16``, returned as float32), configs as JSON for every example pattern,
  and bad input: missing, extra and mis-shaped tensors listed in ONE error, wrong dtypes, a
  config mismatch naming its fields, truncated/garbage/bit-flipped files, missing paths, and an
  interrupted save that leaves the old file intact.
* torch: save/load at TP 1 (float32 and bfloat16 blocks) and a failed load that leaves the
  block's parameters bitwise unchanged.
* Across frameworks and TP sizes: torch TP=2 (two gloo processes) saves; JAX loads it on a
  4-device mesh (bitwise the same parameters, the block's output equal to the float64 oracle
  and to torch's within the float32 tolerance); JAX saves updated parameters, which torch loads
  at TP=1 and TP=2 bitwise; and a torch -> JAX -> torch round trip is bitwise. The TP=2 run also
  checks that a file only one rank cannot read makes every rank raise with nothing loaded.
* GPTs (``GPTConfig`` in the header): a torch TP=2 GPT saves, JAX loads it on a 2-device mesh
  bitwise with the oracle's logits; JAX saves, a torch TP=1 GPT loads it bitwise; a GPT file
  loaded into a HybridBlock or a GPT of another config (torch and JAX) raises a ValueError
  naming the differing fields and tensors, nothing loaded.

Tolerances: ``testing_utils`` (float32 atol 2e-5, rtol atol/10); values are O(1) and every
reduction is <= 128 long. Bitwise means ``np.array_equal`` of the bits (``_assert_bitwise``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from unittest import mock

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax_test_utils as jtu  # noqa: E402
import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from testing_utils import assert_close, round_to_dtype  # noqa: E402

from sparsetp.backends.jax import checkpoint as jckpt  # noqa: E402
from sparsetp.backends.jax.block import export_params, hybrid_block  # noqa: E402
from sparsetp.backends.jax.model import gpt  # noqa: E402
from sparsetp.backends.torch import checkpoint as tckpt  # noqa: E402
from sparsetp.backends.torch.block import HybridBlock  # noqa: E402
from sparsetp.backends.torch.model import GPT  # noqa: E402
from sparsetp.core import (  # noqa: E402
    GPTConfig,
    HybridConfig,
    init_params,
    param_shapes,
    reference,
)
from sparsetp.core import checkpoint as C  # noqa: E402
from sparsetp.core import patterns as P  # noqa: E402
from sparsetp.core.examples import EXAMPLE_PATTERNS  # noqa: E402

try:  # pytest puts tests/ on sys.path (no package); a package layout reaches it as tests.*
    import dist_utils
except ImportError:  # pragma: no cover
    from tests import dist_utils


def _config(dtype="float32", **kw):
    # A local window that is not a multiple of the block: partial tiles; 4 heads so TP=4 works.
    kw = dict(dict(d_model=64, num_heads=4, d_ff=128, pattern=P.local(40, 0), block_size=32,
                   dtype=dtype), **kw)
    return HybridConfig(**kw)


def _params(cfg, seed=0):
    """init_params rounded to values ``cfg.dtype`` holds exactly (float32 arrays; float16 and
    float64 configs get arrays of their own dtype)."""
    p = {n: round_to_dtype(a, cfg.dtype) for n, a in init_params(cfg, seed).items()}
    if cfg.dtype in ("float16", "float64"):
        p = {n: a.astype(cfg.dtype) for n, a in p.items()}
    return p


def _x(seed=5, n=64):
    return np.random.default_rng(seed).standard_normal((2, n, 64)).astype(np.float32)


def _assert_bitwise(test, got, want, what=""):
    test.assertEqual(sorted(got), sorted(want), f"{what}: names")  # (order: its own test)
    for n in want:
        a, b = np.asarray(got[n]), np.asarray(want[n])
        test.assertEqual((a.dtype, a.shape), (b.dtype, b.shape), f"{what}: {n}")
        u = np.dtype(f"u{a.dtype.itemsize}")
        test.assertTrue(np.array_equal(a.view(u), b.view(u)), f"{what}: {n} differs")


class CoreCheckpointTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.dir = _tempdir(self)
        self.path = os.path.join(self.dir, "block.safetensors")

    @parameterized.parameters("float32", "float16", "float64")
    def test_round_trip_bitwise(self, dtype):
        cfg = _config(dtype)
        params = _params(cfg)
        C.save_checkpoint(self.path, params, config=cfg)
        _assert_bitwise(self, C.load_checkpoint(self.path, config=cfg, dtype=dtype), params)
        info = C.checkpoint_info(self.path)
        self.assertEqual(info.config, cfg)
        self.assertEqual({d for d, _ in info.tensors.values()}, {dtype})
        self.assertEqual(os.listdir(self.dir), ["block.safetensors"])  # no temp file left

    def test_bfloat16_stored_as_bf16_returned_as_float32(self):
        cfg = _config("bfloat16")
        params = _params(cfg)  # float32 arrays holding bfloat16 values (a torch export)
        C.save_checkpoint(self.path, params, config=cfg, dtype="bfloat16")
        with safetensors.safe_open(self.path, framework="np") as f:
            self.assertEqual({f.get_slice(n).get_dtype() for n in f.keys()}, {"BF16"})
        _assert_bitwise(self, C.load_checkpoint(self.path, config=cfg, dtype="bfloat16"), params)
        # ml_dtypes bfloat16 arrays (np.asarray of JAX bfloat16) give the same bytes.
        other = os.path.join(self.dir, "jax.safetensors")
        C.save_checkpoint(other, {n: np.asarray(jnp.asarray(a, jnp.bfloat16))
                                  for n, a in params.items()}, config=cfg)
        # (Not the same file bytes: safetensors writes the metadata map in hash order.)
        metas = []
        for path in (self.path, other):
            with safetensors.safe_open(path, framework="np") as f:
                metas.append(f.metadata())
        self.assertEqual(metas[0], metas[1])  # same config and same sha256 of every tensor
        # torch reads the file natively as bfloat16, the same values.
        loaded = safetensors.torch.load_file(other)
        self.assertEqual(loaded["ln1.weight"].dtype, torch.bfloat16)
        np.testing.assert_array_equal(loaded["attn.qkv.weight"].float().numpy(),
                                      params["attn.qkv.weight"])

    def test_save_never_rounds(self):
        cfg = _config("bfloat16")
        params = init_params(cfg, 0)  # float32 values with bits below bfloat16's
        with self.assertRaisesRegex(ValueError, r"attn\.qkv\.weight: float32 values not exactly "
                                                r"representable in bfloat16"):
            C.save_checkpoint(self.path, params, config=cfg, dtype="bfloat16")
        self.assertEqual(os.listdir(self.dir), [])

    @parameterized.parameters(*sorted(EXAMPLE_PATTERNS))
    def test_config_json_round_trip(self, name):
        for kw in ({}, {"num_kv_heads": 2, "bias": False, "norm_eps": 1e-6}):
            cfg = _config(pattern=EXAMPLE_PATTERNS[name](256, 32), **kw)
            text = C.config_to_json(cfg)
            self.assertEqual(C.config_from_json(text), cfg)
            self.assertEqual(C.config_to_json(C.config_from_json(text)), text)

    def test_metadata_and_order(self):
        cfg = _config()
        params = dict(reversed(list(_params(cfg).items())))
        C.save_checkpoint(self.path, params, config=cfg, metadata={"step": "100"})
        info = C.checkpoint_info(self.path)
        self.assertEqual(info.metadata, {"step": "100"})
        self.assertEqual(info.format, C.FORMAT_VERSION)
        self.assertEqual(list(info.tensors), list(params))
        self.assertEqual(list(C.load_checkpoint(self.path)), list(params))       # saved order
        self.assertEqual(list(C.load_checkpoint(self.path, config=cfg)), list(param_shapes(cfg)))
        with self.assertRaisesRegex(ValueError, "metadata key 'sparsetp.config' is reserved"):
            C.save_checkpoint(self.path, params, metadata={"sparsetp.config": "{}"})
        with self.assertRaisesRegex(ValueError, "metadata must map str to str"):
            C.save_checkpoint(self.path, params, metadata={"step": 100})

    def test_missing_extra_misshaped_in_one_message(self):
        cfg = _config()
        params = _params(cfg)
        del params["ln1.bias"], params["attn.out.weight"]
        params["mlp.fc1.weight"] = params["mlp.fc1.weight"].T.copy()
        params["extra.weight"] = np.ones(3, np.float32)
        C.save_checkpoint(self.path, params, config=cfg)
        with self.assertRaises(ValueError) as cm:
            C.load_checkpoint(self.path, config=cfg)
        msg = str(cm.exception)
        for part in (self.path, "missing tensors: ln1.bias, attn.out.weight",
                     "unexpected tensors: extra.weight",
                     "mis-shaped tensors: mlp.fc1.weight (128, 64) (expected (64, 128))"):
            self.assertIn(part, msg)

    def test_wrong_dtypes(self):
        cfg = _config()
        params = _params(cfg)
        bad = dict(params, **{"ln1.bias": np.arange(64, dtype=np.int32)})
        with self.assertRaisesRegex(ValueError, r"ln1\.bias: dtype int32 is not one of"):
            C.save_checkpoint(self.path, bad)
        safetensors.numpy.save_file(bad, self.path)  # another writer: ints are possible
        with self.assertRaisesRegex(ValueError, r"non-floating tensors .*: ln1\.bias I32"):
            C.load_checkpoint(self.path, param_shapes(cfg))
        C.save_checkpoint(self.path, dict(params, **{"ln2.weight": params["ln2.weight"].astype(
            np.float16)}), config=cfg)
        with self.assertRaisesRegex(ValueError, r"not stored as float32 \(F32\): ln2\.weight F16"):
            C.load_checkpoint(self.path, config=cfg, dtype="float32")

    def test_config_mismatch_names_fields(self):
        cfg = _config()
        C.save_checkpoint(self.path, _params(cfg), config=cfg)
        other = dataclasses.replace(cfg, pattern=P.causal(), norm_eps=1e-6)
        with self.assertRaises(ValueError) as cm:
            C.load_checkpoint(self.path, config=other)
        msg = str(cm.exception)
        self.assertIn("config differs: norm_eps: file 1e-05, expected 1e-06; pattern: file "
                      "Local(left=40, right=0), expected Causal(left=None, right=0)", msg)
        self.assertNotIn("d_model", msg)
        C.save_checkpoint(self.path, _params(cfg))  # no config recorded
        with self.assertRaisesRegex(ValueError, "records no config"):
            C.load_checkpoint(self.path, config=cfg)
        _assert_bitwise(self, C.load_checkpoint(self.path, param_shapes(cfg)), _params(cfg))

    def test_corrupt_files(self):
        cfg = _config()
        C.save_checkpoint(self.path, _params(cfg), config=cfg)
        with open(self.path, "rb") as f:
            good = f.read()
        cases = {
            "truncated": good[:-10],
            "header only": good[:200],
            "empty": b"",
            "garbage": b"\x00" * 8 + b"not a checkpoint" * 10,
        }
        for what, data in cases.items():
            with self.subTest(what):
                with open(self.path, "wb") as f:
                    f.write(data)
                with self.assertRaisesRegex(ValueError, "is not a valid safetensors file"):
                    C.load_checkpoint(self.path, config=cfg)
        # One flipped bit in the data: structurally valid, caught by the checksum.
        flipped = bytearray(good)
        flipped[-3] ^= 0x01
        with open(self.path, "wb") as f:
            f.write(flipped)
        with self.assertRaisesRegex(ValueError, r"is corrupt: the bytes of \S+ do not match"):
            C.load_checkpoint(self.path, config=cfg)

    def test_paths(self):
        cfg = _config()
        missing = os.path.join(self.dir, "nope.safetensors")
        with self.assertRaisesRegex(FileNotFoundError, f"checkpoint '{missing}' does not exist"):
            C.load_checkpoint(missing, config=cfg)
        with self.assertRaisesRegex(ValueError, "is a directory"):
            C.load_checkpoint(self.dir)
        with self.assertRaisesRegex(FileNotFoundError, "directory .* does not exist"):
            C.save_checkpoint(os.path.join(self.dir, "no", "x.safetensors"), _params(cfg))
        with self.assertRaisesRegex(ValueError, "path must be a str or os.PathLike"):
            C.load_checkpoint(3)
        with self.assertRaisesRegex(ValueError, "params must be a non-empty dict"):
            C.save_checkpoint(self.path, {})
        with self.assertRaisesRegex(ValueError, "shapes must map names to shape tuples"):
            C.load_checkpoint(self.path, {"ln1.weight": 64})

    def test_interrupted_save_keeps_the_old_file(self):
        cfg = _config()
        C.save_checkpoint(self.path, _params(cfg, 0), config=cfg)
        with open(self.path, "rb") as f:
            before = f.read()

        def crash(specs, filename, metadata=None):
            with open(filename, "wb") as f:
                f.write(b"half a file")
            raise OSError("disk full")

        with mock.patch.object(safetensors, "serialize_file", crash):
            with self.assertRaisesRegex(OSError, "disk full"):
                C.save_checkpoint(self.path, _params(cfg, 1), config=cfg)
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), before)
        self.assertEqual(os.listdir(self.dir), ["block.safetensors"])


def _tempdir(test) -> str:
    # absltest's create_tempdir needs absl flags parsed, which pytest does not do.
    path = tempfile.mkdtemp(prefix="sparsetp-ckpt-")
    test.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path


def _state(block):
    return {n: p.detach().clone() for n, p in block.named_parameters()}


class TorchCheckpointTest(parameterized.TestCase):

    @parameterized.parameters("float32", "bfloat16")
    def test_round_trip_tp1(self, dtype):
        cfg = _config(dtype)
        path = os.path.join(_tempdir(self), "b.safetensors")
        block = HybridBlock.from_params(cfg, _params(cfg))
        tckpt.save(block, path, metadata={"step": "7"})
        want = "BF16" if dtype == "bfloat16" else "F32"
        with safetensors.safe_open(path, framework="np") as f:
            self.assertEqual({f.get_slice(n).get_dtype() for n in f.keys()}, {want})
        fresh = HybridBlock(cfg, seed=None)
        tckpt.load(fresh, path)
        _assert_bitwise(self, fresh.export_params(), block.export_params(), "torch tp1")

    def test_failed_load_leaves_parameters_unchanged(self):
        cfg = _config()
        tmp = _tempdir(self)
        block = HybridBlock(cfg, seed=1)
        before = _state(block)
        params = _params(cfg, 2)
        files = {}
        files["missing"] = {n: a for n, a in params.items() if n != "mlp.fc2.bias"}
        files["extra"] = dict(params, **{"head.weight": np.ones((2, 2), np.float32)})
        files["misshaped"] = dict(params, **{"ln2.bias": np.ones(63, np.float32)})
        for name, p in files.items():
            C.save_checkpoint(os.path.join(tmp, name), p, config=cfg)
        safetensors.numpy.save_file(dict(params, **{"ln1.weight": np.ones(64, np.int64)}),
                                    os.path.join(tmp, "int"))
        C.save_checkpoint(os.path.join(tmp, "other_config"), params,
                          config=dataclasses.replace(cfg, block_size=64))
        with open(os.path.join(tmp, "truncated"), "wb") as f:
            C.save_checkpoint(os.path.join(tmp, "good"), params, config=cfg)
            f.write(open(os.path.join(tmp, "good"), "rb").read()[:-4])
        expect = {"missing": "missing tensors: mlp.fc2.bias", "extra": "unexpected tensors: "
                  "head.weight", "misshaped": r"ln2\.bias \(63,\) \(expected \(64,\)\)",
                  "int": r"non-floating tensors .*: ln1\.weight I64",
                  "other_config": "block_size: file 64",
                  "truncated": "not a valid safetensors file"}
        for name, pattern in expect.items():
            with self.subTest(name):
                with self.assertRaisesRegex(ValueError, pattern):
                    tckpt.load(block, os.path.join(tmp, name))
                for n, p in block.named_parameters():
                    self.assertTrue(torch.equal(p, before[n]), f"{name}: {n} changed")
        with self.assertRaises(FileNotFoundError):
            tckpt.load(block, os.path.join(tmp, "nope"))
        with self.assertRaisesRegex(ValueError, "module must be a sparsetp torch module"):
            tckpt.save(torch.nn.Linear(2, 2), os.path.join(tmp, "x"))
        # The good file does load (the failures above were the files', not the block's).
        tckpt.load(block, os.path.join(tmp, "good"))
        _assert_bitwise(self, block.export_params(), params)


# ---------------------------------------------------------------------------------------------
# Rank functions (module level: pickled by name into the spawned processes).


def _torch_save_rank(rank, world, path):
    cfg = _config()
    block = HybridBlock(cfg, seed=3)
    y = block(torch.from_numpy(_x())).detach().cpu().numpy()
    tckpt.save(block, path)
    return block.export_params(), y


def _torch_load_rank(rank, world, paths, bad):
    cfg = _config()
    out = {}
    for name, path in paths.items():
        block = HybridBlock(cfg, seed=None)  # NaN until loaded: a no-op load would show
        tckpt.load(block, path)
        out[name] = (block.export_params(), block(torch.from_numpy(_x())).detach().numpy())
    # A file only rank 1 cannot read: every rank raises, no rank loads anything.
    block = HybridBlock(cfg, seed=4)
    before = _state(block)
    try:
        tckpt.load(block, bad if rank == 1 else paths["jax"])
    except (RuntimeError, FileNotFoundError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in block.named_parameters())
    return out


# GPTs (the cross-framework GPT round trip below, the mismatch checks after it)
def _gpt_config(**kw):
    blk = HybridConfig(d_model=32, num_heads=2, d_ff=64, block_size=32,
                       pattern=P.causal() & P.local(40, 0))
    return GPTConfig(**dict(dict(vocab_size=24, num_layers=2, max_seq_len=64, block=blk), **kw))


def _tokens():
    return np.random.default_rng(9).integers(0, 24, (2, 64)).astype(np.int64)


def _torch_gpt_save_rank(rank, world, path):
    model = GPT(_gpt_config(), seed=3)  # the default group: TP=2
    logits = model(torch.from_numpy(_tokens())).detach().numpy()
    tckpt.save(model, path, metadata={"step": "5"})
    return model.export_params(), logits


class CrossFrameworkTest(absltest.TestCase):
    """torch TP=2 saves (a block; a GPT), the other framework loads, and back."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # Both torch TP=2 saves on one launch of the 2 gloo ranks (dist_utils.SharedLaunches:
        # each spawn costs ~5 s on 2 cores), each into its own file of this class's directory.
        cls.dir = tempfile.mkdtemp(prefix="sparsetp-ckpt-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, ignore_errors=True)
        cls.saved = {n: os.path.join(cls.dir, f"{n}.safetensors") for n in ("block", "gpt")}
        cls.launches = dist_utils.SharedLaunches()
        cls.launches.add("block", 2, _torch_save_rank, cls.saved["block"], timeout=240,
                         backend="gloo")
        cls.launches.add("gpt", 2, _torch_gpt_save_rank, cls.saved["gpt"], timeout=60,
                         backend="gloo")

    def test_torch_tp2_to_jax_tp4_and_back(self):
        cfg = _config()
        tmp = _tempdir(self)
        path_torch = self.saved["block"]
        path_jax, path_again = (os.path.join(tmp, f"{n}.safetensors") for n in ("jax", "again"))
        results = self.launches.result("block")
        torch_params, torch_y = results[0]
        _assert_bitwise(self, results[1][0], torch_params, "torch ranks agree")

        # torch TP=2 -> JAX TP=4: the same parameters bitwise, the same block.
        mesh = jtu.mesh(4)
        params = jckpt.load(path_torch, cfg, mesh=mesh)
        self.assertEqual(len(params["mlp.fc1.weight"].sharding.device_set), 4)
        self.assertEqual(params["mlp.fc1.weight"].addressable_shards[0].data.shape, (64, 32))
        _assert_bitwise(self, export_params(params), torch_params, "torch -> jax")
        x = _x()
        y = np.asarray(hybrid_block(params, x, cfg, mesh=mesh))
        oracle = reference.hybrid_block(
            {n: a.astype(np.float64) for n, a in torch_params.items()}, x.astype(np.float64), cfg)
        assert_close(y, oracle, "float32", what="jax tp4 vs oracle")
        assert_close(y, torch_y, "float32", what="jax tp4 vs torch tp2")

        # JAX TP=4 -> torch: new values (so torch cannot pass by keeping its old ones), saved
        # from the sharded arrays; and the loaded ones unchanged (torch -> JAX -> torch).
        updated = jax.tree.map(lambda a: a * 0.75 + 0.01, params)  # values stay O(1)
        self.assertEqual(len(updated["attn.qkv.weight"].sharding.device_set), 4)
        jckpt.save(updated, path_jax, cfg)
        jckpt.save(params, path_again, cfg)
        updated_np = export_params(updated)
        y_updated = np.asarray(hybrid_block(updated, x, cfg, mesh=mesh))

        block = HybridBlock(cfg, seed=None)  # TP=1, this process
        tckpt.load(block, path_jax)
        _assert_bitwise(self, block.export_params(), updated_np, "jax -> torch tp1")

        bad = os.path.join(tmp, "only-rank0-can-read.safetensors")
        out = dist_utils.run_distributed(
            _torch_load_rank, 2, {"jax": path_jax, "again": path_again}, bad, timeout=240,
            backend="gloo")
        for rank, res in enumerate(out):
            _assert_bitwise(self, res["jax"][0], updated_np, f"jax -> torch tp2 rank {rank}")
            assert_close(res["jax"][1], y_updated, "float32", what=f"torch tp2 rank {rank}")
            _assert_bitwise(self, res["again"][0], torch_params,
                            f"torch -> jax -> torch rank {rank}")
            self.assertTrue(res["unchanged"], f"rank {rank} loaded half-way")
        self.assertRegex(out[1]["error"], "FileNotFoundError: checkpoint .* does not exist")
        self.assertRegex(out[0]["error"], "RuntimeError: rank 1 of the tensor-parallel group "
                                          "failed to read checkpoint")

    def test_jax_unsharded_and_bad_input(self):
        cfg = _config()
        tmp = _tempdir(self)
        path = os.path.join(tmp, "b.safetensors")
        params = _params(cfg)
        jckpt.save(params, path, cfg)
        _assert_bitwise(self, export_params(jckpt.load(path, cfg)), params, "jax unsharded")
        with self.assertRaisesRegex(ValueError, r"config differs: d_ff: file 128, expected 256"):
            jckpt.load(path, dataclasses.replace(cfg, d_ff=256), mesh=jtu.mesh(2))
        with self.assertRaisesRegex(ValueError, "missing"):
            jckpt.save({n: a for n, a in params.items() if n != "ln1.weight"}, path, cfg)

    def test_gpt_torch_tp2_to_jax_tp2_and_back_to_torch(self):
        """GPTs (GPTConfig in the header): torch TP=2 -> JAX TP=2 -> torch TP=1."""
        cfg = _gpt_config()
        tmp = _tempdir(self)
        path, path_jax = self.saved["gpt"], os.path.join(tmp, "jax.safetensors")
        results = self.launches.result("gpt")
        torch_params, torch_logits = results[0]
        _assert_bitwise(self, results[1][0], torch_params, "torch ranks agree")
        info = C.checkpoint_info(path)
        self.assertEqual(info.config, cfg)
        self.assertEqual(info.metadata, {"step": "5"})
        self.assertEqual(list(info.tensors)[:3], ["embed.weight", "pos.weight",
                                                  "blocks.0.ln1.weight"])

        # torch TP=2 -> JAX TP=2 (host devices): bitwise, and the oracle's logits.
        mesh = jtu.mesh(2)
        params = jckpt.load(path, cfg, mesh=mesh)
        self.assertEqual(len(params["blocks.1.mlp.fc1.weight"].sharding.device_set), 2)
        self.assertEqual(params["blocks.1.mlp.fc1.weight"].addressable_shards[0].data.shape,
                         (32, 32))
        _assert_bitwise(self, export_params(params), torch_params, "torch -> jax")
        tokens = _tokens()
        logits = np.asarray(gpt(params, tokens, cfg, mesh=mesh))
        oracle = reference.gpt_forward(torch_params, tokens, cfg)
        assert_close(logits, oracle, "float32", what="jax tp2 logits vs oracle")
        assert_close(torch_logits, oracle, "float32", what="torch tp2 logits vs oracle")

        # JAX -> torch TP=1: new values saved from the sharded arrays, loaded bitwise.
        updated = jax.tree.map(lambda a: a * 0.75 + 0.01, params)
        jckpt.save(updated, path_jax, cfg)
        model = GPT(cfg, seed=None)  # NaN until loaded
        tckpt.load(model, path_jax)
        _assert_bitwise(self, model.export_params(), export_params(updated), "jax -> torch")
        _assert_bitwise(self, export_params(jckpt.load(path_jax, cfg)), export_params(updated),
                        "jax unsharded")


# ---------------------------------------------------------------------------------------------
# GPT checkpoints


class GPTCheckpointTest(absltest.TestCase):

    def test_mismatches_name_fields_and_tensors_and_load_nothing(self):
        cfg = _gpt_config()
        tmp = _tempdir(self)
        path = os.path.join(tmp, "gpt.safetensors")
        tckpt.save(GPT(cfg, seed=1), path)

        block = HybridBlock(cfg.block, seed=2)
        before = _state(block)
        with self.assertRaisesRegex(
                ValueError, r"type: file 'GPTConfig', expected 'HybridConfig'.*missing tensors: "
                            r"ln1\.weight.*unexpected tensors: blocks\.0\.attn\.out\.bias"):
            tckpt.load(block, path)
        self.assertTrue(all(torch.equal(p, before[n]) for n, p in block.named_parameters()))

        other = {"vocab": (_gpt_config(vocab_size=30),
                           r"config differs: vocab_size: file 24, expected 30.*mis-shaped "
                           r"tensors: embed\.weight \(24, 32\) \(expected \(30, 32\)\), "
                           r"head\.weight"),
                 "layers": (_gpt_config(num_layers=1),
                            r"num_layers: file 2, expected 1.*unexpected tensors: "
                            r"blocks\.1\.attn\.out\.bias"),
                 "block": (_gpt_config(block=dataclasses.replace(cfg.block, d_ff=128)),
                           r"config differs: block\.d_ff: file 64, expected 128; mis-shaped "
                           r"tensors: blocks\.0\.mlp\.fc1\.weight")}
        for name, (ocfg, pattern) in other.items():
            with self.subTest(name):
                model = GPT(ocfg, seed=2)
                before = _state(model)
                with self.assertRaisesRegex(ValueError, pattern):
                    tckpt.load(model, path)
                self.assertTrue(all(torch.equal(p, before[n])
                                    for n, p in model.named_parameters()), f"{name}: loaded")
                with self.assertRaisesRegex(ValueError, pattern):
                    jckpt.load(path, ocfg, mesh=jtu.mesh(2))
        with self.assertRaisesRegex(ValueError, r"type: file 'GPTConfig', expected "
                                                r"'HybridConfig'"):
            jckpt.load(path, cfg.block)
        with self.assertRaisesRegex(ValueError, "missing"):
            jckpt.save({"embed.weight": np.zeros((24, 32), np.float32)}, path, cfg)
        # The file itself was fine all along.
        model = GPT(cfg, seed=None)
        tckpt.load(model, path)
        _assert_bitwise(self, model.export_params(), GPT(cfg, seed=1).export_params())


if __name__ == "__main__":
    absltest.main()
