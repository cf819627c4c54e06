"""Spec layer: patterns mean exactly their documented token-level rule; layouts agree with them."""

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
from absl.testing import absltest, parameterized

from sparsetp.core import make_layout
from sparsetp.core import patterns as P
from sparsetp.core.examples import EXAMPLE_PATTERNS, example_pattern
from sparsetp.core.layout import half_masks, work_order


def _random_spec(per_row, block, seed):
    """Independent re-statement of random_blocks' documented draw."""
    def spec(h, i, j, n):
        nb = -(-n // block)
        rng = np.random.default_rng((seed, h))
        sets = [set() for _ in range(nb)]
        for j_top in range(nb - per_row, nb):
            draws = rng.integers(0, j_top + 1, size=nb)
            for r in range(nb):
                sets[r].add(j_top if int(draws[r]) in sets[r] else int(draws[r]))
        table = np.zeros((nb, nb), bool)
        for r in range(nb):
            table[r, sorted(sets[r])] = True
        return table[i // block, j // block]
    return spec


# (pattern, independent token-level rule written from the text).
SPECS = {
    "dense": (P.dense(), lambda h, i, j, n: np.ones_like(i + j, bool)),
    "causal": (P.causal(), lambda h, i, j, n: j <= i),
    "local": (P.local(5, 2), lambda h, i, j, n: (i - 5 <= j) & (j <= i + 2)),
    "local_causal_window": (P.local(7, 0), lambda h, i, j, n: (i - 7 <= j) & (j <= i)),
    "block_diagonal": (P.block_diagonal(12), lambda h, i, j, n: i // 12 == j // 12),
    "fixed": (P.fixed(16, 4), lambda h, i, j, n: (i // 16 == j // 16) | (j % 16 >= 12)),
    "strided": (P.strided(3, 8, offset=1),
                lambda h, i, j, n: (j // 8 + 1) % 3 == 0),
    "strided_per_head": (P.strided(4, 8, offset=1, per_head_offset=True),
                         lambda h, i, j, n: (j // 8 + 1 + h) % 4 == 0),
    "random": (P.random_blocks(2, 16, seed=5), _random_spec(2, 16, 5)),
    # Pattern block vs layout tile: per-token cells (tile = many cells), cells straddling tiles
    # (neither divides the other), cells of several tiles (block a multiple of the tile).
    "random_tokens": (P.random_blocks(3, 1, seed=4), _random_spec(3, 1, 4)),
    "random_straddling": (P.random_blocks(3, 5, seed=1), _random_spec(3, 5, 1)),
    "random_wide": (P.random_blocks(1, 32, seed=3), _random_spec(1, 32, 3)),
    "global": (P.global_tokens(6), lambda h, i, j, n: (i < 6) | (j < 6)),
    "block_local": (P.block_local(8, 1, 2),
                    lambda h, i, j, n: (i // 8 - 1 <= j // 8) & (j // 8 <= i // 8 + 2)),
    "bigbird": (P.bigbird(16, 3, 1, 1, seed=2),
                lambda h, i, j, n: (np.abs(i // 16 - j // 16) <= 1) | (i < 16) | (j < 16)
                | _random_spec(1, 16, 2)(h, i, j, n)),
    "longformer": (P.longformer(10, 3),
                   lambda h, i, j, n: (np.abs(i - j) <= 5) | (i < 3) | (j < 3)),
    "strided_and_causal": (P.strided(4, 16) & P.causal(),
                           lambda h, i, j, n: ((j // 16) % 4 == 0) & (j <= i)),
    "union": (P.local(3, 0) | P.strided(5, 4),
              lambda h, i, j, n: ((i - 3 <= j) & (j <= i)) | ((j // 4) % 5 == 0)),
    # Boundaries at 5, 21, 22 (not block-aligned; one 1-token document); lengths sum to the
    # case's N (see _documents_spec).
    "documents": (None, None),
    "documents_causal": (None, None),
    "per_head": (P.per_head([P.causal(), P.local(4, 4), P.strided(2, 8, per_head_offset=True)]),
                 lambda h, i, j, n: [j <= i, np.abs(i - j) <= 4,
                                     (j // 8 + h) % 2 == 0][h % 3]),
}


def _documents_spec(name, n):
    """(pattern, rule) of the documents cases for n tokens: lengths 5, 16, 1, then the rest in
    pieces of 29 tokens."""
    lengths = [5, 16, 1]
    while sum(lengths) < n:
        lengths.append(min(29, n - sum(lengths)))
    ends = np.cumsum(lengths)

    def doc(x):
        return np.searchsorted(ends, x, side="right")

    if name == "documents":
        return P.documents(lengths), lambda h, i, j, n: doc(i) == doc(j)
    return (P.documents(lengths) & P.causal(),
            lambda h, i, j, n: (doc(i) == doc(j)) & (j <= i))


def _spec(name, n):
    return _documents_spec(name, n) if name.startswith("documents") else SPECS[name]


def _token_truth(spec, heads, n):
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    return np.stack([np.broadcast_to(spec(h, i, j, n), (n, n)) for h in range(heads)])


def _check_layout(test, lay, truth):
    """block_mask, the CSR/CSC lists and the bitmasks all agree with the token-level truth
    (``truth``: bool[H, N_q, N_kv])."""
    h_n, n, n_kv, bs = lay.num_heads, lay.seq_len, lay.kv_len, lay.block_size
    np.testing.assert_array_equal(lay.dense_mask(), truth)
    nb, nbk = lay.num_blocks, lay.num_kv_blocks
    pad = np.zeros((h_n, nb * bs, nbk * bs), bool)
    valid = np.zeros_like(pad)
    pad[:, :n, :n_kv] = truth
    valid[:, :n, :n_kv] = True
    allowed = pad.reshape(h_n, nb, bs, nbk, bs).sum((2, 4))
    n_valid = valid.reshape(h_n, nb, bs, nbk, bs).sum((2, 4))
    expect = np.where(allowed == 0, 0, np.where(allowed == n_valid, 2, 1))
    np.testing.assert_array_equal(lay.block_mask, expect)
    for h, r in itertools.product(range(h_n), range(nb)):
        q_list = lay.q_index[h, r, : lay.q_count[h, r]]
        np.testing.assert_array_equal(np.sort(q_list), np.nonzero(expect[h, r])[0])
        npart = lay.q_partial[h, r]
        test.assertTrue((expect[h, r, q_list[:npart]] == 1).all())
        test.assertTrue((expect[h, r, q_list[npart:]] == 2).all())
        test.assertTrue((lay.q_mask_id[h, r, :npart] >= 0).all())
        test.assertTrue((lay.q_mask_id[h, r, npart:] == -1).all())
    for h, r in itertools.product(range(h_n), range(nbk)):
        k_list = lay.k_index[h, r, : lay.k_count[h, r]]
        np.testing.assert_array_equal(np.sort(k_list), np.nonzero(expect[h, :, r])[0])
        kpart = lay.k_partial[h, r]
        test.assertTrue((expect[h, k_list[:kpart], r] == 1).all())
        test.assertTrue((expect[h, k_list[kpart:], r] == 2).all())
        # The key-major mask ids name the same bitmask as the query-major view of that tile.
        for t in range(kpart):
            qi = k_list[t]
            slot = np.nonzero(lay.q_index[h, qi, : lay.q_partial[h, qi]] == r)[0]
            test.assertLen(slot, 1)
            test.assertEqual(lay.k_mask_id[h, r, t], lay.q_mask_id[h, qi, slot[0]])
    _check_work_order(test, lay)
    _check_ell_width(test, lay)


def _check_ell_width(test, lay):
    """ELL widths: a multiple of 16 (same Triton specialisation for every pattern: see
    layout._ELL_ALIGN), at least the longest list, padding entries index 0 / mask id -1."""
    for major in ("q", "k"):
        index = getattr(lay, f"{major}_index")
        mask_id = getattr(lay, f"{major}_mask_id")
        count = getattr(lay, f"{major}_count")
        width = index.shape[-1]
        test.assertEqual(width % 16, 0, f"{major}_index width {width}")
        test.assertEqual(mask_id.shape, index.shape)
        test.assertGreaterEqual(width, int(count.max(initial=0)))
        if major == "q":
            test.assertEqual(lay.widest_row, max(1, int(count.max(initial=0))))
        pad = np.arange(width)[None, None, :] >= count[:, :, None]
        test.assertTrue((index[pad] == 0).all() and (mask_id[pad] == -1).all())


def _check_work_order(test, lay):
    """q_order / k_order: per head a permutation of the tiles, longest list first, ties in
    tile order (stable), int32 and read-only like the rest of the metadata."""
    for major in ("q", "k"):
        order, count = getattr(lay, f"{major}_order"), getattr(lay, f"{major}_count")
        test.assertEqual(order.dtype, np.int32)
        test.assertEqual(order.shape, count.shape)
        test.assertFalse(order.flags.writeable)
        tiles = lay.num_blocks if major == "q" else lay.num_kv_blocks
        for h in range(lay.num_heads):
            np.testing.assert_array_equal(np.sort(order[h]), np.arange(tiles))
            c = count[h, order[h]]
            test.assertTrue((np.diff(c) <= 0).all(), f"{major}_order[{h}] not longest first")
            ties = np.diff(c) == 0
            test.assertTrue((np.diff(order[h])[ties] > 0).all(), f"{major}_order[{h}] unstable")


class PatternTest(parameterized.TestCase):
    @parameterized.named_parameters(
        (f"{name}_n{n}_bs{bs}", name, n, bs)
        for name, (n, bs) in itertools.product(SPECS, [(64, 16), (100, 32), (37, 16), (130, 64)]))
    def test_layout_matches_token_rule(self, name, n, bs):
        pattern, spec = _spec(name, n)
        heads = 3
        if name in ("random", "bigbird") and n < 32:
            n = 40  # random_blocks needs per_row <= number of key blocks
        lay = make_layout(pattern, n, heads, bs)
        truth = _token_truth(spec, heads, n)
        np.testing.assert_array_equal(
            np.stack([pattern.token_mask(h, np.arange(n)[:, None], np.arange(n)[None], n)
                      for h in range(heads)]), truth)
        _check_layout(self, lay, truth)

    @parameterized.named_parameters(
        (f"{name}_nq{nq}_nk{nk}_bs{bs}", name, nq, nk, bs)
        for name, (nq, nk, bs) in itertools.product(
            SPECS, [(40, 100, 16), (100, 37, 32), (1, 70, 16), (64, 128, 32), (130, 64, 64)]))
    def test_queries_keys_differ(self, name, nq, nk, bs):
        """kv_len != seq_len: the token rule evaluated bottom-right aligned (layout docstring:
        query i is virtual token i + L - N_q, key j is j + L - N_kv, L = max(N_q, N_kv)),
        exactly, at block-aligned and unaligned shifts."""
        pattern, spec = _spec(name, max(nq, nk))
        heads = 3
        lay = make_layout(pattern, nq, heads, bs, kv_len=nk)
        n = max(nq, nk)
        i = np.arange(nq)[:, None] + n - nq
        j = np.arange(nk)[None, :] + n - nk
        truth = np.stack([np.broadcast_to(spec(h, i, j, n), (nq, nk)) for h in range(heads)])
        self.assertEqual((lay.seq_len, lay.kv_len), (nq, nk))
        _check_layout(self, lay, truth)

    def test_causal_bottom_right_rule(self):
        """FlashAttention 2.1+'s rule in so many words: query i sees key j iff
        j <= i + N_kv - N_q; decode (one query) sees every key; with N_q > N_kv the first
        N_q - N_kv queries see none."""
        for nq, nk in ((16, 50), (1, 50), (50, 16), (33, 33)):
            with self.subTest(nq=nq, nk=nk):
                mask = make_layout(P.causal(), nq, 1, 16, kv_len=nk).dense_mask()[0]
                i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
                np.testing.assert_array_equal(mask, j <= i + nk - nq)
        self.assertTrue(make_layout(P.causal(), 1, 1, 16, kv_len=50).dense_mask().all())
        self.assertFalse(make_layout(P.causal(), 50, 1, 16, kv_len=16).dense_mask()[0, :34].any())

    def test_documents_lengths_are_data(self):
        """Two packings of one total: same metadata shapes up to ELL width (a multiple of 16)
        and mask count, and the block kinds come from the structure alone for aligned
        boundaries (no partial tiles but the causal diagonal)."""
        a = make_layout(P.documents([128, 64, 320]) & P.causal(), 512, 2, 64)
        self.assertEqual(int(a.masks.shape[0]), 1)  # only the causal diagonal mask
        b = make_layout(P.documents([100, 300, 112]) & P.causal(), 512, 2, 64)
        for name in ("q_count", "k_count", "q_order"):
            self.assertEqual(getattr(a, name).shape, getattr(b, name).shape)
        self.assertEqual(a.q_index.shape[-1] % 16, 0)
        self.assertEqual(b.q_index.shape[-1] % 16, 0)
        self.assertEqual(P.documents([1, 2]), P.documents((1, 2)))

    def test_per_batch_row_documents(self):
        """Per-row documents (one list of lengths per batch row): a layout with ``batch = B``
        whose tables are the rows' own layouts stacked row-major (B * H table heads), up to the
        ELL width; ``dense_mask`` is [B, H, N, N]; a head slice keeps those heads of every row;
        ``flat()`` is the same tables as an ordinary layout of B * H heads."""
        rows = ((7, 40, 1, 52), (100,), (50, 50))
        causal_rows = [P.documents(r) & P.causal() for r in rows]
        for pattern, alone in ((P.documents(rows) & P.causal(), causal_rows),
                               (P.per_batch_row(causal_rows) | P.global_tokens(3),
                                [p | P.global_tokens(3) for p in causal_rows])):
            with self.subTest(pattern=pattern):
                lay = make_layout(pattern, 100, 2, 32)
                self.assertEqual((lay.batch, lay.num_heads, lay.table_heads), (3, 2, 6))
                singles = [make_layout(p, 100, 2, 32) for p in alone]
                dense = lay.dense_mask()
                self.assertEqual(dense.shape, (3, 2, 100, 100))
                for r, single in enumerate(singles):
                    np.testing.assert_array_equal(dense[r], single.dense_mask())
                    rows_r = slice(2 * r, 2 * r + 2)
                    for name in ("block_mask", "q_count", "q_partial", "k_count", "k_partial",
                                 "q_order", "k_order"):
                        np.testing.assert_array_equal(getattr(lay, name)[rows_r],
                                                      getattr(single, name), err_msg=name)
                    w = single.q_index.shape[-1]
                    np.testing.assert_array_equal(lay.q_index[rows_r, :, :w], single.q_index)
                part = lay.heads(1, 2)
                self.assertEqual((part.batch, part.num_heads), (3, 1))
                np.testing.assert_array_equal(part.dense_mask(), dense[:, 1:2])
                flat = lay.flat()
                self.assertIs(flat, lay.flat())
                self.assertEqual((flat.batch, flat.num_heads), (None, 6))
                np.testing.assert_array_equal(flat.dense_mask(), dense.reshape(6, 100, 100))
                # The flat layout's pattern rebuilds it (schedule.kernel_layout does so at
                # another block), as does the flat view of a head slice.
                again = make_layout(flat.pattern, 100, 6, 32)
                np.testing.assert_array_equal(again.dense_mask(), flat.dense_mask())
                np.testing.assert_array_equal(
                    make_layout(part.flat().pattern, 100, 3, 16).dense_mask(),
                    dense[:, 1].reshape(3, 100, 100))
        # Rows with equal patterns share masks and metadata: one row's worth of mask table.
        same = make_layout(P.documents([[30, 70]] * 4) & P.causal(), 100, 1, 32)
        one = make_layout(P.documents([30, 70]) & P.causal(), 100, 1, 32)
        self.assertEqual(same.masks.shape, one.masks.shape)
        self.assertIn("batch=4", repr(same))

    def test_random_shapes_and_combinations(self):
        rng = np.random.default_rng(0)
        names = [x for x in SPECS if not x.startswith("documents")]  # those depend on n
        for _ in range(25):
            a, b = (str(x) for x in rng.choice(names, 2))  # plain types: xdist sends subtests
            op = int(rng.integers(2))
            (pa, sa), (pb, sb) = SPECS[a], SPECS[b]
            pattern = (pa | pb) if op else (pa & pb)
            spec = ((lambda h, i, j, n, sa=sa, sb=sb: sa(h, i, j, n) | sb(h, i, j, n)) if op
                    else (lambda h, i, j, n, sa=sa, sb=sb: sa(h, i, j, n) & sb(h, i, j, n)))
            n = int(rng.integers(33, 200))
            bs = int(rng.choice([16, 32, 64, 128]))
            heads = int(rng.integers(1, 5))
            with self.subTest(a=a, b=b, op=op, n=n, bs=bs, heads=heads):
                _check_layout(self, make_layout(pattern, n, heads, bs),
                              _token_truth(spec, heads, n))

    def test_literal_block_masks(self):
        # 4 tiles of 16 tokens each (N = 64), one head.
        def bm(p, n=64, bs=16):
            return make_layout(p, n, 1, bs).block_mask[0].tolist()

        self.assertEqual(bm(P.dense()), [[2] * 4] * 4)
        self.assertEqual(bm(P.causal()), [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]])
        self.assertEqual(bm(P.local(16, 0)),
                         [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])
        self.assertEqual(bm(P.block_diagonal(32)),
                         [[2, 2, 0, 0], [2, 2, 0, 0], [0, 0, 2, 2], [0, 0, 2, 2]])
        self.assertEqual(bm(P.fixed(32, 16)),
                         [[2, 2, 0, 2], [2, 2, 0, 2], [0, 2, 2, 2], [0, 2, 2, 2]])
        self.assertEqual(bm(P.strided(2, 16, offset=1)), [[0, 2, 0, 2]] * 4)
        self.assertEqual(bm(P.global_tokens(8)),
                         [[1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]])
        self.assertEqual(bm(P.block_local(16, 1, 0)),
                         [[2, 0, 0, 0], [2, 2, 0, 0], [0, 2, 2, 0], [0, 0, 2, 2]])
        self.assertEqual(bm(P.strided(2, 16) & P.causal()),
                         [[1, 0, 0, 0], [2, 0, 0, 0], [2, 0, 1, 0], [2, 0, 2, 0]])
        self.assertEqual(bm(P.strided(2, 16) | P.causal()),
                         [[2, 0, 2, 0], [2, 1, 2, 0], [2, 2, 2, 0], [2, 2, 2, 1]])
        self.assertEqual(bm(P.longformer(32, 16)),
                         [[2, 2, 2, 2], [2, 2, 1, 0], [2, 1, 2, 1], [2, 0, 1, 2]])
        self.assertEqual(
            make_layout(P.per_head([P.causal(), P.block_diagonal(32)]), 64, 2, 16)
            .block_mask[:, 0].tolist(), [[1, 0, 0, 0], [2, 2, 0, 0]])
        # Ragged: 40 tokens in tiles of 16; the last tile has 8 valid rows/cols.
        self.assertEqual(bm(P.causal(), n=40), [[1, 0, 0], [2, 1, 0], [2, 2, 1]])
        self.assertEqual(bm(P.dense(), n=40), [[2] * 3] * 3)
        self.assertEqual(bm(P.local(23, 0), n=40), [[1, 0, 0], [1, 1, 0], [1, 2, 1]])
        # Random: per_row=1 of 4 blocks, every row exactly one full tile. The exact blocks pin
        # the documented draw (default_rng((seed, h)), Floyd's sampling); the property test
        # checks them against an independent re-statement of that draw.
        rnd = np.array(bm(P.random_blocks(1, 16, seed=0)))
        self.assertEqual(sorted(set(rnd.ravel().tolist())), [0, 2])
        self.assertEqual((rnd == 2).sum(1).tolist(), [1, 1, 1, 1])
        self.assertEqual(rnd.tolist(), [[0, 0, 0, 2], [0, 0, 2, 0], [0, 0, 2, 0], [0, 2, 0, 0]])
        # Pattern blocks of 8 in tiles of 16: one random 8 x 8 cell per 8 query rows.
        self.assertEqual(bm(P.random_blocks(1, 8, seed=0)),
                         [[0, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
        self.assertEqual(bm(P.bigbird(16, 3, 1, 1, seed=0), n=96),
                         [[2, 2, 2, 2, 2, 2], [2, 2, 2, 2, 0, 0], [2, 2, 2, 2, 0, 0],
                          [2, 2, 2, 2, 2, 0], [2, 2, 0, 2, 2, 2], [2, 0, 0, 0, 2, 2]])

    def test_masks_are_deduplicated(self):
        lay = make_layout(P.causal(), 1024, 8, 64)
        self.assertEqual(lay.masks.shape, (1, 64, 2))  # one diagonal mask for all tiles/heads
        lay = make_layout(P.causal(), 1000, 2, 64)      # + the ragged last diagonal tile
        self.assertEqual(lay.masks.shape[0], 2)

    def test_heads_slice_equals_layout_of_those_heads(self):
        for name in ("strided_per_head", "random", "per_head", "bigbird"):
            pattern, _ = SPECS[name]
            full = make_layout(pattern, 96, 6, 16)
            for a, b in [(0, 2), (2, 4), (3, 6), (5, 6)]:
                part = full.heads(a, b)
                np.testing.assert_array_equal(part.dense_mask(), full.dense_mask()[a:b])
                np.testing.assert_array_equal(part.block_mask, full.block_mask[a:b])
                # ...and equal to building the sliced pattern alone.
                alone = make_layout(part.pattern, 96, b - a, 16)
                np.testing.assert_array_equal(alone.dense_mask(), part.dense_mask())
                np.testing.assert_array_equal(alone.block_mask, part.block_mask)
                for nm in ("q_count", "q_partial", "k_count", "k_partial", "q_order", "k_order"):
                    np.testing.assert_array_equal(getattr(alone, nm), getattr(part, nm))
                _check_work_order(self, part)
        with self.assertRaisesRegex(ValueError, "heads"):
            full.heads(4, 2)

    def test_work_order_examples(self):
        """Causal: last (longest) row first; BigBird: the global rows lead; the metadata the
        kernels get carries both orders."""
        lay = make_layout(P.causal(), 256, 2, 64)
        self.assertEqual(lay.q_order.tolist(), [[3, 2, 1, 0]] * 2)
        self.assertEqual(lay.k_order.tolist(), [[0, 1, 2, 3]] * 2)
        self.assertIn("q_order", lay.metadata())
        self.assertIn("k_order", lay.metadata())
        self.assertEqual(work_order(np.array([[2, 5, 2, 5, 1]])).tolist(), [[1, 3, 0, 2, 4]])

    def test_mask_quarters_say_which_quarters_of_each_partial_tile_hold_a_pair(self):
        for name in ("local", "neighborhood_2d", "masked_rows", "causal"):
            for n, bs in [(512, 128), (200, 32), (97, 16)]:
                lay = make_layout(example_pattern(name, n, bs), n, 2, bs)
                self.assertEqual(lay.mask_quarters.shape, (lay.masks.shape[0],))
                half = bs // 2
                for h, i in zip(*np.nonzero(lay.q_partial), strict=True):
                    for e in range(lay.q_partial[h, i]):
                        tile = lay.tile_mask(h, i, lay.q_index[h, i, e])
                        want = sum(int(tile[r * half:(r + 1) * half,
                                            c * half:(c + 1) * half].any()) << (2 * r + c)
                                   for r in range(2) for c in range(2))
                        self.assertEqual(lay.mask_quarters[lay.q_mask_id[h, i, e]], want,
                                         (name, n, bs, h, i, e))
        # Causal's diagonal tile: all but the upper right (early queries, late keys).
        self.assertEqual(make_layout(P.causal(), 256, 1, 128).mask_quarters.tolist(), [13])

    def test_skip_quarters_needs_a_twentieth_of_the_quarters_empty(self):
        self.assertFalse(make_layout(P.causal(), 8192, 1, 128).skip_quarters)  # 1 of 130
        self.assertTrue(make_layout(P.causal(), 256, 1, 128).skip_quarters)  # 1 of 12
        self.assertFalse(make_layout(P.dense(), 512, 1, 128).skip_quarters)  # no partial tile
        self.assertTrue(make_layout(P.neighborhood((16, 32), (5, 9)), 512, 1, 128).skip_quarters)

    def test_half_entries_lead_each_list_and_are_counted(self):
        # Of each query-major list: the half entries (a key half of the tile with no pair for
        # any row), then the other partial entries, then the full ones, each ascending.
        for pattern, n, bs in ((P.neighborhood((8, 16, 16), (3, 9, 9), tile_shape=(2, 8, 8)),
                                2048, 128), (P.local(320, 320) | P.global_tokens(5), 2048, 128),
                               (example_pattern("neighborhood_2d", 512, 64), 512, 64),
                               (P.causal(), 512, 128)):
            lay = make_layout(pattern, n, 2, bs)
            half = bs // 2
            for h in range(2):
                for i in range(lay.num_blocks):
                    groups = []
                    for e in range(lay.q_count[h, i]):
                        kj = lay.q_index[h, i, e]
                        tile = lay.tile_mask(h, i, kj)
                        if e >= lay.q_partial[h, i]:
                            group = 2
                        else:
                            group = int(tile[:, :half].any() and tile[:, half:].any())
                        groups.append((group, kj))
                    self.assertEqual(groups, sorted(groups), (pattern, h, i))
                    self.assertEqual(lay.q_halves[h, i], sum(g == 0 for g, _ in groups))
            self.assertEqual(lay.skip_halves, 20 * lay.q_halves.sum() >= lay.q_count.sum() > 0)
            # A layout given no counts derives them; a head slice keeps its heads'.
            np.testing.assert_array_equal(dataclasses.replace(lay, q_halves=None).q_halves,
                                          lay.q_halves)
            np.testing.assert_array_equal(lay.heads(1, 2).q_halves, lay.q_halves[1:])
        self.assertEqual(half_masks(np.array([1, 3, 5, 15, 9], np.int32)).tolist(),
                         [True, False, True, False, False])

    def test_block_size_accepts_numpy_ints(self):
        lay = make_layout(P.causal(), 64, 1, np.int64(32))
        self.assertIs(type(lay.block_size), int)
        self.assertEqual(lay.block_mask.shape, (1, 2, 2))

    def test_density_and_metadata_dtypes(self):
        lay = make_layout(P.causal(), 256, 2, 64)
        self.assertAlmostEqual(lay.density, 10 / 16)
        for name, arr in lay.metadata().items():
            self.assertEqual(arr.dtype, np.int32, name)
            self.assertFalse(arr.flags.writeable, name)

    def test_examples_registry_builds(self):
        for name in EXAMPLE_PATTERNS:
            for n, bs in [(256, 64), (200, 32), (97, 16)]:
                lay = make_layout(example_pattern(name, n, bs), n, 4, bs)
                self.assertEqual(lay.block_mask.shape, (4, -(-n // bs), -(-n // bs)))
        lay = make_layout(example_pattern("masked_rows", 128, 32), 128, 1, 32)
        rows = lay.dense_mask()[0].any(-1)
        self.assertFalse(rows[:32].any())
        self.assertTrue(rows[32:].all())
        with self.assertRaisesRegex(ValueError, "unknown pattern name"):
            example_pattern("nope", 64, 16)

    def test_large_layout_builds_without_dense_arrays(self):
        # The build-time benchmark lives in benchmarks/layout_build.py; here only correctness of
        # a long sequence: causal at N = 131072 lists nb*(nb+1)/2 tiles per head.
        lay = make_layout(P.causal(), 131072, 2, 128)
        nb = 1024
        self.assertEqual(int(lay.q_count[0].sum()), nb * (nb + 1) // 2)
        self.assertEqual(int(lay.q_partial.sum()), 2 * nb)


class SpecLayerIsFrameworkFreeTest(absltest.TestCase):
    def test_core_imports_no_framework(self):
        code = ("import sys, sparsetp.core, sparsetp.core.reference, sparsetp.core.examples; "
                "bad = [m for m in ('torch', 'jax', 'triton') if m in sys.modules]; "
                "assert not bad, bad")
        subprocess.run([sys.executable, "-c", code], check=True)


class ValueSemanticsTest(absltest.TestCase):
    def test_equality_and_hash(self):
        self.assertEqual(P.local(3, 2), P.local(3, 2))
        self.assertEqual(hash(P.bigbird(64, 3, 1, 2, 0)), hash(P.bigbird(64, 3, 1, 2, 0)))
        self.assertNotEqual(P.local(3, 2), P.local(2, 3))
        self.assertEqual(P.causal() | P.dense(), P.causal() | P.dense())
        self.assertEqual(len({P.causal(), P.causal(), P.dense()}), 2)

    def test_bool_raises(self):
        with self.assertRaisesRegex(TypeError, "ambiguous"):
            bool(P.causal())
        with self.assertRaisesRegex(TypeError, "ambiguous"):
            _ = P.causal() and P.dense()

    def test_frozen(self):
        p = P.local(3, 2)
        with self.assertRaises(AttributeError):
            p.left = 5

    def test_bad_input(self):
        cases = [
            (lambda: P.local(-1, 0), "left"),
            (lambda: P.local(0, -2), "right"),
            (lambda: P.block_diagonal(0), "size"),
            (lambda: P.fixed(0, 0), "local_size"),
            (lambda: P.fixed(8, 9), "global_size"),
            (lambda: P.strided(0, 8), "stride"),
            (lambda: P.strided(2, -8), "block"),
            (lambda: P.random_blocks(0, 8, 0), "per_row"),
            (lambda: P.global_tokens(-1), "n"),
            (lambda: P.bigbird(64, 2, 1, 1, 0), "window_blocks"),
            (lambda: P.per_head([]), "patterns"),
            (lambda: make_layout(P.causal(), 64, 1, 48), "block_size"),
            (lambda: make_layout(P.causal(), 64, 1, 64.0), "block_size"),
            (lambda: make_layout(P.causal(), 64, 1, True), "block_size"),
            (lambda: make_layout(P.causal(), 0, 1, 16), "seq_len"),
            (lambda: make_layout(P.causal(), 64, 0, 16), "num_heads"),
            (lambda: make_layout(P.causal(), 64, 1, 16, kv_len=0), "kv_len"),
            (lambda: P.documents([3, 0, 5]), "lengths"),
            (lambda: P.documents([3, -2]), "lengths"),
            (lambda: P.documents([]), "lengths"),
            (lambda: P.documents([2.5, 3]), "lengths"),
            (lambda: make_layout(P.documents([30, 30]), 64, 1, 16), "lengths"),
            (lambda: make_layout(P.documents([30, 30]) & P.causal(), 64, 1, 16), "lengths"),
            (lambda: make_layout(P.causal(), 64, 1, 16, kv_len=8.0), "kv_len"),
            (lambda: make_layout("causal", 64, 1, 16), "pattern"),
            (lambda: make_layout(P.random_blocks(5, 16, 0), 64, 1, 16), "per_row"),
            (lambda: make_layout(P.causal() | P.random_blocks(5, 16, 0), 64, 1, 16), "per_row"),
            (lambda: make_layout(P.documents([[32, 32], [30, 30]]), 64, 1, 16),
             r"batch row 1: document lengths sum to 60"),
            (lambda: P.documents([[32, 32], 64]), r"lengths must be one list"),
            (lambda: P.documents([[32, 32], [0, 64]]), r"lengths\[0\]"),
            (lambda: P.documents([[64]] * 2) & P.documents([[64]] * 3), r"batch rows.*\[2, 3\]"),
            (lambda: P.per_head([P.documents([[64]] * 2), P.documents([[64]] * 3)]),
             r"per_head patterns"),
            (lambda: P.per_batch_row([P.documents([[64]] * 2)]), r"patterns\[0\].*nest"),
            (lambda: P.per_batch_row([P.causal(), "causal"]), r"patterns\[1\]"),
            (lambda: P.per_batch_row([]), r"patterns"),
            (lambda: P.documents([[64]] * 2).token_mask(0, 1, 1, 64), r"make_layout"),
        ]
        for fn, name in cases:
            with self.subTest(name=name):
                with self.assertRaisesRegex(ValueError, name):
                    fn()


if __name__ == "__main__":
    absltest.main()
