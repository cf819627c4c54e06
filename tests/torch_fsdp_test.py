"""FSDP2 over HybridBlocks: ``fully_shard`` with a bf16 ``MixedPrecisionPolicy`` (parameters
all-gathered and computed in bf16, gradients reduced in float32), eager and with each block
``torch.compile``d first (torchtitan's order), on 2 gloo ranks as data parallelism (TP=1 per
rank, ``make_device_mesh(dp=2, tp=1)``). The gradients must match one float32 process within
bf16 tolerance. (FSDP2 and tensor parallelism together need DTensor TP parameters, which the
layers do not use: ``backends/torch/parallel.py`` says why DDP is the data-parallel wrapper
there.)"""

from __future__ import annotations

import dist_utils
import numpy as np
import testing_utils as tu
import torch
from absl.testing import absltest, parameterized
from torch import nn

from sparsetp.core import HybridConfig
from sparsetp.core import patterns as P
from sparsetp.torch import HybridBlock

DP = 2
BATCH, SEQ = 4, 64
SEEDS = (0, 1)


def _config() -> HybridConfig:
    return HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.causal() & P.local(47, 0),
                        block_size=32)


def _data():
    g = np.random.default_rng(5)
    x = g.standard_normal((BATCH, SEQ, 64)).astype(np.float32)
    t = g.standard_normal((BATCH, SEQ, 64)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(t)


def _stack(group) -> nn.Sequential:
    return nn.Sequential(*(HybridBlock(_config(), group, seed=s) for s in SEEDS))


def _grads(model: nn.Module) -> dict[str, np.ndarray]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g  # FSDP2: a sharded DTensor
        out[name] = g.detach().float().cpu().numpy().copy()
    return out


def _reference():
    model = _stack(None)
    x, t = _data()
    ((model(x) - t) ** 2).mean().backward()
    return _grads(model)


def _fsdp_step(rank, world, compiled):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    from sparsetp.torch import make_device_mesh, shard_batch  # noqa: PLC0415

    mesh = make_device_mesh(DP, 1, config=_config(), global_batch=BATCH)
    model = _stack(mesh["tp"].get_group())  # TP=1: a one-rank group per data replica
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model):
        if compiled:
            block.compile()  # in place, so the FSDP hooks wrap the compiled module
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        model[i] = block
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    x, t = _data()
    y = model(shard_batch(x, mesh))
    if y.dtype != torch.bfloat16:
        raise AssertionError(f"the forward ran in {y.dtype}, not the policy's bfloat16")
    ((y.float() - shard_batch(t, mesh)) ** 2).mean().backward()
    if compiled:
        from torch._dynamo.utils import counters  # noqa: PLC0415

        if not counters["stats"]["unique_graphs"]:
            raise AssertionError("torch.compile traced no graph: the blocks ran eagerly")
    return _grads(model)


class Fsdp2MixedPrecisionTest(parameterized.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ref = _reference()
        # Both steps on one launch of the 2 ranks (spawning costs ~4 s on 2 cores); eager first,
        # so the compiled step's graph count starts from nothing, as in a process of its own.
        cls.launches = dist_utils.SharedLaunches()
        for compiled in (False, True):
            cls.launches.add(f"compiled_{compiled}", DP, _fsdp_step, compiled, backend="gloo",
                             timeout=300.0)

    @parameterized.named_parameters(("eager", False), ("compiled_blocks", True))
    def test_bf16_policy_grads_match_float32(self, compiled):
        results = self.launches.result(f"compiled_{compiled}")
        self.assertLen(results, DP)
        for rank, grads in enumerate(results):
            self.assertEqual(set(grads), set(self.ref))
            for name, ref in self.ref.items():
                tu.assert_close(grads[name], ref, "bfloat16", grad=True,
                                reduced=BATCH * SEQ, what=f"rank {rank} {name}")


if __name__ == "__main__":
    absltest.main()
