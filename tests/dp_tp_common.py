"""The data x tensor-parallel problem both frameworks' tests train (not a test file itself).

numpy and ``sparsetp.core`` only, so the torch test, the JAX test and the JAX per-process worker
(``jax_dp_tp_worker.py``) import it without starting the other framework or JAX's backend.
"""

from __future__ import annotations

import numpy as np

from sparsetp.core import HybridConfig
from sparsetp.core import patterns as P

DP, TP = 2, 2
BATCH, SEQ, D = 4, 64, 64  # global batch: each data replica trains on BATCH / DP sequences
LR = 0.5                   # one plain SGD step
SEEDS = (0, 1)             # the canonical init_params seed of each of the two blocks


def config(**kw) -> HybridConfig:
    kw = dict(d_model=D, num_heads=4, d_ff=128, pattern=P.causal() | P.local(16, 16),
              block_size=16) | kw
    return HybridConfig(**kw)


def data() -> tuple[np.ndarray, np.ndarray]:
    """The global batch ``x`` and the regression target ``t``, both ``[BATCH, SEQ, D]``."""
    rng = np.random.default_rng(7)
    return (rng.standard_normal((BATCH, SEQ, D)).astype(np.float32),
            rng.standard_normal((BATCH, SEQ, D)).astype(np.float32))
