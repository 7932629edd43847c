"""Quantise-on-write / dequantise-on-read of the decode-state caches: the reference math of the
NPU cache epilogues (reference/dsv4-architecture.md §4, §7, §8.1; layouts in ``engine.cache_dtype``).

A codec turns rows ``[..., dim]`` of the compute dtype into the stored parts (a tuple of tensors
``[..., w_i]``, one row per token / entry) and back. The parts are what the pools hold, what a
P/D transfer ships and what the NPU kernels read:

* KV ``fp8``: one uint8 part ``[..., 640]`` laid out as ``custom.kv_compress_epilog`` quant_mode 2
  writes it: rope bf16 bytes, nope e4m3 (scale per 64-element group, ``2^ceil(log2(amax/448))``
  with amax >= 1e-4, clipped to +-448), the groups' e8m0 exponents, zero padding;
* KV ``hif8`` / indexer ``hif8``: one uint8 part of HiF8 codes (scale 1);
* indexer ``int8``: int8 ``[..., dI]`` + fp16 ``[..., 1]`` (amax / 127, round half to even, clamp
  +-127: A3's ``li_cmp_kv`` + ``li_key_dequant_scale``; the fp16 scale bounds a row's amax to
  about 4e-6 .. 8e6, as on the device: indexer keys are RMS-normed, O(1));
* indexer ``fp8``: uint8 e4m3 bytes ``[..., dI]`` + fp32 ``[..., 1]`` (amax / 448:
  ``custom.indexer_compress_epilog`` quant_mode 1);
* ``none``: one part, the rows themselves in the compute dtype (decode returns it, no copy).

Decoding returns the compute dtype; every reader (window, compressed entries, indexer keys; the
per-sequence, batched and captured paths alike) reads the decoded stored row, so chunking and
batching never change which values a query sees.
"""
from __future__ import annotations

import math

import torch

from engine.cache_dtype import FP8_GROUP, INDEXER_KINDS, KV_KINDS, ROW_ALIGN, CacheDtype, indexer_row_bytes, \
    kv_row_bytes
from engine.checkpoint.fp8_mxfp4 import e4m3_to_float, e8m0_to_float
from engine.checkpoint.hif8 import hif8_decode, hif8_encode

FP8_MAX, INT8_MAX, MX_AMAX_FLOOR = 448.0, 127.0, 1e-4


class CacheCodec:
    """Storage of one cache: ``parts`` layout, ``encode`` and ``decode``.

    Args:
        kind: a ``engine.cache_dtype`` KV or indexer kind ("none", "fp8", "hif8", "int8").
        dim: logical row width (head_dim or index_head_dim).
        dtype: the compute dtype (what ``decode`` returns, what "none" stores).
        rope_dim: KV rows only: the trailing rope part kept in bf16 by "fp8".
        indexer: True for the indexer-key cache (its fp8 / int8 layouts differ from the KV ones).
    Raises:
        ValueError: an unknown kind for this cache.
    """

    def __init__(self, kind: str, dim: int, dtype: torch.dtype, rope_dim: int = 0, indexer: bool = False):
        kinds = INDEXER_KINDS if indexer else KV_KINDS
        if kind not in kinds:
            raise ValueError(f"{'indexer' if indexer else 'kv'} cache kind {kind!r}: expected one of {kinds}")
        self.kind, self.dim, self.dtype, self.rope_dim, self.indexer = kind, dim, dtype, rope_dim, indexer
        act = torch.empty(0, dtype=dtype).element_size()
        self.row_bytes = indexer_row_bytes(kind, dim, act) if indexer else kv_row_bytes(kind, dim, rope_dim, act)
        if kind == "none":
            self.widths: tuple[tuple[int, torch.dtype], ...] = ((dim, dtype),)
        elif kind == "hif8":
            self.widths = ((dim, torch.uint8),)
        elif indexer:
            self.widths = ((dim, torch.int8 if kind == "int8" else torch.uint8),
                           (1, torch.float16 if kind == "int8" else torch.float32))
        else:
            self.widths = ((self.row_bytes, torch.uint8),)
        self.nope = dim - rope_dim
        self.groups = math.ceil(self.nope / FP8_GROUP)

    @property
    def quantised(self) -> bool:
        return self.kind != "none"

    def empty(self, rows: int, device) -> tuple[torch.Tensor, ...]:
        """Zeroed parts for ``rows`` rows."""
        return tuple(torch.zeros(rows, w, dtype=dt, device=device) for w, dt in self.widths)

    def part_shapes(self, rows: int) -> list[tuple[tuple[int, int], torch.dtype]]:
        """(shape, dtype) of each part for ``rows`` rows."""
        return [((rows, w), dt) for w, dt in self.widths]

    # ---- encode / decode ------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``[..., dim]`` (any float dtype; rounded to the compute dtype first, as the
        kernels take it) -> the stored parts ``[..., w_i]``."""
        x = x.to(self.dtype)
        if self.kind == "none":
            return (x,)
        xf = x.float()
        if self.kind == "hif8":
            return (hif8_encode(xf),)
        if self.indexer:
            return _encode_scaled(xf, self.kind)
        return (self._encode_kv_fp8(xf),)

    def decode(self, parts: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
        """Stored parts ``[..., w_i]`` -> rows ``[..., dim]`` in the compute dtype."""
        if self.kind == "none":
            return parts[0]
        if self.kind == "hif8":
            return hif8_decode(parts[0]).to(self.dtype)
        if self.indexer:
            q, s = parts
            vals = q.float() if self.kind == "int8" else e4m3_to_float(q)
            return (vals * s.float()).to(self.dtype)
        return self._decode_kv_fp8(parts[0])

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``; ``x`` itself (cast to the compute dtype) when nothing is quantised."""
        return x.to(self.dtype) if self.kind == "none" else self.decode(self.encode(x))

    def _encode_kv_fp8(self, xf: torch.Tensor) -> torch.Tensor:
        lead, r, n, G = xf.shape[:-1], self.rope_dim, self.nope, self.groups
        out = torch.zeros(*lead, self.row_bytes, dtype=torch.uint8, device=xf.device)
        rope = xf[..., n:].to(torch.bfloat16).contiguous()
        out[..., :2 * r] = rope.view(torch.uint8).reshape(*lead, 2 * r)
        nope = torch.nn.functional.pad(xf[..., :n], (0, G * FP8_GROUP - n)).reshape(*lead, G, FP8_GROUP)
        amax = nope.abs().amax(-1, keepdim=True).clamp_min(MX_AMAX_FLOOR)
        exp = torch.ceil(torch.log2(amax / FP8_MAX))               # scale rounded up to a power of two
        q = (nope / torch.exp2(exp)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[..., 2 * r:2 * r + n] = q.view(torch.uint8).reshape(*lead, G * FP8_GROUP)[..., :n]
        out[..., 2 * r + n:2 * r + n + G] = (exp.squeeze(-1) + 127).to(torch.uint8)
        return out

    def _decode_kv_fp8(self, row: torch.Tensor) -> torch.Tensor:
        lead, r, n, G = row.shape[:-1], self.rope_dim, self.nope, self.groups
        rope = row[..., :2 * r].contiguous().view(torch.bfloat16).float()
        scale = e8m0_to_float(row[..., 2 * r + n:2 * r + n + G].contiguous())             # [..., G]
        vals = e4m3_to_float(row[..., 2 * r:2 * r + n].contiguous())
        idx = torch.arange(n, device=row.device) // FP8_GROUP
        nope = vals * scale[..., idx]
        return torch.cat([nope, rope], dim=-1).to(self.dtype)


def _encode_scaled(xf: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 (fp16 scale) or e4m3 (fp32 scale) of rows ``[..., dI]`` fp32."""
    qmax = INT8_MAX if kind == "int8" else FP8_MAX
    amax = xf.abs().amax(-1, keepdim=True)
    scale = amax / qmax                                  # 0 for an all-zero row, as the epilogue stores it
    y = torch.where(amax > 0, xf / torch.where(amax > 0, scale, torch.ones_like(scale)), torch.zeros_like(xf))
    if kind == "int8":
        return torch.round(y).clamp(-qmax, qmax).to(torch.int8), scale.to(torch.float16)
    return y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8), scale


def quant_query(codec: CacheCodec, q: torch.Tensor) -> torch.Tensor:
    """Indexer queries ``[..., dI]`` as the quantised lightning indexer takes them: with a
    quantised key cache, each (token, head) row quantised like a key row (A3: int8 per token-head
    with an fp16 scale, reference §7; 950: FP8 / HiF8 alike) and dequantised; else ``q`` itself."""
    return codec.round_trip(q) if codec.quantised else q


class CacheRows:
    """One cache's stored rows: the codec's parts ``[rows, w_i]``, addressed by flat row.

    ``read`` / ``write`` take any row index a tensor takes (long tensor of any shape, slice, int)
    and move rows of the compute dtype ``[*idx, dim]``; ``gather`` / ``scatter`` move the stored
    parts as they are (what a P/D transfer ships)."""

    def __init__(self, codec: CacheCodec, parts: tuple[torch.Tensor, ...]):
        self.codec, self.parts = codec, parts

    @classmethod
    def zeros(cls, codec: CacheCodec, rows: int, device) -> "CacheRows":
        return cls(codec, codec.empty(rows, device))

    @property
    def num_rows(self) -> int:
        return self.parts[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype rows are read in."""
        return self.codec.dtype

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def read(self, idx) -> torch.Tensor:
        return self.codec.decode([p[idx] for p in self.parts])

    def write(self, idx, x: torch.Tensor) -> None:
        for p, v in zip(self.parts, self.codec.encode(x)):
            p[idx] = v

    def gather(self, idx) -> tuple[torch.Tensor, ...]:
        return tuple(p[idx] for p in self.parts)

    def scatter(self, idx, parts) -> None:
        for p, v in zip(self.parts, parts):
            p[idx] = v.to(p.device)


def codecs_for(cache: CacheDtype, head_dim: int, rope_dim: int, index_head_dim: int,
               dtype: torch.dtype) -> tuple[CacheCodec, CacheCodec]:
    """(KV codec, indexer codec) of ``cache`` for a model of these widths and compute dtype."""
    return (CacheCodec(cache.kv, head_dim, dtype, rope_dim=rope_dim),
            CacheCodec(cache.indexer, index_head_dim, dtype, indexer=True))


__all__ = ["CacheCodec", "CacheRows", "quant_query", "codecs_for", "FP8_MAX", "ROW_ALIGN"]
