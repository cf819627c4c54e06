"""Checkpoints both frontends read: one safetensors file of canonical UNSHARDED parameters.

The file holds a flat ``{name: array}`` dict under the canonical names (for a block, those of
:func:`sparsetp.core.config.param_shapes`: ``ln1.weight``, ``attn.qkv.weight`` ...), never a
rank's shard, so a checkpoint written by a torch run of one tensor-parallel size loads into a
JAX run of another (each loader shards it itself). Nothing here knows a block: any flat dict of
names and an expected ``{name: shape}`` spec works (a model's ``embed.weight``,
``blocks.0.ln1.weight`` ... too).

Format decisions:

* **Dtypes.** Tensors are stored as ``F16``, ``BF16``, ``F32`` or ``F64`` (floating only).
  :func:`save_checkpoint` keeps each array's own dtype, or converts to ``dtype=`` **only when
  the conversion is exact** (a ValueError lists the tensors that would round), so a file never
  holds other numbers than the ones saved. bfloat16: numpy has no bfloat16 dtype (without
  ``ml_dtypes``), and the frontends' ``export_params`` hand out a bfloat16 block's parameters as
  float32 (exact); ``save_checkpoint(..., dtype="bfloat16")`` stores those as ``BF16`` (half the
  bytes; the dtype safetensors' torch/JAX loaders give back), and :func:`load_checkpoint`
  returns ``BF16`` tensors as float32 (exact: the bfloat16 bits followed by 16 zero bits).
  ml_dtypes ``bfloat16`` arrays (what ``np.asarray`` of a JAX bfloat16 array is) are accepted
  too. So ``load_checkpoint(save_checkpoint(p))`` returns ``p`` bitwise (bfloat16: as float32).
* **Metadata** (safetensors' string-to-string header ``__metadata__``):
  ``sparsetp.format`` (``"1"``); ``sparsetp.sha256``, a JSON object ``{name: sha256 of the
  stored bytes}`` in the order the tensors were given (safetensors itself has no checksum: this
  is what catches a flipped byte, and the order :func:`load_checkpoint` returns the tensors in);
  ``sparsetp.config``, the config as JSON when one is given (:func:`config_to_json`: every
  dataclass field, the attention pattern as its constructor fields, so the file says exactly
  which block or model it holds and :func:`checkpoint_info` rebuilds the ``HybridConfig`` or
  ``GPTConfig``: a GPT's file holds ``embed.weight``, ``blocks.0.ln1.weight`` ...); and the
  caller's own ``metadata`` (string keys not starting with ``sparsetp.``, string values).
* **Atomic writes.** The file is written under a temporary name in the same directory, flushed
  to disk, then renamed over ``path``: a crash leaves the old file or the new one, never half.
* **Loads validate everything before returning anything**: missing, unexpected and mis-shaped
  tensors, non-floating or unwanted dtypes and a config mismatch are all listed in one
  ValueError naming the file; then the data are read and checked against the checksums.

>>> import os, tempfile
>>> from sparsetp.core import HybridConfig, init_params, patterns as P
>>> cfg = HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=P.causal(), block_size=32)
>>> path = os.path.join(tempfile.mkdtemp(), "block.safetensors")
>>> save_checkpoint(path, init_params(cfg, seed=0), config=cfg)
>>> params = load_checkpoint(path, config=cfg)      # shapes default to param_shapes(cfg)
>>> params["attn.qkv.weight"].shape, checkpoint_info(path).config == cfg
((32, 96), True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparsetp.core import patterns as _patterns
from sparsetp.core.config import HybridConfig, param_shapes
from sparsetp.core.model import GPTConfig, gpt_param_shapes

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_info", "CheckpointInfo",
           "config_to_json", "config_from_json", "config_param_shapes", "config_dtype",
           "STORAGE_DTYPES", "FORMAT_VERSION"]

FORMAT_VERSION = "1"
_PREFIX = "sparsetp."
_FORMAT_KEY, _DIGEST_KEY, _CONFIG_KEY = (_PREFIX + k for k in ("format", "sha256", "config"))

# numpy dtype name -> safetensors dtype tag, and the little-endian numpy dtype of the stored bytes
# (bfloat16 has none: its bytes are read and written as uint16 bit patterns).
STORAGE_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
_TAG_TO_NAME = {tag: name for name, tag in STORAGE_DTYPES.items()}
_STORED_NP = {"F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8"}
# Config types checkpoint_info can rebuild from their JSON (patterns come from core.patterns).
_CONFIG_TYPES = {"HybridConfig": HybridConfig, "GPTConfig": GPTConfig}


def config_param_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The canonical ``{name: shape}`` of a known config: a block's
    (:func:`~sparsetp.core.config.param_shapes`) or a GPT's
    (:func:`~sparsetp.core.model.gpt_param_shapes`); ValueError for anything else."""
    if isinstance(config, HybridConfig):
        return param_shapes(config)
    if isinstance(config, GPTConfig):
        return gpt_param_shapes(config)
    raise ValueError(f"config must be a HybridConfig or a GPTConfig, got "
                     f"{type(config).__name__}")


def config_dtype(config: Any) -> str:
    """The dtype a known config computes in: ``config.dtype``, a GPT's ``config.block.dtype``."""
    if isinstance(config, GPTConfig):
        return config.block.dtype
    if isinstance(config, HybridConfig):
        return config.dtype
    raise ValueError(f"config must be a HybridConfig or a GPTConfig, got "
                     f"{type(config).__name__}")




def _safetensors():
    """The safetensors module, imported on first use: ``import sparsetp.core`` must keep working
    where it is not installed (a machine that only runs kernels), and a checkpoint call there
    says what to install instead of failing at import time."""
    try:
        import safetensors  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("sparsetp checkpoints need safetensors: pip install "
                          "'safetensors>=0.8,<0.9' (a dependency of sparsetp)") from e
    return safetensors


# ---------------------------------------------------------------------------------------------
# Configs as JSON


def _encode(value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _encode(getattr(value, f.name), f"{where}.{f.name}")
                  for f in dataclasses.fields(value) if f.init}
        return {"type": type(value).__name__, "fields": fields}
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        # json writes floats with repr(), which round-trips every float64 exactly.
        return float(value)
    if isinstance(value, (tuple, list)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(f"config field {where} = {value!r} ({type(value).__name__}) has no JSON "
                     "form (dataclasses, patterns, numbers, strings, None and tuples do)")


def config_to_json(config: Any) -> str:
    """``config`` (a dataclass such as :class:`~sparsetp.core.config.HybridConfig`) as canonical
    JSON: ``{"type": class name, "fields": {...}}``, the pattern likewise (its constructor
    fields: ``Causal(left=None, right=0)`` is ``{"type": "Causal", "fields": {"left": null,
    "right": 0}}``; unions nest their parts). Equal configs give equal strings.

    >>> from sparsetp.core import HybridConfig, patterns as P
    >>> cfg = HybridConfig(32, 2, 64, P.local(3, 0) | P.causal())
    >>> config_from_json(config_to_json(cfg)) == cfg
    True
    """
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise ValueError(f"config must be a dataclass instance (e.g. a HybridConfig), got "
                         f"{type(config).__name__}")
    return json.dumps(_encode(config, type(config).__name__), sort_keys=True,
                      separators=(",", ":"), allow_nan=False)


def _decode(value: Any, types: Mapping[str, type]) -> Any:
    if isinstance(value, list):  # every sequence field of a pattern or config is a tuple
        return tuple(_decode(v, types) for v in value)
    if not isinstance(value, dict):
        return value
    if set(value) != {"type", "fields"} or not isinstance(value["fields"], dict):
        raise ValueError(f"not an encoded dataclass: {value!r}")
    name = value["type"]
    cls = types.get(name)
    if cls is None:
        cls = getattr(_patterns, name, None)
        if not (isinstance(cls, type) and issubclass(cls, _patterns.Pattern)):
            raise ValueError(f"unknown config or pattern type {name!r} (known configs: "
                             f"{sorted(types)}; patterns: sparsetp.core.patterns)")
    return cls(**{k: _decode(v, types) for k, v in value["fields"].items()})


def config_from_json(text: str, types: Mapping[str, type] | None = None) -> Any:
    """Inverse of :func:`config_to_json`. ``types``: extra config classes by name (a model's
    config, say); ``HybridConfig`` and every pattern class are known already."""
    known = dict(_CONFIG_TYPES, **(types or {}))
    try:
        return _decode(json.loads(text), known)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"cannot rebuild a config from {text[:200]!r}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Arrays


def _dtype_name(a: np.ndarray) -> str | None:
    """The storage dtype name of a numpy array, or None if it is not a float we store."""
    name = a.dtype.name
    if name == "bfloat16" and a.dtype.itemsize == 2:  # ml_dtypes (np.asarray of a JAX array)
        return name
    return name if name in STORAGE_DTYPES else None


def _widen(a: np.ndarray, kind: str) -> np.ndarray:
    """``a`` as a numpy float array (ml_dtypes bfloat16 as float32: exact) in native order."""
    if kind == "bfloat16":
        return _bf16_bits_to_f32(a.view(np.uint16))
    return np.asarray(a, a.dtype.newbyteorder("="))


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    # bfloat16 is the top half of a float32: shifting the bits up gives the same value exactly.
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    u = np.dtype(f"u{a.dtype.itemsize}")
    return a.dtype == b.dtype and np.array_equal(a.view(u), b.view(u))


def _to_storage(wide: np.ndarray, target: str) -> np.ndarray | None:
    """``wide`` as the little-endian array of ``target``'s stored bytes, or None when the
    conversion would change a value (we never round on save)."""
    if target == "bfloat16":
        f32 = wide.astype(np.float32)
        bits = f32.view(np.uint32)
        if not _same_bits(f32.astype(wide.dtype), wide) or (bits & 0xFFFF).any():
            return None
        return np.ascontiguousarray((bits >> 16).astype("<u2"))
    out = wide.astype(np.dtype(target))
    if not _same_bits(out.astype(wide.dtype), wide):
        return None
    return np.ascontiguousarray(out, dtype=_STORED_NP[STORAGE_DTYPES[target]])


def _check_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable (POSIX); platforms that cannot open a directory skip it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path, params: Mapping[str, Any], *, config: Any = None,
                    metadata: Mapping[str, str] | None = None, dtype: str | None = None) -> None:
    """Write ``params`` (canonical unsharded ``{name: array}``) to the safetensors file ``path``.

    Args:
      path: the file to write (its directory must exist); replaced atomically.
      params: names to float arrays (numpy, or anything ``np.asarray`` reads: JAX arrays, CPU
        torch float tensors; ml_dtypes bfloat16 arrays as ``BF16``).
      config: optional dataclass (a ``HybridConfig``, a ``GPTConfig``) recorded as JSON so that
        ``load_checkpoint(..., config=...)`` can check it.
      metadata: optional extra ``{str: str}`` for the header (keys not ``sparsetp.*``).
      dtype: store every tensor in this dtype (one of ``STORAGE_DTYPES``) instead of its own;
        only exact conversions are allowed (float32 values of a bfloat16 block to ``BF16``, say).

    Raises ValueError naming the argument for anything malformed, listing every tensor that is
    not floating or not exactly representable in ``dtype``; nothing is written then.

    >>> save_checkpoint(path, block.export_params(), config=cfg, dtype=cfg.dtype)  # doctest: +SKIP
    """
    path = _check_path(path)
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"params must be a non-empty dict of name -> array, got "
                         f"{type(params).__name__}" + (" (empty)" if isinstance(params, Mapping)
                                                       else ""))
    if dtype is not None and dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be None or one of {tuple(STORAGE_DTYPES)}, got {dtype!r}")
    meta = {_FORMAT_KEY: FORMAT_VERSION}
    if config is not None:
        meta[_CONFIG_KEY] = config_to_json(config)
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise ValueError(f"metadata must be a dict of str -> str, got "
                             f"{type(metadata).__name__}")
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"metadata must map str to str; got {k!r}: {v!r}")
            if k.startswith(_PREFIX) or k == "__metadata__":
                raise ValueError(f"metadata key {k!r} is reserved (sparsetp.* keys hold the "
                                 "format, checksums and config)")
        meta.update(metadata)

    stored, digests, problems = {}, {}, []
    for name, value in params.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"params names must be non-empty strings, got {name!r}")
        try:
            a = np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as e:  # e.g. a torch bf16 or CUDA tensor
            problems.append(f"{name}: not readable as a numpy array ({type(value).__name__}: "
                            f"{e}); pass numpy (torch: .float().cpu().numpy())")
            continue
        kind = _dtype_name(a)
        if kind is None:
            problems.append(f"{name}: dtype {a.dtype} is not one of {tuple(STORAGE_DTYPES)}")
            continue
        target = dtype or kind
        data = _to_storage(_widen(a, kind), target)
        if data is None:
            problems.append(f"{name}: {kind} values not exactly representable in {target}")
            continue
        stored[name] = (STORAGE_DTYPES[target], data)
        digests[name] = hashlib.sha256(data.tobytes()).hexdigest()
    if problems:
        raise ValueError(f"cannot save checkpoint {path!r}: " + "; ".join(problems))
    # No sort_keys: the object's order is the order the tensors were given (load returns it).
    meta[_DIGEST_KEY] = json.dumps(digests, separators=(",", ":"))
    # TensorSpec takes numpy-style names ("bfloat16", "float32"); the header then says "BF16" ...
    st = _safetensors()
    specs = {name: st.TensorSpec(dtype=_TAG_TO_NAME[tag], shape=data.shape,
                                 data_ptr=data.ctypes.data, data_len=data.nbytes)
             for name, (tag, data) in stored.items()}

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save checkpoint {path!r}: directory {directory!r} does "
                                "not exist")
    if os.path.isdir(path):
        raise ValueError(f"path {path!r} is a directory; give a file name")
    # A unique name beside the target (same file system, so the rename is atomic); created by
    # serialize_file with the process's usual permissions.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                  f"{secrets.token_hex(4)}.tmp")
    try:
        st.serialize_file(specs, tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


# ---------------------------------------------------------------------------------------------
# Reading


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint's header says, read without its data (:func:`checkpoint_info`).

    ``tensors``: ``{name: (dtype name, shape)}`` in the saved order; ``config``: the rebuilt
    config (None if none was recorded); ``config_json``: its JSON as stored; ``metadata``: the
    caller's own metadata (``sparsetp.*`` keys removed); ``format``: the format version.
    """

    path: str
    tensors: dict
    config: Any
    config_json: str | None
    metadata: dict
    format: str | None


def _read_header(path: str) -> tuple[dict, dict, dict]:
    """``(tensors {name: (tag, shape)}, offsets {name: (begin, end)} absolute, metadata)``.

    safetensors' own reader validates the file (header JSON, offsets that tile the data
    exactly, the file size) without reading the data; the byte offsets (which its API does not
    expose) come from parsing the same header, which is what lets BF16 be read without
    ml_dtypes."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"path {path!r} is a directory, not a checkpoint file")
    st = _safetensors()
    try:
        with st.safe_open(path, framework="np") as f:
            meta = dict(f.metadata() or {})
            tensors = {}
            for name in f.keys():
                s = f.get_slice(name)
                tensors[name] = (s.get_dtype(), tuple(int(d) for d in s.get_shape()))
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
    except (st.SafetensorError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint {path!r} is not a valid safetensors file (truncated or "
                         f"corrupt?): {e}") from e
    base = 8 + n
    offsets = {k: (base + v["data_offsets"][0], base + v["data_offsets"][1])
               for k, v in header.items() if k != "__metadata__"}
    if set(offsets) != set(tensors):  # replaced between the two reads
        raise ValueError(f"checkpoint {path!r} changed while it was being read; retry")
    return tensors, offsets, meta


def _saved_order(meta: dict, names) -> tuple[list[str], dict | None]:
    raw = meta.get(_DIGEST_KEY)
    if raw is None:
        return sorted(names), None
    try:
        digests = json.loads(raw)
    except json.JSONDecodeError:
        digests = None
    if not isinstance(digests, dict):
        raise ValueError(f"corrupt {_DIGEST_KEY} metadata: {raw[:200]!r}")
    return list(digests), digests


def checkpoint_info(path, types: Mapping[str, type] | None = None) -> CheckpointInfo:
    """The header of checkpoint ``path``: tensor names, dtypes and shapes, config, metadata.

    Reads no tensor data. ``types``: extra config classes :func:`config_from_json` may need.

    >>> checkpoint_info("block.safetensors").config                      # doctest: +SKIP
    HybridConfig(d_model=32, num_heads=2, d_ff=64, pattern=Causal(left=None, right=0), ...)
    """
    path = _check_path(path)
    tensors, _, meta = _read_header(path)
    try:
        order, _ = _saved_order(meta, tensors)
    except ValueError as e:
        raise ValueError(f"checkpoint {path!r}: {e}") from e
    order = [n for n in order if n in tensors] + sorted(set(tensors) - set(order))
    cfg_json = meta.get(_CONFIG_KEY)
    cfg = None
    if cfg_json is not None:
        try:
            cfg = config_from_json(cfg_json, types)
        except (ValueError, TypeError) as e:
            raise ValueError(f"checkpoint {path!r}: cannot rebuild its config: {e}") from e
    return CheckpointInfo(
        path=path,
        tensors={n: (_TAG_TO_NAME.get(tensors[n][0], tensors[n][0]), tensors[n][1])
                 for n in order},
        config=cfg, config_json=cfg_json,
        metadata={k: v for k, v in meta.items() if not k.startswith(_PREFIX)},
        format=meta.get(_FORMAT_KEY))


def _config_diff(saved_json: str, config: Any) -> list[str]:
    """``field: file X, expected Y`` for every field that differs; a nested config (a GPT's
    ``block``) is compared field by field (``block.d_ff: file 64, expected 128``), a pattern as
    a whole."""
    saved, want = json.loads(saved_json), json.loads(config_to_json(config))

    def show(v):
        try:
            return repr(_decode(v, _CONFIG_TYPES))
        except (ValueError, TypeError):
            return json.dumps(v)

    def diff(saved, want, prefix):
        if saved.get("type") != want["type"]:
            return [f"{prefix}type: file {saved.get('type')!r}, expected {want['type']!r}"]
        a, b = saved.get("fields", {}), want["fields"]
        out = []
        for k in sorted(set(a) | set(b)):
            x, y = a.get(k), b.get(k)
            if x == y:
                continue
            if (isinstance(x, dict) and isinstance(y, dict) and y.get("type") in _CONFIG_TYPES
                    and isinstance(x.get("fields"), dict)):
                out += diff(x, y, f"{prefix}{k}.")
            else:
                out.append(f"{prefix}{k}: file {show(x)}, expected {show(y)}")
        return out

    return diff(saved, want, "")


def load_checkpoint(path, shapes: Mapping[str, tuple] | None = None, *, config: Any = None,
                    dtype: str | None = None) -> dict[str, np.ndarray]:
    """Read checkpoint ``path`` as ``{name: numpy array}``, validating everything first.

    Args:
      path: a file :func:`save_checkpoint` (or any safetensors writer) wrote.
      shapes: the expected ``{name: shape}``; the file must hold exactly these names with these
        shapes. None: :func:`config_param_shapes` when ``config`` is a ``HybridConfig`` or a
        ``GPTConfig``, else any.
      config: if given, the file must record this config (every field equal; the error names
        the fields that differ).
      dtype: if given, every tensor must be stored in it (a ``STORAGE_DTYPES`` name).

    Returns fresh writable arrays in ``shapes`` order (else the saved order), each in its
    stored dtype, except ``BF16`` which comes back as float32 (exact; numpy has no bfloat16).

    Raises FileNotFoundError for a missing file; ValueError naming the file for one that is not
    a valid safetensors file (truncated, garbage), fails its checksums, or does not match:
    every missing, unexpected, mis-shaped or wrongly typed tensor and every differing config
    field in ONE message. Nothing is returned unless everything is right.
    """
    path = _check_path(path)
    if dtype is not None and dtype not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be None or one of {tuple(STORAGE_DTYPES)}, got {dtype!r}")
    if shapes is None and isinstance(config, (HybridConfig, GPTConfig)):
        shapes = config_param_shapes(config)
    if shapes is not None:
        if not isinstance(shapes, Mapping):
            raise ValueError(f"shapes must be a dict of name -> shape tuple, got "
                             f"{type(shapes).__name__}")
        try:
            shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"shapes must map names to shape tuples of ints, got "
                             f"{dict(shapes)!r}") from e
    if config is not None:
        config_to_json(config)  # a ValueError naming config before the file is touched

    tensors, offsets, meta = _read_header(path)
    problems = []
    if config is not None:
        saved = meta.get(_CONFIG_KEY)
        if saved is None:
            problems.append("it records no config (load it with config=None to skip the check)")
        else:
            try:
                diff = _config_diff(saved, config)
            except (json.JSONDecodeError, AttributeError) as e:
                diff = [f"unreadable config metadata ({e})"]
            if diff:
                problems.append("config differs: " + "; ".join(diff))
    if shapes is not None:
        missing = [n for n in shapes if n not in tensors]
        unexpected = sorted(n for n in tensors if n not in shapes)
        misshaped = [f"{n} {tensors[n][1]} (expected {shapes[n]})" for n in shapes
                     if n in tensors and tensors[n][1] != shapes[n]]
        for what, names in (("missing tensors", missing), ("unexpected tensors", unexpected),
                            ("mis-shaped tensors", misshaped)):
            if names:
                problems.append(f"{what}: {', '.join(names)}")
    bad_dtype = [f"{n} {tag}" for n, (tag, _) in sorted(tensors.items()) if tag not in _STORED_NP]
    if bad_dtype:
        problems.append(f"non-floating tensors (F16/BF16/F32/F64 only): {', '.join(bad_dtype)}")
    if dtype is not None:
        want = STORAGE_DTYPES[dtype]
        wrong = [f"{n} {tag}" for n, (tag, _) in sorted(tensors.items())
                 if tag in _STORED_NP and tag != want]
        if wrong:
            problems.append(f"tensors not stored as {dtype} ({want}): {', '.join(wrong)}")
    try:
        order, digests = _saved_order(meta, tensors)
    except ValueError as e:
        problems.append(str(e))
        order, digests = sorted(tensors), None
    if digests is not None and set(digests) != set(tensors):
        problems.append(f"corrupt {_DIGEST_KEY} metadata: its names differ from the tensors'")
    if problems:
        raise ValueError(f"checkpoint {path!r} does not match: " + "; ".join(problems))

    names = list(shapes) if shapes is not None else order
    out, corrupt = {}, []
    with open(path, "rb") as fh:
        for name in names:
            tag, shape = tensors[name]
            begin, end = offsets[name]
            fh.seek(begin)
            buf = bytearray(end - begin)
            if fh.readinto(buf) != len(buf):
                raise ValueError(f"checkpoint {path!r} is truncated (tensor {name})")
            if digests is not None and hashlib.sha256(buf).hexdigest() != digests[name]:
                corrupt.append(name)
                continue
            a = np.frombuffer(buf, _STORED_NP[tag]).reshape(shape)
            a = _bf16_bits_to_f32(a) if tag == "BF16" else a.astype(a.dtype.newbyteorder("="),
                                                                     copy=False)
            out[name] = a
    if corrupt:
        raise ValueError(f"checkpoint {path!r} is corrupt: the bytes of {', '.join(corrupt)} do "
                         f"not match their sha256 in the header")
    return out
