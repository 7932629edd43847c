"""HiFloat8 (HiF8) codec in pure torch: fp <-> uint8 codes, and per-row dynamic quantisation.

Format ("Ascend HiFloat8 Format for Deep Learning", https://arxiv.org/abs/2409.16626,
format definition / Fig. 1), byte = ``S | dot | exponent | mantissa``:

=========  ==========  =============  ========  ===============================
dot bits   exp bits D  |E|            mantissa  value
=========  ==========  =============  ========  ===============================
``11``     4           8..15          1         ``±2^E * 1.m``
``10``     3           4..7           2         ``±2^E * 1.m``
``01``     2           2..3           3         ``±2^E * 1.m``
``001``    1           1              3         ``±2^E * 1.m``
``0001``   0           0              3         ``±1.m``
``0000``   -           (denormal)     3 (= M)   ``±2^(M - 23)``, M = 1..7
=========  ==========  =============  ========  ===============================

The D exponent bits are sign-magnitude: the first is the exponent's sign (1 = negative), the
other D-1 are the magnitude below an implicit leading 1, so ``|E| = 2^(D-1) + bits``.
Special codes: ``0x00`` = 0 (there is no -0), ``0x80`` = NaN, ``0x6F``/``0xEF`` = ±Inf (the slot
that would be ``±1.5 * 2^15``). Largest finite ``0x6E`` = 2^15 = 32768, smallest normal
``0x7E`` = 2^-15, smallest denormal ``0x01`` = 2^-22; 253 distinct finite values.

Rounding fp -> HiF8 is round-to-nearest, ties away from zero ("TA"): torch_npu's
``round_mode="round"`` for hifloat8 (op-plugin npu_quant_max docs), Ascend C
``__float22hif82_rna[_sat]``, and the reference en_dtypes ``hifloat8`` (PyPI ``en-dtypes``,
hifloat.h: "hifloat8 only support round half to away"). en_dtypes maps inputs that round past
32768 (``|x| >= 40960``) to ±Inf, or to ±32768 when saturating. Ascend's ``hybrid`` rounding
(meant for gradients) is not implemented here.

Per-row dynamic quant follows torch_npu ``npu_dynamic_quant`` (Ascend/op-plugin
docs/zh/custom_APIs/torch_npu/torch_npu-npu_dynamic_quant.md): ``scale = rowMax(|x|) / DTYPE_MAX``,
``y = cast(x / scale)``, with ``HiF8_MAX = 32768`` (torch_npu-npu_dynamic_block_quant.md) and the
op's ``dst_type_max`` override (op_plugin_functions.yaml, npu_dynamic_quant). That doc lists only
int8/int4 for ``dst_type``; that hifloat8 uses the same rule is an assumption.
"""
from __future__ import annotations

import math

import torch

HIF8_MAX = 32768.0
HIF8_NAN = 0x80
HIF8_INF = 0x6F
_MAX_CODE = 0x6E
_OVERFLOW = 40960.0  # midpoint of 2^15 and 1.5 * 2^15: at or above it TA rounding leaves the finite range


def _decode_byte(b: int) -> float:
    if b == 0x00:
        return 0.0
    if b == HIF8_NAN:
        return math.nan
    sign = -1.0 if b & 0x80 else 1.0
    m = b & 0x7F
    if m == HIF8_INF:
        return sign * math.inf
    if m >> 5:                      # dot 01 / 10 / 11 -> D = 2 / 3 / 4
        d = (m >> 5) + 1
        field, nm = m & 0x1F, 5 - d
    elif m >> 4:                    # dot 001 -> D = 1
        d, field, nm = 1, m & 0x0F, 3
    elif m >> 3:                    # dot 0001 -> D = 0
        d, field, nm = 0, m & 0x07, 3
    else:                           # dot 0000 -> denormal 2^(M - 23)
        return sign * 2.0 ** ((m & 0x07) - 23)
    mant, ebits = field & ((1 << nm) - 1), field >> nm
    e = 0
    if d:
        e = (1 << (d - 1)) | (ebits & ((1 << (d - 1)) - 1))
        if ebits >> (d - 1):
            e = -e
    return sign * 2.0 ** e * (1.0 + mant / 2 ** nm)


# code -> fp32 value, index = code.
_TABLE = torch.tensor([_decode_byte(b) for b in range(256)], dtype=torch.float64)
# Non-negative finite values ascending, their codes, and the rounding boundaries between them.
_POS_CODES = torch.tensor(sorted((b for b in range(0x80) if b != HIF8_INF), key=_decode_byte), dtype=torch.long)
_POS_VALS = _TABLE[_POS_CODES]
_BOUNDS = torch.cat([(_POS_VALS[:-1] + _POS_VALS[1:]) / 2, torch.tensor([_OVERFLOW], dtype=torch.float64)])
_TABLE = _TABLE.float()


def hif8_encode(x: torch.Tensor, *, saturate: bool = True) -> torch.Tensor:
    """Round floats to HiF8 (nearest, ties away from zero) and return their codes.

    Args:
        x: floating tensor of any shape/dtype (fp64 is compared in fp64, others in fp32, exactly).
        saturate: finite values with ``|x| >= 40960`` (those that round above ``HIF8_MAX``) give
            ``±HIF8_MAX`` (``0x6E``/``0xEE``) when True, ``±Inf`` (``0x6F``/``0xEF``) when False.
            ±Inf inputs always give the ±Inf codes; NaN gives ``0x80``.
    Returns:
        uint8 tensor of the shape of ``x``. Values that round to zero (either sign) give ``0x00``.
    Raises:
        ValueError: ``x`` is not a floating-point tensor.
    """
    if not torch.is_floating_point(x):
        raise ValueError(f"hif8_encode: expected a floating-point tensor, found {x.dtype}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    idx = torch.bucketize(xf.abs(), _BOUNDS.to(xf.device, work), right=True)  # right=True: ties go up
    over = _MAX_CODE if saturate else HIF8_INF
    codes = torch.cat([_POS_CODES, torch.tensor([over])]).to(torch.uint8).to(xf.device)[idx]
    codes = torch.where((xf < 0) & (codes != 0), codes | 0x80, codes)
    inf_code = torch.where(xf > 0, HIF8_INF, HIF8_INF | 0x80).to(torch.uint8)
    codes = torch.where(torch.isinf(xf), inf_code, codes)
    return torch.where(torch.isnan(xf), torch.full_like(codes, HIF8_NAN), codes)



def hif8_decode(codes: torch.Tensor) -> torch.Tensor:
    """HiF8 codes -> values.

    Args:
        codes: uint8 tensor of any shape.
    Returns:
        fp32 tensor of the same shape (``0x80`` -> NaN, ``0x6F``/``0xEF`` -> ±Inf).
    Raises:
        ValueError: ``codes`` is not uint8.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"hif8_decode: expected uint8 codes, found {codes.dtype}")
    return _TABLE.to(codes.device)[codes.long()]


def hif8_round(x: torch.Tensor, *, saturate: bool = True) -> torch.Tensor:
    """``hif8_decode(hif8_encode(x))``: ``x`` rounded to the nearest HiF8 value (ties away).

    Args:
        x: floating tensor of any shape.
        saturate: as in :func:`hif8_encode`.
    Returns:
        fp32 tensor of the shape of ``x``.
    Raises:
        ValueError: ``x`` is not a floating-point tensor.
    """
    return hif8_decode(hif8_encode(x, saturate=saturate))


def hif8_quant_per_channel(w: torch.Tensor, *, dst_type_max: float = HIF8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row dynamic quant to HiF8, as ``npu_dynamic_quant(dst_type=hifloat8)``.

    ``scale[n] = max_k |w[n, k]| / dst_type_max`` (1.0 for an all-zero row, or when that quotient
    underflows to 0 in fp32), ``codes = hif8_encode(w / scale)``; ``w ~= hif8_decode(codes) * scale``.

    Args:
        w: floating tensor ``[N, K]`` (e.g. a linear weight ``[out, in]``), all values finite.
        dst_type_max: value the row maximum maps to, in ``(0, HIF8_MAX]`` (the op's ``dst_type_max``).
    Returns:
        ``(codes, scale)``: uint8 ``[N, K]`` and fp32 ``[N, 1]``.
    Raises:
        ValueError: ``w`` is not floating point, not 2-D, or not all finite; ``dst_type_max`` out of range.
    """
    if not torch.is_floating_point(w):
        raise ValueError(f"hif8_quant_per_channel: expected a floating-point tensor, found {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"hif8_quant_per_channel: expected a 2-D [N, K] tensor, found shape {tuple(w.shape)}")
    if not 0.0 < dst_type_max <= HIF8_MAX:
        raise ValueError(f"hif8_quant_per_channel: dst_type_max must be in (0, {HIF8_MAX}], found {dst_type_max}")
    wf = w.float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("hif8_quant_per_channel: w contains Inf or NaN")
    scale = wf.abs().amax(dim=1, keepdim=True) / dst_type_max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return hif8_encode(wf / scale), scale
