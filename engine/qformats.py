"""Weight formats of the converted checkpoints (reference/dsv4-architecture.md §7), encode and decode.

Upstream's ``utils/convert_model.py`` / ``utils/mx_quantize.py`` define them; each stored linear
``X`` keeps its name: ``X.weight`` (+ ``X.scale``, + ``X.bias`` for int4).

==========  =========================  ===========================  ==============================
format      X.weight                   X.scale                      rule
==========  =========================  ===========================  ==============================
int8        int8 ``[N, K]``            fp32 ``[N, 1]``              ``s = absmax_row / 127``
int4        int8 ``[N/2, K]`` (2 rows  uint64 ``[N, 1]`` (fp32 bits ``s`` from a clip search
            per byte: row 2j low)      in the low 32 bits)          0.70..1.30; ``X.bias [N]``
mxfp8       float8_e4m3fn ``[N, K]``   uint8 e8m0 ``[N, K/32]``     shared exp - 8, e4m3 elements
mxfp4       uint8 ``[N, K/2]`` (2      uint8 e8m0 ``[N, K/32]``     shared exp - 2, e2m1 elements
            cols per byte: even low)
hif8        uint8 HiF8 ``[N, K]``      fp32 ``[N, 1]``              see ``engine.hif8``
==========  =========================  ===========================  ==============================

Encoders compute in fp32 from the bf16-exact dequantised weight (upstream computes the int8 scale
in bf16 arithmetic; fp32 is the documented ``absmax/127`` without that extra rounding).
"""
from __future__ import annotations

import torch

from engine.quant import FP4_LUT, QuantFormatError, e8m0_to_float, unpack_fp4

MX_GROUP = 32
INT4_CLIP = (0.70, 1.30, 0.01)   # per_channel_searching: start, end, step (§7)


def _safe_scale(s: torch.Tensor) -> torch.Tensor:
    """A zero row gets scale 1 (its codes are 0); upstream would divide by zero there."""
    return torch.where(s > 0, s, torch.ones_like(s))


# ---- int8 / int4 (A3) ---------------------------------------------------------------------------
def quant_int8(w: torch.Tensor, clip: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 (§7 w8a8-int).

    Args:
        w: ``[N, K]`` float. clip: optional (min factor, max factor) ``[N, 1]`` each: the row is
            first clamped to ``[min_row * fmin, max_row * fmax]`` (upstream's quant_params).
    Returns:
        (int8 ``[N, K]`` in [-127, 127], fp32 scale ``[N, 1]``).
    """
    w = _clip(w.float(), clip)
    s = _safe_scale(w.abs().amax(1, keepdim=True) / 127)
    return torch.round(w / s).clamp(-127, 127).to(torch.int8), s


def _clip(w: torch.Tensor, clip) -> torch.Tensor:
    if clip is None:
        return w
    lo = w.amin(1, keepdim=True) * clip[0].float().reshape(-1, 1)
    hi = w.amax(1, keepdim=True) * clip[1].float().reshape(-1, 1)
    return torch.maximum(torch.minimum(w, hi), lo)


def quant_int4(w: torch.Tensor, clip: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int4 with upstream's clip search (§7 w4a8-int, ``per_channel_searching``).

    For each row, candidates ``r * max_row`` for r = 0.70, 0.71, .., 1.30 are tried; the one with the
    least squared error of ``round(clamp(w, +-c) / (c/7)) * (c/7)`` wins (first on ties). As
    upstream, the candidate is the row's signed max; a row whose max is not positive uses its
    absmax instead (upstream would produce a non-positive scale there).

    Returns:
        (int8 ``[N, K]`` in [-7, 7] (unpacked), fp32 scale ``[N, 1]``).
    """
    w = _clip(w.float(), clip)
    qs, ss = [], []
    rows = max(1, (1 << 16) // max(1, w.shape[1]))          # row blocks that stay in cache
    for blk in w.split(rows):
        q, s = _int4_search(blk)
        qs.append(q)
        ss.append(s)
    return torch.cat(qs), torch.cat(ss)


def _int4_search(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vmax = w.amax(1, keepdim=True)
    vmax = torch.where(vmax > 0, vmax, w.abs().amax(1, keepdim=True))
    start, end, step = INT4_CLIP
    best_err = torch.full_like(vmax, float("inf"))
    best = vmax.clone()
    t = torch.empty_like(w)
    for i in range(int(round((end - start) / step)) + 1):
        c = (start + i * step) * vmax
        s = _safe_scale(c / 7)
        torch.minimum(w, c, out=t)
        t.clamp_(min=-c).div_(s).round_().mul_(s).sub_(w)
        err = t.square_().sum(1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, c, best)
    s = _safe_scale(best / 7)
    q = (torch.maximum(torch.minimum(w, best), -best) / s).round().clamp(-7, 7)
    return q.to(torch.int8), s


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[N, K]`` values in [-8, 7] -> int8 ``[N/2, K]``: row 2j in the low nibble, 2j+1 high (§7)."""
    n = q.shape[0]
    if n % 2:
        raise QuantFormatError(f"int4 packing needs an even number of output rows, found {n}")
    u = q.to(torch.uint8)
    return ((u[0::2] & 0xF) | (u[1::2] << 4)).view(torch.int8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4_rows``: int8 ``[N/2, K]`` -> int8 ``[N, K]`` (sign-extended nibbles)."""
    u = packed.contiguous().view(torch.uint8)
    lo = (u & 0xF).to(torch.int8)
    hi = (u >> 4).to(torch.int8)
    lo = torch.where(lo > 7, lo - 16, lo)
    hi = torch.where(hi > 7, hi - 16, hi)
    return torch.stack([lo, hi], 1).reshape(2 * u.shape[0], u.shape[1])


def scale_to_u64(s: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, 1]`` -> uint64 ``[N, 1]`` holding the fp32 bit pattern in its low 32 bits (§7)."""
    bits = s.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return bits.view(torch.uint64)


def u64_to_scale(u: torch.Tensor) -> torch.Tensor:
    """Inverse of ``scale_to_u64`` (the high 32 bits must be zero)."""
    bits = u.contiguous().view(torch.int64)
    if bool((bits >> 32).any()):
        raise QuantFormatError("int4 scale: uint64 values with non-zero high 32 bits")
    return bits.to(torch.int32).view(torch.float32).clone()


def int4_bias(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The W4A8 GMM "assistance" bias ``sum_k 8 * s_n * q[n, k]``: fp32 ``[N]`` (§7)."""
    return (s.float() * q.float() * 8).sum(1)


def dequant_int(q: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 / unpacked int4 ``[N, K]`` times fp32 ``[N, 1]`` -> ``[N, K]``."""
    return (q.float() * s.float().reshape(-1, 1)).to(out_dtype)


# ---- MX (950) -----------------------------------------------------------------------------------
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
