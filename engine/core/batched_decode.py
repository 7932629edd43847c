"""Decode rows of many requests in one set of tensor ops (reference/dsv4-architecture.md §3.3-§3.5).

``Attention.forward`` walks the packed batch sequence by sequence: right for prefill chunks, but
at decode it runs the window, compressors, indexer and sparse attention once per request and
layer, a few dozen small ops each. Here every single-token row whose state lives in the same
``PagedCache`` goes through them together: ring / entry / state-slot indices are computed once
per step (``DecodeRows``, the model's per-step decode context: ``PagedSequenceState.decode_context``
builds it, ``Attention.forward`` calls its ``attend``), and each layer updates the state of
all rows at once, then calls the seam's batched decode ops (``decode_indexer_topk``,
``decode_sparse_attn``: a fused kernel per layer on a device, ``engine.ops.reference.decode`` here).

Every row's result is bit-identical to the per-sequence path (``tests/engine/test_batched_decode.py``):
the compressor rows are the same row-wise math, and the reference decode ops are exact per row
(``engine.ops.reference.decode``).
Letters: B rows, h heads, d head dim, W window, k top-k, N entries, m compress ratio.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import CSA_RATIO
from engine.core.block_manager import slot_mapping
from engine.ops import reference
from engine.ops.reference import gemm

if TYPE_CHECKING:
    from engine.core.kv_cache import PagedCache


NO_BLOCK = 1 << 40                    # block-table padding: past every pool
PROFILE_LABEL = "decode_rows"         # torch.profiler label of one layer's batched decode attention


@dataclass
class DecodeRows:
    """Single-token rows of a packed batch over one ``PagedCache``, with their indices.

    seq: index of each row's sequence in the batch; rows ``[B]``: its packed row; positions
    ``[B]`` int64 (the new token's position p) and ``pos`` the same as ints; slots ``[B]``: state
    slots; win_write ``[B]``: ring row of p; tables: per pool ("win": the ring blocks ``[B,
    ring_len / bs]``; "c4" / "c128": entry blocks ``[B, max blocks]`` padded with ``NO_BLOCK``), int64.
    """

    cache: "PagedCache"
    seq: list[int]
    rows: torch.Tensor
    positions: torch.Tensor
    pos: list[int]
    slots: torch.Tensor
    win_write: torch.Tensor
    tables: dict[str, torch.Tensor]

    @classmethod
    def build(cls, cache: "PagedCache", states: list, spans: list[tuple[int, int, int]],
              window: int) -> "DecodeRows | None":
        """The rows of ``spans`` (``(offset, length, start_pos)`` per sequence) with one token whose
        state is over ``cache``: a ``PagedSequenceState``, or a window-only ``PagedLayerState`` (an
        MTP layer's ring: its table only, no state slot); None when there are none."""
        pick = [j for j, (st, (_, n, _)) in enumerate(zip(states, spans))
                if n == 1 and getattr(st, "cache", None) is cache]
        if not pick:
            return None
        dev, bs, ring = cache.device, cache.config.block_size, cache.geometry.ring_len
        pos = [spans[j][2] for j in pick]
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        rows = torch.tensor([spans[j][0] for j in pick], dtype=torch.long, device=dev)
        if not hasattr(states[pick[0]], "held"):            # window-only layer states
            win = torch.stack([states[j].win_table for j in pick])
            return cls(cache, pick, rows, positions, pos, torch.zeros_like(positions),
                       slot_mapping(win, bs, (positions % ring)[:, None])[:, 0], {"win": win})
        held = [states[j].held for j in pick]
        win = torch.tensor([h.tables["win"] for h in held], dtype=torch.long, device=dev)
        tables = {"win": win}
        for p in ("c4", "c128"):
            width = max(len(h.tables.get(p, [])) for h in held)
            if width:
                # padding past a row's own blocks: an out-of-range block id, so a row reaching
                # past what it holds (a caller's allocation bug) fails instead of writing into
                # another request's block
                t = torch.full((len(pick), width), NO_BLOCK, dtype=torch.long, device=dev)
                for i, h in enumerate(held):
                    t[i, :len(h.tables[p])] = torch.tensor(h.tables[p], dtype=torch.long, device=dev)
                tables[p] = t
        return cls(cache, pick, rows, positions, pos,
                   torch.tensor([h.state_slot for h in held], dtype=torch.long, device=dev),
                   slot_mapping(win, bs, (positions % ring)[:, None])[:, 0], tables)


    def attend(self, att, lstates: list, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
               iq: torch.Tensor | None, iw: torch.Tensor | None) -> torch.Tensor:
        """``Attention.forward``'s per-sequence body for these rows of one layer: ``attend_rows``."""
        return attend_rows(att, self, lstates, x, q, kv, iq, iw)


@dataclass
class DecodeSpans:
    """Verify spans (MTP: the pending token and its drafts, up to ``1 + next_n`` tokens) of many
    requests, run as ``DecodeRows`` sub-steps: sub-step j holds token j of every span longer than j.

    Within a layer the sub-steps run in order, so token j sees the ring rows, compressor
    remainders and entries tokens 0..j-1 left, as a chunk of the span does in the per-sequence
    path (its chunking invariance makes the two bit-identical); the projections, MoE and mHC of
    all tokens still run as one batch. ``seq`` / ``rows`` / ``attend`` as ``DecodeRows``' (rows
    sub-step by sub-step); ``where[j]``: the indices into ``seq`` of sub-step j's sequences.
    """

    steps: list[DecodeRows]
    seq: list[int]
    rows: torch.Tensor
    where: list[list[int]]

    @classmethod
    def build(cls, cache: "PagedCache", states: list, spans: list[tuple[int, int, int]], window: int,
              max_span: int) -> "DecodeRows | DecodeSpans | None":
        """The spans of 1..``max_span`` tokens over ``cache``; a plain ``DecodeRows`` when all have
        one token (or ``max_span`` is 1), None when there are none."""
        pick = [j for j, (st, (_, n, _)) in enumerate(zip(states, spans))
                if 1 <= n <= max_span and getattr(st, "cache", None) is cache]
        longest = max((spans[j][1] for j in pick), default=0)
        if longest <= 1:
            return DecodeRows.build(cache, states, spans, window)
        steps, where = [], []
        for t in range(longest):
            idx = [i for i, j in enumerate(pick) if spans[j][1] > t]
            steps.append(DecodeRows.build(cache, [states[pick[i]] for i in idx],
                                          [(spans[pick[i]][0] + t, 1, spans[pick[i]][2] + t) for i in idx], window))
            where.append(idx)
        return cls(steps, pick, torch.cat([s.rows for s in steps]), where)

    def attend(self, att, lstates: list, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
               iq: torch.Tensor | None, iw: torch.Tensor | None) -> torch.Tensor:
        """``DecodeRows.attend`` per sub-step, in order; returns ``[R, h, d]`` in ``rows``' order."""
        out, o = torch.empty_like(q), 0
        for step, idx in zip(self.steps, self.where):
            sl = slice(o, o + len(idx))
            out[sl] = attend_rows(att, step, [lstates[i] for i in idx], x[sl], q[sl], kv[sl],
                                  None if iq is None else iq[sl], None if iw is None else iw[sl])
            o += len(idx)
        return out


def compress_rows(comp, x: torch.Tensor, dec: DecodeRows, state_pool: tuple[torch.Tensor, torch.Tensor],
                  entry_pool: torch.Tensor, table: torch.Tensor | None, entries, out_dtype: torch.dtype,
                  remainders: list) -> None:
    """``reference.compressor`` (§3.4) for one token per row, over the state and entry pools.

    x ``[B, H]``; state_pool: (kv, score) ``[slots, rows, c*d]`` fp32; entry_pool: the entries'
    ``CacheRows`` (rows of d, written through its codec); table
    ``[B, nb]`` of the entry pool; entries: each row's ``PagedEntries`` (their counts advance);
    remainders: each row's ``CompressorState`` (views of its slot), whose ``journal`` (a verify
    span's, ``engine.core.spec_decode.Rollback``) gets the row's input as ``Compressor.forward``
    records it. A row whose window closes (p % m == m-1) pools it and writes entry p // m.
    """
    for i, st in enumerate(remainders):
        if st is not None and st.journal is not None:
            st.journal.append((comp, x[i:i + 1], dec.pos[i], out_dtype))
    m, width = comp.ape.shape
    overlap = m == CSA_RATIO
    d = width // 2 if overlap else width
    xf = comp.wkv.quant_input(x).float()
    r = dec.positions % m
    kv = gemm(xf, comp.wkv.dense_weight(torch.float32).float())
    score = gemm(xf, comp.wgate.dense_weight(torch.float32).float()) + comp.ape.float()[r]
    skv, ssc = state_pool
    shut = [i for i, p in enumerate(dec.pos) if p % m == m - 1]
    if len(shut) < len(dec.pos):
        keep = torch.tensor([i for i, p in enumerate(dec.pos) if p % m != m - 1], dtype=torch.long)
        skv[dec.slots[keep], r[keep]] = kv[keep]
        ssc[dec.slots[keep], r[keep]] = score[keep]
    if not shut:
        return
    c = torch.tensor(shut, dtype=torch.long)
    s = dec.slots[c]
    ckv = torch.cat([skv[s, :m - 1], kv[c, None]], dim=1)                   # [n, m, c*d]
    csc = torch.cat([ssc[s, :m - 1], score[c, None]], dim=1)
    if overlap:
        prev_kv, prev_sc = skv[s, m:2 * m, :d], ssc[s, m:2 * m, :d]
        skv[s, m:2 * m, :d] = ckv[:, :, :d]
        ssc[s, m:2 * m, :d] = csc[:, :, :d]
        ckv = torch.cat([prev_kv, ckv[:, :, d:]], dim=1)                      # [n, 2m, d]
        csc = torch.cat([prev_sc, csc[:, :, d:]], dim=1)
    pooled = (ckv * csc.softmax(dim=1)).sum(dim=1)                            # [n, d]
    e = dec.positions[c] // m
    cos, sin = comp.rope.cos_sin(e * m)
    out = reference.rope(reference.rms_norm(pooled, comp.norm.weight, comp.norm.eps), cos, sin).to(out_dtype)
    comp.ops.cache_write(entry_pool, slot_mapping(table[c], dec.cache.config.block_size, e[:, None])[:, 0], out)
    for i in shut:
        entries[i].num_entries += 1


def attend_rows(att, dec: DecodeRows, lstates: list, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                iq: torch.Tensor | None, iw: torch.Tensor | None) -> torch.Tensor:
    """``Attention.forward``'s per-sequence body for all decode rows of one layer (§3.3 steps 4-6).

    x ``[B, H]``, q ``[B, h, d]``, kv ``[B, d]`` (roped), iq / iw the indexer's projections;
    lstates: each row's ``PagedLayerState`` of this layer. Updates the ring, the compressor states
    and the entry pools; returns the attention output ``[B, h, d]`` (still roped) in q.dtype.
    The indexer and the attention are one seam op each for all rows (``decode_indexer_topk``,
    ``decode_sparse_attn``: one kernel call per layer on a device).
    """
    with torch.profiler.record_function(PROFILE_LABEL):
        s0, bs, ops = lstates[0], dec.cache.config.block_size, att.ops
        ops.cache_write(s0.win_pool, dec.win_write, kv)
        cmp = table = topk = None
        if att.compressor is not None:
            pool_name = "c4" if att.ratio == CSA_RATIO else "c128"
            cmp, table = s0.cmp_kv.pool, dec.tables.get(pool_name)
            compress_rows(att.compressor, x, dec, s0.comp_pool, cmp, table, [s.cmp_kv for s in lstates], kv.dtype,
                          [s.comp for s in lstates])
            if att.indexer is not None:
                idx = att.indexer
                compress_rows(idx.compressor, x, dec, s0.idx_comp_pool, s0.idx_kv.pool, dec.tables.get("c4"),
                              [s.idx_kv for s in lstates], s0.idx_kv.pool.dtype, [s.idx_comp for s in lstates])
                topk = ops.decode_indexer_topk(iq, iw, s0.idx_kv.pool, dec.tables.get("c4"), bs, dec.positions,
                                               dec.pos, CSA_RATIO, idx.topk, idx.head_dim ** -0.5)
        if table is None:               # no row holds an entry block yet: nothing to attend but the window
            cmp = topk = None
        return ops.decode_sparse_attn(q, dec.positions, dec.pos, s0.win_pool, dec.tables["win"],
                                      dec.cache.geometry.ring_len, att.window, cmp, table, att.ratio, topk,
                                      att.attn_sink, att.head_dim ** -0.5, bs)
