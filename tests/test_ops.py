"""Reference ops: exact semantics on small hand-checkable cases, and chunking invariance."""
import math

import pytest
import torch

import engine.ops.reference as R
from engine.state import CompressorState

g = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=g)


def naive_attention(q, pos, keys_per_query, kv, sinks, scale):
    """Per query: softmax over the listed key rows plus the sink (denominator only)."""
    out = torch.zeros_like(q)
    for t in range(q.shape[0]):
        k = kv[keys_per_query[t]]                                    # [K, d]
        s = q[t] @ k.T * scale                                       # [h, K]
        z = torch.cat([s, sinks[:, None]], -1)
        p = torch.softmax(z, -1)[:, :-1]
        out[t] = p @ k
    return out


@pytest.mark.parametrize("start", [0, 5, 300])
def test_sparse_attn_window_and_hca_match_naive(start):
    T, h, d, W, m = 40, 3, 16, 8, 4
    pos = torch.arange(start, start + T)
    win_pos0 = max(0, start - (W - 1))
    win_kv = rnd(start + T - win_pos0, d)
    cmp = rnd((start + T) // m, d)
    q, sinks = rnd(T, h, d), rnd(h)
    out = R.sparse_attn(q, pos, win_kv, win_pos0, W, cmp, m, None, sinks, 0.3)
    all_kv = torch.cat([win_kv, cmp])
    keys = [[p - win_pos0 for p in range(max(0, int(p) - W + 1), int(p) + 1)] +
            [win_kv.shape[0] + i for i in range((int(p) + 1) // m)] for p in pos]
    ref = naive_attention(q, pos, keys, all_kv, sinks, 0.3)
    assert torch.allclose(out, ref, atol=1e-5)


def test_sparse_attn_topk_ignores_minus_one_and_is_chunking_invariant(monkeypatch):
    T, h, d, W = 30, 2, 8, 4
    pos = torch.arange(100, 100 + T)
    win_kv = rnd(T + W - 1, d)
    cmp = rnd(32, d)
    topk = torch.randint(0, 32, (T, 5), generator=g)
    topk[::3, -2:] = -1
    q, sinks = rnd(T, h, d), rnd(h)
    out = R.sparse_attn(q, pos, win_kv, 100 - (W - 1), W, cmp, 4, topk, sinks, 0.5)
    keys = [[j for j in range(t, t + W)] + [win_kv.shape[0] + int(i) for i in topk[t] if i >= 0] for t in range(T)]
    ref = naive_attention(q, pos, keys, torch.cat([win_kv, cmp]), sinks, 0.5)
    assert torch.allclose(out, ref, atol=1e-5)
    monkeypatch.setattr(R, "SCORE_BUDGET", 64)                        # forces 1-3 queries per chunk
    assert torch.allclose(R.sparse_attn(q, pos, win_kv, 100 - (W - 1), W, cmp, 4, topk, sinks, 0.5), out, atol=1e-6)


def test_topk_ties_break_to_lower_index_and_pad():
    s = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    allowed = torch.ones_like(s, dtype=torch.bool)
    assert R._topk_low_index(s, allowed, 3).tolist() == [[1, 2, 3]]
    assert R._topk_low_index(s, allowed, 4).tolist() == [[1, 2, 3, 5]]
    allowed[0, 3:] = False
    s2 = s.masked_fill(~allowed, float("-inf"))
    assert R._topk_low_index(s2, allowed, 4).tolist() == [[0, 1, 2, -1]]
    zeros = torch.zeros(1, 6)
    assert R._topk_low_index(zeros, torch.ones(1, 6, dtype=torch.bool), 2).tolist() == [[0, 1]]


def test_indexer_causal_candidates_and_chunking(monkeypatch):
    T, h, dI = 50, 4, 8
    pos = torch.arange(10, 10 + T)
    keys = rnd((10 + T) // 4, dI)
    q, w = rnd(T, h, dI), rnd(T, h)
    idx = R.indexer_topk(q, w, keys, pos, 4, 5, dI ** -0.5)
    for t in range(T):
        n = (int(pos[t]) + 1) // 4
        sel = [i for i in idx[t].tolist() if i >= 0]
        assert len(sel) == min(5, n) and all(i < n for i in sel) and sel == sorted(sel)
        full = (torch.relu(q[t] @ keys[:n].T) * dI ** -0.5 * w[t][:, None]).sum(0)
        assert set(sel) == set(full.topk(min(5, n)).indices.tolist())
    monkeypatch.setattr(R, "SCORE_BUDGET", 16)
    assert torch.equal(R.indexer_topk(q, w, keys, pos, 4, 5, dI ** -0.5), idx)


def test_rope_inverse_and_pairs():
    x = rnd(5, 3, 16)
    ang = rnd(5, 4)
    y = R.rope(x, ang.cos(), ang.sin())
    assert torch.equal(y[..., :8], x[..., :8])                       # nope dims untouched
    assert torch.allclose(R.rope(y, ang.cos(), -ang.sin()), x, atol=1e-6)
    # pair (8, 9) rotates by ang[:, 0]: interleaved, not NeoX half-split
    c, s = ang[:, 0:1].cos(), ang[:, 0:1].sin()
    assert torch.allclose(y[..., 8], x[..., 8] * c - x[..., 9] * s, atol=1e-6)


def test_hc_pre_comb_is_doubly_stochastic_and_post_orientation():
    T, n, H = 7, 4, 16
    X = rnd(T, n, H)
    y, post, comb = R.hc_pre(X, rnd((2 + n) * n, n * H) * 0.1, rnd(3), rnd((2 + n) * n), 1e-6, 1e-6, 20)
    assert torch.allclose(comb.sum(-2), torch.ones(T, n), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(T, n), atol=1e-3)
    f = rnd(T, H)
    out = R.hc_post(f, X, post, comb)
    k = 2
    expect = post[:, k, None] * f + sum(comb[:, j, k, None] * X[:, j] for j in range(n))
    assert torch.allclose(out[:, k], expect, atol=1e-5)


@pytest.mark.parametrize("ratio, overlap", [(4, True), (128, False)])
def test_compressor_streaming_equals_one_shot(ratio, overlap):
    H, d, T = 16, 8, 300
    width = 2 * d if overlap else d
    x, wkv, wg = rnd(T, H), rnd(width, H), rnd(width, H)
    ape, nw = rnd(ratio, width), 1 + 0.1 * rnd(d)
    inv = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))

    def cs(first, n):
        p = (torch.arange(first, first + n) * ratio).float()[:, None] * inv
        return p.cos(), p.sin()

    st = CompressorState.new(ratio, d, overlap, "cpu")
    one = R.compressor(x, wkv, wg, ape, nw, 1e-6, st, 0, *cs(0, T // ratio), torch.float32)
    st2, parts, pos = CompressorState.new(ratio, d, overlap, "cpu"), [], 0
    for c in [1, 2, 3, 70, 128, 96]:
        n_new = R.num_new_entries(pos, c, ratio)
        parts.append(R.compressor(x[pos:pos + c], wkv, wg, ape, nw, 1e-6, st2, pos, *cs(pos // ratio, n_new),
                                  torch.float32))
        pos += c
    assert torch.allclose(torch.cat(parts), one, atol=1e-5)
    # entry 1 by hand (CSA: Ca/Za of window 0 + Cb/Zb of window 1; HCA: window 1)
    kv, sc = x @ wkv.T, x @ wg.T + ape.repeat(T // ratio + 1, 1)[:T]
    if overlap:
        slots_kv = torch.cat([kv[0:4, :d], kv[4:8, d:]])
        slots_sc = torch.cat([sc[0:4, :d], sc[4:8, d:]])
    else:
        slots_kv, slots_sc = kv[ratio:2 * ratio], sc[ratio:2 * ratio]
    pooled = (slots_kv * slots_sc.softmax(0)).sum(0)
    normed = nw * pooled / torch.sqrt(pooled.pow(2).mean() + 1e-6)
    c, s = cs(1, 1)
    assert torch.allclose(one[1], R.rope(normed[None], c, s)[0], atol=1e-5)


def test_gating_hash_and_bias_only_selects():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    s = torch.nn.functional.softplus(logits).sqrt()
    w, ids = R.gating_topk(logits, torch.tensor([10.0, 0.0, 0.0, 0.0]), None, 2, 1.5)
    assert sorted(ids[0].tolist()) == [0, 1]                          # bias pulls expert 0 in
    picked = s[0, ids[0]]
    assert torch.allclose(w[0], picked / picked.sum() * 1.5)
    w2, ids2 = R.gating_topk(logits, None, torch.tensor([[3, 2]]), 2, 1.0)
    assert ids2.tolist() == [[3, 2]] and math.isclose(w2.sum().item(), 1.0, rel_tol=1e-6)


def test_row_results_do_not_depend_on_the_batch():
    """Batch invariance at the op level: a row's GEMM / routing / mHC / rope result is the same
    whether it is computed alone or among other rows (CPU BLAS and vector kernels round
    differently for leftover rows; the reference pads and rounds from fp64 to avoid it)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 256, generator=g), torch.randn(129, 256, generator=g)
    alone = torch.cat([R.linear(x[i:i + 1], w) for i in range(300)])
    for M in list(range(1, 40)) + [127, 128, 129, 300]:
        assert torch.equal(R.linear(x[:M], w), alone[:M]), M
    xg, wg = torch.randn(40, 2, 64, generator=g), torch.randn(2 * 32, 64, generator=g)
    alone = torch.cat([R.grouped_linear(xg[i:i + 1], wg) for i in range(40)])
    assert all(torch.equal(R.grouped_linear(xg[:M], wg), alone[:M]) for M in range(1, 41))
    logits, bias = torch.randn(50, 16, generator=g) * 4, torch.randn(16, generator=g)
    alone = [R.gating_topk(logits[i:i + 1], bias, None, 6, 1.5) for i in range(50)]
    for M in (2, 3, 17, 50):
        wts, ids = R.gating_topk(logits[:M], bias, None, 6, 1.5)
        assert torch.equal(wts, torch.cat([a[0] for a in alone[:M]])) and torch.equal(ids, torch.cat([a[1] for a in alone[:M]]))
    n, H = 4, 64
    X = torch.randn(33, n, H, generator=g)
    fn, base, scale = torch.randn((2 + n) * n, n * H, generator=g) * 0.1, torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g)
    alone = [R.hc_pre(X[i:i + 1], fn, scale, base, 1e-6, 1e-6, 5) for i in range(33)]
    for M in (2, 5, 33):
        got = R.hc_pre(X[:M], fn, scale, base, 1e-6, 1e-6, 5)
        assert all(torch.equal(t, torch.cat([a[k] for a in alone[:M]])) for k, t in enumerate(got))


def test_lm_head_and_batched_moe_keep_rows_independent(monkeypatch):
    """The streamed LM head and the batched routed experts of decode-sized batches give each row
    the bits it gets alone, and the same bits as the plain paths they replace; experts too large
    to gather per call, and empty inputs, take the loop."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(40, 64, generator=g), torch.randn(1000, 64, generator=g)
    alone = torch.cat([R.lm_head(x[i:i + 1], w) for i in range(40)])
    for M in (1, 2, 7, 8, 9, 17, 40):
        assert torch.equal(R.lm_head(x[:M], w), alone[:M]), M
    assert torch.allclose(alone, x @ w.T, atol=1e-5) and R.lm_head(x[:0], w).shape == (0, 1000)
    E, I, H, k = 16, 32, 64, 6
    w1, w3 = torch.randn(E, I, H, generator=g) * 0.1, torch.randn(E, I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    xs = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(40)])   # unsorted, as hash layers
    wts = torch.rand(40, k, generator=g)
    for act in (None, "int8-token"):
        alone = torch.cat([R.moe_experts(xs[i:i + 1], ids[i:i + 1], wts[i:i + 1], w1, w3, w2, 10.0, act)
                           for i in range(40)])
        for T in (2, 5, 16, 17, 40):                       # batched up to MOE_BATCHED_TOKENS, looped above
            assert torch.equal(R.moe_experts(xs[:T], ids[:T], wts[:T], w1, w3, w2, 10.0, act), alone[:T]), (T, act)
        for key, value in (("MOE_BATCHED_TOKENS", 0), ("MOE_BATCHED_MAX_EXPERT", I * H - 1)):
            monkeypatch.setattr(R, key, value)             # the loop: same bits
            assert torch.equal(R.moe_experts(xs[:16], ids[:16], wts[:16], w1, w3, w2, 10.0, act), alone[:16])
            monkeypatch.undo()
    assert R.moe_experts(xs[:0], ids[:0], wts[:0], w1, w3, w2, 10.0).shape == (0, H)
