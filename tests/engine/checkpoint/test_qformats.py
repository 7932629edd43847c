"""Converted weight formats (reference §7): int8 / int4 / MXFP8 / MXFP4 encoders and decoders,
the compressed-tensors scheme table, and the emulated activation quantisation."""
from __future__ import annotations

import pytest
import torch

from engine.checkpoint.fp8_mxfp4 import QuantFormatError, dequant_mxfp4
from engine.checkpoint.int8_int4 import (dequant_int, int4_bias, pack_int4_rows, quant_int4, quant_int8, scale_to_u64,
                                         u64_to_scale, unpack_int4_rows)
from engine.checkpoint.mx import dequant_mx, quant_mx
from engine.checkpoint.qscheme import compressed_tensors_config, linear_format, parse_compressed_tensors
from engine.ops import reference

G = torch.Generator().manual_seed(0)


def _w(n=64, k=96, scale=0.05):
    return torch.randn(n, k, generator=G) * scale


def test_int8_is_per_channel_absmax_over_127():
    w = _w()
    q, s = quant_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (64, 1)
    torch.testing.assert_close(s, w.abs().amax(1, keepdim=True) / 127)
    assert q.abs().amax(1).eq(127).all()                 # each row's absmax maps to +-127
    assert (dequant_int(q, s) - w).abs().le(s / 2 + 1e-7).all()


def test_int8_zero_row_and_clip_factors():
    w = _w(4, 32)
    w[1] = 0
    q, s = quant_int8(w)
    assert q[1].eq(0).all() and torch.isfinite(s).all()
    hi = torch.full((4, 1), 0.5)
    q, s = quant_int8(w, (torch.ones(4, 1), hi))
    assert dequant_int(q, s).amax(1).le(w.amax(1) * 0.5 + s[:, 0] / 2 + 1e-7).all()


def test_int4_clip_search_picks_the_least_squared_error_ratio():
    w = _w(8, 64)
    q, s = quant_int4(w)
    assert q.abs().max() <= 7
    err = (dequant_int(q, s) - w).pow(2).sum(1)
    for r in (0.7, 0.85, 1.0, 1.15, 1.3):                # brute force: no listed ratio does better
        c = r * w.amax(1, keepdim=True)
        alt = (torch.maximum(torch.minimum(w, c), -c) / (c / 7)).round().clamp(-7, 7) * (c / 7)
        assert (err <= (alt - w).pow(2).sum(1) + 1e-9).all()


def test_int4_packing_is_along_output_rows_low_nibble_first():
    q = torch.tensor([[1, -2], [3, -8], [7, 0], [-1, 5]], dtype=torch.int8)
    p = pack_int4_rows(q)
    assert p.shape == (2, 2)
    assert p.view(torch.uint8).tolist() == [[0x31, 0x8E], [0xF7, 0x50]]
    assert torch.equal(unpack_int4_rows(p), q)
    with pytest.raises(QuantFormatError, match="even number"):
        pack_int4_rows(q[:3])


def test_int4_scale_u64_and_assistance_bias():
    s = torch.tensor([[0.25], [1e-3]])
    u = scale_to_u64(s)
    assert u.dtype == torch.uint64 and u.shape == (2, 1)
    assert u.view(torch.int64)[0, 0].item() == 0x3E800000                  # fp32 bits of 0.25, high word 0
    assert torch.equal(u64_to_scale(u), s)
    q = torch.tensor([[1, -2, 3], [7, 7, -7]], dtype=torch.int8)
    torch.testing.assert_close(int4_bias(q, s), torch.tensor([8 * 0.25 * 2, 8 * 1e-3 * 7]))


def test_mx_shared_exponent_rule_and_element_rounding():
    # group max 1.8 -> mantissa 1.8 > 1.75 bumps the exponent: 2^(0 + 1 - 8) for e4m3
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 1.8, 1.0625 / 128 * 2, -3e-3
    q, s = quant_mx(w, 8)
    assert s.tolist() == [[127 + 1 - 8]]
    assert q.dtype == torch.float8_e4m3fn
    vals = q.float()[0] * 2.0 ** (1 - 8)
    assert vals[0].item() == pytest.approx(1.75)           # 1.8 / 2^-7 = 230.4 -> 224 (e4m3 step 16 there)
    # 1.0625 * 2^-6 / 2^-7 = 2.125: a tie between 2.0 and 2.25 in e4m3, rounded away from zero
    assert vals[1].item() == pytest.approx(2.25 * 2.0 ** -7)
    d = dequant_mx(q, s)
    assert d.shape == (1, 32) and d[0, 0].item() == pytest.approx(1.75)
    # group max 1.7: no bump; mxfp4 elements saturate at 6
    w = torch.full((1, 32), 1.7)
    q4, s4 = quant_mx(w, 4)
    assert s4.tolist() == [[127 + 0 - 2]] and q4.dtype == torch.uint8 and q4.shape == (1, 16)
    assert dequant_mx(q4, s4).unique().tolist() == [1.5]   # 1.7 / 0.25 = 6.8 -> 6


def test_mxfp4_uses_the_original_nibble_order():
    w = _w(16, 64)
    q, s = quant_mx(w, 4)
    torch.testing.assert_close(dequant_mx(q, s), dequant_mxfp4(q.view(torch.int8), s.view(torch.float8_e8m0fnu)))
    assert ((dequant_mx(q, s) - w).norm() / w.norm()).item() < 0.15


@pytest.mark.parametrize("quant_type,name,orig,fmt", [
    ("w8a8-int", "layers.3.ffn.experts.5.w2", "fp4", "int8"),
    ("w4a8-int", "layers.3.ffn.experts.5.w2", "fp4", "int4"),
    ("w4a8-mx", "layers.3.ffn.experts.5.w2", "fp4", "mxfp4"),
    ("w4a8-mx-hif", "layers.3.ffn.experts.5.w2", "fp4", "mxfp4"),
    ("w4a8-int", "layers.3.ffn.shared_experts.w1", "fp8", "int8"),
    ("w4a8-mx-hif", "layers.3.ffn.shared_experts.w1", "fp8", "mxfp8"),
    ("w8a8-int", "layers.0.attn.wq_a", "fp8", "bf16"),
    ("w4a8-mx", "layers.0.attn.wq_a", "fp8", "mxfp8"),
    ("w4a8-mx-hif", "layers.0.attn.wo_a", "fp8", "hif8"),
    ("w8a8-int", "layers.2.attn.indexer.wq_b", "fp8", "int8"),
    ("w4a8-mx", "layers.2.attn.compressor.wkv", "bf16", "bf16"),
    ("w4a8-mx-hif", "layers.2.attn.indexer.weights_proj", "bf16", "hif8"),
    ("w4a8-mx-hif", "layers.3.attn.compressor.wgate", "bf16", "hif8"),
    ("w4a8-mx-hif", "layers.3.ffn.gate", "bf16", "bf16"),
    ("w8a8-int", "mtp.0.e_proj", "fp8", "int8"),
    ("w4a8-mx-hif", "head", "bf16", "bf16"),
    (None, "layers.0.attn.wq_a", "fp8", "fp8"),
])
def test_linear_format_follows_upstream_generate_quant_layers(quant_type, name, orig, fmt):
    assert linear_format(quant_type, name, orig) == fmt


def test_compressed_tensors_configs_parse_back():
    ratios = [0, 0, 4, 128]
    orig = compressed_tensors_config(4, ratios, None)
    g0 = orig["config_groups"]["group_0"]
    assert orig["format"] == "float-quantized" and orig["quant_method"] == "compressed-tensors"
    assert g0["targets"] == ["Linear"] and g0["weights"]["block_structure"] == "128x128"
    assert g0["input_activations"]["group_size"] == 128
    assert orig["config_groups"]["group_1"]["weights"]["group_size"] == 32
    assert orig["kv_cache_scheme"] == {"num_bits": 8, "type": "float"}
    assert "layers.2.attn.indexer.weights_proj" in orig["ignore"] and "layers.3.attn.compressor.wkv" in orig["ignore"]
    assert orig["ignore"][-2:] == ["mtp.0.head", "head"] and "layers.0.attn.wq_a" not in orig["ignore"]
    assert parse_compressed_tensors(orig) == (None, (128, 128))
    hif = compressed_tensors_config(4, ratios, None, hif=True)
    assert "layers.3.attn.compressor.wkv" not in hif["ignore"] and hif["weight_block_size"] == [128, 128]
    assert hif["config_groups"]["group_0"]["input_activations"]["strategy"] == "tensor"
    for qt in ("w8a8-int", "w4a8-int", "w4a8-mx", "w4a8-mx-hif"):
        qc = compressed_tensors_config(4, ratios, qt)
        assert parse_compressed_tensors(qc)[0] == qt
    i8 = compressed_tensors_config(4, ratios, "w8a8-int")
    assert i8["format"] == "int-quantized" and "group_1" not in i8["config_groups"]
    assert i8["kv_cache_scheme"] is None and i8["li_cache_scheme"] == {"type": "int", "num_bits": 8}
    assert "layers.0.attn.wq_a" in i8["ignore"] and "mtp.0.attn.wo_a" in i8["ignore"]
    with pytest.raises(ValueError, match="group_0.weights.strategy"):
        parse_compressed_tensors({"format": "float-quantized", "config_groups": {"group_0": {"weights": {}}}})


@pytest.mark.parametrize("scheme", ["int8-token", "mxfp8", "hif8"])
def test_act_quant_is_row_wise_so_batching_changes_nothing(scheme):
    x = torch.randn(5, 64, generator=G) * torch.logspace(-2, 2, 5)[:, None]
    y = reference.act_quant(x, scheme)
    assert y.shape == x.shape and y.dtype == x.dtype
    for i in range(5):
        assert torch.equal(reference.act_quant(x[i:i + 1], scheme), y[i:i + 1])
    assert 0 < ((y - x).norm() / x.norm()).item() < 0.07
    assert torch.equal(reference.act_quant(y, scheme), y) or scheme == "mxfp8"   # idempotent grids


def test_act_quant_int8_token_values():
    x = torch.tensor([[1.0, -0.5, 0.26, 0.0], [0.0, 0.0, 0.0, 0.0]])
    y = reference.act_quant(x, "int8-token")
    s = 1 / 127
    torch.testing.assert_close(y[0], torch.tensor([127, -64, 33, 0]) * s)   # -63.5 -> -64
    assert y[1].eq(0).all()
    with pytest.raises(ValueError, match="unknown scheme"):
        reference.act_quant(x, "int4")


def test_mxfp4_negative_zero_keeps_its_sign_bit_as_upstream():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 6.0, -0.1                       # -0.1 rounds to -0 on the e2m1 grid
    q, s = quant_mx(w, 4)
    assert q[0, 0].item() == 0x87                        # low nibble 7 (6.0), high nibble 8 (-0)
    assert dequant_mx(q, s)[0, 1].item() == 0.0


def test_loader_accepts_an_upstream_bf16_int4_bias_and_refuses_a_foreign_one():
    from engine.checkpoint.formats import dequant_linear
    w = torch.randn(16, 64, generator=G) * 0.05
    q, s = quant_int4(w)
    sb = s.to(torch.bfloat16)                            # upstream: bf16 scale and bf16 arithmetic
    bias = (sb.repeat_interleave(64, 1) * q.to(torch.bfloat16) * 8).sum(1).float()
    st = {"x.weight": pack_int4_rows(q), "x.scale": scale_to_u64(s), "x.bias": bias}
    torch.testing.assert_close(dequant_linear("x", "int4", st.get), dequant_int(q, s))
    st["x.bias"] = bias.flip(0)
    with pytest.raises(QuantFormatError, match="assistance bias"):
        dequant_linear("x", "int4", st.get)
