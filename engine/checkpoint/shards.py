"""Safetensors shards of a checkpoint directory: headers parsed and checked, tensors read lazily.

A checkpoint directory holds ``config.json`` and safetensors shards, with or without
``model.safetensors.index.json``. ``scan_checkpoint`` parses every shard header (no tensor data)
and ``validate_layout`` compares what they hold with ``engine.checkpoint.layout``; any missing,
extra, mis-shaped or mis-typed tensor, or a truncated shard, raises ``CheckpointError`` with one
line naming the tensor (or shard) and expected vs found. ``ShardReader`` then reads one tensor (or
one slice of it) at a time through ``safetensors.safe_open``.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.checkpoint.layout import TensorSpec

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint directory does not hold what its config.json describes (one-line message)."""


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lives: shard file, safetensors dtype string, shape, and its data's byte
    offset in the file (0 when not known)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        """Stored bytes (0 for a dtype safetensors does not size)."""
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 0)


DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_shard_header(path: Path) -> dict[str, StoredTensor]:
    """Parse one safetensors header and check its tensors tile the data section exactly.

    Raises:
        CheckpointError: unreadable or malformed header, truncated file, overlapping data or
            trailing bytes (naming the shard, and the tensor where there is one).
    """
    size = path.stat().st_size
    bad = f"checkpoint: shard {path.name}"
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{bad} is truncated ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{bad} is truncated (header of {n} bytes, file {size})")
        try:
            meta = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{bad} has an unreadable safetensors header") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{bad} has a safetensors header that is not a JSON object")
    extra = meta.pop("__metadata__", {})
    if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
        raise CheckpointError(f"{bad} has a malformed __metadata__ entry (expected string values)")
    data_len = size - 8 - n
    out: dict[str, StoredTensor] = {}
    spans = []
    for name, info in meta.items():
        begin, end = _parse_entry(bad, name, info)
        if end > data_len:
            raise CheckpointError(f"{bad} is truncated: tensor '{name}' ends at byte {8 + n + end}, file has {size}")
        spans.append((begin, end, name))
        out[name] = StoredTensor(path.name, info["dtype"], tuple(info["shape"]), 8 + n + begin)
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise CheckpointError(f"{bad}: tensor '{name}' data starts at offset {begin}, expected {pos} "
                                  "(overlapping or non-contiguous tensors)")
        pos = end
    if pos != data_len:
        raise CheckpointError(f"{bad} has {data_len - pos} unexpected bytes after its last tensor")
    return out


def _parse_entry(bad: str, name: str, info) -> tuple[int, int]:
    """(begin, end) data offsets of one header entry, checked against its dtype and shape."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        ok = (isinstance(dtype, str) and isinstance(shape, list) and isinstance(begin, int) and isinstance(end, int)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) and 0 <= begin <= end)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{bad} has a malformed header entry for tensor '{name}' "
                              "(expected dtype, shape and data_offsets [begin, end])")
    if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise CheckpointError(f"{bad}: tensor '{name}' spans {end - begin} bytes, but {dtype} {shape} needs "
                              f"{math.prod(shape) * DTYPE_BYTES[dtype]}")
    return begin, end


def shard_files(ckpt: Path) -> tuple[list[str], dict[str, str] | None]:
    """The shard file names the checkpoint's weights are read from (sorted): the index's
    (``model.safetensors.index.json``) when there is one, else every ``*.safetensors``; and the
    index's weight_map (None without an index).

    Raises:
        CheckpointError: a malformed index, or no shards.
    """
    index_path = ckpt / INDEX_FILE
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise CheckpointError(f"checkpoint: {INDEX_FILE} has no valid 'weight_map'") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v.endswith(".safetensors")
                                                       and "/" not in v for v in weight_map.values()):
            raise CheckpointError(f"checkpoint: {INDEX_FILE} 'weight_map' must map tensor names to shard file names")
        if not weight_map:
            raise CheckpointError(f"checkpoint: {INDEX_FILE} 'weight_map' lists no tensors")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint: no *.safetensors shards in {ckpt}")
    return shards, weight_map


def scan_checkpoint(ckpt: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint directory, from its index (if any) and shard headers.

    Raises:
        CheckpointError: no shards, a malformed index, an index naming a missing shard or a tensor
            its shard lacks, or a tensor stored in two shards.
    """
    shards, weight_map = shard_files(ckpt)
    found: dict[str, StoredTensor] = {}
    for shard in shards:
        path = ckpt / shard
        if not path.is_file():
            raise CheckpointError(f"checkpoint: shard {shard} named in {INDEX_FILE} is missing")
        for name, t in read_shard_header(path).items():
            if name in found:
                raise CheckpointError(f"checkpoint: tensor '{name}' is stored in both {found[name].file} and {shard}")
            found[name] = t
    for name, shard in (weight_map or {}).items():
        if name not in found or found[name].file != shard:
            raise CheckpointError(f"checkpoint: tensor '{name}' is listed in {INDEX_FILE} under {shard} "
                                  f"but that shard does not hold it")
    return found


def validate_layout(expected: dict[str, TensorSpec], found: dict[str, StoredTensor]) -> None:
    """Compare the stored tensors with the layout the config implies.

    Raises:
        CheckpointError: first problem (missing, dtype, shape, then extra) plus a count of the rest.
    """
    problems: list[str] = []
    for name, spec in expected.items():
        got = found.get(name)
        if got is None:
            problems.append(f"tensor '{name}' is missing (expected {spec.dtype} {list(spec.shape)})")
        elif got.dtype != spec.dtype:
            problems.append(f"tensor '{name}' has dtype {got.dtype}, expected {spec.dtype} ({got.file})")
        elif got.shape != spec.shape:
            problems.append(f"tensor '{name}' has shape {list(got.shape)}, expected {list(spec.shape)} ({got.file})")
    for name in sorted(set(found) - set(expected)):
        problems.append(f"unexpected tensor '{name}' ({found[name].dtype} {list(found[name].shape)}, "
                        f"{found[name].file}) is not part of the layout config.json describes")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint: {problems[0]}{more}")


class ShardReader:
    """Reads single tensors of a checkpoint, opening shards lazily (a context manager).

    ``max_open`` bounds the shards kept open (their memory-mapped pages count as resident);
    None keeps every shard open until exit.
    """

    def __init__(self, ckpt: Path, found: dict[str, StoredTensor], max_open: int | None = None):
        self.ckpt, self.found, self.max_open, self.handles = ckpt, found, max_open, {}

    def get(self, name: str, cuts: tuple = ()) -> torch.Tensor:
        """The tensor ``name``, or only its slice ``cuts`` ((dim, first, length), ...: the
        other bytes are not read). Raises CheckpointError when its shard cannot be read."""
        file = self.found[name].file
        try:
            if file not in self.handles:
                if self.max_open is not None and len(self.handles) >= self.max_open:
                    self.handles.pop(next(iter(self.handles))).__exit__(None, None, None)
                self.handles[file] = safe_open(str(self.ckpt / file), framework="pt").__enter__()
            if cuts:
                index = [slice(None)] * len(self.found[name].shape)
                for d, lo, n in cuts:
                    index[d] = slice(lo, lo + n)
                return self.handles[file].get_slice(name)[tuple(index)]
            return self.handles[file].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"checkpoint: shard {file}: tensor '{name}' cannot be read: {e}") from None

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles.values():
            h.__exit__(None, None, None)
        self.handles.clear()
