"""dsv4-plan's memory plan (engine.memory_plan) on the real DeepSeek-V4 configs shipped in
configs/models/, checked by value: the tensor counts and sizes of reference §2, the per-request
state of reference §4, the tiny checkpoint's shard files, and what the engine's pools allocate."""
from __future__ import annotations

import math

import pytest

from engine.checkpoint.layout import checkpoint_layout
from engine.config import ModelArgs

FLASH, PRO = "configs/models/deepseek-v4-flash", "configs/models/deepseek-v4-pro"
GIB, MIB = 1 << 30, 1 << 20


@pytest.mark.parametrize("path, tensors, gelems, gib", [(FLASH, 69187, 158.07, 148.66), (PRO, 145116, 861.6, 805.33)])
def test_shipped_real_configs_read_and_match_the_published_checkpoints(path, tensors, gelems, gib):
    """Reference §2: Flash 46 files, 148.66 GB, 69,187 tensors, 158.07 G stored elements; Pro
    805.33 GB, 145,116 tensors, 861.6 G. The "GB" there are GiB of files: tensor bytes plus the
    shards' JSON headers (~190 bytes a tensor, the 0.01-0.02 GiB left over)."""
    args = ModelArgs.from_json(path)
    layout = checkpoint_layout(args)
    assert len(layout) == tensors
    assert sum(math.prod(t.shape) for t in layout.values()) / 1e9 == pytest.approx(gelems, abs=0.05)
    assert sum(t.nbytes for t in layout.values()) / GIB == pytest.approx(gib, abs=0.02)
    assert args.num_nextn_predict_layers == 1 and args.quant.expert_dtype == "fp4"
    assert len(args.compress_ratios) == args.num_hidden_layers + 1


# ---- the shipped full-size run configs ---------------------------------------------------------
def _plan(yaml: str, **kw):
    from engine.run_config import RunConfig
    from engine.tools.plan import plan_run
    return plan_run(RunConfig.from_yaml(yaml), **kw)[0]


def test_flash_a3_16_rank_w8a8_leaves_20_gb_per_rank_for_state():
    plan = _plan("configs/deepseek-v4-flash-a3-w8a8-16rank.yaml")
    w, lay = plan.weights, plan.layout
    assert plan.fits and plan.quant_type == "w8a8-int" and plan.device_bytes == 64 * GIB
    assert plan.budget == int(64 * GIB * 0.85)
    # routed experts int8 [N, K] + fp32 [N, 1] row scales, 256 / EP 16 = 16 per layer; the LM head a quarter (TP 4)
    assert w["routed_experts"].resident * 16 == w["routed_experts"].checkpoint
    assert w["routed_experts"].resident == 43 * 16 * (2 * (2048 * 4096 + 4 * 2048) + 4096 * 2048 + 4 * 4096)
    assert w["lm_head"].resident == math.ceil(129280 / 4) * 4096 * 2
    assert w["embedding"].resident == 129280 * 4096 * 2                       # embed_tp 1: whole
    assert 0 < w["mtp"].resident < w["mtp"].checkpoint                          # next_n 1: MTP held, its experts split
    assert plan.resident / GIB == pytest.approx(25.82, abs=0.01)
    ws = plan.workspace
    assert ws["residual"] == 2 * 4 * 8192 * 4096 * 4                           # 1 GiB: the mHC streams, fp32
    assert ws["logits"] == 2 * 16 * 2 * 129280 * 4                             # 16 rows / rank x (1 + next_n)
    assert ws["reserve"] == GIB + 2 * 200 * MIB * 2                            # groups: world (moe), lmhead
    assert plan.left >= 20e9 and plan.left / GIB == pytest.approx(21.67, abs=0.01)
    assert [plan.requests(t) for t in (8192, 131072, 1 << 20)] == [250, 24, 3]


def test_pro_950_16_rank_fits():
    plan = _plan("configs/deepseek-v4-pro-950-16rank.yaml")
    assert plan.fits and plan.quant_type == "w4a8-mx" and plan.device_bytes == 128 * GIB
    w = plan.weights
    # MXFP4 experts: [N, K/2] uint8 + [N, K/32] e8m0, 384 / EP 16 = 24 per layer
    per_expert = 2 * (3072 * 7168 // 2 + 3072 * 7168 // 32) + (7168 * 3072 // 2 + 7168 * 3072 // 32)
    assert w["routed_experts"].resident == 61 * 24 * per_expert
    assert plan.resident / GIB == pytest.approx(76.48, abs=0.01)
    assert plan.left / GIB == pytest.approx(24.49, abs=0.01) and plan.requests(131072) == 19


@pytest.mark.parametrize("yaml", ["configs/deepseek-v4-flash-a3-prefill.yaml", "configs/deepseek-v4-flash-a3-decode.yaml"])
def test_flash_a3_pd_pair_fits(yaml):
    plan = _plan(yaml)
    assert plan.fits and plan.weights["mtp"].resident == 0                   # next_n 0: no MTP weights
    assert plan.left / GIB == pytest.approx(19.07, abs=0.01)                   # mem_fraction_static 0.80


def test_flash_a3_on_4_dies_is_refused_with_the_numbers_and_8_fit():
    """4 dies (2 chips) hold 64.6 GiB of routed int8 experts alone, over a 64 GiB die; 8 dies (4
    chips: the published A3 minimum) fit."""
    import dataclasses

    from engine.memory_plan import MemoryPlanError, plan_memory, require_fit
    from engine.memory_sizes import Layout
    from engine.run_config import RunConfig
    from engine.tools.plan import plan_args
    cfg = RunConfig.from_yaml("configs/deepseek-v4-flash-a3-w8a8-16rank.yaml")
    args, _ = plan_args(cfg)
    lay = Layout.of(cfg)
    four = plan_memory(args, dataclasses.replace(lay, world_size=4), 64 * GIB, "an A3 die")
    assert not four.fits and four.weights["routed_experts"].resident / GIB == pytest.approx(64.58, abs=0.01)
    with pytest.raises(MemoryPlanError) as e:
        require_fit(four)
    msg = str(e.value)
    assert "weights 75.38 GiB + workspace 6.91 GiB exceed the 54.40 GiB budget (64 GiB x mem_fraction_static 0.85) " \
           "by 27.90 GiB" in msg
    assert "below the published minimum of DeepSeek-V4-Flash on A3, 4 chips = 8 ranks" in msg
    assert "Change: more ranks: parallel_config.world_size 8 (4 chips) leaves 5.1 GiB per rank for state" in msg
    assert e.value.plan is four
    eight = plan_memory(args, dataclasses.replace(lay, world_size=8), 64 * GIB)
    assert require_fit(eight) is eight and eight.left / GIB == pytest.approx(5.14, abs=0.01)


def test_a_converted_type_is_suggested_when_it_would_fit():
    """Flash w8a8-int on 8 A3 dies at mem_fraction_static 0.75 is 1.26 GiB short; the plan names
    16 ranks, w4a8-int, the mem fraction and the prefill chunk that would each fit."""
    import dataclasses

    from engine.memory_plan import plan_memory, with_quant_type
    from engine.memory_sizes import Layout
    args = with_quant_type(ModelArgs.from_json(FLASH), "w8a8-int")
    lay = Layout(world_size=8, lmhead_tp_size=4, next_n=1, batch_per_rank=16, mem_fraction=0.75, platform="A3")
    plan = plan_memory(args, lay, 64 * GIB)
    assert not plan.fits
    tips = " | ".join(plan.suggestions)
    assert "world_size 16 (8 chips)" in tips and "a converted type: w4a8-int" in tips
    assert "mem_fraction_static: >= 0.78" in tips and "max_prefill_tokens 4096" in tips
    assert plan_memory(args, dataclasses.replace(lay, mem_fraction=0.78), 64 * GIB).fits


# ---- decode state per request ------------------------------------------------------------------
# reference/dsv4-architecture.md §4, bf16 KV / bf16 indexer keys, MiB: window, CSA, HCA, indexer,
# compressor state, total (the totals include 0.13 MiB of MTP window, which next_n 0 does not hold)
REF_STATE = {(FLASH, 8192): (5.38, 42.0, 1.25, 10.5, 11.64, 70.9), (FLASH, 131072): (5.38, 672, 20.0, 168, 11.64, 877),
             (PRO, 8192): (7.63, 60.0, 1.94, 15.0, 17.84, 102.5), (PRO, 131072): (7.63, 960, 31.0, 240, 17.84, 1257)}


@pytest.mark.parametrize("path, tokens", list(REF_STATE))
def test_state_per_request_matches_reference_section_4(path, tokens):
    from engine.memory_sizes import Layout, state_per_request
    s = {k: v / MIB for k, v in state_per_request(ModelArgs.from_json(path), Layout(), tokens).items()}
    win, csa, hca, idx, comp, total = REF_STATE[(path, tokens)]
    assert (s["window"], s["csa_kv"], s["indexer"], s["compressor_state"]) == \
        pytest.approx((win, csa, idx, comp), abs=0.01)
    # HCA entries go in whole 128-entry blocks: 8K tokens = 64 entries take one block
    blocks = math.ceil(tokens // 128 / 128)
    assert s["hca_kv"] == pytest.approx(hca * blocks * 128 / (tokens // 128), abs=0.01)
    assert s["mtp_window"] == 0
    assert sum(s.values()) == pytest.approx(total - 0.13 + s["hca_kv"] - hca, abs=0.5)
