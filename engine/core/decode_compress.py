"""The compressor (reference/dsv4-architecture.md §3.4) for the rows of a decode step, over the
paged state pools: one token per row and sequence at a time, no host syncs.

``Compressor.forward`` runs one sequence's span against its own remainder; here the B rows of a
step (each a different request's state slot) update their remainders at once. A window that does
not close at a row's token still pools (the row's entry goes to the pool's trash row), so the
step's shapes do not depend on the positions; the pooled values of a closing row are those of
``Compressor.forward`` (same row-wise math, rope looked up in the step's fp32 tables).
"""
from __future__ import annotations

import torch

from engine.config import CSA_RATIO
from engine.core.block_manager import slot_mapping
from engine.model.attention import Compressor


def compress_span(comp: Compressor, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool, state,
                  table: torch.Tensor, trash: int, out_dtype: torch.dtype, rope, block_size: int,
                  span: int) -> None:
    """The compressor for a step's ``B * span`` flat rows (token j of sequence b at row
    ``b * span + j``): the projections of all rows at once (the weights read once), then
    ``compress_rows`` for token j = 0 .. span-1 of every sequence in order, the span's rows
    sharing one state slot.

    Args:
        comp: the layer's (or its indexer's) ``Compressor``. x: ``[B * span, H]`` (normed).
        positions, slots: ``[B * span]`` int64 (padding rows: position 0, the scratch slot).
        pool: the entry pool (``CacheRows``); state: (kv, score) ``[slots, rows, c*d]`` fp32.
        table: ``[B * span, width]`` int64 entry blocks per row; trash: the pool's trash row.
        rope: the layer's (cos, sin) tables ``[max_model_len, r/2]`` fp32.
    """
    xf = comp.wkv.quant_input(x).float()
    r = positions % comp.ape.shape[0]
    kv = comp.ops.linear(xf, comp.wkv.dense_weight(torch.float32))
    score = comp.ops.linear(xf, comp.wgate.dense_weight(torch.float32)) + comp.ape.float()[r]
    if span == 1:
        return compress_rows(comp, kv, score, positions, slots, pool, state, table, trash, out_dtype, rope, block_size)
    for j in range(span):
        compress_rows(comp, kv[j::span], score[j::span], positions[j::span], slots[j::span], pool, state,
                      table[j::span], trash, out_dtype, rope, block_size)


def compress_rows(comp: Compressor, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, pool, state, table: torch.Tensor, trash: int, out_dtype: torch.dtype,
                  rope, block_size: int) -> None:
    """One token per row (its projections ``kv`` / ``score`` ``[B, width]`` fp32, score with
    ape): update the fp32 remainder in the state slot, pool the window, and write the entry
    (or, when the window stays open, trash). CSA's overlap keeps the previous window's first
    half in rows ``m .. 2m`` of the slot (§3.4)."""
    m, width = comp.ape.shape
    overlap = m == CSA_RATIO
    d = width // 2 if overlap else width
    skv, ssc = state
    r = positions % m
    skv[slots, r] = kv
    ssc[slots, r] = score
    cur_kv, cur_sc = skv[slots, :m], ssc[slots, :m]                         # [B, m, width]
    closing = (r == m - 1)[:, None, None]
    if overlap:
        prev_kv, prev_sc = skv[slots, m:2 * m, :d], ssc[slots, m:2 * m, :d]
        ckv = torch.cat([prev_kv, cur_kv[..., d:]], dim=1)                  # [B, 2m, d]
        csc = torch.cat([prev_sc, cur_sc[..., d:]], dim=1)
        skv[slots, m:2 * m, :d] = torch.where(closing, cur_kv[..., :d], prev_kv)
        ssc[slots, m:2 * m, :d] = torch.where(closing, cur_sc[..., :d], prev_sc)
    else:
        ckv, csc = cur_kv, cur_sc
    pooled = (ckv * csc.softmax(dim=1)).sum(dim=1)                           # [B, d]
    first = positions - r                                                     # entry position m * i
    cos, sin = rope                     # the layer's rope, which its compressors share
    entry = comp.ops.rope(comp.norm(pooled), cos[first], sin[first]).to(out_dtype)
    # an open window's entry index may lie past the table (the last window of max_model_len):
    # look up entry 0 instead, then send the write to the trash row
    shut = closing[:, 0, 0]
    rows = slot_mapping(table, block_size, torch.where(shut, positions // m, 0)[:, None])[:, 0]
    comp.ops.cache_write(pool, torch.where(shut, rows, torch.full_like(rows, trash)), entry)
