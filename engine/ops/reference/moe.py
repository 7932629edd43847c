"""MoE ops: gating top-k (score and hash routing), the clamped SwiGLU, the routed experts (§3.7).

Part of the reference ops (``engine.ops.reference``): plain math, the numerics contract.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.reference.blas import GEMM_ROW_MULTIPLE, gemm
from engine.ops.packed import Packed, dequant, tile_elements
from engine.ops.reference.dense import act_quant


def expert_weights(w: torch.Tensor | Packed, experts: list[int], dtype: torch.dtype):
    """Experts ``experts`` of stacked weights ``[E, N, K]`` (dense or ``Packed``), each a dense
    ``[N, K]`` of ``dtype``, yielded in order. Packed experts are dequantised a few at a time: as
    many as fit in one tile (``packed.tile_elements``; one call for several small experts, one
    expert per call at real sizes), never the whole stack."""
    if not isinstance(w, Packed):
        for e in experts:
            yield w[e].to(dtype)
        return
    n, k = w.shape[-2:]
    per = max(1, tile_elements(w.data.device) // (n * k))
    for i in range(0, len(experts), per):
        ids = experts[i:i + per]
        if len(ids) == 1:
            yield dequant(w.expert(ids[0]), dtype)
        elif ids == list(range(ids[0], ids[0] + len(ids))):    # a run (most of a prefill's experts): views
            yield from dequant(w.span(ids[0], ids[-1] + 1), dtype)
        else:
            yield from dequant(w.take(torch.tensor(ids, device=w.data.device)), dtype)


# ---- MoE (§3.7) ------------------------------------------------------------------------------
# While their buffers fit this many bytes, the routed experts' row blocks share one buffer
# (``_moe_blocks``: the loop's GEMM calls, a dozen other ops in all: decode batches of up to 24
# rows of Flash's experts in fp32, short prefills of small experts); past it, a loop over experts
# (a few ops per expert, which a long prefill of real-width experts amortises over their GEMMs).
MOE_BLOCK_BYTES = 64 << 20


def gating_topk(logits: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, k: int,
                routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: ``s = sqrt(softplus(logits))``; experts = top-k of ``s + bias`` (bias picks only) or
    ``tid2eid[token]`` on hash layers; weights ``s[idx] / (sum s[idx] + 1e-20) * routed_scaling``.

    Args:
        logits: ``[T, E]`` fp32 router logits. bias: ``[E]`` fp32 or None. hash_ids: ``[T, k]`` or None.
    Returns:
        ``weights [T, k]`` fp32, ``ids [T, k]`` int64.
    """
    # softplus (threshold 20) in fp64, rounded: the fp32 CPU kernels round differently by an
    # element's place in the tensor, which would make routing weights depend on the batch
    x = logits.double()
    s = torch.where(x > 20, x, torch.log1p(torch.exp(x))).float().sqrt()
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        # ascending ids: the weight normaliser's summation order must not depend on topk's layout
        ids = torch.topk(s + bias.float(), k, dim=-1, sorted=False).indices.sort(dim=-1).values
    w = s.gather(1, ids)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling, ids


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (§3.7)."""
    g = gate.clamp(max=limit)
    silu = F.silu(g.double()).to(g.dtype) if g.dtype == torch.float32 else F.silu(g)   # fp64: see _sigmoid
    return silu * up.clamp(min=-limit, max=limit)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, limit: float, act: str | None = None) -> torch.Tensor:
    """Routed experts ``sum_e w_e * (swiglu_clamp(x W1_e^T, x W3_e^T) W2_e^T)``, grouped by expert.

    Every expert GEMM runs on blocks of exactly ``GEMM_ROW_MULTIPLE`` rows (batch invariance, see
    there) and a token's k results are added in ascending expert order: a row's result does not
    depend on the other tokens, nor on which of the two paths (``MOE_BLOCK_BYTES``) ran.

    Args:
        x: ``[T, H]``; ids, weights: ``[T, k]``; w1, w3: ``[E, I, H]``; w2: ``[E, H, I]``, dense or
            ``Packed`` as stored (each used expert dequantised on its own, to x.dtype).
        act: activation quantisation of a converted checkpoint (``act_quant``) applied to x and to
            the SwiGLU output, as the W8A8 / W4A8 / MXFP4 grouped matmuls do (§7); None: none.
    Returns:
        ``[T, H]`` in x.dtype (accumulated in fp32).
    """
    if act is not None:
        x = act_quant(x, act)
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    wt = weights.reshape(-1)[order]
    rows = T * k + min(T * k, w1.shape[0]) * (GEMM_ROW_MULTIPLE - 1)     # the buffer's rows, at most
    if 0 < T and rows * (2 * x.shape[1] + 3 * w1.shape[1]) * x.element_size() <= MOE_BLOCK_BYTES:
        return _moe_blocks(x, flat[order], tok, wt, w1, w3, w2, limit, act, out)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    used = [e for e, c in enumerate(counts) if c]
    start = 0
    for e, d1, d3, d2 in zip(used, *(expert_weights(w, used, x.dtype) for w in (w1, w3, w2))):
        c = counts[e]
        t_e = tok[start:start + c]
        xe = F.embedding(t_e, x)                                         # x[t_e]; a row gather ~8x [] on CPU
        h = swiglu_clamp(gemm(xe, d1), gemm(xe, d3), limit)
        if act is not None:
            h = act_quant(h, act)
        y = gemm(h, d2).float() * wt[start:start + c, None].float()
        out.index_add_(0, t_e, y)                                        # experts in ascending order
        start += c
    return out.to(x.dtype)


def _moe_blocks(x, eid, tok, wt, w1, w3, w2, limit, act, out):
    """``moe_experts``' loop with every expert's rows in one zero-padded ``[rows, H]`` buffer of
    ``GEMM_ROW_MULTIPLE``-row blocks: the loop's GEMM calls (``gemm``'s), its other ops once.
    ``eid`` / ``tok`` / ``wt``: the ``[T*k]`` slots sorted by expert (stable), their token and weight."""
    R = GEMM_ROW_MULTIPLE
    used, counts = torch.unique_consecutive(eid, return_counts=True)
    blocks = (counts + R - 1) // R
    first = torch.cumsum(blocks, 0) - blocks                             # each expert's first block
    group = torch.repeat_interleave(torch.arange(used.shape[0], device=x.device), counts)
    rank = torch.arange(eid.shape[0], device=x.device) - (torch.cumsum(counts, 0) - counts)[group]
    row = first[group] * R + rank                                        # slot -> buffer row
    n = int(blocks.sum())
    xg = x.new_zeros(n * R, x.shape[1]).index_copy_(0, row, F.embedding(tok, x))
    spans = [(e, b, b + nb) for e, b, nb in zip(used.tolist(), first.tolist(), blocks.tolist())]
    gate, up, y = x.new_empty(n, R, w1.shape[1]), x.new_empty(n, R, w1.shape[1]), x.new_empty(n, R, x.shape[1])
    for w, src, dst in ((w1, xg, gate), (w3, xg, up), (w2, None, y)):
        if src is None:
            src = swiglu_clamp(gate, up, limit)
            src = src if act is None else act_quant(src, act)
        src = src.view(n, R, -1)
        for (e, b0, b1), dense in zip(spans, expert_weights(w, [e for e, _, _ in spans], x.dtype)):
            wt_e = dense.t()
            for b in range(b0, b1):
                torch.mm(src[b], wt_e, out=dst[b])
    # index_add_ on CPU adds the slots one after another: each token's results in ascending expert order
    out.index_add_(0, tok, F.embedding(row, y.view(n * R, -1)).float() * wt[:, None].float())
    return out.to(x.dtype)


def moe_experts_gathered(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2, limit: float,
                         act: str | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed experts without host syncs: each of the k slots gathers its rows' expert weights
    (what a captured decode step runs where no platform kernel takes the experts).

    Same math as ``moe_experts`` (§3.7); costs ``B * I * H`` gathered weight elements per slot, so
    it suits decode buckets, not prefill. Accumulates in fp32 in slot order.

    Args:
        x: ``[B, H]``; ids, weights: ``[B, k]``; w1, w3: ``[E, I, H]``; w2: ``[E, H, I]``, dense or
            ``Packed`` (the B gathered experts' stored bytes are dequantised, ``B * I * H`` elements).
        act: activation quantisation (``moe_experts``).
        out_dtype: the result's dtype (None: x.dtype); fp32 keeps the sum unrounded.
    Returns:
        ``[B, H]`` in ``out_dtype``.
    """
    if act is not None:
        x = act_quant(x, act)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xb = x.unsqueeze(-1)                                                        # [B, H, 1]
    for j in range(ids.shape[1]):
        e = ids[:, j]
        g = torch.bmm(_gathered(w1, e, x.dtype), xb).squeeze(-1)                # [B, I]
        u = torch.bmm(_gathered(w3, e, x.dtype), xb).squeeze(-1)
        h = swiglu_clamp(g, u, limit)
        if act is not None:
            h = act_quant(h, act)
        y = torch.bmm(_gathered(w2, e, x.dtype), h.unsqueeze(-1)).squeeze(-1)   # [B, H]
        out += y.float() * weights[:, j:j + 1].float()
    return out.to(out_dtype or x.dtype)


def _gathered(w, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``idx`` (``[B]``) of stacked weights, dense ``[B, N, K]`` of ``dtype``."""
    return dequant(w.take(idx), dtype) if isinstance(w, Packed) else w[idx].to(dtype)
