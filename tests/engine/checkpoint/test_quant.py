"""Dequantisation from hand-made bytes to exact values (reference/dsv4-architecture.md §2.1)."""
import math

import pytest
import torch

from engine.checkpoint.fp8_mxfp4 import (QuantFormatError, dequant_fp8_block, dequant_mxfp4, e4m3_to_float, e8m0_to_float,
                          quant_fp8_block, quant_mxfp4, unpack_fp4)


def u8(*vals):
    return torch.tensor(vals, dtype=torch.uint8)


def test_e4m3_bytes_decode_exactly():
    # sign | 4-bit exponent (bias 7) | 3-bit mantissa; exponent 0 = subnormal m/8 * 2^-6
    cases = {0x00: 0.0, 0x80: -0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0,
             0x39: 1.125, 0x3F: 1.875, 0x40: 2.0, 0x7E: 448.0, 0xFE: -448.0, 0xB8: -1.0, 0x81: -(2.0 ** -9)}
    got = e4m3_to_float(u8(*cases)).tolist()
    assert got == list(cases.values())
    assert math.copysign(1, e4m3_to_float(u8(0x80)).item()) == -1      # -0 keeps its sign
    assert math.isnan(e4m3_to_float(u8(0x7F)).item()) and math.isnan(e4m3_to_float(u8(0xFF)).item())


def test_e8m0_bytes_decode_exactly():
    got = e8m0_to_float(u8(0, 1, 126, 127, 128, 134, 254)).tolist()
    assert got == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 128.0, 2.0 ** 127]
    assert math.isnan(e8m0_to_float(u8(255)).item())


def test_fp4_nibble_order_low_is_even_column():
    # byte 0x21: low nibble 1 (0.5) -> column 0, high nibble 2 (1.0) -> column 1
    # byte 0xF8: low nibble 8 (-0.0) -> column 2, high nibble 15 (-6.0) -> column 3
    # byte 0x7C: low nibble 12 (-2.0), high nibble 7 (6.0)
    packed = u8(0x21, 0xF8, 0x7C).view(torch.int8).view(1, 3)
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, -0.0, -6.0, -2.0, 6.0]]


def test_mxfp4_scale_applies_per_32_inputs_of_a_row():
    packed = torch.full((2, 32), 0x21, dtype=torch.uint8).view(torch.int8)       # 64 inputs: 0.5, 1.0, ...
    scale = u8(127, 130, 125, 0).view(2, 2)                                       # 1, 8, 1/4, 2^-127
    w = dequant_mxfp4(packed, scale)
    row0 = torch.tensor([0.5, 1.0] * 16 + [4.0, 8.0] * 16)
    row1 = torch.tensor([0.125, 0.25] * 16 + [0.5 * 2.0 ** -127, 2.0 ** -127] * 16)
    assert torch.equal(w, torch.stack([row0, row1]))
    with pytest.raises(QuantFormatError, match="MXFP4 scale shape"):
        dequant_mxfp4(packed, u8(127, 127))


def test_fp8_block_dequant_with_ceil_shaped_grid():
    # [200, 300] with 128x128 blocks: grid [2, 3], last row/col blocks partial
    n, k = 200, 300
    q = torch.full((n, k), 0x38, dtype=torch.uint8)                                # 1.0 everywhere
    q[5, 7] = 0x01                                                                  # smallest subnormal
    q[199, 299] = 0xFE                                                              # -448
    e = u8(127, 128, 129, 120, 121, 140).view(2, 3)
    w = dequant_fp8_block(q.view(torch.float8_e4m3fn), e.view(torch.float8_e8m0fnu), (128, 128))
    expect = torch.ones(n, k)
    for bi in range(2):
        for bj in range(3):
            expect[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128] *= 2.0 ** (e[bi, bj].item() - 127)
    expect[5, 7] = 2.0 ** -9
    expect[199, 299] = -448.0 * 2.0 ** 13
    assert torch.equal(w, expect)
    with pytest.raises(QuantFormatError, match="scale grid"):
        dequant_fp8_block(q.view(torch.float8_e4m3fn), u8(127, 127).view(1, 2).view(torch.float8_e8m0fnu),
                          (128, 128))


def test_fp8_block_size_comes_from_config_not_from_the_grid():
    # a [64, 64] block config on a [128, 64] weight gives a [2, 1] grid; each half has its own scale
    q = torch.full((128, 64), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = dequant_fp8_block(q, u8(127, 131).view(2, 1).view(torch.float8_e8m0fnu), (64, 64))
    assert torch.equal(w[:64], torch.ones(64, 64)) and torch.equal(w[64:], torch.full((64, 64), 16.0))


def test_encoders_round_trip_exactly_representable_values():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g)
    q, s = quant_fp8_block(w, (128, 128))
    deq = dequant_fp8_block(q, s, (128, 128))
    assert torch.equal(dequant_fp8_block(*quant_fp8_block(deq, (128, 128)), (128, 128)), deq)
    assert (deq - w).abs().max() <= w.abs().max() * 2 ** -4                       # e4m3: 3 mantissa bits
    p, s4 = quant_mxfp4(w)
    deq4 = dequant_mxfp4(p, s4)
    assert torch.equal(dequant_mxfp4(*quant_mxfp4(deq4)), deq4)


def test_the_fp4_lut_is_copied_to_a_device_once():
    """The static decode step dequantises MXFP4 experts inside a CUDA graph capture, which refuses
    host-to-device copies: the LUT is copied once per device and reused (meta stands in here)."""
    from engine.checkpoint import fp8_mxfp4
    meta = torch.device("meta")
    assert fp8_mxfp4.byte_lut(meta) is fp8_mxfp4.byte_lut(meta)
    out = fp8_mxfp4.unpack_fp4(torch.empty(3, 16, dtype=torch.int8, device=meta))
    assert out.shape == (3, 32) and out.device == meta


def test_mxfp4_to_bf16_directly_equals_fp32_then_rounded():
    """bf16 dequantisation multiplies in bf16 (a third of the traffic); exact, so bit-equal to the
    fp32 result rounded, for every byte (two e2m1 codes) under every e8m0 scale code (2^-127 ..
    2^127 and NaN): row r holds all 256 bytes under scale code r."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    packed = codes.view(torch.int8).repeat(256, 1)                              # [256, 256]
    scale = codes.unsqueeze(1).repeat(1, 16).view(torch.float8_e8m0fnu)        # [256, 512 / 32]
    direct = dequant_mxfp4(packed, scale, torch.bfloat16)
    rounded = dequant_mxfp4(packed, scale, torch.float32).to(torch.bfloat16)
    assert direct.dtype == torch.bfloat16
    assert torch.equal(direct.view(torch.int16), rounded.view(torch.int16))
