"""Command line: ``python -m sparsetp demo [--backend torch|jax] [--tp N] [sizes...]``.

``python -m sparsetp demo --backend torch --tp 4`` spawns 4 processes: NCCL on 4 GPUs when torch
sees 4, else gloo on CPU (Triton's interpreter); the output says which and why. Under
``torchrun --nproc_per_node 4 -m sparsetp demo --backend torch`` it uses torchrun's processes.
``--backend jax`` drives ``tp`` JAX devices from this process under the same rule. Sizes left
unset take the CPU or GPU defaults of :mod:`sparsetp.demo`, where the device rule is spelled out.
"""

from __future__ import annotations

import sys

from absl import app, flags

_COMMANDS = ("demo",)

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Defined when the command runs, not at import (importing this module for
    :func:`run_demo` must not claim generic flag names such as ``--device`` in the caller)."""
    if "backend" in FLAGS:
        return
    from sparsetp.core import DTYPES  # noqa: PLC0415

    flags.DEFINE_enum("backend", "torch", ["torch", "jax"], "Framework to run the demo in.")
    flags.DEFINE_integer("tp", None, "Tensor-parallel size (default: torchrun's WORLD_SIZE, "
                         "else one per GPU, or 4 on CPU).", lower_bound=1)
    flags.DEFINE_integer("steps", 3, "Forward+backward steps, each checked against the oracle.",
                         lower_bound=1)
    flags.DEFINE_integer("batch", None, "Batch size B.", lower_bound=1)
    flags.DEFINE_integer("seq_len", None, "Sequence length N.", lower_bound=1)
    flags.DEFINE_integer("d_model", None, "Model width.", lower_bound=1)
    flags.DEFINE_integer("num_heads", None, "Attention heads.", lower_bound=1)
    flags.DEFINE_integer("d_ff", None, "MLP hidden width.", lower_bound=1)
    flags.DEFINE_integer("block_size", None, "Layout tile size (16, 32, 64 or 128).")
    flags.DEFINE_enum("dtype", None, list(DTYPES), "Parameter and compute dtype.")
    flags.DEFINE_integer("seed", 0, "Seed of the parameters, the pattern and the data.")
    flags.DEFINE_enum("device", "auto", ["auto", "cpu", "cuda"],
                      "Where to run (auto: tp GPUs if there are that many, else CPU).")
    flags.DEFINE_float("pg_timeout_s", 300.0, "torch process-group timeout in seconds: a rank "
                       "that waits this long in a collective raises instead of hanging.",
                       lower_bound=0.001)


def run_demo(args) -> int:
    """Run the demo of ``args.backend`` (a :class:`sparsetp.demo.DemoArgs`); 0 when it passed."""
    if args.backend == "jax":
        from sparsetp.backends.jax import demo as jax_demo  # noqa: PLC0415

        return jax_demo.main(args)
    from sparsetp import demo  # noqa: PLC0415

    return demo.main(args)


def _run(argv) -> None:
    if len(argv) != 2 or argv[1] not in _COMMANDS:
        raise app.UsageError(f"usage: python -m sparsetp demo [--flags]; got {argv[1:]}")
    from sparsetp.demo import DemoArgs  # noqa: PLC0415

    args = DemoArgs(
        backend=FLAGS.backend, tp=FLAGS.tp, steps=FLAGS.steps, batch=FLAGS.batch,
        seq_len=FLAGS.seq_len, d_model=FLAGS.d_model, num_heads=FLAGS.num_heads,
        d_ff=FLAGS.d_ff, block_size=FLAGS.block_size, dtype=FLAGS.dtype, seed=FLAGS.seed,
        device=FLAGS.device, pg_timeout_s=FLAGS.pg_timeout_s)
    sys.exit(run_demo(args))


def main(argv=None) -> None:
    """Entry point (also the ``sparsetp`` console script)."""
    _define_flags()
    app.run(_run, argv=argv)


if __name__ == "__main__":
    main()
