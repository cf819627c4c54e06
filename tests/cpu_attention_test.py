"""The native CPU paths (sparsetp.backends.{torch,jax}.cpu) against the Triton kernels in the
interpreter and the float64 oracle, plus what only the native paths have: chunking, jax.vmap,
jax.jit(jax.grad(...)). The shared base runs the native paths on every case
(``TorchCpuAttentionTest``, ``JaxCpuAttentionTest``); this file checks native == interpreter
(within float32 tolerance) == oracle on a few features at small sizes.
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import testing_utils as tu  # noqa: E402
import torch  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from sparsetp.backends.jax import attention as jattn  # noqa: E402
from sparsetp.backends.jax import compat  # noqa: E402
from sparsetp.backends.jax import cpu as jcpu  # noqa: E402
from sparsetp.backends.torch import attention as tattn  # noqa: E402
from sparsetp.backends.torch import cpu as tcpu  # noqa: E402
from sparsetp.core import make_layout, reference  # noqa: E402
from sparsetp.core import patterns as P  # noqa: E402
from sparsetp.core.examples import example_pattern  # noqa: E402

# (pattern, N_q, N_kv, block, H, H_kv): causal, bigbird, a per-head mix, GQA, kv_len != seq_len
# both ways, fully masked rows; every N ragged.
CASES = (
    ("causal", 70, 70, 16, 2, 2),
    ("bigbird", 100, 100, 32, 2, 2),
    ("per_head_mix", 90, 90, 32, 3, 3),
    ("causal", 50, 50, 16, 4, 2),
    ("causal", 30, 75, 16, 2, 1),
    ("causal", 75, 30, 16, 2, 2),
    ("masked_rows", 60, 60, 16, 2, 2),
)
D = 16


def _case(name, n, n_kv, bs, h, h_kv, seed=0):
    layout = make_layout(example_pattern(name, max(n, n_kv), bs), n, h, bs, kv_len=n_kv)
    q, d_out = tu.random_inputs(seed, (1, h, n, D), "float32", count=2)
    k, v = tu.random_inputs(seed + 1, (1, h_kv, n_kv, D), "float32", count=2)
    return layout, q, k, v, d_out


def _torch_run(layout, q, k, v, d_out):
    tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
    out, lse = tattn.sparse_attention(tq, tk, tv, layout, return_lse=True)
    out.backward(torch.from_numpy(d_out))
    return [t.detach().numpy() for t in (out, lse, tq.grad, tk.grad, tv.grad)]


def _jax_run(layout, q, k, v, d_out):
    lay = jattn.layout_arrays(layout)
    (out, lse), vjp = jax.vjp(lambda q, k, v: jattn.sparse_attention(q, k, v, lay,
                                                                     return_lse=True), q, k, v)
    grads = vjp((jnp.asarray(d_out), jnp.zeros(lse.shape, lse.dtype)))
    return [np.asarray(a) for a in (out, lse, *grads)]


NAMES = ("out", "lse", "dq", "dk", "dv")


class NativeMatchesInterpreterTest(parameterized.TestCase):

    @parameterized.named_parameters((f"{c[0]}_nq{c[1]}_nk{c[2]}_h{c[4]}_hkv{c[5]}", c)
                                    for c in CASES)
    def test_native_equals_interpreter_equals_oracle(self, case):
        layout, q, k, v, d_out = _case(*case)
        ref = [*reference.attention(q, k, v, layout),
               *reference.attention_grad(q, k, v, layout, d_out)]
        native_torch = _torch_run(layout, q, k, v, d_out)
        native_jax = _jax_run(layout, q, k, v, d_out)
        with mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}):
            interp = _torch_run(layout, q, k, v, d_out)
        group = case[4] // case[5]
        for i, name in enumerate(NAMES):
            grad = i >= 2
            reduced = group if name in ("dk", "dv") else 1
            for tag, got in (("torch native", native_torch), ("jax native", native_jax)):
                tu.assert_close(got[i], ref[i], "float32", grad=grad, reduced=reduced,
                                what=f"{tag} {name}")
                tu.assert_close(got[i], interp[i], "float32", grad=grad, reduced=reduced,
                                what=f"{tag} vs interpreter {name}")
            tu.assert_close(interp[i], ref[i], "float32", grad=grad, reduced=reduced,
                            what=f"interpreter {name}")
        # Fully masked rows: 0, -inf, zero gradients, on both native paths.
        dead = ~layout.dense_mask().any(-1)[None]
        for got in (native_torch, native_jax):
            self.assertTrue((got[0][dead] == 0).all() and np.isneginf(got[1][dead]).all())
            self.assertTrue((got[2][dead] == 0).all())
            for a in got:
                self.assertFalse(np.isnan(a).any())

    def test_chunked_equals_unchunked(self):
        """Chunks of one query tile (a tiny CHUNK_ELEMENTS) give the same numbers, bitwise per
        row on torch (each row is computed whole in one chunk either way)."""
        layout, q, k, v, d_out = _case("per_head_mix", 90, 90, 16, 3, 3)
        whole_t, whole_j = _torch_run(layout, q, k, v, d_out), _jax_run(layout, q, k, v, d_out)
        with mock.patch.object(tcpu, "CHUNK_ELEMENTS", 1), \
                mock.patch.object(jcpu, "CHUNK_ELEMENTS", 1):
            self.assertLen(tcpu._tables(layout).plan(1, D), layout.num_blocks)
            chunked_t = _torch_run(layout, q, k, v, d_out)
            chunked_j = _jax_run(layout, q, k, v, d_out)
        for name, a, b in zip(NAMES, whole_t, chunked_t, strict=True):
            tu.assert_close(b, a, "float32", grad=name[0] == "d", what=f"torch {name}")
        for name, a, b in zip(NAMES, whole_j, chunked_j, strict=True):
            tu.assert_close(b, a, "float32", grad=name[0] == "d", what=f"jax {name}")

    def test_band_chunks_are_strided_views(self):
        """A band's interior rows list consecutive key tiles (partial ones first): their chunks
        read K/V as strided views, with the masks put in tile order. Batch 2, ragged N and a
        partial band edge: the oracle's numbers, and those of the gathering path."""
        n, bs, h = 250, 16, 2
        layout = make_layout(P.causal() & P.local(40, 0), n, h, bs)
        tables = tcpu._tables(layout)
        windows = [tables.window(*c) for c in tables.plan(2, D)]
        self.assertTrue(any(w is not None and list(w[2]) != sorted(w[2]) for w in windows))
        q, d_out = tu.random_inputs(0, (2, h, n, D), "float32", count=2)
        k, v = tu.random_inputs(1, (2, h, n, D), "float32", count=2)
        ref = [*reference.attention(q, k, v, layout),
               *reference.attention_grad(q, k, v, layout, d_out)]
        views = _torch_run(layout, q, k, v, d_out)
        with mock.patch.object(tcpu._Tables, "window", lambda self, t0, t1, w: None):
            gathered = _torch_run(layout, q, k, v, d_out)
        for name, a, g, r in zip(NAMES, views, gathered, ref, strict=True):
            grad = name[0] == "d"
            tu.assert_close(a, r, "float32", grad=grad, what=f"views {name}")
            tu.assert_close(a, g, "float32", grad=grad, what=f"views vs gathered {name}")
        # The band's chunks share their masks: one kept per content, none per batch size.
        kept = len(tables.fused_masks)
        _torch_run(layout, q[:1], k[:1], v[:1], d_out[:1])
        self.assertEqual(len(tables.fused_masks), kept)
        self.assertTrue(all(m.shape[0] in (1, h) and m.shape[1] == 1
                            for m in tables.fused_masks.values()))

    def test_worker_threads(self):
        """Chunks on two worker threads (tiny chunks, so every call uses them) through autograd
        with inputs that require grad: the oracle's numbers, the same as on the caller, and
        bitwise the same twice. N a multiple of the block: the tiles are views of the inputs."""
        layout, q, k, v, d_out = _case("per_head_mix", 96, 96, 16, 3, 3)
        ref = [*reference.attention(q, k, v, layout),
               *reference.attention_grad(q, k, v, layout, d_out)]
        with mock.patch.object(tcpu, "WORKERS", 1):
            caller = _torch_run(layout, q, k, v, d_out)
        with mock.patch.object(tcpu, "WORKERS", 2), \
                mock.patch.object(tcpu, "MIN_SPLIT_ELEMENTS", 1):
            chunks, parallel = tcpu._plan(tcpu._tables(layout), 1, D)
            self.assertTrue(parallel)
            self.assertGreater(len(chunks), 2)
            workers = _torch_run(layout, q, k, v, d_out)
            again = _torch_run(layout, q, k, v, d_out)
            # No grad on the caller, inputs that require it (the no-autograd path): the workers
            # must not record a graph either (grad mode is per thread).
            tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
            with torch.no_grad():
                out = tattn.sparse_attention(tq, tk, tv, layout)
            self.assertFalse(out.requires_grad)
            np.testing.assert_array_equal(out.numpy(), workers[0])
            # The workers run single-threaded; the caller and threads started later keep the
            # process's count (torch.set_num_threads also sets the default new threads take).
            self.assertEqual(tcpu._pool(2).submit(torch.get_num_threads).result(), 1)
        started_later = []
        thread = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        self.assertEqual(started_later, [torch.get_num_threads()])
        for name, w, c, a, r in zip(NAMES, workers, caller, again, ref, strict=True):
            grad = name[0] == "d"
            tu.assert_close(w, r, "float32", grad=grad, what=f"workers {name}")
            tu.assert_close(w, c, "float32", grad=grad, what=f"workers vs caller {name}")
            np.testing.assert_array_equal(w, a, err_msg=f"workers twice {name}")


class JaxNativeTransformsTest(absltest.TestCase):
    """On the CPU device whatever the default backend (a GPU machine's arrays would otherwise
    take the kernel path, which jax_attention_test covers)."""

    def setUp(self):
        super().setUp()
        self.enter_context(jax.default_device(jax.devices("cpu")[0]))

    def test_vmap_over_a_leading_axis(self):
        layout, q, k, v, _ = _case("bigbird", 100, 100, 32, 2, 2)
        qs = np.stack([q, q * 0.5, -q])  # [3, 1, H, N, D]
        lay = jattn.layout_arrays(layout)
        out = jax.vmap(lambda q: jattn.sparse_attention(q, k, v, lay))(qs)
        for i in range(3):
            tu.assert_close(np.asarray(out[i]), reference.attention(qs[i], k, v, layout)[0],
                            "float32", what=f"vmap out {i}")

    def test_jit_of_grad(self):
        layout, q, k, v, d_out = _case("causal", 50, 50, 16, 4, 2)
        lay = jattn.layout_arrays(layout)

        def loss(q, k, v, lay):
            return jnp.vdot(jattn.sparse_attention(q, k, v, lay), d_out)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, lay)
        for name, g, r in zip(("dq", "dk", "dv"), grads,
                              reference.attention_grad(q, k, v, layout, d_out), strict=True):
            tu.assert_close(np.asarray(g), r, "float32", grad=True, reduced=2, what=name)
        # Plain XLA on CPU: no host callback in the jitted program.
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, lay).as_text()
        self.assertNotIn("callback", text)

    def test_loop_steps_under_vmap_and_grad(self):
        """Small steps: a loop of two tiles per step plus a rest, and the global row's heads
        split over steps (GQA), under vmap and jit(grad): the oracle's numbers."""
        layout, q, k, v, d_out = _case("bigbird", 216, 216, 16, 4, 2)
        lay = jattn.layout_arrays(layout, static_widths=True)
        with mock.patch.object(jcpu, "CHUNK_ELEMENTS", 16 * 16 * 5 * 8):
            jax.clear_caches()  # trace under the patched step size, not a cached trace
            self.addCleanup(jax.clear_caches)  # and leave no trace of it to later tests
            plan = jcpu._plan(1, 4, layout.num_blocks, 16, D, lay.widest_row, lay.row_widths)
            self.assertTrue(any(hc < 4 for *_, hc in plan))
            self.assertTrue(any(ct > 1 and (t1 - t0) % ct for t0, t1, _, ct, _ in plan))
            qs = np.stack([q, -0.5 * q])
            out = jax.vmap(lambda q: jattn.sparse_attention(q, k, v, lay))(qs)
            grads = jax.jit(jax.grad(
                lambda q, k, v: jnp.vdot(jattn.sparse_attention(q, k, v, lay), d_out),
                argnums=(0, 1, 2)))(q, k, v)
        for i in range(2):
            tu.assert_close(np.asarray(out[i]), reference.attention(qs[i], k, v, layout)[0],
                            "float32", what=f"vmap out {i}")
        for name, g, r in zip(("dq", "dk", "dv"), grads,
                              reference.attention_grad(q, k, v, layout, d_out), strict=True):
            tu.assert_close(np.asarray(g), r, "float32", grad=True, reduced=2, what=name)

    def test_loop_steps_inside_shard_map(self):
        """The loop's carry inside ``shard_map`` (``check_vma=True``) with the heads split over
        two devices: it must start varying like the steps' results, or tracing fails (on a GPU
        too: ``platform_dependent`` traces this branch there). The oracle's numbers per shard."""
        layout, q, k, v, d_out = _case("bigbird", 216, 216, 16, 2, 1)  # one shard's heads
        q, d_out = (np.concatenate([x, -0.5 * x], axis=1) for x in (q, d_out))  # H = 4
        k, v = (np.concatenate([x, 2.0 * x], axis=1) for x in (k, v))  # H_kv = 2
        lay = jattn.layout_arrays(layout)
        mesh = compat.auto_mesh((2,), ("tp",), devices=jax.devices("cpu")[:2])
        heads = jax.sharding.PartitionSpec(None, "tp")

        def loss(q, k, v):
            def local(q, k, v, d_out):
                return jax.lax.psum(jnp.vdot(jattn.sparse_attention(q, k, v, lay), d_out), "tp")
            return jax.shard_map(local, mesh=mesh, in_specs=(heads,) * 4,
                                 out_specs=jax.sharding.PartitionSpec(),
                                 check_vma=True)(q, k, v, d_out)

        with mock.patch.object(jcpu, "CHUNK_ELEMENTS", 16 * 16 * 5 * 8):
            jax.clear_caches()
            self.addCleanup(jax.clear_caches)
            plan = jcpu._plan(1, 2, layout.num_blocks, 16, D, lay.widest_row, lay.row_widths)
            self.assertTrue(any((t1 - t0) // ct * (2 // hc) > 1 for t0, t1, _, ct, hc in plan))
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        for shard in range(2):
            hq, hk = slice(2 * shard, 2 * shard + 2), slice(shard, shard + 1)
            want = reference.attention_grad(q[:, hq], k[:, hk], v[:, hk], layout, d_out[:, hq])
            for name, g, r, sl in zip(("dq", "dk", "dv"), grads, want, (hq, hk, hk), strict=True):
                tu.assert_close(np.asarray(g)[:, sl], r, "float32", grad=True, reduced=2,
                                what=f"shard {shard} {name}")


if __name__ == "__main__":
    absltest.main()
