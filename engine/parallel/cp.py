"""Zig-zag context-parallel (CP) prefill of one sequence over a torch.distributed group.

reference/upstream-parallel-and-mtp.md "Parallel strategy": the prompt is cut into ``2*cp`` chunks,
rank r runs chunks r and ``2*cp-1-r`` (balancing the causal attention work). Everything row-wise
(mHC, norms, projections, MoE; EP / TP collectives under ``model.parallel``) runs on the rank's
rows. Per layer one all_gather (window-only layers) or two (CSA / HCA) carry what crosses chunks:

  * the last ``ALIGN`` (128) rows of each chunk's attention input x (after attn_norm), a fixed
    ``[2, 128, H]`` per rank (compute dtype); each chunk re-runs the MLA prolog (kv) over the previous chunk's tail
    for its window ring, and the CSA compressors over its last window for the overlap state (HCA
    needs nothing: chunk starts are 128-aligned);
  * the chunk's new compressed entries ``[~L/(cp*m), d]`` (CSA: ``[~L/(4cp), d + dI]``, main |
    indexer keys side by side), padded to the largest per-rank count (counts follow from the chunking, so none are exchanged), reordered
    into sequence order so the indexer and sparse attention see the whole compressed history
    (causality is masked by position inside ``ops.indexer_topk`` / ``ops.sparse_attn``).

The rank owning the last non-empty chunk then broadcasts the window rings and compressor
remainders, so every rank returns the same full ``SequenceState`` (reference/dsv4-architecture.md
§4). Letters: L prompt tokens, T a rank's rows, H hidden, d head dim, dI indexer head dim.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.ops.cache_codec import quant_query
from engine.config import CSA_RATIO
from engine.model.transformer import Block, Transformer
from engine.ops.reference import num_new_entries
from engine.model.state import SequenceState

ALIGN = 128   # chunk starts: a multiple of every compress ratio and >= sliding_window
_AS_BYTES = (torch.bfloat16, torch.float16)   # gloo has no bf16 / int16 collectives


def zigzag_chunks(L: int, cp: int, align: int = 128) -> list[tuple[int, int]]:
    """(start, end) of the 2*cp chunks of a length-L prompt; every start a multiple of `align`
    (so HCA windows never straddle chunks); chunk i goes to rank i if i < cp else 2*cp-1-i; trailing
    chunks may be empty.

    The ``ceil(L/align)`` aligned blocks are dealt out evenly, the first chunks taking one more;
    only the last non-empty chunk may be shorter than its blocks (it ends at L). Empty chunks are
    ``(L, L)``. Raises ValueError for L < 0, cp < 1 or align < 1.
    """
    if L < 0 or cp < 1 or align < 1:
        raise ValueError(f"zigzag_chunks: need L >= 0, cp >= 1, align >= 1; got L={L}, cp={cp}, align={align}")
    base, extra = divmod(-(-L // align), 2 * cp)
    out, u = [], 0
    for i in range(2 * cp):
        k = base + (i < extra)
        out.append((min(u * align, L), min((u + k) * align, L)))
        u += k
    return out


def _owner(c: int, cp: int) -> tuple[int, int]:
    """Chunk c -> (rank, slot 0/1 among that rank's two chunks)."""
    return (c, 0) if c < cp else (2 * cp - 1 - c, 1)


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` (same shape on every rank) -> ``[world, *t.shape]``; 2-byte floats travel as bytes."""
    wire = t.contiguous().view(torch.uint8) if t.dtype in _AS_BYTES else t.contiguous()
    out = wire.new_empty((dist.get_world_size(group), *wire.shape))
    dist.all_gather(list(out.unbind(0)), wire, group=group)
    return out.view(t.dtype)


def _broadcast(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast ``tensors`` from global rank ``src`` in place, one flat buffer per dtype."""
    for dt in dict.fromkeys(t.dtype for t in tensors):
        ts = [t for t in tensors if t.dtype == dt]
        flat = torch.cat([t.reshape(-1) for t in ts])
        wire = flat.view(torch.uint8) if dt in _AS_BYTES else flat
        dist.broadcast(wire, src, group=group)
        o = 0
        for t in ts:
            t.copy_(flat[o:o + t.numel()].view_as(t))
            o += t.numel()


def _state_tensors(ls) -> list[torch.Tensor]:
    """A layer state's window ring and compressor remainders (not the compressed lists)."""
    out = list(ls.win_kv.parts)
    for c in (ls.comp, ls.idx_comp):
        if c is not None:
            out += [t for t in (c.kv, c.score, c.prev_kv, c.prev_score) if t is not None]
    return out


class _Plan:
    """The chunking as seen from one rank: its two chunks (slot 0 = chunk r, slot 1 = chunk
    2cp-1-r, rows in that order) and the last non-empty chunk (whose end state is the final one)."""

    def __init__(self, L: int, cp: int, rank: int):
        self.cp = cp
        self.chunks = zigzag_chunks(L, cp, ALIGN)
        self.mine = [rank, 2 * cp - 1 - rank]
        self.offsets = [0, self.chunks[rank][1] - self.chunks[rank][0]]
        self.last = max((c for c, (s, e) in enumerate(self.chunks) if e > s), default=0)

    def own(self):
        """(slot, chunk id, start, end, local row offset) of this rank's non-empty chunks."""
        for j, c in enumerate(self.mine):
            s, e = self.chunks[c]
            if e > s:
                yield j, c, s, e, self.offsets[j]

    def gather_rows(self, local: torch.Tensor, count, group) -> torch.Tensor:
        """Per-rank rows ``[count(r) + count(2cp-1-r), D]`` -> every chunk's rows in sequence
        order ``[sum_c count(c), D]``; ``count(c)``: chunk c's rows (computed alike on every rank,
        so only the padded rows travel)."""
        cp = self.cp
        pad = max(count(r) + count(2 * cp - 1 - r) for r in range(cp)) - local.shape[0]
        g = _all_gather(F.pad(local, (0, 0, 0, pad)) if pad else local, group)
        parts = []
        for c in range(2 * cp):
            r, slot = _owner(c, cp)
            o = count(r) if slot else 0
            parts.append(g[r, o:o + count(c)])
        return torch.cat(parts)


def _attention(model: Transformer, i: int, x: torch.Tensor, pos: torch.Tensor, plan: _Plan, temps: dict,
               final: SequenceState, group) -> torch.Tensor:
    """Layer i's attention over this rank's rows: x ``[T, H]`` (normed, compute dtype), pos ``[T]``
    -> ``[T, H]``. Same ops and submodules as ``Attention.forward``; chunk c's ``temps[c]`` state
    gets the window ring / compressor remainders at its end, ``final`` the gathered entries."""
    attn = model.layers[i].attn
    ops, rope, T = model.ops, model._rope(attn.ratio), x.shape[0]
    cos, sin = rope.cos_sin(pos)
    # 1. boundary rows: last ALIGN rows of the attention input of every chunk
    tails = x.new_zeros(2, ALIGN, x.shape[1])
    for j, _, s, e, off in plan.own():
        k = min(ALIGN, e - s)
        tails[j, ALIGN - k:] = x[off + e - s - k: off + e - s]
    tails = _all_gather(tails, group)                                        # [cp, 2, ALIGN, H]
    # 2. row-wise projections (Attention.forward)
    c_q = attn.q_norm(attn.wq_a(x))
    q = ops.rope(ops.rms_norm(attn.wq_b(c_q).view(T, attn.n_heads, attn.head_dim), None, attn.eps), cos, sin)
    kv = ops.rope(attn.kv_norm(attn.wkv(x)), cos, sin)
    if attn.indexer is not None:
        iq, iw = attn.indexer.project(x, c_q, cos, sin)
    # 3. per own chunk: prolog over the previous chunk's tail, then the chunk's own compressed entries
    wins, new = {}, []
    for j, c, s, e, off in plan.own():
        ls, sl = temps[c].layers[i], slice(off, off + e - s)
        if s > 0:
            prev = tails[_owner(c - 1, plan.cp)]                            # [ALIGN, H], positions s-ALIGN..
            ppos = torch.arange(s - ALIGN, s, device=x.device)
            ls.write_window(ops.rope(attn.kv_norm(attn.wkv(prev)), *rope.cos_sin(ppos)), s - ALIGN)
            comps = [(attn.compressor, ls.comp)] if attn.compressor is not None else []
            if attn.indexer is not None:
                comps.append((attn.indexer.compressor, ls.idx_comp))
            for comp, st in comps:           # open window + (CSA) the closed one before it
                need = s % comp.ratio + (comp.ratio if st.prev_kv is not None else 0)
                if need:                                                     # entries discarded
                    comp(prev[ALIGN - need:], s - need, st, x.dtype)
        wins[c] = ls.window_keys(kv[sl], s)
        ls.write_window(kv[sl], s)
        if attn.compressor is not None:
            ent = attn.compressor(x[sl], s, ls.comp, x.dtype)
            if attn.indexer is not None:
                ent = torch.cat([ent, attn.indexer.compressor(x[sl], s, ls.idx_comp, x.dtype)], dim=1)
            new.append(ent)
    # 4. all compressed entries in sequence order
    cmp_kv = idx_kv = None
    if attn.compressor is not None:
        fl = final.layers[i]
        ch, width = plan.chunks, attn.head_dim + (fl.idx_kv.view().shape[1] if attn.indexer is not None else 0)
        local = torch.cat(new) if new else x.new_zeros(0, width)
        full = plan.gather_rows(local, lambda c: num_new_entries(ch[c][0], ch[c][1] - ch[c][0], attn.ratio), group)
        fl.cmp_kv.append(full[:, :attn.head_dim])
        cmp_kv = fl.cmp_kv.view()                    # as stored: what the other paths read
        if attn.indexer is not None:
            fl.idx_kv.append(full[:, attn.head_dim:])
            idx_kv = fl.idx_kv.view()
    # 5. indexer top-k and sparse attention per chunk, output projection
    o = torch.empty_like(q)
    for j, c, s, e, off in plan.own():
        sl = slice(off, off + e - s)
        topk = None
        if attn.indexer is not None:
            ind = attn.indexer
            topk = ops.indexer_topk(quant_query(fl.idx_kv.codec, iq[sl]), iw[sl], idx_kv, pos[sl], CSA_RATIO,
                                    ind.topk, ind.head_dim ** -0.5)
        o[sl] = ops.sparse_attn(q[sl], pos[sl], *wins[c], attn.window, cmp_kv, attn.ratio, topk, attn.attn_sink,
                                attn.head_dim ** -0.5)
    return attn.out_proj(ops.rope(o, cos, -sin))                             # o_proj TP seam


def _block(model: Transformer, i: int, X: torch.Tensor, toks: torch.Tensor, pos: torch.Tensor, plan: _Plan,
           temps: dict, final: SequenceState, group) -> torch.Tensor:
    """``Block.forward`` with the CP attention: X ``[T, n, H]`` fp32 -> ``[T, n, H]`` fp32."""
    blk: Block = model.layers[i]
    y, post, comb = blk._hc_pre(X, "attn")
    a = _attention(model, i, blk.attn_norm(y).to(blk.dtype), pos, plan, temps, final, group)
    X = blk.ops.hc_post(a, X, post, comb)
    y, post, comb = blk._hc_pre(X, "ffn")
    return blk.ops.hc_post(blk.ffn(blk.ffn_norm(y).to(blk.dtype), toks), X, post, comb)


@torch.no_grad()
def cp_prefill(model: Transformer, tokens: torch.Tensor, group=None,
               gather_hidden: bool = True, cache=None) -> tuple[torch.Tensor, SequenceState]:
    """Every rank calls it with the same tokens [L] int64 (a whole prompt, from position 0).
    Returns on EVERY rank: hidden [L, H] (compute dtype; rows of every position, gathered) and the full
    decode state after L tokens (SequenceState: window ring, compressed KV, indexer keys, compressor
    remainders) — equal to model.forward(tokens, model.new_state()) within fp32 tolerance.

    ``group``: the CP group (None: the default group); every rank of it must call, even one whose
    chunks are empty (short prompts). ``gather_hidden=False`` returns only the last row ``[1, H]``
    (what serving samples from). ``cache``: the caches' storage (``engine.cache_dtype.CacheDtype``;
    None: unquantised), as the engine's pools keep it. With ``model.parallel`` set (``engine.parallel.shard``) the
    forward runs under ``model.parallel.rows("dp")``: each rank's own rows go through the EP MoE,
    the embedding-TP lookup and the o_proj-TP projection (the ``embed_tokens`` / ``out_proj`` seams).
    Source: reference/upstream-parallel-and-mtp.md "Parallel strategy".

    Raises:
        ValueError: tokens not 1-D / empty / longer than max_position_embeddings, or a model whose
            sliding window or compress ratios do not fit the 128-token chunk alignment.
    """
    a = model.args
    L = tokens.shape[0] if tokens.dim() == 1 else -1
    if not 0 < L <= a.max_position_embeddings:
        raise ValueError(f"cp_prefill: tokens must be [L] with 0 < L <= {a.max_position_embeddings}, "
                         f"got shape {tuple(tokens.shape)}")
    if a.sliding_window > ALIGN or any(m and ALIGN % m for m in a.compress_ratios):
        raise ValueError(f"cp_prefill: sliding_window {a.sliding_window} and compress ratios "
                         f"{a.compress_ratios} must fit the {ALIGN}-token chunk alignment")
    plan = _Plan(L, dist.get_world_size(group), dist.get_rank(group))
    own = list(plan.own())
    pos = torch.cat([torch.arange(s, e, device=tokens.device) for _, _, s, e, _ in own]
                    or [tokens.new_zeros(0)])
    toks = tokens[pos]
    temps = {c: model.new_state(cache=cache) for _, c, *_ in own}
    final = model.new_state(cache=cache)
    ctx = model.parallel.rows("dp") if getattr(model, "parallel", None) is not None else nullcontext()
    with ctx:
        X = model.residual_streams(model.embed_tokens(toks))
        for i in range(len(model.layers)):
            X = _block(model, i, X, toks, pos, plan, temps, final, group)
        h = model.ops.hc_head(X, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, a.rms_norm_eps,
                              a.hc_eps)
        h = model.norm(h).to(model.dtype)                                    # [T, H]
    # window rings + compressor remainders from the owner of the last non-empty chunk
    src = _owner(plan.last, plan.cp)[0]
    src = dist.get_global_rank(group, src) if group is not None else src
    mine = [t for ls in final.layers for t in _state_tensors(ls)]
    if plan.last in temps:
        for dst, srct in zip(mine, [t for ls in temps[plan.last].layers for t in _state_tensors(ls)]):
            dst.copy_(srct)
    _broadcast(mine, src, group)
    final.num_tokens = L
    if gather_hidden:
        return plan.gather_rows(h, lambda c: plan.chunks[c][1] - plan.chunks[c][0], group), final
    last = h.new_zeros(1, h.shape[1])
    if plan.last in temps:
        j = plan.mine.index(plan.last)
        s, e = plan.chunks[plan.last]
        last.copy_(h[plan.offsets[j] + e - s - 1:plan.offsets[j] + e - s])
    _broadcast([last], src, group)
    return last, final
