"""The GPT of hybrid blocks: spec layer, float64 oracle, torch and JAX against the oracle, and
the two frameworks' Adam training curves against each other."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import jax  # noqa: E402
import jax_test_utils  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402
from testing_utils import assert_close  # noqa: E402

from sparsetp.core import (  # noqa: E402
    GPTConfig,
    HybridConfig,
    RecallTask,
    gpt_param_shapes,
    init_gpt_params,
    init_params,
    join_block_params,
    reference,
    split_block_params,
)
from sparsetp.core import patterns as P  # noqa: E402
from sparsetp.core.model import block_seed, gpt_forward_flops  # noqa: E402
from sparsetp.jax import (  # noqa: E402
    gpt,
    load_gpt_params,
    make_2d_mesh,
    shard_batch,
    shard_gpt_params,
)
from sparsetp.jax import gpt_loss as jax_loss  # noqa: E402
from sparsetp.torch import GPT  # noqa: E402
from sparsetp.torch import gpt_loss as torch_loss  # noqa: E402

# Small but real: 2 layers, 2 heads of 16 (the kernels' smallest head dim; TP 2 splits them),
# a window plus global tokens, N = 96 (three 32-token tiles: the last query tile sees the
# window, the diagonal and the globals).
BLOCK = HybridConfig(d_model=32, num_heads=2, d_ff=64, block_size=32,
                     pattern=P.causal() & (P.local(40, 0) | P.global_tokens(8)))
CFG = GPTConfig(vocab_size=24, num_layers=2, max_seq_len=128, block=BLOCK)
TASK = RecallTask(seq_len=96, num_values=16, num_slots=8, num_queries=8)


def _batch(step=0, batch_size=2):
    return TASK.batch(seed=5, step=step, batch_size=batch_size)


class SpecTest(parameterized.TestCase):
    def test_names_shapes_and_order(self):
        shapes = gpt_param_shapes(CFG)
        names = list(shapes)
        self.assertEqual(names[:2], ["embed.weight", "pos.weight"])
        self.assertEqual(names[-3:], ["ln_f.weight", "ln_f.bias", "head.weight"])
        self.assertEqual(shapes["head.weight"], (32, 24))
        self.assertEqual(shapes["pos.weight"], (128, 32))
        self.assertEqual(shapes["blocks.1.attn.qkv.weight"], (32, 96))
        self.assertLen(names, 5 + 2 * 12)

    def test_init_is_deterministic_and_reuses_block_init(self):
        a, b = init_gpt_params(CFG, seed=3), init_gpt_params(CFG, seed=3)
        self.assertEqual(list(a), list(gpt_param_shapes(CFG)))
        for n in a:
            np.testing.assert_array_equal(a[n], b[n])
            self.assertEqual(a[n].dtype, np.float32)
        _, blocks = split_block_params(a, CFG)
        for i, bp in enumerate(blocks):
            ref = init_params(BLOCK, block_seed(3, i))
            for n in ref:
                np.testing.assert_array_equal(bp[n], ref[n])
        self.assertFalse(np.array_equal(blocks[0]["attn.qkv.weight"],
                                        blocks[1]["attn.qkv.weight"]))
        self.assertNotEqual(block_seed(0, 1), block_seed(1, 0))
        c = init_gpt_params(CFG, seed=4)
        self.assertFalse(np.array_equal(a["embed.weight"], c["embed.weight"]))

    def test_split_join_round_trip(self):
        p = init_gpt_params(CFG, seed=0)
        outer, blocks = split_block_params(p, CFG)
        joined = join_block_params(outer, blocks)
        self.assertEqual(list(joined), list(p))
        self.assertTrue(all(joined[n] is p[n] for n in p))

    @parameterized.named_parameters(
        ("vocab_size", dict(vocab_size=0), "vocab_size"),
        ("num_layers", dict(num_layers=1.5), "num_layers"),
        ("max_seq_len", dict(max_seq_len=-1), "max_seq_len"),
        ("block", dict(block="cfg"), "block"),
        ("bool", dict(vocab_size=True), "vocab_size"),
    )
    def test_bad_config(self, kw, name):
        args = dict(vocab_size=24, num_layers=2, max_seq_len=128, block=BLOCK) | kw
        with self.assertRaisesRegex(ValueError, name):
            GPTConfig(**args)

    def test_bad_params_and_seed(self):
        p = init_gpt_params(CFG, seed=0)
        with self.assertRaisesRegex(ValueError, "seed"):
            init_gpt_params(CFG, seed=None)
        with self.assertRaisesRegex(ValueError, "config"):
            init_gpt_params(BLOCK, seed=0)
        with self.assertRaisesRegex(ValueError, "missing.*head.weight"):
            split_block_params({n: a for n, a in p.items() if n != "head.weight"}, CFG)
        with self.assertRaisesRegex(ValueError, "pos.weight must have shape"):
            split_block_params(p | {"pos.weight": p["pos.weight"][:10]}, CFG)

    def test_is_causal(self):
        self.assertTrue(CFG.is_causal())
        acausal = GPTConfig(24, 2, 128, HybridConfig(32, 2, 64, P.local(40, 1), block_size=32))
        self.assertFalse(acausal.is_causal())
        # Global tokens without the causal intersection let query 0 see keys 1..7.
        leaky = GPTConfig(24, 2, 128, HybridConfig(32, 2, 64, P.global_tokens(8), block_size=32))
        self.assertFalse(leaky.is_causal())

    def test_flops(self):
        # Dense causal at one tile: density 1, so the attention term is 4 * H * hd * N^2.
        cfg = GPTConfig(10, 1, 32, HybridConfig(32, 4, 64, P.causal(), block_size=32))
        expect = (2 * 32 * 96 + 2 * 32 * 32 + 4 * 32 * 64) * 32 + 4 * 32 * 32 * 32 \
            + 2 * 32 * 10 * 32
        self.assertEqual(gpt_forward_flops(cfg, 32), expect)

    def test_task(self):
        tokens, targets, mask = TASK.batch(seed=1, step=2, batch_size=3)
        t2, g2, m2 = TASK.batch(seed=1, step=2, batch_size=3)
        np.testing.assert_array_equal(tokens, t2)
        self.assertEqual(tokens.dtype, np.int64)
        np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
        b, t = np.nonzero(mask)
        self.assertLen(t, 3 * TASK.num_queries)
        slots = tokens[b, t] - TASK.num_values
        self.assertTrue(((slots >= 0) & (slots < TASK.num_slots)).all())
        np.testing.assert_array_equal(targets[b, t], tokens[b, slots])
        for row in slots.reshape(3, TASK.num_queries):  # each slot asked at most once
            self.assertLen(set(row.tolist()), TASK.num_queries)
        self.assertLess(tokens.max(), TASK.vocab_size)
        self.assertFalse(np.array_equal(tokens, TASK.batch(seed=1, step=3, batch_size=3)[0]))
        with self.assertRaisesRegex(ValueError, "seq_len"):
            RecallTask(seq_len=10, num_slots=8, num_queries=8)
        with self.assertRaisesRegex(ValueError, "num_queries"):
            RecallTask(seq_len=100, num_slots=8, num_queries=9)


class OracleTest(absltest.TestCase):
    def test_grad_matches_finite_differences(self):
        p = {n: a.astype(np.float64) for n, a in init_gpt_params(CFG, seed=1).items()}
        tokens, targets, mask = _batch()
        loss, grads = reference.gpt_value_and_grad(p, tokens, targets, mask, CFG)
        self.assertAlmostEqual(
            loss, reference.gpt_loss(reference.gpt_forward(p, tokens, CFG), targets, mask), 12)
        rng = np.random.default_rng(0)
        for _ in range(2):  # random directions over all parameters at once
            u = {n: rng.standard_normal(a.shape) for n, a in p.items()}
            eps = 1e-6

            def f(s, u=u):
                q = {n: p[n] + s * u[n] for n in p}
                return reference.gpt_loss(reference.gpt_forward(q, tokens, CFG), targets, mask)

            fd = (f(eps) - f(-eps)) / (2 * eps)
            an = sum(float((grads[n] * u[n]).sum()) for n in p)
            self.assertAlmostEqual(fd, an, delta=1e-6 * max(1.0, abs(an)))


class _FrameworkOracleMixin:
    """torch and JAX against the float64 oracle at float32 (the suite's tolerance table;
    parameter gradients sum over B*N tokens: ``reduced``)."""

    def _run(self, params, tokens, targets, mask, document_lengths=None):
        """(logits, loss, grads) as numpy."""
        raise NotImplementedError

    def test_against_oracle(self):
        self._check_oracle(None)

    def test_per_row_documents_against_oracle(self):
        """Packed documents per batch row (each row its own packing), passed to every block."""
        self._check_oracle(((40, 56), (96,)))

    def _check_oracle(self, lengths):
        """Logits, loss and every parameter gradient vs the oracle."""
        params = init_gpt_params(CFG, seed=2)
        tokens, targets, _ = _batch(batch_size=2)
        # Score every position (not only the questions) so every weight gets a gradient.
        mask = np.ones(targets.shape, bool)
        logits, loss, grads = self._run(params, tokens, targets, mask, lengths)
        ref = reference.gpt_forward(params, tokens, CFG, lengths)
        assert_close(logits, ref, "float32", what="logits")
        ref_loss, ref_grads = reference.gpt_value_and_grad(params, tokens, targets, mask, CFG,
                                                           lengths)
        assert_close(loss, ref_loss, "float32", what="loss")
        self.assertEqual(sorted(grads), sorted(ref_grads))
        t = tokens.size
        for n in ref_grads:
            assert_close(grads[n], ref_grads[n], "float32", grad=True, reduced=t, what=n)

    def _bad(self, tokens, name, pattern):
        raise NotImplementedError

    def test_bad_tokens(self):
        tokens = _batch()[0]
        self._bad(tokens.astype(np.float32), "tokens", "integer|int64")
        self._bad(tokens[0], "tokens", r"\[B, N\]")
        self._bad(np.where(tokens == 0, CFG.vocab_size, tokens), "tokens", "vocab_size")
        self._bad(np.where(tokens == 0, -1, tokens), "tokens", "vocab_size")
        long = np.zeros((1, CFG.max_seq_len + 1), np.int64)
        self._bad(long, "tokens", "max_seq_len")


class TorchGPTTest(_FrameworkOracleMixin, parameterized.TestCase):
    def _run(self, params, tokens, targets, mask, document_lengths=None):
        model = GPT.from_params(CFG, params)
        logits = model(torch.from_numpy(tokens), document_lengths=document_lengths)
        loss = torch_loss(logits, torch.from_numpy(targets), torch.from_numpy(mask))
        loss.backward()
        grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
        return logits.detach().numpy(), loss.item(), grads

    def _bad(self, tokens, name, pattern):
        model = GPT(CFG, seed=0)
        t = torch.from_numpy(np.ascontiguousarray(tokens))
        with self.assertRaisesRegex(ValueError, f"{name}.*({pattern})"):
            model(t)

    def test_named_parameters_are_canonical(self):
        model = GPT(CFG, seed=0)
        shapes = gpt_param_shapes(CFG)
        self.assertEqual({n: tuple(p.shape) for n, p in model.named_parameters()}, shapes)

    def test_export_round_trip_bitwise(self):
        p = init_gpt_params(CFG, seed=7)
        out = GPT.from_params(CFG, p).export_params()
        self.assertEqual(list(out), list(p))
        for n in p:
            np.testing.assert_array_equal(out[n], p[n])
        unloaded = GPT(CFG, seed=None)
        self.assertTrue(all(torch.isnan(q).all() for q in unloaded.parameters()))

    def test_bad_tokens_type_and_params(self):
        with self.assertRaisesRegex(ValueError, "tokens"):
            GPT(CFG, seed=0)(_batch()[0])  # numpy, not a tensor
        with self.assertRaisesRegex(ValueError, "config"):
            GPT(BLOCK)
        with self.assertRaisesRegex(ValueError, "missing"):
            GPT.from_params(CFG, {"embed.weight": np.zeros((24, 32), np.float32)})


class JaxGPTTest(_FrameworkOracleMixin, parameterized.TestCase):
    def _run(self, params, tokens, targets, mask, document_lengths=None):
        p = load_gpt_params(params, CFG)

        def f(p):
            logits = gpt(p, tokens, CFG, document_lengths=document_lengths)
            return jax_loss(logits, targets, mask), logits

        (loss, logits), grads = jax.value_and_grad(f, has_aux=True)(p)
        return np.asarray(logits), float(loss), {n: np.asarray(g) for n, g in grads.items()}

    def _bad(self, tokens, name, pattern):
        with self.assertRaisesRegex(ValueError, f"{name}.*({pattern})"):
            gpt(init_gpt_params(CFG, seed=0), tokens, CFG)

    def test_jit_equals_eager(self):
        p = load_gpt_params(init_gpt_params(CFG, seed=0), CFG)
        tokens = _batch()[0]
        eager = gpt(p, tokens, CFG)
        jitted = jax.jit(gpt, static_argnames=("config",))(p, tokens, config=CFG)
        np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-5)

    def test_tensor_parallel_matches_oracle(self):
        mesh = jax_test_utils.mesh(2)
        params = init_gpt_params(CFG, seed=4)
        tokens = _batch()[0]
        out = gpt(shard_gpt_params(params, CFG, mesh), tokens, CFG, mesh=mesh)
        assert_close(np.asarray(out), reference.gpt_forward(params, tokens, CFG), "float32",
                     what="tp=2 logits")

    def test_data_and_tensor_parallel_matches_oracle(self):
        """dp=2 x tp=2 (``gpt(..., batch_axis="data")`` on a ``make_2d_mesh``): the logits come
        back split over "data", and the loss and every gradient are the global batch's (the
        data-parallel sum of the parameter gradients is jax.grad's, not written by hand)."""
        mesh = make_2d_mesh(2, 2, devices=jax_test_utils.devices(4))
        params = init_gpt_params(CFG, seed=6)
        tokens, targets, _ = _batch(batch_size=2)
        mask = np.ones(targets.shape, bool)
        p = shard_gpt_params(params, CFG, mesh, "model")
        tok, tgt, msk = shard_batch((tokens.astype(np.int32), targets.astype(np.int32), mask),
                                    mesh)

        def f(p):
            logits = gpt(p, tok, CFG, mesh=mesh, axis_name="model", batch_axis="data")
            return jax_loss(logits, tgt, msk), logits

        (loss, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(p)
        self.assertTrue(logits.sharding.is_equivalent_to(NamedSharding(mesh, PS("data")), 3),
                        logits.sharding)
        # Every block splits the batch itself (replicated blocks would give the same numbers,
        # each device computing the whole batch): its shard_map maps "data" over B.
        maps = [e for e in jax.make_jaxpr(f)(p).jaxpr.eqns if e.primitive.name == "shard_map"]
        self.assertLen(maps, CFG.num_layers)
        for e in maps:
            self.assertEqual(tuple(e.params["out_specs"]), (PS("data", None, None),))
        assert_close(np.asarray(logits), reference.gpt_forward(params, tokens, CFG), "float32",
                     what="dp=2 x tp=2 logits")
        ref_loss, ref_grads = reference.gpt_value_and_grad(params, tokens, targets, mask, CFG)
        assert_close(float(loss), ref_loss, "float32", what="loss")
        self.assertEqual(sorted(grads), sorted(ref_grads))
        for n in ref_grads:
            assert_close(np.asarray(grads[n]), ref_grads[n], "float32", grad=True,
                         reduced=tokens.size, what=n)


class TorchJaxTrainingParityTest(absltest.TestCase):
    """Same initial parameters, same data, Adam with the same hyper-parameters in both
    frameworks (torch.optim.Adam and optax.adam compute ``m_hat / (sqrt(v_hat) + eps)`` with the
    same bias corrections): the first five losses agree.

    Tolerances (fp32, CPU). Losses: rtol 1e-5. The two forward passes differ only in summation
    order (~1e-7 relative per op); measured gap over 5 steps: 1.1e-6 relative. A real
    difference (an optimizer setting, a missed bias correction, a different eps placement, a
    wrong gradient) moves the loss by 1e-3 or more.

    Parameters after the steps: atol ``0.05 * lr``. Adam divides each gradient by its own
    running RMS, so an entry whose true gradient is ~0 is moved by up to ``lr`` per step in the
    direction of its rounding noise, differently in each framework. The key biases are the
    extreme case: softmax is invariant to adding a constant to every score, so their gradient is
    exactly 0 analytically and pure noise numerically (measured gap 1.2e-3 = 0.4 lr after 5
    steps, with no effect on the loss); they are held only to Adam's bound, ``steps * lr``.
    Every other entry: measured gap <= 2.8e-5 (0.01 lr).
    """

    STEPS, LR = 5, 3e-3

    def test_first_steps_agree(self):
        params = init_gpt_params(CFG, seed=11)
        # One batch, every position scored, repeated: the loss must fall step after step, so
        # the comparison is of a curve that moves, not of noise around a flat one.
        tokens, targets, _ = TASK.batch(seed=3, step=0, batch_size=2)
        batches = [(tokens, targets, np.ones(targets.shape, bool))] * self.STEPS

        model = GPT.from_params(CFG, params)
        opt = torch.optim.Adam(model.parameters(), lr=self.LR, betas=(0.9, 0.999), eps=1e-8)
        torch_losses = []
        for tokens, targets, mask in batches:
            loss = torch_loss(model(torch.from_numpy(tokens)), torch.from_numpy(targets),
                              torch.from_numpy(mask))
            opt.zero_grad()
            loss.backward()
            opt.step()
            torch_losses.append(loss.item())

        # The claim is about CPU fp32 runs (torch's tensors above are on the CPU): JAX too.
        self.enter_context(jax.default_device(jax.devices("cpu")[0]))
        p = load_gpt_params(params, CFG)
        tx = optax.adam(self.LR, b1=0.9, b2=0.999, eps=1e-8)
        state = tx.init(p)

        @jax.jit
        def step(p, state, tokens, targets, mask):
            loss, g = jax.value_and_grad(lambda p: jax_loss(gpt(p, tokens, CFG), targets,
                                                            mask))(p)
            updates, state = tx.update(g, state, p)
            return optax.apply_updates(p, updates), state, loss

        jax_losses = []
        for batch in batches:
            p, state, loss = step(p, state, *batch)
            jax_losses.append(float(loss))

        np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-5)
        self.assertTrue(np.all(np.diff(torch_losses) < 0), torch_losses)  # the steps train
        tp = model.export_params()
        hd, g = BLOCK.head_dim, BLOCK.kv_group
        cols = np.arange(BLOCK.d_model + 2 * BLOCK.kv_dim)
        is_key = (cols // hd) % (g + 2) == g  # group-major qkv columns: see core.config
        for n, a in p.items():
            a, b = np.asarray(a), tp[n]
            if n.endswith("attn.qkv.bias"):
                np.testing.assert_allclose(a[is_key], b[is_key], rtol=0,
                                           atol=self.STEPS * self.LR, err_msg=n)
                a, b = a[~is_key], b[~is_key]
            np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * self.LR, err_msg=n)


if __name__ == "__main__":
    absltest.main()
