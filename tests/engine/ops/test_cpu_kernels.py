"""The inductor-generated CPU kernels of graph mode (``engine.ops.cpu``): the LM head's values against
the reference op and fp64, a row's bits whatever the number of rows (batch invariance), the cases
that keep the reference, and which table each run config gets; the compiled step's fused FP8
linear, its e4m3 decode and the e8m0 scales held as bytes, the fused routed experts and their
e2m1 decode."""
import logging

import pytest
import torch

import engine.ops.cpu as cpu
from engine.checkpoint.fp8_mxfp4 import e4m3_to_float, quant_fp8_block, quant_mxfp4, unpack_fp4
from engine.core.static_decode import moe_experts_gathered
from engine.ops import REFERENCE, ops_for, reference
from engine.ops.packed import Packed, dequant

V, H = 4099, 256          # an odd vocab: no size is a multiple of the vector width


def _head(dtype=torch.bfloat16, seed=0):
    return (torch.randn(V, H, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def _x(M, seed=1):
    return torch.randn(M, H, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lm_head_equals_the_reference_within_fp32_reordering(dtype):
    """Same fp32 products as the reference (the bf16 head widened exactly), summed in another
    order: within a few fp32 ulps of the logits' scale, and as close to fp64 as the reference."""
    w, x = _head(dtype), _x(5)
    got, ref = cpu.CompiledHead()(x, w), reference.lm_head(x, w)
    exact = (x.double() @ w.double().t())
    assert got.shape == (5, V) and got.dtype == torch.float32 and got.is_contiguous()
    scale = (x.double().abs() @ w.double().abs().t()).max().item()
    assert (got - ref).abs().max().item() <= 4e-7 * scale
    assert (got.double() - exact).abs().max().item() <= 2 * (ref.double() - exact).abs().max().item() + 1e-6
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_a_rows_bits_do_not_depend_on_the_row_count():
    """Batch invariance: each row of M = 2, 3, 8, 13 equals that row computed alone, bit for bit."""
    w, x = _head(), _x(13)
    head = cpu.CompiledHead()
    alone = torch.cat([head(x[i:i + 1], w) for i in range(13)])
    for M in (2, 3, 8, 13):
        assert torch.equal(head(x[:M], w), alone[:M]), M


def test_serving_calls_run_the_kernels_the_probe_compiled():
    """After ``warm`` (what build_engine does before serving) no call compiles again: not under
    no_grad (``Transformer.logits``), not for a view, not for another row count."""
    w, x = _head(), _x(9)
    head = cpu.CompiledHead()
    assert head.warm(w)
    with torch.compiler.set_stance("fail_on_recompile"):
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                for rows in (x[:1], x[1:3], x, x[:5].clone()):
                    assert torch.equal(head(rows, w), torch.cat([head(r[None], w) for r in rows]))


def test_outside_the_kernel_the_reference_runs_bit_for_bit():
    w, head = _head(), cpu.CompiledHead()
    xb = _x(3).bfloat16()
    assert head.why_not(xb, w) is not None
    assert torch.equal(head(xb, w), reference.lm_head(xb, w))
    empty = torch.empty(0, H)
    assert head.why_not(empty, w) == "no rows" and head(empty, w).shape == (0, V)
    assert head.why_not(_x(1), w.to(torch.float16)) is not None


def test_a_failed_compile_or_probe_keeps_the_reference(monkeypatch, caplog):
    """No C++ compiler (inductor raises) or a kernel whose rows depend on M: the reference, logged."""
    w, x = _head(), _x(4)

    def fails(x, w):
        raise RuntimeError("InductorError: no C++ compiler found\nmore")
    monkeypatch.setattr(cpu, "_compiled_head", fails)
    with caplog.at_level(logging.WARNING, logger="engine.ops.cpu"):
        assert torch.equal(cpu.CompiledHead()(x, w), reference.lm_head(x, w))
    assert "compile failed: InductorError: no C++ compiler found" in caplog.text

    def depends_on_m(x, w):
        return (w.float() @ x.t()) + x.shape[0]
    monkeypatch.setattr(cpu, "_compiled_head", depends_on_m)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.ops.cpu"):
        assert torch.equal(cpu.CompiledHead()(x, w), reference.lm_head(x, w))
    assert "depend on the row count" in caplog.text

    def empty_message(x, w):
        raise MemoryError()
    monkeypatch.setattr(cpu, "_compiled_head", empty_message)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.ops.cpu"):
        assert torch.equal(cpu.CompiledHead()(x, w), reference.lm_head(x, w))
    assert "compile failed: MemoryError" in caplog.text


def test_graph_mode_on_cpu_gets_the_kernel_and_native_pins_the_reference():
    assert ops_for("cpu") is REFERENCE
    assert isinstance(ops_for("cpu", compiled=True).lm_head, cpu.CompiledHead)
    assert ops_for("cpu", compiled=True).moe_experts is cpu.moe_experts
    pinned = ops_for("cpu", {"lm_head": "native", "moe_experts": "native"}, compiled=True)
    assert pinned.lm_head is reference.lm_head and pinned.moe_experts is reference.moe_experts
    with pytest.raises(ValueError, match="kernel_config"):
        ops_for("cpu", {"lm_head": "fast"}, compiled=True)


def test_e4m3_fields_decode_bit_for_bit_compiled_and_with_flush_to_zero():
    """Inside a compiled graph an e4m3 byte is decoded from its fields: the 254 non-NaN codes
    (subnormals, -0, +-448) equal torch's own conversion bit for bit, also with denormals flushed;
    0x7F / 0xFF are NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = codes.to(torch.float32)
    decode = torch.compile(e4m3_to_float, fullgraph=True)
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        try:
            got = decode(codes)
        finally:
            torch.set_flush_denormal(False)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32)), flush


def _fp8(N, K, seed=2):
    q, s = quant_fp8_block(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05, (128, 128))
    return Packed(q, s, "fp8")


@pytest.mark.parametrize("M", [1, 2])
def test_fused_fp8_linear_in_a_compiled_step_equals_the_reference(M):
    """The compiled step's FP8 linear (one reduction, bytes decoded in registers) against the
    reference op: the same fp32 products in another order, with e8m0 scales as float8 or bytes."""
    w, x = _fp8(384, 256), _x(M)[:, :256]
    ref = reference.quant_linear(x, w, None)
    step = torch.compile(cpu.quant_linear, fullgraph=True, dynamic=False)
    as_bytes = Packed(w.data, w.scale.view(torch.uint8), "fp8")
    for packed in (w, as_bytes):
        got = step(x, packed, None)
        assert got.shape == (M, 384) and got.dtype == torch.float32
        assert (got - ref).abs().max().item() <= 1e-6 * (x.abs() @ dequant(w, torch.float32).abs().t()).max().item()


def test_fused_fp8_linear_keeps_the_reference_outside_its_case():
    w, x = _fp8(384, 256), _x(2)[:, :256]
    assert cpu.fused_why(x, w, None).startswith("eager")          # not compiling
    assert torch.equal(cpu.quant_linear(x, w, None), reference.quant_linear(x, w, None))
    reasons = torch.compile(lambda x, w: [cpu.fused_why(x, w, None), cpu.fused_why(x, w, "int8"),
                                          cpu.fused_why(_x(5)[:, :256], w, None)], fullgraph=False)
    fused, act, rows = reasons(x, w)
    assert fused is None and "int8" in act and rows == f"more than {cpu.FUSED_ROWS} rows"


def test_e8m0_scales_held_as_bytes_keep_their_values():
    w = _fp8(256, 256)
    lin = torch.nn.Module()
    lin.weight = torch.nn.Parameter(w.data, requires_grad=False)
    lin.scale = torch.nn.Parameter(w.scale, requires_grad=False)
    before = dequant(w, torch.float32)
    assert cpu.e8m0_as_bytes(lin) == 1 and lin.scale.dtype == torch.uint8
    assert torch.equal(dequant(Packed(lin.weight, lin.scale, "fp8"), torch.float32), before)
    assert cpu.e8m0_as_bytes(lin) == 0


def test_e2m1_fields_decode_bit_for_bit_compiled():
    """Inside a compiled graph an MXFP4 byte is decoded from its fields: both nibbles of all 256
    bytes equal the lookup table's values bit for bit (-0 included)."""
    packed = torch.arange(256, dtype=torch.uint8).view(torch.int8)[None]
    want = unpack_fp4(packed)
    got = torch.compile(unpack_fp4, fullgraph=True)(packed)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _experts(E, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    qs = [quant_mxfp4(torch.randn(N, K, generator=g) * 0.05) for _ in range(E)]
    return Packed(torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs]), "fp4")


@pytest.mark.parametrize("B", [1, 5])
def test_fused_experts_in_a_compiled_step_equal_the_gathered_reference(B):
    """The compiled step's routed experts (each gathered MXFP4 expert's bytes decoded in registers,
    every slot of every row in one reduction) against the graph step's reference: the same fp32
    products in another order, with e8m0 scales as float8 or as bytes."""
    E, I, k = 8, 64, 3
    w1, w3, w2 = _experts(E, I, H, 3), _experts(E, I, H, 4), _experts(E, H, I, 5)
    g = torch.Generator().manual_seed(6)
    x, ids, wt = _x(B), torch.randint(0, E, (B, k), generator=g), torch.rand(B, k, generator=g)
    ref = moe_experts_gathered(x, ids, wt, w1, w3, w2, 10.0)
    step = torch.compile(cpu.moe_experts, fullgraph=True, dynamic=False)
    as_bytes = [Packed(w.data, w.scale.view(torch.uint8), "fp4") for w in (w1, w3, w2)]
    for ws in ((w1, w3, w2), as_bytes):
        got = step(x, ids, wt, *ws, 10.0)
        assert got.shape == (B, H) and got.dtype == torch.float32
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    # ids computed inside the graph, as a hash layer's tid2eid[tokens] (cpu.expert_ids)
    table, tokens = torch.cat([ids, ids.flip(0)]), torch.arange(B)
    hashed = torch.compile(lambda x, t: cpu.moe_experts(x, table[t], wt, w1, w3, w2, 10.0), fullgraph=True)
    assert (hashed(x, tokens) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_when_pairs_outnumber_experts_the_step_groups_by_expert_with_the_eager_bits():
    """B * k >= E: the compiled step runs the eager grouping (``dsv4::moe_grouped``: each distinct
    expert dequantised once), bit for bit the eager op, ids given or computed in the graph; below
    it the fused gathered form runs (within fp32 reordering of the eager op)."""
    E, I, k = 16, 64, 4
    w1, w3, w2 = _experts(E, I, H, 3), _experts(E, I, H, 4), _experts(E, H, I, 5)
    as_bytes = [Packed(w.data, w.scale.view(torch.uint8), "fp4") for w in (w1, w3, w2)]
    g = torch.Generator().manual_seed(7)
    step = torch.compile(cpu.moe_experts, fullgraph=True, dynamic=False)
    for B in (4, 9):                                 # 16 and 36 pairs: grouped
        x, ids, wt = _x(B), torch.rand(B, E, generator=g).argsort(-1)[:, :k], torch.rand(B, k, generator=g)
        want = reference.moe_experts(x, ids, wt, w1, w3, w2, 10.0)
        assert torch.equal(step(x, ids, wt, *as_bytes, 10.0), want)
        table, tokens = torch.cat([ids, ids.flip(0)]), torch.arange(B)
        hashed = torch.compile(lambda x, t: cpu.moe_experts(x, table[t], wt, *as_bytes, 10.0), fullgraph=True)
        assert torch.equal(hashed(x, tokens), want)
    x, ids, wt = _x(3), torch.rand(3, E, generator=g).argsort(-1)[:, :k], torch.rand(3, k, generator=g)
    fused, want = step(x, ids, wt, *as_bytes, 10.0), reference.moe_experts(x, ids, wt, w1, w3, w2, 10.0)
    assert not torch.equal(fused, want) and (fused - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_fused_experts_keep_the_reference_outside_their_case():
    E, I = 4, 64
    w1, w3, w2 = _experts(E, I, H, 3), _experts(E, I, H, 4), _experts(E, H, I, 5)
    x, ids, wt = _x(2), torch.tensor([[0, 3], [2, 0]]), torch.rand(2, 2)
    assert cpu.moe_why(x, ids, w1, w3, w2, None).startswith("eager")      # prefill: not compiling
    assert torch.equal(cpu.moe_experts(x, ids, wt, w1, w3, w2, 10.0),
                       reference.moe_experts(x, ids, wt, w1, w3, w2, 10.0))
    dense = [dequant(w, torch.float32) for w in (w1, w3, w2)]
    reasons = torch.compile(lambda x: [cpu.moe_why(x, ids, w1, w3, w2, None), cpu.moe_why(x, ids, w1, w3, w2, "int8"),
                                       cpu.moe_why(x, ids, *dense, None)], fullgraph=False)
    fused, act, stored = reasons(x)
    assert fused is None and "int8" in act and "MXFP4" in stored
    assert cpu.moe_experts.why is cpu.moe_why
