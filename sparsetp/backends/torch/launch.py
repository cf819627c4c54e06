"""Launch the sparsetp Triton kernels on torch tensors (the JAX twin: ``backends/jax/launch.py``).

* :func:`metadata`: a layout's int32 metadata as device tensors, cached per (layout, device).
* :func:`describe` + :func:`run`: a launch description from :mod:`sparsetp.kernels.abi`, cached
  per shapes/strides/dtypes/options, then launched: compiled on CUDA, or in Triton's interpreter
  (:mod:`sparsetp.kernels.interpreter`) for CPU tensors under ``SPARSETP_INTERPRET=1`` (else CPU
  tensors take the native path, :mod:`sparsetp.backends.torch.cpu`); the rule is in
  :mod:`sparsetp._runtime`.
* :func:`compile_together`: the backward's kernels compiled in threads on their first use.
* :func:`new_output`: every output buffer comes from here (tests patch it to pre-fill NaN).

Host time matters at small N, so a description is built once per key and reused, and on CUDA
later calls may skip Triton's JIT entry (``LaunchOptions.direct_launch``; Triton's private
launch API, used only for the tested Triton versions, else the public entry point).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import triton

from sparsetp import _runtime
from sparsetp.core.layout import BlockLayout
from sparsetp.kernels import abi, hopper, interpreter, schedule
from sparsetp.kernels import options as _options

__all__ = ["device_kind", "metadata", "device_metadata", "new_output", "describe", "run",
           "compile_together",
           "direct_launch_enabled", "DIRECT_LAUNCH_TRITON"]

# Per-layout device tensors; weak keys so a dropped layout frees its tensors.
_META_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CALLS: dict = {}
_CALLS_MAX = 1024
# Triton versions whose compiled-kernel launch API (``CompiledKernel.run`` and friends, private)
# the direct launch was tested with; others take the public JIT entry point every call.
DIRECT_LAUNCH_TRITON = ((3, 6), (3, 10))


def device_kind(t: torch.Tensor) -> str:
    """``"cuda"``, ``"cpu"`` (the native path, :mod:`sparsetp.backends.torch.cpu`; no launch
    here) or ``"interpreter"`` for tensors on ``t``'s device (:mod:`sparsetp._runtime`)."""
    if t.device.type not in _runtime.PLATFORMS:
        raise ValueError(f"q is on device {t.device}; sparsetp runs on CPU and CUDA tensors")
    return _runtime.device_kind(t.device.type)


def metadata(layout: BlockLayout, q: torch.Tensor, kind: str) -> dict:
    """Device tensors of the layout the kernels run for ``q`` (``schedule.kernel_layout``: the
    layout, or the same pattern at another kernel tile) plus its head groups, cached per
    (kernel layout, device)."""
    return device_metadata(schedule.kernel_layout(layout, kind, head_dim=q.shape[-1],
                                                  dtype=abi.check_dtype(q.dtype)), q.device)


def device_metadata(layout: BlockLayout, device: torch.device) -> dict:
    """Device tensors of ``layout`` as a kernel runs it (no re-laying: the sm_90 kernels run
    their block-128 form) plus its head groups, cached per (layout, device)."""
    per_layout = _META_CACHE.setdefault(layout, {})
    key = str(device)
    if key not in per_layout:
        q_group, k_group = schedule.head_groups(layout)
        per_layout[key] = {**_device_arrays(layout.metadata(), device),
                           "q_head_group": q_group, "k_head_group": k_group}
    return per_layout[key]


def device_group_metadata(layout: BlockLayout, group: int, device: torch.device) -> dict:
    """:func:`device_metadata` plus, for GQA (``group`` query heads per kv head, > 1), the
    merged key-major lists of the sm_90 dK/dV pass (``hopper.group_key_lists``), cached
    alike."""
    meta = device_metadata(layout, device)
    if group == 1:
        return meta
    per_layout = _META_CACHE.setdefault(layout, {})
    key = f"{device}/group{group}"
    if key not in per_layout:
        merged = hopper.group_key_lists(np, layout.metadata(), group, layout.num_blocks)
        per_layout[key] = {**meta, **_device_arrays(merged, device)}
    return per_layout[key]


def _device_arrays(arrays: dict, device: torch.device) -> dict:
    """int32 copies of numpy ``arrays`` on ``device``. On CUDA they are allocated on a helper
    thread: CUDA-graph trees (torch.compile's reduce-overhead mode) route every allocation of
    the calling thread into their graph's pool, where a tensor that outlives the graph is an
    error; the metadata are cached for the layout's lifetime, so they must live outside it."""
    def build():
        out = {name: torch.from_numpy(np.array(arr, dtype=np.int32, order="C")).to(device)
               for name, arr in arrays.items()}
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # ready for any stream
        return out

    if device.type != "cuda":
        return build()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(build).result()


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every kernel output buffer comes from here (tests patch it to pre-fill with NaN)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _restore_cache_dir() -> None:
    # jax_triton 0.3.1 sets TRITON_CACHE_DIR="" for the whole process, which makes Triton fail
    # to create its cache; an empty value means "unset" to us.
    if os.environ.get("TRITON_CACHE_DIR", None) == "":
        del os.environ["TRITON_CACHE_DIR"]


def _launch(call: abi.KernelCall, outputs, kind: str):
    """Launch ``call`` through Triton's public entry point (or the interpreter); returns the
    compiled kernel Triton hands back on CUDA, None in the interpreter."""
    if kind == "interpreter":
        interpreter.launch(call.kernel, call.grid, (*call.args, *outputs), call.constexprs)
        return None
    _restore_cache_dir()
    with torch.cuda.device(outputs[0].device):
        return call.kernel[call.grid](*call.args, *outputs, **call.constexprs,
                                      num_warps=call.num_warps, num_stages=call.num_stages)


class _Description:
    """A cached launch description: the call as built (per-call tensors left out: ``None``), its
    arguments after the per-call tensors, its constexpr values in signature order, and the
    compiled kernels Triton returned for it, by the alignment of the per-call tensors."""

    __slots__ = ("call", "n_tensors", "tail", "tail_ptrs", "constexpr_values", "compiled",
                 "meta")

    def __init__(self, call: abi.KernelCall, n_tensors: int, meta):
        # The per-call tensors are dropped: a cached description must not keep the first
        # caller's tensors alive (under CUDA graphs they belong to a graph's memory pool).
        self.call = dataclasses.replace(call, args=(None,) * n_tensors + call.args[n_tensors:])
        self.n_tensors = n_tensors
        self.tail = call.args[n_tensors:]
        # The metadata tensors among them as device pointers, for the direct launch (they are
        # cached per layout and kept alive by ``meta``, so the pointers stay valid).
        self.tail_ptrs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                               for a in self.tail)
        names = call.kernel.arg_names[len(call.args) + len(call.outputs):]
        if sorted(names) != sorted(call.constexprs):
            raise AssertionError(f"{call.name}: constexprs {sorted(call.constexprs)} do not fill "
                                 f"the kernel's trailing parameters {names}")
        self.constexpr_values = tuple(call.constexprs[n] for n in names)
        self.compiled: dict = {}
        self.meta = meta  # keeps the metadata tensors (ids in the key) alive

    def with_tensors(self, tensors) -> abi.KernelCall:
        return dataclasses.replace(self.call, args=(*tensors, *self.tail))


def describe(builder, tensors: tuple, meta, strides: dict, **kw) -> _Description:
    """``builder(*tensors[, meta], strides=strides, **kw)`` (an ``abi.*_call``), cached on
    everything the description depends on: the builder, the metadata tensors (kept alive by
    the entry, so their ids stay unique), each tensor's shape/stride/dtype/device, the strides
    and keywords, and the launch options."""
    key = (builder, None if meta is None else tuple(map(id, meta.values())),
           tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors),
           tuple(strides.items()), tuple(kw.items()), _options.current().key())
    hit = _CALLS.get(key)
    if hit is None:
        call = builder(*tensors, *(() if meta is None else (meta,)), strides=strides, **kw)
        # Builders put their tensor arguments first, in order (abi's module docstring).
        assert all(a is t for a, t in zip(call.args, tensors, strict=False))
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = hit = _Description(call, len(tensors), meta)
    return hit


def _direct_launch_supported() -> bool:
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    low, high = DIRECT_LAUNCH_TRITON
    return low <= (major, minor) < high


_DIRECT_OK = _direct_launch_supported()
_STREAM_OF = None


def direct_launch_enabled() -> bool:
    """Whether launches may bypass Triton's JIT entry: the options allow it and this Triton is
    one whose private launch API (and launcher packing) was tested."""
    return _DIRECT_OK and _options.current().direct_launch


def _current_stream(device: int) -> int:
    """The raw current CUDA stream of ``device``, as Triton's launcher obtains it."""
    global _STREAM_OF
    if _STREAM_OF is None:  # the driver initialises on first use: only on the CUDA path
        from triton.runtime import driver  # noqa: PLC0415
        _STREAM_OF = driver.active.get_current_stream
    return _STREAM_OF(device)


def _launch_hooks():
    """Triton's (enter, exit) launch hooks, or None when no hook would run. Triton >= 3.6 keeps
    them as ``HookChain`` objects that are never None, empty unless a profiler adds a hook; an
    empty chain passed on would cost a launch-metadata dict and two calls per launch, and the
    tensors' pointer queries."""
    rt = triton.knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    if _idle(enter) and _idle(leave):
        return None
    return enter, leave


def _idle(hook) -> bool:
    return hook is None or getattr(hook, "calls", None) == []


def run(desc: _Description, tensors: tuple, outputs: tuple, kind: str) -> None:
    """Launch ``desc`` with this call's ``tensors`` (same shapes/strides/dtypes/device as the
    description's) writing ``outputs``. On CUDA, once Triton has compiled the description for
    these alignments, the compiled kernel is called directly: everything Triton specialises on
    is fixed by the description's key, except the 16-byte alignment of the per-call tensors,
    which keys ``desc.compiled``."""
    if kind != "cuda":
        _launch(desc.with_tensors(tensors), outputs, kind)
        return
    ptrs = [t.data_ptr() for t in (*tensors, *outputs)]
    align = tuple(p % 16 == 0 for p in ptrs)
    compiled = desc.compiled.get(align)
    device = outputs[0].device.index
    if (compiled is not None and direct_launch_enabled()
            and torch.cuda.current_device() == device):
        # What triton.runtime.jit.JITFunction.run does after its cache lookup (Triton 3.6 to
        # 3.9): the bound argument values, constexprs included, in signature order. Pointers go
        # as ints, which Triton's launcher takes as they are: a tensor would cost a data_ptr()
        # call and a driver pointer query per argument (the tensors' devices were checked when
        # the description was built, and this one is the current device).
        stream = _current_stream(device)
        grid = desc.call.grid
        n = len(tensors)
        hooks = _launch_hooks()
        if hooks is None:
            args = (*ptrs[:n], *desc.tail_ptrs, *ptrs[n:], *desc.constexpr_values)
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                         compiled.packed_metadata, None, None, None, *args)
        else:  # launch hooks (profilers) read the tensors themselves
            args = (*tensors, *desc.tail, *outputs, *desc.constexpr_values)
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                         compiled.packed_metadata, compiled.launch_metadata(grid, stream, *args),
                         *hooks, *args)
        return
    compiled = _launch(desc.with_tensors(tensors), outputs, kind)
    if compiled is not None:
        desc.compiled[align] = compiled


_COMPILED_TOGETHER: set = set()


def compile_together(launches, kind: str) -> None:
    """Compile (not run) the kernels of ``launches`` [(call, outputs)] in parallel threads,
    once per (device, kernel configs); later launches find them in Triton's cache. Triton's
    compile spends much of its time outside the GIL (MLIR passes, ptxas), so the backward's
    first call waits for one compile instead of three in a row."""
    if kind != "cuda" or not _options.current().parallel_compile:
        return
    device = launches[0][1][0].device
    key = (str(device), *((c.name, c.num_warps, c.num_stages, tuple(sorted(c.constexprs.items())))
                          for c, _ in launches))
    if key in _COMPILED_TOGETHER:
        return
    _restore_cache_dir()

    def warm(launch):
        call, outputs = launch
        with torch.cuda.device(device):  # Triton keys its kernel cache by the current device
            return call.kernel.warmup(*call.args, *outputs, grid=call.grid, **call.constexprs,
                                      num_warps=call.num_warps, num_stages=call.num_stages)

    with ThreadPoolExecutor(len(launches)) as pool:
        compiled = list(pool.map(warm, launches))  # list(): re-raise a compile error here
    # Load the modules now too (Triton does it lazily at the first launch), one after another:
    # Triton builds and imports every kernel's launcher under one module name, which is not
    # safe from two threads at once (and loading is cheap). Private, so only for the tested
    # Triton versions: without it the kernels are still compiled.
    with torch.cuda.device(device):
        for c in compiled:
            init = getattr(c, "_init_handles", None) if _DIRECT_OK else None
            if init is not None:
                init()
    _COMPILED_TOGETHER.add(key)
