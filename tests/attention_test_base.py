"""One framework-agnostic test base for block-sparse attention; subclassed per backend.

A backend test file subclasses :class:`AttentionTestBase` (import the *module*, not the class,
so pytest does not collect the base itself) and implements the hooks below on numpy arrays:

* ``dtypes``: the dtype names the backend runs (e.g. ``("float32", "bfloat16")``).
* ``forward(q, k, v, layout, scale, dtype) -> (out, lse)``: inputs are float32 numpy arrays
  (float64 for ``dtype="float64"``) whose values are exact in ``dtype``, of shape
  ``[B, H, N, D]`` and possibly non-contiguous strides (keep them if the backend can). Cast to
  ``dtype``, run, and return numpy arrays (any float dtype; they are compared in float64).
* ``backward(q, k, v, layout, scale, dtype, d_out) -> (dq, dk, dv)``: gradients of ``out`` for
  the cotangent ``d_out`` (same conventions).
* ``poison_outputs()``: a context manager during which every output buffer the backend
  allocates (out, lse, delta, dq, dk, dv) is pre-filled with NaN, so unwritten elements fail.
* ``call_raw(q, k, v, layout, **kwargs)``: call the op on numpy arrays converted to the
  backend's arrays *keeping their numpy dtype* (float16, float32, int32, ...), for the
  bad-input tests. Errors must be ``ValueError`` naming the offending argument.
* ``device_kind``: how the backend runs (``"cuda"``: compiled kernels, ``"interpreter"``: the
  kernels in Triton's interpreter, ``"cpu"``: the native CPU path, no Triton;
  :mod:`sparsetp._runtime` states the rule).
* ``poisons_outputs``: False where the backend cannot pre-fill its outputs (JAX on a GPU:
  jax-triton allocates them); the poisoned-output test then runs on the CPU class only.

Devices: every backend runs this base on CPU arrays twice, on the native CPU path (the default)
and with ``SPARSETP_INTERPRET=1`` (a subclass flag: the Triton kernel sources in the
interpreter), and on GPU arrays (compiled kernels) in a subclass that skips with "needs a CUDA
GPU" where there is none. GPU
subclasses derive from :class:`CompiledAttentionTestBase`, which adds the GPU-only cases
(every example pattern at N=1024 in bfloat16 and float16, head dims 64 and 128).

Abstract bases set ``__test__ = False`` in their own body (pytest collects every TestCase of a
file it is given, this one included); every other subclass is collected.

Every numeric test compares against the float64 oracle :mod:`sparsetp.core.reference` with the
tolerance table of :mod:`testing_utils` (rtol = atol / 10, gradients at 2 * atol).

CI cost (CPU classes): the interpreter costs ~10-30 ms per computed tile per pass on 2 cores
(the native path a few seconds for the whole base), so the matrix is sparse: every example
pattern at one small ragged shape, and dtypes / block sizes / head dims on a few patterns each.
"""

from __future__ import annotations

import contextlib

import numpy as np
import testing_utils as tu
from absl.testing import parameterized

from sparsetp.core import make_layout, reference
from sparsetp.core import patterns as P
from sparsetp.core.examples import EXAMPLE_PATTERNS, example_pattern
from sparsetp.kernels import options, schedule

# (pattern, seq_len, block_size, batch, heads, head_dim, dtype, scale): seq_len is mostly not a
# multiple of the block size (ragged last tile).
SHAPE_CASES = (
    ("causal", 80, 16, 1, 2, 16, "bfloat16", None),
    ("bigbird", 256, 64, 1, 2, 64, "bfloat16", None),
    ("strided_causal", 200, 64, 2, 2, 64, "float32", 0.3),
    ("per_head_mix", 130, 32, 1, 3, 32, "bfloat16", None),
    ("local", 70, 16, 1, 2, 64, "float32", None),
    ("masked_rows", 100, 64, 1, 2, 16, "bfloat16", 1.7),
    ("dense", 96, 32, 2, 1, 32, "float32", None),
    ("longformer", 200, 128, 1, 2, 16, "float32", None),
)

PATTERN_SHAPE = dict(seq_len=150, block_size=32, batch=1, heads=3, head_dim=32)

# GPU-only cases (CompiledAttentionTestBase): every example pattern, compiled kernels vs the
# float64 oracle at a moderate size, in both half-precision dtypes and the two head dims the
# tile heuristic treats apart; block 64 at D=64 and 128 at D=128 (both layout blocks).
COMPILED_SHAPE = dict(seq_len=1024, batch=1, heads=2)
COMPILED_CASES = tuple((name, dtype, d) for name in sorted(EXAMPLE_PATTERNS)
                       for dtype in ("bfloat16", "float16") for d in (64, 128))

# Real-model attention (GQA/MQA, queries != keys, head dims): (pattern, N_q, N_kv, block, batch,
# H, H_kv, D, dtype). Group sizes 2, 3 (not a power of two) and H (MQA); a per-head pattern
# under GQA (each query head of a group keeps its own mask); N_kv > N_q (chunked prefill,
# decode with one query), N_kv < N_q (the first N_q - N_kv queries see no key), both with GQA.
GQA_CASES = (
    ("causal", 70, 70, 16, 1, 4, 2, 16, "float32"),
    ("per_head_mix", 80, 80, 32, 2, 6, 2, 32, "float32"),
    ("local", 60, 60, 16, 1, 3, 1, 64, "bfloat16"),
    ("masked_rows", 50, 50, 16, 1, 4, 2, 16, "float32"),
)
KV_LEN_CASES = (
    ("causal", 40, 100, 16, 1, 2, 2, 16, "float32"),
    ("causal", 100, 40, 32, 1, 2, 2, 32, "float32"),
    ("local", 1, 70, 16, 2, 2, 2, 16, "float32"),
    ("bigbird", 64, 128, 32, 1, 2, 2, 32, "bfloat16"),
    ("per_head_mix", 48, 80, 16, 1, 6, 2, 16, "float32"),
    ("strided_causal", 90, 37, 16, 1, 4, 1, 16, "float32"),
)
# Head dims past the power-of-two ladder: 80 (padded to 128), 192 (padded to 256), 256; tiny N
# (the interpreter pays per element).
HEAD_DIM_CASES = (
    ("causal", 40, 40, 16, 1, 2, 2, 80, "float32"),
    ("local", 20, 20, 16, 1, 2, 1, 192, "float32"),
    ("causal", 20, 36, 16, 1, 2, 2, 256, "float32"),
    ("causal", 20, 20, 16, 1, 2, 2, 192, "bfloat16"),
)
# GPU-only (CompiledAttentionTestBase): the same features at sizes the interpreter cannot
# afford; block 128 at D=192/256 exercises schedule.kernel_layout's move to tile 64.
COMPILED_REAL_CASES = (
    ("causal", 1024, 1024, 64, 2, 8, 2, 128, "bfloat16"),
    ("bigbird", 1024, 1024, 128, 1, 6, 2, 64, "float16"),
    ("per_head_mix", 512, 512, 64, 1, 4, 1, 64, "bfloat16"),
    ("causal", 512, 1536, 64, 1, 8, 2, 128, "bfloat16"),
    ("local", 1, 1000, 64, 4, 8, 1, 128, "bfloat16"),
    ("causal", 1024, 300, 128, 1, 4, 2, 64, "float16"),
    ("causal", 512, 512, 128, 1, 4, 2, 192, "bfloat16"),
    ("causal", 512, 512, 128, 1, 2, 2, 256, "bfloat16"),
    ("local", 384, 384, 64, 1, 4, 4, 256, "float16"),
    ("causal", 512, 512, 64, 1, 2, 2, 80, "bfloat16"),
)


def _real_case_name(c) -> str:
    return f"{c[0]}_nq{c[1]}_nk{c[2]}_bs{c[3]}_b{c[4]}_h{c[5]}_hkv{c[6]}_d{c[7]}_{c[8]}"



def case(name, n, bs, b, h, d, dtype, seed=0, *, n_kv=None, h_kv=None):
    """Layout of the example pattern ``name`` and numpy inputs ``(layout, q, k, v, d_out)``;
    ``n_kv`` keys and ``h_kv`` kv heads (default ``n``, ``h``)."""
    n_kv = n if n_kv is None else n_kv
    h_kv = h if h_kv is None else h_kv
    layout = make_layout(example_pattern(name, max(n, n_kv), bs), n, h, bs, kv_len=n_kv)
    if (n_kv, h_kv) == (n, h):
        q, k, v, d_out = tu.random_inputs(seed, (b, h, n, d), dtype)
    else:
        q, d_out = tu.random_inputs(seed, (b, h, n, d), dtype, count=2)
        k, v = tu.random_inputs(seed + 1000, (b, h_kv, n_kv, d), dtype, count=2)
    return layout, q, k, v, d_out


class AttentionTestBase(parameterized.TestCase):
    """Shared correctness tests; see the module docstring for the hooks to implement."""

    __test__ = False  # abstract; see the module docstring
    dtypes: tuple[str, ...] = ()
    device_kind: str = "interpreter"
    poisons_outputs: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__test__ = cls.__dict__.get("__test__", True)

    # ------------------------------------------------------------------ hooks
    def forward(self, q, k, v, layout, scale, dtype):
        raise NotImplementedError

    def backward(self, q, k, v, layout, scale, dtype, d_out):
        raise NotImplementedError

    def poison_outputs(self) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def call_raw(self, q, k, v, layout, **kwargs):
        raise NotImplementedError

    def float64_context(self) -> contextlib.AbstractContextManager:
        """A context in which the backend computes in float64 (JAX: x64 on); default none."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ helpers
    def _case(self, name, n, bs, b, h, d, dtype, seed=0, *, n_kv=None, h_kv=None):
        return case(name, n, bs, b, h, d, dtype, seed, n_kv=n_kv, h_kv=h_kv)

    def _check_forward(self, layout, q, k, v, scale, dtype, tag):
        out, lse = self.forward(q, k, v, layout, scale, dtype)
        ref_out, ref_lse = reference.attention(q, k, v, layout, scale)
        tu.assert_close(out, ref_out, dtype, what=f"{tag} out")
        tu.assert_close(lse, ref_lse, dtype, what=f"{tag} lse")
        return out, lse

    def _check_backward(self, layout, q, k, v, scale, dtype, d_out, tag):
        grads = self.backward(q, k, v, layout, scale, dtype, d_out)
        refs = reference.attention_grad(q, k, v, layout, d_out, scale)
        # GQA: dk, dv sum the contributions of a group of query heads, each within the table's
        # error: a sum over `group` terms (testing_utils, "reduced").
        group = q.shape[1] // k.shape[1]
        for g_name, g, r in zip(("dq", "dk", "dv"), grads, refs, strict=True):
            tu.assert_close(g, r, dtype, grad=True, reduced=1 if g_name == "dq" else group,
                            what=f"{tag} {g_name}")
        return grads

    def _check_all(self, name, n, bs, b, h, d, dtype, scale=None, seed=0, *, n_kv=None,
                   h_kv=None):
        layout, q, k, v, d_out = self._case(name, n, bs, b, h, d, dtype, seed, n_kv=n_kv,
                                            h_kv=h_kv)
        tag = f"{name} N={n} N_kv={n_kv} bs={bs} B={b} H={h} H_kv={h_kv} D={d}"
        self._check_forward(layout, q, k, v, scale, dtype, tag)
        self._check_backward(layout, q, k, v, scale, dtype, d_out, tag)

    def _check_real_case(self, case, seed=0):
        name, n, n_kv, bs, b, h, h_kv, d, dtype = case
        self._check_all(name, n, bs, b, h, d, dtype, seed=seed, n_kv=n_kv, h_kv=h_kv)

    # ------------------------------------------------------------------ tests
    @parameterized.named_parameters((name, name) for name in sorted(EXAMPLE_PATTERNS))
    def test_example_pattern(self, name):
        """Every example pattern: out, LSE, dq, dk, dv vs the oracle (float32, ragged N)."""
        s = PATTERN_SHAPE
        self._check_all(name, s["seq_len"], s["block_size"], s["batch"], s["heads"],
                        s["head_dim"], "float32")

    @parameterized.named_parameters(
        (f"{c[0]}_n{c[1]}_bs{c[2]}_b{c[3]}_h{c[4]}_d{c[5]}_{c[6]}", *c) for c in SHAPE_CASES)
    def test_shapes_and_dtypes(self, name, n, bs, b, h, d, dtype, scale):
        self._check_all(name, n, bs, b, h, d, dtype, scale=scale, seed=n + bs + d)

    # (pattern, seq_len, block, heads, head_dim, scale): float64 at float64's tolerance (1e-10;
    # fp32 constants in the kernels used to leave ~1e-7). D=128 and D=32 have irrational default
    # scales.
    @parameterized.named_parameters(
        ("causal_d128", "causal", 90, 32, 1, 128, None),
        ("bigbird_d32", "bigbird", 130, 32, 2, 32, None),
        ("masked_rows_d16", "masked_rows", 70, 16, 2, 16, 0.3),
    )
    def test_float64_matches_oracle(self, name, n, bs, h, d, scale):
        """float64 inputs against the float64 oracle: the scale and the base-2 constants reach
        the fp64 kernels in fp64 (``abi.scale_args``, ``attention._stats_const``)."""
        layout, q, k, v, d_out = self._case(name, n, bs, 1, h, d, "float64", seed=n + d)
        tag = f"float64 {name} N={n} bs={bs} D={d}"
        with self.float64_context():
            self._check_forward(layout, q, k, v, scale, "float64", tag)
            self._check_backward(layout, q, k, v, scale, "float64", d_out, tag)

    @parameterized.named_parameters((_real_case_name(c), c) for c in GQA_CASES)
    def test_gqa(self, case):
        """Grouped-query / multi-query attention: k, v with H_kv heads, never repeated; out,
        LSE, dq and the group-summed dk, dv vs the oracle (which repeats k, v)."""
        self._check_real_case(case, seed=case[5] * 7 + case[6])

    @parameterized.named_parameters((_real_case_name(c), c) for c in KV_LEN_CASES)
    def test_queries_keys_differ(self, case):
        """N_q != N_kv: the pattern's diagonal aligned to the end of the keys (layout
        docstring), with and without GQA; the oracle applies the layout's dense mask."""
        self._check_real_case(case, seed=case[1] + case[2])

    @parameterized.named_parameters((_real_case_name(c), c) for c in HEAD_DIM_CASES)
    def test_head_dims(self, case):
        """Head dims off the power-of-two ladder (padded, masked columns) and up to 256."""
        self._check_real_case(case, seed=case[7])

    def test_packed_documents(self):
        """documents(l) & causal with boundaries inside tiles (token-exact partial tiles),
        under GQA, vs the oracle; then a second packing of the same total in the same process."""
        for lengths in ((7, 40, 1, 52), (50, 50)):
            with self.subTest(lengths=lengths):
                n, bs, h = 100, 32, 4
                layout = make_layout(P.documents(lengths) & P.causal(), n, h, bs)
                q, d_out = tu.random_inputs(sum(lengths[:2]), (1, h, n, 16), "float32", 2)
                k, v = tu.random_inputs(lengths[0], (1, 2, n, 16), "float32", 2)
                tag = f"documents {lengths}"
                self._check_forward(layout, q, k, v, None, "float32", tag)
                self._check_backward(layout, q, k, v, None, "float32", d_out, tag)

    # (per-row lengths, N_q, N_kv, block, H, H_kv): each batch row its own packing in one call
    # (boundaries inside tiles; a one-document row; a row of equal documents), under GQA; then
    # queries != keys (lengths sum to N_kv, the pattern aligned to the end of the keys).
    PER_ROW_CASES = (
        (((7, 40, 1, 52), (100,), (50, 50)), 100, 100, 32, 4, 2),
        (((30, 70), (1, 99)), 40, 100, 16, 2, 1),
    )

    def _per_row_case(self, lengths, n, n_kv, bs, h, h_kv, seed):
        layout = make_layout(P.documents(lengths) & P.causal(), n, h, bs, kv_len=n_kv)
        self.assertEqual((layout.batch, layout.num_heads), (len(lengths), h))
        b = len(lengths)
        q, d_out = tu.random_inputs(seed, (b, h, n, 16), "float32", 2)
        k, v = tu.random_inputs(seed + 1, (b, h_kv, n_kv, 16), "float32", 2)
        return layout, q, k, v, d_out

    @parameterized.parameters(*PER_ROW_CASES)
    def test_per_row_documents(self, lengths, n, n_kv, bs, h, h_kv):
        """Per-batch-row documents (``P.documents`` with one list per row, ``layout.batch = B``)
        in one call: out, LSE, dq, dk, dv vs the oracle (row b under its own packing), outputs
        poisoned where the backend can; each row equals a call with that row's packing alone;
        then another packing of the same total in the same process."""
        layout, q, k, v, d_out = self._per_row_case(lengths, n, n_kv, bs, h, h_kv, n + h)
        tag = f"per-row documents {lengths}"
        poison = self.poison_outputs() if self.poisons_outputs else contextlib.nullcontext()
        with poison:
            out, _ = self._check_forward(layout, q, k, v, None, "float32", tag)
            grads = self._check_backward(layout, q, k, v, None, "float32", d_out, tag)
        for r, row in enumerate(lengths):
            alone = make_layout(P.documents(row) & P.causal(), n, h, bs, kv_len=n_kv)
            sl = slice(r, r + 1)
            out_r, _ = self.forward(q[sl], k[sl], v[sl], alone, None, "float32")
            tu.assert_close(out[sl], out_r, "float32", what=f"{tag} row {r} vs alone")
            grads_r = self.backward(q[sl], k[sl], v[sl], alone, None, "float32", d_out[sl])
            for name, g, g_r in zip(("dq", "dk", "dv"), grads, grads_r, strict=True):
                tu.assert_close(np.asarray(g)[sl], g_r, "float32", grad=True,
                                reduced=h // h_kv, what=f"{tag} row {r} {name} vs alone")
        other = [tuple(reversed(row)) for row in lengths]
        layout2 = make_layout(P.documents(other) & P.causal(), n, h, bs, kv_len=n_kv)
        self._check_forward(layout2, q, k, v, None, "float32", f"per-row documents {other}")

    def test_per_row_documents_head_slice_and_strides(self):
        """A per-row layout's head slice (what a tensor-parallel rank holds: heads [1, 3) of
        every row) on [B, H, N, D] views of [B, N, H, D] buffers (batch cannot fold into heads
        as a view: the frontends copy), vs the oracle of the slice."""
        lengths = ((20, 44), (64,), (1, 62, 1))
        b, h, n, d = 3, 4, 64, 16
        layout = make_layout(P.documents(lengths) & P.causal(), n, h, 16).heads(1, 3)
        self.assertEqual((layout.batch, layout.num_heads), (3, 2))
        rng = np.random.default_rng(5)
        q, k, v, d_out = (np.swapaxes(rng.standard_normal((b, n, 2, d)).astype(np.float32), 1, 2)
                          for _ in range(4))
        self.assertFalse(q.flags.c_contiguous)
        self._check_forward(layout, q, k, v, None, "float32", "per-row slice")
        self._check_backward(layout, q, k, v, None, "float32", d_out, "per-row slice")

    def test_per_row_documents_larger_kernel_tile(self):
        """A per-row layout launched at kernel tile 64 (its flat layout rebuilt from the rows'
        patterns at the larger block, schedule.kernel_layout), vs the oracle of the layout."""
        layout, q, k, v, d_out = self._per_row_case(((10, 90), (33, 33, 34)), 100, 100, 16,
                                                    2, 2, seed=8)
        with options.launch_options(kernel_tile=64):
            if self.device_kind != "cpu":  # the native CPU path runs the layout as is
                self.assertEqual(
                    schedule.kernel_layout(layout.flat(), self.device_kind).block_size, 64)
            self._check_forward(layout, q, k, v, None, "float32", "per-row tile 64")
            self._check_backward(layout, q, k, v, None, "float32", d_out, "per-row tile 64")
        # The GPU's cost model ("auto") reads the flat layout's pattern per table head: same
        # token mask at whatever tile it picks (host-only, so checked on every class).
        flat = layout.flat()
        chosen = schedule.kernel_layout(flat, "cuda", head_dim=16, dtype="float32")
        np.testing.assert_array_equal(chosen.dense_mask(), flat.dense_mask())

    def test_gqa_matches_repeated_kv_and_is_deterministic(self):
        """GQA equals multi-head attention on k, v repeated per group (same layout), with dk,
        dv the group sums of the repeated run's; two GQA runs agree bitwise (the group sum
        runs in a fixed order in one program, no atomics)."""
        h, h_kv, dtype = 6, 2, "float32"
        layout, q, k, v, d_out = self._case("per_head_mix", 64, 16, 1, h, 16, dtype, 4,
                                            h_kv=h_kv)
        first = (*self.forward(q, k, v, layout, None, dtype),
                 *self.backward(q, k, v, layout, None, dtype, d_out))
        second = (*self.forward(q, k, v, layout, None, dtype),
                  *self.backward(q, k, v, layout, None, dtype, d_out))
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        k_rep, v_rep = (np.repeat(x, h // h_kv, axis=1) for x in (k, v))
        out, lse = self.forward(q, k_rep, v_rep, layout, None, dtype)
        dq, dk, dv = self.backward(q, k_rep, v_rep, layout, None, dtype, d_out)
        tu.assert_close(first[0], out, dtype, what="out vs repeated kv")
        tu.assert_close(first[2], dq, dtype, grad=True, what="dq vs repeated kv")
        for got, rep_grad, name in ((first[3], dk, "dk"), (first[4], dv, "dv")):
            summed = np.asarray(rep_grad, np.float64).reshape(1, h_kv, h // h_kv,
                                                            *rep_grad.shape[2:]).sum(2)
            tu.assert_close(got, summed, dtype, grad=True, reduced=h // h_kv,
                            what=f"{name} vs repeated kv")

    def test_fully_masked_rows(self):
        """Rows with no allowed key: output exactly 0, LSE -inf, zero gradients, no NaN."""
        for dtype in self.dtypes:
            with self.subTest(dtype=dtype):
                n, bs = 90, 32
                layout, q, k, v, d_out = self._case("masked_rows", n, bs, 1, 2, 32, dtype)
                dead = ~layout.dense_mask().any(-1)  # [H, N]
                self.assertTrue(dead.any() and not dead.all())
                out, lse = self.forward(q, k, v, layout, None, dtype)
                dq, dk, dv = self.backward(q, k, v, layout, None, dtype, d_out)
                for arr in (out, lse, dq, dk, dv):
                    self.assertFalse(np.isnan(np.asarray(arr, np.float64)).any())
                np.testing.assert_array_equal(np.asarray(out, np.float64)[:, dead], 0.0)
                np.testing.assert_array_equal(np.asarray(lse, np.float64)[:, dead], -np.inf)
                np.testing.assert_array_equal(np.asarray(dq, np.float64)[:, dead], 0.0)
                # Keys nobody may attend to get zero dk, dv.
                unseen = ~layout.dense_mask().any(-2)
                np.testing.assert_array_equal(np.asarray(dk, np.float64)[:, unseen], 0.0)
                np.testing.assert_array_equal(np.asarray(dv, np.float64)[:, unseen], 0.0)
                self._check_forward(layout, q, k, v, None, dtype, "masked_rows")
                self._check_backward(layout, q, k, v, None, dtype, d_out, "masked_rows")

    def test_ragged_full_tile_very_negative_scores(self):
        """A full ragged last key tile with every score near -250: keys past N (K = V = 0,
        score 0) must get no weight. Unbounded, they would swamp the forward's sums, and in dQ
        exp2(0 - lse2) overflows to inf and inf * 0 is NaN. The kernels bound the scores of
        full tiles by N (a select; see KERNEL_NOTES.md, session 6, for why not a bias or a
        separate loop for the ragged tile). Dense and longformer (global rows) at N=40,
        block 16: the 8-key last tile is full."""
        rng = np.random.default_rng(3)
        for name in ("dense", "longformer"):
            with self.subTest(pattern=name):
                n, bs, d = 40, 16, 16
                layout = make_layout(example_pattern(name, n, bs), n, 2, bs)
                self.assertTrue((layout.block_mask[:, :, -1] == 2).any(), "no full ragged tile")
                shape = (1, 2, n, d)
                # q.k * d**-0.5 ~ 8 * -8 * 16 / 4 = -256, plus small noise (exact in float32).
                q = (8.0 + rng.integers(-4, 5, shape) / 64).astype(np.float32)
                k = (-8.0 + rng.integers(-4, 5, shape) / 64).astype(np.float32)
                v, d_out = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
                out, lse = self._check_forward(layout, q, k, v, None, "float32", name)
                self.assertLess(float(np.max(lse)), -200.0)
                grads = self._check_backward(layout, q, k, v, None, "float32", d_out, name)
                for arr in (out, lse, *grads):
                    self.assertTrue(np.isfinite(np.asarray(arr, np.float64)).all())

    def test_poisoned_outputs(self):
        """Outputs pre-filled with NaN: every element must be written (ragged N, sparse rows)."""
        if not self.poisons_outputs:
            self.skipTest("this backend cannot pre-fill its outputs on this path; its "
                          "interpreter class runs the test")
        for name in ("causal", "bigbird", "masked_rows"):
            with self.subTest(pattern=name):
                layout, q, k, v, d_out = self._case(name, 75, 32, 2, 2, 16, "float32", seed=5)
                with self.poison_outputs():
                    self._check_forward(layout, q, k, v, None, "float32", f"poisoned {name}")
                    self._check_backward(layout, q, k, v, None, "float32", d_out,
                                         f"poisoned {name}")

    def test_deterministic(self):
        """Two runs give bitwise-equal outputs and gradients (no atomics)."""
        for dtype in self.dtypes:
            with self.subTest(dtype=dtype):
                layout, q, k, v, d_out = self._case("per_head_mix", 100, 32, 1, 3, 32, dtype, 9)
                first = (*self.forward(q, k, v, layout, None, dtype),
                         *self.backward(q, k, v, layout, None, dtype, d_out))
                second = (*self.forward(q, k, v, layout, None, dtype),
                          *self.backward(q, k, v, layout, None, dtype, d_out))
                for a, b in zip(first, second, strict=True):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_larger_kernel_tile(self):
        """Layouts launched at a kernel tile larger than their block (schedule.kernel_layout,
        the GPU's default for small blocks, forced here): out, LSE and gradients vs the oracle
        of the layout as given, outputs poisoned (where the backend can); a ragged N and a
        partial row of kernel tiles."""
        for name, bs in (("local", 16), ("causal", 32), ("masked_rows", 32)):
            with self.subTest(pattern=name, block=bs):
                layout, q, k, v, d_out = self._case(name, 100, bs, 1, 2, 16, "float32", seed=bs)
                poison = (self.poison_outputs() if self.poisons_outputs
                          else contextlib.nullcontext())
                with options.launch_options(kernel_tile=64), poison:
                    if self.device_kind != "cpu":  # the native CPU path runs the layout as is
                        self.assertEqual(
                            schedule.kernel_layout(layout, self.device_kind).block_size, 64)
                    tag = f"{name} bs={bs} kernel tile 64"
                    self._check_forward(layout, q, k, v, None, "float32", tag)
                    self._check_backward(layout, q, k, v, None, "float32", d_out, tag)

    @parameterized.named_parameters(("ragged", 70), ("whole_tiles", 64))
    def test_strided_inputs(self, n):
        """[B, H, N, D] views of [B, N, H, D] buffers (non-contiguous strides), and of a
        [B, H, D, N] buffer (the last axis strided, as a transposed key cache), are honoured;
        N ragged (the native path pads: a copy) or a multiple of the block (views throughout)."""
        b, h, d = 2, 2, 32
        layout = make_layout(example_pattern("local", n, 32), n, h, 32)
        rng = np.random.default_rng(11)
        q, k, v, d_out = (np.swapaxes(rng.standard_normal((b, n, h, d)).astype(np.float32), 1, 2)
                          for _ in range(4))
        self.assertFalse(q.flags.c_contiguous)
        self._check_forward(layout, q, k, v, None, "float32", "strided")
        self._check_backward(layout, q, k, v, None, "float32", d_out, "strided")
        q, k, v = (np.swapaxes(rng.standard_normal((b, h, d, n)).astype(np.float32), 2, 3)
                   for _ in range(3))
        self.assertNotEqual(q.strides[-1], q.itemsize)
        self._check_forward(layout, q, k, v, None, "float32", "last axis strided")
        self._check_backward(layout, q, k, v, None, "float32", d_out, "last axis strided")

    def test_new_pattern_same_shapes(self):
        """Two patterns with the same shapes in one process: both right (metadata as tensors)."""
        n, bs = 64, 32
        for name in ("causal", "local"):
            layout, q, k, v, _ = self._case(name, n, bs, 1, 1, 16, "float32", seed=3)
            self._check_forward(layout, q, k, v, None, "float32", name)

    @parameterized.named_parameters(
        ("k_shape", dict(k_shape=(1, 2, 64, 32)), r"\bk\b"),
        ("v_shape", dict(v_shape=(1, 2, 48, 16)), r"\bv\b"),
        ("k_dtype", dict(k_dtype=np.float16), r"\bk\b"),
        ("v_dtype", dict(v_dtype=np.float16), r"\bv\b"),
        ("q_not_float", dict(q_dtype=np.int32, k_dtype=np.int32, v_dtype=np.int32), r"\bq\b"),
        ("q_not_4d", dict(q_shape=(2, 64, 16), k_shape=(2, 64, 16), v_shape=(2, 64, 16)),
         r"\bq\b"),
        ("head_dim_24", dict(q_shape=(1, 2, 64, 24), k_shape=(1, 2, 64, 24),
                             v_shape=(1, 2, 64, 24)), r"head dim"),
        ("head_dim_8", dict(q_shape=(1, 2, 64, 8), k_shape=(1, 2, 64, 8),
                            v_shape=(1, 2, 64, 8)), r"head dim"),
        ("layout_seq_len", dict(layout_n=96), r"layout.*seq_len"),
        ("layout_heads", dict(layout_h=3), r"layout.*num_heads"),
        ("layout_type", dict(layout_obj="causal"), r"layout"),
        ("kv_heads_not_divisor", dict(q_shape=(1, 3, 64, 16), layout_h=3,
                                      k_shape=(1, 2, 64, 16), v_shape=(1, 2, 64, 16)),
         r"H_kv"),
        ("kv_heads_k_v_differ", dict(k_shape=(1, 1, 64, 16)), r"\bv\b"),
        ("layout_kv_len", dict(k_shape=(1, 2, 96, 16), v_shape=(1, 2, 96, 16)),
         r"layout.*kv_len"),
        ("head_dim_272", dict(q_shape=(1, 2, 64, 272), k_shape=(1, 2, 64, 272),
                              v_shape=(1, 2, 64, 272)), r"head dim"),
        ("head_dim_200", dict(q_shape=(1, 2, 64, 200), k_shape=(1, 2, 64, 200),
                              v_shape=(1, 2, 64, 200)), r"head dim"),
        ("layout_rows", dict(layout_rows=3), r"layout is per-batch-row for batch=3 .* B=1"),
    )
    def test_bad_inputs(self, spec, regex):
        shape = (1, 2, 64, 16)
        pattern = example_pattern("causal", spec.get("layout_n", 64), 32)
        if "layout_rows" in spec:  # per-row documents for another batch size
            pattern = P.documents([[32, 32]] * spec["layout_rows"]) & pattern
        layout = make_layout(pattern, spec.get("layout_n", 64), spec.get("layout_h", 2), 32)
        if "layout_obj" in spec:
            layout = spec["layout_obj"]
        rng = np.random.default_rng(0)
        arrays = {}
        for name in ("q", "k", "v"):
            arr = rng.standard_normal(spec.get(f"{name}_shape", shape))
            arrays[name] = arr.astype(spec.get(f"{name}_dtype", np.float32))
        with self.assertRaisesRegex(ValueError, regex):
            self.call_raw(arrays["q"], arrays["k"], arrays["v"], layout)


class CompiledAttentionTestBase(AttentionTestBase):
    """:class:`AttentionTestBase` plus the GPU-only cases; GPU subclasses derive from this."""

    __test__ = False  # abstract; see the module docstring

    @parameterized.named_parameters(
        (f"{name}_{dtype}_d{d}", name, dtype, d) for name, dtype, d in COMPILED_CASES)
    def test_compiled_example_pattern(self, name, dtype, d):
        """Compiled kernels vs the float64 oracle: out, LSE, dq, dk, dv at N=1024 (a size the
        interpreter cannot afford), in the precision the GPU runs."""
        if self.device_kind != "cuda":  # SPARSETP_INTERPRET=1 / TRITON_INTERPRET=1 process
            self.skipTest("compiled kernels only: this process forces the interpreter")
        s = COMPILED_SHAPE
        bs = 64 if d == 64 else 128
        self._check_all(name, s["seq_len"], bs, s["batch"], s["heads"], d, dtype,
                        seed=len(name) + d)

    @parameterized.named_parameters((_real_case_name(c), c) for c in COMPILED_REAL_CASES)
    def test_compiled_real_model(self, case):
        """Compiled kernels on GQA/MQA, N_q != N_kv and head dims 80/192/256 vs the oracle."""
        if self.device_kind != "cuda":
            self.skipTest("compiled kernels only: this process forces the interpreter")
        self._check_real_case(case, seed=case[1] + case[7])
