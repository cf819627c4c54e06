"""Cross-backend parity: a pattern, a config and a set of weights mean the same in torch and JAX.

For every combination of the flags, from the same numpy inputs, cotangent and ``init_params``
weights, each backend computes
  * sparse attention: output, log-sum-exp and dq/dk/dv;
  * the whole HybridBlock at the flagged TP size (torch: that many NCCL/gloo processes; JAX: a
    mesh of that many devices): output, input gradient and every parameter gradient;
and each result is compared with the float64 oracle and with the other backend. The kernel
metadata each backend actually hands its kernels is compared bitwise, and canonical weights
round-trip torch -> JAX -> torch bitwise.

Run as a program (flags) or under pytest (the defaults)::

    python tests/parity_test.py --patterns=causal,bigbird --seq_lens=256 --tp_sizes=2,4 \\
        --report=/tmp/parity.json
    python -m pytest tests/parity_test.py

Devices (``--device``, default ``auto``): ``gpu`` when torch and JAX both see a GPU (compiled
kernels), else ``cpu`` (CPU tensors and CPU JAX devices: Triton's interpreter). The sizes left
unset are the device's defaults (``_DEFAULTS``): on CPU small shapes for the interpreter (N=100,
4 heads of 32, blocks of 32, TP 2; ~70 s on 2 cores); on a GPU shapes whose float64 oracle
stays cheap (N=300, 4 heads of 64, blocks of 64; the oracle of a whole block at N=1000 alone
outran a 75 s limit), and the TP sizes of 1 and 2 that the GPUs hold (TP 1 on one GPU: the
whole program then takes ~60 s on an H100, most of it first compiles). A HybridBlock case
of a TP size given with ``--tp_sizes`` runs on that many GPUs when there are that many; with
``auto`` and fewer GPUs it runs on CPU ranks / CPU devices at the CPU sizes (the suite's rule:
``tests/dist_utils.py``, ``tests/jax_test_utils.py``), with ``--device=gpu`` it fails saying
how many GPUs it needs. Every report row names its device.

Real-model attention: ``--kv_heads`` (grouped-query k/v; 0 = as many as the query heads),
``--kv_lens`` (N_k keys for N queries, the diagonal aligned to the end of the keys; 0 = N),
``--documents`` (``none``, ``shared``: one packing for every batch row, ``per_row``: each row its
own; lengths drawn from ``--seed``, boundaries inside tiles) and head dims up to 256 multiply the
attention cases; ``--kv_heads`` and ``--documents`` the HybridBlock cases too (combinations
where H_kv does not divide H, or the TP size H_kv, are left out and listed in the report).
``test_real_model_attention`` / ``test_real_model_block`` run a small fixed set of those
(GQA, N_q != N_k, packed documents per row, D=256) whatever the flags, so pytest covers them.

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

from sparsetp import _runtime  # noqa: E402
from sparsetp.backends.jax import attention as jax_attn  # noqa: E402
from sparsetp.backends.jax import block as jblock  # noqa: E402
from sparsetp.backends.torch import attention as torch_attn  # noqa: E402
from sparsetp.backends.torch import launch as torch_launch  # noqa: E402
from sparsetp.backends.torch.block import HybridBlock  # noqa: E402
from sparsetp.core import (  # noqa: E402
    HybridConfig,
    init_params,
    make_layout,
    partition_dim,
    reference,
    unshard_param,
)
from sparsetp.core.config import document_lengths_key  # noqa: E402
from sparsetp.core.examples import EXAMPLE_PATTERNS, example_pattern  # noqa: E402
from sparsetp.kernels import schedule  # noqa: E402

_DEFAULT_PATTERNS = ("causal,local,block_diagonal,fixed,strided_causal,random,bigbird,longformer,"
                     "per_head_mix,neighborhood_global")
flags.DEFINE_list("backends", ["torch", "jax"], "backends to compare (torch, jax)")
flags.DEFINE_list("patterns", _DEFAULT_PATTERNS.split(","),
                  f"named example patterns: {sorted(EXAMPLE_PATTERNS)}")
flags.DEFINE_list("seq_lens", None, "sequence lengths (not multiples of the block: ragged; "
                  "default: the device's, see _DEFAULTS)")
flags.DEFINE_list("num_heads", None, "head counts (default: the device's)")
flags.DEFINE_list("head_dims", None, "head dims (multiples of 16 up to 256; default: the "
                  "device's)")
flags.DEFINE_list("kv_heads", ["0"], "key/value heads (GQA/MQA; must divide the query heads; "
                  "0: as many as the query heads)")
flags.DEFINE_list("kv_lens", ["0"], "key lengths N_k of the attention cases (0: N_k = N)")
flags.DEFINE_list("documents", ["none"], "packed documents: none, shared (one packing for every "
                  "batch row), per_row (each batch row its own)")
flags.DEFINE_list("block_sizes", None, "layout block sizes (16, 32, 64, 128; default: the "
                  "device's)")
flags.DEFINE_list("dtypes", ["float32"], "float32, bfloat16, float16")
flags.DEFINE_list("tp_sizes", None, "tensor-parallel sizes for the HybridBlock cases (default: "
                  "the device's)")
flags.DEFINE_list("block_patterns", ["bigbird", "per_head_mix"],
                  "patterns for the HybridBlock cases (a subset: each runs whole blocks)")
flags.DEFINE_integer("batch", 2, "batch size")
flags.DEFINE_integer("seed", 0, "seed of inputs, cotangents and weights")
flags.DEFINE_float("atol_scale", 1.0, "multiplies every tolerance (>= 1 only for bigger shapes)")
flags.DEFINE_enum("device", "auto", ["auto", "cpu", "gpu"], "where both frameworks run "
                  "(auto: gpu when torch and JAX both see a GPU, else cpu)")
flags.DEFINE_string("report", None, "write every case's errors to this JSON file")
FLAGS = flags.FLAGS

_REPORT: list[dict] = []

# Sizes per device when their flag is unset (see the module docstring).
_DEFAULTS = {
    "cpu": dict(seq_lens=[100], num_heads=[4], head_dims=[32], block_sizes=[32], tp_sizes=[2]),
    "gpu": dict(seq_lens=[300], num_heads=[4], head_dims=[64], block_sizes=[64],
                tp_sizes=[1, 2]),
}


def _flags():
    if not FLAGS.is_parsed():  # under pytest: the defaults (a quick CPU run)
        FLAGS.mark_as_parsed()
    return FLAGS


def gpu_counts() -> tuple[int, int]:
    """GPUs seen by (torch, JAX)."""
    try:
        n_jax = len(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend
        n_jax = 0
    return (torch.cuda.device_count() if torch.cuda.is_available() else 0), n_jax


def device() -> str:
    """Where the attention cases run: ``--device``, with ``auto`` resolved."""
    want = _flags().device
    n_torch, n_jax = gpu_counts()
    if want == "gpu" and not (n_torch and n_jax):
        raise AssertionError(f"--device=gpu needs a GPU seen by torch and JAX; torch sees "
                             f"{n_torch}, JAX {n_jax}")
    if want == "auto":
        return "gpu" if n_torch and n_jax else "cpu"
    return want


def sizes(name: str, dev: str) -> list[int]:
    """The ints of flag ``name`` if set, else ``dev``'s default (``_DEFAULTS``)."""
    values = getattr(_flags(), name)
    return [int(v) for v in values] if values else list(_DEFAULTS[dev][name])


def block_device(tp: int) -> str:
    """Where a HybridBlock case of TP ``tp`` runs: the GPUs if there are ``tp`` (for both
    frameworks), else, with ``--device=auto``, CPU ranks / CPU devices."""
    dev = device()
    if dev == "cpu" or tp <= min(gpu_counts()):
        return dev
    if _flags().device == "auto":
        return "cpu"
    n_torch, n_jax = gpu_counts()
    raise AssertionError(f"tp={tp} on --device=gpu needs {tp} GPUs; torch sees {n_torch}, JAX "
                         f"{n_jax} (--device=auto runs it on CPU ranks)")


def _write_report():
    if FLAGS.is_parsed() and FLAGS.report and _REPORT:
        n_torch, n_jax = gpu_counts()
        with open(FLAGS.report, "w") as f:
            json.dump(dict(flags={k: str(getattr(FLAGS, k)) for k in (
                "backends", "patterns", "seq_lens", "num_heads", "head_dims", "block_sizes",
                "dtypes", "tp_sizes", "batch", "seed", "atol_scale", "device", "kv_heads",
                "kv_lens", "documents")},
                torch=torch.__version__, jax=jax.__version__, gpus_torch=n_torch,
                gpus_jax=n_jax, cases=_REPORT), f, indent=1)


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


_DOCUMENT_MODES = ("none", "shared", "per_row")


def document_lengths(mode: str, n: int, batch: int, seed: int):
    """Packed documents of ``mode`` for ``n`` tokens: None, one list (``shared``) or ``batch``
    lists (``per_row``), each of 1-4 documents cut at points drawn from ``seed`` (so
    boundaries fall inside tiles)."""
    if mode not in _DOCUMENT_MODES:
        raise AssertionError(f"--documents takes {_DOCUMENT_MODES}, got {mode!r}")
    if mode == "none":
        return None
    rng = np.random.default_rng(seed)

    def one():
        cuts = np.unique(rng.integers(1, n, size=int(rng.integers(0, 4))))
        return [int(x) for x in np.diff(np.concatenate([[0], cuts, [n]]))]

    return one() if mode == "shared" else [one() for _ in range(batch)]


def _with_documents(pattern, lengths):
    from sparsetp.core import patterns as P  # noqa: PLC0415

    return pattern if lengths is None else P.documents(lengths) & pattern


# ---------------------------------------------------------------------------------------------
# Backends on numpy in, numpy (float64) out.

_TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_JAX_DT = {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16,
           "float16": jax.numpy.float16}


def _torch_device(dev):
    return torch.device("cuda" if dev == "gpu" else "cpu")


def _jax_device(dev):
    return jax.devices(dev)[0]


def torch_attention(q, k, v, d_out, layout, dtype, dev):
    dev = _torch_device(dev)
    q, k, v = (torch.tensor(a, dtype=_TORCH_DT[dtype], device=dev, requires_grad=True)
               for a in (q, k, v))
    out, lse = torch_attn.sparse_attention(q, k, v, layout, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.tensor(d_out, dtype=out.dtype,
                                                                  device=dev))
    return [t.detach().float().cpu().numpy() for t in (out, lse, dq, dk, dv)]


def jax_attention(q, k, v, d_out, layout, dtype, dev):
    with jax.default_device(_jax_device(dev)):
        q, k, v, d_out = (jax.numpy.asarray(a, _JAX_DT[dtype]) for a in (q, k, v, d_out))
        lay = jax_attn.layout_arrays(layout)
        fn = jax.jit(lambda q, k, v, lay: jax_attn.sparse_attention(q, k, v, lay,
                                                                    return_lse=True))
        (out, lse), vjp = jax.vjp(fn, q, k, v, lay)
        dq, dk, dv, _ = vjp((d_out, jax.numpy.zeros_like(lse)))
        return [np.asarray(t.astype(jax.numpy.float32)) for t in (out, lse, dq, dk, dv)]


def torch_layout_arrays(layout, head_dim, dtype, dev):
    """The metadata the torch frontend launches for q [*, *, *, head_dim] of ``dtype`` (a
    per-row layout's flat view: batch folded into heads)."""
    q = torch.empty((1, 1, 1, head_dim), dtype=_TORCH_DT[dtype], device=_torch_device(dev))
    kind = torch_launch.device_kind(q)
    return {n: t if isinstance(t, int) else t.cpu().numpy()  # ints: the head order
            for n, t in torch_launch.metadata(layout.flat(), q, kind).items()}


def jax_layout_arrays(layout, head_dim, dtype, dev):
    lay = jax_attn.layout_arrays(layout, head_dim=head_dim, dtype=_JAX_DT[dtype])
    return {**{n: np.asarray(a) for n, a in lay.metadata().items()},
            "q_head_group": lay.q_head_group, "k_head_group": lay.k_head_group}


def kernel_layout(layout, head_dim, dtype, dev):
    """The layout both frontends must launch on ``dev`` (schedule.kernel_layout's policy)."""
    kind = _runtime.device_kind("cuda" if dev == "gpu" else "cpu")
    return schedule.kernel_layout(layout, kind, head_dim=head_dim, dtype=dtype)


def _torch_block_rank(rank, world, config, params, x, dy, device, lengths=None):
    """One torch rank: returns y, dx and this rank's gradient shards (canonical names)."""
    dev = torch.device(f"cuda:{rank}") if device == "gpu" else torch.device("cpu")
    if device == "gpu":
        torch.cuda.set_device(dev)
    block = HybridBlock.from_params(config, params).to(dev)
    xt = torch.tensor(x, dtype=_TORCH_DT[config.dtype], device=dev, requires_grad=True)
    y = block(xt, document_lengths=lengths)
    y.backward(torch.tensor(dy, dtype=y.dtype, device=dev))
    grads = {n: p.grad.float().cpu().numpy() for n, p in block.named_parameters()}
    exported = block.export_params()
    return y.detach().float().cpu().numpy(), xt.grad.float().cpu().numpy(), grads, exported


def torch_block_ranks(config, params, x, dy, tp, dev, lengths=None):
    """Every torch rank's :func:`_torch_block_rank` result (TP 1: this process)."""
    if tp == 1:  # no process group: a single process
        return [_torch_block_rank(0, 1, config, params, x, dy, dev, lengths)]
    return dist_utils.run_distributed(_torch_block_rank, tp, config, params, x, dy, dev,
                                      lengths, backend=_torch_backend(dev), timeout=600)


def _torch_backend(dev):
    return "nccl" if dev == "gpu" else "gloo"


def torch_block_result(params, results):
    """y, dx, the unsharded parameter gradients and the exported weights of the ranks' results."""
    y, dx = results[0][0], results[0][1]
    grads = {n: (unshard_param(n, [r[2][n] for r in results]) if partition_dim(n) is not None
                 else results[0][2][n]) for n in params}
    return y, dx, grads, results[0][3]


def torch_block(config, params, x, dy, tp, dev, lengths=None):
    return torch_block_result(params, torch_block_ranks(config, params, x, dy, tp, dev, lengths))


def jax_block(config, params, x, dy, tp, dev, lengths=None):
    devices = jax.devices(dev)
    if len(devices) < tp:
        raise AssertionError(f"JAX has {len(devices)} {dev} devices, tp={tp} needs more")
    mesh = jblock.make_mesh(tp, "tp", devices=devices[:tp]) if tp > 1 else None
    lengths = document_lengths_key(lengths)  # static under jit: hashable tuples
    fn = jax.jit(lambda p, x: jblock.hybrid_block(p, x, config, mesh=mesh,
                                                  document_lengths=lengths))
    with jax.default_device(devices[0]):  # every array of the case on ``dev``
        p = (jblock.shard_params(params, config, mesh, "tp") if mesh is not None
             else jblock.load_params(params, config))
        xj = jax.numpy.asarray(x, _JAX_DT[config.dtype])
        y, vjp = jax.vjp(fn, p, xj)
        dp, dx = vjp(jax.numpy.asarray(dy, y.dtype))
    f32 = lambda a: np.asarray(jax.device_get(a)).astype(np.float32)
    return f32(y), f32(dx), {n: f32(g) for n, g in dp.items()}, jblock.export_params(p)


def _block_problem(dev, name, n, heads, hd, bs, dtype, tp, h_kv, docs):
    """(config, params, x, dy, document lengths) of a HybridBlock case, or None for a case
    left out (H_kv must divide H and be divisible by the TP size)."""
    f = _flags()
    h_kv = h_kv or heads
    if heads % h_kv or h_kv % tp:
        return None
    d = heads * hd
    config = HybridConfig(d_model=d, num_heads=heads, d_ff=2 * d,
                          pattern=example_pattern(name, n, bs), block_size=bs,
                          dtype=dtype, num_kv_heads=h_kv)
    lengths = document_lengths(docs, n, f.batch, f.seed + n)
    params = {k: round_to_dtype(v, dtype) for k, v in init_params(config, f.seed).items()}
    rng = np.random.default_rng(f.seed + 1)
    x, dy = (round_to_dtype(rng.standard_normal((f.batch, n, d)), dtype) for _ in range(2))
    return config, params, x, dy, lengths


ATTENTION = {"torch": torch_attention, "jax": jax_attention}
LAYOUT_ARRAYS = {"torch": torch_layout_arrays, "jax": jax_layout_arrays}
BLOCK = {"torch": torch_block, "jax": jax_block}


# ---------------------------------------------------------------------------------------------


class ParityTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        """The torch ranks of every multi-process HybridBlock case (test_hybrid_block's and
        test_real_model_block's) of one TP size run in one launch (dist_utils.SharedLaunches:
        spawning costs ~4 s per launch on 2 CPU cores), started by the first case to need it."""
        super().setUpClass()
        cls.torch_launches = dist_utils.SharedLaunches()
        if "torch" not in _flags().backends:
            return
        for args in [*cls._block_cases(), cls._real_model_block_args()]:
            problem = _block_problem(*args)
            tp, dev = args[7], args[0]
            if problem is not None and tp > 1:
                cls.torch_launches.add(repr(args), tp, _torch_block_rank, *problem[:4], dev,
                                       problem[4], backend=_torch_backend(dev), timeout=600)

    def setUp(self):
        f = _flags()
        unknown = set(f.backends) - set(ATTENTION)
        self.assertFalse(unknown, f"unknown backends {unknown}")
        self.backends = list(f.backends)

    def _attention_cases(self, dev):
        f = _flags()
        return itertools.product(f.patterns, sizes("seq_lens", dev), sizes("num_heads", dev),
                                 sizes("head_dims", dev), sizes("block_sizes", dev), f.dtypes,
                                 [int(x) for x in f.kv_heads], [int(x) for x in f.kv_lens],
                                 f.documents)

    def test_attention(self):
        failures = []
        dev = device()
        for name, n, heads, hd, bs, dtype, h_kv, n_kv, docs in self._attention_cases(dev):
            self._attention_case(dev, name, n, n_kv or n, heads, h_kv or heads, hd, bs, dtype,
                                 docs, failures)
        self.assertEmpty(failures, "\n".join(failures))

    # (pattern, N, N_k, H, H_kv, head dim, block, documents): what test_real_model_attention
    # runs whatever the flags: GQA 4:2 and MQA, more keys than queries and fewer, packed
    # documents per batch row and shared, head dims 80 and 256; CPU sizes (the interpreter pays
    # per element), on a GPU the same cases.
    _REAL_MODEL_CASES = (
        ("causal", 100, 100, 4, 2, 32, 32, "per_row"),
        ("bigbird", 100, 100, 4, 1, 32, 32, "shared"),
        ("causal", 40, 100, 4, 2, 32, 16, "per_row"),
        ("local", 100, 60, 2, 2, 16, 32, "none"),
        ("causal", 40, 40, 2, 1, 256, 16, "per_row"),
        ("per_head_mix", 50, 50, 2, 2, 80, 16, "shared"),
    )

    def test_real_model_attention(self):
        """GQA/MQA, N_q != N_k, packed documents (per row and shared), head dims 80 and 256:
        torch vs JAX vs the oracle (the flags' sweep covers more, see the module docstring)."""
        failures = []
        dev = device()
        for name, n, n_kv, heads, h_kv, hd, bs, docs in self._REAL_MODEL_CASES:
            self._attention_case(dev, name, n, n_kv, heads, h_kv, hd, bs, "float32", docs,
                                 failures)
        self.assertEmpty(failures, "\n".join(failures))

    def _attention_case(self, dev, name, n, n_kv, heads, h_kv, hd, bs, dtype, docs, failures):
        """One attention case: every backend vs the float64 oracle and each other, and the
        kernel metadata each launches vs the kernel layout's; failures appended."""
        f = _flags()
        case = dict(op="attention", pattern=name, seq_len=n, kv_len=n_kv, num_heads=heads,
                    kv_heads=h_kv, head_dim=hd, block_size=bs, dtype=dtype, documents=docs,
                    batch=f.batch, device=dev)
        if heads % h_kv:
            _REPORT.append(dict(case, left_out=f"H_kv={h_kv} does not divide H={heads}"))
            return
        virtual = max(n, n_kv)  # the sequence the pattern (and the documents) cover
        lengths = document_lengths(docs, virtual, f.batch, f.seed + n)
        case["document_lengths"] = lengths
        pattern = _with_documents(example_pattern(name, virtual, bs), lengths)
        layout = make_layout(pattern, n, heads, bs, kv_len=n_kv)
        rng = np.random.default_rng(f.seed)
        q, d_out = (round_to_dtype(rng.standard_normal((f.batch, heads, n, hd)), dtype)
                    for _ in range(2))
        k, v = (round_to_dtype(rng.standard_normal((f.batch, h_kv, n_kv, hd)), dtype)
                for _ in range(2))
        ref_out, ref_lse = reference.attention(q, k, v, layout)
        refs = [ref_out, ref_lse, *reference.attention_grad(q, k, v, layout, d_out)]
        names = ["out", "lse", "dq", "dk", "dv"]
        got = {}
        meta = {}
        for b in self.backends:
            got[b] = ATTENTION[b](q, k, v, d_out, layout, dtype, dev)
            meta[b] = LAYOUT_ARRAYS[b](layout, hd, dtype, dev)
        # A per-row layout launches its flat view (batch folded into heads).
        launched = kernel_layout(layout.flat(), hd, dtype, dev)
        case["kernel_block"] = launched.block_size
        group = heads // h_kv  # dk, dv sum over a group of query heads
        try:
            for b in self.backends:
                for nm, val, ref in zip(names, got[b], refs, strict=True):
                    _compare(val, ref, dtype=dtype, grad=nm.startswith("d"),
                             case=dict(case, backend=b), tensor=nm,
                             against="float64 oracle", failures=failures,
                             reduced=group if nm in ("dk", "dv") else 1)
                for nm, arr in launched.metadata().items():
                    if not np.array_equal(meta[b][nm], arr) or meta[b][nm].dtype != np.int32:
                        raise AssertionError(f"[{case}] {b} kernel metadata {nm} differs "
                                             f"from the kernel layout's")
                groups = dict(zip(("q_head_group", "k_head_group"),
                                  schedule.head_groups(launched), strict=True))
                for nm, want in groups.items():
                    if meta[b][nm] != want:
                        raise AssertionError(f"[{case}] {b} launches {nm}={meta[b][nm]}, "
                                             f"the kernel layout's schedule says {want}")
            for a, b in itertools.combinations(self.backends, 2):
                for nm, va, vb in zip(names, got[a], got[b], strict=True):
                    _compare(va, vb, dtype=dtype, grad=nm.startswith("d"),
                             case=dict(case, backend=a), tensor=nm, against=b,
                             failures=failures, reduced=group if nm in ("dk", "dv") else 1)
                for nm in meta[a]:
                    np.testing.assert_array_equal(meta[a][nm], meta[b][nm], err_msg=nm)
        except AssertionError as e:
            failures.append(str(e))

    @classmethod
    def _block_cases(cls):
        """(device, pattern, N, heads, head_dim, block, dtype, tp, kv heads, documents): each TP
        size on the device :func:`block_device` gives it, at that device's sizes. The GPU's
        default TP sizes are those its GPUs hold (1 on one GPU: its CPU fallback would add
        ~45 s there)."""
        f = _flags()
        dev = device()
        tp_sizes = sizes("tp_sizes", dev)
        if dev == "gpu" and not f.tp_sizes:
            tp_sizes = [p for p in tp_sizes if p <= min(gpu_counts())]
        for tp in tp_sizes:
            dev = block_device(tp)
            yield from itertools.product(
                [dev], f.block_patterns, sizes("seq_lens", dev), sizes("num_heads", dev),
                sizes("head_dims", dev), sizes("block_sizes", dev), f.dtypes, [tp],
                [int(x) for x in f.kv_heads], f.documents)

    def test_hybrid_block(self):
        failures = []
        for case in self._block_cases():
            self._block_case(*case, failures)
        self.assertEmpty(failures, "\n".join(failures))

    @staticmethod
    def _real_model_block_args():
        dev = device()
        tp = sizes("tp_sizes", dev)[-1] if dev == "cpu" else 1
        dev = block_device(tp)
        return (dev, "causal", sizes("seq_lens", dev)[0], 4, sizes("head_dims", dev)[0],
                sizes("block_sizes", dev)[0], "float32", tp, 2, "per_row")

    def test_real_model_block(self):
        """The block with GQA (2 kv heads of 4) and per-row document lengths per call, on CPU
        at the largest of --tp_sizes (default 2), on a GPU at TP 1: torch vs JAX vs the
        oracle."""
        failures = []
        self._block_case(*self._real_model_block_args(), failures)
        self.assertEmpty(failures, "\n".join(failures))

    def _block_case(self, dev, name, n, heads, hd, bs, dtype, tp, h_kv, docs, failures):
        """One HybridBlock case: every backend's y, dx and parameter gradients vs the float64
        oracle and each other, weights exported bitwise; failures appended."""
        f = _flags()
        args = (dev, name, n, heads, hd, bs, dtype, tp, h_kv, docs)
        h_kv = h_kv or heads
        case = dict(op="hybrid_block", pattern=name, seq_len=n, num_heads=heads, kv_heads=h_kv,
                    head_dim=hd, block_size=bs, dtype=dtype, tp=tp, documents=docs,
                    batch=f.batch, device=dev)
        problem = _block_problem(*args)
        if problem is None:
            _REPORT.append(dict(case, left_out=f"H_kv={h_kv} must divide H={heads} and be "
                                               f"divisible by tp={tp}"))
            return
        config, params, x, dy, lengths = problem
        case["document_lengths"] = lengths
        y_ref = reference.hybrid_block(params, x, config, lengths)
        dx_ref, dp_ref = reference.hybrid_block_grad(params, x, config, dy, lengths)
        got = {b: BLOCK[b](config, params, x, dy, tp, dev, lengths) for b in self.backends
               if not (b == "torch" and tp > 1)}
        if "torch" in self.backends and tp > 1:  # its ranks ran in the class's shared launch
            got["torch"] = torch_block_result(params, self.torch_launches.result(repr(args)))
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
