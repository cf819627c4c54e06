"""Launch options: one small frozen object that says how the kernels are launched.

The defaults are what users run; tests and benchmarks change them for a block of code with
:func:`launch_options` (read when a launch is built: at trace time under ``jax.jit``, so a
function traced outside the ``with`` keeps the options it was traced with).

Example::

    >>> from sparsetp.kernels import options
    >>> options.current().work_order
    'auto'
    >>> with options.launch_options(work_order="natural"):
    ...     options.current().work_order
    'natural'
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from sparsetp.core.layout import SUPPORTED_BLOCK_SIZES

__all__ = ["WORK_ORDERS", "KERNEL_TILES", "FWD_KERNEL_MODES", "LaunchOptions", "current", "using",
           "launch_options"]

# "auto": per view, the layout's head groups, longest lists first (schedule.grid_group);
# "natural": heads one after another, tile = rank; "longest_first": heads one after another,
# longest lists first; "longest_first_bh": every head interleaved, longest lists first.
WORK_ORDERS = ("auto", "natural", "longest_first", "longest_first_bh")
# "auto": schedule.kernel_layout's cost model on CUDA, the layout's own block elsewhere;
# "layout": always the layout's own block; an int: that tile wherever it is >= the layout's.
KERNEL_TILES = ("auto", "layout", *SUPPORTED_BLOCK_SIZES)
# "auto": the sm_90 forward where eligible and measured faster (sparsetp.kernels.hopper);
# "portable": always the portable Triton forward; "hopper": the sm_90 forward or ValueError.
FWD_KERNEL_MODES = ("auto", "portable", "hopper")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How launches are built. Every field's default is the library's behaviour.

    Attributes:
      work_order: one of :data:`WORK_ORDERS` (the order programs take tiles and heads in).
      head_group: None (the work order decides), or G >= 1 heads interleaved per group.
      kernel_tile: one of :data:`KERNEL_TILES` (:func:`sparsetp.kernels.schedule.kernel_layout`).
      tiles: kernel name -> :class:`sparsetp.kernels.tiles.TileConfig` replacing the heuristic.
      direct_launch: torch on CUDA: after Triton's JIT entry has compiled a launch, later calls
        go straight to the compiled kernel (saves host time per call; off falls back to the
        public entry point, and so does a Triton whose private launch API is not the tested one).
      parallel_compile: torch on CUDA: the backward's kernels compile in threads on first use.
      native_autograd: torch on CUDA, eager: once a call signature's kernels are compiled, its
        later calls create a C++ autograd node and launch from C++
        (:mod:`sparsetp.backends.torch.native`; same kernels, same numbers, less host time).
        Needs ``direct_launch``; off, the Python ``autograd.Function`` path runs.
      fwd_kernel: one of :data:`FWD_KERNEL_MODES`: which forward kernel runs
        (:func:`sparsetp.kernels.hopper.forward_choice`).
      bwd_kernel: one of :data:`FWD_KERNEL_MODES` (the same modes): which kernels run the
        backward's dQ and dK/dV passes (:func:`sparsetp.kernels.hopper.backward_choice`).
    """

    work_order: str = "auto"
    head_group: int | None = None
    kernel_tile: str | int = "auto"
    tiles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    direct_launch: bool = True
    parallel_compile: bool = True
    native_autograd: bool = True
    fwd_kernel: str = "auto"
    bwd_kernel: str = "auto"

    def __post_init__(self):
        if self.work_order not in WORK_ORDERS:
            raise ValueError(f"work_order must be one of {WORK_ORDERS}, got {self.work_order!r}")
        if self.head_group is not None and (isinstance(self.head_group, bool) or not isinstance(
                self.head_group, int) or self.head_group < 1):
            raise ValueError(f"head_group must be None or an int >= 1, got {self.head_group!r}")
        for name in ("fwd_kernel", "bwd_kernel"):
            if getattr(self, name) not in FWD_KERNEL_MODES:
                raise ValueError(f"{name} must be one of {FWD_KERNEL_MODES}, got "
                                 f"{getattr(self, name)!r}")
        if self.kernel_tile not in KERNEL_TILES or isinstance(self.kernel_tile, bool):
            raise ValueError(f"kernel_tile must be one of {KERNEL_TILES}, got "
                             f"{self.kernel_tile!r}")
        from sparsetp.kernels.tiles import KERNEL_NAMES, TileConfig  # noqa: PLC0415 (cycle)

        for name, cfg in dict(self.tiles).items():
            if name not in KERNEL_NAMES or not isinstance(cfg, TileConfig):
                raise ValueError(f"tiles must map kernel names {KERNEL_NAMES} to TileConfig, "
                                 f"got {name!r}: {cfg!r}")
        for name in ("direct_launch", "parallel_compile", "native_autograd"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "tiles", MappingProxyType(dict(self.tiles)))
        # Launch caches key on this per call: computed once (the object is frozen).
        object.__setattr__(self, "_key", (
            self.work_order, self.head_group, self.kernel_tile, tuple(sorted(self.tiles.items())),
            self.direct_launch, self.parallel_compile, self.native_autograd, self.fwd_kernel,
            self.bwd_kernel))

    def key(self) -> tuple:
        """A hashable value that changes whenever a launch built under these options could."""
        return self._key

    def __hash__(self) -> int:
        # The generated field hash would fail on ``tiles`` (a mapping); equal options have
        # equal keys. Hashable, the options can be a static argument of ``jax.jit`` (the JAX
        # frontend keys its trace on them).
        return hash(self._key)


_DEFAULT = LaunchOptions()
# Process-wide, not per thread: torch runs a CUDA backward on its own autograd thread, which must
# see the options the caller set. Changing them is for tests and benchmarks (not thread-safe).
_CURRENT = [_DEFAULT]


def current() -> LaunchOptions:
    """The options in force."""
    return _CURRENT[0]


@contextlib.contextmanager
def using(opts: LaunchOptions) -> Iterator[LaunchOptions]:
    """Within the block, launches use ``opts`` (e.g. the options a forward ran with, in its
    backward)."""
    if not isinstance(opts, LaunchOptions):
        raise ValueError(f"opts must be a LaunchOptions, got {type(opts).__name__}")
    saved = _CURRENT[0]
    _CURRENT[0] = opts
    try:
        yield opts
    finally:
        _CURRENT[0] = saved


@contextlib.contextmanager
def launch_options(**changes: Any) -> Iterator[LaunchOptions]:
    """Within the block, launches use the current options with ``changes``.

    >>> from sparsetp.kernels.tiles import TileConfig
    >>> with launch_options(tiles={"bwd_dkdv": TileConfig(64, 64, 4, 2, sub=16)}) as opts:
    ...     opts.tiles["bwd_dkdv"].sub
    16
    """
    with using(dataclasses.replace(current(), **changes)) as opts:
        yield opts
