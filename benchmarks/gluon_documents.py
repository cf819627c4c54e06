"""Run ``gluon_fwd.py`` or ``gluon_bwd.py`` with one more pattern spec, ``documents``: the packed
documents of ``real_models.py`` (N tokens as documents of 512-8192 tokens, seed 0, causal within
each), so an A/B of two commits' sm_90 kernels covers that layout too. Lab (KERNEL_NOTES,
"Session 32")::

    cd benchmarks && PYTHONPATH=$PWD/.. python gluon_documents.py gluon_fwd \
        --base_hopper=/tmp/base_hopper.py --variants=base_ws3pp,ws3pp --patterns=documents \
        --seq_lens=32768
"""

from __future__ import annotations

import importlib
import sys

from absl import app
from attention_common import document_lengths

import sparsetp.bench.attention as bench
from sparsetp.core import patterns as P

_bench_pattern = bench.bench_pattern


class _Documents:
    """What the lab scripts read of a ``BenchPattern``: its pattern."""

    def __init__(self, pattern):
        self.pattern = pattern


def bench_pattern(spec, n, block, heads):
    if spec != "documents":
        return _bench_pattern(spec, n, block, heads)
    return _Documents(P.documents(document_lengths(n)) & P.causal())


if __name__ == "__main__":
    # The lab scripts import bench_pattern when they measure, so the patched one is read.
    bench.bench_pattern = bench_pattern
    app.run(importlib.import_module(sys.argv.pop(1)).main)
