"""Ops over the stored decode-state caches (reference/dsv4-architecture.md §4, §7, §8.1).

Part of the reference ops (``engine.ops.reference``). A pool is a ``engine.ops.cache_codec.CacheRows``
(the codec's stored parts ``[rows, w_i]``, flat row = ``block * block_size + offset``); these ops take
the pool itself plus the block table of one sequence, so a platform kernel can read the stored
parts as they are (quantised keys, scales) instead of decoded rows. The reference decodes the rows a
query can see (``CacheRows.read``) and runs the plain attention math of
``engine.ops.reference.attention``: its numerics are exactly the model's today, which reads the
decoded stored rows too (with a quantised key cache the indexer queries are quantised alike,
``quant_query``).

Letters as in ``engine.ops.reference``; bs block size (entries / slots per block).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.ops.reference.attention import indexer_topk, sparse_attn

if TYPE_CHECKING:
    from engine.ops.cache_codec import CacheRows


def _rows(table: torch.Tensor, bs: int, idx: torch.Tensor) -> torch.Tensor:
    """Flat pool rows of logical slots ``idx`` through a block table ``[n_blocks]``."""
    table = table.to(device=idx.device, dtype=torch.long)
    return table[idx // bs] * bs + idx % bs


def cache_write(rows: CacheRows, idx: torch.Tensor, x: torch.Tensor) -> None:
    """Store rows ``x`` at flat pool rows ``idx``, quantised by the pool's codec (``rows.write``).

    Args:
        rows: the pool; idx: ``[N]`` int64 flat rows, each in ``[0, rows.num_rows)`` (no -1 skip);
        x: ``[N, dim]`` float rows (rounded to the codec's compute dtype first, as the kernels take it).
    Returns None; ``rows.parts`` are updated in place.
    Raises:
        IndexError / RuntimeError: an index outside the pool, or ``x`` not ``[N, dim]``.
    """
    rows.write(idx, x)


def cache_indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: CacheRows, block_table: torch.Tensor,
                       block_size: int, positions: torch.Tensor, ratio: int, topk: int, scale: float) -> torch.Tensor:
    """Lightning-indexer top-k over one sequence's stored indexer keys (§3.5, ``indexer_topk``).

    Entry i of the sequence lives at pool row ``block_table[i // bs] * bs + i % bs``; the query at
    position p sees entries ``i < (p+1) // ratio``. With a quantised key cache each (token, head)
    query row is quantised like a key row and dequantised (``quant_query``: A3 int8 per token-head
    with an fp16 scale; FP8 / HiF8 alike), then scored against the decoded keys.

    Args:
        q: ``[T, h, dI]`` roped indexer queries (compute dtype); weights: ``[T, h]`` fp32 (already
            * h^-0.5); keys: the pool (``CacheRows`` of an indexer codec); block_table: ``[n_blocks]``
            int32 / int64; block_size: entries per block; positions: ``[T]`` int64 ascending.
    Returns:
        ``[T, topk]`` int64 entry ids (sequence-local), ascending; ``-1`` pads rows with fewer candidates.
    Raises:
        IndexError: the table holds fewer blocks than the closed windows need.
    """
    from engine.ops.cache_codec import quant_query
    k = closed_entries(keys, block_table, block_size, positions, ratio)
    return indexer_topk(quant_query(keys.codec, q), weights, k.to(q.device), positions, ratio, topk, scale)


def closed_entries(keys: CacheRows, block_table: torch.Tensor, block_size: int, positions: torch.Tensor,
                   ratio: int) -> torch.Tensor:
    """The ``(positions[-1] + 1) // ratio`` entries a sequence's queries can see, decoded
    ``[N, dim]`` (compute dtype); entry i at pool row ``block_table[i // bs] * bs + i % bs``."""
    n = int(positions[-1] + 1) // ratio if positions.shape[0] else 0
    return keys.read(_rows(block_table, block_size, torch.arange(n, device=keys.device)))


def cache_sparse_attn(q: torch.Tensor, positions: torch.Tensor, win: CacheRows, win_table: torch.Tensor,
                      ring_len: int, window: int, cmp: CacheRows | None, cmp_table: torch.Tensor | None,
                      cmp_ratio: int, topk_idx: torch.Tensor | None, sinks: torch.Tensor, scale: float,
                      block_size: int) -> torch.Tensor:
    """Shared-KV attention with sink over one sequence's stored window ring and compressed entries
    (§3.3 steps 4-6, ``sparse_attn``), reading the decoded stored rows.

    Window: position p lives in ring slot ``p % ring_len`` at pool row ``win_table[s // bs] * bs +
    s % bs``; the ring must still hold positions ``max(0, p_first - window + 1) .. p_last``.
    Compressed entry i lives at ``cmp_table[i // bs] * bs + i % bs``; the ``(p_last + 1) //
    cmp_ratio`` closed windows are read (all of them attended on HCA, the indexer's picks on CSA).

    Args:
        q: ``[T, h, d]``; positions: ``[T]`` int64, consecutive. win / cmp: KV pools (``CacheRows``
            of a KV codec; cmp None on window-only layers, then cmp_table and topk_idx are None);
        win_table ``[ring_len / bs]`` / cmp_table ``[n_blocks]``: int32 / int64 block tables;
        topk_idx: ``[T, k]`` int64 sequence-local entry ids (-1 = none) or None; sinks ``[h]`` fp32.
    Returns:
        ``[T, h, d]`` in q.dtype.
    Raises:
        ValueError: the ring is too short for the chunk (``T + window - 1 > ring_len``).
    """
    T = q.shape[0]
    if T == 0:
        return torch.empty_like(q)
    p0, p1 = int(positions[0]), int(positions[-1])
    w0 = max(0, p0 - window + 1)
    if p1 + 1 - w0 > ring_len:
        raise ValueError(f"cache_sparse_attn: positions {w0}..{p1} do not fit a window ring of {ring_len} slots")
    pos = torch.arange(w0, p1 + 1, device=win.device)
    win_kv = win.read(_rows(win_table, block_size, pos % ring_len)).to(q.device)
    cmp_kv = None if cmp is None else closed_entries(cmp, cmp_table, block_size, positions, cmp_ratio).to(q.device)
    return sparse_attn(q, positions, win_kv, w0, window, cmp_kv, cmp_ratio, topk_idx, sinks, scale)
