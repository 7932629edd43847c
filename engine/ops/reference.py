"""Pure-torch reference ops: the numerics contract of the model (reference/dsv4-architecture.md §3).

Each function is one fused op of the NPU port (§8.1) written as plain math. They must match HF
transformers 5.23.0 ``DeepseekV4ForCausalLM`` in fp32; in bf16 they keep the precision choices of
§5 (fp32 router, compressor pooling, mHC, norms, RoPE tables, softmax). Memory stays linear in the
number of query tokens: attention and indexer work on query chunks, never on an L x L matrix.

Letters: T query tokens, H hidden, h heads, d head dim, r rope dims (trailing), N kv entries,
k selected entries, E experts, I expert width, n mHC streams (hc_mult), m compress ratio.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.checkpoint.hif8 import hif8_decode, hif8_round
from engine.checkpoint.int8_int4 import dequant_int
from engine.checkpoint.mx import dequant_mx, mx_fake_quant

# Query-chunk budget: elements of one score block (T_chunk x h x keys) kept in fp32.
SCORE_BUDGET = 1 << 23
# Batch invariance on CPU: a row's bits must not depend on how many rows share a BLAS call. CPU
# BLAS picks kernels and splits work across threads by the call's shape (leftover rows, narrow
# column slices when rows are few), and rounds differently in each; MKL's strict CNR mode
# (engine/__init__.py) holds that still on Intel CPUs but not on AMD ones (EPYC: a row of an
# [M, 256] x [256, 16] GEMM changes bits between M = 8 and M = 16 on 2 threads, a batched
# matmul item between 1 and 2 items, a score column between 11 and 12 columns). So on CPU every
# GEMM and every per-row batched matmul here runs in calls of exactly GEMM_ROW_MULTIPLE rows (the
# last block zero-padded), and a row's products have the same number of columns on every path:
# the same call shape, hence the same kernel and split, for every row whatever the number of
# rows. On other devices linear / grouped_linear / the per-row products stay single calls (rows
# padded to a multiple of GEMM_ROW_MULTIPLE).
GEMM_ROW_MULTIPLE = 8


def _pad_rows(M: int) -> int:
    return -(-M // GEMM_ROW_MULTIPLE) * GEMM_ROW_MULTIPLE - M


def _pad_block(x: torch.Tensor) -> torch.Tensor:
    """x ``[r, ...]`` (r <= GEMM_ROW_MULTIPLE) zero-padded to ``GEMM_ROW_MULTIPLE`` rows, contiguous."""
    r = x.shape[0]
    if r == GEMM_ROW_MULTIPLE:
        return x.contiguous()
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, GEMM_ROW_MULTIPLE - r))


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` in row blocks of exactly ``GEMM_ROW_MULTIPLE``: x ``[M, K]``, weight ``[N, K]`` ->
    ``[M, N]`` in x's dtype. Fixed-shape calls make a row's result independent of M (batch
    invariance: a row computes the same alone or batched)."""
    M, R = x.shape[0], GEMM_ROW_MULTIPLE
    if M == 0:
        return F.linear(x, weight)
    if x.device.type != "cpu":
        return F.linear(F.pad(x, (0, 0, 0, _pad_rows(M))), weight)[:M]
    x, wt = x.contiguous(), weight.t()
    if M <= R:
        return torch.mm(_pad_block(x), wt)[:M]
    full = M // R * R
    out = torch.empty(-(-M // R) * R, weight.shape[0], dtype=x.dtype, device=x.device)
    if full:
        for xb, ob in zip(x[:full].view(-1, R, x.shape[1]), out[:full].view(-1, R, out.shape[1])):
            torch.mm(xb, wt, out=ob)
    if full < M:
        torch.mm(_pad_block(x[full:]), wt, out=out[full:])
    return out[:M]


def _row_bmm(a: torch.Tensor, b: torch.Tensor, b_t: bool) -> torch.Tensor:
    """Per-row products ``a[t] @ b[t]`` (``b[t]^T`` with ``b_t``) as batched matmuls of exactly
    ``GEMM_ROW_MULTIPLE`` rows each, the last group padded (see ``GEMM_ROW_MULTIPLE``).

    a: ``[T, m, k]``. b: ``[T, k, n]`` (``[T, n, k]`` with b_t) or, shared by all rows, ``[k, n]``
    (``[n, k]``), used in place (stride-0 batch). a is made contiguous and b's items dense
    (row-major), so every call sees the same item layouts (a window of overlapping rows, a slice of
    a wider tensor, a gathered copy or a shared tensor alike). Returns ``[T, m, n]`` in a's dtype.
    """
    T, R = a.shape[0], GEMM_ROW_MULTIPLE
    shared = b.dim() == 2
    if a.device.type != "cpu":
        b = b.expand(T, *b.shape) if shared else b
        return torch.bmm(a, b.transpose(1, 2) if b_t else b)
    if not shared and (b.stride(-1) != 1 or b.stride(-2) != b.shape[-1]):
        b = b.contiguous()
    a = a.contiguous()

    def group(t0: int, r: int) -> torch.Tensor:
        if r == 1:                                   # padding items repeat the row (results unused)
            ag, bg = a[t0:t0 + 1].expand(R, *a.shape[1:]), b if shared else b[t0:t0 + 1]
        else:
            ag = _pad_block(a[t0:t0 + r])
            bg = b if shared else b[t0:t0 + R] if r == R else _pad_block(b[t0:t0 + r])
        bg = bg.expand(R, *b.shape) if shared else bg.expand(R, *bg.shape[1:])
        return torch.bmm(ag, bg.transpose(1, 2) if b_t else bg)

    if T <= R:
        return group(0, T)[:T] if T else a.new_empty((0, a.shape[1], b.shape[-2] if b_t else b.shape[-1]))
    return torch.cat([group(t0, min(R, T - t0)) for t0 in range(0, T, R)])[:T]


def row_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q[t] @ keys[t]^T`` per row: q ``[T, h, d]``, keys ``[T, n, d]`` or shared ``[n, d]`` -> ``[T, h, n]``."""
    return _row_bmm(q, keys, True)


def row_mix(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``p[t] @ values[t]`` per row: p ``[T, h, n]``, values ``[T, n, d]`` or shared ``[n, d]`` -> ``[T, h, d]``."""
    return _row_bmm(p, values, False)


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The vocab projection ``x @ weight^T``: x ``[M, H]`` fp32 (the last hidden of each sequence),
    weight ``[V, H]`` fp32; returns ``[M, V]`` fp32.

    On CPU it streams the weight (the largest one, past any cache) as ``weight @ x_block^T`` over
    fixed blocks of ``GEMM_ROW_MULTIPLE`` rows: for decode-sized M that stays near the memory
    bandwidth limit, where CPU BLAS's row-major GEMM of a few rows runs ~2.5x slower; one kernel
    shape for every M keeps each row's bits independent of the batch. Past ~8 rows per block the
    cost grows linearly with M (compute in the small-N kernel). Elsewhere it is ``linear``.
    """
    if x.device.type != "cpu":
        return linear(x, weight)
    w = weight.to(x.dtype)
    pad = _pad_rows(x.shape[0])
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    out = torch.empty(xp.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for b in range(0, xp.shape[0], GEMM_ROW_MULTIPLE):
        out[b:b + GEMM_ROW_MULTIPLE] = torch.mm(w, xp[b:b + GEMM_ROW_MULTIPLE].t()).t()
    return out[: x.shape[0]]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 (§3 notation).

    Args:
        x: ``[..., D]`` any float dtype. weight: ``[D]`` or None (unweighted, e.g. q_b_norm).
    Returns:
        ``[..., D]`` in ``x.dtype``.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved partial RoPE on the trailing ``r = 2 * cos.shape[-1]`` dims (§3.6).

    Pairs ``(x[D-r+2i], x[D-r+2i+1])`` rotate by angle ``theta_i * p``; pass ``-sin`` for the
    inverse rotation applied to the attention output (§3.3 step 7).

    Args:
        x: ``[T, D]`` or ``[T, h, D]``. cos, sin: ``[T, r/2]`` fp32.
    Returns:
        same shape and dtype as ``x``.
    """
    r = 2 * cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    nope, pe = x[..., :-r], x[..., -r:].float()
    even, odd = pe[..., 0::2], pe[..., 1::2]
    rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rot.to(x.dtype)], dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (no bias). x: ``[..., K]``; weight: ``[N, K]``; returns ``[..., N]`` in x.dtype.

    The seam for quantised matmuls (FP8 block / W8A8 / MXFP4 kernels on devices).
    """
    lead = x.shape[:-1]
    return gemm(x.reshape(-1, x.shape[-1]), weight.to(x.dtype)).view(*lead, weight.shape[0])


def quant_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str, act: str | None
                 ) -> torch.Tensor:
    """A converted checkpoint's linear on its stored weight (§7): ``act_quant(x) @ dequant(weight)^T``.

    Args:
        x: ``[..., K]`` float.
        weight, scale: as stored (``engine.checkpoint.layout``): ``int8`` int8 ``[N, K]`` + fp32 ``[N, 1]``;
            ``mxfp8`` float8_e4m3fn ``[N, K]`` + uint8 e8m0 ``[N, K/32]``; ``hif8`` uint8 ``[N, K]`` + fp32 ``[N, 1]``.
        fmt: "int8", "mxfp8" or "hif8". act: the activation scheme (``act_quant``) or None.
    Returns:
        ``[..., N]`` in x.dtype; the weight is dequantised to x.dtype first, exactly as the loader
        does for dense weights, so this equals ``linear`` on the loaded dense weight.
    Raises:
        ValueError: an unknown fmt.
    """
    if fmt == "int8":
        w = dequant_int(weight, scale)
    elif fmt == "mxfp8":
        w = dequant_mx(weight, scale)
    elif fmt == "hif8":
        w = hif8_decode(weight) * scale.float()
    else:
        raise ValueError(f"quant_linear: unknown weight format {fmt!r} (int8, mxfp8, hif8)")
    return linear(x if act is None else act_quant(x, act), w.to(x.dtype))


def act_quant(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """Dynamic activation quantisation in front of a converted linear, emulated (§7): quantise, dequantise.

    Schemes (row = last dim, so a row's result never depends on other rows in the batch):

    * ``int8-token``: per token, ``s = absmax / 127``, ``round(x / s)`` clamped to +-127
      (``npu_dynamic_quant``, smooth scales 1);
    * ``mxfp8``: groups of 32 along the last dim, e8m0 scale, e4m3 elements (``npu_dynamic_mx_quant``;
      the shared-exponent rule of ``engine.checkpoint.mx.quant_mx`` is assumed for it too);
    * ``hif8``: a cast to HiF8 with scale 1, as upstream's W8A8 HiF8 linear does.

    Args:
        x: ``[..., K]`` float (K % 32 == 0 for mxfp8).
    Returns:
        same shape and dtype, each value replaced by its quantised value.
    Raises:
        ValueError: an unknown scheme.
    """
    shape, xf = x.shape, x.float().reshape(-1, x.shape[-1])
    if scheme == "int8-token":
        s = xf.abs().amax(-1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        y = torch.round(xf / s).clamp(-127, 127) * s
    elif scheme == "mxfp8":
        y = mx_fake_quant(xf, 8) if xf.shape[0] else xf
    elif scheme == "hif8":
        y = hif8_round(xf)
    else:
        raise ValueError(f"act_quant: unknown scheme {scheme!r} (int8-token, mxfp8, hif8)")
    return y.reshape(shape).to(x.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Block-diagonal grouped output projection ``wo_a`` (§3.3 step 8).

    Args:
        x: ``[T, G, K]`` (group g holds heads g*h/G .. (g+1)*h/G - 1, flattened).
        weight: ``[G * N, K]``; group g uses rows ``g*N .. g*N + N - 1``.
    Returns:
        ``[T, G, N]``.
    """
    T, G, K = x.shape
    w = weight.to(x.dtype).view(G, -1, K)
    x, R = x.contiguous(), GEMM_ROW_MULTIPLE                            # batch invariance, see gemm
    if x.device.type != "cpu":
        return torch.einsum("tgk,gnk->tgn", F.pad(x, (0, 0, 0, 0, 0, _pad_rows(T))), w)[:T]
    if 0 < T <= R:
        return torch.einsum("tgk,gnk->tgn", _pad_block(x), w)[:T]
    out = torch.empty(T + _pad_rows(T), G, w.shape[1], dtype=x.dtype, device=x.device)
    for b in range(0, T, R):
        out[b:b + R] = torch.einsum("tgk,gnk->tgn", _pad_block(x[b:b + R]), w)
    return out[:T]


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid via fp64: the CPU kernel's vector and scalar-tail paths round differently in
    fp32, so on a small last dim (n = 4) a row's value would depend on the number of rows."""
    return torch.sigmoid(x.double()).float()


# ---- mHC (§3.2) ------------------------------------------------------------------------------
def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix: collapse n streams into the block input and build post / comb (§3.2).

    Args:
        X: ``[T, n, H]`` residual streams. fn: ``[(2+n)*n, n*H]`` fp32; scale ``[3]``; base ``[(2+n)*n]``.
    Returns:
        ``y [T, H]`` (X.dtype), ``post [T, n]`` fp32, ``comb [T, n, n]`` fp32 (rows = input
        stream j, cols = output stream k; doubly stochastic after Sinkhorn).
    """
    T, n, H = X.shape
    flat = X.reshape(T, n * H).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = gemm(flat, fn.float())                                   # [T, (2+n)*n]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = _sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * _sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):                             # in place: 4 small ops, not 6
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(hc_eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc_eps))
    y = (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)                 # [T, H]
    return y, post, comb


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post-mix ``X'_k = post_k * f + sum_j comb[j, k] * X_j`` in fp32 (§3.2).

    Args:
        f: ``[T, H]`` block output; X: ``[T, n, H]``; post: ``[T, n]``; comb: ``[T, n, n]``.
    Returns:
        ``[T, n, H]`` in X.dtype.
    """
    # elementwise over the n input streams in order, not a batched matmul: no BLAS call whose
    # shape depends on the number of rows (batch invariance, see GEMM_ROW_MULTIPLE)
    Xf = X.float()
    out = post.unsqueeze(-1) * f.float().unsqueeze(1)
    for j in range(X.shape[1]):
        out.add_(comb[:, j, :, None] * Xf[:, j, None, :])
    return out.to(X.dtype)


def hc_head(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Final stream collapse ``h = sum_j (sigmoid(mix_j * scale + base_j) + eps) X_j`` (§3.2 end).

    X: ``[T, n, H]``; fn ``[n, n*H]``; scale ``[1]``; base ``[n]``. Returns ``[T, H]`` in X.dtype.
    """
    T, n, H = X.shape
    flat = X.reshape(T, n * H).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = _sigmoid(gemm(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)


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
    keys_per_q = window + (n_cmp if topk_idx is None else topk_idx.shape[1])
    # per query chunk: scores [t, h, keys] plus gathered keys [t, keys, d]
    step = max(1, min(T, SCORE_BUDGET // ((h + d) * keys_per_q)))
    dense = cmp_kv is not None and topk_idx is None
    p0 = int(positions[0]) if T else 0
    t0 = 0
    while t0 < T:
        t1 = min(T, t0 + step)
        if dense:   # every query of a chunk sees the same entries: reductions keep one length
            t1 = min(t1, (p0 + t0 + 1) // cmp_ratio * cmp_ratio + cmp_ratio - 1 - p0)
        out[t0:t1] = _attn_chunk(q[t0:t1], positions[t0:t1], win_kv, win_pos0, window, cmp_kv, cmp_ratio,
                                 None if topk_idx is None else topk_idx[t0:t1], sinks, scale)
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
        ck = cmp_kv[topk_idx.clamp_min(0)].float()                        # [t, k, d]
        s = row_scores(qf, ck).mul(scale)
        scores.append(s.masked_fill(~valid[:, None], float("-inf")))
    sink = sinks.float().view(1, h, 1).expand(t, h, 1)
    logits = torch.cat(scores + [sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)
    o = row_mix(probs[..., :window], wk)
    if cmp_kv is not None:
        o = o + row_mix(probs[..., window:-1], ck)
    return o.to(q.dtype)


# ---- MoE (§3.7) ------------------------------------------------------------------------------
# Up to this many tokens (decode batches) the routed experts' row blocks share one buffer
# (``_moe_blocks``: the loop's GEMM calls, fewer small ops); above, a loop over experts.
MOE_BATCHED_TOKENS = 16


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
    depend on the other tokens, nor on which of the two paths (``MOE_BATCHED_TOKENS``) ran.

    Args:
        x: ``[T, H]``; ids, weights: ``[T, k]``; w1, w3: ``[E, I, H]``; w2: ``[E, H, I]``.
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
    if 0 < T <= MOE_BATCHED_TOKENS:
        return _moe_blocks(x, flat[order], tok, wt, w1, w3, w2, limit, act, out)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        t_e = tok[start:start + c]
        xe = x[t_e]
        h = swiglu_clamp(gemm(xe, w1[e].to(x.dtype)), gemm(xe, w3[e].to(x.dtype)), limit)
        if act is not None:
            h = act_quant(h, act)
        y = gemm(h, w2[e].to(x.dtype)).float() * wt[start:start + c, None].float()
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
    xg = x.new_zeros(n * R, x.shape[1])
    xg[row] = x[tok]
    spans = [(e, b, b + nb) for e, b, nb in zip(used.tolist(), first.tolist(), blocks.tolist())]
    gate, up, y = x.new_empty(n, R, w1.shape[1]), x.new_empty(n, R, w1.shape[1]), x.new_empty(n, R, x.shape[1])
    for w, src, dst in ((w1, xg, gate), (w3, xg, up), (w2, None, y)):
        if src is None:
            src = swiglu_clamp(gate, up, limit)
            src = src if act is None else act_quant(src, act)
        src = src.view(n, R, -1)
        for e, b0, b1 in spans:
            wt_e = w[e].to(x.dtype).t()
            for b in range(b0, b1):
                torch.mm(src[b], wt_e, out=dst[b])
    # index_add_ on CPU adds the slots one after another: each token's results in ascending expert order
    out.index_add_(0, tok, y.view(n * R, -1)[row].float() * wt[:, None].float())
    return out.to(x.dtype)
