"""Fixed-shape decode step over the paged pools: ``span`` tokens per sequence, no host syncs.

The graph-capturable twin of ``Transformer.forward_batch`` for decode rows: one token per
sequence, or an MTP verify span (below); reference/dsv4-architecture.md §3 for the math, §8.4
for graph mode. Every shape depends only on the bucket size B and the pool geometry, and every
index (ring slot, entry slot, state slot) is computed on the device from positions and block
tables, so the step can be captured as a CUDA graph, compiled by torch.compile / npugraph_ex
and replayed. Data-dependent branches are masks: a
compressor window that does not close this step writes its pooled entry to the pool's trash row;
attention and the indexer see every entry the tables can hold, masked to the causal ones. The
tables are as wide as the step's context bucket (``DecodeRunner``), so that is O(context).

Padding rows of a bucket use ``cache.pad_slot`` / ``cache.pad_win_blocks`` at position 0, so
they write only scratch state. Letters: B rows, h heads, d head dim, W window, N entries, k top-k.

A span of T > 1 tokens per sequence (an MTP verify step: the pending token and up to ``next_n``
drafts, reference/upstream-parallel-and-mtp.md) is B * T flat rows, token j of sequence b at row
``b * T + j`` with its own position and copy of the block tables; a sequence with fewer tokens
fills the rest of its T rows with padding rows. Every op but the compressor is row-wise or masked
by each row's position, so the flat rows run as one batch: the window ring takes all T writes
before attention reads it (the ring holds ``sliding_window + next_n`` rows, so a later token of the
span never overwrites a row an earlier one reads), and an entry a span token closes is visible
only to rows at or past its position. The compressor's remainder is one state slot per sequence,
so its T tokens update it in order (j = 0 .. T-1), as the eager path's verify sub-steps do
(``engine.core.batched_decode.DecodeSpans``).
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.core.kv_cache import PagedCache
from engine.core.paged_state import slot_mapping
from engine.checkpoint.fp8_mxfp4 import byte_lut
from engine.config import CSA_RATIO
from engine.model.attention import Attention, Compressor
from engine.model.moe import MoE
from engine.model.transformer import Block, Transformer
from engine.ops import reference
from engine.ops.packed import Packed, dequant
from engine.platform import Platform, detect

# A3 core budgets per branch (reference §8.3): (AI-cube, AI-vector) cores
CORES_COMPRESSOR = (16, 32)
CORES_MAIN = (24 - 8, 2 * (24 - 8))


def moe_experts_gathered(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2, limit: float,
                         act: str | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed experts without host syncs: each of the k slots gathers its rows' expert weights.

    Same math as ``reference.moe_experts`` (§3.7); costs ``B * I * H`` gathered weight elements per
    slot, so it suits decode buckets, not prefill. Accumulates in fp32 in slot order.

    Args:
        x: ``[B, H]``; ids, weights: ``[B, k]``; w1, w3: ``[E, I, H]``; w2: ``[E, H, I]``, dense or
            ``Packed`` (the B gathered experts' stored bytes are dequantised, ``B * I * H`` elements).
        act: activation quantisation (``reference.moe_experts``).
        out_dtype: the result's dtype (None: x.dtype); fp32 keeps the sum unrounded.
    Returns:
        ``[B, H]`` in ``out_dtype``.
    """
    if act is not None:
        x = reference.act_quant(x, act)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xb = x.unsqueeze(-1)                                                        # [B, H, 1]
    for j in range(ids.shape[1]):
        e = ids[:, j]
        g = torch.bmm(_gathered(w1, e, x.dtype), xb).squeeze(-1)                # [B, I]
        u = torch.bmm(_gathered(w3, e, x.dtype), xb).squeeze(-1)
        h = reference.swiglu_clamp(g, u, limit)
        if act is not None:
            h = reference.act_quant(h, act)
        y = torch.bmm(_gathered(w2, e, x.dtype), h.unsqueeze(-1)).squeeze(-1)   # [B, H]
        out += y.float() * weights[:, j:j + 1].float()
    return out.to(out_dtype or x.dtype)


def _gathered(w, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``idx`` (``[B]``) of stacked weights, dense ``[B, N, K]`` of ``dtype``."""
    return dequant(w.take(idx), dtype) if isinstance(w, Packed) else w[idx].to(dtype)


class LayerInputs(NamedTuple):
    """A layer's own tensors in the step: its pools (window ring ``[rows, d]``; compressed entries,
    compressor state, indexer entries and indexer compressor state, None where it has none) and
    its rope's cos / sin tables ``[max_model_len, r/2]`` fp32 (the compressors look entries'
    positions up in them)."""

    win: torch.Tensor
    cmp_kv: torch.Tensor | None
    comp: tuple | None
    idx_kv: torch.Tensor | None
    idx_comp: tuple | None
    rope: tuple[torch.Tensor, torch.Tensor]


class StaticDecoder:
    """One decode step for B sequences (one token each) with fixed shapes.

    Args:
        model: the loaded ``Transformer`` (its ops table is used for the row-wise ops).
        cache: the engine's ``PagedCache`` (pools updated in place, like the eager path).
        max_model_len: tokens per request; sizes the block-table widths and the RoPE tables.
        platform: streams and core limits (``detect("cpu")`` when None).
        multi_streams: run the compressors beside the query / KV projections on a side stream,
            and the shared expert beside the routed experts (§8.2); no-op on CPU.
        limit_core: A3 core budgets per stream (§8.3); needs ``multi_streams``.
        span: tokens per sequence (T; an MTP engine's ``1 + next_n``, module docstring). With T > 1
            the step also returns the output streams the MTP layer drafts from.
    Raises:
        ValueError: span past the CSA compress ratio (a span could close two windows of a slot).
    """

    def __init__(self, model: Transformer, cache: PagedCache, max_model_len: int, platform: Platform | None = None,
                 multi_streams: bool = False, limit_core: bool = False, span: int = 1):
        if not 1 <= span <= CSA_RATIO:
            raise ValueError(f"StaticDecoder: span must be 1 .. {CSA_RATIO}, got {span}")
        self.model, self.cache, self.max_model_len, self.span = model, cache, max_model_len, span
        self.platform = platform or detect("cpu")
        g = cache.geometry
        self.bs = g.block_size
        self.widths = {"win": g.blocks_needed("win", 0), "c4": g.blocks_needed("c4", max_model_len),
                       "c128": g.blocks_needed("c128", max_model_len)}
        dev = model.embed.weight.device
        pos = torch.arange(max_model_len, device=dev)
        # same fp32 values as RotaryTable.cos_sin per step, looked up instead of computed (no fp64)
        self.rope = {id(model.rope_main): model.rope_main.cos_sin(pos),
                     id(model.rope_compress): model.rope_compress.cos_sin(pos)}
        for dt in (torch.float32, torch.bfloat16):     # before any trace (fp8_mxfp4.byte_lut)
            byte_lut(dev, dt)
        p = self.platform
        self.side = p.new_stream() if multi_streams else None
        self.limit_core = limit_core and self.side is not None
        # decided here, not in the step: a graph tracer need not follow inspect.unwrap. A platform
        # kernel's ``why`` (shapes / dtypes -> the reason it would fall back, None: it runs them)
        # says when it is graph-safe: its fallback is the reference, which syncs the host
        kernel = inspect.unwrap(model.ops.moe_experts)
        self.moe_why = getattr(kernel, "why", None) if kernel is not reference.moe_experts else None
        # one layer of the step: ``layer_step`` as is, or its regionally compiled form (the CPU
        # runner's torch.compile: one graph per layer kind, shared by the layers of that kind)
        self.block = self.layer_step

    # ---- streams (plain no-op contexts when off: nothing for a graph tracer to trip on) ----
    def _side(self):
        return self.platform.side_stream(self.side) if self.side is not None else nullcontext()

    def _cores(self, budget: tuple[int, int]):
        return self.platform.limit_core(*budget) if self.limit_core else nullcontext()

    def _join(self, *made_on_side: torch.Tensor) -> None:
        if self.side is not None:
            self.platform.join(self.side, *made_on_side)

    # ---- inputs ----------------------------------------------------------------------------
    def tables(self, block_lists: list[dict[str, list[int]] | None], B: int, context: int | None = None
               ) -> dict[str, torch.Tensor]:
        """Block tables ``[B, width]`` int64 per pool from each row's block lists (host side);
        rows that are None or past ``len(block_lists)`` are padding (scratch ring, block 0
        elsewhere, masked). ``context``: the context bucket (every row's position < context; None:
        max_model_len): the entry tables hold the blocks of ``context`` tokens, so the step's
        attention and indexer cost O(context), not O(max_model_len)."""
        g = self.cache.geometry
        widths = self.widths if context is None else {
            "win": self.widths["win"], "c4": g.blocks_needed("c4", context), "c128": g.blocks_needed("c128", context)}
        pad = [i for i in range(B) if i >= len(block_lists) or block_lists[i] is None]
        out = {}
        for pool, w in widths.items():
            t = torch.zeros(B, max(w, 1), dtype=torch.long)
            for i, tables in enumerate(block_lists):
                blocks = [] if tables is None else tables.get(pool, [])[:max(w, 1)]
                t[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            if pool == "win" and pad:
                t[pad, :w] = torch.tensor(self.cache.pad_win_blocks, dtype=torch.long)
            out[pool] = t
        return out

    # ---- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, win_table: torch.Tensor,
                 c4_table: torch.Tensor, c128_table: torch.Tensor):
        """Run ``span`` flat rows per sequence (one token each) and update the pools.

        Args:
            tokens, positions, slots: ``[B * T]`` int64 (token id, its position = tokens already
                in the state before it, state slot; padding: 0, 0, ``cache.pad_slot``).
                win_table / c4_table / c128_table: ``[B * T, width]`` int64 (``tables``).
        Returns:
            ``[B * T, H]`` final hidden states (after hc_head and the final norm), compute dtype;
            with T > 1 also the ``[B * T, n, H]`` output streams before hc_head (residual dtype:
            the MTP layer's input, as ``Transformer.forward_batch(streams=True)``).
        """
        m, a = self.model, self.model.args
        tables = {"win": win_table, "c4": c4_table, "c128": c128_table}
        rope = {k: (cos[positions], sin[positions]) for k, (cos, sin) in self.rope.items()}
        emb = m.embed_tokens(tokens) if m.embed_tp is not None else F.embedding(tokens, m.embed.weight)
        X = m.residual_streams(emb)
        c = self.cache
        for i, layer in enumerate(m.layers):
            key = id(m._rope(layer.attn.ratio))
            own = LayerInputs(c.win[i], c.cmp_kv.get(i), c.comp.get(i), c.idx_kv.get(i), c.idx_comp.get(i),
                              self.rope[key])
            X = self.block(layer, X, tokens, positions, slots, tables, *rope[key], own)
        h = m.ops.hc_head(X, m.hc_head_fn, m.hc_head_scale, m.hc_head_base, a.rms_norm_eps, a.hc_eps)
        h = m.norm(h).to(m.dtype)
        return (h, X) if self.span > 1 else h

    def layer_step(self, layer: Block, X, tokens, positions, slots, tables, cos, sin, own: LayerInputs):
        """``Block.forward`` (§3.2) with the static attention and MoE: one layer of the step
        (``cos`` / ``sin``: its rope at the rows' positions; ``own``: its pools and rope tables).

        Nothing here names the layer's index or the identity of a model object, so the layers of
        one kind (compress ratio, indexer, routing), of any engine, trace to the same graph: a
        regional compile of this function compiles once per kind, not per layer.
        """
        y, post, comb = layer._hc_pre(X, "attn")
        o = self._attention(layer.attn, layer.attn_norm(y).to(layer.dtype), positions, slots, tables, cos, sin,
                            own)
        X = layer.ops.hc_post(o, X, post, comb)
        y, post, comb = layer._hc_pre(X, "ffn")
        f = self._moe(layer.ffn, layer.ffn_norm(y).to(layer.dtype), tokens)
        return layer.ops.hc_post(f, X, post, comb)

    def _attention(self, att: Attention, x, positions, slots, tables, cos, sin, own: LayerInputs):
        """``Attention.forward`` (§3.3) for one token per row, over the layer's paged pools."""
        B, ops, c = x.shape[0], att.ops, self.cache
        win, cmp_kv, comp, idx_kv, idx_comp, rope = own
        pool = "c4" if att.ratio == CSA_RATIO else "c128"
        with self._side(), self._cores(CORES_COMPRESSOR):
            if att.compressor is not None:      # entries written before attention reads them
                self._compress_span(att.compressor, x, positions, slots, cmp_kv, comp, tables[pool],
                                    c.trash_row[pool], x.dtype, rope)
            if att.indexer is not None:
                self._compress_span(att.indexer.compressor, x, positions, slots, idx_kv, idx_comp,
                                    tables["c4"], c.trash_row["c4"], c.idx_codec.dtype, rope)
        with self._cores(CORES_MAIN):
            c_q = att.q_norm(att.wq_a(x))
            q = att.wq_b(c_q).view(B, att.n_heads, att.head_dim)
            q = ops.rope(ops.rms_norm(q, None, att.eps), cos, sin)
            kv = ops.rope(att.kv_norm(att.wkv(x)), cos, sin)
            if att.indexer is not None:
                iq, iw = att.indexer.project(x, c_q, cos, sin)
        self._join()
        # window ring: write this token; the seam's decode ops then read positions p-W+1 .. p and
        # the entries, without host positions: masked over the context bucket the tables span
        W, R, bs = att.window, self.widths["win"] * self.bs, self.bs
        ops.cache_write(win, slot_mapping(tables["win"], bs, (positions % R)[:, None])[:, 0], kv)
        table = tables[pool] if att.compressor is not None else None
        bound = tables["c4"].shape[1] * bs * CSA_RATIO          # >= the context bucket: position + 1 <= it
        topk = None
        if att.indexer is not None:
            topk = ops.decode_indexer_topk(iq, iw, idx_kv, tables["c4"], bs, positions, None, CSA_RATIO,
                                           att.indexer.topk, att.indexer.head_dim ** -0.5, max_seqlen=bound)
        o = ops.decode_sparse_attn(q, positions, None, win, tables["win"], R, W,
                                   cmp_kv if table is not None else None, table, att.ratio, topk,
                                   att.attn_sink, att.head_dim ** -0.5, bs, max_seqlen=bound)
        return att.out_proj(ops.rope(o, cos, -sin))              # o_proj TP inside under several ranks

    def _compress_span(self, comp: Compressor, x, positions, slots, pool, state, table, trash: int, out_dtype,
                       rope):
        """``reference.compressor`` (§3.4) for the step's rows: the projections of all rows at
        once (the weights read once), then ``_compress`` for token j = 0 .. T-1 of every sequence
        in order, its T rows sharing one state slot (module docstring)."""
        xf = comp.wkv.quant_input(x).float()
        r = positions % comp.ape.shape[0]
        kv = comp.ops.linear(xf, comp.wkv.dense_weight(torch.float32))
        score = comp.ops.linear(xf, comp.wgate.dense_weight(torch.float32)) + comp.ape.float()[r]
        T = self.span
        if T == 1:
            return self._compress(comp, kv, score, positions, slots, pool, state, table, trash, out_dtype, rope)
        for j in range(T):
            self._compress(comp, kv[j::T], score[j::T], positions[j::T], slots[j::T], pool, state, table[j::T],
                           trash, out_dtype, rope)

    def _compress(self, comp: Compressor, kv, score, positions, slots, pool, state, table, trash: int, out_dtype,
                  rope):
        """One token per row (its projections ``kv`` / ``score`` ``[B, width]`` fp32, score with
        ape): update the fp32 remainder in the state slot, pool the window, and write the entry
        (or, when the window stays open, trash)."""
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
        rows = slot_mapping(table, self.bs, torch.where(shut, positions // m, 0)[:, None])[:, 0]
        comp.ops.cache_write(pool, torch.where(shut, rows, torch.full_like(rows, trash)), entry)

    def _moe(self, moe: MoE, x, tokens):
        """``MoE.forward`` (§3.7); the shared expert on the side stream when multi-streams are on.
        Over several ranks (``engine.parallel.moe.ParallelMoE``) the routed experts take its
        fixed-shape path, with this step's expert function on the rank's shard."""
        weights, ids = moe.gate(x, tokens)
        with self._side():
            shared = moe.shared_experts(x) if moe.shared_experts is not None else None
        routed_fixed = getattr(moe, "routed_fixed", None)
        if routed_fixed is not None:
            y = routed_fixed(x, ids, weights, lambda xa, i, w: self._experts(moe, xa, i, w, torch.float32))
            y = y.to(x.dtype)
        else:
            y = self._experts(moe, x, ids, weights, x.dtype)
        self._join(*(() if shared is None else (shared,)))
        return y if shared is None else y + shared

    def _experts(self, moe: MoE, x, ids, weights, out_dtype: torch.dtype) -> torch.Tensor:
        """Routed experts of ``moe.experts`` (ids local to them) -> ``[B, H]`` ``out_dtype``."""
        e = moe.experts
        if self.moe_why is not None and self.moe_why(x, ids, *e.stored(), e.act) is None:
            # the platform kernel (grouped matmul with a device-side group list; W8A8 as stored)
            return moe.ops.moe_experts(x, ids, weights, *e.stored(), moe.limit, e.act).to(out_dtype)
        return moe_experts_gathered(x, ids, weights, *e.stored(), moe.limit, e.act, out_dtype)


def layer_kinds(model: Transformer) -> set[tuple]:
    """The distinct layer kinds of ``model`` (compress ratio, indexer, hash routing): how many
    graphs a regional compile of ``StaticDecoder.layer_step`` makes per bucket."""
    def hashed(b: Block) -> bool:
        return getattr(getattr(b.ffn, "gate", None), "tid2eid", None) is not None
    return {(b.attn.ratio, b.attn.indexer is not None, hashed(b)) for b in model.layers}
