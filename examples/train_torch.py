"""Train a small GPT of sparsetp ``HybridBlock`` s in PyTorch on a long-range recall task.

The task (:class:`sparsetp.core.RecallTask`): every sequence opens with a memory of random values,
and ends with questions "what was at memory slot s?", ~seq_len tokens later. A causal local
window (``--pattern=local``) cannot see the memory and stays at chance; adding global tokens or
strided key blocks (``--pattern=global|strided|bigbird``) lets the model learn the lookup.

    python examples/train_torch.py                       # CPU default: --size=small, < 2 minutes
    python examples/train_torch.py --pattern=local       # the window alone: stays at chance
    python examples/train_torch.py --size=gpu            # one GPU: bf16 autocast, tokens/s, MFU

Prints a progress bar and a ``SUMMARY`` line (final loss and accuracy over the last 10% of
steps, tokens/s, and on a known GPU the MFU = achieved matmul FLOP/s / the device's dense bf16
peak, FLOPs counted by :func:`sparsetp.core.model.gpt_forward_flops` times 3 for training) and
writes ``<out>/torch_<size>_<pattern>.json`` with the loss curve. Same initial parameters and
the same batches as ``train_jax.py``.
"""

from __future__ import annotations

import contextlib

import common
import torch
import tqdm
from absl import app, flags

from sparsetp.torch import GPT, gpt_loss

common.define_flags()
FLAGS = flags.FLAGS


def main(argv):
    del argv
    run = common.make_run(FLAGS.size, FLAGS.pattern, FLAGS.steps, FLAGS.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if device.type == "cpu" and FLAGS.cpu_threads:
        torch.set_num_threads(FLAGS.cpu_threads)
    # bf16 matmuls and attention on the GPU (fp32 master weights and optimizer state); fp32 on
    # the CPU, where the torch/JAX loss-curve parity is checked.
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    model = GPT(run.config, seed=run.seed, device=device)
    hp = common.adam_hparams(run)
    opt = torch.optim.Adam(model.parameters(), lr=hp["lr"], betas=(hp["b1"], hp["b2"]),
                           eps=hp["eps"])
    rec = common.Recorder(run, "torch", device_name)
    bar = tqdm.trange(run.steps, desc=f"torch {run.pattern_name}", disable=not FLAGS.progress)
    for step in bar:
        tokens, targets, mask = (torch.from_numpy(a).to(device)
                                 for a in run.task.batch(run.seed, step, run.size.batch_size))
        with autocast:
            logits = model(tokens)
        loss = gpt_loss(logits, targets, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        acc = (logits.detach().argmax(-1)[mask] == targets[mask]).float().mean()
        rec.step(loss.item(), acc.item())  # .item() syncs: the step's time is real
        bar.set_postfix(loss=f"{rec.loss[-1]:.3f}", acc=f"{rec.acc[-1]:.2f}")
    rec.finish(FLAGS.out)


if __name__ == "__main__":
    app.run(main)
