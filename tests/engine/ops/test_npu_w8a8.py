"""The W8A8 routed-expert path of ``engine.ops.npu.moe.moe_experts`` against a contract stub: a
pure-torch twin of the four torch_npu kernels that records each call's dtypes and shapes. The
wrapper must hand the kernels the stored int8 experts as they are (no dequantised copy), with the
documented layouts, and its result must equal the reference op within int8 rounding."""
from __future__ import annotations

import pytest
import torch

import engine.ops.npu.moe as npu_moe
from engine.checkpoint.int8_int4 import quant_int8
from engine.ops import reference
from engine.ops.packed import Packed


class TwinNpu:
    """torch_npu's routing / GMM / dynamic-quant / finalize in pure torch, recording every call."""

    def __init__(self):
        self.calls = []

    def npu_moe_init_routing_v2(self, x, expert_idx, *, active_num, expert_num, **kw):
        assert expert_idx.dtype == torch.int32 and kw["row_idx_type"] == 0 and kw["expert_tokens_num_type"] == 1
        k = expert_idx.shape[1]
        order = torch.argsort(expert_idx.reshape(-1).long(), stable=True)
        self.calls.append(("init_routing", x.dtype, tuple(x.shape)))
        return x[order // k], order, torch.bincount(expert_idx.reshape(-1).long(), minlength=expert_num), None

    def npu_dynamic_quant(self, a):
        s = a.float().abs().amax(-1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        self.calls.append(("dynamic_quant", a.dtype, tuple(a.shape)))
        return torch.round(a.float() / s).clamp(-127, 127).to(torch.int8), s.squeeze(-1)

    def npu_grouped_matmul(self, x, weight, *, group_list, split_item, group_type, group_list_type, scale=None,
                           per_token_scale=None, output_dtype=None):
        (a,), (w,) = x, weight
        assert split_item == 3 and group_type == 0 and group_list_type == 1
        self.calls.append(("gmm", a.dtype, w.dtype, tuple(w.shape), None if scale is None else scale[0].dtype,
                           None if per_token_scale is None else per_token_scale[0].dtype, output_dtype))
        out, start = [], 0
        for e, c in enumerate(group_list.tolist()):
            y = a[start:start + c].float() @ w[e].float()
            if scale is not None:
                y = y * scale[0][e].float() * per_token_scale[0][start:start + c, None]
            out.append(y)
            start += c
        return [torch.cat(out).to(output_dtype or a.dtype)]

    def npu_moe_finalize_routing(self, y, s1, s2, bias, scales, row_idx, ex, *, drop_pad_mode):
        k = scales.shape[1]
        out = torch.zeros(scales.shape[0], y.shape[1], dtype=torch.float32)
        out.index_add_(0, row_idx // k, y.float() * scales.reshape(-1)[row_idx, None].float())
        self.calls.append(("finalize", y.dtype, drop_pad_mode))
        return out.to(y.dtype)


@pytest.fixture
def twin(monkeypatch):
    t = TwinNpu()
    monkeypatch.setattr(npu_moe, "device_why", lambda x: None)            # pretend the tensors are on an NPU
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
