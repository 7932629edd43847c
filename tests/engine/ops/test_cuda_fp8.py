"""The CUDA FP8 block-scaled GEMM path (``engine.ops.cuda``) on this CPU machine: the call is checked
against torch's own meta kernel of ``scaled_mm`` (its shape / dtype / stride contract, the one the
CUDA kernel enforces), the activation quantisation's bound and layout by value, and every case
outside the kernel's contract goes to the reference op."""
import pytest
import torch

import engine.ops.cuda as cuda
from engine.checkpoint.fp8_mxfp4 import quant_fp8_block
from engine.ops import reference
from engine.ops.packed import Packed, dequant


def _weight(N, K, device="cpu"):
    q, s = quant_fp8_block(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05, (128, 128))
    return Packed(q.to(device), s.to(device), "fp8")


@pytest.mark.parametrize("M, N, K", [(1, 256, 512), (37, 1024, 4096), (8, 512, 1024)])
def test_the_call_meets_torchs_blockwise_contract(M, N, K):
    """On the meta device torch runs the kernel's own checks (layouts of both scales included)."""
    w = Packed(torch.empty(N, K, dtype=torch.float8_e4m3fn, device="meta"),
               torch.empty(N // 128, K // 128, dtype=torch.float8_e8m0fnu, device="meta"), "fp8")
    x = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
    assert cuda.fp8_why(x, w, None) is None
    y = cuda.quant_linear(x, w, None)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def test_activation_quantisation_is_per_1x128_with_power_of_two_scales():
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)) * 3
    q, s = cuda.act_quant_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 4) and s.stride() == (1, 5)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)                       # ue8m0
    back = (q.float().view(5, 4, 128) * s.unsqueeze(-1)).view(5, 512)
    assert ((back - x).abs() <= x.abs().view(5, 4, 128).amax(-1).repeat_interleave(128, 1) / 8).all()
    # the GEMM's math (a pure-torch twin of the kernel) is close to the reference op
    w = _weight(256, 512)
    twin = back @ dequant(w, torch.float32).t()
    ref = reference.quant_linear(x, w, None)
    assert (twin - ref).abs().max() / ref.abs().max() < 0.05


def test_outside_the_contract_runs_the_reference():
    w = _weight(256, 512)
    x = torch.randn(3, 512)
    assert cuda.fp8_why(x, w, None) == "tensors on cpu"
    assert torch.equal(cuda.quant_linear(x, w, None), reference.quant_linear(x, w, None))
    meta = torch.empty(3, 512, dtype=torch.bfloat16, device="meta")
    mw = Packed(torch.empty(256, 512, dtype=torch.float8_e4m3fn, device="meta"),
                torch.empty(2, 4, dtype=torch.float8_e8m0fnu, device="meta"), "fp8")
    assert "only the original FP8" in cuda.fp8_why(meta, mw._replace(fmt="int8"), "int8-token")
    assert "offset" in cuda.fp8_why(meta, mw._replace(offset=(64, 0)), None)
    assert "fp32" in cuda.fp8_why(meta.float(), mw, None) or "float32" in cuda.fp8_why(meta.float(), mw, None)
    small = Packed(torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="meta"),
                   torch.empty(2, 2, dtype=torch.float8_e8m0fnu, device="meta"), "fp8")
    assert "multiple of 4" in cuda.fp8_why(torch.empty(3, 256, dtype=torch.bfloat16, device="meta"), small, None)


def test_zero_rows_run_the_reference():
    """An idle attention-DP rank runs every linear on 0 rows: the blockwise GEMM refuses M = 0."""
    w = Packed(torch.empty(256, 512, dtype=torch.float8_e4m3fn, device="meta"),
               torch.empty(2, 4, dtype=torch.float8_e8m0fnu, device="meta"), "fp8")
    assert cuda.fp8_why(torch.empty(0, 512, dtype=torch.bfloat16, device="meta"), w, None) == "no rows"
    real = _weight(256, 512)
    assert cuda.quant_linear(torch.zeros(0, 512, dtype=torch.bfloat16), real, None).shape == (0, 256)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 263])
def test_rows_are_padded_to_a_multiple_of_4_and_sliced_back(M, monkeypatch):
    """cuBLAS's blockwise heuristic refuses M % 4 != 0 on an H200 (deploy/device-check): the call
    gets zero rows up to a multiple of 4, and the output is the same rows as unpadded, by value
    (a CPU twin of the kernel's math stands in for it)."""
    calls = []

    def twin(xq, wt, xs, ra, sb, rb, output_dtype):
        calls.append(tuple(xq.shape))
        assert xs.shape == (xq.shape[0], xq.shape[1] // 128) and xs.stride() == (1, xq.shape[0])
        a = (xq.float().view(xq.shape[0], -1, 128) * xs.unsqueeze(-1)).view(xq.shape)
        b = wt.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return (a @ b).to(output_dtype)

    monkeypatch.setattr(cuda.F, "scaled_mm", twin)
    monkeypatch.setattr(cuda, "fp8_why", lambda *a: None)
    w = _weight(256, 512)
    x = torch.randn(M, 512, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
    y = cuda.quant_linear(x, w, None)
    assert calls == [(-(-M // 4) * 4, 512)] and y.shape == (M, 256)
    one_by_one = torch.cat([cuda.quant_linear(x[i:i + 1], w, None) for i in range(M)])
    assert torch.equal(y, one_by_one)
    ref = reference.quant_linear(x.float(), w, None)
    assert (y.float() - ref).abs().max() / ref.abs().max() < 0.05
