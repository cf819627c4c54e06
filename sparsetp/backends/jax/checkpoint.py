"""Save and load the JAX block's (or GPT's) parameters as one safetensors checkpoint.

The file is :mod:`sparsetp.core.checkpoint`'s: canonical UNSHARDED parameters, so a checkpoint
written by the torch frontend at one tensor-parallel size loads here onto a mesh of any size
(:func:`load` shards it with :func:`~sparsetp.backends.jax.block.shard_params`), and back.
A GPT's canonical params go the same way with a ``GPTConfig`` (sharded by
:func:`~sparsetp.backends.jax.model.shard_gpt_params`); the config is recorded and checked.

>>> from sparsetp.jax import checkpoint, make_mesh                   # doctest: +SKIP
>>> params = checkpoint.load("block.safetensors", cfg, mesh=make_mesh(4))   # sharded 4 ways
>>> checkpoint.save(params, "block2.safetensors", cfg)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from sparsetp.backends.jax.block import _check_params, export_params, load_params, shard_params
from sparsetp.backends.jax.model import load_gpt_params, shard_gpt_params
from sparsetp.core.checkpoint import config_param_shapes, load_checkpoint, save_checkpoint
from sparsetp.core.config import HybridConfig
from sparsetp.core.model import GPTConfig, check_gpt_params

__all__ = ["save", "load"]


def _gather(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    if jax.process_count() == 1:
        return export_params(params)  # device_get gathers the shards of each array
    # Multi-process: a sharded array is not fully addressable by one process; every process
    # takes part in the all-gather (not exercised by the CPU tests: one process there).
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return {n: np.array(multihost_utils.process_allgather(a, tiled=True))
            for n, a in params.items()}


def _check_config(config) -> None:
    if not isinstance(config, (HybridConfig, GPTConfig)):
        raise ValueError(f"config must be a HybridConfig or a GPTConfig, got "
                         f"{type(config).__name__}")


def save(params: Mapping[str, Any], path, config: HybridConfig | GPTConfig, *,
         metadata: Mapping[str, str] | None = None, dtype: str | None = None) -> None:
    """Write canonical ``params`` (unsharded or sharded JAX arrays, or numpy) and ``config``
    (a block's ``HybridConfig``, or a GPT's ``GPTConfig`` with its ``embed.weight``, ...).

    Tensors are stored in their own dtype (JAX float32 parameters of a bfloat16 config stay
    float32: the block casts when it computes, and they may be master weights), or in ``dtype``
    when given, which must be exact (``dtype=cfg.dtype`` on bfloat16-valued params stores
    ``BF16``). Under multi-process JAX every process calls it and process 0 writes; every
    process raises if the write failed.
    """
    _check_config(config)
    # Names, shapes (and a block's dtypes): a clear error before any gather.
    if isinstance(config, GPTConfig):
        check_gpt_params(params, config)
    else:
        _check_params(params, config)
    arrays = _gather(params)
    error = None
    if jax.process_index() == 0:
        try:
            save_checkpoint(path, arrays, config=config, metadata=metadata, dtype=dtype)
        except Exception as e:  # noqa: BLE001  (re-raised below, after the other processes know)
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        failed = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
        if error is None and int(failed):
            raise RuntimeError(f"process 0 failed to write checkpoint {path!r}")
    if error is not None:
        raise error


def load(path, config: HybridConfig | GPTConfig, *, mesh: jax.sharding.Mesh | None = None,
         axis_name: str = "tp", check_config: bool = True) -> dict[str, jax.Array]:
    """Read checkpoint ``path`` as the canonical JAX params of ``config`` (a ``HybridConfig``,
    or a ``GPTConfig``: the GPT's params, sharded with :func:`shard_gpt_params`).

    With ``mesh``, each array is placed split on its ``partition_dim`` over ``axis_name`` (any
    TP size dividing the heads and ``d_ff``); without, unsharded on the default device. The
    whole file is validated first (names, shapes, dtypes, checksums and, with
    ``check_config``, every config field): a ValueError lists every problem. Values are kept
    bit for bit; ``BF16`` tensors come back as float32 (exact; the block casts to
    ``config.dtype`` when it computes).
    """
    _check_config(config)
    params = load_checkpoint(path, config_param_shapes(config),
                             config=config if check_config else None)
    if isinstance(config, GPTConfig):
        if mesh is None:
            return load_gpt_params(params, config)
        return shard_gpt_params(params, config, mesh, axis_name)
    if mesh is None:
        return load_params(params, config)
    return shard_params(params, config, mesh, axis_name)
