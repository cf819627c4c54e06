"""The torch GPT under tensor parallelism: TP=2 on two gloo processes against the float64 oracle.

Each rank runs ``GPT(CFG, group)`` from the same canonical parameters on the same batch and
returns its logits, loss, its gradients gathered to canonical unsharded form
(``GPT.export_grads``), its replicated parameters' LOCAL gradients, and ``export_params()`` of a
model seeded with the canonical draw. The parent checks, for every rank:

* logits, loss and every canonical gradient against :mod:`sparsetp.core.reference` at the
  float32 tolerances of ``testing_utils`` (parameter gradients sum over B*N tokens:
  ``reduced=``);
* the replicated parameters' gradients (embed, pos, ln_f, head, and inside each block the layer
  norms and the row-parallel biases) are bitwise equal on both ranks (no rank may drift: the
  optimiser applies them without a collective);
* ``export_params()`` at TP=2 equals ``init_gpt_params`` bitwise.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl.testing import absltest  # noqa: E402
from testing_utils import assert_close  # noqa: E402

from sparsetp.core import (  # noqa: E402
    GPTConfig,
    HybridConfig,
    RecallTask,
    init_gpt_params,
    reference,
)
from sparsetp.core import patterns as P  # noqa: E402
from sparsetp.core.config import partition_dim  # noqa: E402
from sparsetp.torch import GPT  # noqa: E402
from sparsetp.torch import gpt_loss as torch_loss  # noqa: E402

try:  # pytest puts tests/ on sys.path (no package); a package layout reaches it as tests.*
    import dist_utils
except ImportError:  # pragma: no cover
    from tests import dist_utils

# As tests/model_test.py: 2 layers, 2 heads of 16 (TP 2 splits them), window + global tokens,
# N = 96 (three 32-token tiles).
BLOCK = HybridConfig(d_model=32, num_heads=2, d_ff=64, block_size=32,
                     pattern=P.causal() & (P.local(40, 0) | P.global_tokens(8)))
CFG = GPTConfig(vocab_size=24, num_layers=2, max_seq_len=128, block=BLOCK)
TASK = RecallTask(seq_len=96, num_values=16, num_slots=8, num_queries=8)
TP = 2


def _replicated_grads(model: GPT) -> dict[str, np.ndarray]:
    """This rank's local gradients of the parameters TP does not split."""
    return {name: p.grad.detach().cpu().numpy().copy()
            for name, p in model.named_parameters()
            if not name.startswith("blocks.") or partition_dim(name.split(".", 2)[2]) is None}


def _tp_rank(rank, world, params, tokens, targets, mask):
    model = GPT.from_params(CFG, params, group=None)  # the default group: both ranks
    logits = model(torch.from_numpy(tokens))
    loss = torch_loss(logits, torch.from_numpy(targets), torch.from_numpy(mask))
    loss.backward()
    grads, replicated = model.export_grads(), _replicated_grads(model)
    seeded = GPT(CFG, seed=3).export_params()
    return dict(logits=logits.detach().numpy(), loss=loss.item(), grads=grads,
                replicated=replicated, export=seeded, export_again=model.export_params())


class TorchGPTTensorParallelTest(absltest.TestCase):

    def test_tp2_against_oracle(self):
        params = init_gpt_params(CFG, seed=2)
        tokens, targets, _ = TASK.batch(seed=5, step=0, batch_size=2)
        mask = np.ones(targets.shape, bool)  # every position scored: every weight gets a grad
        out = dist_utils.run_distributed(_tp_rank, TP, params, tokens, targets, mask,
                                         timeout=90, backend="gloo")
        ref_logits = reference.gpt_forward(params, tokens, CFG)
        ref_loss, ref_grads = reference.gpt_value_and_grad(params, tokens, targets, mask, CFG)
        t = tokens.size
        init = init_gpt_params(CFG, seed=3)
        for rank, res in enumerate(out):
            w = f"rank {rank}"
            assert_close(res["logits"], ref_logits, "float32", what=f"{w} logits")
            assert_close(res["loss"], ref_loss, "float32", what=f"{w} loss")
            self.assertEqual(list(res["grads"]), list(ref_grads))
            for n in ref_grads:
                assert_close(res["grads"][n], ref_grads[n], "float32", grad=True, reduced=t,
                             what=f"{w} {n}")
            self.assertEqual(list(res["export"]), list(init))
            for n in init:  # the canonical draw, sharded and gathered back: bitwise
                a, b = res["export"][n], init[n]
                self.assertEqual(a.dtype, b.dtype, n)
                self.assertTrue(np.array_equal(a.view(np.uint32), b.view(np.uint32)),
                                f"{w}: export_params()[{n}] differs from init_gpt_params")
            for n in params:
                self.assertTrue(np.array_equal(res["export_again"][n], params[n]), n)
        # Replicated parameters: the same gradient bits on every rank.
        rep0, rep1 = out[0]["replicated"], out[1]["replicated"]
        self.assertIn("embed.weight", rep0)
        self.assertIn("blocks.1.mlp.fc2.bias", rep0)
        self.assertEqual(sorted(rep0), sorted(rep1))
        for n in rep0:
            self.assertTrue(np.array_equal(rep0[n], rep1[n]),
                            f"{n}: replicated gradient differs between ranks")
        self.assertFalse(np.array_equal(out[0]["grads"]["blocks.0.attn.qkv.weight"], 0))


if __name__ == "__main__":
    absltest.main()
