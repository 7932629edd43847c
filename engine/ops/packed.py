"""Weights kept as the checkpoint stores them, and their dequantisation one tile at a time.

A ``Packed`` is one linear's stored tensors (reference/dsv4-architecture.md §2.1, §7; the table
in ``engine.checkpoint.layout``): ``data`` + ``scale`` (+ ``bias`` for int4) in the checkpoint's
own dtypes and shapes, with an optional leading expert dim (stacked routed experts). Resident bytes
are the stored bytes; the reference ops dequantise a bounded tile (``tile_rows``) or one expert per
call, never a whole weight, and a device kernel takes the stored tensors as they are.

Dequantisation is elementwise and exact where the format allows (FP8 / FP4 / MX values times a
power of two are exact in fp32 and bf16; int8 / int4 / HiF8 times an fp32 per-row scale round once,
as the whole-weight dequantisation does), so a tile equals the same rows of the dense weight.

Formats (``fmt``) and the row unit a tile must start on:

=========  =====================================  ==========================  ========
fmt        data ``[.., N', K']``                  scale                       row unit
=========  =====================================  ==========================  ========
fp8        float8_e4m3fn ``[N, K]``               e8m0 ``[ceil(N/bo), ceil(K/bi)]``  bo
fp4        int8 ``[N, K/2]`` (even col low)       e8m0 ``[N, K/32]``          1
mxfp4      uint8 ``[N, K/2]``                     uint8 e8m0 ``[N, K/32]``    1
mxfp8      float8_e4m3fn ``[N, K]``               uint8 e8m0 ``[N, K/32]``    1
int8       int8 ``[N, K]``                        fp32 ``[N, 1]``             1
int4       int8 ``[N/2, K]`` (row 2j low)         uint64 ``[N, 1]`` + bias    2
hif8       uint8 ``[N, K]``                       fp32 ``[N, 1]``             1
=========  =====================================  ==========================  ========
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.checkpoint.fp8_mxfp4 import QuantFormatError, dequant_mxfp4, e4m3_to_float, e8m0_to_float
from engine.checkpoint.hif8 import hif8_decode
from engine.checkpoint.int8_int4 import dequant_int, u64_to_scale, unpack_int4_rows
from engine.checkpoint.mx import dequant_mx

FORMATS = ("fp8", "fp4", "mxfp4", "mxfp8", "int8", "int4", "hif8")
# Elements of one dequantised tile: bounds the transient a reference op makes, and tiles never
# depend on the number of activation rows (batch invariance). On a device 64 MiB in fp32 (few
# kernel launches); on CPU 1 MiB, which stays in cache between the cast and the GEMM (a bf16 LM
# head cast tile by tile then runs as fast as an fp32 one).
TILE_ELEMENTS = 1 << 24
CPU_TILE_ELEMENTS = 1 << 18


def tile_elements(device: torch.device) -> int:
    """``TILE_ELEMENTS`` on an accelerator, ``CPU_TILE_ELEMENTS`` on CPU."""
    return CPU_TILE_ELEMENTS if device.type == "cpu" else TILE_ELEMENTS


class Packed(NamedTuple):
    """One stored linear (or a stack of experts): see the module table.

    ``block``: the FP8 ``weight_block_size`` (bo, bi); ``offset``: where ``data[0, 0]`` lies in its
    first scale block (a rank's shard cut inside a block, ``engine.parallel.cuts``). Other formats
    ignore both.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    bias: torch.Tensor | None = None
    block: tuple[int, int] = (128, 128)
    offset: tuple[int, int] = (0, 0)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical ``(.., N, K)`` of the dense weight."""
        *lead, n, k = self.data.shape
        if self.fmt in ("fp4", "mxfp4"):
            k *= 2
        elif self.fmt == "int4":
            n *= 2
        return (*lead, n, k)

    def expert(self, e: int) -> "Packed":
        """Expert ``e`` of a stacked ``[E, ..]`` Packed."""
        return Packed(self.data[e], self.scale[e], self.fmt, None if self.bias is None else self.bias[e], self.block,
                      self.offset)

    def take(self, idx: torch.Tensor) -> "Packed":
        """Experts ``idx`` (``[B]`` int64) of a stacked Packed, gathered: ``[B, ..]`` (no host sync)."""
        return Packed(self.data[idx], self.scale[idx], self.fmt, None if self.bias is None else self.bias[idx],
                      self.block, self.offset)

    def span(self, e0: int, e1: int) -> "Packed":
        """Experts ``e0 .. e1 - 1`` of a stacked Packed, as views: ``[e1 - e0, ..]``."""
        return Packed(self.data[e0:e1], self.scale[e0:e1], self.fmt, None if self.bias is None else self.bias[e0:e1],
                      self.block, self.offset)


def row_unit(fmt: str) -> int:
    """Rows of one stored byte row: a tile (and a row shard) must start on a multiple of it."""
    return 2 if fmt == "int4" else 1


def col_unit(fmt: str) -> int:
    """Input columns a column shard must start on: one byte (FP4 packs two) and one MX scale group
    (32). FP8 block scales may be cut anywhere (``Packed.offset``)."""
    return 32 if fmt in ("fp4", "mxfp4", "mxfp8") else 1


def tile_rows(p: Packed) -> int:
    """Rows per dequantised tile: ``tile_elements / K`` rounded down to the format's row unit."""
    unit = row_unit(p.fmt)
    return max(unit, tile_elements(p.data.device) // max(p.shape[-1], 1) // unit * unit)


def dequant(p: Packed, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows ``[r0, r1)`` (default all) of a Packed as a dense ``[.., r1 - r0, K]`` tensor of ``dtype``.

    A stacked Packed (``[E, ..]`` or ``take``'s ``[B, ..]``) is dequantised whole (``rows`` must be
    None); its N must be a multiple of the row unit and of the FP8 block (true of every expert
    shape and of its shards on block boundaries).

    Raises:
        ValueError: an unknown fmt, or r0 not on the format's row unit.
        engine.checkpoint.fp8_mxfp4.QuantFormatError: a scale that does not fit its weight.
    """
    if p.data.dim() > 2:
        lead, (n, k) = p.data.shape[:-2], p.shape[-2:]
        if p.fmt == "fp8" and (n % p.block[0] or p.offset[0]):
            return torch.stack([dequant(p.expert(e), dtype) for e in range(p.data.shape[0])]).view(*lead, n, k)
        flat = Packed(p.data.flatten(0, -2), p.scale.flatten(0, -2), p.fmt,
                      None if p.bias is None else p.bias.flatten(), p.block, p.offset)
        return dequant(flat, dtype).view(*lead, n, k)
    n = p.shape[-2]
    r0, r1 = rows if rows is not None else (0, n)
    unit = row_unit(p.fmt)
    if r0 % unit or (r1 % unit and r1 != n):
        raise ValueError(f"dequant: rows [{r0}, {r1}) of a {p.fmt} weight must start on a multiple of {unit}")
    w, s, fmt = p.data, p.scale, p.fmt
    if fmt == "fp8":
        out = _fp8_rows(p, r0, r1)
    elif fmt == "fp4":
        out = dequant_mxfp4(w[r0:r1], s[r0:r1], dtype)
    elif fmt in ("mxfp4", "mxfp8"):
        out = dequant_mx(w[r0:r1], s[r0:r1])
    elif fmt == "int8":
        out = dequant_int(w[r0:r1], s[r0:r1])
    elif fmt == "int4":
        out = dequant_int(unpack_int4_rows(w[r0 // 2:-(-r1 // 2)])[: r1 - r0], u64_to_scale(s[r0:r1]))
    elif fmt == "hif8":
        out = hif8_decode(w[r0:r1]) * s[r0:r1].float()
    else:
        raise ValueError(f"dequant: unknown weight format {fmt!r} (expected one of {', '.join(FORMATS)})")
    return out.to(dtype)


def _fp8_rows(p: Packed, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of an FP8 block-scaled weight, fp32 (§2.1: ``fp8(W) * 2^(e - 127)`` per
    ``bo x bi`` block, the grid shifted by ``p.offset``)."""
    (bo, bi), (o_r, o_c), k = p.block, p.offset, p.data.shape[-1]
    g0, g1 = o_r + r0, o_r + r1
    s = e8m0_to_float(p.scale[g0 // bo:-(-g1 // bo)])
    if s.shape[-1] * bi < o_c + k or s.shape[0] * bo < g1 - g0 // bo * bo:
        raise QuantFormatError(f"FP8 scale grid {tuple(p.scale.shape)} does not cover a [{p.shape[-2]}, {k}] "
                               f"weight at offset {p.offset} with blocks {p.block}")
    w = e4m3_to_float(p.data[r0:r1])
    n = r1 - r0
    if g0 % bo == 0 and o_c == 0 and n % bo == 0 and k % bi == 0:         # whole blocks: broadcast the scales
        return (w.view(n // bo, bo, k // bi, bi) * s[:, None, :k // bi, None]).view(n, k)
    return w * s.repeat_interleave(bo, 0)[g0 % bo:g0 % bo + n].repeat_interleave(bi, 1)[:, o_c:o_c + k]


def tiles(p: Packed):
    """``(r0, r1)`` row tiles covering a 2-D Packed (``tile_rows`` each, the last shorter)."""
    n, t = p.shape[-2], tile_rows(p)
    return [(r, min(n, r + t)) for r in range(0, n, t)]


def stored_cut(fmt: str, tensor: str, dim: int, first: int, length: int, ndim: int,
               block: tuple[int, int] = (128, 128)) -> tuple[int, int, int] | None:
    """A cut ``(dim, first, length)`` of the logical weight as a cut of its stored ``tensor``
    ("data", "scale" or "bias"; ``dim`` counted in a tensor of ``ndim`` dims, the last two N, K),
    or None when that tensor is kept whole (a per-row scale on a column cut, a bias on a column
    cut). An FP8 scale keeps every block the cut touches (``Packed.offset`` places the data in it).

    Raises:
        ValueError: the cut does not fall on the format's row / column units (say which).
    """
    row, col = dim == ndim - 2, dim == ndim - 1
    if not (row or col):
        return dim, first, length                                   # an expert dim: same in every tensor
    unit = row_unit(fmt) if row else col_unit(fmt)
    if first % unit or length % unit:
        raise ValueError(f"a {fmt} weight can only be cut on multiples of {unit} "
                         f"{'rows' if row else 'input columns'}, not [{first}, {first + length})")
    if tensor == "bias":
        return (ndim - 2, first, length) if row else None
    if tensor == "data":
        div = 2 if (col and fmt in ("fp4", "mxfp4")) or (row and fmt == "int4") else 1
        return dim, first // div, length // div
    if fmt == "fp8":
        b = block[0] if row else block[1]
        return dim, first // b, -(-(first + length) // b) - first // b
    if col and fmt in ("fp4", "mxfp4", "mxfp8"):
        return dim, first // 32, length // 32
    return None if col else (dim, first, length)


def cut_offset(fmt: str, cuts, ndim: int, block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    """``Packed.offset`` of an FP8 weight after logical ``cuts``: where its first kept element lies
    in its first scale block ((0, 0) for other formats)."""
    if fmt != "fp8":
        return 0, 0
    o = [0, 0]
    for d, lo, _ in cuts:
        if d >= ndim - 2:
            o[d - (ndim - 2)] = lo % block[d - (ndim - 2)]
    return o[0], o[1]
