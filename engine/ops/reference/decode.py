"""Decode ops over the stored pools for a batch of requests, one query each (§3.3 steps 4-6, §3.5, §8.1).

Part of the reference ops (``engine.ops.reference``). ``cache_sparse_attn`` / ``cache_indexer_topk``
take one sequence; these take B rows of B requests with their block tables ``[B, n_blocks]``,
which is the form the fused kernels take (TND queries with ``cu_seqlens``, paged keys with a block
table per sequence), so a decode step calls each kernel once per layer, not once per request.

Each row's result is bit-identical to the per-sequence op on that row alone: the per-row products
go through ``row_scores`` / ``row_mix`` (batched matmuls of a fixed number of rows whatever the
batch; row-wise ops do not mix rows), and rows whose softmax lengths differ (HCA entry counts, CSA
before its first entry) are reduced in separate groups, since a longer reduction rounds
differently. The grouping uses ``pos`` (the positions on the host, which the scheduler has), so
the reference needs no host sync to find it.

A captured step has no host positions: with ``pos=None`` each op runs one masked group over every
entry the block table can hold (the step's context bucket: O(context)), a fixed shape for any
positions, and ``max_seqlen`` (the bucket) bounds every row's position + 1 for the kernels'
tiling. Same math; a row's softmax then spans the masked entries too (exp(-inf) = 0 terms), so it
can differ from the grouped path in the last bits (tokens held equal by ``test_graph_decode.py``).

Letters as in ``engine.ops.reference``; B rows, W window, bs block size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.ops.reference.attention import csa_pick_width, leading_picks, topk_low_index, weighted_relu_sum
from engine.ops.reference.blas import row_mix, row_scores

if TYPE_CHECKING:
    from engine.ops.cache_codec import CacheRows


def table_rows(table: torch.Tensor, bs: int, idx: torch.Tensor) -> torch.Tensor:
    """Flat pool rows of logical slots ``idx [B, k]`` through per-row block tables ``[B, n_blocks]``."""
    return table.gather(1, idx // bs) * bs + idx % bs


def groups(keys: list[int]) -> list[tuple[int, torch.Tensor]]:
    """(key, row indices) per distinct key, in first-seen order."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return [(k, torch.tensor(v, dtype=torch.long)) for k, v in out.items()]


def window_rows(win_table: torch.Tensor, positions: torch.Tensor, ring_len: int, window: int, bs: int):
    """Ring rows ``[B, W]`` of positions ``p-W+1 .. p`` per row and their validity (position >= 0);
    position q lives in ring slot ``q % ring_len`` of the row's ring blocks ``win_table [B, n]``."""
    wpos = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)
    return table_rows(win_table, bs, wpos % ring_len), wpos >= 0


def keys_first_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """``weighted_relu_sum(q k^T)`` (§3.5's index scores) with the keys as the untransposed left
    operand of both products: ``[B, N, dI] x [B, dI, h]``, then ``[B, N, h] x [B, h, 1]``. The
    ``[B, h, dI] x [B, dI, N]`` form reads the N keys as the transposed operand of a skinny GEMM,
    which ran at ~5 GB/s on CPU against the ~34 the keys stream at (docs/benchmarks.md, the decode
    grid at 128K). Same products, summed in another order. q ``[B, h, dI]``, k ``[B, N, dI]`` fp32,
    weights ``[B, h]`` -> ``[B, N]`` fp32."""
    s = torch.bmm(k, q.transpose(1, 2)).clamp_min_(0)                              # [B, N, h]
    return torch.bmm(s, (weights.float() * scale).unsqueeze(-1)).squeeze(-1)


def decode_indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: CacheRows, block_table: torch.Tensor,
                        block_size: int, positions: torch.Tensor, pos: list[int] | None, ratio: int, topk: int,
                        scale: float, max_seqlen: int | None = None) -> torch.Tensor:
    """Lightning-indexer top-k (§3.5) for one query per row over each row's stored keys
    (``cache_indexer_topk`` of each row alone).

    Args:
        q: ``[B, h, dI]`` roped indexer queries (compute dtype); weights: ``[B, h]`` fp32 (already
            * h^-0.5); keys: the indexer pool (``CacheRows``); block_table: ``[B, n_blocks]``
            int64 (padding past a row's blocks is never read); block_size: entries per block;
            positions: ``[B]`` int64 and ``pos`` the same on the host (None: no host positions,
            one masked group; ``max_seqlen`` then bounds position + 1); the row at position p
            sees entries ``i < (p+1) // ratio``.
    Returns:
        ``[B, topk]`` int64 entry ids (row-local), ascending; ``-1`` pads rows with fewer candidates.
    """
    from engine.ops.cache_codec import quant_query
    if pos is None:                     # every entry the table holds, masked to the causal ones
        N = block_table.shape[1] * block_size
        idx = torch.arange(N, device=q.device)
        k = keys.read(table_rows(block_table, block_size, idx.expand(q.shape[0], N))).float()
        s = keys_first_scores(quant_query(keys.codec, q).float(), k, weights, scale)
        allowed = idx[None] < ((positions + 1) // ratio)[:, None]
        return topk_low_index(s.masked_fill(~allowed, float("-inf")), allowed, topk)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for n, g in groups([(p + 1) // ratio for p in pos]):
        if n == 0:
            continue
        g = g.to(q.device)
        idx = torch.arange(n, device=q.device).expand(len(g), n)
        k = keys.read(table_rows(block_table[g], block_size, idx)).float()          # [b, N, dI]
        s = weighted_relu_sum(row_scores(quant_query(keys.codec, q[g]).float(), k), weights[g], scale)
        out[g] = topk_low_index(s, torch.ones_like(s, dtype=torch.bool), topk)
    return out


def decode_sparse_attn(q: torch.Tensor, positions: torch.Tensor, pos: list[int] | None, win: CacheRows,
                       win_table: torch.Tensor, ring_len: int, window: int, cmp: CacheRows | None,
                       cmp_table: torch.Tensor | None, cmp_ratio: int, topk_idx: torch.Tensor | None,
                       sinks: torch.Tensor, scale: float, block_size: int, max_seqlen: int | None = None) -> torch.Tensor:
    """Shared-KV attention with sink (§3.3 steps 4-6) for one query per row over each row's stored
    window ring and compressed entries (``cache_sparse_attn`` of each row alone).

    Window: the row at position p attends positions ``max(0, p-W+1) .. p``, position q in ring
    slot ``q % ring_len`` of its ring blocks (the current token already written). Compressed: its
    ``(p+1) // cmp_ratio`` closed entries, all of them (HCA) or the indexer's picks (CSA).

    Args:
        q: ``[B, h, d]`` (roped); positions ``[B]`` int64 and ``pos`` the same on the host (None:
            one masked group over every entry of ``cmp_table``; ``max_seqlen`` bounds position + 1);
        win: the window pool; win_table: ``[B, ring_len / bs]`` int64 ring blocks per row;
        cmp: the entry pool or None (window-only layers, or no row holds an entry yet; then
            cmp_table / topk_idx are None);
        cmp_table: ``[B, n_blocks]`` int64; topk_idx: ``[B, k]`` int64 row-local entry ids
        (-1 = none) on CSA layers, None on HCA; sinks ``[h]`` fp32; block_size: slots per block.
    Returns:
        ``[B, h, d]`` in q.dtype (still roped).
    """
    B, h, d = q.shape
    rows, valid = window_rows(win_table, positions, ring_len, window, block_size)
    wk = win.read(rows).float().masked_fill(~valid[..., None], 0.0)                  # [B, W, d]
    if pos is None:
        return _masked_attn(q, positions, wk, valid, cmp, cmp_table, cmp_ratio, topk_idx, sinks, scale, block_size)
    if cmp is None:
        keys = [0] * B
    elif topk_idx is not None:
        keys = [csa_pick_width(p, cmp_ratio, topk_idx.shape[1]) for p in pos]
    else:
        keys = [(p + 1) // cmp_ratio for p in pos]
    qf, o = q.float(), torch.empty_like(q)
    for n, g in groups(keys):
        g = g.to(q.device)
        kq, wg = qf[g], wk[g]
        scores = [row_scores(kq, wg).mul(scale).masked_fill(~valid[g][:, None], float("-inf"))]
        ck = None
        if n and topk_idx is not None:                                           # CSA: the indexer's picks
            t = leading_picks(topk_idx[g], n)
            ck = cmp.read(table_rows(cmp_table[g], block_size, t.clamp_min(0))).float()   # [b, k, d]
            scores.append(row_scores(kq, ck).mul(scale).masked_fill(~(t >= 0)[:, None], float("-inf")))
        elif n:                                                                  # HCA: every closed entry
            idx = torch.arange(n, device=q.device).expand(len(g), n)
            ck = cmp.read(table_rows(cmp_table[g], block_size, idx)).float()            # [b, N, d]
            scores.append(row_scores(kq, ck).mul(scale))
        sink = sinks.float().view(1, h, 1).expand(len(g), h, 1)
        logits = torch.cat(scores + [sink], dim=-1)
        probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)
        og = row_mix(probs[..., :window], wg)
        if ck is not None:
            og = og + row_mix(probs[..., window:-1], ck)
        o[g] = og.to(q.dtype)
    return o


def _masked_attn(q, positions, wk, valid, cmp, cmp_table, cmp_ratio, topk_idx, sinks, scale, bs):
    """``decode_sparse_attn`` without host positions: one group of all B rows, HCA over every
    entry ``cmp_table`` holds masked to the row's closed ones, CSA over the picks masked to -1."""
    B, h, _ = q.shape
    qf = q.float()
    scores = [torch.einsum("bhd,bwd->bhw", qf, wk).mul(scale).masked_fill(~valid[:, None], float("-inf"))]
    ck = None
    if cmp is not None and cmp_table is not None and topk_idx is not None:      # CSA: the indexer's picks
        ck = cmp.read(table_rows(cmp_table, bs, topk_idx.clamp_min(0))).float()            # [B, k, d]
        s = torch.einsum("bhd,bkd->bhk", qf, ck).mul(scale)
        scores.append(s.masked_fill((topk_idx < 0)[:, None], float("-inf")))
    elif cmp is not None and cmp_table is not None:                             # HCA: the closed entries
        N = cmp_table.shape[1] * bs
        idx = torch.arange(N, device=q.device)
        ck = cmp.read(table_rows(cmp_table, bs, idx.expand(B, N))).float()                 # [B, N, d]
        seen = idx[None] < ((positions + 1) // cmp_ratio)[:, None]
        scores.append(torch.einsum("bhd,bnd->bhn", qf, ck).mul(scale).masked_fill(~seen[:, None], float("-inf")))
    W = wk.shape[1]
    logits = torch.cat(scores + [sinks.float().view(1, h, 1).expand(B, h, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)
    o = torch.einsum("bhw,bwd->bhd", probs[..., :W], wk)
    if ck is not None:
        o = o + torch.einsum("bhn,bnd->bhd", probs[..., W:-1], ck)
    return o.to(q.dtype)
