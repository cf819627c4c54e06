"""torch mixed precision: HybridBlock under ``torch.autocast`` (bf16), forward and backward,
against the same block in float32, on CPU and (when present) CUDA; activation checkpointing
under autocast too. The custom autograd Functions of the parallel layers replay their
forward's autocast state in backward (``layers._autocast_backward``)."""

from __future__ import annotations

import unittest

import numpy as np
import testing_utils as tu
import torch
from absl.testing import absltest, parameterized
from torch.utils.checkpoint import checkpoint

from sparsetp.core import HybridConfig, init_params
from sparsetp.core import patterns as P
from sparsetp.torch import HybridBlock

_CFG = HybridConfig(d_model=64, num_heads=2, d_ff=128, pattern=P.causal() & P.local(63, 0),
                    block_size=32)
_B, _N = 2, 96


def _run(device: str, autocast: bool, remat: bool = False):
    """Block output, input gradient and parameter gradients for a random cotangent."""
    block = HybridBlock.from_params(_CFG, init_params(_CFG, seed=0)).to(device)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((_B, _N, _CFG.d_model)).astype(np.float32))
    x = x.to(device).requires_grad_(True)
    g = torch.from_numpy(rng.standard_normal((_B, _N, _CFG.d_model)).astype(np.float32))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        y = checkpoint(block, x, use_reentrant=False) if remat else block(x)
    (y.float() * g.to(device)).sum().backward()
    grads = {n: p.grad.detach().cpu().numpy() for n, p in block.named_parameters()}
    return y.detach().float().cpu().numpy(), x.grad.cpu().numpy(), grads, y.dtype


class AutocastTest(parameterized.TestCase):

    @parameterized.product(device=("cpu", "cuda"), remat=(False, True))
    def test_bf16_autocast_matches_float32(self, device, remat):
        if device == "cuda" and not torch.cuda.is_available():
            raise unittest.SkipTest("needs a CUDA GPU")
        y32, dx32, g32, _ = _run(device, autocast=False)
        y16, dx16, g16, dtype = _run(device, autocast=True, remat=remat)
        self.assertEqual(dtype, torch.float32)  # the residual stream keeps x's dtype
        tu.assert_close(y16, y32, "bfloat16", what="out")
        tu.assert_close(dx16, dx32, "bfloat16", grad=True, what="dx")
        for name, ref in g32.items():
            self.assertEqual(g16[name].dtype, np.float32, name)  # master weights stay fp32
            tu.assert_close(g16[name], ref, "bfloat16", grad=True, reduced=_B * _N, what=name)


if __name__ == "__main__":
    absltest.main()
