"""INT8 W8A8 and INT4 W4A8 linears of converted checkpoints (reference/dsv4-architecture.md §7, A3).

Upstream's ``utils/convert_model.py`` defines them; each stored linear ``X`` keeps its name.
int8: ``X.weight`` int8 ``[N, K]``, ``X.scale`` fp32 ``[N, 1]`` with ``s = absmax_row / 127``.
int4: ``X.weight`` int8 ``[N/2, K]`` (two rows per byte, row 2j in the low nibble), ``X.scale``
uint64 ``[N, 1]`` holding the fp32 bits in its low 32 bits (``s`` from a clip search 0.70..1.30),
``X.bias`` fp32 ``[N]`` (the W4A8 GMM assistance bias).

Encoders compute in fp32 from the bf16-exact dequantised weight (upstream computes the int8 scale
in bf16 arithmetic; fp32 is the documented ``absmax/127`` without that extra rounding).
"""
from __future__ import annotations

import torch

from engine.checkpoint.fp8_mxfp4 import QuantFormatError

INT4_CLIP = (0.70, 1.30, 0.01)   # per_channel_searching: start, end, step (§7)


def _safe_scale(s: torch.Tensor) -> torch.Tensor:
    """A zero row gets scale 1 (its codes are 0); upstream would divide by zero there."""
    return torch.where(s > 0, s, torch.ones_like(s))


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
