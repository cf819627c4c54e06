"""Synthetic long-range tasks for the training examples (numpy only, seeded).

:class:`RecallTask` ("retrieve the token at a marked position"): a sequence opens with
``num_slots`` *memory* tokens (random values), continues with random filler values, and ends
with ``num_queries`` questions ``(marker_s, answer)`` about distinct slots: marker ``s`` asks
for the value stored at position ``s``, and the next token is that value. Next-token
prediction is scored (``mask``) only at the markers, whose targets are the answers. The answers
sit ``~seq_len`` tokens back, so an attention pattern whose window is shorter than the sequence
cannot see them (its accuracy stays at chance, ``1 / num_values``: the filler is drawn from the
same values, and no slot is asked twice, so nothing local gives the answer away), while a
pattern that keeps the first layout block visible to every query (global tokens, strided
columns with offset 0, BigBird's globals) can learn the lookup.

Ids: values ``0 .. num_values - 1``, markers ``num_values .. num_values + num_slots - 1``.

Batches are pure functions of ``(seed, step)`` through ``numpy.random.default_rng((seed,
step))``: never global RNG state, never a framework RNG, so the torch and JAX examples train on
the same data, and batch ``k`` does not depend on how many batches came before.

>>> import numpy as np
>>> task = RecallTask(seq_len=256, num_values=8, num_slots=4, num_queries=3)
>>> tokens, targets, mask = task.batch(seed=0, step=0, batch_size=2)
>>> tokens.shape, int(mask.sum()), task.vocab_size
((2, 256), 6, 12)
>>> b, t = np.nonzero(mask)                     # each marker's answer is its slot's value
>>> bool((targets[b, t] == tokens[b, tokens[b, t] - 8]).all())
True
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparsetp.core.config import check_seed

__all__ = ["RecallTask"]


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """Marked-position retrieval over ``seq_len`` tokens (see the module docstring).

    Args:
      seq_len: tokens per sequence (the model's input length ``N``).
      num_values: distinct value tokens (chance accuracy is ``1 / num_values``).
      num_slots: memory positions ``0 .. num_slots - 1`` (keep it <= the layout block size so
        the memory is one tile: the tile global/strided patterns keep visible).
      num_queries: questions at the end of every sequence (``2 * num_queries`` tokens), each
        about a different slot (``<= num_slots``), so no answer is repeated within reach of a
        local window.
    """

    seq_len: int
    num_values: int = 32
    num_slots: int = 32
    num_queries: int = 32

    def __post_init__(self):
        for name in ("seq_len", "num_values", "num_slots", "num_queries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_queries > self.num_slots:
            # Each slot is asked at most once per sequence: a repeated question would put its
            # answer a few tokens back, inside any local window (a shortcut, not a lookup).
            raise ValueError(f"num_queries={self.num_queries} must be <= num_slots="
                             f"{self.num_slots} (every slot is asked at most once)")
        if self.num_slots + 2 * self.num_queries > self.seq_len:
            raise ValueError(f"seq_len={self.seq_len} must hold num_slots={self.num_slots} "
                             f"memory tokens and 2 * num_queries={2 * self.num_queries} "
                             "question tokens")

    @property
    def vocab_size(self) -> int:
        return self.num_values + self.num_slots

    @property
    def chance(self) -> float:
        """Accuracy of guessing: the answers are uniform over the values."""
        return 1.0 / self.num_values

    def batch(self, seed: int, step: int, batch_size: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, targets, mask)``, each ``[batch_size, seq_len]``: int64 inputs, int64
        next tokens (``targets[:, t] = sequence[t + 1]``), bool positions that are scored (the
        markers). A pure function of ``(seed, step)``."""
        check_seed(seed)
        check_seed(step, name="step")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or (
                batch_size < 1):
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        rng = np.random.default_rng((seed, step))
        b, n, s, q = batch_size, self.seq_len, self.num_slots, self.num_queries
        seq = rng.integers(0, self.num_values, size=(b, n + 1), dtype=np.int64)  # memory+filler
        # Distinct slots per sequence (see __post_init__): the first q of a random permutation.
        slots = rng.permuted(np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)), axis=1)[:, :q]
        start = n + 1 - 2 * q  # the questions fill the last 2q tokens of the n + 1
        seq[:, start::2] = self.num_values + slots                       # markers
        seq[:, start + 1::2] = np.take_along_axis(seq[:, :s], slots, 1)  # their answers
        mask = np.zeros((b, n), bool)
        mask[:, start::2] = True
        return seq[:, :n], seq[:, 1:], mask
