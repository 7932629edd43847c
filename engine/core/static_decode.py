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
so its T tokens update it in order (j = 0 .. T-1) (``engine.core.decode_compress``).

The same code is the eager batched decode path (``run``): uncompiled, with the rows' positions
also on the host (``pos``), the seam's decode ops take their exact per-row form (entries grouped
by count, no masked tail: ``engine.ops.reference.decode``) and the MoE its eager form
(``MoE.forward``), so each row's result is the bits of the per-sequence path
(``Attention.forward``; ``tests/engine/test_batched_decode.py``). The MTP layer's short rows
(verify catch-up, chained drafts) run through it too (``mtp``).
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.checkpoint.fp8_mxfp4 import byte_lut
from engine.config import CSA_RATIO
from engine.core.block_manager import slot_mapping
from engine.core.decode_compress import compress_span
from engine.core.kv_cache import PagedCache
from engine.model.attention import Attention
from engine.model.moe import MoE
from engine.model.transformer import Block, Transformer
from engine.ops import reference
from engine.ops.reference.moe import moe_experts_gathered
from engine.platform import Platform, detect

NO_BLOCK = 1 << 40                    # the eager step's block-table padding: past every pool
# A3 core budgets per branch (reference §8.3): (AI-cube, AI-vector) cores
CORES_COMPRESSOR = (16, 32)
CORES_MAIN = (24 - 8, 2 * (24 - 8))


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
    """The decode step for B sequences (``span`` tokens each at most): fixed shapes for a graph,
    exact per-row ops eager (``run``).

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
        dev = self.device = model.embed.weight.device
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
    def tables(self, block_lists: list[dict[str, list[int]] | None], B: int, context: int | None = None,
               pad_block: int = 0) -> dict[str, torch.Tensor]:
        """Block tables ``[B, width]`` int64 per pool from each row's block lists (host side);
        rows that are None or past ``len(block_lists)`` are padding (scratch ring, block 0
        elsewhere, masked). ``context``: the context bucket (every row's position < context; None:
        max_model_len): the entry tables hold the blocks of ``context`` tokens, so the step's
        attention and indexer cost O(context), not O(max_model_len). ``pad_block``: the entry
        tables' id past a row's own blocks (the eager step's ``NO_BLOCK``: a row reaching past
        what it holds, a caller's allocation bug, fails instead of writing another's block; a
        graph's masked reads need an id in range)."""
        g = self.cache.geometry
        widths = self.widths if context is None else {
            "win": self.widths["win"], "c4": g.blocks_needed("c4", context), "c128": g.blocks_needed("c128", context)}
        pad = [i for i in range(B) if i >= len(block_lists) or block_lists[i] is None]
        out = {}
        for pool, w in widths.items():
            t = torch.full((B, max(w, 1)), 0 if pool == "win" else pad_block, dtype=torch.long)
            for i, tables in enumerate(block_lists):
                blocks = [] if tables is None else tables.get(pool, [])[:max(w, 1)]
                t[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            if pool == "win" and pad:
                t[pad, :w] = torch.tensor(self.cache.pad_win_blocks, dtype=torch.long)
            out[pool] = t
        return out

    def inputs(self, rows: list[tuple[list[int], int, int, dict]], B: int, T: int, C: int, pad_block: int = 0
               ) -> tuple[list[torch.Tensor], list[int]]:
        """(token ids, first position, state slot, block tables) per row -> the step's ``B * T``
        flat rows (token j of row b at ``b * T + j``, padding past a row's tokens and past its
        rows) on the device, with the entry tables of context C, and the flat rows' positions on
        the host."""
        c = self.cache
        assert len(rows) <= B and all(1 <= len(r[0]) <= T for r in rows)
        toks, pos, slots = [0] * (B * T), [0] * (B * T), [c.pad_slot] * (B * T)
        blocks: list[dict | None] = [None] * (B * T)
        for b, (ids, p0, slot, tables) in enumerate(rows):
            n = len(ids)
            toks[b * T:b * T + n] = ids
            pos[b * T:b * T + n] = range(p0, p0 + n)
            slots[b * T:b * T + n] = [slot] * n
            blocks[b * T:b * T + n] = [tables] * n
        t = self.tables(blocks, B * T, C, pad_block)
        out = [torch.tensor(toks, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
               torch.tensor(slots, dtype=torch.long), t["win"], t["c4"], t["c128"]]
        return [x.to(self.device, non_blocking=True) for x in out], pos

    def run(self, rows: list[tuple[list[int], int, int, dict]]):
        """The eager batched decode step: ``rows`` as ``inputs`` takes them (1 .. ``span`` tokens
        each, room already allocated) -> hidden ``[n, H]`` of their n tokens in order, with
        ``span`` > 1 also their output streams ``[n, hc, H]``; the pools advance. Exact per row
        (module docstring); spans are padded to the longest in ``rows``, not to ``span``. No rows:
        a step of zero rows (an idle attention-DP rank still joins the collectives)."""
        T = max((len(r[0]) for r in rows), default=1)
        inputs, pos = self.inputs(rows, len(rows), T, max((r[1] + len(r[0]) for r in rows), default=1), NO_BLOCK)
        out = self(*inputs, pos=pos, span=T)
        if T == 1:
            return out
        idx = torch.tensor([b * T + j for b, r in enumerate(rows) for j in range(len(r[0]))], dtype=torch.long,
                           device=self.device)
        return tuple(o[idx] for o in out) if isinstance(out, tuple) else out[idx]

    # ---- the step --------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, win_table: torch.Tensor,
                 c4_table: torch.Tensor, c128_table: torch.Tensor, pos: list[int] | None = None,
                 span: int | None = None):
        """Run ``span`` flat rows per sequence (one token each) and update the pools.

        Args:
            tokens, positions, slots: ``[B * T]`` int64 (token id, its position = tokens already
                in the state before it, state slot; padding: 0, 0, ``cache.pad_slot``).
                win_table / c4_table / c128_table: ``[B * T, width]`` int64 (``tables``).
            pos: the positions on the host (the eager step: exact per-row ops); None: the
                fixed-shape step (masked, no host positions: what a graph captures).
            span: T (None: the decoder's ``span``).
        Returns:
            ``[B * T, H]`` final hidden states (after hc_head and the final norm), compute dtype;
            with a decoder ``span`` > 1 also the ``[B * T, n, H]`` output streams before hc_head
            (residual dtype: the MTP layer's input, as ``Transformer.forward_batch(streams=True)``).
        """
        m, a = self.model, self.model.args
        T = span or self.span
        tables = {"win": win_table, "c4": c4_table, "c128": c128_table}
        rope = {k: (cos[positions], sin[positions]) for k, (cos, sin) in self.rope.items()}
        emb = m.embed_tokens(tokens) if m.embed_tp is not None else F.embedding(tokens, m.embed.weight)
        X = m.residual_streams(emb)
        c = self.cache
        block = self.block if pos is None else self.layer_step     # the eager step is never the compiled one
        for i, layer in enumerate(m.layers):
            key = id(m._rope(layer.attn.ratio))
            own = LayerInputs(c.win[i], c.cmp_kv.get(i), c.comp.get(i), c.idx_kv.get(i), c.idx_comp.get(i),
                              self.rope[key])
            X = block(layer, X, tokens, positions, slots, tables, *rope[key], own, pos, T)
        h = m.ops.hc_head(X, m.hc_head_fn, m.hc_head_scale, m.hc_head_base, a.rms_norm_eps, a.hc_eps)
        h = m.norm(h).to(m.dtype)
        return (h, X) if self.span > 1 else h

    def mtp(self, X_in: torch.Tensor, tokens_next: torch.Tensor, rows: list[tuple[int, int, list[int]]],
            layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``layer`` (§3.8) over short spans of rows, eager and exact (``Transformer.
        forward_mtp``'s values): ``rows`` (first position, rows 1 .. ``span``, ring blocks) per
        sequence; X_in ``[n, hc, H]`` and tokens_next ``[n]`` their rows in order. Returns (output
        streams ``[n, hc, H]``, hidden ``[n, H]``); the MTP rings advance (the ring holds
        ``sliding_window + next_n`` rows, so a span's rows write before any reads)."""
        m, c = self.model, self.cache
        blk = m.mtp[layer]
        T, B = max((n for _, n, _ in rows), default=1), len(rows)
        pick = [b * T + j for b, (_, n, _) in enumerate(rows) for j in range(n)]
        flat = [(list(range(n)), p0, c.pad_slot, {"win": win}) for p0, n, win in rows]
        (_, positions, slots, win_t, c4_t, c128_t), pos = self.inputs(flat, B, T, max((p + n for p, n, _ in rows),
                                                                                      default=1))
        idx = torch.tensor(pick, dtype=torch.long, device=self.device)
        tok = torch.zeros(B * T, dtype=torch.long, device=self.device)
        tok[idx] = tokens_next
        X = torch.zeros((B * T, *X_in.shape[1:]), dtype=X_in.dtype, device=self.device)
        X[idx] = X_in
        X = blk.mtp_input(X, m.embed_tokens(tok))
        cos, sin = self.rope[id(m.rope_main)]
        own = LayerInputs(c.mtp_win[layer], None, None, None, None, (cos, sin))
        tables = {"win": win_t, "c4": c4_t, "c128": c128_t}
        X = self.layer_step(blk, X, tok, positions, slots, tables, cos[positions], sin[positions], own, pos, T)
        return X[idx], blk.mtp_output(X)[idx]

    def layer_step(self, layer: Block, X, tokens, positions, slots, tables, cos, sin, own: LayerInputs,
                   pos: list[int] | None = None, span: int = 1):
        """``Block.forward`` (§3.2) with the static attention and MoE: one layer of the step
        (``cos`` / ``sin``: its rope at the rows' positions; ``own``: its pools and rope tables;
        ``pos`` / ``span``: ``__call__``'s).

        Nothing here names the layer's index or the identity of a model object, so the layers of
        one kind (compress ratio, indexer, routing), of any engine, trace to the same graph: a
        regional compile of this function compiles once per kind, not per layer.
        """
        y, post, comb = layer._hc_pre(X, "attn")
        o = self._attention(layer.attn, layer.attn_norm(y).to(layer.dtype), positions, slots, tables, cos, sin,
                            own, pos, span)
        X = layer.ops.hc_post(o, X, post, comb)
        y, post, comb = layer._hc_pre(X, "ffn")
        f = self._moe(layer.ffn, layer.ffn_norm(y).to(layer.dtype), tokens, pos is not None)
        return layer.ops.hc_post(f, X, post, comb)

    def _attention(self, att: Attention, x, positions, slots, tables, cos, sin, own: LayerInputs, pos, span):
        """``Attention.forward`` (§3.3) for one token per row, over the layer's paged pools."""
        B, ops, c, bs = x.shape[0], att.ops, self.cache, self.bs
        win, cmp_kv, comp, idx_kv, idx_comp, rope = own
        pool = "c4" if att.ratio == CSA_RATIO else "c128"
        with self._side(), self._cores(CORES_COMPRESSOR):
            if att.compressor is not None:      # entries written before attention reads them
                compress_span(att.compressor, x, positions, slots, cmp_kv, comp, tables[pool], c.trash_row[pool],
                              x.dtype, rope, bs, span)
            if att.indexer is not None:
                compress_span(att.indexer.compressor, x, positions, slots, idx_kv, idx_comp, tables["c4"],
                              c.trash_row["c4"], c.idx_codec.dtype, rope, bs, span)
        with self._cores(CORES_MAIN):
            c_q = att.q_norm(att.wq_a(x))
            q = att.wq_b(c_q).view(B, att.n_heads, att.head_dim)
            q = ops.rope(ops.rms_norm(q, None, att.eps), cos, sin)
            kv = ops.rope(att.kv_norm(att.wkv(x)), cos, sin)
            if att.indexer is not None:
                iq, iw = att.indexer.project(x, c_q, cos, sin)
        self._join()
        # window ring: write this token; the seam's decode ops then read positions p-W+1 .. p and
        # the entries: by the host positions (eager), or masked over the context the tables span
        W, R = att.window, self.widths["win"] * bs
        ops.cache_write(win, slot_mapping(tables["win"], bs, (positions % R)[:, None])[:, 0], kv)
        table = tables[pool] if att.compressor is not None else None
        bound = None if pos is not None else tables["c4"].shape[1] * bs * CSA_RATIO   # >= position + 1
        topk = None
        if att.indexer is not None:
            topk = ops.decode_indexer_topk(iq, iw, idx_kv, tables["c4"], bs, positions, pos, CSA_RATIO,
                                           att.indexer.topk, att.indexer.head_dim ** -0.5, max_seqlen=bound)
        o = ops.decode_sparse_attn(q, positions, pos, win, tables["win"], R, W,
                                   cmp_kv if table is not None else None, table, att.ratio, topk,
                                   att.attn_sink, att.head_dim ** -0.5, bs, max_seqlen=bound)
        return att.out_proj(ops.rope(o, cos, -sin))              # o_proj TP inside under several ranks

    def _moe(self, moe: MoE, x, tokens, eager: bool):
        """``MoE.forward`` (§3.7): as it is (eager), or with the fixed-shape routed experts of a
        captured step (``_experts``; over several ranks ``ParallelMoE.routed_fixed``)."""
        if eager:
            return moe(x, tokens)
        return moe(x, tokens, routed=lambda xa, ids, w: self._experts(moe, xa, ids, w))

    def _experts(self, moe: MoE, x, ids, weights) -> torch.Tensor:
        """Routed experts of ``moe.experts`` (ids local to them) -> ``[B, H]`` fp32."""
        e = moe.experts
        if self.moe_why is not None and self.moe_why(x, ids, *e.stored(), e.act) is None:
            # the platform kernel (grouped matmul with a device-side group list; W8A8 as stored)
            return moe.ops.moe_experts(x, ids, weights, *e.stored(), moe.limit, e.act).float()
        return moe_experts_gathered(x, ids, weights, *e.stored(), moe.limit, e.act, torch.float32)


def layer_kinds(model: Transformer) -> set[tuple]:
    """The distinct layer kinds of ``model`` (compress ratio, indexer, hash routing): how many
    graphs a regional compile of ``StaticDecoder.layer_step`` makes per bucket."""
    def hashed(b: Block) -> bool:
        return getattr(getattr(b.ffn, "gate", None), "tid2eid", None) is not None
    return {(b.attn.ratio, b.attn.indexer is not None, hashed(b)) for b in model.layers}
