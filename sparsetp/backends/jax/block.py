"""The hybrid block in JAX: pre-norm block-sparse attention + MLP, optionally tensor-parallel.

``y1 = x + Attn(LN1(x));  y = y1 + MLP(LN2(y1))``, GELU (tanh), softmax scale ``head_dim**-0.5``:
the block of :class:`sparsetp.backends.torch` ``HybridBlock`` and of the float64 oracle
:func:`sparsetp.core.reference.hybrid_block`, on the canonical parameter dict of
:func:`sparsetp.core.config.init_params` (unsharded names and shapes, weights ``[in, out]``).

With a ``mesh``, the block runs inside ``jax.shard_map`` over mesh axis ``axis_name``, split the
Megatron way (the split of each parameter comes from :func:`sparsetp.core.config.partition_dim`,
the same description the torch layers use):

* ``attn.qkv`` column-parallel: each shard gets whole heads (the qkv columns are head-major), runs
  the Triton attention kernel on its heads with its heads' layout metadata;
* ``attn.out`` row-parallel: one all-reduce forward;
* ``mlp.fc1`` column-parallel, ``mlp.fc2`` row-parallel: one all-reduce forward;
* layer norms and the two row-parallel biases replicated; the activations ``x``, ``y1``, ``y``
  replicated. Backward: one all-reduce per column-parallel layer input (two per block).

``sequence_parallel=True`` (Megatron's sequence parallelism; needs a ``mesh``) splits the
activations between the parallel layers along the tokens instead: ``x``, ``y1`` and ``y`` are
``[B, N/tp, d]`` per shard (shard ``r`` holds tokens ``[r*N/tp, (r+1)*N/tp)``; ``N`` divisible by
``tp``), and the layer norms and residual adds run on the token shard. ``attn.qkv`` and
``mlp.fc1`` all-gather the tokens of their input (backward: reduce-scatter), ``attn.out`` and
``mlp.fc2`` reduce-scatter their output over the tokens instead of all-reducing it (backward:
all-gather) and add their replicated bias to the shard; attention runs on all ``N`` tokens of the
shard's heads. Two all-gathers and two reduce-scatters forward, two of each backward, and no
all-reduce of activations: as many activation bytes on the wire as the plain mode's four
all-reduces (an all-reduce is a reduce-scatter plus an all-gather), while the layer norms, the
residual adds and the layer norms' saved inputs shrink by ``tp``. The replicated parameters'
gradients (layer norms, row biases) are summed over the token shards by ``shard_map``'s typing
(one small all-reduce each). The caller still passes and gets the global ``[B, N, d]`` arrays:
the result equals the plain mode's.

``overlap_comm=True`` (off by default) hides the tensor-parallel communication behind the GEMMs
(:mod:`sparsetp.backends.jax.layers`, "collective matmul"): with ``sequence_parallel`` the two
all-gathers become all-gather-matmul rings of ``ppermute`` s in ``attn.qkv`` and ``mlp.fc1`` and
the two reduce-scatters matmul-reduce-scatter rings in ``attn.out`` and ``mlp.fc2`` (backward:
the reverse rings, derived by autodiff); without it, ``attn.out`` and ``mlp.fc2`` all-reduce in
``comm_chunks`` token chunks, each in flight during the next chunk's GEMM. Same values up to the
order of the sums (``tests/jax_overlap_test.py``).

Data parallelism (``batch_axis=``, on a 2-D mesh from :func:`make_2d_mesh`): ``x`` and the result
are split along the batch over a second mesh axis, the parameters replicated over it, so each
data shard runs the tensor-parallel block above on its ``B / dp`` sequences. No gradient
all-reduce is written by hand: inside ``shard_map`` a parameter that is replicated over the data
axis but used on data-sharded activations is implicitly cast to varying over it, and that cast's
transpose is a ``psum`` over the data axis, so ``jax.grad`` of a loss over the global batch gives
every parameter its full gradient (the data-parallel all-reduce, placed by XLA). Any params
pytree works the same way, inside or outside ``shard_map``: place the batch with
:func:`shard_batch`, keep the parameters replicated over the data axis, and differentiate a loss
over the global batch.

Example::

    >>> from sparsetp.core import HybridConfig, init_params, patterns as P   # doctest: +SKIP
    >>> cfg = HybridConfig(d_model=64, num_heads=4, d_ff=128, pattern=P.causal(), block_size=32)
    >>> mesh = make_mesh(4)                                 # 4 devices on axis "tp"
    >>> params = shard_params(init_params(cfg, seed=0), cfg, mesh)
    >>> y = jax.jit(hybrid_block, static_argnames=("config", "mesh"))(params, x, cfg, mesh=mesh)
    >>> grads = jax.grad(lambda p, x: hybrid_block(p, x, cfg, mesh=mesh).sum())(params, x)
    >>> y_sp = hybrid_block(params, x, cfg, mesh=mesh, sequence_parallel=True)  # same values
    >>> mesh2 = make_2d_mesh(dp=2, tp=2)          # axes ("data", "model"), 4 devices
    >>> params2 = shard_params(init_params(cfg, seed=0), cfg, mesh2, "model")
    >>> y_dp = hybrid_block(params2, shard_batch(x, mesh2), cfg, mesh=mesh2, axis_name="model",
    ...                     batch_axis="data")     # same values, batch split over "data"
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsetp.backends.jax import compat
from sparsetp.backends.jax.attention import LayoutArrays, layout_arrays, sparse_attention
from sparsetp.backends.jax.layers import (
    _check_comm_chunks,
    _num_chunks,
    column_parallel_linear,
    parallel_mlp,
    row_parallel_linear,
)
from sparsetp.core.config import (
    HybridConfig,
    check_tp_size,
    document_lengths_key,
    param_shapes,
    partition_dim,
    with_documents,
)
from sparsetp.core.layout import BlockLayout, make_layout

__all__ = ["hybrid_block", "shard_params", "param_specs", "load_params", "export_params",
           "make_mesh", "make_2d_mesh", "shard_batch", "mesh_devices", "block_layout"]


def mesh_devices(tp: int) -> list:
    """The ``tp`` devices :func:`make_mesh` uses when it is given none.

    The rule: the first ``tp`` devices of JAX's default backend (``jax.devices()``: the GPUs on a
    GPU machine) if it has at least ``tp``; otherwise the first ``tp`` CPU devices
    (``jax.devices("cpu")``, host devices: see ``jax_num_cpu_devices``) if there are that many;
    otherwise a ``ValueError`` that names both counts and how to get more CPU devices. So on a
    machine with one GPU, ``make_mesh(1)`` is that GPU and ``make_mesh(4)`` four CPU devices
    (their arrays run the kernels in Triton's interpreter). The choice is never hidden: it is
    ``mesh.devices`` (``mesh.devices.flat[0].platform``).

    >>> [d.platform for d in mesh_devices(2)]  # one GPU and 4 CPU host devices  # doctest: +SKIP
    ['cpu', 'cpu']
    """
    _check_size("tp", tp)
    return _devices(tp, f"tp={tp}")


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _devices(n: int, what: str) -> list:
    """The first ``n`` devices by :func:`mesh_devices`' rule; ``what`` names the request in the
    error."""
    default = jax.devices()
    if n <= len(default):
        return list(default[:n])
    platform = default[0].platform
    cpu = default
    if platform != "cpu":
        try:
            cpu = jax.devices("cpu")
        except RuntimeError:  # JAX_PLATFORMS without cpu: no CPU backend to fall back on
            cpu = []
        if n <= len(cpu):
            return list(cpu[:n])
    seen = (f"{len(default)} ({platform})" if platform == "cpu"
            else f"{len(default)} {platform} and {len(cpu)} cpu")
    raise ValueError(f"{what} needs {n} devices; JAX sees {seen}. For {n} CPU devices set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={n} or "
                     f"jax.config.update('jax_num_cpu_devices', {n}) before JAX starts.")


def make_mesh(tp: int, axis_name: str = "tp", devices=None) -> jax.sharding.Mesh:
    """A 1-D mesh of ``tp`` devices with an Auto axis ``axis_name`` (see
    :func:`sparsetp.backends.jax.compat.auto_mesh`).

    ``devices=None`` takes :func:`mesh_devices` ``(tp)``: the default backend's devices if it has
    ``tp`` of them, else ``tp`` CPU devices, else a ``ValueError``. Pass ``devices`` (a sequence
    of ``tp`` devices) to choose them yourself.

    >>> make_mesh(4).devices.flat[0].platform  # fewer than 4 GPUs, 4 host devices  # doctest: +SKIP
    'cpu'
    """
    if devices is None:
        devices = mesh_devices(tp)
    elif len(devices) != tp:
        raise ValueError(f"make_mesh(tp={tp}) got {len(devices)} devices")
    return compat.auto_mesh((tp,), (axis_name,), devices=devices)


def make_2d_mesh(dp: int, tp: int, axis_names: tuple[str, str] = ("data", "model"),
                 devices=None) -> jax.sharding.Mesh:
    """A ``dp x tp`` mesh with Auto axes ``axis_names`` (data first, model innermost).

    Data parallelism runs over ``axis_names[0]`` (pass it as ``hybrid_block(batch_axis=...)``,
    the batch split over it), tensor parallelism over ``axis_names[1]`` (``axis_name=...``).
    The model axis is the innermost: devices ``[i * tp, (i + 1) * tp)`` of the list form data
    shard ``i``'s tensor-parallel group. ``devices=None`` takes :func:`mesh_devices`' rule for
    ``dp * tp`` devices, ordered by (process, device id), so that under
    ``jax.distributed.initialize`` each tensor-parallel group stays on one host (its fast
    links) whenever ``tp`` divides the devices per host, and only the data-parallel gradient
    all-reduce crosses hosts. Pass ``devices`` (``dp * tp`` of them, in that order) to choose.

    >>> mesh = make_2d_mesh(2, 2)        # 4 devices: ('data': 2, 'model': 2)  # doctest: +SKIP
    >>> y = hybrid_block(params, x, cfg, mesh=mesh, axis_name="model",
    ...                  batch_axis="data")                                  # doctest: +SKIP
    """
    _check_size("dp", dp)
    _check_size("tp", tp)
    if (not isinstance(axis_names, (tuple, list)) or len(axis_names) != 2
            or not all(isinstance(a, str) and a for a in axis_names)
            or axis_names[0] == axis_names[1]):
        raise ValueError(f"axis_names must be two distinct axis names (data, model), got "
                         f"{axis_names!r}")
    if devices is None:
        devices = sorted(_devices(dp * tp, f"dp={dp} x tp={tp}"),
                         key=lambda d: (d.process_index, d.id))
    elif len(devices) != dp * tp:
        raise ValueError(f"make_2d_mesh(dp={dp}, tp={tp}) needs {dp * tp} devices, got "
                         f"{len(devices)}")
    # jax.sharding.Mesh keeps the order given (jax.make_mesh may reorder for the topology).
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(dp, tp),
                             tuple(axis_names), axis_types=auto)


def shard_batch(batch, mesh: jax.sharding.Mesh, batch_axis: str = "data"):
    """Place a global batch (a pytree of arrays, dim 0 the batch) on ``mesh``, split along dim 0
    over ``batch_axis`` and replicated over the other axes.

    Every process passes the same global arrays (numpy or JAX); each fills only the shards of
    its own devices, so this works unchanged under ``jax.distributed.initialize`` (many
    processes, one mesh). ValueError naming the leaf when ``mesh.shape[batch_axis]`` does not
    divide its batch, or when the mesh has no ``batch_axis``.

    >>> x = shard_batch(np.zeros((8, 128, 64), np.float32), make_2d_mesh(2, 2))  # doctest: +SKIP
    """
    dp = _batch_axis_size(mesh, batch_axis)
    sharding = NamedSharding(mesh, P(batch_axis))

    def put(path, a):
        name = "batch" + jax.tree_util.keystr(path)
        if not hasattr(a, "shape") or len(a.shape) < 1:
            raise ValueError(f"{name} must be an array with a batch dim, got "
                             f"{getattr(a, 'shape', type(a).__name__)}")
        if a.shape[0] % dp:
            raise ValueError(f"{name} has batch {a.shape[0]}, not divisible by mesh axis "
                             f"{batch_axis!r} of size {dp} (the data-parallel size)")
        return _place(a, sharding)

    return jax.tree_util.tree_map_with_path(put, batch)


def _place(a, sharding: NamedSharding) -> jax.Array:
    """``a`` laid out as ``sharding``. A host array (or a JAX array this process holds whole)
    goes through ``make_array_from_callback``: each process fills only its own devices' shards,
    which is what a mesh spanning several processes needs (every process passes the same
    values); an array spread over processes is resharded by ``device_put``."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return jax.device_put(a, sharding)
    host = np.asarray(jax.device_get(a) if isinstance(a, jax.Array) else a)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _batch_axis_size(mesh, batch_axis) -> int:
    if not isinstance(batch_axis, str):
        raise ValueError(f"batch_axis must be a mesh axis name (str), got {batch_axis!r}")
    if batch_axis not in mesh.shape:
        raise ValueError(f"batch_axis={batch_axis!r} is not an axis of the mesh (axes "
                         f"{tuple(mesh.shape)}); build one with make_2d_mesh(dp, tp)")
    return mesh.shape[batch_axis]


def _dtype(config: HybridConfig):
    return jnp.dtype(config.dtype)


def param_specs(config: HybridConfig, axis_name: str = "tp") -> dict[str, P]:
    """PartitionSpec of every canonical parameter (from ``core.config.partition_dim``)."""
    specs = {}
    for name, shape in param_shapes(config).items():
        dim = partition_dim(name)
        axes = [None] * len(shape)
        if dim is not None:
            axes[dim] = axis_name
        specs[name] = P(*axes)
    return specs


def _check_params(params: Mapping[str, Any], config: HybridConfig):
    shapes = param_shapes(config)
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a dict of canonical parameters, got "
                         f"{type(params).__name__}")
    if set(params) != set(shapes):
        raise ValueError(f"params must hold exactly {sorted(shapes)}; missing "
                         f"{sorted(set(shapes) - set(params))}, unexpected "
                         f"{sorted(set(params) - set(shapes))}")
    for name, shape in shapes.items():
        a = params[name]
        # Arrays only: a string or a list would otherwise fail later as an AttributeError or a
        # silent conversion. numpy/JAX dtypes must be floating (the block casts them to
        # config.dtype); other array types (torch) are checked by their shape only.
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"params[{name!r}] must be an array (numpy or JAX), got "
                             f"{type(a).__name__}")
        try:
            dt = np.dtype(a.dtype)
        except TypeError:
            dt = None
        if dt is not None and not np.issubdtype(dt, np.floating) and dt.name != "bfloat16":
            raise ValueError(f"params[{name!r}] must be a floating-point array, got dtype {dt}")
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(params[name].shape)}")


def load_params(params: Mapping[str, Any], config: HybridConfig) -> dict[str, jax.Array]:
    """Canonical params (numpy, torch-exported, ...) as JAX arrays, checked against ``config``.

    Values and dtypes are kept bit for bit (``export_params(load_params(p, cfg))`` equals ``p``
    bitwise); the block casts to ``config.dtype`` when it computes.
    """
    _check_params(params, config)
    return {n: jnp.asarray(np.asarray(params[n])) for n in param_shapes(config)}


def shard_params(params: Mapping[str, Any], config: HybridConfig, mesh: jax.sharding.Mesh,
                 axis_name: str = "tp") -> dict[str, jax.Array]:
    """Place canonical params on ``mesh``: each array split on its ``partition_dim`` over
    ``axis_name`` (contiguously, like the torch ranks' shards) or replicated; replicated over
    every other mesh axis (a data axis of :func:`make_2d_mesh`). Works on a mesh spanning
    several processes when every process passes the same values."""
    _check_params(params, config)
    check_tp_size(config, mesh.shape[axis_name])
    specs = param_specs(config, axis_name)
    return {n: _place(params[n], NamedSharding(mesh, specs[n])) for n in param_shapes(config)}


def export_params(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical unsharded numpy arrays (gathers sharded arrays), bitwise, names unchanged.

    The arrays are fresh, writable copies (``jax.device_get`` hands out read-only views, which
    ``torch.from_numpy`` warns about when the torch frontend loads them). Arrays spread over
    several processes (``jax.distributed``) are all-gathered to every process: a collective
    there, every process must call it."""
    return {n: np.array(_gather_host(a)) for n, a in params.items()}


def _gather_host(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415  (multi-process only)

        return multihost_utils.process_allgather(a, tiled=True)
    return jax.device_get(a)


def block_layout(config: HybridConfig, seq_len: int, document_lengths=None, *,
                 batch: int | None = None) -> BlockLayout:
    """The attention layout of ``config`` for ``seq_len`` tokens (cached; all heads); with
    ``document_lengths`` (one list, or one per batch row: then ``batch`` rows) that of
    ``P.documents(document_lengths) & config.pattern``, cached per lengths."""
    key = document_lengths_key(document_lengths)
    per_row = bool(key) and isinstance(key[0], tuple)
    # Only per-row lengths depend on the batch (their count must match it).
    batch = (len(key) if batch is None else batch) if per_row else 1
    return _block_layout(config, seq_len, key, batch)


@functools.lru_cache(maxsize=64)
def _block_layout(config: HybridConfig, seq_len: int, key, batch) -> BlockLayout:
    pattern = with_documents(config.pattern, key, batch=batch, seq_len=seq_len)
    return make_layout(pattern, seq_len, config.num_heads, config.block_size)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _layer_norm(x, w, b, eps):
    # checkpoint: the backward keeps x (compute dtype) and recomputes mean/rstd, instead of
    # autodiff's three fp32 [T, d] residuals (torch keeps x plus [T] mean and rstd).
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mu = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mu).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _block_local(p: Mapping[str, jax.Array], x: jax.Array, lay: LayoutArrays,
                 config: HybridConfig, axis_name: str | None,
                 sequence_parallel: bool = False, overlap_comm: bool = False,
                 comm_chunks: int | None = None) -> jax.Array:
    """The block on one shard: ``p`` holds this shard's slices (all of them if unsharded); ``x``
    is ``[B, N, d]``, or this shard's ``[B, N/tp, d]`` tokens with ``sequence_parallel``."""
    hd = config.head_dim
    sp = dict(axis_name=axis_name, sequence_parallel=sequence_parallel, overlap_comm=overlap_comm)
    chunks = {} if comm_chunks is None else dict(comm_chunks=comm_chunks)
    h1 = _layer_norm(x, p["ln1.weight"], p["ln1.bias"], config.norm_eps)
    g = config.kv_group
    qkv = column_parallel_linear(h1, p["attn.qkv.weight"], p.get("attn.qkv.bias"),
                                 **sp)                       # [B, N, Hk_loc * (G + 2) * hd]
    b, n, _ = qkv.shape  # all N tokens (x holds only N/tp of them with sequence_parallel)
    hk_loc = qkv.shape[-1] // ((g + 2) * hd)
    h_loc = hk_loc * g
    # Group-major columns (sparsetp.core.config): per kv head, G query heads, its key, its value.
    qkv = qkv.reshape(b, n, hk_loc, g + 2, hd).transpose(0, 2, 3, 1, 4)  # [B, Hk, G+2, N, hd]
    q = qkv[:, :, :g].reshape(b, h_loc, n, hd)
    o = sparse_attention(q, qkv[:, :, g], qkv[:, :, g + 1], lay, scale=hd ** -0.5)
    o = o.transpose(0, 2, 1, 3).reshape(b, n, h_loc * hd)
    y1 = x + row_parallel_linear(o, p["attn.out.weight"], p.get("attn.out.bias"), **sp,
                                 **chunks)
    h2 = _layer_norm(y1, p["ln2.weight"], p["ln2.bias"], config.norm_eps)
    # column fc1 -> GELU -> row fc2 (with SP + overlap_comm: the two chained rings).
    y = y1 + parallel_mlp(h2, p["mlp.fc1.weight"], p.get("mlp.fc1.bias"), p["mlp.fc2.weight"],
                          p.get("mlp.fc2.bias"), **sp, **chunks)
    return y


def hybrid_block(params: Mapping[str, Any], x: jax.Array, config: HybridConfig, *,
                 mesh: jax.sharding.Mesh | None = None, axis_name: str = "tp",
                 sequence_parallel: bool = False, batch_axis: str | None = None,
                 document_lengths=None, overlap_comm: bool = False,
                 comm_chunks: int | None = None) -> jax.Array:
    """The hybrid block on ``x [B, N, d_model]``; see the module docstring.

    Args:
      params: the canonical unsharded parameter dict (numpy or JAX arrays, e.g. from
        :func:`shard_params`); cast to ``config.dtype`` for compute.
      x: ``[B, N, d_model]`` input (cast to ``config.dtype``).
      config: the :class:`~sparsetp.core.config.HybridConfig` (static under ``jit``).
      mesh: ``None`` runs unsharded on one device; otherwise a mesh with axis ``axis_name`` of
        size ``tp`` (``num_heads``, ``num_kv_heads`` and ``d_ff`` divisible by it), over which
        the block runs Megatron-style inside ``shard_map``.
      axis_name: the mesh axis to split over.
      sequence_parallel: Megatron's sequence parallelism (see the module docstring): ``x`` and
        the result are split along ``N`` over ``axis_name`` (``N`` divisible by ``tp``). Needs a
        ``mesh``. Same result as without it, up to the order of the sums.
      batch_axis: data parallelism: a second mesh axis (``"data"`` of :func:`make_2d_mesh`)
        over which ``x`` and the result are split along ``B`` (divisible by its size) while the
        parameters are replicated over it; each data shard runs the tensor-parallel block on
        its ``B / dp`` sequences. ``jax.grad`` of a loss over the global batch then gives the
        parameters the gradient summed over the data shards (the transpose of using a
        replicated parameter on sharded data is a ``psum`` over ``batch_axis``): the
        single-device gradient, with no separate all-reduce to write. Needs a ``mesh``;
        combines with ``sequence_parallel``.
      document_lengths: packed documents of this call (Python ints; static under ``jit``:
        pass tuples and list it in ``static_argnames``, each new value traces again): one
        sequence of lengths for every batch row, or one per row (each its own packing), each
        summing to ``N``. Attention runs ``P.documents(document_lengths) & config.pattern``
        (:func:`sparsetp.core.config.with_documents`, as the float64 oracle's
        ``reference.hybrid_block(..., document_lengths)``); layouts are cached per lengths. Per
        row lengths give a per-batch-row layout, split over ``batch_axis`` like ``x`` and over
        ``axis_name`` like the heads.
      overlap_comm: overlap the tensor-parallel collectives with the GEMMs
        (:mod:`sparsetp.backends.jax.layers`): with ``sequence_parallel``, ``attn.qkv`` and
        ``mlp.fc1`` become all-gather-matmul rings and ``attn.out`` and ``mlp.fc2``
        matmul-reduce-scatter rings of ``ppermute`` s (fc1's ring feeds fc2's without putting
        the tokens back in order); without it, ``attn.out`` and ``mlp.fc2`` all-reduce in
        ``comm_chunks`` token chunks. Same result up to the order of the sums; no effect
        without a ``mesh`` or on one device.
      comm_chunks: token chunks of those all-reduces (``overlap_comm`` without
        ``sequence_parallel`` only; must divide ``N``; None: 4, 2 or 1, the largest dividing
        ``N``).

    Returns ``[B, N, d_model]`` in ``config.dtype`` (replicated over the mesh; with
    ``sequence_parallel``, split along ``N`` over it: ``PartitionSpec(None, axis_name, None)``;
    with ``batch_axis``, split along ``B`` over that axis too).
    Differentiable w.r.t. ``params`` and ``x``; works under ``jit`` (``config``, ``mesh``,
    ``axis_name``, ``sequence_parallel``, ``batch_axis``, ``overlap_comm``, ``comm_chunks``
    static).

    Raises ValueError naming the argument for a non-HybridConfig ``config``, a missing,
    extra, mis-shaped or non-array parameter (``params['ln1.weight'] must be an array``), a
    non-floating numpy/JAX parameter, or an ``x`` of the wrong shape; a ``mesh`` without
    ``axis_name`` or ``batch_axis``, a ``batch_axis`` equal to ``axis_name``, a batch ``B`` the
    data axis does not divide, heads / kv heads / ``d_ff`` the model axis does not divide, and
    a bad ``comm_chunks`` (not a positive int, not dividing ``N``, without ``overlap_comm`` or
    with ``sequence_parallel``).

    >>> y = hybrid_block(params, x, cfg, mesh=mesh, sequence_parallel=True)  # doctest: +SKIP
    >>> y = hybrid_block(params, x, cfg, mesh=mesh, sequence_parallel=True,
    ...                  overlap_comm=True)                                 # doctest: +SKIP
    >>> mesh2 = make_2d_mesh(dp=2, tp=2)                                     # doctest: +SKIP
    >>> y = hybrid_block(params, x, cfg, mesh=mesh2, axis_name="model",
    ...                  batch_axis="data")                                  # doctest: +SKIP
    """
    if not isinstance(config, HybridConfig):
        raise ValueError(f"config must be a HybridConfig, got {type(config).__name__}")
    _check_params(params, config)
    if not hasattr(x, "ndim") or x.ndim != 3 or x.shape[-1] != config.d_model:
        raise ValueError(f"x must be [B, N, d_model={config.d_model}], got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    dtype = _dtype(config)
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("config.dtype='float64' needs jax.config.update('jax_enable_x64', True)")
    if comm_chunks is not None:  # before any work (the layers check it again when traced)
        _check_comm_chunks(comm_chunks, overlap_comm, sequence_parallel)
        _num_chunks(int(x.shape[1]), comm_chunks, what="x (its N)")
    x = jnp.asarray(x, dtype)
    p = {n: jnp.asarray(a, dtype) for n, a in params.items()}
    lay = layout_arrays(block_layout(config, int(x.shape[1]), document_lengths,
                                     batch=int(x.shape[0])),
                        head_dim=config.head_dim, dtype=dtype, static_widths=True)
    if mesh is None:
        if sequence_parallel:
            # Not a silent no-op: a caller asking for SP without a mesh has a bug somewhere.
            raise ValueError("sequence_parallel=True needs a mesh (it splits the tokens over the "
                             "tensor-parallel mesh axis); pass mesh=... or drop it")
        if batch_axis is not None:
            raise ValueError(f"batch_axis={batch_axis!r} needs a mesh with that axis (it splits "
                             "the batch over it); pass mesh=make_2d_mesh(dp, tp) or drop it")
        return _block_local(p, x, lay, config, None, overlap_comm=overlap_comm,
                            comm_chunks=comm_chunks)
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has axes {tuple(mesh.shape)}, not {axis_name!r}")
    tp = mesh.shape[axis_name]
    check_tp_size(config, tp)
    if sequence_parallel and x.shape[1] % tp:
        raise ValueError(f"sequence_parallel=True splits the N={x.shape[1]} tokens of x over mesh "
                         f"axis {axis_name!r} of size {tp}: N must be divisible by it")
    if batch_axis is not None:
        if batch_axis == axis_name:
            raise ValueError(f"batch_axis and axis_name are both {axis_name!r}: data and tensor "
                             "parallelism need two different mesh axes")
        dp = _batch_axis_size(mesh, batch_axis)
        if x.shape[0] % dp:
            raise ValueError(f"batch_axis={batch_axis!r} splits the B={x.shape[0]} sequences of x "
                             f"over {dp} data shards: B must be divisible by it")
    specs = param_specs(config, axis_name)
    x_spec = P(batch_axis, axis_name if sequence_parallel else None, None)
    in_specs = ({n: specs[n] for n in p}, x_spec, lay.partition_specs(axis_name, batch_axis))
    args = (p, x, lay)
    explicit = jax.sharding.AxisType.Explicit
    if any(t == explicit for t in mesh.axis_types):
        # Explicit meshes: shard_map wants its inputs already laid out as in_specs.
        args = jax.tree_util.tree_map(
            lambda s, a: jax.sharding.reshard(a, NamedSharding(mesh, s)), in_specs, args,
            is_leaf=lambda s: isinstance(s, P))
    fn = jax.shard_map(functools.partial(_block_local, config=config, axis_name=axis_name,
                                         sequence_parallel=sequence_parallel,
                                         overlap_comm=overlap_comm, comm_chunks=comm_chunks),
                       mesh=mesh, in_specs=in_specs, out_specs=x_spec, check_vma=True)
    return fn(*args)
