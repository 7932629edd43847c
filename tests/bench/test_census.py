"""``dsv4-bench census`` (bench.census): the figures it reports for the tiny Flash decode on the
CPU op table, held here so a change to the decode path shows up as a changed count; its counters
on their own; its CLI errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bench.census import census
from bench.census_count import OpRecorder, SyncCounter
from engine.ops import REFERENCE
from engine.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
# the flash preset cut to its first 4 layers (custom_params.num_hidden_layers): window, window,
# CSA, HCA; every layer kind at 2/3 of the trace time of all 6
LAYERS = 4
CSA_LAYERS = 1
# compressors of those layers: CSA's own and its indexer's, HCA's (the window layers have none)
COMPRESSORS = 2 * CSA_LAYERS + 1


def _cut(path: Path, out: Path | None = None) -> dict:
    """The run config at ``path`` with ``custom_params.num_hidden_layers`` LAYERS (written to ``out``)."""
    raw = yaml.safe_load(path.read_text())
    raw["model_config"].setdefault("custom_params", {})["num_hidden_layers"] = LAYERS
    if out is not None:
        out.write_text(yaml.safe_dump(raw))
    return raw


@pytest.fixture(scope="module")
def fig(tiny_ckpt):
    cfg = RunConfig.from_dict(_cut(ROOT / "configs/tiny-flash.yaml"))
    return census(cfg, tiny_ckpt("flash", 1), "cpu", batch=2, context=200, steps=2, graph=True)


def test_cpu_census_runs_every_op_on_the_reference(fig):
    for step in (fig, fig["graph_step"]):
        assert step["ops"]
        for op, row in step["ops"].items():
            assert row["kernel"] == 0 and row["fallback"] == {}, op
            assert row["reference"] > 0, op


def test_eager_decode_step_op_counts_per_step(fig):
    ref = {op: row["reference"] for op, row in fig["ops"].items()}
    assert ref["lm_head"] == 1 and ref["hc_head"] == 1              # one head call for the whole batch
    assert ref["hc_pre"] == ref["hc_post"] == 2 * LAYERS             # attention + FFN sites per layer
    assert ref["moe_experts"] == ref["gating_topk"] == ref["swiglu_clamp"] == LAYERS
    assert ref["grouped_linear"] == LAYERS                           # wo_a
    # the decode rows of all requests go through the decode step (``StaticDecoder.run``): one
    # window write, one attention call per layer and one indexer call per CSA layer; each
    # compressor's projections (wkv, wgate), norm, rope and entry write are seam calls too
    assert ref["cache_write"] == LAYERS + COMPRESSORS
    assert ref["decode_sparse_attn"] == LAYERS and ref["decode_indexer_topk"] == CSA_LAYERS
    # the seam's fp32 linears: each layer's router, each indexer's weights_proj, each compressor's wkv / wgate
    assert ref["linear"] == LAYERS + CSA_LAYERS + 2 * COMPRESSORS
    # the eager step is the graph step's code: the same seam calls, but the LM head and the
    # eager MoE's grouped experts
    graph = {op: row["reference"] for op, row in fig["graph_step"]["ops"].items()}
    assert {op: n for op, n in ref.items() if op not in ("lm_head", "moe_experts")} == graph
    for op in ("sparse_attn", "compressor", "indexer_topk", "cache_indexer_topk", "cache_sparse_attn"):
        assert op not in ref


def test_eager_decode_step_host_syncs_by_site(fig):
    sites = fig["sync_sites"]
    files = {s.split(" @ ")[1].rsplit(":", 1)[0] for s in sites}
    assert files == {"engine/ops/reference/moe.py", "engine/core/model_runner.py"}
    moe = sum(n for s, n in sites.items() if "reference/moe.py" in s)
    assert moe == 6 * LAYERS     # per layer: unique, repeat_interleave, int(blocks.sum()), 3 tolist of the spans
    # sampling stays on the device: the step's one copy to the host is the sampler's small result
    # (ids, requested logprobs, finite flags), never the [B, V] logits
    assert sum(n for s, n in sites.items() if "model_runner.py" in s) == 1
    assert fig["host_syncs_per_step"] == sum(sites.values())


def test_graph_step_has_no_host_sync_and_no_graph_break(fig):
    g = fig["graph_step"]
    assert g["host_syncs_per_step"] == 0 and g["sync_sites"] == {}
    assert g["graph_breaks"] == 0 and g["stub_graph_breaks"] == 0 and g["break_reasons"] == []
    ref = {op: row["reference"] for op, row in g["ops"].items()}
    assert ref["hc_pre"] == 2 * LAYERS and ref["hc_head"] == 1
    # attention and the indexer are the seam's decode ops, as in the eager step (so a device's
    # fused kernels are what a captured step runs), called without host positions
    assert ref["decode_sparse_attn"] == LAYERS and ref["decode_indexer_topk"] == CSA_LAYERS
    assert "moe_experts" not in ref          # the routed experts are gathered per slot, outside the seam
    assert "lm_head" not in ref              # the graph step returns hidden states; logits are the engine's


@pytest.fixture(scope="module")
def stub_fig(tiny_ckpt, tmp_path_factory):
    """``dsv4-bench census --platform npu-stub --json`` in its own process (the stub registers
    torch.ops.custom for the life of a process) on the A3 decode config (bf16)."""
    cfg = tmp_path_factory.mktemp("census") / "a3-decode.yaml"
    _cut(ROOT / "configs/deepseek-v4-flash-a3-decode.yaml", cfg)
    r = subprocess.run([sys.executable, "-m", "bench.cli", "census", "--config",
                        str(cfg), "--ckpt", str(tiny_ckpt("flash", 1)),
                        "--platform", "npu-stub", "--batch", "3", "--context", "140", "--steps", "1", "--graph",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_npu_stub_census_decodes_all_rows_in_one_call_per_layer(stub_fig):
    ops = stub_fig["ops"]
    assert stub_fig["platform"] == "npu-stub" and stub_fig["dtype"] == "bfloat16" and stub_fig["batch"] == 3
    # the NPU table keeps decode batched: one attention call per layer and one indexer call per CSA
    # layer for the 3 rows (the tiny preset's 4 x 128 heads are outside the kernel's 64 x 512)
    att = ops["decode_sparse_attn"]
    assert att["fallback"] == {"heads x dim 4 x 128, kernel takes 64 x 512 (n x 64 heads: n calls)": LAYERS}
    assert att["kernel"] == 0
    assert sum(ops["decode_indexer_topk"]["fallback"].values()) == CSA_LAYERS
    for op in ("sparse_attn", "cache_indexer_topk", "cache_sparse_attn"):
        assert op not in ops                              # no per-sequence attention at decode
    assert ops["gating_topk"]["kernel"] == LAYERS and ops["rope"]["kernel"] > 0     # kernels are reached
    # bf16 residual streams on an NPU (engine.ops.residual_dtype_for): no norm of the layers falls
    # back for its dtype, and mHC falls back only for the tiny preset's hidden size (real widths:
    # test_npu_stub). The compressors' pooled entries are fp32 (§3.4): their norm and rope are the
    # reference math (the decode step's ``compress_span``, as in the graph step)
    fp32 = {"x dtype float32, kernel path takes bfloat16/float16": COMPRESSORS}
    assert ops["rms_norm"]["fallback"] == ops["rope"]["fallback"] == fp32 and ops["rms_norm"]["kernel"] > 0
    for op in ("hc_pre", "hc_post"):
        assert ops[op]["fallback"] == {"hidden 256 not in (4096, 7168)": 2 * LAYERS}, op
    assert not any("npu_stub" in s for s in stub_fig["sync_sites"])     # the stub kernels run on a device there


def test_npu_stub_graph_step_has_no_graph_break_of_ours(stub_fig):
    g = stub_fig["graph_step"]
    assert g["graph_breaks"] == 0 and g["break_reasons"] == [] and g["host_syncs_per_step"] == 0
    # the captured step reaches the NPU wrappers of the decode ops (the tiny heads fall back)
    assert sum(g["ops"]["decode_sparse_attn"]["fallback"].values()) == LAYERS
    assert g["ops"]["rms_norm"]["kernel"] > 0 and g["ops"]["gating_topk"]["kernel"] == LAYERS
    assert g["stub_graph_breaks"] > 0                        # the stub's Python binding, counted apart


def test_sync_counter_counts_kinds_and_sites():
    t, mask = torch.tensor([1.0, 2.0]), torch.tensor([True, False])
    with SyncCounter() as c:
        t.sum().item()
        t.tolist()
        int(t[0])
        t[mask]
        torch.nonzero(mask)
        t + 1                                 # no sync
    assert dict(c.kinds) == {"item": 1, "tolist": 1, "int": 1, "bool-mask index": 1, "nonzero": 1}
    assert all(site.startswith("tests/bench/test_census.py:") for _, site in c.sites)


def test_op_recorder_paths_and_unwrap():
    import inspect
    rec = OpRecorder()

    def wrapper(x, w, eps):                   # a platform wrapper that falls back once in two calls
        if x.shape[0] > 1:
            rec.on_fallback("rms_norm", "too many rows")
        return REFERENCE.rms_norm(x, w, eps)

    ops = rec.table(REFERENCE.with_overrides(rms_norm=wrapper))
    assert inspect.unwrap(ops.linear) is REFERENCE.linear and inspect.unwrap(ops.rms_norm) is wrapper
    x = torch.ones(1, 4)
    ops.rms_norm(x, None, 1e-6)               # not recording yet
    rec.active = True
    ops.rms_norm(x, None, 1e-6)
    ops.rms_norm(torch.ones(3, 4), None, 1e-6)
    ops.linear(x, torch.ones(2, 4))
    assert rec.by_op() == {"linear": {"kernel": 0, "reference": 1, "fallback": {}},
                           "rms_norm": {"kernel": 1, "reference": 0, "fallback": {"too many rows": 1}}}


@pytest.mark.parametrize("args, msg", [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--preset", "nope"], "--preset 'nope'"),
    (["--ckpt", "/nonexistent"], "is not a checkpoint directory"),
    (["--platform", "tpu"], "invalid choice"),
])
def test_cli_bad_flags_exit_2(args, msg):
    r = subprocess.run([sys.executable, "-m", "bench.cli", "census", "--config", "configs/tiny-flash.yaml", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr


def test_cli_bad_config_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_config: {dtype: float8}\n")
    r = subprocess.run([sys.executable, "-m", "bench.cli", "census", "--config", str(bad), "--preset", "flash"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model_config.dtype" in r.stderr, r.stderr
