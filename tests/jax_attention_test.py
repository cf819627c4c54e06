"""JAX frontend of block-sparse attention: the shared AttentionTestBase plus JAX-only tests.

Every numeric hook runs under ``jax.jit`` (layout metadata as operands), on CPU arrays (the
native path, ``sparsetp.backends.jax.cpu``; and in a flag subclass with ``SPARSETP_INTERPRET=1``,
Triton's interpreter through ``buffer_callback``) always and on GPU arrays (the compiled kernels
through jax-triton) where ``jax.devices("gpu")`` has a device; the GPU class skips with "needs a
CUDA GPU" elsewhere and adds the GPU-only cases (``attention_test_base.CompiledAttentionTestBase``).
Arrays are placed explicitly (``jax.device_put`` and ``jax.default_device``), so on a GPU
machine the CPU classes really run on CPU. The JAX-only tests (CPU) cover ``shard_map`` with
heads split over 2 and 4 host devices (both ways of giving each shard its heads' metadata), the
no-retrace property, the LSE cotangent and ``jit(grad(...))``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import contextlib  # noqa: E402
import functools  # noqa: E402
import unittest  # noqa: E402
from unittest import mock  # noqa: E402

import attention_test_base as base  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import testing_utils as tu  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from sparsetp import _runtime  # noqa: E402
from sparsetp.backends.jax import attention as jattn  # noqa: E402
from sparsetp.backends.jax import launch as jlaunch  # noqa: E402
from sparsetp.backends.jax.block import make_mesh  # noqa: E402
from sparsetp.core import make_layout, reference  # noqa: E402
from sparsetp.core import patterns as PT  # noqa: E402
from sparsetp.core import patterns as patterns_  # noqa: E402
from sparsetp.core.examples import example_pattern  # noqa: E402
from sparsetp.kernels import interpreter, options  # noqa: E402
from sparsetp.kernels.tiles import TileConfig  # noqa: E402


def _gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # this JAX has no GPU backend
        return []


CPU = jax.devices("cpu")[0]
GPUS = _gpu_devices()
NEEDS_GPU = "needs a CUDA GPU (jax.devices('gpu') is empty)"


def _np(a) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.name in ("bfloat16", "float16") else a


def _jitted(scale, return_lse=True):
    # Launch options and the CPU path (native or interpreter) are read at trace time, so they
    # key the jit cache too.
    return _jitted_for(scale, return_lse, (options.current().key(), _runtime.device_kind("cpu")))


@functools.cache
def _jitted_for(scale, return_lse, options_key):
    del options_key  # only a cache key
    return jax.jit(functools.partial(jattn.sparse_attention, scale=scale, return_lse=return_lse))


class _JaxHooks:
    """AttentionTestBase's hooks for JAX arrays on one device of ``platform``."""

    platform: str  # "cpu" or "gpu"
    dtypes = ("float32", "bfloat16")

    def setUp(self):
        super().setUp()
        self.device = CPU if self.platform == "cpu" else GPUS[0]
        # Arrays the code under test creates (layout metadata, zeros) land here too.
        self.enter_context(jax.default_device(self.device))

    @property
    def device_kind(self) -> str:
        if self.platform == "gpu" and jlaunch.gpu_path():
            return "cuda"
        return _runtime.device_kind("cpu")

    @property
    def poisons_outputs(self) -> bool:
        # The interpreter path allocates its outputs NaN-filled; jax-triton allocates its own.
        return self.device_kind == "interpreter"

    def _to(self, x: np.ndarray, dtype: str) -> jax.Array:
        return jax.device_put(np.asarray(x), self.device).astype(jnp.dtype(dtype))

    def _on_device(self, *arrays):
        for a in arrays:
            self.assertEqual(a.devices(), {self.device})

    def forward(self, q, k, v, layout, scale, dtype):
        # head_dim and dtype: the arrays of the tile the kernels run (schedule.kernel_layout).
        lay = jattn.layout_arrays(layout, head_dim=q.shape[-1], dtype=dtype)
        out, lse = _jitted(scale)(self._to(q, dtype), self._to(k, dtype), self._to(v, dtype),
                                  lay)
        self.assertEqual(out.dtype, jnp.dtype(dtype))
        self._on_device(out, lse)
        return _np(out), _np(lse)

    def backward(self, q, k, v, layout, scale, dtype, d_out):
        lay = jattn.layout_arrays(layout, head_dim=q.shape[-1], dtype=dtype)
        fn = _jitted(scale, return_lse=False)
        _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, lay), self._to(q, dtype),
                         self._to(k, dtype), self._to(v, dtype))
        dq, dk, dv = vjp(self._to(d_out, dtype))
        for g in (dq, dk, dv):
            self.assertEqual(g.dtype, jnp.dtype(dtype))
        self._on_device(dq, dk, dv)
        return _np(dq), _np(dk), _np(dv)

    @contextlib.contextmanager
    def poison_outputs(self):
        # The interpreter path allocates every kernel output NaN-filled (ints: -2**31) always;
        # check that every launch in the block really went through that allocation.
        self.assertEqual(self.device_kind, "interpreter",
                         "poisoned outputs are a property of the interpreter path")
        calls = []
        real = jlaunch._poisoned

        def spy(shape_dtype):
            out = real(shape_dtype)
            if out.dtype.is_floating_point:
                self.assertTrue(bool(out.isnan().all()))
            calls.append(tuple(shape_dtype.shape))
            return out

        # A launch binds its allocator when traced, and sparse_attention's staged kernels are
        # traced once per shape: start from empty trace caches so the block traces them anew.
        jax.clear_caches()
        with mock.patch.object(jlaunch, "_poisoned", spy):
            yield
        self.assertGreaterEqual(len(calls), 6)  # out, lse, delta, dq, dk, dv at least

    def test_vmap_maps_queries_and_layouts(self):
        """vmap over a leading axis: jax-triton has no batching rule, so the kernel paths fold the
        mapped axis into B (layout shared) or loop (one layout per element); the gradient too."""
        n, h, d = 128, 2, 32
        layouts = [make_layout(patterns_.causal() & patterns_.local(w, 0), n, h, 64)
                   for w in (90, 100)]
        q, k, v, _ = tu.random_inputs(3, (1, h, n, d), "float32")
        qs = np.stack([q, 0.5 * q, -q])
        lay = jattn.layout_arrays(layouts[0])
        out = jax.vmap(lambda q: jattn.sparse_attention(q, self._to(k, "float32"),
                                                        self._to(v, "float32"), lay))(
            self._to(qs, "float32"))
        self._on_device(out)

        def loss(q, k, lay):
            return jnp.sum(jattn.sparse_attention(q, k, self._to(v, "float32"), lay) ** 2)

        dq, dk = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, None))(
            self._to(qs, "float32"), self._to(k, "float32"), lay)
        for i in range(3):
            tu.assert_close(_np(out[i]), reference.attention(qs[i], k, v, layouts[0])[0],
                            "float32", what=f"vmap out {i}")
            ref_dq, ref_dk, _ = reference.attention_grad(
                qs[i], k, v, layouts[0], 2 * reference.attention(qs[i], k, v, layouts[0])[0])
            tu.assert_close(_np(dq[i]), ref_dq, "float32", grad=True, what=f"vmap dq {i}")
            tu.assert_close(_np(dk[i]), ref_dk, "float32", grad=True, what=f"vmap dk {i}")
        both = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]),
                                      *[jattn.layout_arrays(x) for x in layouts])
        out2 = jax.vmap(lambda q, lay: jattn.sparse_attention(
            q, self._to(k, "float32"), self._to(v, "float32"), lay))(
            self._to(qs[:2], "float32"), both)
        for i in range(2):
            tu.assert_close(_np(out2[i]), reference.attention(qs[i], k, v, layouts[i])[0],
                            "float32", what=f"vmap over layouts, out {i}")

    def float64_context(self):
        return jax.enable_x64(True)

    def call_raw(self, q, k, v, layout, **kwargs):
        q, k, v = (jax.device_put(x, self.device) for x in (q, k, v))
        return jattn.sparse_attention(q, k, v, layout, **kwargs)


class JaxCpuAttentionTest(_JaxHooks, base.AttentionTestBase):
    """CPU arrays: the native path (plain XLA; its outputs are XLA's, so not poisoned)."""

    platform = "cpu"

    def test_runs_native(self):
        self.assertEqual(self.device_kind, "cpu")


class JaxInterpreterAttentionTest(_JaxHooks, base.AttentionTestBase):
    """CPU arrays under SPARSETP_INTERPRET=1: the kernels in Triton's interpreter."""

    platform = "cpu"

    def setUp(self):
        super().setUp()
        self.enter_context(mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}))

    def test_runs_interpreted(self):
        self.assertEqual(self.device_kind, "interpreter")


@unittest.skipUnless(GPUS, NEEDS_GPU)
class JaxGpuAttentionTest(_JaxHooks, base.CompiledAttentionTestBase):
    """GPU arrays: the compiled kernels (jax-triton), plus the GPU-only cases."""

    platform = "gpu"

    def test_one_jitted_function_on_cpu_and_gpu_arrays(self):
        """One jitted function, staged for both platforms (jax.lax.platform_dependent): CPU
        arrays run the interpreter, GPU arrays the compiled kernels; both match the oracle."""
        layout, q, k, v, d_out = _per_head_case(n=128, bs=32, b=1, h=2, seed=12)
        fn = jax.jit(functools.partial(jattn.sparse_attention, return_lse=True))
        lay = jattn.layout_arrays(layout)
        for device in (CPU, self.device):
            with self.subTest(platform=device.platform):
                args = [jax.device_put(x, device) for x in (q, k, v)]
                lay_d = jax.device_put(lay, device)
                (out, lse), vjp = jax.vjp(lambda q, k, v, lay_d=lay_d: fn(q, k, v, lay_d), *args)
                grads = vjp((jax.device_put(d_out, device),
                             jax.device_put(np.zeros(lse.shape, np.float32), device)))
                for a in (out, lse, *grads):
                    self.assertEqual(a.devices(), {device})
                _check(layout, q, k, v, d_out, out, lse, grads, tag=device.platform)


def _check(layout, q, k, v, d_out, out, lse, grads, scale=None, tag=""):
    ref_out, ref_lse = reference.attention(q, k, v, layout, scale)
    tu.assert_close(out, ref_out, "float32", what=f"{tag} out")
    tu.assert_close(lse, ref_lse, "float32", what=f"{tag} lse")
    for name, g, r in zip(("dq", "dk", "dv"), grads,
                          reference.attention_grad(q, k, v, layout, d_out, scale), strict=True):
        tu.assert_close(g, r, "float32", grad=True, what=f"{tag} {name}")


def _per_head_case(n=96, bs=32, b=2, h=4, d=16, seed=0, name="per_head_mix"):
    layout = make_layout(example_pattern(name, n, bs), n, h, bs)
    q, k, v, d_out = tu.random_inputs(seed, (b, h, n, d), "float32")
    return layout, q, k, v, d_out


class JaxAttentionExtrasTest(parameterized.TestCase):
    """JAX-only behaviour on CPU devices (explicitly, also on a GPU machine): shard_map over
    heads, no retrace, LSE cotangent, jit(grad)."""

    def test_eager_launch_path_follows_the_operands(self):
        """Outside jit, in a process with a GPU backend, the path is the operands' platform:
        JAX arrays by their devices, NumPy arrays by where JAX would put them (the default
        backend); platform_dependent alone would take the default backend's branch for all."""
        kinds = []

        def fake_call(kernel, args, *, device_kind, out_shapes, **kw):
            kinds.append(device_kind)
            return tuple(jnp.zeros(o.shape, o.dtype) for o in out_shapes)

        layout = make_layout(PT.causal(), 64, 1, 32)
        x_cpu = jax.device_put(jnp.ones((1, 1, 64, 16)), jax.devices("cpu")[0])
        x_np = np.ones((1, 1, 64, 16), np.float32)
        meta = jattn.layout_arrays(layout).metadata()

        def build(kind):
            return jattn._abi.fwd_call(x_np, x_np, x_np, meta, scale=0.25, dtype="float32",
                                       device_kind=kind)

        with mock.patch.object(jlaunch, "gpu_path", return_value=True), \
                mock.patch.object(jlaunch, "call_kernel", fake_call), \
                mock.patch.object(jax, "default_backend", return_value="gpu"):
            with jax.default_device(None):  # NumPy operands go to the default backend, a GPU
                for operands in ((x_cpu,), (x_np,), (x_cpu, x_np)):
                    jlaunch.launch(build, *operands)
            with jax.default_device(jax.devices("cpu")[0]):  # ... or to the default device
                jlaunch.launch(build, x_np)
        self.assertEqual(kinds, ["interpreter", "cuda", "cuda", "interpreter"])


    def setUp(self):
        super().setUp()
        self.enter_context(jax.default_device(CPU))

    def _check(self, layout, q, k, v, d_out, out, lse, grads, scale=None, tag=""):
        for a in (out, lse, *grads):
            self.assertEqual({d.platform for d in a.devices()}, {"cpu"})
        _check(layout, q, k, v, d_out, out, lse, grads, scale=scale, tag=tag)

    def test_sub_tiles_and_work_order(self):
        """A non-default sub-tile config and the heads-fastest longest-first grid through the
        JAX launch (the same launch description as torch's), under jit, vs the oracle; the
        layout's work orders travel as LayoutArrays leaves. Kernel options: in the interpreter."""
        self.enter_context(mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}))
        layout, q, k, v, d_out = _per_head_case(n=100, bs=32, b=1, h=2, seed=7)
        lay = jattn.layout_arrays(layout)
        np.testing.assert_array_equal(np.asarray(lay.q_order), layout.q_order)
        np.testing.assert_array_equal(np.asarray(lay.k_order), layout.k_order)
        cfg = TileConfig(32, 32, 4, 2, sub=16)
        with options.launch_options(work_order="longest_first_bh",
                                    tiles={"fwd": cfg, "bwd_dq": cfg, "bwd_dkdv": cfg}):
            fn = jax.jit(functools.partial(jattn.sparse_attention, return_lse=True))
            (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, lay), q, k, v)
            grads = vjp((jnp.asarray(d_out), jnp.zeros(lse.shape, lse.dtype)))
        self._check(layout, q, k, v, d_out, out, lse, grads, tag="sub16 longest_first_bh")

    def test_launch_options_key_the_trace_and_reach_the_backward(self):
        """Launch options are part of the trace key (a static argument of the staged call):
        the same shapes under other options launch those options' kernels, not the first
        trace's (work order "natural" gives ORDERED off), and a vjp built under options and
        called outside the ``with`` launches the forward's options, as the torch frontend
        does. Gradients vs the oracle."""
        self.enter_context(mock.patch.dict(os.environ, {"SPARSETP_INTERPRET": "1"}))
        n, bs, h, h_kv = 64, 32, 4, 2
        layout = make_layout(PT.causal(), n, h, bs)
        lay = jattn.layout_arrays(layout)
        q, d_out = tu.random_inputs(13, (1, h, n, 16), "float32", count=2)
        k, v = tu.random_inputs(14, (1, h_kv, n, 16), "float32", count=2)
        refs = reference.attention_grad(q, k, v, layout, d_out, None)

        def run(**changes):
            with mock.patch.object(interpreter, "launch", wraps=interpreter.launch) as spy:
                with options.launch_options(**changes):
                    _, vjp = jax.vjp(lambda q, k, v: jattn.sparse_attention(q, k, v, lay),
                                     q, k, v)
                grads = vjp(jnp.asarray(d_out))  # outside the with
            for name, g, r in zip(("dq", "dk", "dv"), grads, refs, strict=True):
                tu.assert_close(g, r, "float32", grad=True,
                                reduced=1 if name == "dq" else h // h_kv, what=f"{changes} {name}")
            return [(c.args[0].fn.__name__, c.args[3]) for c in spy.call_args_list]

        for changes in ({}, {"work_order": "natural"}, {}):
            launched = run(**changes)
            ordered = {consts.get("ORDERED") for nm, consts in launched if "ORDERED" in consts}
            self.assertEqual(ordered, {"work_order" not in changes}, changes)

    def test_interpreter_switch_is_not_a_cached_trace(self):
        """The same shapes and options first on the native CPU path, then under
        ``SPARSETP_INTERPRET=1``, then natively again: each call takes its own path (a trace
        reused across the switch ran the interpreter's host callback on GPU buffers)."""
        layout = make_layout(PT.causal(), 64, 2, 32)
        lay = jattn.layout_arrays(layout)
        q, k, v = tu.random_inputs(21, (1, 2, 64, 16), "float32", count=3)
        ref = reference.attention(q, k, v, layout)[0]
        for interpret in (False, True, False):
            env = {"SPARSETP_INTERPRET": "1"} if interpret else {}
            with mock.patch.dict(os.environ, env), \
                    mock.patch.object(interpreter, "launch", wraps=interpreter.launch) as spy:
                out = jax.device_get(jattn.sparse_attention(q, k, v, lay))
            self.assertEqual(spy.called, interpret)
            tu.assert_close(out, ref, "float32", what=f"interpret={interpret}")

    @parameterized.product(tp=(2, 4), how=("sharded_metadata", "local_heads"))
    def test_shard_map_over_heads(self, tp, how):
        """Heads split over a mesh axis (check_vma on): every shard runs its heads' metadata.

        per_head_mix gives each head a different pattern, so a shard using another shard's
        metadata (or the whole layout's first heads) fails the comparison."""
        layout, q, k, v, d_out = _per_head_case(seed=tp)
        lay = jattn.layout_arrays(layout)
        mesh = make_mesh(tp, devices=jax.devices("cpu")[:tp])
        spec = P(None, "tp")
        if how == "sharded_metadata":
            lay_spec = lay.partition_specs("tp")
            body = functools.partial(jattn.sparse_attention, return_lse=True)
        else:
            lay_spec = jax.tree_util.tree_map(lambda _: P(), lay)

            def body(q, k, v, lay):
                return jattn.sparse_attention(q, k, v, lay.local_heads("tp"), return_lse=True)

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, lay_spec),
                                   out_specs=(spec, spec), check_vma=True))
        (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, lay), q, k, v)
        grads = vjp((jnp.asarray(d_out), jnp.zeros(lse.shape, lse.dtype)))
        self.assertEqual(out.sharding.spec, spec)
        self._check(layout, q, k, v, d_out, out, lse, grads, tag=f"tp={tp} {how}")

    def test_layout_heads_slices(self):
        """The spec-layer way: each head group run with its static ``BlockLayout.heads(...)``
        slice (what one tensor-parallel rank holds) equals the whole layout's result."""
        layout, q, k, v, d_out = _per_head_case(h=4, seed=7)
        outs, grads = [], []
        for start in (0, 2):
            sub = layout.heads(start, start + 2)
            sl = slice(start, start + 2)
            (o, _), vjp = jax.vjp(lambda q, k, v, sub=sub: jattn.sparse_attention(
                q, k, v, sub, return_lse=True), q[:, sl], k[:, sl], v[:, sl])
            outs.append(o)
            grads.append(vjp((jnp.asarray(d_out[:, sl]), jnp.zeros(o.shape[:3]))))
        out = np.concatenate(outs, 1)
        g = [np.concatenate([gr[i] for gr in grads], 1) for i in range(3)]
        ref_out, ref_lse = reference.attention(q, k, v, layout)
        tu.assert_close(out, ref_out, "float32", what="heads() out")
        for name, a, r in zip(("dq", "dk", "dv"), g,
                              reference.attention_grad(q, k, v, layout, d_out), strict=True):
            tu.assert_close(a, r, "float32", grad=True, what=f"heads() {name}")

    def test_static_widths_match_the_shared_trace(self):
        """``layout_arrays(..., static_widths=True)`` (per-pattern row widths for the native
        CPU path; one trace per pattern) gives the default arrays' results, forward and
        gradients, and records each query tile's widest list."""
        n, bs, h = 128, 32, 2
        lay = make_layout(example_pattern("bigbird", n, bs), n, h, bs)
        shared, own = jattn.layout_arrays(lay), jattn.layout_arrays(lay, static_widths=True)
        self.assertIsNone(shared.row_widths)
        self.assertEqual(own.row_widths, tuple(int(x) for x in lay.q_count.max(axis=0)))
        self.assertEqual(own.partial_row, int(lay.q_partial.max()))
        q, k, v, d_out = tu.random_inputs(3, (1, h, n, 16), "float32")

        def loss(q, k, v, la):
            return jnp.vdot(jattn.sparse_attention(q, k, v, la), d_out)

        got = [jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, la) for la in (shared, own)]
        (l0, g0), (l1, g1) = got
        tu.assert_close(np.asarray(l1), np.asarray(l0), "float32", what="loss")
        for name, a, b in zip(("dq", "dk", "dv"), g0, g1, strict=True):
            tu.assert_close(np.asarray(b), np.asarray(a), "float32", grad=True, what=name)

    def test_no_retrace_for_same_metadata_shapes(self):
        """Patterns whose metadata arrays have equal shapes share one trace and one compiled
        executable (forward and backward); a pattern with other shapes retraces."""
        n, bs, h = 128, 32, 2
        layouts = [make_layout(example_pattern(nm, n, bs), n, h, bs)
                   for nm in ("causal", "bigbird")]
        layouts.append(make_layout(PT.local(40, 10), n, h, bs))
        layouts.append(make_layout(PT.local(10, 40), n, h, bs))  # its mirror image
        # A pair of equal shapes, one with empty quarters (skip_quarters) and one without: only
        # sm_90 layouts carry skip_quarters into the trace.
        layouts.append(make_layout(PT.local(0, 0), n, h, bs))  # the diagonal: empty quarters
        layouts.append(make_layout(PT.dense(), n, h, bs))
        shapes = [{k: a.shape for k, a in lay.metadata().items()} for lay in layouts]
        # Preconditions of the test (not skips): pairs of equal shapes, different blocks/masks.
        self.assertEqual(shapes[0], shapes[1])
        self.assertEqual(shapes[2], shapes[3])
        self.assertEqual(shapes[4], shapes[5])
        self.assertFalse(np.array_equal(layouts[0].block_mask, layouts[1].block_mask))
        self.assertFalse(np.array_equal(layouts[2].masks, layouts[3].masks))
        self.assertNotEqual(layouts[4].skip_quarters, layouts[5].skip_quarters)
        traces = []

        def loss(q, k, v, lay, d_out):
            traces.append(1)
            return jnp.vdot(jattn.sparse_attention(q, k, v, lay), d_out)

        fwd = jax.jit(lambda q, k, v, lay: jattn.sparse_attention(q, k, v, lay))
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        q, k, v, d_out = tu.random_inputs(1, (1, h, n, 16), "float32")
        for lay in layouts:
            la = jattn.layout_arrays(lay)
            tu.assert_close(fwd(q, k, v, la), reference.attention(q, k, v, lay)[0], "float32",
                            what="out")
            for name, g, r in zip(("dq", "dk", "dv"), grad(q, k, v, la, d_out),
                                  reference.attention_grad(q, k, v, lay, d_out), strict=True):
                tu.assert_close(g, r, "float32", grad=True, what=name)
        self.assertLen(traces, 3)  # one per distinct set of metadata shapes
        self.assertEqual(fwd._cache_size(), 3)
        self.assertEqual(grad._cache_size(), 3)
        # Another number of distinct element masks: other metadata shapes (the ELL widths are
        # padded to multiples of 16, so at this size they alone never differ).
        other = make_layout(example_pattern("longformer", n, bs), n, h, bs)
        self.assertNotIn({k: a.shape for k, a in other.metadata().items()}, shapes)
        grad(q, k, v, jattn.layout_arrays(other), d_out)
        self.assertLen(traces, 4)

    def test_per_batch_row_layout_arrays(self):
        """Per-row documents as LayoutArrays operands: per-head arrays [B, H, ...]; a second
        packing with the same metadata shapes shares the jitted trace; shard_map with the rows
        over one mesh axis and the heads over another (partition_specs(axis, batch_axis)) and
        the static heads() slice of every row, each vs the oracle."""
        n, h, bs = 64, 4, 16
        layouts = [make_layout(PT.documents(rows) & PT.causal(), n, h, bs)
                   for rows in ([[20, 44], [64]], [[64], [20, 44]])]
        q, d_out = tu.random_inputs(2, (2, h, n, 16), "float32", 2)
        k, v = tu.random_inputs(3, (2, 2, n, 16), "float32", 2)
        traces = []

        def fwd(q, k, v, lay):
            traces.append(1)
            return jattn.sparse_attention(q, k, v, lay)

        fwd = jax.jit(fwd)
        for lay in layouts:
            la = jattn.layout_arrays(lay)
            self.assertEqual((la.batch, la.num_heads, la.q_count.shape[:2]), (2, h, (2, h)))
            tu.assert_close(fwd(q, k, v, la), reference.attention(q, k, v, lay)[0], "float32",
                            what="per-row LayoutArrays out")
        self.assertLen(traces, 1)
        layout = layouts[0]
        la = jattn.layout_arrays(layout)
        mesh = jax.make_mesh((2, 2), ("data", "tp"), devices=jax.devices("cpu")[:4],
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        spec = P("data", "tp")
        fn = jax.jit(jax.shard_map(
            functools.partial(jattn.sparse_attention, return_lse=True), mesh=mesh,
            in_specs=(spec, spec, spec, la.partition_specs("tp", "data")),
            out_specs=(spec, spec), check_vma=True))
        (out, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, la), q, k, v)
        grads = vjp((jnp.asarray(d_out), jnp.zeros(lse.shape, lse.dtype)))
        self._check(layout, q, k, v, d_out, out, lse, grads, tag="per-row data x tp")
        sub = la.heads(2, 4)
        self.assertEqual((sub.batch, sub.num_heads), (2, 2))
        tu.assert_close(jattn.sparse_attention(q[:, 2:], k[:, 1:], v[:, 1:], sub),
                        reference.attention(q[:, 2:], k[:, 1:], v[:, 1:],
                                            layout.heads(2, 4))[0],
                        "float32", what="per-row LayoutArrays.heads")

    def test_lse_cotangent(self):
        """A cotangent on LSE flows into q and k (d lse_i / d s_ij = p_ij), float64 by hand."""
        layout, q, k, v, d_out = _per_head_case(n=70, bs=16, b=1, h=2, seed=8, name="bigbird")
        d_lse = np.random.default_rng(9).standard_normal((1, 2, 70)).astype(np.float32)
        _, vjp = jax.vjp(lambda q, k, v: jax.jit(functools.partial(
            jattn.sparse_attention, return_lse=True))(q, k, v, jattn.layout_arrays(layout)),
            q, k, v)
        dq, dk, dv = vjp((jnp.asarray(d_out), jnp.asarray(d_lse)))
        scale = 16 ** -0.5
        mask = layout.dense_mask()[None]
        s = np.where(mask, np.einsum("bhnd,bhmd->bhnm", q.astype(np.float64), k) * scale, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ds_lse = p * d_lse[..., None] * scale
        rq, rk, rv = reference.attention_grad(q, k, v, layout, d_out)
        tu.assert_close(dq, rq + np.einsum("bhnm,bhmd->bhnd", ds_lse, k), "float32", grad=True,
                        what="dq")
        tu.assert_close(dk, rk + np.einsum("bhnm,bhnd->bhmd", ds_lse, q), "float32", grad=True,
                        what="dk")
        tu.assert_close(dv, rv, "float32", grad=True, what="dv")

    def test_jit_of_grad_and_blocklayout_static(self):
        """jit(grad) with a BlockLayout as a static argument (the README's spelling)."""
        layout, q, k, v, d_out = _per_head_case(n=64, bs=32, b=1, h=2, seed=10, name="causal")
        fn = jax.jit(jattn.sparse_attention, static_argnames="layout")
        tu.assert_close(fn(q, k, v, layout=layout), reference.attention(q, k, v, layout)[0],
                        "float32", what="out")
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.vdot(
            jattn.sparse_attention(q, k, v, layout), d_out), argnums=(0, 1, 2)))
        for name, g, r in zip(("dq", "dk", "dv"), grad(q, k, v),
                              reference.attention_grad(q, k, v, layout, d_out), strict=True):
            tu.assert_close(g, r, "float32", grad=True, what=name)

    def test_layout_arrays_errors(self):
        layout, q, k, v, _ = _per_head_case(n=64, bs=32, b=1, h=4, seed=11)
        lay = jattn.layout_arrays(layout)
        self.assertEqual((lay.num_heads, lay.block_size, lay.seq_len), (4, 32, 64))
        with self.assertRaisesRegex(ValueError, r"layout is for num_heads=2 but q has H=4"):
            jattn.sparse_attention(q, k, v, lay.heads(0, 2))
        with self.assertRaisesRegex(ValueError, r"0 <= start < stop <= num_heads=4"):
            lay.heads(2, 6)
        with self.assertRaisesRegex(ValueError, "scale must be a Python float"):
            jattn.sparse_attention(q, k, v, lay, scale="0.5")
        with self.assertRaisesRegex(ValueError, "BlockLayout"):
            jattn.layout_arrays(layout.metadata())


if __name__ == "__main__":
    absltest.main()
