"""Neighbourhood attention (``patterns.neighborhood``, NATTEN 0.21 semantics).

* The token rule against a brute-force re-statement of NATTEN's formula (loops over grid
  coordinates, many small configs) and the layouts against the token rule: the semantic check
  that runs everywhere.
* Tiled order (``grid_tiling``): permute, attend, unpermute equals row-major attention.
* Bad input: ``ValueError`` naming the argument.
* Against the peer: sparsetp's torch frontend (Triton interpreter on CPU) always against the
  float64 oracle; NATTEN's ``na1d/na2d/na3d`` (``pip install sparsetp[natten]``) against the same
  oracle where NATTEN is installed. On CPU NATTEN runs through FlexAttention, which has no
  backward there, so NATTEN's gradients are compared only on a CUDA GPU; sparsetp's gradients
  are always compared with the oracle.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
from unittest import mock

import numpy as np
import testing_utils as tu
from absl.testing import absltest, parameterized
from layout_test import _check_layout

from sparsetp.core import grid_tiling, make_layout, reference
from sparsetp.core import layout as layout_module
from sparsetp.core import patterns as P

HAS_NATTEN = importlib.util.find_spec("natten") is not None
NO_NATTEN = "NATTEN is not installed (pip install 'sparsetp[natten]')"


def natten_rule(grid, kernel, dilation, causal) -> np.ndarray:
    """bool[n, n]: NATTEN's neighbour rule, written out per coordinate pair (tiny grids)."""
    coords = list(itertools.product(*[range(length) for length in grid]))
    out = np.zeros((len(coords), len(coords)), bool)
    for a, ci in enumerate(coords):
        for b, cj in enumerate(coords):
            ok = True
            for length, k, d, c, i, j in zip(grid, kernel, dilation, causal, ci, cj,
                                             strict=True):
                p, t = i // d, j // d
                groups = len([x for x in range(length) if x % d == i % d])
                if i % d != j % d:
                    ok = False
                elif c:
                    ok &= p - k + 1 <= t <= p
                else:
                    s = min(max(p - k // 2, 0), groups - k)
                    ok &= s <= t < s + k
            out[a, b] = ok
    return out


def random_config(rng, dims, max_len):
    grid = tuple(int(x) for x in rng.integers(1, max_len + 1, size=dims))
    dil = tuple(int(rng.integers(1, min(3, length) + 1)) for length in grid)
    kernel = tuple(int(rng.integers(1, length // d + 1))
                   for length, d in zip(grid, dil, strict=True))
    causal = tuple(bool(x) for x in rng.integers(0, 2, size=dims))
    return grid, kernel, dil, causal


class SemanticsTest(parameterized.TestCase):
    def test_literal_windows(self):
        n = 8
        row = lambda p, i: np.nonzero(p.token_mask(0, i, np.arange(n), n))[0].tolist()
        p = P.neighborhood(8, 3)
        self.assertEqual(row(p, 0), [0, 1, 2])      # shifted inward at the edge
        self.assertEqual(row(p, 4), [3, 4, 5])
        self.assertEqual(row(p, 7), [5, 6, 7])
        p = P.neighborhood(8, 4)                     # even: k // 2 before, k // 2 - 1 after
        self.assertEqual(row(p, 4), [2, 3, 4, 5])
        p = P.neighborhood(8, 2, dilation=3)         # residues mod 3; L_g is 3, 3, 2
        self.assertEqual(row(p, 7), [4, 7])
        self.assertEqual(row(p, 0), [0, 3])
        p = P.neighborhood(8, 3, causal=True)
        self.assertEqual(row(p, 1), [0, 1])
        self.assertEqual(row(p, 5), [3, 4, 5])

    @parameterized.parameters(1, 2, 3)
    def test_token_mask_and_layout_match_natten_rule(self, dims):
        rng = np.random.default_rng(dims)
        max_len = {1: 40, 2: 9, 3: 5}[dims]
        for _ in range(30):
            grid, kernel, dil, causal = random_config(rng, dims, max_len)
            n = int(np.prod(grid))
            p = P.neighborhood(grid, kernel, dil, causal)
            truth = natten_rule(grid, kernel, dil, causal)
            with self.subTest(grid=grid, kernel=kernel, dilation=dil, causal=causal):
                got = p.token_mask(0, np.arange(n)[:, None], np.arange(n)[None, :], n)
                np.testing.assert_array_equal(got, truth)
                for bs in (16, 32):
                    _check_layout(self, make_layout(p, n, 1, bs), truth[None])

    def test_composes(self):
        grid = (6, 7)
        n = 42
        nb = natten_rule(grid, (3, 4), (1, 1), (False, True))
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        cases = {
            "global": (P.neighborhood(grid, (3, 4), causal=(False, True)) | P.global_tokens(3),
                       nb | (i < 3) | (j < 3)),
            "and_causal": (P.neighborhood(grid, (3, 4), causal=(False, True)) & P.causal(),
                           nb & (j <= i)),
            "per_head": (P.per_head([P.neighborhood(grid, (3, 4), causal=(False, True)),
                                     P.local(2, 0)]), None),
        }
        for name, (p, truth) in cases.items():
            with self.subTest(name):
                lay = make_layout(p, n, 2, 16)
                if truth is None:
                    truth = np.stack([nb, (j <= i) & (j >= i - 2)])
                else:
                    truth = np.stack([truth, truth])
                _check_layout(self, lay, truth)

    @parameterized.parameters(
        ((2000,), (701,), (1,), (False,), 16),
        ((1500,), (300,), (3,), (False,), 32),
        ((1200,), (500,), (2,), (True,), 16),
        ((40, 90), (9, 61), (2, 1), (False, False), 16),
    )
    def test_clamped_window_classes(self, grid, kernel, dil, causal, bs):
        """Wide windows clamped at the edges give many absolute tile keys; the layout merges
        them by what decides the mask (``_window_key``). Exact against the token rule, and
        tiles of one class have one mask."""
        n = int(np.prod(grid))
        p = P.neighborhood(grid, kernel, dil, causal)
        i = np.arange(n)
        _check_layout(self, make_layout(p, n, 1, bs), p.token_mask(0, i[:, None], i, n)[None])
        qi, kj, _ = p._sparse_tiles(0, bs, n)
        interior = (qi < n // bs) & (kj < n // bs)
        qi, kj = qi[interior], kj[interior]
        classes = p._tile_classes(0, bs, n, qi, kj)
        r = np.arange(bs)
        masks = p.token_mask(0, qi[:, None, None] * bs + r[:, None], kj[:, None, None] * bs + r,
                             n)
        for c in np.unique(classes):
            same = masks[classes == c]
            self.assertTrue((same == same[0]).all(), c)

    def test_large_3d_layout_is_exact_on_sampled_rows(self):
        """32 x 64 x 64 tokens, kernel 7: the sparse build agrees with the token rule on
        sampled query tiles (every key), and every query has exactly 343 neighbours."""
        grid, n, bs = (32, 64, 64), 131072, 128
        p = P.neighborhood(grid, 7)
        lay = make_layout(p, n, 1, bs)
        self.assertEqual(lay.block_mask.shape, (1, n // bs, n // bs))
        for qi in (0, 1, 37, 500, 1023):
            rows = qi * bs + np.arange(bs)
            truth = p.token_mask(0, rows[:, None], np.arange(n)[None, :], n)
            self.assertTrue((truth.sum(1) == 343).all())
            got = np.zeros_like(truth)
            for kj in range(lay.num_blocks):
                got[:, kj * bs:(kj + 1) * bs] = lay.tile_mask(0, qi, kj)
            np.testing.assert_array_equal(got, truth)


class TilingTest(parameterized.TestCase):
    def test_grid_tiling_is_a_permutation_of_compact_tiles(self):
        perm, inv = grid_tiling((4, 6), (2, 3))
        np.testing.assert_array_equal(perm[inv], np.arange(24))
        np.testing.assert_array_equal(perm[:6], [0, 1, 2, 6, 7, 8])
        rows, cols = np.divmod(perm.reshape(4, 6), 6)  # each 6-token run is a 2 x 3 box
        for t in range(4):
            self.assertEqual(np.ptp(rows[t]) + 1, 2)
            self.assertEqual(np.ptp(cols[t]) + 1, 3)

    @parameterized.parameters(
        ((8, 8), (4, 4), (3, 5), (1, 1), (False, False)),
        ((8, 12), (4, 4), (3, 4), (2, 2), (True, False)),
        ((4, 4, 8), (2, 2, 4), (3, 2, 3), (1, 2, 2), (False, True, False)),
        ((24,), (8,), (5,), (2,), (False,)),
    )
    def test_permute_attend_unpermute_equals_row_major(self, grid, tile, kernel, dil, causal):
        n = int(np.prod(grid))
        perm, inv = grid_tiling(grid, tile)
        row_major = P.neighborhood(grid, kernel, dil, causal)
        tiled = P.neighborhood(grid, kernel, dil, causal, tile_shape=tile)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        np.testing.assert_array_equal(tiled.token_mask(0, i, j, n),
                                      row_major.token_mask(0, perm[i], perm[j], n))
        truth = natten_rule(grid, kernel, dil, causal)[perm][:, perm]
        lay_t = make_layout(tiled, n, 1, 16)
        _check_layout(self, lay_t, truth[None])
        q, k, v, _ = tu.random_inputs(0, (1, 1, n, 8), "float32")
        out_rm, _ = reference.attention(q, k, v, make_layout(row_major, n, 1, 16))
        out_t, _ = reference.attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], lay_t)
        np.testing.assert_allclose(out_t[:, :, inv], out_rm, rtol=1e-12, atol=1e-12)

    def test_tiled_layout_is_sparser(self):
        """A 13 x 13 window on 64 x 64 tokens, 64-token tiles: row-major, a tile is one grid
        row and sees 13 rows (13 tiles); tiled 8 x 8, its 20 x 20 key box meets 3 x 3 tiles
        (2 per axis at the edges: 2 + 6 * 3 + 2 = 22 per axis).
        (Tiling pays when the window is wide against the tile: a 7 x 7 window on 32 x 32 in
        8 x 8 tiles lists 100 tiles against 76 row-major.)"""
        grid, n = (64, 64), 4096
        rm = make_layout(P.neighborhood(grid, 13), n, 1, 64)
        tl = make_layout(P.neighborhood(grid, 13, tile_shape=(8, 8)), n, 1, 64)
        self.assertEqual(rm.nnz_blocks, 64 * 13)
        self.assertEqual(tl.nnz_blocks, 22 * 22)


def _random_composition(rng, heads):
    """(pattern, n): a neighbourhood (1-3 D, dilations, causal axes, sometimes tiled) composed
    with global tokens (0 to more than n), causal, local bands, documents, strided columns,
    random blocks, another neighbourhood, or per_head mixes of such with dense patterns."""
    dims = int(rng.integers(1, 4))
    grid, kernel, dil, causal = random_config(rng, dims, {1: 300, 2: 40, 3: 14}[dims])
    tile = None
    if rng.random() < 0.3:  # a divisor of each axis
        tile = tuple(int(rng.choice([t for t in range(1, g + 1) if g % t == 0])) for g in grid)
    nbh = P.neighborhood(grid, kernel, dil, causal, tile_shape=tile)
    n = int(np.prod(grid))
    glob = P.global_tokens(int(rng.choice([0, 1, int(rng.integers(1, 40)),
                                           int(rng.integers(1, n + 20))])))
    band = P.local(int(rng.integers(0, 60)), int(rng.integers(0, 60)))
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False))
    docs = P.documents(np.diff(np.concatenate([[0], cuts, [n]])).tolist()) if n > 1 else band
    other = P.neighborhood(grid, tuple(1 + k // 2 for k in kernel), 1, False)
    choices = [
        nbh | glob, nbh & P.causal(), nbh & band, nbh | band, (nbh & P.causal()) | glob,
        nbh | glob | band, (nbh | glob) & P.causal(), nbh & docs, nbh | other,
        nbh & P.strided(3, int(rng.integers(1, 20)), per_head_offset=True),
        nbh & P.random_blocks(1, int(rng.integers(1, 40)), seed=int(rng.integers(9))),
        (nbh | glob) & band, glob, band, glob | band, nbh,
    ]
    pick = [choices[int(rng.integers(len(choices)))] for _ in range(heads)]
    if heads > 1 and rng.random() < 0.5:
        pick[int(rng.integers(heads))] = [P.causal(), P.dense(), P.strided(2, 8)][
            int(rng.integers(3))]
    return (pick[0] if heads == 1 else P.per_head(pick)), n


def _assert_same_layout(test, a, b):
    """Every field of two layouts equal, arrays by dtype, shape and value."""
    for f in dataclasses.fields(a):
        if f.name == "handle":  # a process-unique name, not part of the value
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            test.assertEqual((x.dtype, x.shape), (y.dtype, y.shape), f.name)
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            test.assertEqual(x, y, f.name)


def _both_ways(p, n, heads, bs):
    """The layout from the sparse tile lists (every part that can list its tiles does) and the
    one from the dense nb x nb kinds."""
    P._KINDS_CACHE.clear()  # no dense kinds left from another build
    with mock.patch.object(P, "_SPARSE_MAX_FRACTION", 1.0):
        sparse = make_layout(p, n, heads, bs)
    with mock.patch.object(layout_module, "_USE_SPARSE_TILES", False):
        dense = make_layout(p, n, heads, bs)
    return sparse, dense


class SparseCompositionTest(absltest.TestCase):
    """Unions and intersections with a neighbourhood (and global tokens, bands) list their
    tiles sparsely; the layout must be the dense path's, bit for bit."""

    def test_listed_kinds_are_the_dense_kinds(self):
        """``_sparse_tiles`` scattered, and ``_kinds_at`` everywhere, equal ``block_kinds``."""
        rng = np.random.default_rng(7)
        with mock.patch.object(P, "_SPARSE_MAX_FRACTION", 1.0):
            for t in range(120):
                p, n = _random_composition(rng, 1)
                bs = int(rng.choice([16, 32, 64, 128]))
                nb = -(-n // bs)
                with self.subTest(t=t, pattern=repr(p), bs=bs):
                    dense = np.broadcast_to(p.block_kinds(0, bs, n), (nb, nb))
                    r = np.arange(nb)
                    np.testing.assert_array_equal(p._kinds_at(0, bs, n, r[:, None], r), dense)
                    listed = p._sparse_tiles(0, bs, n)
                    if isinstance(p, (P._Intersection, P.Neighborhood)) or any(
                            isinstance(x, P.Neighborhood) for x in getattr(p, "parts", ())):
                        self.assertIsNotNone(listed)
                    if listed is not None:
                        qi, kj, kind = listed
                        order = qi * nb + kj
                        self.assertTrue((np.diff(order) > 0).all())  # row-major, each once
                        self.assertTrue(np.isin(kind, [P.PARTIAL, P.FULL]).all())
                        got = np.zeros((nb, nb), np.int8)
                        got[qi, kj] = kind
                        np.testing.assert_array_equal(got, dense)
                    if isinstance(p, P._Union):  # classes from the parts' kinds, as before
                        qi, kj = np.nonzero(dense == P.PARTIAL)
                        classes = []
                        for part in p.parts:
                            k = np.broadcast_to(part.block_kinds(0, bs, n), (nb, nb))[qi, kj]
                            c = part._tile_classes(0, bs, n, qi, kj) if (
                                k == P.PARTIAL).any() else k
                            classes += [k.astype(np.int64), np.where(k == P.PARTIAL, c, 0)]
                        P._KINDS_CACHE.clear()  # the parts' closed forms, not dense kinds
                        np.testing.assert_array_equal(p._tile_classes(0, bs, n, qi, kj),
                                                      P._combine_classes(classes))

    def test_layout_is_the_dense_paths_bit_for_bit(self):
        rng = np.random.default_rng(32)
        for t in range(150):
            heads = int(rng.integers(1, 4))
            p, n = _random_composition(rng, heads)
            bs = int(rng.choice([16, 32, 64, 128]))
            with self.subTest(t=t, pattern=repr(p), bs=bs, heads=heads):
                sparse, dense = _both_ways(p, n, heads, bs)
                _assert_same_layout(self, sparse, dense)
                if n <= 400:  # and both right, token for token
                    i = np.arange(n)
                    _check_layout(self, sparse, np.stack([
                        p.token_mask(h, i[:, None], i, n) for h in range(heads)]))

    def test_issue_case_at_full_size(self):
        """The benchmark's union at N = 131072 (block 128) goes the sparse way, with the
        default thresholds, and gives the dense path's layout."""
        p = P.neighborhood((32, 64, 64), 7) | P.global_tokens(64)
        self.assertIsNotNone(p._sparse_tiles(0, 128, 131072))
        sparse = make_layout(p, 131072, 2, 128)
        with mock.patch.object(layout_module, "_USE_SPARSE_TILES", False):
            dense = make_layout(p, 131072, 2, 128)
        _assert_same_layout(self, sparse, dense)
        self.assertEqual(int(sparse.q_count[0, 0]), 1024)  # a global row lists every tile


class BadInputTest(absltest.TestCase):
    def test_errors_name_the_argument(self):
        cases = [
            (lambda: P.neighborhood((4, 4), 5), "kernel_size\\[0\\] \\* dilation\\[0\\]"),
            (lambda: P.neighborhood(10, 3, dilation=4), "dilation"),
            (lambda: P.neighborhood((4, 0), 1), "grid"),
            (lambda: P.neighborhood((4, 4), 0), "kernel_size"),
            (lambda: P.neighborhood((4, 4), 1, dilation=-1), "dilation"),
            (lambda: P.neighborhood((4, 4), (3, 3, 3)), "kernel_size must be .* tuple of 2"),
            (lambda: P.neighborhood((4, 4), 3, causal=(True,)), "causal"),
            (lambda: P.neighborhood((4, 4), 3, causal="yes"), "causal"),
            (lambda: P.neighborhood((2, 2, 2, 2), 1), "1 to 3"),
            (lambda: P.neighborhood(4.0, 1), "grid"),
            (lambda: P.neighborhood((8, 8), 3, tile_shape=(3, 4)), "tile_shape\\[0\\]"),
            (lambda: grid_tiling((8, 8), (4,)), "tile_shape"),
            (lambda: make_layout(P.neighborhood((4, 5), 3), 21, 1, 16), "seq_len is 21"),
        ]
        for fn, msg in cases:
            with self.subTest(msg):
                with self.assertRaisesRegex(ValueError, msg):
                    fn()


# (grid, kernel, dilation, causal): 1-D/2-D/3-D, odd and even kernels, dilations 1-3, causal
# axes; no N is a multiple of the 16-token block.
PEER_CASES = (
    ((37,), (7,), (1,), (False,)),
    ((45,), (4,), (3,), (True,)),
    ((6, 9), (3, 4), (2, 2), (False, False)),
    ((7, 10), (4, 3), (1, 3), (True, False)),
    ((3, 4, 5), (3, 2, 3), (1, 2, 1), (False, True, True)),
    ((5, 3, 7), (2, 3, 2), (2, 1, 3), (False, False, False)),
)


def _peer_name(c):
    return "_".join("x".join(str(int(v)) for v in part) for part in c)


class PeerTest(parameterized.TestCase):
    """Outputs and gradients: sparsetp (torch) vs the float64 oracle, NATTEN vs the oracle."""

    def _inputs(self, grid, seed=0):
        n = int(np.prod(grid))
        return tu.random_inputs(seed, (1, 2, n, 16), "float32")

    @parameterized.named_parameters((_peer_name(c), *c) for c in PEER_CASES)
    def test_sparsetp_matches_oracle(self, grid, kernel, dil, causal):
        import torch  # noqa: PLC0415

        from sparsetp.backends.torch.attention import sparse_attention  # noqa: PLC0415

        n = int(np.prod(grid))
        lay = make_layout(P.neighborhood(grid, kernel, dil, causal), n, 2, 16)
        q, k, v, d_out = self._inputs(grid)
        ts = [torch.from_numpy(x).requires_grad_(True) for x in (q, k, v)]
        out = sparse_attention(*ts, lay)
        out.backward(torch.from_numpy(d_out))
        ref = reference.attention(q, k, v, lay)[0]
        tu.assert_close(out.detach().numpy(), ref, "float32", what="out")
        for name, t, r in zip("qkv", ts, reference.attention_grad(q, k, v, lay, d_out),
                              strict=True):
            tu.assert_close(t.grad.numpy(), r, "float32", grad=True, what=f"d{name}")

    @parameterized.named_parameters((_peer_name(c), *c) for c in PEER_CASES)
    def test_natten_matches_oracle(self, grid, kernel, dil, causal):
        if not HAS_NATTEN:
            self.skipTest(NO_NATTEN)
        import natten  # noqa: PLC0415
        import torch  # noqa: PLC0415

        n, dims = int(np.prod(grid)), len(grid)
        lay = make_layout(P.neighborhood(grid, kernel, dil, causal), n, 2, 16)
        q, k, v, d_out = self._inputs(grid)
        na = {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[dims]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # Flex on CPU has no backward: gradients only on a GPU.
        grads = device == "cuda"

        def to_natten(x):  # [B, H, N, D] -> [B, *grid, H, D]
            t = torch.from_numpy(np.ascontiguousarray(
                np.moveaxis(x, 1, 2).reshape(1, *grid, 2, 16))).to(device)
            return t.requires_grad_(grads)

        def from_natten(t):
            x = t.detach().float().cpu().numpy().reshape(1, n, 2, 16)
            return np.moveaxis(x, 2, 1)

        ts = [to_natten(x) for x in (q, k, v)]
        out = na(*ts, kernel_size=kernel, dilation=dil, is_causal=causal)
        tu.assert_close(from_natten(out), reference.attention(q, k, v, lay)[0], "float32",
                        what="natten out")
        # The neighbour sets themselves: with q = k = 0 every neighbour weighs the same, so a
        # one-hot v per key reads NATTEN's mask out of the output.
        eye = np.zeros((1, 2, n, 16), np.float32)
        for start in range(0, n, 16):
            width = min(16, n - start)
            eye[:, :, start:start + width] = 0
            eye[:, :, np.arange(start, start + width), np.arange(width)] = 1
            zero = to_natten(np.zeros_like(eye)).detach()
            o = from_natten(na(zero, zero, to_natten(eye).detach(), kernel_size=kernel,
                               dilation=dil, is_causal=causal))
            seen = o[0, 0, :, :width] > 0
            np.testing.assert_array_equal(seen, lay.dense_mask()[0][:, start:start + width])
            eye[:] = 0
        if not grads:
            return
        out.backward(to_natten(d_out))
        for name, t, r in zip("qkv", ts, reference.attention_grad(q, k, v, lay, d_out),
                              strict=True):
            tu.assert_close(from_natten(t.grad), r, "float32", grad=True, what=f"natten d{name}")


if __name__ == "__main__":
    absltest.main()
