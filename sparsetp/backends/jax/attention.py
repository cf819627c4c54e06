"""Block-sparse attention for JAX: the Triton kernels of :mod:`sparsetp.kernels` behind a
``jax.custom_vjp``.

``sparse_attention(q, k, v, layout)`` takes ``q`` ``[B, H, N, D]``, ``k, v`` ``[B, H_kv, N_kv, D]``
(GQA/MQA when ``H_kv < H``; ``N_kv`` keys, the layout's ``kv_len``) and a layout, and returns the
attention output ``[B, H, N, D]``. The forward launches ``_attn_fwd_kernel``; the backward (a
``custom_vjp`` rule, since jax-triton does not differentiate) launches the dQ and dK/dV
kernels. Launches go through :func:`sparsetp.backends.jax.launch.per_platform`: on GPU
``jax_triton``, or on sm_90 GPUs where :func:`forward_kernel` / :func:`backward_kernel` say so
the Gluon kernels through :mod:`sparsetp.backends.jax.hopper`; on CPU the native path
:mod:`sparsetp.backends.jax.cpu` (plain ``jax.numpy``, so ``jit``, ``grad`` and ``vmap`` work
as for any XLA code), or with ``SPARSETP_INTERPRET=1`` the kernels in Triton's interpreter
through ``buffer_callback``.

Layouts reach the kernels as array *operands*, never as trace constants: :class:`LayoutArrays`
is a pytree whose leaves are the int32 metadata arrays of a
:class:`~sparsetp.core.layout.BlockLayout` and whose static part is ``seq_len`` and ``kv_len``
(and the head order). Under
``jax.jit``, two patterns whose metadata arrays have the same shapes therefore share one trace
and one compiled executable::

    >>> import jax, numpy as np
    >>> from sparsetp.core import make_layout, patterns as P
    >>> f = jax.jit(sparse_attention)
    >>> q = k = v = jax.numpy.asarray(np.random.randn(1, 2, 128, 16), "float32")
    >>> a = layout_arrays(make_layout(P.causal(), 128, 2, 64))
    >>> b = layout_arrays(make_layout(P.local(64, 0), 128, 2, 64))   # other pattern, same shapes
    >>> out_a, out_b = f(q, k, v, a), f(q, k, v, b)                    # traced once

A :class:`~sparsetp.core.layout.BlockLayout` is accepted too (converted with
:func:`layout_arrays`; as a ``static_argnames`` argument of ``jit`` it is a trace constant).

Tensor parallelism: inside ``jax.shard_map`` with heads split over a mesh axis, give each shard
its heads' metadata, either by passing the :class:`LayoutArrays` with
:meth:`LayoutArrays.partition_specs` as its ``in_specs`` (per-head arrays split like the heads,
the mask table replicated), or by passing it replicated and calling
:meth:`LayoutArrays.local_heads` inside. Outputs are typed varying over the axes the inputs vary
over, so ``jax.grad`` works with ``check_vma=True`` (leave it on).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparsetp import _runtime
from sparsetp.backends.jax import cpu as _cpu
from sparsetp.backends.jax import launch as _launch
from sparsetp.core.layout import BlockLayout
from sparsetp.kernels import abi as _abi
from sparsetp.kernels import hopper as _hopper
from sparsetp.kernels import options as _options
from sparsetp.kernels import schedule as _schedule

__all__ = ["sparse_attention", "LayoutArrays", "layout_arrays"]

_PER_HEAD = ("q_count", "q_partial", "q_index", "q_mask_id", "k_count", "k_partial", "k_index",
             "k_mask_id", "q_order", "k_order", "q_halves")
_META = (*_PER_HEAD, "masks", "mask_quarters")


@dataclasses.dataclass(frozen=True)
class LayoutArrays:
    """The kernel metadata of a :class:`~sparsetp.core.layout.BlockLayout` as JAX arrays.

    A pytree: the thirteen int32 arrays are leaves (operands of the kernels), ``seq_len`` is static.
    ``num_heads`` and ``block_size`` are read off the array shapes, so a head slice of the arrays
    (inside ``shard_map``) is itself a valid :class:`LayoutArrays` of its heads.

    Per-row layouts (``BlockLayout.batch = B``, e.g. per-row packed documents): the per-head
    arrays are ``[B, H, ...]`` (``batch`` = their leading size), so ``shard_map`` can split rows
    over a data axis and heads over a model axis (:meth:`partition_specs`); :meth:`metadata`
    gives the kernels' flat ``[B * H, ...]`` tables.
    """

    q_count: jax.Array
    q_partial: jax.Array
    q_index: jax.Array
    q_mask_id: jax.Array
    k_count: jax.Array
    k_partial: jax.Array
    k_index: jax.Array
    k_mask_id: jax.Array
    masks: jax.Array
    q_order: jax.Array
    k_order: jax.Array
    mask_quarters: jax.Array
    q_halves: jax.Array
    seq_len: int = dataclasses.field(metadata=dict(static=True), default=0)
    # How launches order heads (schedule.head_groups; static). None: all heads interleaved
    # (schedule.grid_group).
    q_head_group: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    k_head_group: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    # Number of keys; 0 means seq_len (self-attention).
    kv_len: int = dataclasses.field(metadata=dict(static=True), default=0)
    # Most tiles any query-major list holds (BlockLayout.widest_row), a static bound the native
    # CPU path pads its rows to instead of the ELL width (padded to 16); 0: unknown, ELL width.
    widest_row: int = dataclasses.field(metadata=dict(static=True), default=0)
    # Most partial (element-masked) tiles any query-major list holds (max q_partial), a static
    # bound: the native CPU path gathers masks for that many leading entries of each row only.
    # None: unknown, every entry.
    partial_row: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    # Per query tile, the most tiles its list holds in any head (static): the native CPU path
    # pads each chunk of rows to its own widest (a BigBird global row would otherwise widen
    # every row). None: every row is as wide as widest_row.
    row_widths: tuple[int, ...] | None = dataclasses.field(metadata=dict(static=True),
                                                           default=None)
    # Whether the query lists are long enough for the sm_90 rule's list-length threshold
    # (kernels.hopper.AUTO_MIN_MEAN_TILES at block 128; static, set by layout_arrays): the
    # rule reads it eagerly and under jit alike. False: the rule counts programs only.
    long_lists: bool = dataclasses.field(metadata=dict(static=True), default=False)
    # BlockLayout.skip_quarters of the sm_90 form (static, set by layout_arrays; False where the
    # sm_90 kernels will not run it): whether their backward compiles its skip of empty
    # quarter tiles. Like long_lists, a pattern whose value differs from another's of
    # the same shapes takes a trace of its own; only sm_90 layouts can differ.
    skip_quarters: bool = dataclasses.field(metadata=dict(static=True), default=False)
    # BlockLayout.skip_halves of the sm_90 form, as skip_quarters (whether the sm_90 forward
    # compiles its half entries as 64-key steps).
    skip_halves: bool = dataclasses.field(metadata=dict(static=True), default=False)

    def __post_init__(self):
        if not self.kv_len:
            object.__setattr__(self, "kv_len", self.seq_len)

    @property
    def batch(self) -> int | None:
        """Batch rows of a per-row layout (per-head arrays ``[batch, H, ...]``), else None."""
        return int(self.q_count.shape[0]) if self.q_count.ndim == 3 else None

    @property
    def num_heads(self) -> int:
        return int(self.q_count.shape[-2])

    def _head_axis(self) -> int:
        return 0 if self.batch is None else 1

    @property
    def block_size(self) -> int:
        return int(self.masks.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.q_count.shape[1])

    def metadata(self) -> dict[str, jax.Array]:
        """The arrays by name, as :meth:`BlockLayout.metadata` names them (a per-row layout's
        per-head arrays flattened to the kernels' ``[batch * H, ...]`` tables)."""
        if self.batch is None:
            return {n: getattr(self, n) for n in _META}
        return {n: (getattr(self, n).reshape(-1, *getattr(self, n).shape[2:])
                    if n in _PER_HEAD else getattr(self, n)) for n in _META}

    def partition_specs(self, axis_name: str | None,
                        batch_axis: str | None = None) -> LayoutArrays:
        """``shard_map`` in/out specs: per-head arrays split over ``axis_name``, mask tables
        replicated; a per-row layout's rows split over ``batch_axis`` too (None: replicated),
        as ``x``'s batch is.

        >>> spec = layout_arrays(lay).partition_specs("tp")    # doctest: +SKIP
        >>> jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"),) * 3 + (spec,),
        ...               out_specs=P(None, "tp"))                  # doctest: +SKIP
        """
        from jax.sharding import PartitionSpec as P  # noqa: PLC0415

        spec = P(axis_name) if self.batch is None else P(batch_axis, axis_name)
        return dataclasses.replace(self, **{n: spec for n in _PER_HEAD}, masks=P(),
                                   mask_quarters=P())

    def heads(self, start: int, stop: int) -> LayoutArrays:
        """Heads ``[start, stop)`` (static bounds), like :meth:`BlockLayout.heads` (of every
        row of a per-row layout)."""
        if not 0 <= start < stop <= self.num_heads:
            raise ValueError(f"heads(start, stop) needs 0 <= start < stop <= num_heads="
                             f"{self.num_heads}, got ({start}, {stop})")
        ax = self._head_axis()
        return dataclasses.replace(self, **{
            n: jax.lax.slice_in_dim(getattr(self, n), start, stop, axis=ax) for n in _PER_HEAD})

    def local_heads(self, axis_name: str) -> LayoutArrays:
        """Inside ``shard_map``: this shard's contiguous slice of heads along mesh axis
        ``axis_name`` (shard ``i`` of ``n`` gets heads ``[i*H/n, (i+1)*H/n)``)."""
        n = jax.lax.axis_size(axis_name)
        if self.num_heads % n:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by the size {n} of "
                             f"mesh axis {axis_name!r}")
        per = self.num_heads // n
        start = jax.lax.axis_index(axis_name) * per
        ax = self._head_axis()
        return dataclasses.replace(self, **{
            name: jax.lax.dynamic_slice_in_dim(getattr(self, name), start, per, axis=ax)
            for name in _PER_HEAD})


jax.tree_util.register_dataclass(LayoutArrays, data_fields=list(_META),
                                 meta_fields=["seq_len", "q_head_group", "k_head_group",
                                              "kv_len", "widest_row", "partial_row",
                                              "row_widths", "long_lists", "skip_quarters",
                                              "skip_halves"])

LayoutLike = BlockLayout | LayoutArrays


def layout_arrays(layout: LayoutLike, *, head_dim: int | None = None, dtype=None,
                  static_widths: bool = False, batch: int = 1) -> LayoutArrays:
    """A :class:`LayoutArrays` for ``layout`` (a ``BlockLayout``, or a ``LayoutArrays`` as is).

    ``static_widths`` also records the pattern's per-row list widths and partial-tile counts
    (``partial_row``, ``row_widths``) as static fields: the native CPU path then pads each chunk
    to its own rows (faster, less memory: BigBird's global row no longer widens every row), but
    a jitted function taking the arrays retraces for every pattern. Off, layouts whose metadata
    have the same shapes share one trace (what a training loop over changing patterns wants);
    ``sparse_attention`` given a ``BlockLayout`` (one trace per layout anyway) turns it on.

    A ``BlockLayout`` becomes the arrays of the layout the kernels run for q of ``head_dim``
    and ``dtype`` (:func:`sparsetp.kernels.schedule.kernel_layout` for the default backend: on
    a GPU possibly the same pattern at another kernel tile, exactly as the torch frontend
    launches it; without ``head_dim``/``dtype`` only larger tiles are considered); where the
    sm_90 kernels will run it (:func:`forward_kernel`'s rule for ``batch`` rows: an sm_90 GPU,
    bfloat16/float16, head dim 128), its block-128 form. A ``LayoutArrays`` is launched as it
    is.
    """
    if isinstance(layout, LayoutArrays):
        return layout
    if not isinstance(layout, BlockLayout):
        raise ValueError(f"layout must be a sparsetp BlockLayout or LayoutArrays, got "
                         f"{type(layout).__name__}")
    rows = layout.batch
    dtype = None if dtype is None else jnp.dtype(dtype).name
    flat = layout.flat()
    lay128 = _sm90_layout(flat, head_dim, dtype, 1 if rows is not None else batch)
    layout = lay128 if lay128 is not None else _schedule.kernel_layout(
        flat, _launch.layout_device_kind(), head_dim=head_dim, dtype=dtype)
    long_lists = (layout.block_size == _hopper.BLOCK
                  and float(layout.q_count.mean()) >= _hopper.AUTO_MIN_MEAN_TILES)
    q_group, k_group = _schedule.head_groups(layout)

    def arr(name, a):  # a per-row layout's per-head tables as [batch, H, ...]
        a = jnp.asarray(a, jnp.int32)
        return a if rows is None or name not in _PER_HEAD else a.reshape(rows, -1, *a.shape[1:])

    return LayoutArrays(**{n: arr(n, a) for n, a in layout.metadata().items()},
                        seq_len=layout.seq_len, q_head_group=q_group, k_head_group=k_group,
                        kv_len=layout.kv_len, widest_row=layout.widest_row,
                        long_lists=long_lists,
                        skip_quarters=lay128 is not None and layout.skip_quarters,
                        skip_halves=lay128 is not None and layout.skip_halves,
                        **({"partial_row": int(layout.q_partial.max(initial=0)),
                            "row_widths": tuple(int(x) for x in layout.q_count.max(axis=0))}
                           if static_widths else {}))


def _sm90_layout(layout: BlockLayout, head_dim: int | None, dtype: str | None, batch: int):
    """``layout`` at block 128 when the sm_90 kernels would run it (``batch`` rows, the
    default GPU; :func:`forward_kernel`'s rule, either pass), else None."""
    opts = _options.current()
    # One layout's arrays serve both passes: where the sm_90 backward cannot run (head dim
    # 256), the portable one needs the portable tile (block 64 there), so JAX keeps it.
    if (head_dim not in _hopper.BWD_HEAD_DIMS or dtype is None
            or _launch.layout_device_kind() != "cuda"
            or (opts.fwd_kernel, opts.bwd_kernel) == ("portable", "portable")):
        return None
    common = _device_rule(None, dtype, head_dim, layout.seq_len, layout.kv_len, 1.0)
    if _hopper._ineligible(**common, layout_ok=True) is not None:
        return None
    lay = _hopper.layout_128(layout)
    if lay is None:
        return None
    kw = dict(why=None, batch_heads=batch * layout.num_heads, seq_len=layout.seq_len,
              mean_tiles=float(lay.q_count.mean()))
    if "hopper" in (_hopper._choice("fwd_kernel", **kw).name,
                    _hopper._choice("bwd_kernel", **kw).name):
        return lay
    return None


def _device_rule(q, dtype: str, head_dim: int, seq_len: int, kv_len: int,
                 scale: float) -> dict:
    """The kernel rules' device arguments for a JAX call on ``q`` (a tracer or None: the
    default device)."""
    concrete = isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer)
    device = next(iter(q.devices())) if concrete else None
    if device is None:
        kind = _launch.layout_device_kind()
    else:
        kind = "cuda" if device.platform == "gpu" and _launch.gpu_path() else "cpu"
    capability = triton_version = None
    launcher = None
    if kind == "cuda":
        from sparsetp.backends.jax import hopper as _jhopper  # noqa: PLC0415 (GPU only)

        capability = _jhopper.capability(device)
        import triton  # noqa: PLC0415

        triton_version = triton.__version__
        opts = _options.current()
        # The launcher's check builds its C++ handler once: only for calls the fast path
        # could run.
        if (capability == (9, 0) and dtype in _hopper.DTYPES and head_dim in _hopper.HEAD_DIMS
                and (opts.fwd_kernel, opts.bwd_kernel) != ("portable", "portable")):
            launcher = _jhopper.unavailable()
    return dict(framework="jax", device_kind=kind, capability=capability,
                triton_version=triton_version or "0.0", dtype=dtype, head_dim=head_dim,
                seq_len=seq_len, kv_len=kv_len, contiguous=True, scale=scale,
                launcher=launcher)


def _choose(q, k, lay: LayoutArrays, scale: float,
            report: bool = False) -> tuple[_hopper.KernelChoice, ...]:
    """(forward kernel, backward kernels) of a call on ``lay`` (checked inputs). The rule's
    list length is ``lay.long_lists`` (static: the same eagerly and under jit). ``report``:
    also say where this call's sm_90 kernels failed to compile in this process (the call then
    runs the portable ones; needs concrete layout arrays)."""
    d = int(q.shape[-1])
    common = _device_rule(q, jnp.dtype(q.dtype).name, d, int(q.shape[2]), int(k.shape[2]),
                          scale)
    kw = dict(**common, batch_heads=int(q.shape[0] * q.shape[1]),
              mean_tiles=_hopper.AUTO_MIN_MEAN_TILES if lay.long_lists else 0.0,
              layout_ok=True)
    fwd, bwd = _hopper.forward_choice(**kw), _hopper.backward_choice(**kw)
    why = None
    if d not in _hopper.BWD_HEAD_DIMS:
        why = (f"head dim {d}: JAX runs the sm_90 forward only where the sm_90 backward runs "
               "too (one layout's arrays serve both passes, and the portable backward needs "
               "block 64 here)")
    elif lay.block_size != _hopper.BLOCK:
        why = (f"the layout arrays are at block {lay.block_size}; the sm_90 kernels run the "
               f"block-{_hopper.BLOCK} form (pass the BlockLayout, or layout_arrays of it with "
               "head_dim and dtype)")
    if why is not None:  # what the rule would run, JAX cannot run here
        for option in ("fwd_kernel", "bwd_kernel"):
            if getattr(_options.current(), option) == "hopper":
                raise ValueError(f"LaunchOptions.{option}='hopper' cannot run this call: {why}")
        fwd, bwd = (c if c.name != "hopper" else _hopper.KernelChoice("portable", why)
                    for c in (fwd, bwd))
    if report and "hopper" in (fwd.name, bwd.name):
        from sparsetp.backends.jax import hopper as _jhopper  # noqa: PLC0415

        b, h, n, _ = q.shape
        meta = _with_group_lists(_with_statics(lay.metadata(), _statics(lay)), h, k.shape[1],
                                 n)
        launches = _hopper.launches(meta, b, h, k.shape[1], n, k.shape[2], scale,
                                    _options.current().work_order != "natural", d,
                                    skip_quarters=meta["skip_quarters"],
                                    skip_halves=meta["skip_halves"])
        dtype = jnp.dtype(q.dtype).name
        fwd, bwd = (_failed_report(choice, _jhopper, [launches[n] for n in names], dtype, d)
                    for choice, names in ((fwd, ("fwd",)), (bwd, ("dq_dlse", "dkdv"))))
    return fwd, bwd


def _failed_report(choice, jhopper, launches, dtype, d) -> _hopper.KernelChoice:
    """``choice``, or the portable kernel with the reason where one of ``launches`` failed to
    compile in this process (the call then falls back)."""
    if choice.name != "hopper":
        return choice
    for launch in launches:
        exc = jhopper.failed(launch, dtype, d)
        if exc is not None:
            return _hopper.KernelChoice(
                "portable", f"the sm_90 {launch.kernel} failed to compile here: "
                f"{type(exc).__name__}: {exc}"[:500])
    return choice


def _check_inputs(q, k, v, layout, scale) -> tuple[LayoutArrays, float]:
    """The torch frontend's checks and messages (``sparsetp.backends.torch.attention``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not hasattr(t, "shape") or not hasattr(t, "dtype") or isinstance(t, (int, float)):
            raise ValueError(f"{name} must be a JAX or NumPy array, got {type(t).__name__}")
    if not isinstance(layout, (BlockLayout, LayoutArrays)):
        raise ValueError(f"layout must be a BlockLayout (or LayoutArrays), got "
                         f"{type(layout).__name__}")
    dtype = jnp.dtype(q.dtype)
    if len(q.shape) == 4 and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"q must be a floating-point array, got dtype {dtype}")
    scale = _abi.check_attention_shapes(q.shape, k.shape, v.shape, layout, scale)
    _abi.check_dtype(dtype.name)
    for name, t in (("k", k), ("v", v)):
        if jnp.dtype(t.dtype) != dtype:
            raise ValueError(f"{name} has dtype {jnp.dtype(t.dtype)} but q has {dtype}")
    batch = 1 if isinstance(layout, BlockLayout) and layout.batch is not None else q.shape[0]
    lay = layout_arrays(layout, head_dim=int(q.shape[-1]), dtype=dtype, static_widths=True,
                        batch=int(batch))
    for name, a in lay.metadata().items():
        if jnp.dtype(a.dtype) != jnp.int32:
            raise ValueError(f"layout metadata {name!r} must be int32, got {a.dtype}")
    return lay, scale


def _batch_folded(fn, *arrays):
    """``fn(*arrays)`` for kernel launches whose arrays all lead with the batch axis ``B``, made
    ``vmap``-able: jax-triton's call has no batching rule (and the interpreter callback none we
    want), so a ``vmap`` folds its mapped axis into ``B`` (one launch, unmapped operands
    broadcast), or, when the layout metadata (last argument) is mapped too, loops with
    ``lax.map``. Outputs lead with ``B`` as well."""
    fn_vmappable = jax.custom_batching.custom_vmap(fn)

    @fn_vmappable.def_vmap
    def _rule(axis_size, in_batched, *args):
        def mapped(a, batched):
            return a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))

        *data, meta = args
        *data_batched, meta_batched = in_batched
        if any(jax.tree_util.tree_leaves(meta_batched)):  # a layout per element: loop
            data = [mapped(a, b) for a, b in zip(data, data_batched, strict=True)]
            meta = jax.tree_util.tree_map(mapped, meta, meta_batched)
            outs = jax.lax.map(lambda xs: fn(*xs[0], xs[1]), (data, meta))
            return outs, tuple(True for _ in outs)
        folded = [mapped(a, b).reshape(axis_size * a.shape[int(b)], *a.shape[1 + int(b):])
                  for a, b in zip(data, data_batched, strict=True)]
        outs = tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in fn(*folded, meta))
        return outs, tuple(True for _ in outs)

    return fn_vmappable(*arrays)


def _with_group_lists(meta: dict, heads: int, kv_heads: int, seq_len: int) -> dict:
    """``meta`` plus GQA's merged key-major lists for the sm_90 dK/dV pass
    (``hopper.group_key_lists``), computed in the graph from the arrays, so a head slice
    (``shard_map``) or a per-row layout merges its own; ``meta`` itself for MHA."""
    if heads == kv_heads:
        return meta
    return {**meta, **_hopper.group_key_lists(jnp, meta, heads // kv_heads,
                                              seq_len // _hopper.BLOCK)}


def _sm90_launches(q, k, meta, scale, names):
    """The sm_90 launches ``names`` of this call, compiled (trace time), or None where one
    failed to compile (warned; the call then runs the portable kernels)."""
    from sparsetp.backends.jax import hopper as _jhopper  # noqa: PLC0415 (GPU only)

    b, h, n, d = q.shape
    if "dkdv" in names:
        meta = _with_group_lists(meta, h, k.shape[1], n)
    launches = _hopper.launches(meta, b, h, k.shape[1], n, k.shape[2], scale,
                                _options.current().work_order != "natural", d,
                                skip_quarters=meta["skip_quarters"],
                                skip_halves=meta["skip_halves"])
    dtype = jnp.dtype(q.dtype).name
    for name in names:
        try:
            _jhopper.compile_launch(launches[name], dtype, d)
        except Exception as exc:  # noqa: BLE001 (any compile failure: the portable kernels)
            _jhopper.warn_fallback({"fwd": "forward", "dq_dlse": "dQ pass",
                                    "dkdv": "dK/dV pass"}[name], exc)
            return None
    return _jhopper, launches, dtype, d


def _fwd(q, k, v, meta, scale, widest, opts, sm90=False):
    dtype = jnp.dtype(q.dtype).name

    def run(kind):
        if kind == "cpu":  # plain XLA: vmap has its own rules
            return _cpu.forward(q, k, v, meta, scale, widest=widest)

        def kernel(q, k, v, meta_arrays):
            with _options.using(opts):  # also when a vmap traces this later
                full = {**meta, **meta_arrays}
                fast = sm90 and kind == "cuda" and _sm90_launches(q, k, full, scale, ("fwd",))
                if fast:
                    jh, launches, dt, d = fast
                    outs = jh.call(launches["fwd"], dt, d, dict(q=q, k=k, v=v), dict(
                        out=jax.ShapeDtypeStruct(q.shape, q.dtype),
                        lse=jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)))
                    return outs["out"], outs["lse"]
                call = _abi.fwd_call(q, k, v, full, scale=scale, dtype=dtype, device_kind=kind)
            return tuple(_launch.run_call(call, kind))

        return _batch_folded(kernel, q, k, v, _arrays_only(meta))

    return _launch.per_platform(run, q, k, v)


def sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: LayoutLike, *,
                     scale: float | None = None,
                     return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Block-sparse softmax attention ``softmax(q k^T * scale, masked by layout) v`` per head.

    Args:
      q: ``[B, H, N, D]``; k, v: ``[B, H_kv, N_kv, D]`` with ``H % H_kv == 0`` (GQA/MQA: query
        head ``h`` uses kv head ``h // (H // H_kv)``, never repeated in memory; dk, dv sum
        over each group, deterministically). One dtype (float16, bfloat16, float32; float64
        with ``jax_enable_x64``: within 1e-10 of the float64 oracle, not a fast path).
        Supported head dims ``D``: the multiples of 16 from 16 to 256; others raise
        ``ValueError``.
      layout: a :class:`~sparsetp.core.layout.BlockLayout` or :class:`LayoutArrays` for
        ``H`` query heads, ``N`` queries and ``N_kv`` keys (``make_layout(..., kv_len=N_kv)``;
        causal and local patterns are aligned to the end of the keys).
      scale: softmax scale (a Python float, static); default ``D ** -0.5``.
      return_lse: also return the log-sum-exp ``[B, H, N]`` (float32; differentiable).

    Returns ``out`` (``[B, H, N, D]``, the input dtype), or ``(out, lse)``. Rows with no allowed
    key give 0 and ``-inf`` and pass no gradient. Differentiable w.r.t. ``q, k, v``
    (``jax.grad``/``jax.vjp`` run the Triton backward kernels); works under ``jit`` and inside
    ``shard_map``.

    Raises ValueError, with the torch frontend's messages, for mismatched shapes or dtypes, an
    unsupported dtype or head dim, or a layout for another head count / sequence length.

    >>> out = sparse_attention(q, k, v, make_layout(P.causal(), 1024, 8))   # doctest: +SKIP

    Per-row documents (``layout.batch`` must equal B): each batch row its own packing, in one
    call; batch is folded into heads for the launch, as in the torch frontend::

    >>> lay = make_layout(P.documents([[100, 28], [128]]) & P.causal(), 128, 8)  # doctest: +SKIP
    >>> out = sparse_attention(q2, k2, v2, lay)     # q2 [2, 8, 128, D]        # doctest: +SKIP
    """
    lay, scale = _check_inputs(q, k, v, layout, scale)
    fwd, bwd = _choose(q, k, lay, scale)  # raises for a forced fast path that cannot run
    shape = q.shape
    if lay.batch is not None:
        # A per-row layout: batch folded into heads; table head r * H + h is row r's head h
        # (GQA folds alike), so the flat tables of metadata() serve [1, B * H, N, D].
        q, k, v = (t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:]) for t in (q, k, v))
    out, lse = _attention_jit(q, k, v, lay.metadata(), scale=scale,
                              statics=_statics(lay),
                              widest=(lay.widest_row, lay.partial_row, lay.row_widths),
                              opts=_options.current(),
                              sm90=(fwd.name == "hopper", bwd.name == "hopper"))
    out, lse = out.reshape(shape), lse.reshape(shape[:3])
    return (out, lse) if return_lse else out


def forward_kernel(q: jax.Array, k: jax.Array, v: jax.Array,
                   layout: LayoutLike) -> _hopper.KernelChoice:
    """Which forward kernel :func:`sparse_attention` runs for these arguments, and why:
    ``"hopper"``, the sm_90 Gluon forward (:mod:`sparsetp.kernels.hopper`, launched by
    :mod:`sparsetp.backends.jax.hopper`), where :func:`sparsetp.kernels.hopper.forward_choice`
    takes it (an sm_90 GPU, bfloat16/float16, head dim 128, the layout at block 128, under
    ``LaunchOptions.fwd_kernel``), else ``"portable"`` (the portable Triton kernel or the
    native CPU path). The same rule as ``sparsetp.torch.forward_kernel``; under ``jit`` the
    layout's mean list length is unknown, so the rule's size threshold counts programs only.
    Under ``LaunchOptions.fwd_kernel="hopper"`` a call the fast path cannot run raises
    ValueError here and in ``sparse_attention``.

    >>> import numpy as np
    >>> from sparsetp.core import make_layout, patterns as P
    >>> q = np.zeros((1, 2, 128, 32), np.float32)
    >>> forward_kernel(q, q, q, make_layout(P.causal(), 128, 2, 64)).name
    'portable'
    """
    lay, scale = _check_inputs(q, k, v, layout, None)
    return _choose(q, k, lay, scale, report=True)[0]


def backward_kernel(q: jax.Array, k: jax.Array, v: jax.Array,
                    layout: LayoutLike) -> _hopper.KernelChoice:
    """Which kernels run :func:`sparse_attention`'s backward, and why: the sm_90 dQ and dK/dV
    passes (``"hopper"``) by :func:`forward_kernel`'s eligibility and rule under
    ``LaunchOptions.bwd_kernel``, else the portable ones.

    >>> import numpy as np
    >>> from sparsetp.core import make_layout, patterns as P
    >>> q = np.zeros((1, 2, 128, 32), np.float32)
    >>> backward_kernel(q, q, q, make_layout(P.causal(), 128, 2, 64)).name
    'portable'
    """
    lay, scale = _check_inputs(q, k, v, layout, None)
    return _choose(q, k, lay, scale, report=True)[1]


def _arrays_only(meta):
    """The array entries of launch metadata (the static head order stays out of traced args)."""
    return {n: a for n, a in meta.items() if n in _META}


def _statics(lay: LayoutArrays) -> tuple:
    """What launches read of a layout besides its arrays (static): the head order
    (schedule.grid_group), ``skip_quarters`` and ``skip_halves``."""
    return lay.q_head_group, lay.k_head_group, lay.skip_quarters, lay.skip_halves


def _with_statics(meta, statics):
    """The launch metadata: the arrays plus the layout's :func:`_statics`."""
    return {**meta, **dict(zip(("q_head_group", "k_head_group", "skip_quarters", "skip_halves"),
                               statics, strict=True))}


# ``opts``: the launch options the call was made under (kernels.options, a hashable frozen
# object), static so that they key the trace (without them a jitted call would keep the
# options of its first trace) and reach the backward rule, which launches as the forward did
# (the torch frontend's rule too).
@functools.partial(jax.custom_vjp,
                   nondiff_argnames=("scale", "statics", "widest", "opts", "sm90"))
def _attention(q, k, v, meta, scale, statics, widest, opts, sm90):  # by name (static)
    return _fwd(q, k, v, _with_statics(meta, statics), scale, widest, opts, sm90[0])


# Always staged: launch.per_platform's platform_dependent then lowers for the devices the call
# runs on. Evaluated op by op (an eager shard_map over CPU devices of a GPU machine) it took the
# default backend's CUDA branch on CPU buffers and crashed the process. One staged function per
# path rule (whether the GPU path is staged, and the CPU kind; SPARSETP_INTERPRET switches both):
# a trace made under one rule, reused under another, ran the interpreter's host callback on GPU
# buffers.
_STAGED: dict = {}


def _attention_jit(*args, **kwargs):
    rule = (_launch.gpu_path(), _runtime.device_kind("cpu"))
    staged = _STAGED.get(rule)
    if staged is None:
        def attention(*args, **kwargs):  # its own function: jit caches traces per function
            return _attention(*args, **kwargs)

        staged = _STAGED[rule] = jax.jit(
            attention, static_argnames=("scale", "statics", "widest", "opts", "sm90"))
    return staged(*args, **kwargs)


def _attention_fwd_rule(q, k, v, meta, scale, statics, widest, opts, sm90):
    out, lse = _fwd(q, k, v, _with_statics(meta, statics), scale, widest, opts, sm90[0])
    return (out, lse), (q, k, v, out, lse, meta)


def _kernel_backward(q, k, v, out, lse, d_out, d_lse, meta, scale, kind):
    """The dQ and dK/dV kernels on the path ``kind``, under the caller's launch options. dQ also
    writes Delta = rowsum(dO * O) - d_lse (an LSE cotangent enters dS = P * (dP - Delta) that
    way; zeros when only ``out`` is used), which dK/dV reads."""
    dtype = jnp.dtype(q.dtype).name
    dq, delta = _launch.run_call(_abi.bwd_dq_call(
        q, k, v, d_out, lse, out, d_lse, meta, scale=scale, dtype=dtype, device_kind=kind), kind)
    dk, dv = _launch.run_call(_abi.bwd_dkdv_call(
        q, k, v, d_out, lse, delta, meta, scale=scale, dtype=dtype, device_kind=kind), kind)
    return dq, dk, dv


def _sm90_backward(fast, q, k, v, out, lse, d_out, d_lse):
    """The sm_90 dQ pass (with the LSE cotangent: JAX hands zeros where the LSE is unused,
    and Delta - 0 is Delta) and dK/dV pass."""
    jh, launches, dt, d = fast
    f32 = jnp.float32
    first = jh.call(launches["dq_dlse"], dt, d,
                    dict(q=q, k=k, v=v, out=out, lse=lse, d_out=d_out, d_lse=d_lse.astype(f32)),
                    dict(dq=jax.ShapeDtypeStruct(q.shape, q.dtype),
                         delta=jax.ShapeDtypeStruct(q.shape[:3], f32)))
    second = jh.call(launches["dkdv"], dt, d,
                     dict(q=q, k=k, v=v, lse=lse, delta=first["delta"], d_out=d_out),
                     dict(dk=jax.ShapeDtypeStruct(k.shape, k.dtype),
                          dv=jax.ShapeDtypeStruct(v.shape, v.dtype)))
    return first["dq"], second["dk"], second["dv"]


def _attention_bwd_rule(scale, statics, widest, opts, sm90, residuals, cotangents):
    q, k, v, out, lse, meta_arrays = residuals
    meta = _with_statics(meta_arrays, statics)
    d_out, d_lse = cotangents
    d_out = d_out.astype(q.dtype)

    def run(kind):
        if kind == "cpu":  # the native backward on CPU (recomputes P from the LSE)
            return _cpu.backward(q, k, v, out, lse, d_out, d_lse, meta, scale, widest=widest)

        def kernels(q, k, v, out, lse, d_out, d_lse, meta_arrays):
            with _options.using(opts):  # the forward's options, also when a vmap traces this
                full = {**meta, **meta_arrays}
                fast = (sm90[1] and kind == "cuda"
                        and _sm90_launches(q, k, full, scale, ("dq_dlse", "dkdv")))
                if fast:
                    return _sm90_backward(fast, q, k, v, out, lse, d_out, d_lse)
                return _kernel_backward(q, k, v, out, lse, d_out, d_lse, full, scale, kind)

        return _batch_folded(kernels, q, k, v, out, lse, d_out, d_lse, _arrays_only(meta))

    dq, dk, dv = _launch.per_platform(run, q, d_out)
    # Integer metadata has no cotangent (JAX's float0 zeros).
    d_meta = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, jax.dtypes.float0), meta_arrays)
    return dq, dk, dv, d_meta


_attention.defvjp(_attention_fwd_rule, _attention_bwd_rule)
