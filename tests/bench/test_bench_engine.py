"""``dsv4-bench engine`` and its cost model (bench.roofline): values checked against the real model
and against hand sums; the CLI end to end on tiny sweeps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import roofline as R
from bench.engine_bench import attribute, main as bench_main, synthetic_paged
from engine.checkpoint.loader import load_model
from engine.config import ModelArgs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, progress=False, mtp=True)


def small_args() -> ModelArgs:
    """A hand-sized config: 3 layers (window-only, CSA, HCA), layer 0 hash-routed, no MTP."""
    a = ModelArgs(vocab_size=10, hidden_size=8, num_hidden_layers=3, rms_norm_eps=1e-6, max_position_embeddings=4096,
                  eos_token_id=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, qk_rope_head_dim=4,
                  q_lora_rank=4, o_groups=2, o_lora_rank=3, sliding_window=4, compress_ratios=(0, 4, 128),
                  index_n_heads=2, index_head_dim=4, index_topk=2, rope_theta=1e4, compress_rope_theta=1.6e5,
                  rope_scaling=None, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                  moe_intermediate_size=3, routed_scaling_factor=1.5, swiglu_limit=10.0, num_hash_layers=1,
                  hc_mult=2)
    a.validate()
    return a


# ---- weights against the loaded model -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_equal_loaded_parameters(ckpt, model, dtype):
    """Every parameter of the loaded model (all experts, MTP block included) has the shape and
    element size the inventory says: the checkpoint's storage in every compute dtype, so the
    analytic all-weights figure equals sum(numel * element_size) exactly. The hash layers' tid2eid
    tables are buffers, not parameters."""
    m = model if dtype == torch.float32 else load_model(ckpt, dtype=dtype, progress=False, mtp=True)
    real = {n: (tuple(p.shape), p.element_size()) for n, p in m.named_parameters()}
    inv = R.weight_inventory(m.args, dtype)
    assert set(real) == set(inv)
    assert {n: v for n, v in real.items() if inv[n] != v} == {}
    loaded = sum(p.numel() * p.element_size() for p in m.parameters())
    assert R.weight_bytes(m.args, dtype) == loaded
    mtp = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n.startswith("mtp."))
    assert mtp > 0 and R.weight_bytes(m.args, dtype, mtp=False) == loaded - mtp
    a = m.args
    buffers = sum(b.numel() * b.element_size() for b in m.buffers())
    assert buffers == a.num_hash_layers * a.vocab_size * a.num_experts_per_tok * 8
    # as stored: bf16 head / router / compressors, FP8 + e8m0 scales, MXFP4 experts (1 byte per 2 weights)
    assert real["head.weight"][1] == real["layers.3.ffn.gate.weight"][1] == real["layers.2.attn.compressor.wkv.weight"][1] == 2
    assert real["layers.2.attn.wq_b.weight"][1] == real["layers.2.attn.wq_b.scale"][1] == 1
    assert real["layers.2.ffn.experts.w1"][0] == (a.n_routed_experts, a.moe_intermediate_size, a.hidden_size // 2)


# ---- decode cost, term by term -------------------------------------------------------------------
def test_decode_cost_batch1_equals_hand_sum():
    """small_args, batch 1, context 20, fp32 compute. H=8 V=10 n=2 h=2 d=8 q=4 G=2 o=3 W=4 hI=2
    dI=4 kI=2 E=4 k=2 I=3 S=1; layers: 0 window-only (hash), 1 CSA, 2 HCA. No quantization_config:
    weights as stored are bf16 (linears, embedding, norms; 2 bytes) and fp32 (mHC, sinks, ape,
    router bias; 4 bytes); the state is in the compute dtype (4 bytes)."""
    a = small_args()
    c = R.decode_cost(a, batch=1, context=20, dtype=torch.float32)
    H, V, n, h, d, q, G, o, E, k, I = 8, 10, 2, 2, 8, 4, 2, 3, 4, 2, 3
    mix = (2 + n) * n                                   # 8 mHC mix outputs
    f, w2, w4 = 4, 2, 4                                 # state bytes per value; bf16 / fp32 weights
    # weights: params read once (embedding: one row; routed experts: the k of E one token picks)
    embed = w2 * H
    lm_head = w2 * (V * H + H)                          # head + final norm
    mhc = w4 * (3 * 2 * (mix * n * H + mix + 3) + (n * n * H + n + 1))        # per layer 2 sites, + hc_head
    attn = 3 * (w2 * (q * H + q + h * d * q + d * H + d + G * o * (h * d // G) + H * G * o) + w4 * h)
    norms = w2 * 3 * 2 * H
    # compressors: wkv + wgate + norm (bf16), one ape row (fp32, the token's window slot); CSA width 2d, HCA d
    comp = w2 * (2 * 2 * d * H + d) + w4 * 2 * d + w2 * (2 * d * H + d) + w4 * d
    idx = w2 * (2 * 4 * q + 2 * H + 2 * 2 * 4 * H + 4) + w4 * 2 * 4            # wq_b, weights_proj, CSA comp at dI=4
    router = w2 * 3 * E * H + w4 * 2 * E                # gate weights, biases of the 2 non-hash layers
    experts = w2 * 3 * k * 3 * I * H                    # 3 layers x k experts x (w1, w3, w2)
    shared = w2 * 3 * 3 * I * H
    weights = embed + lm_head + mhc + attn + norms + comp + idx + router + experts + shared
    tid2eid = 1 * k * 8                                 # one hash layer: k int64 ids
    # state (context 20, the new token at position 20)
    window = 3 * (3 + 1) * d * f                        # min(20, W-1) = 3 rows read + 1 written, 3 layers
    csa = 2 * d * f                                     # min(kI, 21 // 4 = 5) = 2 selected entries
    hca = 0                                             # 21 // 128 = 0 entries
    idx_keys = 5 * 4 * f                                # all 5 indexer keys of dI = 4
    comp_state = (2 * 2 * 16 * f + d * f / 4) + (2 * 2 * 8 * f + 4 * f / 4) + (2 * 2 * 8 * f + d * f / 128)
    assert c["bytes"] == pytest.approx(weights + tid2eid + window + csa + hca + idx_keys + comp_state, rel=1e-12)
    assert c["parts"]["lm_head"]["bytes"] == lm_head
    assert c["parts"]["routed_experts"]["bytes"] == experts
    # FLOPs: 2 per weight of every per-token matmul, k of E experts, attention 4 h d per key
    linears = (V * H                                                   # head
               + 3 * 2 * mix * n * H + n * n * H                        # mHC mixes
               + 3 * (q * H + h * d * q + d * H + G * o * (h * d // G) + H * G * o)
               + 2 * 2 * d * H + 2 * d * H                              # compressors wkv + wgate
               + 2 * 4 * q + 2 * H + 2 * 2 * 4 * H                      # indexer
               + 3 * E * H + 3 * k * 3 * I * H + 3 * 3 * I * H)         # router, experts, shared
    mhc_mixing = 3 * 2 * (n * H + n * n * H + n * H) + n * H
    attention = 3 * 4 * h * d * 4 + 4 * h * d * 2                      # window 4 keys x 3 layers, CSA 2 keys
    indexer = 5 * (2 * 2 * 4 + 2 * 2)                                   # 5 keys x (2 hI dI + 2 hI)
    assert c["flops"] == 2 * linears + 2 * mhc_mixing + attention + indexer
    assert c["flops_fp32"] == 0                                         # fp32 model: one peak
    assert c["experts_touched"] == pytest.approx(k)
    # bf16 compute: the weights are the same bytes (as stored); the fp32 math (head, router,
    # compressors, weights_proj, mHC) is counted apart
    b = R.decode_cost(a, 1, 20, torch.bfloat16)
    for part in ("lm_head", "compressor", "routed_experts", "attention"):
        assert b["parts"][part]["bytes"] == c["parts"][part]["bytes"]
    assert b["flops_fp32"] == 2 * (V * H + 3 * 2 * mix * n * H + n * n * H + 2 * 2 * d * H + 2 * d * H
                                   + 2 * H + 2 * 2 * 4 * H + 3 * E * H) + 2 * mhc_mixing


def test_expected_distinct_experts():
    assert R.expected_distinct_experts(256, 6, 1) == pytest.approx(6)
    assert R.expected_distinct_experts(256, 6, 2) == pytest.approx(6 + 6 * (1 - 6 / 256))
    assert R.expected_distinct_experts(256, 6, 100_000) == pytest.approx(256)
    vals = [R.expected_distinct_experts(16, 6, b) for b in (1, 2, 4, 8, 64)]
    assert vals == sorted(vals) and vals[-1] < 16
    a = small_args()
    grow = R.decode_cost(a, 64, 20)["parts"]["routed_experts"]["bytes"]
    assert grow == pytest.approx(R.decode_cost(a, 1, 20)["parts"]["routed_experts"]["bytes"] * 4 / 2, rel=1e-9)


def test_prefill_indexer_quadratic_and_limit(model):
    a = model.args
    p1, p2 = R.prefill_cost(a, 16384), R.prefill_cost(a, 32768)
    ratio = p2["parts"]["state_indexer"]["flops"] / p1["parts"]["state_indexer"]["flops"]
    assert ratio == pytest.approx(4, rel=1e-3)                             # O(T^2)
    assert p2["parts"]["attention"]["flops"] == pytest.approx(2 * p1["parts"]["attention"]["flops"])   # linear
    assert p1["keys"]["indexer"] == sum((j + 1) // 4 for j in range(16384))
    assert p1["keys"]["csa"] == sum(min(a.index_topk, (j + 1) // 4) for j in range(16384))
    assert p1["keys"]["hca"] == sum((j + 1) // 128 for j in range(16384))
    assert p1["chunks"] == 2 and p2["chunks"] == 4
    # weights once per 8192-token chunk; the LM head once (last row only)
    assert p2["parts"]["attention"]["bytes"] == 2 * p1["parts"]["attention"]["bytes"]
    assert p2["parts"]["lm_head"]["bytes"] == p1["parts"]["lm_head"]["bytes"] == 2 * (a.vocab_size + 1) * a.hidden_size
    assert p1["parts"]["lm_head"]["flops"] == 2 * a.vocab_size * a.hidden_size
    # the limit: the larger of the two terms binds
    hw = {"read_gbs": 10.0, "gemm_gflops": {"float32": 100.0, "bfloat16": 200.0}}
    d = R.decode_cost(a, 1, 1024)
    lim = R.limit(d, hw)
    assert lim["memory_s"] == pytest.approx(d["bytes"] / 10e9)
    assert lim["compute_s"] == pytest.approx(d["flops"] / 100e9)
    assert lim["bound"] == "memory" and lim["limit_s"] == lim["memory_s"]
    lim = R.limit(p2, hw)
    assert lim["bound"] == "compute" and lim["limit_s"] == pytest.approx(p2["flops"] / 100e9)


# ---- synthetic state ---------------------------------------------------------------------------
def _shapes(state):
    """Entry counts / shapes / dtypes and the compressor states' shapes and finiteness of a
    ``SequenceState`` or ``PagedSequenceState`` (the interface both share)."""
    out = {"num_tokens": state.num_tokens}
    for i, ls in enumerate(state.layers):
        for key in ("cmp_kv", "idx_kv"):
            buf = getattr(ls, key)
            out[i, key] = None if buf is None else (buf.num_entries, tuple(buf.view().shape), buf.view().dtype)
        for key in ("comp", "idx_comp"):
            cs = getattr(ls, key)
            out[i, key] = None if cs is None else tuple(
                None if t is None else (tuple(t.shape), t.dtype, bool(torch.isfinite(t).all()))
                for t in (cs.kv, cs.score, cs.prev_kv, cs.prev_score))
    return out


@pytest.mark.parametrize("context", [2, 600])
def test_synthetic_paged_state_matches_real_prefill(model, context):
    """Same entry counts, shapes, dtypes and finite / -inf overlap state as a real prefill of
    that many tokens over the pools; a decode step on it runs and appends like a real one."""
    from bench.engine_measure import eager_decode
    from engine.core.block_manager import CacheConfig
    from engine.core.kv_cache import LocalCache

    ids = torch.randint(2, model.args.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    real = LocalCache(model.args, CacheConfig(128, 1, {"c4": 4, "c128": 1}), model.dtype)
    real.allocate(0, context + 8)
    model.forward_batch(ids, [real.sequence_state(0, 0)], [context])
    syn = synthetic_paged(model, context, torch.Generator().manual_seed(1), headroom=8)
    assert _shapes(syn.sequence_state(0, context)) == _shapes(real.sequence_state(0, context))
    if context == 600:
        st = syn.sequence_state(0, context)
        assert st.layers[2].cmp_kv.num_entries == 150 and st.layers[3].cmp_kv.num_entries == 4
        assert st.layers[2].cmp_kv.view().float().std() == pytest.approx(1.0, abs=0.1)   # unit scale
    for c in (real, syn):                          # the engine's eager decode step (what the bench times)
        h = eager_decode(model, c, context + 8)([5], context)
        assert h.shape == (1, model.args.hidden_size) and torch.isfinite(model.logits(h)).all()
    assert _shapes(syn.sequence_state(0, context + 1)) == _shapes(real.sequence_state(0, context + 1))


def test_attribute_folds_nested_labels():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with torch.profiler.record_function("decode_step"):
                with torch.profiler.record_function("linear"):
                    torch.ones(64, 64) @ torch.ones(64, 64)
                with torch.profiler.record_function("lm_head"):
                    with torch.profiler.record_function("linear"):
                        torch.ones(8)
                torch.zeros(16).sum()                                      # outside the table
        with torch.profiler.record_function("linear"):                     # outside a step: ignored
            torch.ones(8)
    at = attribute(prof.events(), {"linear", "lm_head"})
    per = at["per"]
    assert at["steps"] == 2 and set(per) == {"linear", "lm_head"}
    assert per["linear"][1] == 2 and per["lm_head"][1] == 2               # the head's linear is the head's
    assert at["untabled_us"] > 0
    assert per["linear"][0] + per["lm_head"][0] + at["untabled_us"] <= at["total_us"]


def test_gemm_probe_stops_doubling_at_its_budget(monkeypatch):
    """Each dtype's GEMM doubles from 256 while the next size's three calls fit the budget: a
    dtype without a fast CPU kernel is measured small instead of for minutes; never past gemm_n."""
    times = {torch.float32: 1e-4, torch.bfloat16: 0.5}      # seconds per 256^3 call, x8 per doubling

    def fake_best(dtype):
        n = {"n": 256}

        def best(fn, reps, budget):
            t = times[dtype] * (n["n"] // 256) ** 3
            n["n"] *= 2
            return t
        return best
    for dtype, n_max, want in ((torch.float32, 1024, 1024), (torch.float32, 8192, 2048), (torch.bfloat16, 2048, 256)):
        monkeypatch.setattr(R, "_best_time", fake_best(dtype))
        gflops, n = R._gemm_gflops(dtype, n_max, 0.8)
        assert n == want and gflops == pytest.approx(2 * n ** 3 / (times[dtype] * (n // 256) ** 3) / R.GB)


def test_bad_flags_name_the_flag(capsys):
    for argv, flag in ((["--batch-sizes", "1,0"], "--batch-sizes"), (["--contexts", "x"], "--contexts"),
                       (["--decode-steps", "-1"], "--decode-steps"), (["--prefill-chunk", "0"], "--prefill-chunk"),
                       (["--threads", "0"], "--threads")):
        with pytest.raises(SystemExit) as e:
            bench_main(argv)
        assert e.value.code == 2
        assert f"argument {flag}" in capsys.readouterr().err


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_quick_writes_every_section(ckpt, tmp_path):
    out = tmp_path / "eb.json"
    png = tmp_path / "eb.png"
    r = subprocess.run([sys.executable, "-m", "bench.cli", "engine", "--quick", "--no-hf", "--threads", "1", "--ckpt", ckpt,
                        "--out", str(out), "--plot", str(png)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    hw = res["hardware"]
    assert hw["read_gbs"] > 0 and hw["copy_gbs"] > 0 and hw["gemm_gflops"]["float32"] > 0 and hw["threads"] == 1
    assert res["model"]["weight_bytes_no_mtp"] == res["model"]["param_bytes_loaded"]          # next_n 0: no MTP
    assert [row["batch"] for row in res["decode_batch"]] == [1, 2]
    assert [row["context"] for row in res["decode_context"]] == [256, 512]
    assert [row["length"] for row in res["prefill"]] == [128, 256]
    for row in res["decode_batch"] + res["decode_context"]:
        assert row["step_ms"] > 0 and row["limit_ms"] > 0 and row["bound"] in ("memory", "compute")
        assert row["ratio"] == pytest.approx(row["step_ms"] / row["limit_ms"], rel=0.02)
        assert row["limit_ms"] == pytest.approx(max(row["memory_ms"], row["compute_ms"]), abs=2e-3)
    assert res["decode_batch"][0]["decode_steps"] >= 2
    for row in res["prefill"]:
        assert row["seconds"] > 0 and row["limit_s"] > 0
    assert res["prefill"][0]["linearity"] == 1.0
    assert [bd["batch"] for bd in res["breakdown"]] == [1, 2]
    for bd in res["breakdown"]:
        ops = bd["ops"]
        assert {"lm_head", "linear", "moe_experts", "hc_pre", "rms_norm", "rope"} <= set(ops)
        assert all(o["ms"] > 0 for o in ops.values())
        assert sum(o["ms"] for o in ops.values()) <= bd["profiled_step_ms"] + 1e-6
        assert bd["other_ms"] == pytest.approx(bd["profiled_step_ms"] - sum(o["ms"] for o in ops.values()), abs=2e-3)
        assert bd["other_torch_ms"] >= 0 and bd["other_python_ms"] >= 0
        assert bd["other_torch_ms"] + bd["other_python_ms"] == pytest.approx(bd["other_ms"], abs=2e-3)
        assert ops["lm_head"]["calls_per_step"] == 1 and ops["moe_experts"]["calls_per_step"] == 6
        assert bd["full_decode_steps_profiled"] == bd["steps"] and bd["step_ms"] > 0
    assert "hf" not in res
    assert "decode step vs batch" in r.stdout and "per-op time" in r.stdout and "prefill vs length" in r.stdout
    assert png.stat().st_size > 0
