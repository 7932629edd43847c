"""The inductor-generated CPU kernels of graph mode (``engine.ops.cpu``): the LM head's values against
the reference op and fp64, a row's bits whatever the number of rows (batch invariance), the cases
that keep the reference, and which table each run config gets."""
import logging

import pytest
import torch

import engine.ops.cpu as cpu
from engine.ops import REFERENCE, ops_for, reference

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


def test_graph_mode_on_cpu_gets_the_kernel_and_native_pins_the_reference():
    assert ops_for("cpu") is REFERENCE
    assert isinstance(ops_for("cpu", compiled=True).lm_head, cpu.CompiledHead)
    pinned = ops_for("cpu", {"lm_head": "native"}, compiled=True)
    assert pinned.lm_head is reference.lm_head
    with pytest.raises(ValueError, match="kernel_config"):
        ops_for("cpu", {"lm_head": "fast"}, compiled=True)
