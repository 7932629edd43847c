"""Storage formats of the original DeepSeek-V4 checkpoints (reference/dsv4-architecture.md §2.1).

* FP8 linears: ``float8_e4m3fn [out, in]`` with ``float8_e8m0fnu`` block scales
  ``[ceil(out/bo), ceil(in/bi)]``; ``W[n, k] = fp8(W[n, k]) * 2^(e[n // bo, k // bi] - 127)``.
* MXFP4 experts: ``int8 [out, in/2]``, two e2m1 nibbles per byte, low nibble = even column;
  ``float8_e8m0fnu [out, in/32]`` scales; ``W[n, k] = LUT[nib] * 2^(s[n, k // 32] - 127)``.

Decoders go through torch's own float8 dtypes (a library beats home-made bit twiddling), with one
exception: inside an inductor-compiled graph on CPU (graph mode's decode step), where torch's float8
conversion becomes a fallback call and a lookup-table gather scalar loads, an e4m3 byte is decoded
from its fields (``_e4m3_arith``: bit-equal to torch's conversion on the 254 non-NaN codes, NaN for
0x7F / 0xFF). The encoders
exist for ``dsv4-make-tiny`` and produce exactly representable values.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP4_MAX = 6.0
MXFP4_GROUP = 32
# e2m1 code -> value (§2.1); index = 4-bit code.
FP4_LUT = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_FP4_MIDPOINTS = (FP4_LUT[:7] + FP4_LUT[1:8]) / 2


class QuantFormatError(ValueError):
    """A quantised tensor and its scale do not fit together."""


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 exponents -> fp32 multipliers ``2^(e - 127)`` (e = 255 is NaN).

    Args:
        scale: ``float8_e8m0fnu`` or ``uint8`` tensor of any shape.
    Returns:
        fp32 tensor of the same shape.
    """
    if scale.dtype == torch.uint8:              # arithmetic, not a float8 view: graph compilers take it
        f = torch.exp2(scale.float() - 127)
        return torch.where(scale == 255, torch.full_like(f, float("nan")), f)
    if scale.dtype != torch.float8_e8m0fnu:
        raise QuantFormatError(f"e8m0 scale: expected float8_e8m0fnu or uint8, found {scale.dtype}")
    return scale.to(torch.float32)


# e4m3fn code -> fp32 value (every code, NaN included): on CPU one gather beats torch's
# element-wise float8 conversion ~4x
_E4M3_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_to_float(w: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` (or its raw uint8 bytes) -> fp32, exact (incl. subnormals, +-448, NaN)."""
    if w.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise QuantFormatError(f"e4m3 weight: expected float8_e4m3fn or uint8, found {w.dtype}")
    if w.device.type == "cpu":
        if torch.compiler.is_compiling():        # inductor turns a gather into scalar loads
            return _e4m3_arith(w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)
        codes = w.contiguous().view(torch.uint8)
        return _E4M3_LUT.index_select(0, codes.reshape(-1).int()).view(w.shape)
    return (w.view(torch.float8_e4m3fn) if w.dtype == torch.uint8 else w).to(torch.float32)


def _e4m3_arith(u8: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes -> fp32 by integer arithmetic on the fields (bit-equal to ``_E4M3_LUT`` but for
    the NaN payloads): a
    normal code's exponent is rebiased (7 -> 127) and its 3 mantissa bits moved to the top of fp32's;
    a subnormal one is ``m * 2^-9``, formed without fp32 denormals so a flush-to-zero mode changes
    nothing; 0x7F / 0xFF are NaN. Element-wise ops that inductor vectorises."""
    u = u8.to(torch.int32)
    e, m = (u >> 3) & 15, u & 7
    normal = (((e + 120) << 23) | (m << 20)).view(torch.float32)
    mag = torch.where(e == 0, m.to(torch.float32) * 2.0 ** -9, normal)
    val = torch.where(u >= 128, -mag, mag)
    return torch.where((u & 127) == 127, torch.full_like(val, float("nan")), val)


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-scaled FP8 -> dense (§2.1).

    Args:
        w: ``[out, in]`` float8_e4m3fn.
        scale: ``[ceil(out/bo), ceil(in/bi)]`` float8_e8m0fnu (ceil-shaped grids: the last block
            may be partial).
        block: ``(bo, bi)``, the config's ``weight_block_size``.
    Returns:
        ``[out, in]`` tensor of ``out_dtype``.
    Raises:
        QuantFormatError: the scale grid does not match ``ceil(shape / block)``.
    """
    n, k = w.shape
    bo, bi = block
    grid = (-(-n // bo), -(-k // bi))
    if tuple(scale.shape) != grid:
        raise QuantFormatError(f"FP8 scale grid {tuple(scale.shape)} != ceil({n}/{bo}), ceil({k}/{bi}) = {grid}")
    s = e8m0_to_float(scale).repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
    return (e4m3_to_float(w) * s).to(out_dtype)


# byte -> (value of its low nibble, value of its high nibble): one gather decodes two columns
_BYTE_LUT = torch.stack([FP4_LUT[torch.arange(256) & 0xF], FP4_LUT[torch.arange(256) >> 4]], dim=-1)
_BYTE_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def byte_lut(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The LUT on ``device`` in ``dtype``, copied once: a host-to-device copy inside a CUDA graph
    capture (the static decode step dequantises MXFP4 experts) is refused, and every step would pay it.
    A graph step calls this before it is traced: a copy made while dynamo traces leaves a guard
    (the key absent) that fails once the copy exists, and the step compiles again at its next call."""
    lut = _BYTE_LUTS.get((device, dtype))
    if lut is None:
        lut = _BYTE_LUTS[(device, dtype)] = _BYTE_LUT.to(device, dtype)
    return lut


def unpack_fp4(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 pairs ``int8 [..., in/2]`` -> ``[..., in]`` of ``dtype`` (fp32 or bf16: every
    e2m1 value is exact in both); low nibble = even column."""
    if packed.device.type == "cpu" and torch.compiler.is_compiling():   # inductor: a gather is scalar loads
        u = packed.view(torch.uint8).to(torch.int32)
        return torch.stack([e2m1_arith(u & 15), e2m1_arith(u >> 4)], dim=-1).flatten(-2).to(dtype)
    u8 = packed.contiguous().view(torch.uint8)
    lut = byte_lut(packed.device, dtype)
    if packed.device.type == "cpu":     # each pair one 4- or 8-byte element, int64 ids: ~4x the row gather
        pair = {torch.float32: torch.int64, torch.bfloat16: torch.int32}.get(lut.dtype)
        if pair is not None:
            return lut.view(pair).view(-1).index_select(0, u8.reshape(-1).long()).view(lut.dtype).view(
                *packed.shape[:-1], 2 * packed.shape[-1])
    vals = lut.index_select(0, u8.reshape(-1).int())
    return vals.view(*packed.shape[:-1], 2 * packed.shape[-1])


def e2m1_arith(c: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (int32, 0..15) -> fp32 by arithmetic on the fields, bit-equal to ``FP4_LUT``
    (-0 included): exponent e > 0 is rebiased (1 -> 127) with the mantissa bit at the top of
    fp32's; e = 0 is ``m / 2``. Element-wise ops that inductor vectorises."""
    e, m = (c >> 1) & 3, c & 1
    normal = (((e + 126) << 23) | (m << 22)).view(torch.float32)
    mag = torch.where(e == 0, m.to(torch.float32) * 0.5, normal)
    return torch.where(c >= 8, -mag, mag)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 expert weight -> dense (§2.1).

    Args:
        packed: ``[out, in/2]`` int8 (two e2m1 codes per byte).
        scale: ``[out, in/32]`` float8_e8m0fnu, one power-of-two per 32 inputs of a row.
    Returns:
        ``[out, in]`` tensor of ``out_dtype``. For bf16 the product is formed in bf16, which is
        exact (an e2m1 value has 2 significant bits, a scale is a power of two inside bf16's fp32
        exponent range), so it equals the fp32 result rounded, bit for bit, with a third of the
        memory traffic: the graph decode step dequantises every row's routed experts.
    Raises:
        QuantFormatError: ``scale`` is not ``[out, in/32]``.
    """
    n, half = packed.shape
    k = 2 * half
    if k % MXFP4_GROUP or tuple(scale.shape) != (n, k // MXFP4_GROUP):
        raise QuantFormatError(f"MXFP4 scale shape {tuple(scale.shape)} != ({n}, {k}/{MXFP4_GROUP})")
    dt = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    vals = unpack_fp4(packed, dt).view(n, k // MXFP4_GROUP, MXFP4_GROUP) * e8m0_to_float(scale).to(dt).unsqueeze(-1)
    return vals.view(n, k).to(out_dtype)


# ---- encoders (used by dsv4-make-tiny) --------------------------------------------------------
def _pow2_exponent(amax: torch.Tensor, vmax: float) -> torch.Tensor:
    """Smallest integer e with amax / 2^e <= vmax (e in the e8m0 range)."""
    e = torch.ceil(torch.log2(amax.clamp_min(1e-30) / vmax))
    return e.clamp(-127, 127)


def quant_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[out, in]`` -> (float8_e4m3fn weight, float8_e8m0fnu ceil-shaped block scales)."""
    n, k = w.shape
    bo, bi = block
    gn, gk = -(-n // bo), -(-k // bi)
    if n % bo == 0 and k % bi == 0:     # whole blocks: scale through a view, no padded or repeated copy
        wb = w.float().reshape(gn, bo, gk, bi)
        e = _pow2_exponent(wb.abs().amax(dim=(1, 3)), E4M3_MAX)
        q = (wb / torch.exp2(e)[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.reshape(n, k), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    pad = torch.zeros(gn * bo, gk * bi, dtype=torch.float32)
    pad[:n, :k] = w.float()
    amax = pad.abs().view(gn, bo, gk, bi).amax(dim=(1, 3))
    e = _pow2_exponent(amax, E4M3_MAX)
    s = torch.exp2(e).repeat_interleave(bo, 0)[:n].repeat_interleave(bi, 1)[:, :k]
    q = (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[out, in]`` -> (int8 ``[out, in/2]`` packed e2m1, float8_e8m0fnu ``[out, in/32]``).

    Rounds each value to the nearest e2m1 code after dividing by its group's power of two.
    """
    n, k = w.shape
    if k % MXFP4_GROUP:
        raise QuantFormatError(f"MXFP4 needs in % {MXFP4_GROUP} == 0, found in={k}")
    g = w.float().view(n, k // MXFP4_GROUP, MXFP4_GROUP)
    e = _pow2_exponent(g.abs().amax(-1), FP4_MAX)
    x = (g / torch.exp2(e).unsqueeze(-1)).reshape(n, k)
    # nearest e2m1 magnitude; a tie goes to the smaller one (the midpoints are exact in fp32)
    code = torch.bucketize(x.abs(), _FP4_MIDPOINTS, out_int32=True)
    code = code + 8 * ((x < 0) & (code > 0)).int()
    u8 = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return u8.view(torch.int8), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
