"""Weights as stored: tile / expert dequantisation equals the whole-weight one, and the reference ops
on packed weights equal the dense path (bit-equal where one tile covers the weight)."""
import pytest
import torch

import engine.ops.packed as packed_mod
from engine.checkpoint.formats import dequant_linear
from engine.checkpoint.fp8_mxfp4 import quant_fp8_block, quant_mxfp4
from engine.checkpoint.hif8 import hif8_quant_per_channel
from engine.checkpoint.int8_int4 import int4_bias, pack_int4_rows, quant_int4, quant_int8, scale_to_u64
from engine.checkpoint.mx import quant_mx
from engine.ops import reference
from engine.ops.packed import Packed, dequant, stored_cut, tiles

FMTS = ["fp8", "fp4", "mxfp4", "mxfp8", "int8", "int4", "hif8"]


def stored(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w [N, K]`` quantised as the checkpoint stores format ``fmt`` (names as in a shard)."""
    if fmt == "fp8":
        q, s = quant_fp8_block(w, (128, 128))
    elif fmt == "fp4":
        q, s = quant_mxfp4(w)
    elif fmt in ("mxfp4", "mxfp8"):
        q, s = quant_mx(w, 4 if fmt == "mxfp4" else 8)
    elif fmt == "int8":
        q, s = quant_int8(w)
    elif fmt == "int4":
        q4, s4 = quant_int4(w)
        return {"x.weight": pack_int4_rows(q4), "x.scale": scale_to_u64(s4), "x.bias": int4_bias(q4, s4)}
    else:
        q, s = hif8_quant_per_channel(w)
    return {"x.weight": q, "x.scale": s}


def as_packed(sd: dict, fmt: str) -> Packed:
    return Packed(sd["x.weight"], sd["x.scale"], fmt, sd.get("x.bias"))


@pytest.mark.parametrize("fmt", FMTS)
def test_tiles_equal_the_whole_weight(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 256, generator=g) * 0.05
    sd = stored(fmt, w)
    p = as_packed(sd, fmt)
    whole = dequant_linear("x", fmt, sd.get)
    assert p.shape == (384, 256) and torch.equal(dequant(p, torch.float32), whole)
    for r0, r1 in ((0, 128), (128, 384), (256, 384)):
        assert torch.equal(dequant(p, torch.float32, (r0, r1)), whole[r0:r1])
    assert torch.equal(dequant(p, torch.bfloat16), whole.to(torch.bfloat16))
    stacked = Packed(*(t.unsqueeze(0).expand(3, *t.shape).contiguous() if t is not None else None
                       for t in (p.data, p.scale)), fmt,
                     None if p.bias is None else p.bias.unsqueeze(0).expand(3, -1).contiguous())
    assert stacked.shape == (3, 384, 256)
    assert torch.equal(dequant(stacked.expert(2), torch.float32), whole)
    assert torch.equal(dequant(stacked.take(torch.tensor([0, 2])), torch.float32), whole.expand(2, -1, -1))


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "mxfp4"])
def test_quant_linear_in_tiles_is_batch_invariant_and_matches_dense(fmt, monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 256, generator=g) * 0.05
    p = as_packed(stored(fmt, w), fmt)
    x = torch.randn(11, 256, generator=g)
    dense = reference.linear(x, dequant(p, torch.float32))
    one_tile = reference.quant_linear(x, p, None)
    assert torch.equal(one_tile, dense)                                   # one tile: the very same call
    monkeypatch.setattr(packed_mod, "CPU_TILE_ELEMENTS", 128 * 256)           # 4 tiles of 128 rows
    assert len(tiles(p)) == 4
    tiled = reference.quant_linear(x, p, None)
    torch.testing.assert_close(tiled, dense, rtol=1e-6, atol=1e-6)
    for i in (0, 5, 10):                                                  # a row alone == the row in the batch
        assert torch.equal(reference.quant_linear(x[i:i + 1], p, None), tiled[i:i + 1])


def test_bf16_weights_cast_in_tiles(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(300, 64, generator=g)).to(torch.bfloat16)
    x = torch.randn(9, 64, generator=g)
    want = reference.linear(x, w.float())
    monkeypatch.setattr(packed_mod, "CPU_TILE_ELEMENTS", 64 * 64)
    torch.testing.assert_close(reference.linear(x, w), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reference.lm_head(x, w), reference.lm_head(x, w.float()), rtol=1e-6, atol=1e-6)
    for i in (0, 8):
        assert torch.equal(reference.linear(x[i:i + 1], w), reference.linear(x, w)[i:i + 1])


@pytest.mark.parametrize("fmt", ["fp4", "mxfp4", "int8", "int4"])
def test_moe_experts_on_packed_equal_dense(fmt):
    g = torch.Generator().manual_seed(3)
    E, H, I, T, k = 6, 64, 96, 20, 2

    def stack(shape):
        sds = [stored(fmt, torch.randn(*shape, generator=g) * 0.1) for _ in range(E)]
        return Packed(*(torch.stack([sd[n] for sd in sds]) for n in ("x.weight", "x.scale")), fmt,
                      torch.stack([sd["x.bias"] for sd in sds]) if fmt == "int4" else None)
    w1, w3, w2 = stack((I, H)), stack((I, H)), stack((H, I))
    dense = [dequant(w, torch.float32) for w in (w1, w3, w2)]
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    for rows in (T, 3):                                                  # the loop and the batched path
        want = reference.moe_experts(x[:rows], ids[:rows], wts[:rows], *dense, 10.0)
        assert torch.equal(reference.moe_experts(x[:rows], ids[:rows], wts[:rows], w1, w3, w2, 10.0), want)


def test_grouped_linear_packed(monkeypatch):
    g = torch.Generator().manual_seed(4)
    G, N, K = 4, 128, 64
    p = as_packed(stored("fp8", torch.randn(G * N, K, generator=g) * 0.1), "fp8")
    x = torch.randn(10, G, K, generator=g)
    want = reference.grouped_linear(x, dequant(p, torch.float32))
    assert torch.equal(reference.grouped_linear(x, p), want)
    monkeypatch.setattr(packed_mod, "CPU_TILE_ELEMENTS", N * K)                # one group at a time
    torch.testing.assert_close(reference.grouped_linear(x, p), want, rtol=1e-6, atol=1e-6)


def test_stored_cuts():
    assert stored_cut("fp8", "data", 0, 256, 128, 2) == (0, 256, 128)
    assert stored_cut("fp8", "scale", 0, 256, 128, 2) == (0, 2, 1)
    assert stored_cut("fp8", "scale", 0, 64, 64, 2) == (0, 0, 1)             # inside a block: offset 64
    assert stored_cut("fp8", "scale", 0, 64, 128, 2) == (0, 0, 2)
    assert stored_cut("fp8", "scale", 1, 128, 256, 2) == (1, 1, 2)
    assert stored_cut("fp4", "data", 2, 64, 64, 3) == (2, 32, 32)
    assert stored_cut("fp4", "scale", 2, 64, 64, 3) == (2, 2, 2)
    assert stored_cut("int4", "data", 1, 4, 8, 3) == (1, 2, 4)
    assert stored_cut("int8", "scale", 1, 0, 64, 2) is None                # a per-row scale is kept whole
    assert stored_cut("fp4", "data", 0, 3, 2, 3) == (0, 3, 2)              # the expert dim
    with pytest.raises(ValueError, match="multiples of 32 input columns"):
        stored_cut("mxfp4", "data", 1, 16, 16, 2)
    with pytest.raises(ValueError, match="multiples of 2 rows"):
        stored_cut("int4", "data", 0, 3, 2, 2)


def test_fp8_shard_inside_a_block():
    """A rank's rows / columns cut inside FP8 128x128 blocks dequantise to the same values."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(320, 256, generator=g) * 0.05
    sd = stored("fp8", w)
    whole = dequant_linear("x", "fp8", sd.get)
    for (r0, n), (c0, m) in (((64, 64), (0, 256)), ((192, 96), (64, 160)), ((0, 320), (96, 32))):
        sc = sd["x.scale"][r0 // 128:-(-(r0 + n) // 128), c0 // 128:-(-(c0 + m) // 128)]
        p = Packed(sd["x.weight"][r0:r0 + n, c0:c0 + m], sc, "fp8", offset=(r0 % 128, c0 % 128))
        assert torch.equal(dequant(p, torch.float32), whole[r0:r0 + n, c0:c0 + m])
        assert torch.equal(dequant(p, torch.float32, (5, n)), whole[r0 + 5:r0 + n, c0:c0 + m])
