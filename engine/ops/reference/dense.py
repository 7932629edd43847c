"""Dense ops: the LM head, RMSNorm, RoPE, linear, quantised linear, activation quantisation, the grouped output projection (§3.1, §3.3, §6).

Part of the reference ops (``engine.ops.reference``): plain math, the numerics contract.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.checkpoint.hif8 import hif8_round
from engine.checkpoint.mx import mx_fake_quant
from engine.ops.packed import Packed, dequant, tile_elements, tiles
from engine.ops.reference.blas import GEMM_ROW_MULTIPLE, gemm, pad_block, pad_rows


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The vocab projection ``x @ weight^T``: x ``[M, H]`` fp32 (the last hidden of each sequence),
    weight ``[V, H]`` as stored (bf16; cast to fp32 one tile of ``packed.tile_elements`` at a time,
    never the whole head); returns ``[M, V]`` fp32.

    On CPU it streams the weight (the largest one, past any cache) as ``weight @ x_block^T`` over
    fixed blocks of ``GEMM_ROW_MULTIPLE`` rows: for decode-sized M that stays near the memory
    bandwidth limit, where CPU BLAS's row-major GEMM of a few rows runs ~2.5x slower; one kernel
    shape for every M keeps each row's bits independent of the batch. Past ~8 rows per block the
    cost grows linearly with M (compute in the small-N kernel). Elsewhere it is ``linear``.
    """
    if x.device.type != "cpu":
        return linear(x, weight)
    pad = pad_rows(x.shape[0])
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    out = torch.empty(xp.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    step = max(1, tile_elements(x.device) // max(weight.shape[1], 1))
    for v0 in range(0, weight.shape[0], step):
        w = weight[v0:v0 + step].to(x.dtype)
        for b in range(0, xp.shape[0], GEMM_ROW_MULTIPLE):
            out[b:b + GEMM_ROW_MULTIPLE, v0:v0 + step] = torch.mm(w, xp[b:b + GEMM_ROW_MULTIPLE].t()).t()
    return out[: x.shape[0]]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 (§3 notation).

    Args:
        x: ``[..., D]`` any float dtype. weight: ``[D]`` or None (unweighted, e.g. q_b_norm).
    Returns:
        ``[..., D]`` in ``x.dtype``.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved partial RoPE on the trailing ``r = 2 * cos.shape[-1]`` dims (§3.6).

    Pairs ``(x[D-r+2i], x[D-r+2i+1])`` rotate by angle ``theta_i * p``; pass ``-sin`` for the
    inverse rotation applied to the attention output (§3.3 step 7).

    Args:
        x: ``[T, D]`` or ``[T, h, D]``. cos, sin: ``[T, r/2]`` fp32.
    Returns:
        same shape and dtype as ``x``.
    """
    r = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    nope, pe = x[..., :-r], x[..., -r:].float()
    even, odd = pe[..., 0::2], pe[..., 1::2]
    rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rot.to(x.dtype)], dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (no bias). x: ``[..., K]``; weight: ``[N, K]`` in any float dtype (cast to
    x.dtype, one tile of ``packed.tile_elements`` at a time when it is not x.dtype already); returns
    ``[..., N]`` in x.dtype.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    tile = tile_elements(x.device)
    if weight.dtype == x.dtype or weight.numel() <= tile:
        return gemm(x2, weight.to(x.dtype)).view(*lead, weight.shape[0])
    step = max(1, tile // weight.shape[1])
    spans = [(r, min(weight.shape[0], r + step)) for r in range(0, weight.shape[0], step)]
    return _tiled(x2, weight.shape[0], spans, lambda r0, r1: weight[r0:r1].to(x.dtype)).view(*lead, weight.shape[0])


def _tiled(x: torch.Tensor, n: int, spans, tile) -> torch.Tensor:
    """``x [M, K] @ W^T`` with ``W`` produced one row tile at a time: ``tile(r0, r1)`` -> ``[r1-r0, K]``."""
    if len(spans) == 1:
        return gemm(x, tile(*spans[0]))
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for r0, r1 in spans:
        out[:, r0:r1] = gemm(x, tile(r0, r1))
    return out


def quant_linear(x: torch.Tensor, weight: Packed, act: str | None) -> torch.Tensor:
    """A linear on its stored quantised weight (§2.1, §7): ``act_quant(x) @ dequant(weight)^T``.

    Args:
        x: ``[..., K]`` float.
        weight: the stored tensors (``engine.ops.packed``: fp8 block, int8, int4, mxfp8, mxfp4,
            hif8, fp4), dequantised to x.dtype one row tile (``packed.tile_rows``) at a time.
        act: the activation scheme (``act_quant``) or None.
    Returns:
        ``[..., N]`` in x.dtype. Dequantisation is exact or rounds once, as the whole-weight one
        does, so this equals ``linear`` on the dense weight in x.dtype; a weight of at most
        ``packed.tile_elements`` runs as that very call (bit-equal).
    Raises:
        ValueError: an unknown fmt.
    """
    x = x if act is None else act_quant(x, act)
    lead, n = x.shape[:-1], weight.shape[-2]
    out = _tiled(x.reshape(-1, x.shape[-1]), n, tiles(weight), lambda r0, r1: dequant(weight, x.dtype, (r0, r1)))
    return out.view(*lead, n)


def act_quant(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """Dynamic activation quantisation in front of a converted linear, emulated (§7): quantise, dequantise.

    Schemes (row = last dim, so a row's result never depends on other rows in the batch):

    * ``int8-token``: per token, ``s = absmax / 127``, ``round(x / s)`` clamped to +-127
      (``npu_dynamic_quant``, smooth scales 1);
    * ``mxfp8``: groups of 32 along the last dim, e8m0 scale, e4m3 elements (``npu_dynamic_mx_quant``;
      the shared-exponent rule of ``engine.checkpoint.mx.quant_mx`` is assumed for it too);
    * ``hif8``: a cast to HiF8 with scale 1, as upstream's W8A8 HiF8 linear does.

    Args:
        x: ``[..., K]`` float (K % 32 == 0 for mxfp8).
    Returns:
        same shape and dtype, each value replaced by its quantised value.
    Raises:
        ValueError: an unknown scheme.
    """
    shape, xf = x.shape, x.float().reshape(-1, x.shape[-1])
    if scheme == "int8-token":
        s = xf.abs().amax(-1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        y = torch.round(xf / s).clamp(-127, 127) * s
    elif scheme == "mxfp8":
        y = mx_fake_quant(xf, 8) if xf.shape[0] else xf
    elif scheme == "hif8":
        y = hif8_round(xf)
    else:
        raise ValueError(f"act_quant: unknown scheme {scheme!r} (int8-token, mxfp8, hif8)")
    return y.reshape(shape).to(x.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor | Packed) -> torch.Tensor:
    """Block-diagonal grouped output projection ``wo_a`` (§3.3 step 8).

    Args:
        x: ``[T, G, K]`` (group g holds heads g*h/G .. (g+1)*h/G - 1, flattened).
        weight: ``[G * N, K]`` dense (any float dtype) or ``Packed``; group g uses rows
            ``g*N .. g*N + N - 1``. Past ``packed.tile_elements`` it is cast / dequantised one group at a time.
    Returns:
        ``[T, G, N]`` in x.dtype.
    """
    T, G, K = x.shape
    N = weight.shape[-2] // G
    tile = tile_elements(x.device)
    if isinstance(weight, Packed) or (weight.dtype != x.dtype and weight.numel() > tile):
        if weight.shape[-2] * K > tile:
            out = torch.empty(T, G, N, dtype=x.dtype, device=x.device)
            for g in range(G):
                w = (dequant(weight, x.dtype, (g * N, g * N + N)) if isinstance(weight, Packed)
                     else weight[g * N:(g + 1) * N].to(x.dtype))
                out[:, g] = gemm(x[:, g], w)
            return out
        weight = dequant(weight, x.dtype) if isinstance(weight, Packed) else weight
    w = weight.to(x.dtype).view(G, -1, K)
    x, R = x.contiguous(), GEMM_ROW_MULTIPLE                            # batch invariance, see gemm
    if x.device.type != "cpu":
        return torch.einsum("tgk,gnk->tgn", F.pad(x, (0, 0, 0, 0, 0, pad_rows(T))), w)[:T]
    if 0 < T <= R:
        return torch.einsum("tgk,gnk->tgn", pad_block(x), w)[:T]
    out = torch.empty(T + pad_rows(T), G, w.shape[1], dtype=x.dtype, device=x.device)
    for b in range(0, T, R):
        out[b:b + R] = torch.einsum("tgk,gnk->tgn", pad_block(x[b:b + R]), w)
    return out[:T]
