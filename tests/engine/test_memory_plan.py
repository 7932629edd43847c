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
    w = plan.weights
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
    # auto: the w8a8-int checkpoint's cache schemes, A3's default (bf16 KV, int8 indexer keys)
    assert plan.layout.cache_dtype == ("none", "int8") and plan.cache_rows == (1024, 130)
    assert [plan.requests(t) for t in (8192, 131072, 1 << 20)] == [265, 27, 3]


def test_pro_950_16_rank_fits():
    plan = _plan("configs/deepseek-v4-pro-950-16rank.yaml")
    assert plan.fits and plan.quant_type == "w4a8-mx" and plan.device_bytes == 128 * GIB
    w = plan.weights
    # MXFP4 experts: [N, K/2] uint8 + [N, K/32] e8m0, 384 / EP 16 = 24 per layer
    per_expert = 2 * (3072 * 7168 // 2 + 3072 * 7168 // 32) + (7168 * 3072 // 2 + 7168 * 3072 // 32)
    assert w["routed_experts"].resident == 61 * 24 * per_expert
    assert plan.resident / GIB == pytest.approx(76.48, abs=0.01)
    assert plan.layout.cache_dtype == ("fp8", "fp8") and plan.cache_rows == (640, 132)      # w4a8-mx: 950 C8
    assert plan.left / GIB == pytest.approx(24.49, abs=0.01) and plan.requests(131072) == 31


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
# reference/dsv4-architecture.md §4's totals table, MiB: window, CSA, HCA, indexer, compressor
# state, MTP window, total (next_n 0 holds no MTP window: the plan's total is the table's less it)
BF16, A3, C8 = ("none", "none"), ("none", "int8"), ("fp8", "fp8")
REF_STATE = {(FLASH, 8192, BF16): (5.38, 42.0, 1.25, 10.5, 11.64, 0.13, 70.9),
             (FLASH, 8192, A3): (5.38, 42.0, 1.25, 5.33, 11.64, 0.13, 65.7),
             (FLASH, 8192, C8): (3.36, 26.3, 0.78, 5.41, 11.64, 0.08, 47.5),
             (FLASH, 131072, BF16): (5.38, 672, 20.0, 168, 11.64, 0.13, 877),
             (FLASH, 131072, A3): (5.38, 672, 20.0, 85.3, 11.64, 0.13, 794),
             (FLASH, 131072, C8): (3.36, 420, 12.5, 86.6, 11.64, 0.08, 534),
             (PRO, 8192, BF16): (7.63, 60.0, 1.94, 15.0, 17.84, 0.13, 102.5),
             (PRO, 131072, BF16): (7.63, 960, 31.0, 240, 17.84, 0.13, 1257),
             (PRO, 131072, C8): (4.77, 600, 19.4, 123.8, 17.84, 0.08, 766)}
# §4's per-row storage: KV bf16 1024 B / 950 fp8 640 B; indexer bf16 256 B, A3 int8 + fp16 scale 130 B,
# 950 fp8 + fp32 scale 132 B
KV_ROW, IDX_ROW = {"none": 1024, "fp8": 640}, {"none": 256, "int8": 130, "fp8": 132}


@pytest.mark.parametrize("path, tokens, cache", list(REF_STATE))
def test_state_per_request_matches_reference_section_4(path, tokens, cache):
    """Each part from §4's definitions (whole 128-entry blocks: 8K tokens = 64 HCA entries take
    one block), and the total within the table's rounding of it."""
    from engine.cache_dtype import CacheDtype
    from engine.memory_sizes import Layout, state_per_request
    args = ModelArgs.from_json(path)
    n_csa, n_hca = (sum(r == m for r in args.compress_ratios[:args.num_hidden_layers]) for m in (4, 128))
    kv, idx, L = KV_ROW[cache[0]], IDX_ROW[cache[1]], tokens
    s = state_per_request(args, Layout(cache_dtype=CacheDtype(*cache)), tokens)
    hca_entries = math.ceil(L // 128 / 128) * 128
    assert s == {"window": args.num_hidden_layers * 128 * kv, "csa_kv": L // 4 * kv * n_csa,
                 "indexer": L // 4 * idx * n_csa, "hca_kv": hca_entries * kv * n_hca,
                 "compressor_state": n_csa * (64 + 16) * 1024 + n_hca * 512 * 1024, "mtp_window": 0}
    win, csa, hca, ind, comp, mtp, total = REF_STATE[(path, tokens, cache)]
    mib = {k: v / MIB for k, v in s.items()}
    assert (mib["window"], mib["csa_kv"], mib["indexer"], mib["compressor_state"]) == \
        pytest.approx((win, csa, ind, comp), rel=0.002, abs=0.01)
    assert mib["hca_kv"] == pytest.approx(hca * hca_entries / (L // 128), rel=0.005)
    # the table's totals are rounded to 0.1 MiB (8K) or 1 MiB (128K)
    assert sum(mib.values()) - (mib["hca_kv"] - hca) == pytest.approx(total - mtp, abs=0.05 if total < 200 else 0.5)


# ---- against the tiny checkpoint's shard files and the engine's pools ---------------------------
def _stored(ckpt) -> dict[str, int]:
    """Bytes of every tensor in the checkpoint's shard headers (not the layout table)."""
    from pathlib import Path

    from engine.checkpoint.shards import DTYPE_BYTES, scan_checkpoint
    return {n: math.prod(t.shape) * DTYPE_BYTES[t.dtype] for n, t in scan_checkpoint(Path(ckpt)).items()}


def test_weights_at_world_1_are_the_tiny_checkpoints_stored_bytes(ckpt):
    from engine.memory_sizes import COMPONENTS, Layout, component, weight_bytes
    stored = _stored(ckpt)
    total, mtp = sum(stored.values()), sum(b for n, b in stored.items() if n.startswith("mtp."))
    args = ModelArgs.from_json(ckpt)
    for next_n, held in ((1, total), (0, total - mtp)):       # MTP weights only when next_n > 0
        w = weight_bytes(args, Layout(next_n=next_n))
        assert sum(r.checkpoint for r in w.values()) == total
        assert sum(r.read for r in w.values()) == sum(r.resident for r in w.values()) == held
    for comp in COMPONENTS:
        assert w[comp].checkpoint == sum(b for n, b in stored.items() if component(n) == comp), comp


def _group(name: str, lay) -> int:
    """Ranks one copy of a tensor is split over (engine.parallel.shard's groups); 1: replicated."""
    if ".ffn.experts." in name:
        return lay.world_size                                   # EP x MoE-TP: every rank a part
    if name in ("embed.weight", "head.weight"):
        return lay.embed_tp_size if name == "embed.weight" else lay.lmhead_tp_size
    if ".ffn.shared_experts.w" in name:
        return lay.shared_tp_size
    return lay.o_proj_tp_size if ".attn.wo_a." in name or ".attn.wo_b." in name else 1


@pytest.mark.parametrize("kw", [dict(world_size=2, embed_tp_size=2, lmhead_tp_size=2, o_proj_tp_size=2, next_n=1),
                                dict(world_size=4, moe_tp_size=2, lmhead_tp_size=4, next_n=0),
                                dict(world_size=8, embed_tp_size=8, o_proj_tp_size=2, next_n=1)])
def test_ranks_hold_the_tiny_checkpoint_as_the_shard_rules_cut_it(ckpt, kw):
    """Summed over the ranks, what they read is each tensor once per group it is split over:
    a split tensor (experts, TP slices) world_size / group copies, a replicated one world_size."""
    from engine.memory_sizes import Layout, weight_bytes
    lay, args, stored = Layout(**kw), ModelArgs.from_json(ckpt), _stored(ckpt)
    per_rank = [weight_bytes(args, lay, r) for r in range(lay.world_size)]
    want = sum(b * lay.world_size // _group(n, lay) for n, b in stored.items()
               if lay.next_n or not n.startswith("mtp."))
    assert sum(sum(row.read for row in w.values()) for w in per_rank) == want
    for w in per_rank:                                           # vocab 129280 splits evenly: no padding
        assert sum(row.read for row in w.values()) == sum(row.resident for row in w.values())
    assert per_rank[0]["routed_experts"].read * lay.world_size == sum(b for n, b in stored.items()
                                                                      if n.startswith("layers.") and ".experts." in n)


def test_the_lm_heads_last_slice_is_padded_to_ceil_v_over_s(ckpt):
    from engine.memory_sizes import Layout, weight_bytes
    args = ModelArgs.from_json(ckpt)                             # vocab 129280, hidden 256, bf16 head
    lay = Layout(world_size=48, lmhead_tp_size=3)                # ceil(129280 / 3) = 43094 rows per slice
    last = weight_bytes(args, lay, rank=2)["lm_head"]
    assert (last.read, last.resident) == (43092 * 256 * 2, 43094 * 256 * 2)
    assert weight_bytes(args, lay, rank=0)["lm_head"].read == 43094 * 256 * 2


@pytest.mark.parametrize("next_n", [0, 1])
@pytest.mark.parametrize("tokens", [1, 200, 4096, 5000])
@pytest.mark.parametrize("dtype, cache", [("float32", BF16), ("bfloat16", BF16), ("bfloat16", A3),
                                          ("bfloat16", C8), ("float32", C8), ("bfloat16", ("hif8", "hif8"))])
def test_state_per_request_is_what_the_engines_pools_allocate(tokens, next_n, dtype, cache):
    """A LocalCache (accounting + PagedCache) holding exactly one request of ``tokens`` tokens,
    caches stored as ``cache``: its tensors' bytes are ``pool_bytes`` and, minus the scratch part, the plan's per-request
    state, each part once (with next_n > 0 the MTP window ring lives in the ``win`` blocks: it is
    ``mtp_window``, not also in ``window``)."""
    import torch

    from engine.cache_dtype import CacheDtype
    from engine.checkpoint.make_tiny import PRESETS
    from engine.core.block_manager import CacheConfig, Geometry, pool_bytes
    from engine.core.kv_cache import LocalCache
    from engine.memory_sizes import Layout, pool_overheads, state_per_request
    args, dt, cd = ModelArgs.from_dict(PRESETS["flash"]), getattr(torch, dtype), CacheDtype(*cache)
    g = Geometry.of(args, 128, next_n)
    cfg = CacheConfig(128, 1, {"c4": g.blocks_needed("c4", tokens), "c128": g.blocks_needed("c128", tokens)}, next_n,
                      cd)
    cache_ = LocalCache(args, cfg, dt)
    cache_.allocate("r", tokens)
    assert all(n == 0 for n in cache_.num_free().values())        # the request holds every block
    allocated = sum(t.numel() * t.element_size() for t in cache_.tensors())
    lay = Layout(act_bytes=dt.itemsize, next_n=next_n, cache_dtype=cd)
    plan, (scratch, _) = state_per_request(args, lay, tokens), pool_overheads(args, lay)
    assert allocated == pool_bytes(args, dt, cfg)
    assert allocated - scratch == sum(plan.values())
    mtp_pools = sum(t.numel() * t.element_size() for rows in cache_.paged.mtp_win for t in rows.parts)
    assert plan["mtp_window"] == mtp_pools // 2 and (mtp_pools > 0) == (next_n > 0)   # the request's ring + scratch


def test_the_pools_minimum_is_what_plan_cache_refuses_below():
    from engine.checkpoint.make_tiny import PRESETS
    from engine.core.block_manager import plan_cache
    from engine.memory_sizes import Layout, pool_overheads
    args = ModelArgs.from_dict(PRESETS["flash"])
    f32 = type("F32", (), {"itemsize": 4})()
    _, minimum = pool_overheads(args, Layout(act_bytes=4, batch_per_rank=8))
    plan_cache(args, f32, 128, 8, minimum)
    with pytest.raises(ValueError, match=f"below the minimum {minimum} bytes"):
        plan_cache(args, f32, 128, 8, minimum - 1)


# ---- dsv4-plan -------------------------------------------------------------------------------------
REAL_YAMLS = ["configs/deepseek-v4-flash-a3-prefill.yaml", "configs/deepseek-v4-flash-a3-decode.yaml",
              "configs/deepseek-v4-flash-a3-w8a8-16rank.yaml", "configs/deepseek-v4-pro-950-16rank.yaml"]


def test_every_shipped_full_size_yaml_is_covered():
    from pathlib import Path
    assert sorted(str(p) for p in Path("configs").glob("deepseek-v4-*.yaml")) == sorted(REAL_YAMLS)


@pytest.mark.parametrize("yaml", REAL_YAMLS)
def test_dsv4_plan_prints_the_table_of_every_shipped_real_yaml(yaml, capsys):
    from engine.tools.plan import main
    assert main(["--config", yaml]) == 0                      # no other flag needed
    out = capsys.readouterr().out
    for line in ("weights (GiB)", "routed_experts", "workspace (GiB)", "state per request (MiB)",
                 "requests that fit / rank", "verdict: fits"):
        assert line in out, line
    assert "configs/models/deepseek-v4-" in out and "(model_config.quant_type)" in out


def test_dsv4_plan_json_quant_type_and_refusal(capsys):
    import json

    from engine.tools.plan import main
    flash16 = "configs/deepseek-v4-flash-a3-w8a8-16rank.yaml"
    assert main(["--config", flash16, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["left"] == d["budget"] - d["resident"] - d["workspace_total"] and d["left"] >= 20e9
    assert d["state"]["131072"]["total"] / MIB == pytest.approx(810.77, abs=0.01)     # bf16 KV, int8 indexer
    assert d["layout"]["cache_dtype"] == {"kv": "none", "indexer": "int8"} and d["cache_rows"] == [1024, 130]
    assert main(["--config", flash16, "--quant-type", "w4a8-int", "--json"]) == 0
    d4 = json.loads(capsys.readouterr().out)
    assert d4["quant_type"] == "w4a8-int" and d4["resident"] < d["resident"] - 7 * GIB    # int4 experts: half
    assert main(["--config", flash16, "--device-memory-gib", "32"]) == 2
    cap = capsys.readouterr()
    assert "verdict: does NOT fit" in cap.out
    assert "dsv4-plan: memory plan: DeepSeek-V4-Flash (w8a8-int) on 16 rank(s) of 32 GiB (--device-memory-gib) does " \
           "not fit: weights 25.82 GiB + workspace 6.91 GiB exceed the 27.20 GiB budget" in cap.err
    # a budget that rounds to nothing, and a --model that is not a checkpoint, are named (exit 2)
    assert main(["--config", flash16, "--device-memory-gib", "1e-10"]) == 2
    assert "--device-memory-gib: 0 bytes per rank is too small to plan" in capsys.readouterr().err
    assert main(["--config", flash16, "--model", "/nonexistent"]) == 2
    assert "--model: no config.json in '/nonexistent'" in capsys.readouterr().err


def test_dsv4_plan_resolves_the_cache_dtype_prints_it_and_takes_an_override(capsys):
    import json

    from engine.tools.plan import main
    flash16, pro950 = REAL_YAMLS[2], REAL_YAMLS[3]
    assert main(["--config", flash16]) == 0
    assert "decode-state caches: KV unquantised (1024 B/row), indexer keys int8 (130 B/entry) (scheduler_config." \
           "kv_cache_dtype auto: the checkpoint's kv_cache_scheme / li_cache_scheme)" in capsys.readouterr().out
    assert main(["--config", flash16, "--kv-cache-dtype", "bfloat16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["state"]["131072"]["total"] / MIB == pytest.approx(893.46, abs=0.01)     # bf16 indexer keys
    assert d["cache_source"] == "--kv-cache-dtype bfloat16"
    assert main(["--config", pro950, "--kv-cache-dtype", "hif8"]) == 0
    assert "decode-state caches: KV hif8 (512 B/row), indexer keys hif8 (128 B/entry) (--kv-cache-dtype hif8)" \
        in capsys.readouterr().out
    assert main(["--config", flash16, "--kv-cache-dtype", "fp8"]) == 2        # A3 has no FP8: refused, named
    err = capsys.readouterr().err
    assert "--kv-cache-dtype fp8: KV fp8 / indexer fp8 caches need FP8 / HiF8, which Ascend A3 lacks (950 only)" \
        in err and "Change: scheduler_config.kv_cache_dtype int8 (bf16 KV, int8 indexer keys) or bfloat16" in err


def test_dsv4_plan_on_the_tiny_checkpoint_and_bad_input(ckpt, capsys):
    from engine.tools.plan import main
    assert main(["--config", "configs/tiny-flash.yaml", "--model", ckpt]) == 0       # CPU: cpu_memory_gb 1
    out = capsys.readouterr().out
    assert "on CPU" in out and "device: 1 GiB (scheduler_config.cpu_memory_gb, CPU)" in out
    assert "decode-state caches: KV unquantised" in out            # original FP8 checkpoint: no cache scheme
    assert main(["--config", "configs/tiny-flash.yaml", "--model", "/nonexistent"]) == 2
    assert "--model: no config.json in '/nonexistent'; point it at a checkpoint" in capsys.readouterr().err
    for bad in (["--quant-type", "w8a8"], ["--device-memory-gib", "0"], ["--kv-cache-dtype", "fp16"]):
        with pytest.raises(SystemExit) as e:
            main(["--config", REAL_YAMLS[0], *bad])
        assert e.value.code == 2


def test_docs_memory_plan_shows_the_current_table_of_every_shipped_real_yaml():
    from pathlib import Path

    from engine.run_config import RunConfig
    from engine.tools.plan import format_plan, plan_run
    doc = Path("docs/memory-plan.md").read_text()
    for yaml in REAL_YAMLS:
        plan, source = plan_run(RunConfig.from_yaml(yaml))
        assert f"`dsv4-plan --config {yaml}`\n\n```\n{format_plan(plan, source)}\n```" in doc, \
            f"docs/memory-plan.md: regenerate the table of {yaml}"


def test_the_plans_resident_weights_are_what_the_loader_holds(ckpt):
    """The plan's rule (every kept tensor resident as stored) is the loader's: byte for byte."""
    from engine.checkpoint.loader import load_model
    from engine.memory_sizes import Layout, weight_bytes
    args = ModelArgs.from_json(ckpt)
    for next_n in (0, 1):
        m = load_model(ckpt, progress=False, mtp=next_n > 0)
        held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
        assert held == sum(r.resident for r in weight_bytes(args, Layout(next_n=next_n)).values())
