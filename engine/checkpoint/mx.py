"""MXFP8 and MXFP4 linears of converted checkpoints (OCP microscaling; reference/dsv4-architecture.md §7, 950).

Upstream's ``utils/mx_quantize.py`` defines them; each stored linear ``X`` keeps its name.
mxfp8: ``X.weight`` float8_e4m3fn ``[N, K]``; mxfp4: ``X.weight`` uint8 ``[N, K/2]`` (two e2m1
codes per byte, even column low). Both: ``X.scale`` uint8 e8m0 ``[N, K/32]``, one shared exponent
per 32 inputs of a row (the group's exponent minus 8 for e4m3, minus 2 for e2m1).
The original checkpoint's MXFP4 experts (int8 storage, float8_e8m0fnu scales) are
``engine.checkpoint.fp8_mxfp4``.
"""
from __future__ import annotations

import torch

from engine.checkpoint.fp8_mxfp4 import FP4_LUT, QuantFormatError, e8m0_to_float, unpack_fp4

MX_GROUP = 32
# element format: (mantissa bits incl. sign and implicit one, min private exponent, max normal, emax)
_MX = {8: (5, -6, 448.0, 8), 4: (3, 0, 6.0, 2)}


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quant_mx(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (bits 8, e4m3) or MXFP4 (bits 4, e2m1) along K in groups of 32 (§7, ``quantize_mx``).

    The group exponent is ``round2decimal(max|x|) - emax``: floor(log2) plus one when the mantissa
    exceeds 1.75, minus 8 (e4m3) or 2 (e2m1), kept in [-127, 127]. Elements are rounded
    half away from zero to the element grid (subnormals kept) and saturated.

    Args:
        w: ``[N, K]`` float, K % 32 == 0.
    Returns:
        bits 8: (float8_e4m3fn ``[N, K]``, uint8 e8m0 ``[N, K/32]``);
        bits 4: (uint8 ``[N, K/2]`` packed e2m1, even column low, uint8 e8m0 ``[N, K/32]``).
    Raises:
        QuantFormatError: K not a multiple of 32.
    """
    a, e = _mx_round(w, bits)
    scale = (e + 127).to(torch.uint8)
    return (a.to(torch.float8_e4m3fn), scale) if bits == 8 else (_pack_e2m1(a), scale)


def mx_fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``dequant_mx(*quant_mx(x, bits))`` without the storage dtypes (graph-compile friendly): fp32 ``[N, K]``."""
    a, e = _mx_round(x, bits)
    n, k = a.shape
    return (a.view(n, k // MX_GROUP, MX_GROUP) * torch.exp2(e).unsqueeze(-1)).view(n, k)


def _mx_round(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements on the e4m3 / e2m1 grid fp32 ``[N, K]``, group exponents fp32 ``[N, K/32]``)."""
    n, k = w.shape
    if k % MX_GROUP:
        raise QuantFormatError(f"MX formats need in_features % {MX_GROUP} == 0, found {k}")
    mbits, min_exp, max_norm, emax = _MX[bits]
    g = w.float().reshape(n, k // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    amax = torch.where(amax == 0, torch.full_like(amax, 2.0 ** -126), amax)
    e = torch.floor(torch.log2(amax))
    e = torch.where(amax / torch.exp2(e) > 1.75, e + 1, e)
    e = (e - emax).clamp(-127, 127)
    a = g / torch.exp2(e)
    pe = torch.floor(torch.log2(a.abs() + (a == 0).float())).clamp(min=min_exp)
    step = torch.exp2(pe - (mbits - 2))
    a = (_round_half_away(a / step) * step).clamp(-max_norm, max_norm).reshape(n, k)
    return a, e.squeeze(-1)


def _pack_e2m1(a: torch.Tensor) -> torch.Tensor:
    """fp32 values on the e2m1 grid ``[N, K]`` -> uint8 ``[N, K/2]``, even column in the low nibble."""
    code = (a.abs().unsqueeze(-1) == FP4_LUT[:8]).float().argmax(-1)
    code = code + 8 * torch.signbit(a).long()             # -0 keeps its sign bit (0x8), as torchao packs it
    return (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)


def dequant_mx(w: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP8 ``float8_e4m3fn [N, K]`` or packed MXFP4 ``uint8 [N, K/2]`` with uint8 ``[N, K/32]`` -> ``[N, K]``.

    Raises:
        QuantFormatError: the scale grid does not match.
    """
    vals = w.float() if w.dtype == torch.float8_e4m3fn else unpack_fp4(w)
    n, k = vals.shape
    if tuple(scale.shape) != (n, k // MX_GROUP) or k % MX_GROUP:
        raise QuantFormatError(f"MX scale shape {tuple(scale.shape)} != ({n}, {k}/{MX_GROUP})")
    return (vals * e8m0_to_float(scale).repeat_interleave(MX_GROUP, 1)).to(out_dtype)
