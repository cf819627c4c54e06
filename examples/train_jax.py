"""Train a small GPT of sparsetp ``hybrid_block`` s in JAX (optax) on a long-range recall task.

The JAX twin of ``train_torch.py`` (read its docstring for the task and the outputs): the same
sizes, patterns, initial parameters, batches and Adam settings (``common.py``), a jitted step.

    python examples/train_jax.py                         # CPU default: --size=small, < 2 minutes
    python examples/train_jax.py --pattern=local         # the window alone: stays at chance
    python examples/train_jax.py --size=gpu              # one GPU (needs jax-triton): tokens/s, MFU

Writes ``<out>/jax_<size>_<pattern>.json`` and prints the ``SUMMARY`` line.
"""

from __future__ import annotations

import dataclasses
import functools

import common
import jax
import jax.numpy as jnp
import optax
import tqdm
from absl import app, flags

from sparsetp.core import init_gpt_params
from sparsetp.jax import gpt, gpt_loss, load_gpt_params

common.define_flags()
FLAGS = flags.FLAGS


def make_step(config, optimizer):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, targets, mask):
        def loss_fn(p):
            logits = gpt(p, tokens, config)
            return gpt_loss(logits, targets, mask), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        hit = (logits.argmax(-1) == targets) & mask
        acc = hit.sum() / jnp.maximum(mask.sum(), 1)
        return params, opt_state, loss, acc

    return step


def main(argv):
    del argv
    run = common.make_run(FLAGS.size, FLAGS.pattern, FLAGS.steps, FLAGS.seed)
    dev = jax.devices()[0]
    device_name = dev.device_kind if dev.platform == "gpu" else "cpu"
    config = run.config
    if dev.platform == "gpu":
        # bf16 compute on the GPU, like the torch example's autocast: blocks and head in bf16.
        # The parameters and Adam state stay fp32 (gpt casts them for compute).
        config = dataclasses.replace(config, block=dataclasses.replace(config.block,
                                                                       dtype="bfloat16"))
    params = load_gpt_params(init_gpt_params(run.config, run.seed), run.config)
    hp = common.adam_hparams(run)
    optimizer = optax.adam(hp["lr"], b1=hp["b1"], b2=hp["b2"], eps=hp["eps"])
    opt_state = optimizer.init(params)
    step_fn = make_step(config, optimizer)
    rec = common.Recorder(run, "jax", device_name)
    bar = tqdm.trange(run.steps, desc=f"jax {run.pattern_name}", disable=not FLAGS.progress)
    for step in bar:
        batch = run.task.batch(run.seed, step, run.size.batch_size)
        params, opt_state, loss, acc = step_fn(params, opt_state, *batch)
        rec.step(float(loss), float(acc))  # float() waits for the step: its time is real
        bar.set_postfix(loss=f"{rec.loss[-1]:.3f}", acc=f"{rec.acc[-1]:.2f}")
    rec.finish(FLAGS.out)


if __name__ == "__main__":
    app.run(main)
