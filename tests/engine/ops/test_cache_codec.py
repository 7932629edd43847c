"""The decode-state cache codecs (engine.ops.cache_codec) and the cache-dtype settings
(engine.cache_dtype): byte layouts, round-trip error, and which checkpoint keeps which caches."""
from __future__ import annotations

import pytest
import torch

from engine.cache_dtype import CacheDtype, indexer_row_bytes, kv_row_bytes, resolve
from engine.checkpoint.qscheme import QUANT_TYPES, compressed_tensors_config
from engine.ops.cache_codec import CacheCodec, CacheRows, quant_query


def _rows(n, d, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * scale


def test_row_bytes_are_the_npu_layouts():
    # reference §4: 950 FP8 KV 640 B/token, A3 int8 indexer 130 B, 950 fp8 indexer 132 B, bf16 1 KiB / 256 B
    assert kv_row_bytes("fp8", 512, 64, 2) == 640
    assert kv_row_bytes("hif8", 512, 64, 2) == 512
    assert kv_row_bytes("none", 512, 64, 2) == 1024
    assert [indexer_row_bytes(k, 128, 2) for k in ("none", "int8", "fp8", "hif8")] == [256, 130, 132, 128]
    for kind, idx in (("fp8", False), ("hif8", False), ("int8", True), ("fp8", True), ("none", True)):
        c = CacheCodec(kind, 128 if idx else 512, torch.bfloat16, rope_dim=0 if idx else 64, indexer=idx)
        assert sum(p.shape[-1] * p.element_size() for p in c.encode(_rows(3, c.dim))) == c.row_bytes


def test_fp8_kv_row_layout():
    """kv_compress_epilog quant_mode 2: rope bf16 bytes first, then e4m3 nope, then one e8m0 exponent
    per 64 nope values (power-of-two scale >= amax / 448), zero padding to 128 bytes."""
    c = CacheCodec("fp8", 512, torch.bfloat16, rope_dim=64)
    x = _rows(6, 512).to(torch.bfloat16)
    x[1, :448] = 0                                      # an all-zero nope: amax floor 1e-4
    (row,) = c.encode(x)
    assert row.shape == (6, 640) and row.dtype == torch.uint8
    assert torch.equal(row[:, :128], x[:, 448:].contiguous().view(torch.uint8))
    exps = row[:, 576:583].float() - 127
    amax = x[:, :448].float().view(6, 7, 64).abs().amax(-1).clamp_min(1e-4)
    assert torch.equal(exps, torch.ceil(torch.log2(amax / 448)))
    assert (row[:, 583:] == 0).all()
    nope = row[:, 128:576].view(torch.float8_e4m3fn).float().view(6, 7, 64)
    assert nope.abs().amax() <= 448
    y = c.decode((row,))
    assert torch.equal(y[:, 448:], x[:, 448:])                               # rope part exact
    assert torch.equal(y[1, :448], torch.zeros(448, dtype=torch.bfloat16))
    rel = (y.float() - x.float()).norm() / x.float().norm()
    assert 0 < rel < 0.04                                                    # e4m3: 3 mantissa bits


@pytest.mark.parametrize("kind,indexer,bound", [("fp8", False, 0.04), ("hif8", False, 0.04), ("int8", True, 0.01),
                                                ("fp8", True, 0.04), ("hif8", True, 0.04)])
def test_round_trip_error_and_idempotence(kind, indexer, bound):
    c = CacheCodec(kind, 128, torch.float32, rope_dim=0 if indexer else 64, indexer=indexer)
    x = _rows(64, 128, seed=3)
    y = c.round_trip(x)
    rel = ((y - x).norm(dim=-1) / x.norm(dim=-1)).max()
    assert 0 < rel < bound
    assert torch.equal(c.round_trip(y), y)             # stored values are fixed points: re-encoding is lossless
    assert y.dtype == torch.float32 and y.shape == x.shape


def test_int8_indexer_scale_and_values():
    c = CacheCodec("int8", 128, torch.bfloat16, indexer=True)
    x = _rows(4, 128).to(torch.bfloat16)
    q, s = c.encode(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (4, 1)
    assert torch.equal(s, (x.float().abs().amax(-1, keepdim=True) / 127).half())
    assert (q.abs().amax(-1) == 127).all()             # the largest value of every row maps to +-127
    zero = c.encode(torch.zeros(2, 128))
    assert (zero[0] == 0).all() and torch.isfinite(c.decode(zero)).all()


def test_quant_query_matches_key_quantisation():
    c = CacheCodec("int8", 32, torch.float32, indexer=True)
    q = _rows(12, 32).view(3, 4, 32)
    got = quant_query(c, q)
    assert torch.equal(got, c.round_trip(q.reshape(12, 32)).view(3, 4, 32))    # per (token, head)
    assert quant_query(CacheCodec("none", 32, torch.float32, indexer=True), q) is q


def test_cache_rows_read_write_gather():
    c = CacheCodec("fp8", 128, torch.float32, rope_dim=64, indexer=False)
    rows = CacheRows.zeros(c, 10, "cpu")
    x = _rows(3, 128)
    idx = torch.tensor([7, 2, 5])
    rows.write(idx, x)
    assert torch.equal(rows.read(idx), c.round_trip(x))
    assert torch.equal(rows.read(idx[None])[0], rows.read(idx))          # any index shape
    other = CacheRows.zeros(c, 10, "cpu")
    other.scatter(torch.tensor([0, 1, 2]), rows.gather(idx))
    assert torch.equal(other.read(torch.arange(3)), rows.read(idx))
    assert rows.nbytes == 10 * c.row_bytes


def test_resolve_settings_and_checkpoint_schemes():
    assert resolve("bfloat16", None) == CacheDtype("none", "none")
    assert resolve("int8", None) == CacheDtype("none", "int8")
    assert resolve("fp8", None) == CacheDtype("fp8", "fp8")
    assert resolve("hif8", None) == CacheDtype("hif8", "hif8")
    assert resolve("auto", None) == CacheDtype()
    assert resolve("auto", {"quant_method": "fp8", "fmt": "e4m3"}) == CacheDtype()     # original HF checkpoint
    ratios = [0, 0, 4, 128]
    want = {"w8a8-int": ("none", "int8"), "w4a8-int": ("none", "int8"), "w4a8-mx": ("fp8", "fp8"),
            "w4a8-mx-hif": ("hif8", "hif8")}
    for qt in QUANT_TYPES:
        if qt in want:
            assert resolve("auto", compressed_tensors_config(4, ratios, qt)) == CacheDtype(*want[qt]), qt
    assert resolve("auto", compressed_tensors_config(4, ratios, None)) == CacheDtype("fp8", "fp8")
    assert resolve("auto", compressed_tensors_config(4, ratios, None, hif=True)) == CacheDtype("hif8", "hif8")


def test_resolve_refusals_name_the_key():
    with pytest.raises(ValueError, match="scheduler_config.kv_cache_dtype: expected 'auto'"):
        resolve("fp16", None)
    qc = compressed_tensors_config(4, [0, 0, 4, 128], "w8a8-int")
    for bad in ({"type": "int", "num_bits": 4}, {"type": ["int"], "num_bits": 8}, {"type": {"a": 1}, "num_bits": 8},
                {"type": "int", "num_bits": 8.0}, {"type": "int", "num_bits": True}, "int8"):
        with pytest.raises(ValueError, match="quantization_config.li_cache_scheme"):
            resolve("auto", {**qc, "li_cache_scheme": bad})
    groups = {"group_0": {**qc["config_groups"]["group_0"], "input_activations": "tensor"}}
    with pytest.raises(ValueError, match="quantization_config.config_groups.group_0.input_activations"):
        resolve("auto", {**qc, "config_groups": groups})


def test_run_config_key(tmp_path):
    from engine.config import ConfigError, ModelArgs
    from engine.checkpoint.make_tiny import PRESETS
    from engine.run_config import RunConfig
    with pytest.raises(ConfigError, match="scheduler_config.kv_cache_dtype"):
        RunConfig.from_dict({"scheduler_config": {"kv_cache_dtype": "float8"}})
    cfg = RunConfig.from_dict({"scheduler_config": {"kv_cache_dtype": "fp8"}})
    assert cfg.cache_dtype_for(ModelArgs.from_dict(PRESETS["flash"])) == CacheDtype("fp8", "fp8")
