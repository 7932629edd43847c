"""The quantised-cache wrappers of ``engine.ops.npu.cache_quant`` against contract stubs: the
pure-torch twins of the cann-recipes-infer custom ops and of ``torch_npu.npu_dynamic_quant`` in
``bench.npu_stub``, each written from its doc's golden formula (not from ``engine.ops.cache_codec``)
and checking the documented dtypes / shapes / kwargs; the twin here records every call. They prove
which kernel each pool kind reaches and with what, that every other input falls back naming its
reason, and that the kernels' bytes equal the codec's (the stored row is the reference math). The reference ops over the pools are checked against the
plain attention ops on the decoded rows."""
from __future__ import annotations

import logging

import pytest
import torch

import engine.ops.npu as npu
import engine.ops.npu.cache_quant as cq
import engine.ops.npu.runtime as npu_runtime
from bench import npu_stub
from engine.ops import reference as R
from engine.ops.cache_codec import CacheCodec, CacheRows, quant_query

CUSTOM, NPU = npu_stub.kernels("custom"), npu_stub.kernels("torch_npu")
# what each twin call records (the call's arguments by name -> a tuple), per API
RECORD = {
    "kv_compress_epilog": lambda a: ("kv_compress_epilog", tuple(a["kv_compress_cache"].shape), a["x"].dtype,
                                     tuple(a["x"].shape), a["slot_mapping"].dtype),
    "indexer_compress_epilog": lambda a: ("indexer_compress_epilog", tuple(a["indexer_compress_cache"].shape),
                                          tuple(a["indexer_compress_scale"].shape), a["x"].dtype,
                                          a["slot_mapping"].dtype),
    "scatter_nd_update_asc": lambda a: ("scatter_nd_update_asc", a["var"].dtype, tuple(a["var"].shape),
                                        tuple(a["update"].shape)),
    "npu_quant_lightning_indexer_metadata": lambda a: (
        "li_metadata", *(a[k] for k in ("num_heads_q", "num_heads_k", "head_dim", "query_quant_mode",
                                        "key_quant_mode", "batch_size", "max_seqlen_q", "max_seqlen_k", "layout_query",
                                        "layout_key", "sparse_count", "sparse_mode", "cmp_ratio"))),
    "npu_quant_lightning_indexer": lambda a: ("quant_li", tuple(a["key"].shape), tuple(a["block_table"].shape),
                                              a["sparse_count"], a["cmp_ratio"]),
    "npu_dynamic_quant": lambda a: ("npu_dynamic_quant", a["input"].dtype, tuple(a["input"].shape)),
}


class Twin:
    """A namespace of ``bench.npu_stub``'s contract stubs (``torch.ops.custom`` or ``torch_npu``):
    pure torch from the docs' goldens, each checking its documented contract (``ContractError``)
    and its schema's arguments; every call is recorded in ``calls`` as ``RECORD`` says."""

    def __init__(self, stubs, calls: list):
        self.stubs, self.calls = stubs, calls

    def __getattr__(self, name):
        stub = getattr(self.stubs, name)

        def call(*args, **kwargs):
            self.calls.append(RECORD[name](stub.bind(args, kwargs)))
            return stub(*args, **kwargs)
        return call


@pytest.fixture
def twin(monkeypatch, caplog):
    t = Twin(CUSTOM, [])
    monkeypatch.setattr(npu_runtime, "_LOGGED", set())
    monkeypatch.setattr(npu_runtime, "NPU_DEVICE_TYPES", ("npu", "cpu"))  # CPU tensors count as on an NPU
    monkeypatch.setattr(cq, "custom_namespace", lambda: t)
    monkeypatch.setattr(cq, "torch_npu_module", lambda: Twin(NPU, t.calls))
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


@pytest.mark.parametrize("codec", [CacheCodec("none", 512, torch.bfloat16, rope_dim=64),
                                   CacheCodec("none", 128, torch.float16, indexer=True)])
def test_unquantised_write_is_one_scatter_of_the_rows_as_they_are(twin, caplog, codec):
    g = torch.Generator().manual_seed(4)
    rows = CacheRows.zeros(codec, 7, "cpu")
    x, idx = torch.randn(3, codec.dim, generator=g).to(codec.dtype), torch.tensor([6, 0, 3])
    cq.cache_write(rows, idx, x)
    assert twin.calls == [("scatter_nd_update_asc", codec.dtype, (7, codec.dim), (3, codec.dim))]
    assert torch.equal(rows.parts[0][idx], x) and _reasons(caplog) == []


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
    (CacheCodec("none", 256, torch.bfloat16, rope_dim=64), torch.bfloat16, "kv none d 256, scatter takes"),
    (CacheCodec("none", 512, torch.float32, rope_dim=64), torch.float32, "x dtype float32"),
    (CacheCodec("hif8", 512, torch.bfloat16, rope_dim=64), torch.bfloat16, "kv hif8 cache: no documented"),
    (CacheCodec("hif8", 128, torch.bfloat16, indexer=True), torch.bfloat16, "indexer hif8 cache: no documented"),
    (CacheCodec("fp8", 512, torch.float16, rope_dim=64), torch.float16, "x dtype float16, kernel path takes bfloat16"),
    (CacheCodec("fp8", 256, torch.bfloat16, rope_dim=64), torch.bfloat16, "kv row d=256 rope=64 (384 B)"),
    (CacheCodec("fp8", 512, torch.bfloat16, rope_dim=32), torch.bfloat16, "kv row d=512 rope=32"),
    (CacheCodec("fp8", 256, torch.bfloat16, indexer=True), torch.bfloat16, "indexer d 256, pool keeps one scale"),
    (CacheCodec("int8", 64, torch.bfloat16, indexer=True), torch.bfloat16, "indexer int8 d 64, scatter takes"),
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
