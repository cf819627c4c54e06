"""Save and load a (tensor-parallel) torch block or GPT as one safetensors checkpoint.

The file is :mod:`sparsetp.core.checkpoint`'s: canonical UNSHARDED parameters, so it loads into
any TP size here and into JAX (:mod:`sparsetp.backends.jax.checkpoint`) on any mesh.

Any module with ``config`` (a ``HybridConfig`` or a ``GPTConfig``), ``group``, ``export_params``
and ``load_params`` works: a :class:`~sparsetp.backends.torch.block.HybridBlock` or a
:class:`~sparsetp.backends.torch.model.GPT`. The config goes into the header and a load checks
it, so a GPT's file does not load into a block (or a GPT of another config): the ValueError
names the differing fields and tensors, and nothing is loaded.

Both functions are collectives over the module's TP ``group``: every rank calls them.

* :func:`save` gathers the shards (``module.export_params()``), rank 0 of the group writes the
  file, and every rank learns whether it was written (a failure on rank 0 raises on every rank,
  instead of leaving the others in a barrier until the process-group timeout).
* :func:`load` has every rank read and validate the whole file, agree that all ranks did, and
  only then copy its shards into the parameters: a bad file, or one rank that cannot read it,
  raises on every rank with every parameter unchanged.

With several data-parallel replicas, each replica's rank 0 writes the same bytes under a unique
temporary name and renames them into place; call :func:`save` from one replica to write once.

>>> from sparsetp.torch import HybridBlock, checkpoint        # doctest: +SKIP
>>> checkpoint.save(block, "block.safetensors")               # every TP rank calls it
>>> fresh = HybridBlock(cfg, group, seed=None)                # NaN until loaded
>>> checkpoint.load(fresh, "block.safetensors")
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist
from torch import nn

from sparsetp.backends.torch.comm import group_rank, group_size
from sparsetp.core.checkpoint import (
    config_dtype,
    config_param_shapes,
    load_checkpoint,
    save_checkpoint,
)
from sparsetp.core.config import HybridConfig
from sparsetp.core.model import GPTConfig

__all__ = ["save", "load"]


def _agree(group, error: BaseException | None, action: str) -> None:
    """Raise on every rank if any rank of ``group`` failed ``action`` (a collective).

    The failing rank re-raises its own exception; the others raise RuntimeError naming it."""
    world = group_size(group)
    if world > 1:
        errors = [None] * world
        mine = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(errors, mine, group=group)
        if error is None:
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed:
                rank, msg = failed[0]
                raise RuntimeError(f"rank {rank} of the tensor-parallel group failed to "
                                   f"{action}, so this rank did not either: {msg}")
    if error is not None:
        raise error


def _check_module(module):
    if not isinstance(module, nn.Module) or not all(
            hasattr(module, a) for a in ("config", "export_params", "load_params")):
        raise ValueError(f"module must be a sparsetp torch module with config/export_params/"
                         f"load_params (a HybridBlock or a GPT), got {type(module).__name__}")
    return module.config


def save(module: nn.Module, path, *, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``module``'s canonical unsharded parameters and config to ``path`` (collective).

    Every rank of ``module.group`` must call it. Tensors are stored in the config's dtype
    (``config.dtype``, a GPT's ``config.block.dtype``; a bfloat16 model as ``BF16``: exact,
    the values it holds). ``metadata``: extra
    ``{str: str}`` for the header (a step count, say). Raises on every rank if rank 0 could not
    write (the error names the rank and the cause).
    """
    config = _check_module(module)
    group = getattr(module, "group", None)
    params = module.export_params()  # a collective: every rank gathers the full tensors
    error = None
    if group_rank(group) == 0:
        try:
            dtype = config_dtype(config) if isinstance(config, (HybridConfig, GPTConfig)) \
                else None
            save_checkpoint(path, params, config=config, metadata=metadata, dtype=dtype)
        except Exception as e:  # noqa: BLE001  (re-raised by _agree, on every rank)
            error = e
    _agree(group, error, f"write checkpoint {path!r}")


def load(module: nn.Module, path, *, check_config: bool = True,
         shapes: Mapping[str, tuple] | None = None) -> None:
    """Load checkpoint ``path`` into ``module``, each rank keeping its shards (collective).

    Every rank reads and validates the file (names, shapes, dtypes, checksums and, with
    ``check_config``, every config field against ``module.config``) before any parameter is
    touched; if any rank fails, every rank raises and ``module`` is unchanged everywhere.
    ``check_config=False`` loads the tensors of a file with another config (another pattern,
    or another dtype: values are then rounded to the module's dtype as ``load_params`` does).
    ``shapes``: the expected ``{name: shape}``; default the canonical shapes of
    ``module.config`` (:func:`~sparsetp.core.checkpoint.config_param_shapes`: a block's or a
    GPT's).
    """
    config = _check_module(module)
    group = getattr(module, "group", None)
    if shapes is None:
        if not isinstance(config, (HybridConfig, GPTConfig)):
            raise ValueError(f"shapes must be given for a module whose config is a "
                             f"{type(config).__name__}")
        shapes = config_param_shapes(config)
    params, error = None, None
    try:
        params = load_checkpoint(path, shapes, config=config if check_config else None)
    except Exception as e:  # noqa: BLE001  (re-raised by _agree, on every rank)
        error = e
    _agree(group, error, f"read checkpoint {path!r}")
    module.load_params(params)
