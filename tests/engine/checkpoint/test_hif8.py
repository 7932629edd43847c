"""HiFloat8 codec: code table, ties-away rounding, saturation, per-row quant (engine/checkpoint/hif8.py docstring)."""
import math

import pytest
import torch

from engine.checkpoint.hif8 import HIF8_MAX, hif8_decode, hif8_encode, hif8_quant_per_channel, hif8_round

ALL = torch.arange(256, dtype=torch.uint8)


def enc(*vals, saturate=True):
    return hif8_encode(torch.tensor(vals, dtype=torch.float64), saturate=saturate).tolist()


def test_decode_table():
    v = hif8_decode(ALL)
    assert v.dtype == torch.float32 and v.shape == (256,)
    finite = v[torch.isfinite(v)]
    assert len(set(finite.tolist())) == 253          # 126 positive, 126 negative, one zero
    assert finite.max().item() == HIF8_MAX == 2.0 ** 15
    assert finite.min().item() == -HIF8_MAX
    assert torch.isnan(v[0x80]) and torch.isnan(v).sum() == 1
    assert v[0x6F].item() == math.inf and v[0xEF].item() == -math.inf and torch.isinf(v).sum() == 2
    pos = torch.tensor([c for c in range(1, 0x80) if c != 0x6F])
    assert torch.equal(v[pos + 0x80], -v[pos])       # the sign bit mirrors every non-zero finite code
    # S | dot | exponent (sign-magnitude, implicit leading 1) | mantissa
    known = {0x00: 0.0, 0x08: 1.0, 0x0F: 1.875, 0x10: 2.0, 0x18: 0.5, 0x20: 4.0, 0x28: 8.0, 0x30: 0.25,
             0x40: 16.0, 0x60: 256.0, 0x6E: 32768.0, 0x7E: 2.0 ** -15, 0x7F: 1.5 * 2.0 ** -15,
             0x01: 2.0 ** -22, 0x07: 2.0 ** -16, 0x88: -1.0, 0xEE: -32768.0}
    assert [v[c].item() for c in known] == list(known.values())


def test_every_code_round_trips():
    assert torch.equal(hif8_encode(hif8_decode(ALL), saturate=False), ALL)
    assert torch.equal(hif8_encode(hif8_decode(ALL)), ALL)


def test_ties_go_away_from_zero():
    # midpoints: 1.0|1.125, 16|20 (RNE would pick 16), 15|16, 1.875|2, 0|2^-22, 2^-16|2^-15, 24576|32768
    assert enc(1.0625, -1.0625, 18.0, 15.5, 1.9375) == [0x09, 0x89, 0x41, 0x40, 0x10]
    assert hif8_round(torch.tensor([1.0625, 18.0, 17.0, 2.0 ** -23, 1.5 * 2.0 ** -16, 28672.0])).tolist() == [
        1.125, 20.0, 16.0, 2.0 ** -22, 2.0 ** -15, 32768.0]
    assert enc(2.0 ** -23, -(2.0 ** -23)) == [0x01, 0x81]
    below = math.nextafter(2.0 ** -23, 0.0)
    assert enc(below, -below, -0.0) == [0x00, 0x00, 0x00]   # no -0 code: 0x80 is NaN


def test_matches_brute_force_nearest():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-24, 16, (4096,), generator=g).double())
    table = hif8_decode(ALL).double()
    pos = table[torch.isfinite(table) & (table >= 0)].sort(descending=True).values   # larger first: ties go up
    nearest = pos[(x.abs()[:, None] - pos[None, :]).abs().argmin(dim=1)] * x.sign()
    assert torch.equal(hif8_round(x).double(), nearest)


def test_overflow_saturates_or_goes_inf():
    # 40960 is the midpoint of 32768 and the Inf slot (1.5 * 2^15)
    assert enc(40959.0, 40960.0, 1e6, -1e6) == [0x6E, 0x6E, 0x6E, 0xEE]
    assert enc(40959.0, 40960.0, 1e6, -1e6, saturate=False) == [0x6E, 0x6F, 0x6F, 0xEF]
    assert enc(math.inf, -math.inf, math.nan) == [0x6F, 0xEF, 0x80]
    assert hif8_round(torch.tensor([1e30, -1e30])).tolist() == [HIF8_MAX, -HIF8_MAX]


def test_encode_keeps_shape_and_accepts_half_types():
    x = torch.tensor([[1.0625, -3.0], [0.0, 100.0]], dtype=torch.bfloat16)
    c = hif8_encode(x)
    assert c.dtype == torch.uint8 and c.shape == (2, 2)
    assert hif8_decode(c).tolist() == [[1.125, -3.0], [0.0, 96.0]]


def test_bad_dtypes_raise():
    with pytest.raises(ValueError, match="floating-point"):
        hif8_encode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="uint8"):
        hif8_decode(torch.tensor([1, 2], dtype=torch.int8))
    with pytest.raises(ValueError, match="2-D"):
        hif8_quant_per_channel(torch.ones(4))
    with pytest.raises(ValueError, match="Inf or NaN"):
        hif8_quant_per_channel(torch.tensor([[1.0, math.inf]]))
    with pytest.raises(ValueError, match="dst_type_max"):
        hif8_quant_per_channel(torch.ones(2, 2), dst_type_max=65536.0)


def _rel_bound(scaled: torch.Tensor) -> torch.Tensor:
    """Half an ulp over the value: 2^-(m+1) with m = 3, 3, 2, 1 mantissa bits for |E| <= 3, 7, 15."""
    e = torch.floor(torch.log2(scaled)).abs()
    m = torch.where(e <= 3, 3, torch.where(e <= 7, 2, 1))
    return torch.exp2(-(m + 1.0))


def test_per_channel_quant_error_bound():
    g = torch.Generator().manual_seed(1)
    n, k = 8, 256
    mag = torch.exp2(torch.empty(n, k).uniform_(-20, 0, generator=g)) * torch.exp2(torch.arange(n) - 4.0)[:, None]
    w = (mag * torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0)).to(torch.bfloat16)
    codes, scale = hif8_quant_per_channel(w)
    assert codes.dtype == torch.uint8 and codes.shape == (n, k)
    assert scale.dtype == torch.float32 and scale.shape == (n, 1)
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale, amax / HIF8_MAX, rtol=0, atol=0)
    deq = hif8_decode(codes) * scale
    assert torch.equal(deq.abs().amax(dim=1, keepdim=True), amax)   # the row maximum maps to 32768 exactly
    rel = (deq - wf).abs() / wf.abs()
    assert (rel <= _rel_bound(wf.abs() / scale) * (1 + 1e-6)).all()
    assert rel.max() <= 0.2                         # 1-bit mantissa worst case: 0.25 / 1.25
    # rows spanning 2^-6..1 of their maximum: dst_type_max=8 puts them in |E| <= 3 (3 mantissa bits)
    narrow = torch.exp2(torch.empty(n, k).uniform_(-6, 0, generator=g))
    for vmax, bound in ((HIF8_MAX, 0.2), (8.0, 1 / 17)):
        c, s = hif8_quant_per_channel(narrow, dst_type_max=vmax)
        assert ((hif8_decode(c) * s - narrow).abs() / narrow).max() <= bound * (1 + 1e-6)


def test_zero_row_gets_unit_scale():
    w = torch.tensor([[0.0, 0.0, -0.0], [1.0, -2.0, 0.5]])
    codes, scale = hif8_quant_per_channel(w)
    assert scale[0, 0].item() == 1.0 and scale[1, 0].item() == 2.0 / HIF8_MAX
    assert codes[0].tolist() == [0, 0, 0]
    deq = hif8_decode(codes) * scale
    assert not torch.isnan(deq).any()
    assert deq.tolist() == [[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]]
