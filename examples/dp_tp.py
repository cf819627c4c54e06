"""Train a stack of hybrid blocks with data x tensor parallelism (torch), on random data.

One node, 4 CPU ranks as dp=2 x tp=2 (gloo)::

    torchrun --nproc-per-node=4 examples/dp_tp.py --dp=2 --tp=2

Two nodes of 8 GPUs each (NCCL; the same command on both nodes, HOST = the first node)::

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        examples/dp_tp.py --dp=2 --tp=8

``tp`` is the innermost mesh dim, so with ``--tp`` dividing the GPUs per node each
tensor-parallel group stays inside one node and only DDP's gradient all-reduce crosses nodes.
Without torchrun the script runs as one process (``--dp=1 --tp=1``). Rank 0 prints the loss of
every step: the regression target is fixed, so it goes down.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from absl import app, flags
from torch import nn

from sparsetp.core import HybridConfig
from sparsetp.core import patterns as P
from sparsetp.torch import (
    HybridBlock,
    data_parallel,
    init_distributed,
    make_device_mesh,
    shard_batch,
)
from sparsetp.torch import gather_from_sequence_region as gather_seq
from sparsetp.torch import scatter_to_sequence_region as scatter_seq

FLAGS = flags.FLAGS
flags.DEFINE_integer("dp", 1, "data-parallel size (DDP over the mesh's 'dp' dim)")
flags.DEFINE_integer("tp", 1, "tensor-parallel size (HybridBlock over the mesh's 'tp' dim)")
flags.DEFINE_integer("steps", 5, "optimizer steps")
flags.DEFINE_integer("batch", 8, "global batch (sequences), split over dp")
flags.DEFINE_integer("seq_len", 256, "tokens per sequence")
flags.DEFINE_integer("d_model", 128, "model width")
flags.DEFINE_integer("heads", 4, "attention heads (tp must divide them)")
flags.DEFINE_integer("d_ff", 512, "MLP width (tp must divide it)")
flags.DEFINE_integer("blocks", 2, "hybrid blocks in the stack")
flags.DEFINE_bool("sequence_parallel", False, "Megatron sequence parallelism inside each TP group")
flags.DEFINE_float("lr", 1e-3, "AdamW learning rate")
flags.DEFINE_float("pg_timeout_s", 300.0, "process-group timeout: a rank waiting longer than "
                   "this for a peer fails instead of hanging")


def main(argv):
    del argv
    info = init_distributed(timeout_s=FLAGS.pg_timeout_s)
    cfg = HybridConfig(d_model=FLAGS.d_model, num_heads=FLAGS.heads, d_ff=FLAGS.d_ff,
                       pattern=P.causal() & P.local(127, 0), block_size=64)
    try:
        mesh = make_device_mesh(FLAGS.dp, FLAGS.tp, config=cfg, global_batch=FLAGS.batch)
        tp_group = mesh["tp"].get_group()
        sp = FLAGS.sequence_parallel
        blocks = nn.Sequential(*(HybridBlock(cfg, tp_group, seed=i, device=info.device,
                                             sequence_parallel=sp)
                                 for i in range(FLAGS.blocks)))
        model = data_parallel(blocks, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=FLAGS.lr)
        # The same global batch on every rank (one seed); each data replica trains on its slice.
        gen = torch.Generator().manual_seed(0)
        shape = (FLAGS.batch, FLAGS.seq_len, cfg.d_model)
        x = torch.randn(shape, generator=gen).to(info.device)
        target = torch.randn(shape, generator=gen).to(info.device)
        x_local, t_local = shard_batch(x, mesh), shard_batch(target, mesh)

        def forward(x):
            if not sp:
                return model(x)
            # Between the blocks each TP rank holds a contiguous slice of the tokens; the loss
            # sees the whole sequence again, so it means the same as without SP.
            return gather_seq(model(scatter_seq(x, tp_group)), tp_group)

        if info.rank == 0:
            print(f"dp={FLAGS.dp} x tp={FLAGS.tp} on {info.world_size} ranks ({info.backend}, "
                  f"{info.device.type}); {FLAGS.blocks} blocks, batch {FLAGS.batch} x "
                  f"{FLAGS.seq_len} tokens, sequence_parallel={sp}", flush=True)
        for step in range(FLAGS.steps):
            opt.zero_grad(set_to_none=True)
            loss = ((forward(x_local) - t_local) ** 2).mean()  # mean over the local batch
            loss.backward()                                  # DDP averages over dp
            opt.step()
            # Report the global loss: the mean of every rank's local mean (equal shard sizes).
            report = loss.detach().clone()
            dist.all_reduce(report)
            if info.rank == 0:
                print(f"step {step}: loss {report.item() / info.world_size:.5f}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(app.run(main))
