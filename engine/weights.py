"""Checkpoint loading: validate the original layout, then fill the model tensor by tensor.

A checkpoint directory holds ``config.json`` and safetensors shards, with or without
``model.safetensors.index.json``. Before any weight is read, every shard header is parsed and
compared with ``engine.checkpoint.checkpoint_layout``; any missing, extra, mis-shaped or
mis-typed tensor, or a truncated shard, raises ``CheckpointError`` with one line naming the
tensor (or shard) and expected vs found. Tensors are then read lazily (one at a time, through
``safetensors.safe_open``), dequantised (FP8 block / MXFP4, reference §2.1) and copied into the
model's compute dtype.
"""
from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.checkpoint import LinearSpec, TensorSpec, checkpoint_layout, model_linears
from engine.config import ModelArgs
from engine.model.transformer import Transformer
from engine.ops import REFERENCE, Ops
from engine.quant import QuantFormatError, dequant_fp8_block, dequant_mxfp4

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint directory does not hold what its config.json describes (one-line message)."""


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lives: shard file, safetensors dtype string, shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]


def read_shard_header(path: Path) -> dict[str, StoredTensor]:
    """Parse one safetensors header and check the file holds all the bytes it promises.

    Raises:
        CheckpointError: unreadable header, or the file is shorter than its tensors' extent.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"checkpoint: shard {path.name} is truncated ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"checkpoint: shard {path.name} is truncated (header of {n} bytes, file {size})")
        try:
            meta = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"checkpoint: shard {path.name} has an unreadable safetensors header") from None
    out: dict[str, StoredTensor] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        end = 8 + n + int(info["data_offsets"][1])
        if end > size:
            raise CheckpointError(f"checkpoint: shard {path.name} is truncated: tensor '{name}' ends at byte {end}, "
                                  f"file has {size}")
        out[name] = StoredTensor(path.name, info["dtype"], tuple(info["shape"]))
    return out


def scan_checkpoint(ckpt: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint directory, from its index (if any) and shard headers.

    Raises:
        CheckpointError: no shards, an index naming a missing shard or a tensor its shard lacks.
    """
    index_path = ckpt / INDEX_FILE
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"checkpoint: {INDEX_FILE} has no valid 'weight_map'") from None
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint: no *.safetensors shards in {ckpt}")
    found: dict[str, StoredTensor] = {}
    for shard in shards:
        path = ckpt / shard
        if not path.is_file():
            raise CheckpointError(f"checkpoint: shard {shard} named in {INDEX_FILE} is missing")
        found.update(read_shard_header(path))
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


class _Reader:
    """Opens shards lazily and returns single tensors."""

    def __init__(self, ckpt: Path, found: dict[str, StoredTensor], stack: ExitStack):
        self.ckpt, self.found, self.stack, self.handles = ckpt, found, stack, {}

    def get(self, name: str) -> torch.Tensor:
        file = self.found[name].file
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(str(self.ckpt / file), framework="pt"))
        return self.handles[file].get_tensor(name)


def _target(model: Transformer, name: str) -> tuple[torch.Tensor, int | None]:
    """Model tensor for checkpoint tensor ``name`` (stacked experts: tensor and expert index)."""
    parts = name.split(".")
    if ".experts." in name and parts[-2] in ("w1", "w2", "w3") and parts[-3].isdigit():
        stacked = ".".join(parts[:-3] + [parts[-2]])
        return model.get_parameter(stacked), int(parts[-3])
    try:
        return model.get_parameter(name), None
    except AttributeError:
        return model.get_buffer(name), None


def _dequant(name: str, lin: LinearSpec, reader: _Reader, args: ModelArgs) -> torch.Tensor:
    w = reader.get(f"{name}.weight")
    try:
        if lin.kind == "fp8":
            return dequant_fp8_block(w, reader.get(f"{name}.scale"), args.quant.weight_block_size)
        if lin.kind == "fp4":
            return dequant_mxfp4(w, reader.get(f"{name}.scale"))
    except QuantFormatError as e:
        raise CheckpointError(f"checkpoint: tensor '{name}.weight': {e}") from None
    return w


def _check_values(name: str, t: torch.Tensor, args: ModelArgs) -> None:
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise CheckpointError(f"checkpoint: tensor '{name}' holds NaN or inf values")
    if name.endswith("tid2eid") and (t.min() < 0 or t.max() >= args.n_routed_experts):
        raise CheckpointError(f"checkpoint: tensor '{name}' has expert ids outside [0, {args.n_routed_experts})")


def load_model(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               ops: Ops = REFERENCE, progress: bool = True) -> Transformer:
    """Read config.json, validate the shards, and return a filled ``Transformer``.

    Args:
        ckpt_dir: checkpoint directory in the original DeepSeek-V4 layout.
        dtype: compute dtype, ``torch.float32`` or ``torch.bfloat16``.
        progress: show a tqdm bar (stderr) while loading.
    Raises:
        ConfigError: bad config.json. CheckpointError: layout or value problems (one line each).
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint: directory {ckpt} does not exist")
    args = ModelArgs.from_json(ckpt)
    found = scan_checkpoint(ckpt)
    validate_layout(checkpoint_layout(args), found)
    model = Transformer(args, dtype, ops)
    linears = model_linears(args)
    covered = {f"{n}.{s}" for n in linears for s in ("weight", "scale")}
    plain = [n for n in found if n not in covered]
    with ExitStack() as stack, torch.no_grad():
        reader = _Reader(ckpt, found, stack)
        bar = tqdm(total=len(linears) + len(plain), desc="loading weights", unit="tensor", disable=not progress)
        for name, lin in linears.items():
            w = _dequant(name, lin, reader, args)
            _check_values(f"{name}.weight", w, args)
            target, idx = _target(model, f"{name}.weight")
            (target[idx] if idx is not None else target).copy_(w)
            bar.update()
        for name in plain:
            t = reader.get(name)
            _check_values(name, t, args)
            target, _ = _target(model, name)
            target.copy_(t)
            bar.update()
        bar.close()
    return model.to(device).eval()
