"""Whole-weight dequantisation of one stored linear, and the quant type its tensors are really in.

For the converters (``dsv4-convert-model`` dequantises every linear before requantising), the
benchmarks and tests; serving never dequantises a whole weight (``engine.ops.packed``).
"""
from __future__ import annotations

import dataclasses

import torch

from engine.checkpoint.fp8_mxfp4 import QuantFormatError, dequant_fp8_block, dequant_mxfp4
from engine.checkpoint.hif8 import hif8_decode
from engine.checkpoint.int8_int4 import dequant_int, int4_bias, u64_to_scale, unpack_int4_rows
from engine.checkpoint.mx import dequant_mx
from engine.checkpoint.shards import StoredTensor
from engine.config import ModelArgs


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
