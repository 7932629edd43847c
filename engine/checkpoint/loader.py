"""Checkpoint loading: validate the stored layout, then fill the model tensor by tensor.

Before any weight is read, the shard headers are checked against the layout config.json implies
(``engine.checkpoint.shards``). Tensors are then read lazily (one at a time), dequantised (FP8
block / MXFP4, reference §2.1; the converted int8 / int4 / MXFP8 / MXFP4 / HiF8 layouts of §7) and
copied into the model's compute dtype; problems raise ``engine.checkpoint.shards.CheckpointError``.
A converted linear's activation quantisation (``engine.checkpoint.qscheme.ACT_SCHEME``) is set on
its module.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from engine.checkpoint.fp8_mxfp4 import QuantFormatError, dequant_fp8_block, dequant_mxfp4
from engine.checkpoint.hif8 import hif8_decode
from engine.checkpoint.int8_int4 import dequant_int, int4_bias, u64_to_scale, unpack_int4_rows
from engine.checkpoint.layout import LinearSpec, checkpoint_layout, linear_tensors, model_linears
from engine.checkpoint.mx import dequant_mx
from engine.checkpoint.qscheme import ACT_SCHEME
from engine.checkpoint.shards import (CheckpointError, ShardReader, StoredTensor, scan_checkpoint,
                                      validate_layout)
from engine.config import ModelArgs
from engine.model.layers import deferred_params, materialize
from engine.model.transformer import Transformer
from engine.ops import REFERENCE, Ops


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
