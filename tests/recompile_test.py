"""A new pattern must not recompile the kernels: a signature-level check.

Triton compiles one variant per distinct (constexprs, launch options, argument signature). The
argument signature is each pointer's dtype and 16-byte alignment, and for each integer argument
its type and Triton's specialisation (``x == 1`` becomes a constant, ``x % 16 == 0`` is marked
divisible). Layout metadata reaches the kernels as tensors, but the list strides derive from the
ELL width, so without padding (``layout._ELL_ALIGN``) a pattern whose longest row has 3 tiles
and one with 32 compiled two variants (issue 4 audit).

This test builds the forward, dQ and dK/dV launch descriptions exactly as the torch frontend
does (``sparsetp.kernels.abi``, ``device_kind="cuda"``) for several patterns at one
(B, H, N, D, block, dtype), and asserts that the constexprs, warps/stages and the per-argument
signature (computed with Triton's own ``native_specialize_impl``, the function its launcher
calls) are identical. Pointer alignment comes from the allocator (the CUDA caching allocator
returns 512-byte aligned blocks), not from the pattern, so pointers are compared by dtype only.

It deliberately stays at the signature level: on a CPU machine the kernels run in Triton's
interpreter, which compiles nothing, so counting compilations there would prove nothing. The
GPU evidence is the timing of a new pattern's first call (benchmarks/results/).
"""

from __future__ import annotations

import inspect
from unittest import mock

import numpy as np
import torch
from absl.testing import absltest, parameterized
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from sparsetp.core import layout as layout_lib
from sparsetp.core import make_layout
from sparsetp.core import patterns as P
from sparsetp.kernels import abi, schedule

# (B, H, N, D, block, dtype). The first has 32 tiles per side, so padded widths differ across
# patterns (16 for local, 32 for dense); the second is ragged (N % block != 0, ALIGNED off).
SHAPES = (
    (2, 3, 2048, 64, 64, "bfloat16"),
    (1, 4, 1000, 128, 32, "float16"),
    (1, 2, 768, 32, 128, "float32"),
)


def _patterns(b: int, n: int) -> dict[str, P.Pattern]:
    return {
        "causal": P.causal(),
        "bigbird": P.bigbird(b, 3, 1, 1, seed=3),
        "local": P.local(b + b // 2, b // 3),
        "strided_causal_or_local": P.strided(4, b) & P.causal() | P.local(b - 1, 0),
        "dense": P.dense(),
        "global_tokens": P.global_tokens(b // 2 + 3),
        # Packed documents: two packings of the same total (boundaries inside tiles); lengths
        # are layout data, never kernel arguments.
        "documents_a": P.documents([7, n // 2, 1, n - n // 2 - 8]) & P.causal(),
        "documents_b": P.documents([n // 3 + 1, n - n // 3 - 1]) & P.causal(),
        "per_head_mix": P.per_head([P.causal(), P.local(b, b),
                                    P.strided(2, b, per_head_offset=True) | P.global_tokens(5)]),
    }


def _meta(lay) -> dict:
    # As sparsetp.backends.torch.launch.metadata: C-contiguous int32 tensors plus the layout's
    # head groups (they shape the grid, never the compiled kernel).
    q_group, k_group = schedule.head_groups(lay)
    return {**{name: torch.from_numpy(np.array(arr, dtype=np.int32, order="C"))
               for name, arr in lay.metadata().items()},
            "q_head_group": q_group, "k_head_group": k_group}


def _calls(lay, batch: int, head_dim: int, dtype: str):
    """(KernelCall, output tensors) of the forward, dQ and dK/dV launches, built like the torch
    frontend builds them. Big tensors live on the meta device: only shapes, strides and dtypes
    are read."""
    h, n = lay.num_heads, lay.seq_len
    tdt = getattr(torch, dtype)
    sdt = torch.float64 if dtype == "float64" else torch.float32
    q, k, v, out, d_out, dq, dk, dv = (torch.empty((batch, h, n, head_dim), dtype=tdt,
                                                   device="meta") for _ in range(8))
    lse, delta = (torch.empty((batch, h, n), dtype=sdt, device="meta") for _ in range(2))
    meta = _meta(lay)
    scale = head_dim ** -0.5
    fwd = abi.fwd_call(q, k, v, meta, scale=scale, dtype=dtype, device_kind="cuda",
                         strides={"q": q.stride(), "k": k.stride(), "v": v.stride(),
                                "out": out.stride(), "lse": lse.stride()})
    st = {"q": q.stride(), "k": k.stride(), "v": v.stride(), "d_out": d_out.stride(),
          "lse": lse.stride()}
    dq_call = abi.bwd_dq_call(q, k, v, d_out, lse, out, None, meta, scale=scale, dtype=dtype,
                              device_kind="cuda",
                              strides={**st, "out": out.stride(), "dq": dq.stride()})
    dkdv_call = abi.bwd_dkdv_call(q, k, v, d_out, lse, delta, meta, scale=scale, dtype=dtype,
                                  device_kind="cuda",
                                  strides={**st, "dk": dk.stride(), "dv": dv.stride()})
    return {"fwd": (fwd, (out, lse)), "bwd_dq": (dq_call, (dq, delta)),
            "bwd_dkdv": (dkdv_call, (dk, dv))}


def _int_key(x: int):
    """(x % 16 == 0, x == 1) plus Triton's own (type, specialisation) of the integer ``x``."""
    return (x % 16 == 0, x == 1, native_specialize_impl(BaseBackend, x, False, True, True))


def _signature(call, outputs) -> dict[str, object]:
    """Per kernel parameter: ``("tensor", dtype)`` for pointers, the integer key for ints, the
    type name for floats. Binds positionally to the kernel's own signature (none of the kernels
    marks a parameter ``do_not_specialize``, so every int is specialised)."""
    names = list(inspect.signature(call.kernel.fn).parameters)
    values = (*call.args, *outputs)
    assert len(values) + len(call.constexprs) == len(names), (call.name, len(values), len(names))
    assert set(call.constexprs) == set(names[len(values):]), call.name
    sig = {}
    for name, x in zip(names, values, strict=False):
        if isinstance(x, torch.Tensor):
            sig[name] = ("tensor", str(x.dtype))
        elif isinstance(x, bool):
            sig[name] = ("bool", x)
        elif isinstance(x, int):
            sig[name] = _int_key(x)
        elif isinstance(x, float):
            sig[name] = ("float",)
        else:
            raise AssertionError(f"{call.name}.{name}: unexpected argument type {type(x)}")
    return sig


def _compile_keys(lay, batch, head_dim, dtype):
    """Per kernel: everything a pattern could change in Triton's compile cache key."""
    return {name: {"constexprs": dict(call.constexprs), "num_warps": call.num_warps,
                   "num_stages": call.num_stages, "signature": _signature(call, outs)}
            for name, (call, outs) in _calls(lay, batch, head_dim, dtype).items()}


class RecompileTest(parameterized.TestCase):

    @parameterized.parameters(*SHAPES)
    def test_patterns_share_one_compile_key(self, b, h, n, d, bs, dtype):
        keys, widths = {}, set()
        for name, pattern in _patterns(bs, n).items():
            lay = make_layout(pattern, n, h, bs)
            widths.add(int(lay.q_count.max()))
            keys[name] = _compile_keys(lay, b, d, dtype)
        # Not vacuous: the patterns' longest rows differ.
        self.assertGreater(len(widths), 1, widths)
        first_name, first = next(iter(keys.items()))
        for name, key in keys.items():
            for kernel in key:
                with self.subTest(pattern=name, kernel=kernel):
                    self.assertEqual(key[kernel]["constexprs"], first[kernel]["constexprs"])
                    self.assertEqual(key[kernel]["num_warps"], first[kernel]["num_warps"])
                    self.assertEqual(key[kernel]["num_stages"], first[kernel]["num_stages"])
                    self.assertEqual(key[kernel]["signature"], first[kernel]["signature"],
                                     f"{name} vs {first_name}")

    @parameterized.parameters(*SHAPES)
    def test_per_batch_row_packings_share_one_compile_key(self, b, h, n, d, bs, dtype):
        """Per-row documents (each of B rows its own packing) launch as ``layout.flat()``, the
        B * H table heads, with batch folded into heads (``[1, B * H, N, D]``): new per-row
        lengths of the same total are new table data under one compile key, however the
        packings' longest rows differ."""
        packings = ([[7, n // 2, 1, n - n // 2 - 8], [n]],
                    [[bs] * (n // bs) + [n % bs] * (n % bs > 0), [n // 3 + 1, n - n // 3 - 1]],
                    [[1, n - 1], [n - 5, 5]])
        keys, widths = [], set()
        for lengths in packings:
            lay = make_layout(P.documents(lengths) & P.causal(), n, h, bs)
            self.assertEqual(lay.batch, 2)
            widths.add(int(lay.q_count.max()))
            keys.append(_compile_keys(lay.flat(), 1, d, dtype))
        self.assertGreater(len(widths), 1, widths)
        for key in keys[1:]:
            self.assertEqual(key, keys[0])

    def test_padded_widths_differ_but_specialise_alike(self):
        """At 32 tiles per side the padded ELL widths are 16 and 32: the arrays differ in
        shape, yet every stride keeps the same specialisation."""
        b, h, n, d, bs, dtype = SHAPES[0]
        local = make_layout(P.local(bs, 0), n, h, bs)
        dense = make_layout(P.dense(), n, h, bs)
        self.assertEqual((local.q_index.shape[-1], dense.q_index.shape[-1]), (16, 32))
        self.assertEqual(_compile_keys(local, b, d, dtype), _compile_keys(dense, b, d, dtype))

    def test_unpadded_widths_would_recompile(self):
        """Sanity check of the test itself: without the padding the list strides of a 2-wide
        and a 32-wide layout specialise differently, so the check above would fail."""
        b, h, n, d, bs, dtype = SHAPES[0]
        with mock.patch.object(layout_lib, "_ELL_ALIGN", 1):
            local = make_layout(P.local(bs, 0), n, h, bs)
            dense = make_layout(P.dense(), n, h, bs)
        self.assertEqual((local.q_index.shape[-1], dense.q_index.shape[-1]), (2, 32))
        k_local = _compile_keys(local, b, d, dtype)
        k_dense = _compile_keys(dense, b, d, dtype)
        self.assertNotEqual(k_local["fwd"]["signature"], k_dense["fwd"]["signature"])

    @parameterized.named_parameters(
        ("block_size", dict(bs=32), "BLOCK"),
        ("head_dim", dict(d=128), "HEAD_DIM"),
    )
    def test_shape_changes_do_change_constexprs(self, change, constexpr):
        """Converse: a different block size or head dim is a new compile (the test is not
        vacuous about what it compares)."""
        b, h, n, d, bs, dtype = SHAPES[0]
        base = _compile_keys(make_layout(P.causal(), n, h, bs), b, d, dtype)
        bs2, d2 = change.get("bs", bs), change.get("d", d)
        other = _compile_keys(make_layout(P.causal(), n, h, bs2), b, d2, dtype)
        for kernel in base:
            with self.subTest(kernel=kernel):
                self.assertNotEqual(base[kernel]["constexprs"][constexpr],
                                    other[kernel]["constexprs"][constexpr])

    def test_head_dim_above_256_is_refused_before_compiling(self):
        """D > 256 never reaches a compile: a ValueError naming the argument and the reason
        (up to 256 the kernels pad the head dim to a power of two, tiles.SUPPORTED_HEAD_DIMS)."""
        lay = make_layout(P.causal(), 256, 2, 64)
        with self.assertRaisesRegex(ValueError, r"^q has head dim 272; head dims above 256 are "
                                    r"not supported.*split-D accumulator"):
            _calls(lay, 1, 272, "bfloat16")
        _calls(lay, 1, 256, "bfloat16")  # described (block 64 fits D=256)


if __name__ == "__main__":
    absltest.main()
