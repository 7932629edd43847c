"""Checkpoint loading: validate the original layout, then fill the model tensor by tensor.

A checkpoint directory holds ``config.json`` and safetensors shards, with or without
``model.safetensors.index.json``. Before any weight is read, every shard header is parsed and
compared with ``engine.checkpoint.checkpoint_layout``; any missing, extra, mis-shaped or
mis-typed tensor, or a truncated shard, raises ``CheckpointError`` with one line naming the
tensor (or shard) and expected vs found. Tensors are then read lazily (one at a time, through
``safetensors.safe_open``), dequantised (FP8 block / MXFP4, reference §2.1; the converted
int8 / int4 / MXFP8 / MXFP4 / HiF8 layouts of §7) and copied into the model's compute dtype. A
converted linear's activation quantisation (``engine.checkpoint.qscheme.ACT_SCHEME``) is set on its module.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine.checkpoint.fp8_mxfp4 import QuantFormatError, dequant_fp8_block, dequant_mxfp4
from engine.checkpoint.hif8 import hif8_decode
from engine.checkpoint.int8_int4 import dequant_int, int4_bias, u64_to_scale, unpack_int4_rows
from engine.checkpoint.layout import LinearSpec, TensorSpec, checkpoint_layout, linear_tensors, model_linears
from engine.checkpoint.mx import dequant_mx
from engine.checkpoint.qscheme import ACT_SCHEME
from engine.config import ModelArgs
from engine.model.layers import deferred_params, materialize
from engine.model.transformer import Transformer
from engine.ops import REFERENCE, Ops

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint directory does not hold what its config.json describes (one-line message)."""


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lives: shard file, safetensors dtype string, shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]


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
        out[name] = StoredTensor(path.name, info["dtype"], tuple(info["shape"]))
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


def scan_checkpoint(ckpt: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint directory, from its index (if any) and shard headers.

    Raises:
        CheckpointError: no shards, a malformed index, an index naming a missing shard or a tensor
            its shard lacks, or a tensor stored in two shards.
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


def _local(target: torch.Tensor, idx: int | None) -> tuple[torch.Tensor, tuple] | None:
    """Where this rank keeps checkpoint tensor ``target[idx]`` (``idx``: a stacked expert) of a
    model sharded before loading (``shard_cuts``: (dim, first, length) of the full tensor each
    kept; ``engine.parallel.shard``): (destination, cuts of the stored tensor), or None when the
    rank keeps none of it (another EP shard's expert)."""
    cuts = getattr(target, "shard_cuts", ())
    if idx is not None:
        first, n = next(((lo, n) for d, lo, n in cuts if d == 0), (0, target.shape[0]))
        if not first <= idx < first + n:
            return None
        target, cuts = target[idx - first], tuple((d - 1, lo, n) for d, lo, n in cuts if d != 0)
    for d, _, n in cuts:                 # a padded shard (LM head): the stored rows fill its first n
        target = target.narrow(d, 0, n)
    return target, cuts


def narrow_cuts(t: torch.Tensor, cuts: tuple) -> torch.Tensor:
    """``t`` narrowed along each (dim, first, length) of ``cuts`` (a view)."""
    for d, lo, n in cuts:
        t = t.narrow(d, lo, n)
    return t


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


def dequant_linear(name: str, kind: str, get, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Dense fp32 ``[out, in]`` of linear ``name`` stored as ``kind`` (``engine.checkpoint.layout`` kinds).

    Args:
        get: ``tensor name -> torch.Tensor`` (a shard reader).
    Raises:
        QuantFormatError: a scale or int4 bias that does not fit its weight.
    """
    w = get(f"{name}.weight")
    if kind == "bf16":
        return w.float()
    s = get(f"{name}.scale")
    if kind == "fp8":
        return dequant_fp8_block(w, s, block)
    if kind == "fp4":
        return dequant_mxfp4(w, s)
    if kind in ("mxfp8", "mxfp4"):
        return dequant_mx(w, s)
    if kind == "int8":
        return dequant_int(w, s)
    if kind == "hif8":
        return hif8_decode(w) * s.float()
    if kind == "int4":
        q, scale = unpack_int4_rows(w), u64_to_scale(s)
        # upstream computes the bias in bf16: allow 2^-6 of sum_k |8 s q| (a stale or foreign bias is off by O(1))
        tol = (8 * scale.float() * q.float()).abs().sum(1) * 2 ** -6 + 1e-6
        if ((get(f"{name}.bias").float() - int4_bias(q, scale)).abs() > tol).any():
            raise QuantFormatError("int4 assistance bias does not equal sum_k 8 * scale * q (stale or foreign bias)")
        return dequant_int(q, scale)
    raise QuantFormatError(f"unknown storage kind {kind!r}")


def _dequant(name: str, lin: LinearSpec, reader: ShardReader, args: ModelArgs) -> torch.Tensor:
    try:
        return dequant_linear(name, lin.kind, reader.get, args.quant.weight_block_size if args.quant else (128, 128))
    except QuantFormatError as e:
        raise CheckpointError(f"checkpoint: tensor '{name}.weight': {e}") from None


PACKED_KINDS = ("int8", "mxfp8", "hif8")     # can stay as stored on packable Linears (ops.quant_linear)


def packed_kinds(ops: Ops, packed: bool | None) -> tuple[str, ...]:
    """Formats kept as stored: all of ``PACKED_KINDS`` (True), none (False), or by default those the
    ops table has a fused kernel for (int8 when ``ops.quant_linear`` is a platform kernel): the
    reference would dequantise the whole weight on every call, slower than a dense weight."""
    if packed is not None:
        return PACKED_KINDS if packed else ()
    return ("int8",) if ops.quant_linear is not REFERENCE.quant_linear else ()


def _stored_module(model: Transformer, name: str, kind: str, kinds: tuple[str, ...]):
    """The Linear that keeps linear ``name`` as stored, or None (dense weight)."""
    if kind not in kinds or ".experts." in name:
        return None
    mod = model.get_submodule(name)
    return mod if getattr(mod, "packable", False) else None


def _set_act(model: Transformer, name: str, kind: str) -> None:
    """Record the activation quantisation of a converted linear on its module (Linear or Experts)."""
    act = ACT_SCHEME[kind]
    if act is None:
        return
    parts = name.split(".")
    if ".experts." in name and parts[-2].isdigit():
        model.get_submodule(".".join(parts[:-2])).act = act
    else:
        model.get_submodule(name).act = act


def _check_values(name: str, t: torch.Tensor, args: ModelArgs) -> None:
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise CheckpointError(f"checkpoint: tensor '{name}' holds NaN or inf values")
    if name.endswith("tid2eid") and (t.min() < 0 or t.max() >= args.n_routed_experts):
        raise CheckpointError(f"checkpoint: tensor '{name}' has expert ids outside [0, {args.n_routed_experts})")


def stored_args(args: ModelArgs, found: dict[str, StoredTensor]) -> ModelArgs:
    """``args`` with the quant type the stored tensors are in.

    A HiF8 compressed-tensors config reads the same whether ``convert-config --hif`` wrote it over
    the original FP8 tensors or ``convert-model --quant-type w4a8-mx-hif`` wrote it over HiF8 ones
    (reference §1.3, §7); the dtype of the first ``wq_b`` weight tells which.
    """
    q = args.quant
    probe = found.get("layers.0.attn.wq_b.weight")
    if q is not None and q.quant_type == "w4a8-mx-hif" and probe is not None and probe.dtype == "F8_E4M3":
        return dataclasses.replace(args, quant=dataclasses.replace(q, quant_type=None))
    return args


def load_model(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               ops: Ops = REFERENCE, progress: bool = True, packed: bool | None = None,
               shard: Callable[[Transformer], object] | None = None) -> Transformer:
    """Read config.json, validate the shards, and return a filled ``Transformer``.

    Args:
        ckpt_dir: checkpoint directory in the original DeepSeek-V4 layout or a converted one (§7).
        dtype: compute dtype, ``torch.float32`` or ``torch.bfloat16``.
        progress: show a tqdm bar (stderr) while loading.
        packed: keep converted int8 / MXFP8 / HiF8 linears as stored (``packed_kinds``); the
            numerics are the same either way.
        shard: shards the model before any weight is read (e.g. ``engine.parallel.shard.
            apply_parallel`` for one rank): it gets the model with meta parameters (the
            activation quantisation already set); a rank then holds only the slices it keeps
            (``shard_cuts``), never reads another EP shard's experts, and of a bf16 / plain
            tensor reads only its slice (a block-quantised one is read whole, then cut).
    Raises:
        ConfigError: bad config.json, or raised by ``shard``. CheckpointError: layout or value
            problems (one line each).
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint: directory {ckpt} does not exist")
    found = scan_checkpoint(ckpt)
    args = stored_args(ModelArgs.from_json(ckpt), found)
    validate_layout(checkpoint_layout(args), found)
    linears = model_linears(args)
    if shard is None:
        model = Transformer(args, dtype, ops)
    else:
        with deferred_params():
            model = Transformer(args, dtype, ops)
        for name, lin in linears.items():          # the shard's checks see what will be quantised
            _set_act(model, name, lin.kind)
        shard(model)
        materialize(model)
    covered = {t for n, lin in linears.items() for t in linear_tensors(n, lin, args)}
    kinds = packed_kinds(ops, packed)
    plain = [n for n in found if n not in covered]
    with ShardReader(ckpt, found) as reader, torch.no_grad():
        bar = tqdm(total=len(linears) + len(plain), desc="loading weights", unit="tensor", disable=not progress)
        for name, lin in linears.items():
            stored = _stored_module(model, name, lin.kind, kinds)
            place = _local(*_target(model, f"{name}.weight")) if stored is None else None
            if stored is None and place is None:
                bar.update()
                continue
            if place is not None and place[1] and lin.kind == "bf16":     # a TP slice: read only it
                w, place = reader.get(f"{name}.weight", place[1]).float(), (place[0], ())
            else:
                w = _dequant(name, lin, reader, args)
            _check_values(f"{name}.weight", w, args)
            if stored is not None:
                stored.store_quantised(reader.get(f"{name}.weight"), reader.get(f"{name}.scale"), lin.kind,
                                       ACT_SCHEME[lin.kind])
            else:
                place[0].copy_(narrow_cuts(w, place[1]))
                _set_act(model, name, lin.kind)
            bar.update()
        for name in plain:
            dst, cuts = _local(_target(model, name)[0], None)
            t = reader.get(name, cuts)
            _check_values(name, t, args)
            dst.copy_(t)
            bar.update()
        bar.close()
    return model.to(device).train(False)
