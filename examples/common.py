"""What the torch and JAX training examples share: sizes, patterns, task, optimizer settings,
FLOP/MFU accounting, the summary line and the JSON record. Framework-free (numpy only), so the
two scripts differ only in how they run a step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time

import numpy as np
from absl import flags

from sparsetp.core import GPTConfig, HybridConfig, RecallTask, gpt_train_flops, make_layout
from sparsetp.core import patterns as P

__all__ = ["Size", "SIZES", "PATTERNS", "define_flags", "Run", "make_run", "adam_hparams",
           "PEAK_FLOPS", "peak_flops", "Recorder"]


@dataclasses.dataclass(frozen=True)
class Size:
    """One example size: model, task and training schedule."""

    seq_len: int
    d_model: int
    num_heads: int
    d_ff: int
    num_layers: int
    block_size: int
    window: int          # causal local window (tokens) every pattern has
    stride: int          # strided pattern: every stride-th key block (block 0 included)
    batch_size: int
    steps: int
    lr: float
    num_values: int
    num_slots: int
    num_queries: int
    dtype: str = "float32"          # parameters (the GPU size computes in bf16 under autocast)


SIZES = {
    # Test size: a few seconds, says nothing about learning.
    "tiny": Size(seq_len=256, d_model=32, num_heads=2, d_ff=64, num_layers=2, block_size=32,
                 window=32, stride=4, batch_size=2, steps=8, lr=3e-3, num_values=16,
                 num_slots=16, num_queries=16),
    # The default: < 2 minutes per run on a 2-core CPU, long enough for the lookup to be learnt.
    "small": Size(seq_len=2048, d_model=64, num_heads=4, d_ff=128, num_layers=2, block_size=64,
                  window=64, stride=8, batch_size=4, steps=400, lr=3e-3, num_values=16,
                  num_slots=16, num_queries=16),
    # One GPU: 16k tokens, a wider and deeper model.
    "gpu": Size(seq_len=16384, d_model=512, num_heads=8, d_ff=2048, num_layers=6,
                block_size=128, window=512, stride=16, batch_size=8, steps=1000, lr=1e-3,
                num_values=64, num_slots=128, num_queries=128),
}

# Every pattern is causal (a language model) and keeps a causal window of ``size.window``
# tokens; they differ in what lies beyond it. The task's memory is the first block.
PATTERNS = {
    "local": lambda s: P.causal() & P.local(s.window - 1, 0),
    "global": lambda s: P.causal() & (P.local(s.window - 1, 0) | P.global_tokens(s.block_size)),
    "strided": lambda s: P.causal() & (P.local(s.window - 1, 0)
                                       | P.strided(s.stride, s.block_size)),
    "bigbird": lambda s: P.causal() & P.bigbird(s.block_size, 3, 1, 1, seed=0),
    "dense": lambda s: P.causal(),
}


def define_flags() -> None:
    flags.DEFINE_enum("size", "small", list(SIZES), "Model/task size (tiny: tests; small: the "
                      "CPU default; gpu: one GPU).")
    flags.DEFINE_enum("pattern", "global", list(PATTERNS), "Attention pattern of every block.")
    flags.DEFINE_integer("steps", None, "Training steps (default: the size's).")
    flags.DEFINE_integer("seed", 0, "Seed of the parameters and of the data.")
    flags.DEFINE_string("out", "examples/results", "Directory for the JSON record.")
    flags.DEFINE_bool("progress", True, "Show a tqdm progress bar.")
    flags.DEFINE_integer("cpu_threads", 1, "torch intra-op threads on a CPU (0: torch's "
                         "default). 1 because at these sizes a second thread gains little and, "
                         "on a busy machine, spinning OpenMP threads made a step 8x slower "
                         "(2.1 s vs 0.25 s at --size=small on the 2-core VM).")


@dataclasses.dataclass(frozen=True)
class Run:
    size_name: str
    size: Size
    pattern_name: str
    config: GPTConfig
    task: RecallTask
    steps: int
    seed: int
    density: float       # fraction of attention tiles computed (for the FLOP count)


def make_run(size_name: str, pattern_name: str, steps: int | None, seed: int) -> Run:
    s = SIZES[size_name]
    task = RecallTask(s.seq_len, s.num_values, s.num_slots, s.num_queries)
    pattern = PATTERNS[pattern_name](s)
    block = HybridConfig(s.d_model, s.num_heads, s.d_ff, pattern, block_size=s.block_size,
                         dtype=s.dtype)
    config = GPTConfig(task.vocab_size, s.num_layers, s.seq_len, block)
    density = make_layout(pattern, s.seq_len, s.num_heads, s.block_size).density
    return Run(size_name, s, pattern_name, config, task, s.steps if steps is None else steps,
               seed, density)


def adam_hparams(run: Run) -> dict:
    """The one optimizer both frameworks use: Adam, constant learning rate, no weight decay
    (torch.optim.Adam and optax.adam compute the same update with these)."""
    return dict(lr=run.size.lr, b1=0.9, b2=0.999, eps=1e-8)


# Dense peak FLOP/s per device for the MFU denominator (bf16 tensor cores, no sparsity): the
# vendors' datasheet numbers for SXM parts.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_FLOPS.items():
        if key in device_name:
            return value
    return None


class Recorder:
    """Collects the per-step loss/accuracy, times the run, prints the summary line and writes
    the JSON record. Step 0 (compilation, warm-up) is left out of tokens/s."""

    def __init__(self, run: Run, framework: str, device_name: str):
        self.run, self.framework, self.device_name = run, framework, device_name
        self.loss: list[float] = []
        self.acc: list[float] = []
        self._t0 = self._t1 = None

    def step(self, loss: float, acc: float) -> None:
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        self._t1 = now
        self.loss.append(float(loss))
        self.acc.append(float(acc))

    def summary(self) -> dict:
        r, s = self.run, self.run.size
        tail = max(1, len(self.loss) // 10)  # fresh batches every step: a held-out estimate
        timed = len(self.loss) - 1
        secs = (self._t1 - self._t0) if timed > 0 else float("nan")
        tokens_s = timed * s.batch_size * s.seq_len / secs if timed > 0 else float("nan")
        flops = gpt_train_flops(r.config, s.seq_len, r.density) * s.batch_size
        peak = peak_flops(self.device_name)
        return dict(
            framework=self.framework, size=r.size_name, pattern=r.pattern_name, seed=r.seed,
            steps=len(self.loss), seq_len=s.seq_len, batch_size=s.batch_size,
            density=r.density, chance=r.task.chance,
            final_loss=float(np.mean(self.loss[-tail:])),
            final_accuracy=float(np.mean(self.acc[-tail:])),
            tokens_per_s=tokens_s, train_flops_per_step=flops,
            mfu=(flops * timed / secs / peak) if peak and timed > 0 else None,
            device=self.device_name, python=platform.python_version(),
            loss=self.loss, accuracy=self.acc)

    def finish(self, out_dir: str) -> dict:
        res = self.summary()
        mfu = f", MFU {100 * res['mfu']:.1f}%" if res["mfu"] is not None else ""
        print(f"SUMMARY {res['framework']} size={res['size']} pattern={res['pattern']} "
              f"steps={res['steps']}: final loss {res['final_loss']:.3f}, accuracy "
              f"{res['final_accuracy']:.3f} (chance {res['chance']:.3f}), "
              f"{res['tokens_per_s']:.0f} tokens/s{mfu} on {res['device']}", flush=True)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{res['framework']}_{res['size']}_{res['pattern']}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {path}")
        return res
