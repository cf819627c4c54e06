"""Cross-backend parity: a pattern, a config and a set of weights mean the same in torch and JAX.

For every combination of the flags, from the same numpy inputs, cotangent and ``init_params``
weights, each backend computes
  * sparse attention: output, log-sum-exp and dq/dk/dv;
  * the whole HybridBlock at the flagged TP size (torch: that many gloo/NCCL processes; JAX: a
    mesh of that many devices): output, input gradient and every parameter gradient;
and each result is compared with the float64 oracle and with the other backend. The kernel
metadata each backend actually hands its kernels is compared bitwise, and canonical weights
round-trip torch -> JAX -> torch bitwise.

Run as a program (flags) or under pytest (defaults: a quick CPU run)::

    python tests/parity_test.py --patterns=causal,bigbird --seq_lens=256 --tp_sizes=2,4 \\
        --report=/tmp/parity.json
    python -m pytest tests/parity_test.py

A failure names the backend, pattern, shape and tensor, and gives the max abs/rel error and
where it is. ``--report=path.json`` writes every case's errors (for the docs).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from jax_test_utils import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices()

import dist_utils  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import flags  # noqa: E402
from absl.testing import absltest  # noqa: E402
from testing_utils import round_to_dtype, tolerance  # noqa: E402

from sparsetp.backends.jax import attention as jax_attn  # noqa: E402
from sparsetp.backends.jax import block as jblock  # noqa: E402
from sparsetp.backends.torch import attention as torch_attn  # noqa: E402
from sparsetp.backends.torch.block import HybridBlock  # noqa: E402
from sparsetp.core import (  # noqa: E402
    HybridConfig,
    init_params,
    make_layout,
    partition_dim,
    reference,
    unshard_param,
)
from sparsetp.core.examples import EXAMPLE_PATTERNS, example_pattern  # noqa: E402
from sparsetp.kernels import launch as kernel_launch  # noqa: E402

_DEFAULT_PATTERNS = ("causal,local,block_diagonal,fixed,strided_causal,random,bigbird,longformer,"
                     "per_head_mix")
flags.DEFINE_list("backends", ["torch", "jax"], "backends to compare (torch, jax)")
flags.DEFINE_list("patterns", _DEFAULT_PATTERNS.split(","),
                  f"named example patterns: {sorted(EXAMPLE_PATTERNS)}")
flags.DEFINE_list("seq_lens", ["100"], "sequence lengths (not multiples of the block: ragged)")
flags.DEFINE_list("num_heads", ["4"], "head counts")
flags.DEFINE_list("head_dims", ["32"], "head dims (16, 32, 64, 128)")
flags.DEFINE_list("block_sizes", ["32"], "layout block sizes (16, 32, 64, 128)")
flags.DEFINE_list("dtypes", ["float32"], "float32, bfloat16, float16")
flags.DEFINE_list("tp_sizes", ["2"], "tensor-parallel sizes for the HybridBlock cases")
flags.DEFINE_list("block_patterns", ["bigbird", "per_head_mix"],
                  "patterns for the HybridBlock cases (a subset: each runs whole blocks)")
flags.DEFINE_integer("batch", 2, "batch size")
flags.DEFINE_integer("seed", 0, "seed of inputs, cotangents and weights")
flags.DEFINE_float("atol_scale", 1.0, "multiplies every tolerance (>= 1 only for bigger shapes)")
flags.DEFINE_enum("device", "cpu", ["cpu", "gpu"], "where both frameworks run")
flags.DEFINE_string("report", None, "write every case's errors to this JSON file")
FLAGS = flags.FLAGS

_REPORT: list[dict] = []


def _flags():
    if not FLAGS.is_parsed():  # under pytest: the defaults (a quick CPU run)
        FLAGS.mark_as_parsed()
    return FLAGS


def _write_report():
    if FLAGS.is_parsed() and FLAGS.report and _REPORT:
        with open(FLAGS.report, "w") as f:
            json.dump(dict(flags={k: str(getattr(FLAGS, k)) for k in (
                "backends", "patterns", "seq_lens", "num_heads", "head_dims", "block_sizes",
                "dtypes", "tp_sizes", "batch", "seed", "atol_scale", "device")},
                torch=torch.__version__, jax=jax.__version__, cases=_REPORT), f, indent=1)


atexit.register(_write_report)


def _compare(actual, expected, *, dtype, grad, case, tensor, against, failures, reduced=1):
    """Record and check one tensor; a failure (appended to ``failures``, so every comparison
    of a case still runs) says which backend/pattern/shape/tensor and how far off.
    ``reduced``: how many tokens the tensor sums over (parameter gradients: batch * seq_len),
    see ``testing_utils.tolerance``."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    atol, rtol = tolerance(dtype, grad, reduced)
    atol, rtol = atol * _flags().atol_scale, rtol * _flags().atol_scale
    row = dict(case, tensor=tensor, against=against, shape=list(a.shape), reduced=reduced)
    problems = []
    if a.shape != e.shape:
        problems.append(f"shape {a.shape} != {e.shape}")
    else:
        if np.isnan(a).any():
            problems.append(f"{int(np.isnan(a).sum())} NaN")
        inf = np.isinf(e)
        if not np.array_equal(np.isinf(a), inf) or not np.array_equal(a[inf], e[inf]):
            problems.append("infinities differ")
        fin = ~inf & ~np.isinf(a)
        err = np.zeros(a.shape)
        np.subtract(a, e, out=err, where=fin)  # only finite pairs: no inf - inf warnings
        err = np.abs(err)
        rel = err / np.maximum(np.abs(e), 1e-30)
        idx = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
        row.update(max_abs=float(err.max(initial=0)), max_rel=float(np.where(
            fin, rel, 0).max(initial=0)), where=[int(i) for i in idx], atol=atol, rtol=rtol,
            bitwise_equal=bool(np.array_equal(a, e)))
        bad = fin & (err > atol + rtol * np.abs(e))
        if bad.any():
            problems.append(f"{int(bad.sum())}/{bad.size} elements out of tolerance; max abs "
                            f"err {row['max_abs']:.3g} at {tuple(idx)} (got {a[idx]!r}, want "
                            f"{e[idx]!r}); max rel err {row['max_rel']:.3g}")
    row["passed"] = not problems
    _REPORT.append(row)
    if problems:
        failures.append(f"[{case}] {tensor} vs {against}: " + "; ".join(problems) +
                        f" (atol={atol:g}, rtol={rtol:g})")


# ---------------------------------------------------------------------------------------------
# Backends on numpy in, numpy (float64) out.

_TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_JAX_DT = {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16,
           "float16": jax.numpy.float16}


def _torch_device():
    return torch.device("cuda" if _flags().device == "gpu" else "cpu")


def _jax_device():
    return jax.devices("gpu" if _flags().device == "gpu" else "cpu")[0]


def torch_attention(q, k, v, d_out, layout, dtype):
    dev = _torch_device()
    q, k, v = (torch.tensor(a, dtype=_TORCH_DT[dtype], device=dev, requires_grad=True)
               for a in (q, k, v))
    out, lse = torch_attn.sparse_attention(q, k, v, layout, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.tensor(d_out, dtype=out.dtype,
                                                                  device=dev))
    return [t.detach().float().cpu().numpy() for t in (out, lse, dq, dk, dv)]


def jax_attention(q, k, v, d_out, layout, dtype):
    with jax.default_device(_jax_device()):
        q, k, v, d_out = (jax.numpy.asarray(a, _JAX_DT[dtype]) for a in (q, k, v, d_out))
        lay = jax_attn.layout_arrays(layout)
        fn = jax.jit(lambda q, k, v, lay: jax_attn.sparse_attention(q, k, v, lay,
                                                                    return_lse=True))
        (out, lse), vjp = jax.vjp(fn, q, k, v, lay)
        dq, dk, dv, _ = vjp((d_out, jax.numpy.zeros_like(lse)))
        return [np.asarray(t.astype(jax.numpy.float32)) for t in (out, lse, dq, dk, dv)]


def torch_layout_arrays(layout, head_dim, dtype):
    """The metadata the torch frontend launches for q [*, *, *, head_dim] of ``dtype``."""
    q = torch.empty((1, 1, 1, head_dim), dtype=_TORCH_DT[dtype], device=_torch_device())
    kind = torch_attn._device_kind(q)
    return {n: t if isinstance(t, int) else t.cpu().numpy()  # ints: the head order
            for n, t in torch_attn._metadata(layout, q, kind).items()}


def jax_layout_arrays(layout, head_dim, dtype):
    lay = jax_attn.layout_arrays(layout, head_dim=head_dim, dtype=_JAX_DT[dtype])
    return {**{n: np.asarray(a) for n, a in lay.metadata().items()},
            "q_head_group": lay.q_head_group, "k_head_group": lay.k_head_group}


def kernel_layout(layout, head_dim, dtype):
    """The layout both frontends must launch (launch.kernel_layout's policy)."""
    kind = "cuda" if _flags().device == "gpu" else "interpreter"
    return kernel_launch.kernel_layout(layout, kind, head_dim=head_dim, dtype=dtype)


def _torch_block_rank(rank, world, config, params, x, dy, device):
    """One torch rank: returns y, dx and this rank's gradient shards (canonical names)."""
    dev = torch.device(f"cuda:{rank}") if device == "gpu" else torch.device("cpu")
    if device == "gpu":
        torch.cuda.set_device(dev)
    block = HybridBlock.from_params(config, params).to(dev)
    xt = torch.tensor(x, dtype=_TORCH_DT[config.dtype], device=dev, requires_grad=True)
    y = block(xt)
    y.backward(torch.tensor(dy, dtype=y.dtype, device=dev))
    grads = {n: p.grad.float().cpu().numpy() for n, p in block.named_parameters()}
    exported = block.export_params()
    return y.detach().float().cpu().numpy(), xt.grad.float().cpu().numpy(), grads, exported


def torch_block(config, params, x, dy, tp):
    backend = "nccl" if _flags().device == "gpu" else "gloo"
    if tp == 1:  # no process group: a single process
        results = [_torch_block_rank(0, 1, config, params, x, dy, _flags().device)]
    else:
        results = dist_utils.run_distributed(_torch_block_rank, tp, config, params, x, dy,
                                             _flags().device, backend=backend, timeout=600)
    y, dx = results[0][0], results[0][1]
    grads = {n: (unshard_param(n, [r[2][n] for r in results]) if partition_dim(n) is not None
                 else results[0][2][n]) for n in params}
    return y, dx, grads, results[0][3]


def jax_block(config, params, x, dy, tp):
    devices = jax.devices("gpu" if _flags().device == "gpu" else "cpu")
    if len(devices) < tp:
        raise AssertionError(f"JAX has {len(devices)} {_flags().device} devices, tp={tp} needs "
                             f"more")
    mesh = jblock.make_mesh(tp, "tp", devices=devices[:tp]) if tp > 1 else None
    p = (jblock.shard_params(params, config, mesh, "tp") if mesh is not None
         else jblock.load_params(params, config))
    fn = jax.jit(lambda p, x: jblock.hybrid_block(p, x, config, mesh=mesh))
    with jax.default_device(devices[0]):
        xj = jax.numpy.asarray(x, _JAX_DT[config.dtype])
        y, vjp = jax.vjp(fn, p, xj)
        dp, dx = vjp(jax.numpy.asarray(dy, y.dtype))
    f32 = lambda a: np.asarray(jax.device_get(a)).astype(np.float32)
    return f32(y), f32(dx), {n: f32(g) for n, g in dp.items()}, jblock.export_params(p)


ATTENTION = {"torch": torch_attention, "jax": jax_attention}
LAYOUT_ARRAYS = {"torch": torch_layout_arrays, "jax": jax_layout_arrays}
BLOCK = {"torch": torch_block, "jax": jax_block}


# ---------------------------------------------------------------------------------------------


class ParityTest(absltest.TestCase):
    def setUp(self):
        f = _flags()
        unknown = set(f.backends) - set(ATTENTION)
        self.assertFalse(unknown, f"unknown backends {unknown}")
        self.backends = list(f.backends)

    def _attention_cases(self):
        f = _flags()
        return itertools.product(f.patterns, map(int, f.seq_lens), map(int, f.num_heads),
                                 map(int, f.head_dims), map(int, f.block_sizes), f.dtypes)

    def test_attention(self):
        f = _flags()
        failures = []
        for name, n, heads, hd, bs, dtype in self._attention_cases():
            case = dict(op="attention", pattern=name, seq_len=n, num_heads=heads, head_dim=hd,
                        block_size=bs, dtype=dtype, batch=f.batch)
            layout = make_layout(example_pattern(name, n, bs), n, heads, bs)
            rng = np.random.default_rng(f.seed)
            shape = (f.batch, heads, n, hd)
            q, k, v, d_out = (round_to_dtype(rng.standard_normal(shape), dtype) for _ in range(4))
            ref_out, ref_lse = reference.attention(q, k, v, layout)
            refs = [ref_out, ref_lse, *reference.attention_grad(q, k, v, layout, d_out)]
            names = ["out", "lse", "dq", "dk", "dv"]
            got = {}
            meta = {}
            for b in self.backends:
                got[b] = ATTENTION[b](q, k, v, d_out, layout, dtype)
                meta[b] = LAYOUT_ARRAYS[b](layout, hd, dtype)
            launched = kernel_layout(layout, hd, dtype)
            case["kernel_block"] = launched.block_size
            try:
                for b in self.backends:
                    for nm, val, ref in zip(names, got[b], refs, strict=True):
                        _compare(val, ref, dtype=dtype, grad=nm.startswith("d"),
                                 case=dict(case, backend=b), tensor=nm,
                                 against="float64 oracle", failures=failures)
                    for nm, arr in launched.metadata().items():
                        if not np.array_equal(meta[b][nm], arr) or meta[b][nm].dtype != np.int32:
                            raise AssertionError(f"[{case}] {b} kernel metadata {nm} differs "
                                                 f"from the kernel layout's")
                    for nm in ("q_head_group", "k_head_group"):
                        if meta[b][nm] != getattr(launched, nm):
                            raise AssertionError(f"[{case}] {b} launches {nm}={meta[b][nm]}, "
                                                 f"the kernel layout says {getattr(launched, nm)}")
                for a, b in itertools.combinations(self.backends, 2):
                    for nm, va, vb in zip(names, got[a], got[b], strict=True):
                        _compare(va, vb, dtype=dtype, grad=nm.startswith("d"),
                                 case=dict(case, backend=a), tensor=nm, against=b,
                                 failures=failures)
                    for nm in meta[a]:
                        np.testing.assert_array_equal(meta[a][nm], meta[b][nm], err_msg=nm)
            except AssertionError as e:
                failures.append(str(e))
        self.assertEmpty(failures, "\n".join(failures))

    def test_hybrid_block(self):
        f = _flags()
        failures = []
        for name, n, heads, hd, bs, dtype, tp in itertools.product(
                f.block_patterns, map(int, f.seq_lens), map(int, f.num_heads),
                map(int, f.head_dims), map(int, f.block_sizes), f.dtypes, map(int, f.tp_sizes)):
            d = heads * hd
            config = HybridConfig(d_model=d, num_heads=heads, d_ff=2 * d,
                                  pattern=example_pattern(name, n, bs), block_size=bs,
                                  dtype=dtype)
            case = dict(op="hybrid_block", pattern=name, seq_len=n, num_heads=heads, head_dim=hd,
                        block_size=bs, dtype=dtype, tp=tp, batch=f.batch)
            params = {k: round_to_dtype(v, dtype) for k, v in init_params(config, f.seed).items()}
            rng = np.random.default_rng(f.seed + 1)
            x, dy = (round_to_dtype(rng.standard_normal((f.batch, n, d)), dtype)
                     for _ in range(2))
            y_ref = reference.hybrid_block(params, x, config)
            dx_ref, dp_ref = reference.hybrid_block_grad(params, x, config, dy)
            got = {b: BLOCK[b](config, params, x, dy, tp) for b in self.backends}
            tokens = f.batch * n  # every parameter gradient sums over all tokens
            try:
                for b in self.backends:
                    y, dx, dp, exported = got[b]
                    c = dict(case, backend=b)
                    _compare(y, y_ref, dtype=dtype, grad=False, case=c, tensor="y",
                             against="float64 oracle", failures=failures)
                    _compare(dx, dx_ref, dtype=dtype, grad=True, case=c, tensor="dx",
                             against="float64 oracle", failures=failures)
                    for pn in params:
                        _compare(dp[pn], dp_ref[pn], dtype=dtype, grad=True, case=c,
                                 tensor=f"d[{pn}]", against="float64 oracle", failures=failures,
                                 reduced=tokens)
                        if not np.array_equal(exported[pn].astype(np.float32), params[pn]):
                            raise AssertionError(f"[{c}] exported {pn} is not bitwise the "
                                                 f"loaded weight")
                for a, b in itertools.combinations(self.backends, 2):
                    c = dict(case, backend=a)
                    for i, nm in enumerate(("y", "dx")):
                        _compare(got[a][i], got[b][i], dtype=dtype, grad=i > 0, case=c,
                                 tensor=nm, against=b, failures=failures)
                    for pn in params:
                        _compare(got[a][2][pn], got[b][2][pn], dtype=dtype, grad=True, case=c,
                                 tensor=f"d[{pn}]", against=b, failures=failures,
                                 reduced=tokens)
            except AssertionError as e:
                failures.append(str(e))
        self.assertEmpty(failures, "\n".join(failures))

    def test_weight_interchange_round_trip(self):
        """torch export -> JAX load/export -> torch load/export: bitwise at every step."""
        if not {"torch", "jax"} <= set(self.backends):
            self.fail("weight interchange needs both backends in --backends")
        from sparsetp.core import patterns as P  # noqa: PLC0415

        config = HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.causal(),
                              block_size=32)
        params = init_params(config, _flags().seed)
        from_torch = HybridBlock.from_params(config, params).export_params()
        via_jax = jblock.export_params(jblock.load_params(from_torch, config))
        back = HybridBlock.from_params(config, via_jax).export_params()
        for name in params:
            for stage, arr in (("torch export", from_torch), ("jax export", via_jax),
                               ("torch re-export", back)):
                self.assertEqual(arr[name].dtype, params[name].dtype, f"{stage} {name}")
                np.testing.assert_array_equal(arr[name], params[name], f"{stage} {name}")


if __name__ == "__main__":
    absltest.main()
