"""Eager CUDA attention with its autograd node and launches in C++ (``native.cpp`` beside this).

Why: at small N the host decides the speed of an eager forward + backward, and a Python
``autograd.Function`` plus Triton's Python launcher cost more host time than a whole dense SDPA
forward + backward (``benchmarks/KERNEL_NOTES.md``, host time). With this extension, once a
call signature's kernels are compiled (its first forward + backward through the Python path),
later calls with that signature create a C++ autograd node and launch the same compiled Triton
kernels through ``cuLaunchKernel``, with no Python in the backward: the portable kernels and,
on sm_90, the Gluon ones (:mod:`sparsetp.kernels.hopper`), whose TMA descriptors it encodes
per call from the tensors' addresses as Triton's launcher does (in Python, its descriptors
and launches cost more host time than the portable kernels': KERNEL_NOTES, host time).

* The numbers are the Python path's, bit for bit: same kernels, same arguments, same order.
* It is used when all of these hold, else the Python path runs (same results):
  the tensors are CUDA tensors; :attr:`LaunchOptions.native_autograd` is on and the direct
  launch is enabled (``launch.direct_launch_enabled``: ``direct_launch`` on, a tested
  Triton); ``SPARSETP_NATIVE`` is not ``0`` (read when a call signature's plan is built); the
  extension has built (:func:`status`); ``return_lse`` is off or nothing needs a gradient;
  q, k and v are 16-byte aligned (as their kernels were compiled); no Triton launch hook (a
  profiler) is set; not under ``torch.compile`` (which traces the registered operator
  instead), compiled autograd or ``torch.jit.trace``.
* The extension builds once per machine, source and torch version with torch's C++ toolchain
  (``torch.utils.cpp_extension``: a C++17 compiler and ninja; no CUDA toolkit) into
  ``$SPARSETP_CACHE_DIR`` (default ``~/.cache/sparsetp``), in a process of its own
  (``native_build.py``) that the first CUDA backward starts; calls use the Python path until
  it is ready. Built before, it is imported by the first call at once. A failed build warns
  once (``RuntimeWarning``) and :func:`status` keeps the reason.
* An output gradient with other strides than the first backward's (a broadcast from
  ``.sum()``, a transposed view) is copied to those strides before the backward kernels, and
  so are saved tensors that a saved-tensor hook (``save_on_cpu``) gives back in other strides.
* No double backward (``create_graph=True`` raises) and no forward-mode AD, as in the Python
  path; an unused output gives zero gradients, as there.

Example::

    >>> from sparsetp.backends.torch import native
    >>> native.status() in ("not started", "building", "ready") or native.status().startswith(
    ...     ("disabled", "unavailable"))
    True
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import threading
import warnings

from sparsetp.backends.torch import native_build
from sparsetp.kernels import abi, hopper

__all__ = ["status", "load", "wait", "make_plan", "plan_cells", "portable_kernel",
           "sm90_kernel", "TENSORS"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.cpp")
_LOCK = threading.Lock()
_CFLAGS = ("-O2", "-std=c++17")
_STATE: dict = {"module": None, "status": "not started", "thread": None, "target": None}


def _disabled() -> str | None:
    value = os.environ.get("SPARSETP_NATIVE", "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return f"disabled (SPARSETP_NATIVE={value})"
    if value not in ("", "1", "true", "yes", "on"):
        raise ValueError(f"SPARSETP_NATIVE must be 1 or 0, got {value!r}")
    return None


def status() -> str:
    """``"ready"``, ``"building"``, ``"not started"`` (no CUDA backward yet),
    ``"disabled (...)"`` or ``"unavailable: <why>"``."""
    return _disabled() or _STATE["status"]


def _target() -> str:
    """The extension's file in the cache: one per source, torch, Python and compiler."""
    if _STATE.get("target") is None:
        import torch  # noqa: PLC0415

        _STATE["target"] = abi.cached_build(
            "torch_native", _SOURCE, (torch.__version__, sys.version,
                                      sys.implementation.cache_tag, platform.machine(),
                                      os.environ.get("CXX"), _CFLAGS))
    return _STATE["target"]


def _import(path: str):
    spec = importlib.util.spec_from_file_location(native_build.NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> None:
    """The background thread: build in a process of its own (:mod:`native_build` says why),
    then import the library. Waiting on that process holds no GIL."""
    try:
        done = subprocess.run([sys.executable, native_build.__file__, _SOURCE, _target(),
                               *_CFLAGS], capture_output=True, text=True, check=False,
                              env=_build_env())
        if done.returncode:
            raise _BuildError(done)
        module = _import(_target())
    except Exception as exc:  # noqa: BLE001 (any build or import failure: reported, not raised)
        kind, text = (exc.kind, exc.text) if isinstance(exc, _BuildError) else (
            type(exc).__name__, str(exc))
        reason = f"{kind}: {abi.first_diagnostic(text)}"
        _STATE["status"] = f"unavailable: {reason}"
        warnings.warn(f"sparsetp: the native attention extension did not build ({reason}); "
                      "eager CUDA attention keeps the Python autograd path, with more host "
                      "time per call. sparsetp.backends.torch.native.status() keeps the reason.",
                      RuntimeWarning, stacklevel=2)
        return
    _STATE["module"] = module
    _STATE["status"] = "ready"


def _build_env() -> dict:
    """The build process's environment: this one's, with this process's ``sys.path`` ahead of
    ``PYTHONPATH``, so that it imports the torch this process imported, also where
    ``sys.path`` was edited at run time (a notebook's, a launcher's)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class _BuildError(Exception):
    """A failed build process: the exception it reported (its last stderr line, JSON), else
    its whole stderr."""

    def __init__(self, done: subprocess.CompletedProcess):
        lines = done.stderr.strip().splitlines()
        try:
            last = json.loads(lines[-1])
            self.kind, self.text = last["type"], last["message"]
        except (IndexError, ValueError, KeyError, TypeError):
            self.kind = f"build process exit {done.returncode}"
            self.text = done.stderr or done.stdout or "(no output)"
        super().__init__(f"{self.kind}: {self.text}")


def load(block: bool = False):
    """The extension module, or None while it is building, disabled or unavailable. Built
    before (on this machine, for this source and torch), it is imported at once; else the
    first call starts the build in the background (``block=True`` waits for it)."""
    if _STATE["module"] is not None:
        return None if _disabled() else _STATE["module"]
    if _disabled():
        return None
    with _LOCK:
        if _STATE["thread"] is None and _STATE["module"] is None:
            try:
                cached = os.path.exists(_target())
            except OSError:  # no writable cache directory: the build says why
                cached = False
            if cached:
                try:
                    _STATE["module"] = _import(_target())
                    _STATE["status"] = "ready"
                    return _STATE["module"]
                except Exception:  # noqa: BLE001 (a damaged file: build it again)
                    with contextlib.suppress(OSError):
                        os.remove(_target())
            _STATE["status"] = "building"
            _STATE["thread"] = threading.Thread(target=_build, name="sparsetp-native-build",
                                                daemon=True)
            _STATE["thread"].start()
    if block and _STATE["thread"] is not None:
        _STATE["thread"].join()
    return _STATE["module"]


def wait() -> str:
    """Build (or load) the extension now and return :func:`status`."""
    load(block=True)
    return status()


def plan_cells(desc, compiled) -> tuple[list[int], list[tuple[int, int]]]:
    """``(cells, per_call)`` of one launch description (``launch._Description``) with its
    compiled kernel: every kernel parameter's value in order, constexprs left out and Triton's
    two scratch pointers (null: the kernel must need no scratch) appended; ``per_call`` pairs
    (cell, index into the launch's per-call tensors: the description's tensors, then its
    outputs). Raises ValueError for a kernel this launcher cannot pass."""
    needs = abi.unlaunchable(compiled.metadata)
    if needs:
        raise ValueError(f"{compiled.name}: needs {', '.join(needs)}")
    names = desc.call.kernel.arg_names
    n_tensors, n_args, n_outputs = desc.n_tensors, len(desc.call.args), len(desc.call.outputs)
    if len(names) != n_args + n_outputs + len(desc.constexpr_values):
        raise ValueError(f"{compiled.name}: {len(names)} parameters for {n_args} arguments, "
                         f"{n_outputs} outputs and {len(desc.constexpr_values)} constexprs")
    signature = compiled.src.signature
    if list(signature) != list(names):
        raise ValueError(f"{compiled.name}: signature {list(signature)} is not in argument order")
    cells: list[int] = []
    per_call: list[tuple[int, int]] = []
    for i, name in enumerate(names):
        ty = signature[name]
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            raise ValueError(f"{compiled.name}: parameter {name} has type {ty!r}")
        if ty.startswith("*"):
            if i < n_tensors:
                per_call.append((len(cells), i))
                cells.append(0)
            elif i < n_args:
                cells.append(int(desc.tail_ptrs[i - n_tensors]))
            elif i < n_args + n_outputs:
                per_call.append((len(cells), n_tensors + i - n_args))
                cells.append(0)
            else:
                raise ValueError(f"{compiled.name}: pointer parameter {name} among constexprs")
        elif n_tensors <= i < n_args:
            cells.append(abi.pack_cell(ty, desc.tail[i - n_tensors]))
        elif i >= n_args + n_outputs:
            cells.append(abi.pack_cell(ty, desc.constexpr_values[i - n_args - n_outputs]))
        else:
            raise ValueError(f"{compiled.name}: parameter {name} ({ty}) is a per-call tensor")
    cells += [0, 0]  # global and profile scratch
    return cells, per_call


# The per-call tensors of each C++ launch, in order (native.cpp: attention() and apply(); the
# dQ pass's "d_lse" slot holds lse, as the Python path passes it when there is no cotangent).
TENSORS = {"fwd": ("q", "k", "v", "out", "lse"),
           "dq": ("q", "k", "v", "d_out", "lse", "out", "d_lse", "dq", "delta"),
           "dkdv": ("q", "k", "v", "d_out", "lse", "delta", "dk", "dv")}


def portable_kernel(module, desc):
    """The C++ ``Kernel`` of a portable launch description (``launch._Description``), its
    kernel compiled for 16-byte-aligned tensors; None while it is not compiled yet. Raises
    ValueError (:func:`plan_cells`) for a kernel the C++ launcher cannot pass."""
    compiled = desc.compiled.get((True,) * (desc.n_tensors + len(desc.call.outputs)))
    if compiled is None:
        return None
    cells, per_call = plan_cells(desc, compiled)
    return _module_kernel(module, compiled, desc.call.grid, cells, per_call)


def _module_kernel(module, compiled, grid, cells, per_call, tma=()):
    """The C++ ``Kernel`` of a loaded Triton-compiled kernel with its parameter cells."""
    if compiled.function is None:
        raise ValueError(f"{compiled.metadata.name}: not loaded")
    return module.Kernel(function=int(compiled.function), grid=list(grid),
                         threads=32 * compiled.metadata.num_warps,
                         shared=compiled.metadata.shared, cells=cells, per_call=per_call,
                         tma=list(tma))


def sm90_kernel(module, which: str, launch, compiled, rows: dict, head_dim: int):
    """The C++ ``Kernel`` of an sm_90 launch (``sparsetp.kernels.hopper.Sm90Launch``; ``which``
    one of :data:`TENSORS`) with its Triton-compiled kernel (loaded): the parameters of
    :func:`sparsetp.kernels.hopper.parameters`, the TMA descriptors encoded per call from the
    boxed tensors' addresses (``rows`` of each boxed operand's ``[rows, head_dim]`` view).
    Raises ValueError for a kernel the C++ launcher cannot pass."""
    params, specs = hopper.parameters(launch, compiled, rows, head_dim)
    index = {name: i for i, name in enumerate(TENSORS[which])}
    named = {v for kind, v in params if kind == "pointer"} | {t.name for t in specs}
    unknown = named - set(index)
    if unknown:
        raise ValueError(f"{compiled.metadata.name}: operands {sorted(unknown)} are not among "
                         f"the node's {which} tensors {TENSORS[which]}")
    cells: list[int] = []
    per_call: list[tuple[int, int]] = []
    tma: list[list[int]] = []
    for kind, value in params:
        if kind == "pointer":
            per_call.append((len(cells), index[value]))
        elif kind == "tma":
            t = specs[value]
            tma.append([len(cells), index[t.name], t.rows, t.d, t.box_rows, t.box_cols,
                        t.elem_type, t.elem_size, t.swizzle])
        cells.append(int(launch.args[value].data_ptr()) if kind == "array"
                     else int(value) if kind.startswith("lit") else 0)
    return _module_kernel(module, compiled, launch.grid, cells, per_call, tma)


def make_plan(module, fwd, dq, dkdv, *, lse_double: bool, d_out_strides, saved_strides,
              keep):
    """A native plan from the forward's, dQ pass's and dK/dV pass's C++ kernels
    (:func:`portable_kernel`, :func:`sm90_kernel`; any None: not compiled yet, no plan).
    ``keep``: the tensors whose addresses sit in the kernels' cells (the layout's metadata),
    kept alive by the plan. The caller decides whether the direct launch is enabled
    (``launch.direct_launch_enabled``)."""
    if fwd is None or dq is None or dkdv is None:
        return None
    return module.Plan(fwd, dq, dkdv, lse_double=lse_double, d_out_strides=list(d_out_strides),
                       saved_strides=[list(x) for x in saved_strides], keep=list(keep))
