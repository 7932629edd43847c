"""Attention ops: the compressor (§3.4), the lightning indexer (§3.5), sparse attention with shared KV and sink (§3.3).

Part of the reference ops (``engine.ops.reference``): plain math, the numerics contract.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.reference.blas import GEMM_ROW_MULTIPLE, gemm, row_mix, row_scores
from engine.ops.reference.dense import rms_norm, rope


# Query-chunk budget: elements of one score block (T_chunk x h x keys) kept in fp32.
SCORE_BUDGET = 1 << 23


# ---- compressor (§3.4) -----------------------------------------------------------------------
def compressor(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
               norm_weight: torch.Tensor, norm_eps: float, state, start_pos: int,
               cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Streaming KV compressor: emits one entry per closed window of ``m`` tokens (§3.4).

    HCA (``state.prev_kv is None``): entry i = softmax-pool over tokens ``m*i .. m*i+m-1``.
    CSA (overlap): entry i pools 2m slots, ``Ca/Za`` of window i-1 then ``Cb/Zb`` of window i; for
    i = 0 the previous slots have kv 0 and score -inf (weight 0). Projections, state, softmax and
    pooling run in fp32; then RMSNorm and RoPE at position ``m*i``.

    Args:
        x: ``[T, H]`` normed block input for positions ``start_pos .. start_pos+T-1``.
        wkv, wgate: ``[c*d, H]`` (c = 2 for CSA, 1 for HCA). ape: ``[m, c*d]`` fp32.
        state: ``CompressorState`` for this sequence; updated in place.
        cos, sin: ``[n_new, r/2]`` for the new entries' positions (see ``num_new_entries``).
    Returns:
        ``[n_new, d]`` new compressed entries in ``out_dtype``.
    """
    m, width = ape.shape
    overlap = state.prev_kv is not None
    d = width // 2 if overlap else width
    T = x.shape[0]
    xf = x.float()
    kv = gemm(xf, wkv.float())                                       # [T, c*d]
    slot = (start_pos + torch.arange(T, device=x.device)) % m
    score = gemm(xf, wgate.float()) + ape.float()[slot]
    r = start_pos % m
    kv = torch.cat([state.kv[:r], kv])
    score = torch.cat([state.score[:r], score])
    n = (r + T) // m
    rem = r + T - n * m
    state.kv[:rem] = kv[n * m:]
    state.score[:rem] = score[n * m:]
    if n == 0:
        return x.new_zeros((0, d), dtype=out_dtype)
    ckv = kv[: n * m].view(n, m, width)
    csc = score[: n * m].view(n, m, width)
    if overlap:
        prev_kv = torch.cat([state.prev_kv[None], ckv[:-1, :, :d]])      # [n, m, d]
        prev_sc = torch.cat([state.prev_score[None], csc[:-1, :, :d]])
        state.prev_kv.copy_(ckv[-1, :, :d])
        state.prev_score.copy_(csc[-1, :, :d])
        ckv = torch.cat([prev_kv, ckv[:, :, d:]], dim=1)                 # [n, 2m, d]
        csc = torch.cat([prev_sc, csc[:, :, d:]], dim=1)
    pooled = (ckv * csc.softmax(dim=1)).sum(dim=1)                       # [n, d]
    out = rope(rms_norm(pooled, norm_weight, norm_eps), cos, sin)
    return out.to(out_dtype)


def num_new_entries(start_pos: int, num_tokens: int, ratio: int) -> int:
    """Compressed entries emitted by tokens ``start_pos .. start_pos+num_tokens-1``: windows closed."""
    return (start_pos + num_tokens) // ratio - start_pos // ratio


# ---- lightning indexer (§3.5) ----------------------------------------------------------------
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 ratio: int, topk: int, scale: float) -> torch.Tensor:
    """Lightning-indexer top-k: ``score(p, i) = sum_h w_h * ReLU(q_h . K_i) * scale`` (§3.5).

    Candidates are entries ``i < (p+1) // ratio``. Ties are broken towards the lower index, so the
    selection is a pure function of the scores (independent of chunking and batch shape).

    Args:
        q: ``[T, h, dI]`` roped indexer queries; weights: ``[T, h]`` fp32 (already * h^-0.5);
        keys: ``[N, dI]`` indexer keys; positions: ``[T]`` int64.
    Returns:
        ``[T, topk]`` int64 entry ids, ascending; ``-1`` pads rows with fewer candidates.
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for t0, t1, s, allowed in indexer_scores(q, weights, keys, positions, ratio, scale):
        out[t0:t1] = topk_low_index(s, allowed, topk)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                   ratio: int, scale: float):
    """Yield ``(t0, t1, scores [t, n] fp32 with -inf on non-candidates, allowed [t, n] bool)`` per
    query chunk; ``n`` = entries visible to the chunk's last query. Shapes as in ``indexer_topk``.

    Queries that see the same number of entries are scored together over exactly those entries: a
    row's products then have the shape they have at decode (CPU BLAS rounds a product's columns
    differently by the number of columns: batch / chunk invariance, see ``GEMM_ROW_MULTIPLE``)."""
    T = q.shape[0]
    if keys.shape[0] == 0:
        return
    step = max(1, SCORE_BUDGET // max(1, q.shape[1] * keys.shape[0]))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        seen = ((positions[t0:t1] + 1) // ratio).clamp(max=keys.shape[0])    # entries per query
        n_allowed = int(seen.max())
        if n_allowed == 0:
            continue
        s = torch.full((t1 - t0, n_allowed), float("-inf"), device=q.device)
        a = 0
        for n, c in zip(*(v.tolist() for v in torch.unique_consecutive(seen, return_counts=True))):
            if n:
                s[a:a + c, :n] = weighted_relu_sum(row_scores(q[t0 + a:t0 + a + c].float(), keys[:n].float()),
                                                   weights[t0 + a:t0 + a + c], scale)
            a += c
        yield t0, t1, s, torch.arange(n_allowed, device=q.device)[None] < seen[:, None]


def weighted_relu_sum(s: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """``sum_h (w_h * scale) * ReLU(s_h)`` for ``s [t, h, n]`` fp32 (overwritten) and ``weights
    [t, h]``: ReLU in place, then a batched matmul over heads (``row_mix``), so the ``[t, h, n]``
    block is read twice instead of materialised three more times (it bounds long prefill). -> ``[t, n]``."""
    return row_mix((weights.float() * scale).unsqueeze(1), s.clamp_min_(0)).squeeze(1)


def topk_low_index(s: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of ``s [t, n]`` (``allowed`` ``[t, n]`` bool): ids of the k largest allowed scores, ties ->
    lower id; ``[t, k]`` long, -1 padded (fewer than k allowed)."""
    t, n = s.shape
    ids = torch.arange(n, device=s.device).expand(t, n)
    if n > k:
        thr = s.topk(k, dim=-1).values[:, -1:]
        above = s > thr
        tied = (s == thr) & allowed
        take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    else:
        take = allowed
    key = torch.where(take, ids, ids + n)
    kk = min(k, n)
    sel = key.topk(kk, dim=-1, largest=False, sorted=True).values
    sel = torch.where(sel < n, sel, torch.full_like(sel, -1))
    if kk < k:
        sel = torch.cat([sel, sel.new_full((t, k - kk), -1)], dim=-1)
    return sel


# ---- sparse attention with shared KV and sink (§3.3 steps 4-6) --------------------------------
# The indexer picks min(topk, n) of a query's n candidate entries (§3.5); the rest of its topk ids
# are -1. A CSA query attends the first ``csa_pick_width`` columns of its picks: n rounded up to
# an eighth of topk (64 on Flash's 512, 128 on Pro's 1024), so a short context gathers and scores
# a few entries, not topk of which most are padding. The width is a function of the position
# alone, so the prefill rows and the decode rows of a position keep one reduction length (batch
# invariance).
CSA_PICK_STEPS = 8


def csa_pick_width(position: int, ratio: int, topk: int) -> int:
    """Columns of the indexer's picks a CSA query at ``position`` attends: 0 before its first
    closed entry, else ``min(topk, n rounded up to a multiple of topk // CSA_PICK_STEPS)``,
    n = ``(position + 1) // ratio``."""
    n, unit = (position + 1) // ratio, max(1, topk // CSA_PICK_STEPS)
    return 0 if n == 0 else min(topk, -(-n // unit) * unit)


def csa_width_end(position: int, ratio: int, topk: int) -> int:
    """The first position after ``position`` whose ``csa_pick_width`` differs (a large number when
    none): the one whose candidates outnumber the width."""
    width = csa_pick_width(position, ratio, topk)
    return 1 << 62 if width == topk else (width + 1) * ratio - 1


def leading_picks(topk_idx: torch.Tensor, width: int) -> torch.Tensor:
    """``[t, k]`` int64 picks -> ``[t, width]``: each row's valid ids ascending, then -1. The
    reference indexer's picks are in this order already; a kernel's may not be, and every valid
    id of a causal pick fits ``width`` (at most n of them)."""
    if width >= topk_idx.shape[1]:
        return topk_idx
    big = torch.iinfo(topk_idx.dtype).max
    key = torch.where(topk_idx >= 0, topk_idx, big).topk(width, dim=-1, largest=False, sorted=True).values
    return torch.where(key == big, -1, key)


def sparse_attn(q: torch.Tensor, positions: torch.Tensor, win_kv: torch.Tensor, win_pos0: int, window: int,
                cmp_kv: torch.Tensor | None, cmp_ratio: int, topk_idx: torch.Tensor | None,
                sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """One softmax over window keys, compressed keys and a per-head sink (K = V, shared by heads).

    Query at position p sees window keys at positions ``p-window+1 .. p`` and compressed entries
    ``i < (p+1) // cmp_ratio``: all of them (HCA, ``topk_idx is None``) or the indexer's picks
    (CSA; ``-1`` = none). ``P_j = exp(s_j) / (exp(sink_h) + sum_l exp(s_l))``, ``s = q.k * scale``.

    Args:
        q: ``[T, h, d]``; positions: ``[T]`` int64, consecutive.
        win_kv: ``[Nw, d]`` keys of positions ``win_pos0 .. win_pos0+Nw-1`` (covers the window
            of every query). cmp_kv: ``[Nc, d]`` or None (window-only layer).
        topk_idx: ``[T, k]`` int64 or None. sinks: ``[h]`` fp32.
    Returns:
        ``[T, h, d]`` in q.dtype.
    """
    T, h, d = q.shape
    out = torch.empty_like(q)
    if cmp_kv is not None and cmp_kv.shape[0] == 0:
        cmp_kv = topk_idx = None
    n_cmp = 0 if cmp_kv is None else cmp_kv.shape[0]
    dense = cmp_kv is not None and topk_idx is None
    p0 = int(positions[0]) if T else 0
    t0 = 0
    while t0 < T:
        ck, picks, width = cmp_kv, topk_idx, n_cmp
        if topk_idx is not None:
            width = csa_pick_width(p0 + t0, cmp_ratio, topk_idx.shape[1])
        # per query chunk: scores [t, h, keys] plus gathered keys [t, keys, d]
        # (whole row groups of the per-row products, so only a chunk's last group is padded)
        t1 = min(T, t0 + max(GEMM_ROW_MULTIPLE, SCORE_BUDGET // ((h + d) * (window + width))
                             // GEMM_ROW_MULTIPLE * GEMM_ROW_MULTIPLE))
        if dense:   # every query of a chunk sees the same entries: reductions keep one length
            t1 = min(t1, (p0 + t0 + 1) // cmp_ratio * cmp_ratio + cmp_ratio - 1 - p0)
        elif topk_idx is not None:   # every query of a chunk attends the same number of picks
            t1 = min(t1, csa_width_end(p0 + t0, cmp_ratio, topk_idx.shape[1]) - p0)
            picks = leading_picks(topk_idx[t0:t1], width) if width else None
            ck = cmp_kv if width else None
        out[t0:t1] = _attn_chunk(q[t0:t1], positions[t0:t1], win_kv, win_pos0, window, ck, cmp_ratio,
                                 picks, sinks, scale)
        t0 = t1
    return out


def _attn_chunk(q, pos, win_kv, win_pos0, window, cmp_kv, cmp_ratio, topk_idx, sinks, scale):
    t, h, d = q.shape
    qf = q.float()
    # window: query p sees keys p-window+1 .. p; rows before position 0 are zero padding, masked
    first = int(pos[0]) - window + 1 - win_pos0                          # local row of the first key
    kv = win_kv[max(0, first): int(pos[-1]) + 1 - win_pos0].float()
    if first < 0:
        kv = F.pad(kv, (0, 0, -first, 0))
    wk = kv.unfold(0, window, 1).transpose(1, 2)                         # [t, window, d] (views)
    kpos = pos[:, None] - window + 1 + torch.arange(window, device=q.device)
    # per-row products through row_scores / row_mix: the batched decode path's calls (batch invariance)
    scores = [row_scores(qf, wk).mul(scale).masked_fill((kpos < 0)[:, None], float("-inf"))]
    if cmp_kv is not None and topk_idx is None:                           # HCA: dense causal
        nc = min(cmp_kv.shape[0], int(pos[-1] + 1) // cmp_ratio)
        ck = cmp_kv[:nc].float()
        cmask = torch.arange(nc, device=q.device)[None] < ((pos + 1) // cmp_ratio)[:, None]
        scores.append(row_scores(qf, ck).mul(scale).masked_fill(~cmask[:, None], float("-inf")))
    elif cmp_kv is not None:                                              # CSA: indexer picks
        valid = topk_idx >= 0
        ck = _picked_keys(cmp_kv, topk_idx).float()                       # [t, k, d] or shared [k, d]
        s = row_scores(qf, ck).mul(scale)
        scores.append(s.masked_fill(~valid[:, None], float("-inf")))
    sink = sinks.float().view(1, h, 1).expand(t, h, 1)
    logits = torch.cat(scores + [sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)
    o = row_mix(probs[..., :window], wk)
    if cmp_kv is not None:
        o = o + row_mix(probs[..., window:-1], ck)
    return o.to(q.dtype)


def _picked_keys(cmp_kv: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """The keys of ``picks [t, w]``: ``[t, w, d]`` gathered or, when every row picked all of its
    candidates (n <= topk: entries ``0 .. n-1`` in order, then -1), the shared first ``w`` entries
    ``[w, d]`` (zero rows past the stored ones). Columns past a row's picks are masked either way,
    and ``row_scores`` / ``row_mix`` give a shared tensor the bits of its gathered copy, so a short
    context skips copying the same entries for every query."""
    w = picks.shape[1]
    first = torch.arange(w, device=picks.device)
    if torch.equal(picks, torch.where(first < (picks >= 0).sum(-1, keepdim=True), first, -1)):
        ck = cmp_kv[:w]
        return F.pad(ck, (0, 0, 0, w - ck.shape[0])) if ck.shape[0] < w else ck
    return F.embedding(picks.clamp_min(0), cmp_kv)                    # a row gather: ~8x ``cmp_kv[idx]`` on CPU
