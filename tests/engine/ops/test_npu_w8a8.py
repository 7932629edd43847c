"""The W8A8 routed-expert path of ``engine.ops.npu.moe.moe_experts`` against a contract stub: the
pure-torch twins of the four torch_npu kernels in ``bench.npu_stub``, recording each call's dtypes
and shapes. The wrapper must hand the kernels the stored int8 experts as they are (no dequantised
copy), with the documented layouts, and its result must equal the reference op within int8
rounding."""
from __future__ import annotations

import pytest
import torch

import engine.ops.npu.moe as npu_moe
import engine.ops.npu.runtime as npu_runtime
from bench import npu_stub
from engine.checkpoint.int8_int4 import quant_int8
from engine.ops import reference
from engine.ops.packed import Packed


NPU = npu_stub.kernels("torch_npu")


class TwinNpu:
    """torch_npu's routing / GMM / dynamic-quant / finalize: ``bench.npu_stub``'s contract stubs
    (pure torch, each checking its documented contract), recording every call."""

    def __init__(self):
        self.calls = []

    def npu_moe_init_routing_v2(self, x, expert_idx, **kw):
        self.calls.append(("init_routing", x.dtype, tuple(x.shape)))
        return NPU.npu_moe_init_routing_v2(x, expert_idx, **kw)

    def npu_dynamic_quant(self, a, **kw):
        self.calls.append(("dynamic_quant", a.dtype, tuple(a.shape)))
        return NPU.npu_dynamic_quant(a, **kw)

    def npu_grouped_matmul(self, x, weight, **kw):
        scale, pts = kw.get("scale"), kw.get("per_token_scale")
        self.calls.append(("gmm", x[0].dtype, weight[0].dtype, tuple(weight[0].shape),
                           None if scale is None else scale[0].dtype, None if pts is None else pts[0].dtype,
                           kw.get("output_dtype")))
        return NPU.npu_grouped_matmul(x, weight, **kw)

    def npu_moe_finalize_routing(self, y, *args, **kw):
        self.calls.append(("finalize", y.dtype, kw.get("drop_pad_mode")))
        return NPU.npu_moe_finalize_routing(y, *args, **kw)


@pytest.fixture
def twin(monkeypatch):
    t = TwinNpu()
    monkeypatch.setattr(npu_runtime, "NPU_DEVICE_TYPES", ("npu", "cpu"))  # CPU tensors count as on an NPU
    monkeypatch.setattr(npu_moe, "torch_npu_module", lambda: t)
    monkeypatch.setattr(npu_moe, "api_available", lambda api, mod: False)  # the reference SwiGLU in between
    return t


def _experts(E, N, K, g):
    qs = [quant_int8(torch.randn(N, K, generator=g) * 0.1) for _ in range(E)]
    return Packed(torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs]), "int8")


def test_w8a8_experts_run_as_stored_with_the_documented_layouts(twin):
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 8, 64, 32, 12, 3
    w1, w3, w2 = _experts(E, I, H, g), _experts(E, I, H, g), _experts(E, H, I, g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    y = npu_moe.moe_experts(x, ids, wts, w1, w3, w2, 10.0, "int8-token")
    gmms = [c for c in twin.calls if c[0] == "gmm"]
    assert len(gmms) == 3 and [c[0] for c in twin.calls].count("dynamic_quant") == 3
    for c, n, kk in zip(gmms, (I, I, H), (H, H, I)):
        # int8 rows x int8 [E, K, N] (the stored [E, N, K] transposed: no copy), bf16 channel scale,
        # fp32 per-token scale, bf16 out
        assert c[1:] == (torch.int8, torch.int8, (E, kk, n), torch.bfloat16, torch.float32, torch.bfloat16)
    want = reference.moe_experts(x.float(), ids, wts, w1, w3, w2, 10.0, "int8-token")
    torch.testing.assert_close(y.float(), want, rtol=0.05, atol=0.02)


def test_other_packed_experts_fall_back_to_the_reference(twin):
    g = torch.Generator().manual_seed(1)
    w = _experts(4, 32, 64, g)
    w4 = Packed(w.data, w.scale, "mxfp4")
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1]] * 5)
    wts = torch.ones(5, 2)
    why = npu_moe._w8a8_why(w4, "mxfp8")
    assert why == "mxfp4 experts with mxfp8 activations (only W8A8 int8 is mapped)"
    assert npu_moe._w8a8_why(w, "int8-token") is None
    out = npu_moe.moe_experts(x, ids, wts, w, w, Packed(_experts(4, 64, 32, g).data, _experts(4, 64, 32, g).scale,
                                                        "int8"), 10.0, None)
    assert twin.calls == [] and out.shape == (5, 64)                     # act None: the reference ran
