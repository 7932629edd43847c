"""The quantised-cache wrappers of ``engine.ops.npu.cache_quant`` against contract stubs: pure-torch
twins of the cann-recipes-infer custom ops and of ``torch_npu.npu_dynamic_quant``, each written from
its doc's golden formula (not from ``engine.ops.cache_codec``), that check the documented dtypes /
shapes / kwargs and record every call. They prove which kernel each pool kind reaches and with what,
that every other input falls back naming its reason, and that the kernels' bytes equal the codec's
(the stored row is the reference math). The reference ops over the pools are checked against the
plain attention ops on the decoded rows."""
from __future__ import annotations

import logging

import pytest
import torch

import engine.ops.npu as npu
import engine.ops.npu.cache_quant as cq
import engine.ops.npu.runtime as npu_runtime
from engine.ops import reference as R
from engine.ops.cache_codec import CacheCodec, CacheRows, quant_query

E4M3 = torch.float8_e4m3fn


class TwinCustom:
    """``torch.ops.custom`` epilogues / quantised indexer in pure torch (docs' goldens), recording calls."""

    def __init__(self):
        self.calls = []

    def kv_compress_epilog(self, kv_compress_cache, x, slot_mapping, *, quant_group_size=64, quant_mode=2,
                           round_scale_flag=True, scale=1.0):
        # custom-npu_kv_compress_epilog.md + examples golden_mxfp8_row (quant_mode 2)
        assert kv_compress_cache.dtype == E4M3 and kv_compress_cache.is_contiguous()
        assert x.dtype == torch.bfloat16 and x.shape[1] == 512 and x.is_contiguous()
        assert slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == (x.shape[0],)
        assert (quant_group_size, quant_mode, round_scale_flag) == (64, 2, True)
        self.calls.append(("kv_compress_epilog", tuple(kv_compress_cache.shape), x.dtype, tuple(x.shape),
                           slot_mapping.dtype))
        rope, nope = x[:, 448:], x[:, :448].float().view(-1, 7, 64)
        s = nope.abs().amax(-1, keepdim=True).clamp_min(1e-4) * torch.tensor(1 / 448.0, dtype=torch.float32)
        bits = s.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()        # round the scale up to 2^k
        s = (exp << 23).view(torch.float32)
        q = (nope / s).clamp(-448, 448).to(E4M3).view(torch.uint8).view(-1, 448)
        row = torch.zeros(x.shape[0], kv_compress_cache.shape[1], dtype=torch.uint8)
        row[:, :128] = rope.contiguous().view(torch.uint8)
        row[:, 128:576], row[:, 576:583] = q, exp.view(-1, 7).to(torch.uint8)
        keep = slot_mapping >= 0
        kv_compress_cache.view(torch.uint8)[slot_mapping[keep].long()] = row[keep]

    def indexer_compress_epilog(self, indexer_compress_cache, indexer_compress_scale, x, slot_mapping, *,
                                quant_mode=1, round_scale=True, scale=1.0):
        # custom-npu_indexer_compress_epilog.md + examples dynamic_block_quant (quant_mode 1)
        assert indexer_compress_cache.dtype == E4M3 and indexer_compress_scale.dtype == torch.float32
        assert x.dtype in (torch.float16, torch.bfloat16) and slot_mapping.dtype == torch.int32
        d = x.shape[1]
        assert indexer_compress_scale.shape[1] == -(-d // 128) and quant_mode == 1
        self.calls.append(("indexer_compress_epilog", tuple(indexer_compress_cache.shape),
                           tuple(indexer_compress_scale.shape), x.dtype, slot_mapping.dtype))
        blocks = x.float().view(x.shape[0], -1, 128)
        s = blocks.abs().amax(-1, keepdim=True) / 448.0
        q = torch.nan_to_num((blocks / s).clamp(-448, 448)).to(E4M3).view(x.shape[0], d)
        keep = slot_mapping >= 0
        indexer_compress_cache[slot_mapping[keep].long()] = q[keep]
        indexer_compress_scale[slot_mapping[keep].long()] = s.squeeze(-1)[keep]

    def scatter_nd_update_asc(self, var, indices, update):
        # custom-npu_scatter_nd_update_asc.md
        assert var.dtype in (torch.bfloat16, torch.float16, torch.int8) and var.shape[1] in (1, 128, 512)
        assert indices.dtype in (torch.int32, torch.int64) and indices.shape == (update.shape[0], 1)
        assert update.dtype == var.dtype and update.shape[1] == var.shape[1] and update.is_contiguous()
        self.calls.append(("scatter_nd_update_asc", var.dtype, tuple(var.shape), tuple(update.shape)))
        keep = indices[:, 0] >= 0
        var[indices[keep, 0].long()] = update[keep]

    def npu_quant_lightning_indexer_metadata(self, num_heads_q, num_heads_k, head_dim, query_quant_mode,
                                             key_quant_mode, *, actual_seq_lengths_query=None,
                                             actual_seq_lengths_key=None, batch_size=0, max_seqlen_q=0,
                                             max_seqlen_k=0, layout_query="BSND", layout_key="BSND",
                                             sparse_count=2048, sparse_mode=3, pre_tokens=2 ** 63 - 1,
                                             next_tokens=2 ** 63 - 1, cmp_ratio=1, device="npu:0"):
        self.calls.append(("li_metadata", num_heads_q, num_heads_k, head_dim, query_quant_mode, key_quant_mode,
                           batch_size, max_seqlen_q, max_seqlen_k, layout_query, layout_key, sparse_count,
                           sparse_mode, cmp_ratio))
        return torch.zeros(1024, dtype=torch.int32)

    def npu_quant_lightning_indexer(self, query, key, weights, query_dequant_scale, key_dequant_scale,
                                    query_quant_mode, key_quant_mode, *, actual_seq_lengths_query=None,
                                    actual_seq_lengths_key=None, block_table=None, metadata=None,
                                    layout_query="BSND", layout_key="PA_BSND", sparse_count=2048, sparse_mode=3,
                                    pre_tokens=2 ** 63 - 1, next_tokens=2 ** 63 - 1, cmp_ratio=1,
                                    return_value=False, query_dtype=None, key_dtype=None):
        # custom-npu_quant_lightning_indexer.md: Top-k of sum_h W * ReLU((sq sk) * (q . k)), TND / PA_BSND
        T, n1, d = query.shape
        nb, bs, n2, _ = key.shape
        assert query.dtype == key.dtype == torch.int8 and (n1, n2, d) == (64, 1, 128)
        assert weights.dtype == query_dequant_scale.dtype == key_dequant_scale.dtype == torch.float16
        assert key_dequant_scale.shape == (nb, bs, 1) and weights.shape == query_dequant_scale.shape == (T, 64)
        assert block_table.dtype == torch.int32 and block_table.dim() == 2 and metadata is not None
        assert (layout_query, layout_key, sparse_mode, return_value) == ("TND", "PA_BSND", 3, False)
        self.calls.append(("quant_li", tuple(key.shape), tuple(block_table.shape), sparse_count, cmp_ratio))
        S2 = int(actual_seq_lengths_key[0])
        n = S2 // cmp_ratio
        ids = torch.arange(n)
        rows = block_table[0, ids // bs].long() * bs + ids % bs
        k = key.view(nb * bs, d)[rows].float() * key_dequant_scale.view(-1)[rows, None].float()
        q = query.float() * query_dequant_scale.float()[..., None]
        s = (torch.einsum("thd,nd->thn", q, k).relu() * weights.float()[..., None]).sum(1)
        seen = (S2 - T + torch.arange(T) + 1) // cmp_ratio
        s = s.masked_fill(ids[None] >= seen[:, None], float("-inf"))
        kk = min(sparse_count, n)
        v, top = s.topk(kk, dim=-1)                                       # by score, not by id
        top = torch.where(torch.isinf(v), -1, top)
        out = torch.full((T, sparse_count), -1, dtype=torch.int32)
        out[:, :kk] = top.int()
        return out.view(T, 1, sparse_count), None


class TwinNpu:
    """``torch_npu.npu_dynamic_quant`` [OPP]: per-row symmetric int8, fp32 scale amax / 127."""

    def __init__(self, calls):
        self.calls = calls

    def npu_dynamic_quant(self, x, *, smooth_scales=None):
        assert x.dtype in (torch.float16, torch.bfloat16)
        self.calls.append(("npu_dynamic_quant", x.dtype, tuple(x.shape)))
        s = x.float().abs().amax(-1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        return torch.round(x.float() / s).clamp(-127, 127).to(torch.int8), s.squeeze(-1)


@pytest.fixture
def twin(monkeypatch, caplog):
    t = TwinCustom()
    monkeypatch.setattr(npu_runtime, "_LOGGED", set())
    monkeypatch.setattr(cq, "device_why", lambda x: None)                 # pretend the tensors are on an NPU
    monkeypatch.setattr(cq, "custom_namespace", lambda: t)
    monkeypatch.setattr(cq, "torch_npu_module", lambda: TwinNpu(t.calls))
    caplog.set_level(logging.INFO, logger="engine.ops.npu")
    return t


def _reasons(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engine.ops.npu"]


def _kv_rows(g, n=12, dt=torch.bfloat16):
    x = torch.randn(n, 512, generator=g) * torch.logspace(-3, 2, n)[:, None]
    x[0] = 0                                                              # amax floor 1e-4
    x[1, :448] = torch.tensor([7.0, -3.5] * 224)                          # amax 7 = 448 * 2^-6 exactly
    x[2, :64] = 448.0 * 2.0 ** -20                                        # a power of two times 448, tiny
    return x.to(dt)


# ---- cache_write ---------------------------------------------------------------------------------
def test_kv_fp8_write_runs_kv_compress_epilog_with_the_codec_bytes(twin, caplog):
    g = torch.Generator().manual_seed(0)
    codec = CacheCodec("fp8", 512, torch.bfloat16, rope_dim=64)
    rows = CacheRows.zeros(codec, 20, "cpu")
    x, idx = _kv_rows(g), torch.randperm(20, generator=g)[:12]
    assert npu.KERNELS["cache_write"](rows, idx, x) is None
    assert twin.calls == [("kv_compress_epilog", (20, 640), torch.bfloat16, (12, 512), torch.int64)]
    want = codec.encode(x)[0]
    assert torch.equal(rows.parts[0][idx], want)                          # byte for byte, every row
    assert _reasons(caplog) == []


def test_indexer_fp8_write_runs_indexer_compress_epilog(twin, caplog):
    g = torch.Generator().manual_seed(1)
    codec = CacheCodec("fp8", 128, torch.bfloat16, indexer=True)
    rows = CacheRows.zeros(codec, 9, "cpu")
    x = (torch.randn(6, 128, generator=g) * 3).to(torch.bfloat16)
    idx = torch.tensor([8, 0, 3, 5, 1, 2])
    cq.cache_write(rows, idx, x)
    assert twin.calls == [("indexer_compress_epilog", (9, 128), (9, 1), torch.bfloat16, torch.int32)]
    q, s = codec.encode(x)
    assert torch.equal(rows.parts[0][idx], q) and torch.equal(rows.parts[1][idx], s)
    assert _reasons(caplog) == []


def test_indexer_fp8_zero_row_stores_the_goldens_bytes(twin):
    """The doc's golden stores scale amax / 448 = 0 and codes 0 for an all-zero row; so does the codec."""
    codec = CacheCodec("fp8", 128, torch.bfloat16, indexer=True)
    rows = CacheRows.zeros(codec, 2, "cpu")
    cq.cache_write(rows, torch.tensor([0]), torch.zeros(1, 128, dtype=torch.bfloat16))
    q, s = codec.encode(torch.zeros(1, 128))
    assert torch.equal(rows.parts[0][:1], q) and rows.parts[1][0].item() == 0.0 and s.item() == 0.0
    assert torch.equal(codec.decode(rows.gather(torch.tensor([0]))), torch.zeros(1, 128, dtype=torch.bfloat16))


def test_indexer_int8_write_runs_dynamic_quant_and_two_scatters(twin, caplog):
    g = torch.Generator().manual_seed(2)
    codec = CacheCodec("int8", 128, torch.float16, indexer=True)
    rows = CacheRows.zeros(codec, 7, "cpu")
    x = (torch.randn(4, 128, generator=g) * 5).half()
    idx = torch.tensor([6, 2, 0, 3])
    cq.cache_write(rows, idx, x)
    assert twin.calls == [("npu_dynamic_quant", torch.float16, (4, 128)),
                          ("scatter_nd_update_asc", torch.float16, (7, 1), (4, 1)),
                          ("scatter_nd_update_asc", torch.int8, (7, 128), (4, 128))]
    q, s = codec.encode(x)
    assert torch.equal(rows.parts[0][idx], q) and torch.equal(rows.parts[1][idx], s)
    assert _reasons(caplog) == []


@pytest.mark.parametrize("codec,dt,reason", [
    (CacheCodec("none", 512, torch.bfloat16, rope_dim=64), torch.bfloat16, "kv none cache: no documented"),
    (CacheCodec("hif8", 512, torch.bfloat16, rope_dim=64), torch.bfloat16, "kv hif8 cache: no documented"),
    (CacheCodec("none", 128, torch.bfloat16, indexer=True), torch.bfloat16, "indexer none cache: no documented"),
    (CacheCodec("hif8", 128, torch.bfloat16, indexer=True), torch.bfloat16, "indexer hif8 cache: no documented"),
    (CacheCodec("fp8", 512, torch.float16, rope_dim=64), torch.float16, "x dtype float16, kernel path takes bfloat16"),
    (CacheCodec("fp8", 256, torch.bfloat16, rope_dim=64), torch.bfloat16, "kv row d=256 rope=64 (384 B)"),
    (CacheCodec("fp8", 512, torch.bfloat16, rope_dim=32), torch.bfloat16, "kv row d=512 rope=32"),
    (CacheCodec("fp8", 256, torch.bfloat16, indexer=True), torch.bfloat16, "indexer d 256, pool keeps one scale"),
    (CacheCodec("int8", 64, torch.bfloat16, indexer=True), torch.bfloat16, "indexer d 64, scatter takes"),
    (CacheCodec("int8", 128, torch.float32, indexer=True), torch.float32, "x dtype float32"),
])
def test_write_outside_the_contracts_falls_back_naming_the_reason(twin, caplog, codec, dt, reason):
    g = torch.Generator().manual_seed(3)
    rows, ref = CacheRows.zeros(codec, 5, "cpu"), CacheRows.zeros(codec, 5, "cpu")
    x, idx = torch.randn(3, codec.dim, generator=g).to(dt), torch.tensor([4, 0, 2])
    cq.cache_write(rows, idx, x)
    R.cache_write(ref, idx, x)
    assert twin.calls == [] and all(torch.equal(a, b) for a, b in zip(rows.parts, ref.parts))
    msgs = _reasons(caplog)
    assert len(msgs) == 1 and "op cache_write" in msgs[0] and reason in msgs[0], msgs


def test_write_checks_shapes_and_dtype_against_the_pool(twin, caplog):
    rows = CacheRows.zeros(CacheCodec("fp8", 512, torch.bfloat16, rope_dim=64), 4, "cpu")
    cq.cache_write(rows, torch.tensor([0]), torch.randn(1, 512))                     # fp32 rows
    cq.cache_write(rows, torch.tensor([], dtype=torch.long), torch.zeros(0, 512, dtype=torch.bfloat16))
    assert twin.calls == []
    msgs = _reasons(caplog)
    assert "x dtype float32" in msgs[0] and "no rows" in msgs[1]


# ---- cache_indexer_topk --------------------------------------------------------------------------
def _indexer_case(g, kind="int8", T=5, p_last=70, bs=16, h=64):
    codec = CacheCodec(kind, 128, torch.bfloat16, indexer=True)
    keys = CacheRows.zeros(codec, 3 * bs + 1, "cpu")                    # 3 blocks + the trash row
    table = torch.tensor([2, 0])                                         # entries 0..31 -> blocks 2, 0
    n = (p_last + 1) // 4
    ids = torch.arange(n)
    keys.write(table[ids // bs] * bs + ids % bs, torch.randn(n, 128, generator=g).to(torch.bfloat16))
    q = torch.randn(T, h, 128, generator=g).to(torch.bfloat16)
    w = torch.randint(-8, 9, (T, h), generator=g).float() / 64            # exact in fp16 with scale 1
    return q, w, keys, table, bs, torch.arange(p_last - T + 1, p_last + 1)


def test_int8_indexer_runs_quant_lightning_indexer_on_the_stored_blocks(twin, caplog):
    g = torch.Generator().manual_seed(4)
    q, w, keys, table, bs, pos = _indexer_case(g)
    out = npu.KERNELS["cache_indexer_topk"](q, w, keys, table, bs, pos, 4, 6, 1.0)
    assert twin.calls == [("npu_dynamic_quant", torch.bfloat16, (5, 64, 128)),
                          ("li_metadata", 64, 1, 128, 0, 0, 1, 5, 71, "TND", "PA_BSND", 6, 3, 4),
                          ("quant_li", (3, 16, 1, 128), (1, 2), 6, 4)]
    want = R.cache_indexer_topk(q, w, keys, table, bs, pos, 4, 6, 1.0)
    assert out.dtype == torch.long and torch.equal(out, want)            # ascending ids, as the reference
    assert _reasons(caplog) == []


def test_indexer_pads_with_minus_one_like_the_reference(twin):
    g = torch.Generator().manual_seed(5)
    q, w, keys, table, bs, pos = _indexer_case(g, T=3, p_last=10)       # 2 entries closed, topk 4
    out = cq.cache_indexer_topk(q, w, keys, table, bs, pos, 4, 4, 1.0)
    assert torch.equal(out, R.cache_indexer_topk(q, w, keys, table, bs, pos, 4, 4, 1.0))
    assert (out[:, 2:] == -1).all()


@pytest.mark.parametrize("case,reason", [
    (dict(kind="fp8"), "indexer fp8 keys: only int8 keys are documented"),
    (dict(kind="hif8"), "indexer hif8 keys"),
    (dict(kind="none"), "indexer none keys"),
    (dict(h=8), "heads x dim 8 x 128, kernel takes 64 x 128"),
    (dict(bs=24), "block size 24"),
    (dict(p_last=2, T=3), "no closed window"),
])
def test_indexer_outside_the_contract_falls_back_naming_the_reason(twin, caplog, case, reason):
    g = torch.Generator().manual_seed(6)
    q, w, keys, table, bs, pos = _indexer_case(g, **case)
    out = cq.cache_indexer_topk(q, w, keys, table, bs, pos, 4, 6, 1.0)
    assert torch.equal(out, R.cache_indexer_topk(q, w, keys, table, bs, pos, 4, 6, 1.0))
    assert twin.calls == []
    msgs = _reasons(caplog)
    assert len(msgs) == 1 and "op cache_indexer_topk" in msgs[0] and reason in msgs[0], msgs


# ---- the reference ops over the pools -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["none", "int8", "fp8", "hif8"])
def test_reference_indexer_reads_decoded_keys_and_quantised_queries(kind):
    g = torch.Generator().manual_seed(7)
    q, w, keys, table, bs, pos = _indexer_case(g, kind=kind)
    ids = torch.arange(17)
    k = keys.read(table[ids // bs] * bs + ids % bs)
    want = R.indexer_topk(quant_query(keys.codec, q), w, k, pos, 4, 6, 0.3)
    assert torch.equal(R.cache_indexer_topk(q, w, keys, table, bs, pos, 4, 6, 0.3), want)


@pytest.mark.parametrize("kind,ratio,sparse", [("fp8", 4, True), ("hif8", 128, False), ("none", 4, None)])
def test_reference_sparse_attn_reads_the_decoded_ring_and_entries(kind, ratio, sparse):
    g = torch.Generator().manual_seed(8)
    bs, ring, window, d = 8, 16, 8, 512
    codec = CacheCodec(kind, d, torch.bfloat16, rope_dim=64)
    win, cmp = CacheRows.zeros(codec, 4 * bs, "cpu"), CacheRows.zeros(codec, 9 * bs, "cpu")
    win_table, cmp_table = torch.tensor([3, 1]), torch.tensor([5, 0, 2, 8, 4, 1, 7, 3, 6])
    pos = torch.arange(260, 266)                                          # ring holds 253..265
    wpos = torch.arange(253, 266)
    s = wpos % ring
    win.write(win_table[s // bs] * bs + s % bs, torch.randn(13, d, generator=g))
    n = 266 // ratio
    e = torch.arange(n)
    cmp.write(cmp_table[e // bs] * bs + e % bs, torch.randn(n, d, generator=g))
    q = torch.randn(6, 4, d, generator=g).to(torch.bfloat16)
    sinks = torch.randn(4, generator=g)
    topk = torch.randint(-1, 65, (6, 5), generator=g) if sparse else None
    if sparse is None:
        cmp = cmp_table = None
    got = R.cache_sparse_attn(q, pos, win, win_table, ring, window, cmp, cmp_table, ratio, topk, sinks, 0.05, bs)
    ckv = None if cmp is None else cmp.read(cmp_table[e // bs] * bs + e % bs)
    want = R.sparse_attn(q, pos, win.read(win_table[s // bs] * bs + s % bs), 253, window, ckv, ratio, topk,
                         sinks, 0.05)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="window ring of 16"):
        R.cache_sparse_attn(q.repeat(2, 1, 1), torch.arange(260, 272), win, win_table, ring, window, None, None,
                            ratio, None, sinks, 0.05, bs)


def test_the_attention_kernels_over_quantised_kv_are_not_mapped():
    why = npu.NOT_MAPPED["cache_sparse_attn"]
    assert "npu_kv_quant_sparse_attn_sharedkv" in why and "quant_sparse_flash_mla" in why
    assert "cache_sparse_attn" not in npu.KERNELS
