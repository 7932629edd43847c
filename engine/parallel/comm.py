"""Row collectives over one ``GroupInfo`` (torch.distributed; gloo on CPU, hccl / nccl on devices).

Everything moves whole rows (dim 0) of uneven counts with ``all_to_all_single`` and explicit
split sizes, which gloo supports; payloads travel as raw bytes (``uint8`` views), so any dtype
(bf16 included, which gloo cannot reduce) crosses unchanged. Gloo has no reduce_scatter, so a
reduce-scatter is an all_to_all followed by a sum in ascending rank order (the same order on every
rank, so the result does not depend on the transport). Only ``all_reduce_sum`` reduces in the
backend (fp32). A group of size 1 short-circuits every call (no communication).
Letters: T this rank's rows, N the group's rows (sum of counts), s the group size.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.parallel.context import GroupInfo


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` any dtype -> ``[n, row bytes]`` uint8 (a view of a contiguous copy)."""
    return x.contiguous().reshape(x.shape[0], math.prod(x.shape[1:])).view(torch.uint8)


def _unbytes(b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_bytes``: rows of ``like``'s dtype and trailing shape."""
    if b.numel() == 0:                  # no bytes to reinterpret (no rows, or rows of zero width)
        return torch.empty((b.shape[0], *like.shape[1:]), dtype=like.dtype, device=b.device)
    return b.contiguous().view(like.dtype).view(b.shape[0], *like.shape[1:])


def counts(n: int, g: GroupInfo) -> list[int]:
    """Every rank's row count ``n``, in group rank order (one all_gather of an int64)."""
    if g.size == 1:
        return [n]
    out = torch.zeros(g.size, dtype=torch.int64)
    dist.all_gather(list(out.unbind(0)), torch.tensor(n, dtype=torch.int64), group=g.group)
    return out.tolist()


def exchange_counts(send: list[int], g: GroupInfo) -> list[int]:
    """``send[j]`` rows this rank will send to group rank j -> rows it receives from each rank."""
    if g.size == 1:
        return list(send)
    out = torch.zeros(g.size, dtype=torch.int64)
    dist.all_to_all_single(out, torch.tensor(send, dtype=torch.int64), group=g.group)
    return out.tolist()


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], g: GroupInfo) -> torch.Tensor:
    """x ``[sum(send), ...]`` (consecutive blocks of ``send[j]`` rows for group rank j) ->
    ``[sum(recv), ...]`` (blocks from rank 0, 1, ... in order), same dtype and trailing shape."""
    if g.size == 1:
        return x
    b = _bytes(x)
    out = b.new_empty(sum(recv), b.shape[1])
    dist.all_to_all_single(out, b, recv, send, group=g.group)
    return _unbytes(out, x)


def gather_rows(x: torch.Tensor, g: GroupInfo, c: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """x ``[T, ...]`` -> (every rank's rows concatenated in rank order ``[N, ...]``, the counts).
    ``c``: the counts when known (``ParallelContext.counts``): no count exchange, a fixed shape."""
    if g.size == 1:
        return x, [x.shape[0]]
    c = c or counts(x.shape[0], g)
    return all_to_all_rows(x.repeat(g.size, *([1] * (x.dim() - 1))), [x.shape[0]] * g.size, c, g), c


def scatter_sum(parts: torch.Tensor, c: list[int], g: GroupInfo) -> torch.Tensor:
    """Reduce-scatter of rows: parts ``[N, ...]`` (``c[j]`` rows belonging to rank j, in order) on
    every rank -> ``[T, ...]`` fp32, the sum over the group of this rank's block (rank order)."""
    parts = parts.float()
    if g.size == 1:
        return parts
    got = all_to_all_rows(parts, c, [c[g.index]] * g.size, g).view(g.size, c[g.index], *parts.shape[1:])
    out = torch.zeros_like(got[0])
    for j in range(g.size):
        out += got[j]
    return out


def all_reduce_sum(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    """Sum of ``x`` (same shape on every rank) over the group, in fp32; the result is the same on
    every rank (each element is reduced once and broadcast)."""
    x = x.float().contiguous()
    if g.size > 1:
        dist.all_reduce(x, group=g.group)
    return x


def all_reduce_max(n: int, g: GroupInfo) -> int:
    """The largest ``n`` over the group."""
    if g.size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.group)
    return int(t.item())


def all_gather_cols(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    """x ``[T, C]`` (same shape on every rank) -> ``[T, s*C]``: rank j's columns at ``[j*C, (j+1)*C)``."""
    if g.size == 1:
        return x
    b = _bytes(x)
    out = b.new_empty(g.size, *b.shape)
    dist.all_gather(list(out.unbind(0)), b, group=g.group)
    cols = _unbytes(out.view(g.size * x.shape[0], b.shape[1]), x).view(g.size, *x.shape)
    return cols.permute(1, 0, 2).reshape(x.shape[0], g.size * x.shape[1])
