"""Layout build time for every pattern constructor, up to N = 131072 (CPU, numpy only).

Believe these numbers only when `python -m pytest tests/layout_test.py` passes.

    python benchmarks/layout_build.py --out=benchmarks/results/layout_build_cpu.json
    python benchmarks/layout_build.py --seq_lens=131072 --match=neighborhood --num_heads=1

Neighbourhood rows: tests/neighborhood_test.py must pass too.
"""

import json
import platform
import time

import numpy as np
from absl import app, flags
from tqdm import tqdm

from sparsetp.core import make_layout
from sparsetp.core import patterns as P

FLAGS = flags.FLAGS
flags.DEFINE_list("seq_lens", ["8192", "32768", "131072"], "sequence lengths")
flags.DEFINE_integer("num_heads", 16, "heads")
flags.DEFINE_integer("block_size", 128, "layout block size")
flags.DEFINE_integer("repeats", 3, "builds per case (the minimum is reported)")
flags.DEFINE_string("out", None, "write JSON here")
flags.DEFINE_string("match", None, "only the patterns whose name contains this")
flags.DEFINE_list("patterns", None, "only these case names (default: all)")


def neighborhood_cases(n):
    """NATTEN-style neighbourhoods on grids of exactly n tokens (n a multiple of 4096)."""
    if n % 4096:
        return {}
    g3, g2 = (n // 4096, 64, 64), (n // 256, 256)
    return {
        f"neighborhood({'x'.join(map(str, g3))},7)": P.neighborhood(g3, 7),
        f"neighborhood({'x'.join(map(str, g2))},13,dil2,causal0)": P.neighborhood(
            g2, 13, dilation=2, causal=(True, False)),
        f"neighborhood({'x'.join(map(str, g3))},7,tile4x4x8)": P.neighborhood(
            g3, 7, tile_shape=(4, 4, 8)),
        "neighborhood(3d,7)|global_tokens(64)": P.neighborhood(g3, 7) | P.global_tokens(64),
        "neighborhood(3d,7)&causal": P.neighborhood(g3, 7) & P.causal(),
    }


def _doc_lengths(n: int, count: int, seed: int) -> list[int]:
    """``count`` documents of random lengths summing to ``n`` (boundaries not block-aligned)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n), size=count - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [n]])).tolist()


def cases(bs, n):
    return {
        # Packed documents: token-exact boundaries anywhere (most straddle a tile).
        "documents(8 random)&causal": P.documents(_doc_lengths(n, 8, 0)) & P.causal(),
        "documents(1000 random)&causal": P.documents(_doc_lengths(n, 1000, 0)) & P.causal(),
        "dense": P.dense(),
        "causal": P.causal(),
        "local(511,511)": P.local(511, 511),
        "block_diagonal(1024)": P.block_diagonal(1024),
        "fixed(256,32)": P.fixed(256, 32),
        "strided(16,bs,per_head)&causal": P.strided(16, bs, per_head_offset=True) & P.causal(),
        "random_blocks(2,bs)": P.random_blocks(2, bs, seed=0),
        # Pattern blocks smaller than the layout's: several random cells per tile.
        "random_blocks(2,32)": P.random_blocks(2, 32, seed=0),
        "global_tokens(bs)": P.global_tokens(bs),
        "bigbird(bs,3,1,2)": P.bigbird(bs, 3, 1, 2, seed=0),
        "bigbird(64,3,1,2)": P.bigbird(64, 3, 1, 2, seed=0),
        "longformer(1024,64)": P.longformer(1024, 64),
        "per_head(causal,local)": P.per_head([P.causal(), P.local(1023, 0)]),
        **neighborhood_cases(n),
    }


def main(argv):
    del argv
    bs = FLAGS.block_size
    rows = []
    todo = [(int(n), name, p) for n in FLAGS.seq_lens for name, p in cases(bs, int(n)).items()
            if (FLAGS.match is None or FLAGS.match in name)
            and (FLAGS.patterns is None or name in FLAGS.patterns)]
    for n, name, p in tqdm(todo, desc="layouts"):
        times, cpu = [], []
        for _ in range(FLAGS.repeats):
            P._KINDS_CACHE.clear()
            getattr(P, "_TILES_CACHE", {}).clear()  # getattr: older cores had none (A/B runs)
            P._random_chosen.cache_clear()
            t0, c0 = time.perf_counter(), time.process_time()
            lay = make_layout(p, n, FLAGS.num_heads, bs)
            cpu.append(time.process_time() - c0)
            times.append(time.perf_counter() - t0)
        # CPU time (process_time) leaves out waiting for a core on a shared machine.
        rows.append(dict(pattern=name, seq_len=n, num_heads=FLAGS.num_heads, block_size=bs,
                         seconds=min(times), cpu_seconds=min(cpu), density=lay.density,
                         masks=lay.masks.shape[0]))
    print(f"{'pattern':38s} {'N':>7s} {'ms':>9s} {'cpu ms':>9s} {'density':>8s} {'masks':>6s}")
    for r in rows:
        print(f"{r['pattern']:38s} {r['seq_len']:7d} {r['seconds'] * 1e3:9.1f} "
              f"{r['cpu_seconds'] * 1e3:9.1f} {r['density']:8.4f} {r['masks']:6d}")
    if FLAGS.out:
        meta = dict(machine=platform.platform(), processor=platform.processor(),
                    python=platform.python_version(), numpy=np.__version__,
                    command="python benchmarks/layout_build.py " + " ".join(
                        f"--{k}={v}" for k, v in [("seq_lens", ",".join(FLAGS.seq_lens)),
                                                  ("num_heads", FLAGS.num_heads),
                                                  ("block_size", bs),
                                                  ("match", FLAGS.match)]))
        with open(FLAGS.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)


if __name__ == "__main__":
    app.run(main)
