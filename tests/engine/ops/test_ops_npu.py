"""engine.ops.npu on a machine without torch_npu: import hygiene, the kernel_config contract, the
op table, the log-once helpers, and every wrapper's guard routing out-of-contract input (fp32, or
tensors not on an NPU) to the reference op before torch_npu is touched. No kernel is faked: the
kernel paths themselves need Ascend hardware and are not run here."""
from __future__ import annotations

import importlib.util
import inspect
import logging
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import engine.ops.npu as npu
import engine.ops.npu.runtime as npu_runtime
import engine.ops.reference as R
from engine.ops import IMPLS, OP_NAMES, REFERENCE, Ops, ops_for, validate_kernel_config
from engine.ops.cache_codec import CacheCodec, CacheRows
from engine.ops.packed import Packed

ROOT = Path(__file__).resolve().parents[3]
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
KEY = "model_config.custom_params.kernel_config"


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """An empty log-once set and INFO capture on engine.ops.npu."""
    monkeypatch.setattr(npu_runtime, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger="engine.ops.npu")
    return caplog


def test_imports_do_not_pull_torch_npu():
    code = ("import sys\n"
            "import engine.ops\n"
            "assert 'engine.ops.npu' not in sys.modules, 'engine.ops imported engine.ops.npu'\n"
            "import engine.ops.npu\n"
            "assert 'torch_npu' not in sys.modules, 'torch_npu imported'\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# ---- ops_for / kernel_config -------------------------------------------------------------------
def test_ops_for_cpu_is_reference_and_cuda_adds_only_the_fp8_gemm():
    cfg = {"compressor": "native", "rms_norm": "npu", "moe_experts": "native"}
    assert ops_for("cpu") is REFERENCE and ops_for("cpu", {}) is REFERENCE and ops_for("cpu", cfg) is REFERENCE
    import engine.ops.cuda as cuda
    for table in (ops_for("cuda"), ops_for("cuda", cfg)):
        assert table.quant_linear is cuda.quant_linear
        assert all(getattr(table, n) is getattr(REFERENCE, n) for n in OP_NAMES if n != "quant_linear")


def test_kernel_config_unknown_op_names_key_and_lists_ops():
    with pytest.raises(ValueError) as e:
        ops_for("cpu", {"gate_topk": "native"})
    msg = str(e.value)
    assert f"{KEY}.gate_topk" in msg
    assert all(name in msg for name in OP_NAMES)


@pytest.mark.parametrize("impl", ["cuda", "NPU", "", None, 1])
def test_kernel_config_bad_impl_names_key(impl):
    with pytest.raises(ValueError, match=rf"{KEY}\.hc_pre"):
        validate_kernel_config({"hc_pre": impl})
    with pytest.raises(ValueError, match=rf"{KEY}\.hc_pre"):
        ops_for("cuda", {"hc_pre": impl})


def test_kernel_config_accepts_native_and_npu_and_rejects_non_mappings():
    assert IMPLS == ("native", "npu", "ascendc")
    assert validate_kernel_config(None) == {}
    cfg = {name: "native" for name in OP_NAMES}
    assert validate_kernel_config(cfg) == cfg
    assert validate_kernel_config({"sparse_attn": "npu"}) == {"sparse_attn": "npu"}
    with pytest.raises(ValueError, match=KEY):
        validate_kernel_config(["compressor"])


def test_ops_for_unknown_kind():
    with pytest.raises(ValueError, match="tpu"):
        ops_for("tpu")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_ops_without_torch_npu_is_a_clear_import_error():
    with pytest.raises(npu.NpuUnavailableError) as e:
        npu.npu_ops(REFERENCE)
    assert isinstance(e.value, ImportError)
    assert "torch_npu is required for --device npu" in str(e.value)
    with pytest.raises(ImportError, match="torch_npu is required for --device npu"):
        ops_for("npu", {"compressor": "native"})
    assert "torch_npu" not in sys.modules


def test_npu_ops_checks_kernel_config_before_importing_torch_npu():
    with pytest.raises(ValueError, match=rf"{KEY}\.bogus"):
        npu.npu_ops(REFERENCE, {"bogus": "npu"})
    with pytest.raises(ValueError, match=rf"{KEY}\.rope"):
        ops_for("npu", {"rope": "fast"})


# ---- the table ---------------------------------------------------------------------------------
def test_every_seam_op_is_mapped_or_documented_not_mapped():
    names = {f.name for f in fields(Ops)}
    assert set(npu.KERNELS) | set(npu.NOT_MAPPED) == names
    assert not set(npu.KERNELS) & set(npu.NOT_MAPPED)
    assert set(npu.KERNEL_APIS) == set(npu.KERNELS)
    assert all(reason.strip() for reason in npu.NOT_MAPPED.values())
    assert all(apis and all(a.startswith(("torch_npu.", "custom.")) for a in apis)
               for apis in npu.KERNEL_APIS.values())


@pytest.mark.parametrize("name", sorted(npu.KERNELS))
def test_wrapper_signature_and_docstring(name):
    fn = npu.KERNELS[name]
    ref = getattr(R, name)
    got = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
    want = [(p.name, p.kind, p.default) for p in inspect.signature(ref).parameters.values()]
    assert got == want
    doc = fn.__doc__ or ""
    for api in npu.KERNEL_APIS[name]:
        assert api.split(".", 1)[1] in doc, f"{name} docstring does not name {api}"
    assert "Falls back to the reference" in doc


# ---- log once ----------------------------------------------------------------------------------
def test_log_fallback_once_per_op_and_reason(fresh_log):
    assert npu.log_fallback("rope", "reason A")
    assert not npu.log_fallback("rope", "reason A")
    assert npu.log_fallback("rope", "reason B")
    assert npu.log_fallback("hc_pre", "reason A")
    msgs = [r.getMessage() for r in fresh_log.records if r.name == "engine.ops.npu"]
    assert len(msgs) == 3
    assert sum("reason A" in m for m in msgs) == 2 and sum("op rope" in m for m in msgs) == 2


def test_log_reference_op_once_per_name(fresh_log):
    assert npu.log_reference_op("compressor", "why")
    assert not npu.log_reference_op("compressor", "another why")
    msgs = [r.getMessage() for r in fresh_log.records if r.name == "engine.ops.npu"]
    assert msgs == ["op compressor: no NPU kernel (why); using the reference op"]


# ---- guards: out-of-contract input goes to the reference ---------------------------------------
def _cases(dt: torch.dtype) -> dict[str, tuple]:
    """Valid reference inputs per mapped op; activations in ``dt`` (fp32 contract tensors stay fp32)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, generator=g).to(dtype)

    f32 = torch.float32
    T = 6
    ang = rnd(T, 4, dtype=f32)
    logits = rnd(T, 16, dtype=f32) * 3
    gw, gid = R.gating_topk(rnd(T, 4, dtype=f32), rnd(4, dtype=f32), None, 2, 1.5)     # 4 experts, k = 2
    pos = torch.arange(100, 130)
    kv_rows = CacheRows.zeros(CacheCodec("fp8", 512, dt, rope_dim=64), 8, "cpu")
    keys = CacheRows.zeros(CacheCodec("int8", 128, dt, indexer=True), 33, "cpu")
    keys.write(torch.arange(32), rnd(32, 128))
    dpos = torch.tensor([40, 70, 2])
    win, cmp = CacheRows.zeros(CacheCodec("none", 8, dt), 49, "cpu"), CacheRows.zeros(CacheCodec("none", 8, dt), 33, "cpu")
    win.write(torch.arange(48), rnd(48, 8))
    cmp.write(torch.arange(32), rnd(32, 8))
    return {
        "rms_norm": (rnd(T, 3, 16), None, 1e-6),
        "rope": (rnd(T, 3, 16), ang.cos(), ang.sin()),
        "grouped_linear": (rnd(T, 2, 32), rnd(2 * 16, 32)),
        "hc_pre": (rnd(7, 4, 16), rnd(24, 64, dtype=f32) * 0.1, rnd(3, dtype=f32), rnd(24, dtype=f32),
                   1e-6, 1e-6, 20),
        "hc_post": (rnd(7, 16), rnd(7, 4, 16), rnd(7, 4, dtype=f32).sigmoid(), rnd(7, 4, 4, dtype=f32).softmax(-1)),
        "sparse_attn": (rnd(30, 2, 8), pos, rnd(33, 8), 97, 4, rnd(32, 8), 4,
                        torch.randint(0, 32, (30, 5), generator=g), rnd(2, dtype=f32), 0.5),
        "gating_topk": (logits, rnd(16, dtype=f32), None, 3, 1.5),
        "swiglu_clamp": (rnd(T, 8) * 4, rnd(T, 8) * 4, 2.0),
        "moe_experts": (rnd(T, 16), gid, gw, rnd(4, 8, 16), rnd(4, 8, 16), rnd(4, 16, 8), 10.0),
        "quant_linear": (rnd(T, 32), Packed(torch.randint(-127, 128, (8, 32), generator=g, dtype=torch.int8),
                                            rnd(8, 1, dtype=f32).abs() * 0.01, "int8"), "int8-token"),
        "cache_write": (kv_rows, torch.tensor([5, 1]), rnd(2, 512)),
        "cache_indexer_topk": (rnd(30, 64, 128), rnd(30, 64, dtype=f32), keys, torch.tensor([1, 0]), 16, pos, 4, 8,
                               0.1),
        # three decode rows at positions 40, 70, 2 (no closed window yet), blocks of 16
        "decode_indexer_topk": (rnd(3, 64, 128), rnd(3, 64, dtype=f32), keys, torch.tensor([[1, 0], [0, 1], [1, 0]]),
                                16, dpos, dpos.tolist(), 4, 8, 0.1),
        "decode_sparse_attn": (rnd(3, 2, 8), dpos, dpos.tolist(), win, torch.tensor([[0], [1], [2]]), 16, 4, cmp,
                               torch.tensor([[1, 0], [0, 1], [1, 0]]), 4, torch.randint(-1, 8, (3, 5), generator=g),
                               rnd(2, dtype=f32), 0.5, 16),
    }


def _same(a, b) -> bool:
    if a is None:                     # in-place ops (cache_write) return None
        return b is None
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(npu.KERNELS))
def test_fp32_input_runs_the_reference_before_torch_npu(name, fresh_log):
    args = _cases(torch.float32)[name]
    out = npu.KERNELS[name](*args)
    assert _same(out, getattr(R, name)(*args))
    assert "torch_npu" not in sys.modules
    msgs = [r.getMessage() for r in fresh_log.records if r.name == "engine.ops.npu"]
    assert len(msgs) == 1 and f"op {name}:" in msgs[0]
    # fp32 activations fall back on their dtype; the router's logits are fp32 by contract, so
    # gating_topk falls back here only because the tensors are on the CPU
    expect = "not on an NPU device" if name == "gating_topk" else "dtype float32"
    assert expect in msgs[0]
    npu.KERNELS[name](*args)                                          # same reason: not logged again
    assert len([r for r in fresh_log.records if r.name == "engine.ops.npu"]) == 1


@pytest.mark.parametrize("name", sorted(npu.KERNELS))
def test_bf16_cpu_input_runs_the_reference_before_torch_npu(name, fresh_log):
    args = _cases(torch.bfloat16)[name]
    out = npu.KERNELS[name](*args)
    assert _same(out, getattr(R, name)(*args))
    assert "torch_npu" not in sys.modules
    msgs = [r.getMessage() for r in fresh_log.records if r.name == "engine.ops.npu"]
    assert len(msgs) == 1 and "not on an NPU device" in msgs[0], msgs


def test_hash_routing_and_empty_compressed_cache_fall_back_too(fresh_log):
    logits = torch.randn(4, 8)
    hash_ids = torch.tensor([[3, 1], [0, 2], [7, 7], [5, 4]])
    w, ids = npu.gating_topk(logits, None, hash_ids, 2, 1.0)
    rw, rids = R.gating_topk(logits, None, hash_ids, 2, 1.0)
    assert torch.equal(w, rw) and torch.equal(ids, rids) and ids.tolist() == hash_ids.tolist()
    q, pos = torch.randn(3, 2, 8, dtype=torch.bfloat16), torch.arange(3)
    win = torch.randn(3, 8, dtype=torch.bfloat16)
    args = (q, pos, win, 0, 4, win.new_zeros(0, 8), 4, None, torch.randn(2), 0.3)
    assert torch.equal(npu.sparse_attn(*args), R.sparse_attn(*args))
    assert "torch_npu" not in sys.modules
