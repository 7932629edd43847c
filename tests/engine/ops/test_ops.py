"""Reference ops: exact semantics on small hand-checkable cases, and chunking invariance."""
import math

import pytest
import torch

import engine.ops.reference as R
from engine.model.state import CompressorState

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
    monkeypatch.setattr(R.attention, "SCORE_BUDGET", 64)              # forces 1-3 queries per chunk
    assert torch.allclose(R.sparse_attn(q, pos, win_kv, 100 - (W - 1), W, cmp, 4, topk, sinks, 0.5), out, atol=1e-6)


def test_csa_attends_its_picks_to_a_width_set_by_its_position():
    """A short CSA context attends the first ``csa_pick_width`` columns of its picks (its n
    candidates rounded up to an eighth of topk, 0 before the first entry), not all topk: the
    values of attending every pick, the same bits in chunks that cross a width boundary as one
    query at a time (a row that picked all its candidates reads them shared, alone, and gathered,
    in a chunk with rows that did not), and the same bits for a kernel's unordered picks."""
    from engine.ops.reference.attention import csa_pick_width, csa_width_end
    assert [csa_pick_width(p, 4, 16) for p in (0, 2, 3, 7, 10, 11, 63, 64, 200)] == [0, 0, 2, 2, 2, 4, 16, 16, 16]
    assert [csa_pick_width(p, 4, 512) for p in (3, 258, 259, 2047, 1 << 20)] == [64, 64, 128, 512, 512]
    assert (csa_width_end(0, 4, 16), csa_width_end(3, 4, 16), csa_width_end(60, 4, 16)) == (3, 11, 1 << 62)
    T, h, d, W, k = 96, 2, 8, 4, 16                  # n from 0 to 24: all candidates picked up to 16
    gen = torch.Generator().manual_seed(1)       # its own stream: the tests after it keep theirs

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    pos = torch.arange(T)
    win_kv, cmp, q, sinks = rnd(T, d), rnd(T // 4, d), rnd(T, h, d), rnd(h)
    topk = R.indexer_topk(rnd(T, 2, d), rnd(T, 2), rnd(T // 4, d), pos, 4, k, 0.5)   # ascending, -1 last
    out = R.sparse_attn(q, pos, win_kv, 0, W, cmp, 4, topk, sinks, 0.5)
    keys = [list(range(max(0, t - W + 1), t + 1)) + [T + int(i) for i in topk[t] if i >= 0] for t in range(T)]
    assert torch.allclose(out, naive_attention(q, pos, keys, torch.cat([win_kv, cmp]), sinks, 0.5), atol=1e-5)
    alone = torch.cat([R.sparse_attn(q[t:t + 1], pos[t:t + 1], win_kv, 0, W, cmp, 4, topk[t:t + 1], sinks, 0.5)
                       for t in range(T)])
    assert torch.equal(out, alone)
    shuffled = torch.stack([row[torch.randperm(k, generator=gen)] for row in topk])
    short = sum(csa_pick_width(p, 4, k) < k for p in range(T))      # rows whose picks are sorted first
    assert short == 59 and torch.equal(R.sparse_attn(q, pos, win_kv, 0, W, cmp, 4, shuffled, sinks, 0.5)[:short],
                                       out[:short])


def test_topk_ties_break_to_lower_index_and_pad():
    s = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    allowed = torch.ones_like(s, dtype=torch.bool)
    assert R.topk_low_index(s, allowed, 3).tolist() == [[1, 2, 3]]
    assert R.topk_low_index(s, allowed, 4).tolist() == [[1, 2, 3, 5]]
    allowed[0, 3:] = False
    s2 = s.masked_fill(~allowed, float("-inf"))
    assert R.topk_low_index(s2, allowed, 4).tolist() == [[0, 1, 2, -1]]
    zeros = torch.zeros(1, 6)
    assert R.topk_low_index(zeros, torch.ones(1, 6, dtype=torch.bool), 2).tolist() == [[0, 1]]


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
    monkeypatch.setattr(R.attention, "SCORE_BUDGET", 16)
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
    """The streamed LM head and the routed experts (one buffer of row blocks within
    MOE_BLOCK_BYTES, a loop over experts past it) give each row the bits it gets alone,
    both expert paths the same bits, and the values of the plain math; empty inputs give empty
    outputs."""
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
    naive = torch.zeros(40, H)
    for t in range(40):
        for e, wgt in zip(ids[t].tolist(), wts[t]):
            h = R.swiglu_clamp(xs[t] @ w1[e].T, xs[t] @ w3[e].T, 10.0)
            naive[t] += wgt * (h @ w2[e].T)
    for act in (None, "int8-token"):
        alone = torch.cat([R.moe_experts(xs[i:i + 1], ids[i:i + 1], wts[i:i + 1], w1, w3, w2, 10.0, act)
                           for i in range(40)])
        for T in (2, 5, 16, 17, 40):                       # one buffer of row blocks
            assert torch.equal(R.moe_experts(xs[:T], ids[:T], wts[:T], w1, w3, w2, 10.0, act), alone[:T]), (T, act)
        monkeypatch.setattr(R.moe, "MOE_BLOCK_BYTES", 0)       # the loop over experts: same bits
        for T in (1, 16, 40):
            assert torch.equal(R.moe_experts(xs[:T], ids[:T], wts[:T], w1, w3, w2, 10.0, act), alone[:T]), (T, act)
        monkeypatch.undo()
    assert torch.allclose(R.moe_experts(xs, ids, wts, w1, w3, w2, 10.0), naive, atol=1e-5)
    assert R.moe_experts(xs[:0], ids[:0], wts[:0], w1, w3, w2, 10.0).shape == (0, H)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_gemm_row_keeps_its_bits_at_any_row_count(threads):
    """Every GEMM and per-row batched matmul: a row's bits at M = 1, 2, 3, 5, 8, 13 rows (two
    offsets) equal its bits among 40 rows, on 1, 2 and 4 threads; attention and indexer rows of a
    chunk equal the rows run one at a time. CPU BLAS splits a call's work by the call's shape and
    rounds differently per split; on an AMD EPYC (MKL ignores strict CNR there) a row of
    ``[M, 256] x [256, 16]`` changed between M = 8 and 16 rows, a batched matmul item between 1
    and 2 items and a score column between 11 and 12 columns, so the ops run calls of one shape."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_rows_keep_their_bits()
    finally:
        torch.set_num_threads(before)


def _check_rows_keep_their_bits():
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)                                   # noqa: E731
    B = 40

    def same_rows(name, f, *xs):
        """f over rows s .. s+M-1 of every x equals rows s .. s+M-1 of f over all B rows."""
        full = f(*(x[:B] for x in xs))
        for M in (1, 2, 3, 5, 8, 13):
            for s in (0, 3):
                part = f(*(x[s:s + M] for x in xs))
                for a, b in zip(*((t,) if torch.is_tensor(t) else t for t in (part, full))):
                    assert torch.equal(a, b[s:s + M]), (name, M, s)

    x = r(B, 256)
    for N in (4, 16, 24, 129, 1024):
        w = r(N, 256)
        same_rows(f"linear N={N}", lambda a: R.linear(a, w), x)
    same_rows("lm_head", lambda a: R.lm_head(a, w), x)                             # w: [1024, 256]
    wg = r(2 * 128, 64)
    same_rows("grouped_linear", lambda a: R.grouped_linear(a, wg), r(B, 2, 64))
    n, H = 4, 64
    fn, base, scale = r((2 + n) * n, n * H) * 0.1, r((2 + n) * n), torch.rand(3, generator=g)
    X = r(B, n, H)
    same_rows("hc_pre", lambda a: R.hc_pre(a, fn, scale, base, 1e-6, 1e-6, 5), X)
    same_rows("hc_head", lambda a: R.hc_head(a, fn[:n], scale[:1], base[:n], 1e-6, 1e-6), X)
    comb = torch.softmax(r(B, n, n), -1)
    same_rows("hc_post", R.hc_post, r(B, H), X, torch.rand(B, n, generator=g), comb)
    E, I, k = 16, 32, 6
    w1, w3, w2 = r(E, I, H) * 0.1, r(E, I, H) * 0.1, r(E, H, I) * 0.1
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)])
    same_rows("moe_experts", lambda a, i, wt: R.moe_experts(a, i, wt, w1, w3, w2, 10.0), r(B, H), ids,
              torch.rand(B, k, generator=g))
    # per-row products (attention, indexer): shared keys, gathered per-row keys and overlapping
    # windows of one key sequence, each row alike
    h, d, W, nk = 4, 128, 32, 16
    q, keys = r(B, h, d), r(nk, d)
    same_rows("row_scores shared", lambda a: R.row_scores(a, keys), q)
    same_rows("row_scores per row", lambda a, kk: R.row_scores(a, kk), q, keys.expand(B, nk, d).contiguous())
    assert torch.equal(R.row_scores(q, keys), R.row_scores(q, keys.expand(B, nk, d).contiguous()))
    kv = r(B + W - 1, d)
    win = kv.unfold(0, W, 1).transpose(1, 2)                                     # [B, W, d] views
    same_rows("row_scores window", lambda a, kk: R.row_scores(a, kk), q, win)
    assert torch.equal(R.row_scores(q, win), R.row_scores(q, win.contiguous()))
    p = torch.softmax(r(B, h, W + nk + 1), -1)
    same_rows("row_mix window", lambda a, v: R.row_mix(a[..., :W], v), p, win)
    same_rows("row_mix shared", lambda a: R.row_mix(a[..., W:-1], keys), p)
    same_rows("weighted_relu_sum", lambda s, wt: R.weighted_relu_sum(s.clone(), wt, 0.5), r(B, 16, 100), r(B, 16))
    # the ops built on them, one query at a time vs a chunk: window + CSA picks, window + HCA
    pos = torch.arange(300, 300 + B)
    win_kv, cmp, sinks = r(B + W - 1, d), r(80, d), r(h)
    topk = torch.randint(0, 80, (B, nk), generator=g)
    topk[::3, -2:] = -1
    chunk = R.sparse_attn(q, pos, win_kv, 300 - (W - 1), W, cmp, 4, topk, sinks, 0.1)
    alone = torch.cat([R.sparse_attn(q[t:t + 1], pos[t:t + 1], win_kv, 300 - (W - 1), W, cmp, 4, topk[t:t + 1],
                                     sinks, 0.1) for t in range(B)])
    assert torch.equal(chunk, alone)
    pos = torch.arange(256, 256 + B)                                             # HCA entries 0, 1 (256 + 40 < 384)
    chunk = R.sparse_attn(q, pos, win_kv, 256 - (W - 1), W, cmp[:2], 128, None, sinks, 0.1)
    alone = torch.cat([R.sparse_attn(q[t:t + 1], pos[t:t + 1], win_kv, 256 - (W - 1), W, cmp[:2], 128, None,
                                     sinks, 0.1) for t in range(B)])
    assert torch.equal(chunk, alone)
    # indexer scores of a prefill chunk (9 .. 19 entries visible) vs one query at a time (decode)
    qi, wi, ki, pos = r(B, 16, d), r(B, 16), r(B // 4 + 20, d), torch.arange(37, 37 + B)
    (_, _, chunk, _), = R.indexer_scores(qi, wi, ki, pos, 4, 0.1)
    for t in range(B):
        (_, _, alone, _), = R.indexer_scores(qi[t:t + 1], wi[t:t + 1], ki, pos[t:t + 1], 4, 0.1)
        assert torch.equal(alone[0], chunk[t, :alone.shape[1]]), t
