"""The YAML run config: upstream schema and defaults, shipped configs load, bad values name their key."""
import copy
from pathlib import Path

import pytest

from engine.checkpoint.make_tiny import PRESETS
from engine.config import ConfigError, ModelArgs
from engine.run_config import CustomParams, ModelConfig, ParallelConfig, RunConfig, SchedulerConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))

# reference/upstream-baseline.md §5.1 (cann-recipes-infer executor/core/config/inference_config.py)
UPSTREAM_DEFAULTS = {
    "model_config": dict(model_name="deepseek_v4", model_path="", output_path="", dtype="bfloat16", with_ckpt=True,
                         next_n=0, exe_mode="eager", enable_cache_compile=False, enable_static_kernel=False,
                         enable_dynamic_graph=True, force_eplb=False, enable_profiler=False, enable_weight_nz=True,
                         enable_hadamard=False, hadamard_weight_path=""),
    "custom_params": dict(enable_multi_streams=False, enable_limit_core=False, enable_pypto=False,
                          moe_chunk_max_len=65536, enable_superkernel=False, kernel_config={}),
    "data_config": dict(dataset="default", dataset_path="", input_truncated_len=256, temperature=0.0, top_p=1.0,
                        top_k=0, seed=None),
    "parallel_config": dict(world_size=1, attn_tp_size=1, moe_tp_size=1, embed_tp_size=1, lmhead_tp_size=1,
                            dense_tp_size=1, shared_tp_size=1, o_proj_tp_size=1, cp_size=1,
                            offline_prefill_dp_group_size=1),
    "scheduler_config": dict(batch_size=1, max_new_tokens=32, max_prefill_tokens=0, mem_fraction_static=0.85,
                             block_size=128, num_reserved_decode_tokens=64, cp_mini_batch=-1),
}

# upstream models/deepseek_v4/config/ci_a3/deepseek_v4_pd/decode.yaml, as shipped
UPSTREAM_DECODE = {
    "model_config": {"model_name": "deepseek_v4", "model_path": "/data/models/deepseek_v4_int8_w8a8",
                     "platform_version": "A3", "with_ckpt": True, "exe_mode": "npugraph_ex",
                     "enable_static_kernel": True, "enable_dynamic_graph": False, "enable_profiler": False,
                     "force_eplb": False, "enable_cache_compile": False,
                     "custom_params": {"enable_multi_streams": False, "enable_pypto": False,
                                       "enable_limit_core": True, "moe_chunk_max_len": 65536}},
    "data_config": {"temperature": 1.0},
    "parallel_config": {"world_size": 16, "cp_size": 1, "attn_tp_size": 1, "dense_tp_size": 1, "moe_tp_size": 1,
                        "embed_tp_size": 1, "lmhead_tp_size": 4, "o_proj_tp_size": 1},
    "scheduler_config": {"block_size": 128, "max_new_tokens": 8192, "max_prefill_tokens": 8192, "batch_size": 16,
                         "mem_fraction_static": 0.80},
}


def _with(base: dict, dotted: str, value) -> dict:
    """A deep copy of ``base`` with ``a.b.c = value``."""
    d = copy.deepcopy(base)
    *parents, leaf = dotted.split(".")
    node = d
    for k in parents:
        node = node.setdefault(k, {})
    node[leaf] = value
    return d


def test_there_are_shipped_configs():
    names = {p.name for p in SHIPPED}
    assert {"tiny-flash.yaml", "deepseek-v4-flash-a3-prefill.yaml", "deepseek-v4-flash-a3-decode.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_yaml_loads_validates_and_round_trips(path):
    assert path.read_text().startswith("#"), "each shipped YAML starts with a comment saying what it is for"
    cfg = RunConfig.from_yaml(path)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_tiny_flash_config():
    cfg = RunConfig.from_yaml(CONFIGS / "tiny-flash.yaml")
    m, d, s = cfg.model_config, cfg.data_config, cfg.scheduler_config
    assert (m.model_path, m.dtype, m.exe_mode) == ("models/tiny-flash", "float32", "eager")
    assert (d.dataset, d.dataset_path) == ("InfiniteBench", "data/infinitebench_sample.jsonl")
    assert (CONFIGS.parent / d.dataset_path).is_file()
    assert (s.batch_size, s.max_prefill_tokens, s.block_size, s.cpu_memory_gb) == (8, 2048, 128, 1.0)
    assert s.cpu_memory_bytes == 1 << 30
    assert cfg.batch_size_per_dp_rank == 8 and cfg.effective_max_prefill_tokens == 2048


def test_a3_pd_configs_match_upstream_shape():
    p = RunConfig.from_yaml(CONFIGS / "deepseek-v4-flash-a3-prefill.yaml")
    d = RunConfig.from_yaml(CONFIGS / "deepseek-v4-flash-a3-decode.yaml")
    for cfg in (p, d):
        assert cfg.parallel_config.world_size == 16 and cfg.parallel_config.lmhead_tp_size == 4
        assert cfg.parallel_config.attn_dp_size == 16 and cfg.parallel_config.moe_ep_size == 16
        s = cfg.scheduler_config
        assert (s.block_size, s.max_prefill_tokens, s.batch_size, s.mem_fraction_static) == (128, 8192, 16, 0.80)
    assert p.model_config.exe_mode == "eager" and p.scheduler_config.max_new_tokens == 1
    m = d.model_config
    assert m.exe_mode == "npugraph_ex" and m.enable_static_kernel and d.scheduler_config.max_new_tokens == 8192
    assert m.custom_params.enable_limit_core and m.custom_params.enable_multi_streams


def test_upstream_shipped_decode_yaml_is_rejected_with_the_reason():
    with pytest.raises(ConfigError, match=r"custom_params\.enable_limit_core: needs .*enable_multi_streams"):
        RunConfig.from_dict(UPSTREAM_DECODE)
    fixed = _with(UPSTREAM_DECODE, "model_config.custom_params.enable_multi_streams", True)
    assert RunConfig.from_dict(fixed).model_config.custom_params.enable_limit_core


def test_defaults_equal_upstream():
    d = RunConfig().to_dict()
    custom = d["model_config"].pop("custom_params")
    for section, expected in UPSTREAM_DEFAULTS.items():
        got = custom if section == "custom_params" else d[section]
        assert {k: got[k] for k in expected} == expected, section
    assert d["model_config"]["platform_version"] is None          # detected from the device
    assert (custom["num_hidden_layers"], custom["max_position_embeddings"]) == (None, None)
    s = d["scheduler_config"]
    assert (s["cpu_memory_gb"], s["num_kv_blocks"], s["max_model_len"]) == (4.0, None, None)
    assert RunConfig.from_dict({}) == RunConfig()


def test_round_trip_non_default():
    raw = _with(UPSTREAM_DECODE, "model_config.custom_params.enable_multi_streams", True)
    raw = _with(raw, "model_config.custom_params.kernel_config", {"compressor": "native"})
    raw = _with(raw, "data_config.seed", 7)
    raw = _with(raw, "scheduler_config.num_kv_blocks", 1000)
    cfg = RunConfig.from_dict(raw)
    again = RunConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert cfg.model_config.custom_params.kernel_config == {"compressor": "native"}


def test_yaml_details_normalised(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model_config:\n  platform_version: 950\ndata_config:\nscheduler_config:\n"
                 "  mem_fraction_static: 1\n  cpu_memory_gb: 2\n")
    cfg = RunConfig.from_yaml(f)
    assert cfg.model_config.platform_version == "950"             # unquoted YAML number
    assert cfg.data_config == RunConfig().data_config              # empty section = defaults
    assert cfg.scheduler_config.mem_fraction_static == 1.0 and isinstance(cfg.scheduler_config.cpu_memory_gb, float)


def test_derived_sizes():
    p = ParallelConfig(world_size=16, moe_tp_size=2, embed_tp_size=4, lmhead_tp_size=4)
    assert (p.attn_dp_size, p.moe_ep_size, p.embed_dp_size, p.cp_prefill_dp_size) == (16, 8, 4, 16)
    cfg = RunConfig.from_dict({"parallel_config": {"world_size": 4}, "scheduler_config": {"batch_size": 8},
                               "data_config": {"input_truncated_len": 100}})
    assert cfg.batch_size_per_dp_rank == 2 and cfg.effective_max_prefill_tokens == 200   # 0 -> 100 x 2
    cp = RunConfig.from_dict({"parallel_config": {"world_size": 8, "cp_size": 8},
                              "scheduler_config": {"batch_size": 16, "cp_mini_batch": 1},
                              "data_config": {"input_truncated_len": 1024}})
    assert cp.parallel_config.cp_prefill_dp_size == 1 and cp.effective_max_prefill_tokens == 16 * 1024


def test_sections_are_frozen_and_validate_on_construction():
    cfg = RunConfig()
    with pytest.raises(AttributeError):
        cfg.scheduler_config.block_size = 64                       # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"^scheduler_config\.block_size: must be a power of two, got 96$"):
        SchedulerConfig(block_size=96)
    with pytest.raises(ConfigError, match=r"model_config\.custom_params\.moe_chunk_max_len"):
        ModelConfig(custom_params=CustomParams(moe_chunk_max_len=0))
    # upstream's DSV4 check refuses ge_graph; we run it (engine.core.graph_runner)
    assert RunConfig(model_config=ModelConfig(exe_mode="ge_graph")).model_config.exe_mode == "ge_graph"
    with pytest.raises(ConfigError, match=r"model_config\.custom_params\.kernel_config\.sas: unknown op"):
        CustomParams(kernel_config={"sas": "native"})
    with pytest.raises(ConfigError, match=r"model_config\.custom_params\.kernel_config\.compressor: impl 'cuda'"):
        CustomParams(kernel_config={"compressor": "cuda"})
    assert CustomParams(kernel_config={"compressor": "ascendc"}).kernel_config == {"compressor": "ascendc"}


def test_check_model_against_tiny_checkpoint():
    args = ModelArgs.from_dict(PRESETS["flash"])                  # 4 heads, 16 experts, 1 MTP layer
    ok = RunConfig.from_dict({"scheduler_config": {"max_model_len": 4096}, "model_config": {"next_n": 1}})
    ok.check_model(args)
    assert ok.max_model_len_for(args) == 4096
    assert RunConfig().max_model_len_for(args) == args.max_position_embeddings
    short = RunConfig.from_dict({"model_config": {"custom_params": {"max_position_embeddings": 8192}}})
    assert short.max_model_len_for(args) == 8192
    bad = [
        ({"parallel_config": {"world_size": 32}, "scheduler_config": {"batch_size": 32}},
         "parallel_config.moe_tp_size: moe_ep_size"),
        ({"model_config": {"custom_params": {"num_hidden_layers": 7}}}, "model_config.custom_params.num_hidden_layers"),
        ({"scheduler_config": {"max_model_len": 2 << 20}}, "scheduler_config.max_model_len: must be <="),
    ]
    for raw, msg in bad:
        with pytest.raises(ConfigError, match=msg.replace(".", r"\.")):
            RunConfig.from_dict(raw).check_model(args)
    no_mtp = ModelArgs.from_dict(dict(PRESETS["flash"], num_nextn_predict_layers=0,
                                      compress_ratios=PRESETS["flash"]["compress_ratios"][:-1]))
    with pytest.raises(ConfigError, match=r"model_config\.next_n: needs an MTP layer"):
        ok.check_model(no_mtp)


def test_quant_type_must_be_what_the_checkpoint_config_says():
    """model_config.quant_type names the converted type model_path holds; the checkpoint's
    config.json (here the tiny original, then its w8a8-int conversion) must agree."""
    from engine.checkpoint.qscheme import compressed_tensors_config
    original = ModelArgs.from_dict(PRESETS["flash"])
    w8a8 = ModelArgs.from_dict(dict(PRESETS["flash"], quantization_config=compressed_tensors_config(
        6, PRESETS["flash"]["compress_ratios"], "w8a8-int")))
    cfg = RunConfig.from_dict({"model_config": {"quant_type": "w8a8-int"}})
    cfg.check_model(w8a8)
    RunConfig().check_model(original)
    with pytest.raises(ConfigError, match=r"model_config\.quant_type: 'w8a8-int', but the checkpoint's config\.json "
                                          r"says 'the original \(unconverted\) weights'"):
        cfg.check_model(original)
    with pytest.raises(ConfigError, match=r"model_config\.quant_type: 'w4a8-int', .* says 'w8a8-int'"):
        RunConfig.from_dict({"model_config": {"quant_type": "w4a8-int"}}).check_model(w8a8)


# (key path set, value, substring the message must contain) -- applied to the fixed upstream decode YAML
GOOD = _with(UPSTREAM_DECODE, "model_config.custom_params.enable_multi_streams", True)
BAD = [
    # unknown sections / keys, with suggestions
    ("scheduler_confg", {}, "scheduler_confg: unknown section (did you mean 'scheduler_config'?)"),
    ("exe_mode", "eager", "exe_mode: unknown section (did you mean model_config.exe_mode?)"),
    ("disagg_config", {}, "disagg_config: not a YAML section"),
    ("scheduler_config.blok_size", 128, "scheduler_config.blok_size: unknown key (did you mean 'block_size'?)"),
    ("data_config.batch_size", 16, "data_config.batch_size: unknown key (did you mean scheduler_config.batch_size?)"),
    ("model_config.enable_limit_core", True,
     "model_config.enable_limit_core: unknown key (did you mean model_config.custom_params.enable_limit_core?)"),
    ("model_config.custom_params.enable_multistream", True,
     "model_config.custom_params.enable_multistream: unknown key (did you mean 'enable_multi_streams'?)"),
    ("parallel_config.zzz", 1, "parallel_config.zzz: unknown key; known: attn_tp_size"),
    ("model_config", [1, 2], "model_config: must be a mapping, got list"),
    # types (bool is not an int, a string is not a number)
    ("scheduler_config.block_size", True, "scheduler_config.block_size: must be an integer, got True (bool)"),
    ("scheduler_config.batch_size", "16", "scheduler_config.batch_size: must be an integer, got '16' (str)"),
    ("scheduler_config.mem_fraction_static", "0.8", "scheduler_config.mem_fraction_static: must be a finite number"),
    ("scheduler_config.mem_fraction_static", float("nan"), "scheduler_config.mem_fraction_static: must be a finite"),
    ("model_config.with_ckpt", 1, "model_config.with_ckpt: must be true or false, got 1 (int)"),
    ("model_config.model_path", None, "model_config.model_path: must be a string, got None (null)"),
    ("model_config.custom_params.kernel_config", {"compressor": 1},
     "model_config.custom_params.kernel_config: must be a mapping of strings to strings"),
    ("data_config.top_k", 1.5, "data_config.top_k: must be an integer, got 1.5 (float)"),
    # ranges / choices
    ("scheduler_config.block_size", 0, "scheduler_config.block_size: must be a positive integer, got 0"),
    ("scheduler_config.block_size", 96, "scheduler_config.block_size: must be a power of two, got 96"),
    ("scheduler_config.batch_size", 0, "scheduler_config.batch_size: must be a positive integer, got 0"),
    ("scheduler_config.max_new_tokens", 0, "scheduler_config.max_new_tokens: must be a positive integer, got 0"),
    ("scheduler_config.max_prefill_tokens", -1, "scheduler_config.max_prefill_tokens: must be >= 0"),
    ("scheduler_config.mem_fraction_static", 0, "scheduler_config.mem_fraction_static: must be in (0, 1], got 0.0"),
    ("scheduler_config.mem_fraction_static", 1.2, "scheduler_config.mem_fraction_static: must be in (0, 1], got 1.2"),
    ("scheduler_config.num_reserved_decode_tokens", -1, "scheduler_config.num_reserved_decode_tokens: must be >= 0"),
    ("scheduler_config.cp_mini_batch", 0, "scheduler_config.cp_mini_batch: must be -1 (no limit) or a positive"),
    ("scheduler_config.cpu_memory_gb", 0, "scheduler_config.cpu_memory_gb: must be > 0"),
    ("scheduler_config.num_kv_blocks", 0, "scheduler_config.num_kv_blocks: must be a positive integer or null"),
    ("scheduler_config.max_model_len", -5, "scheduler_config.max_model_len: must be a positive integer or null"),
    ("scheduler_config.batch_size", 8, "scheduler_config.batch_size: must be a multiple of the attention-DP size 16"),
    ("data_config.temperature", -0.1, "data_config.temperature: must be >= 0"),
    ("data_config.top_p", 0.0, "data_config.top_p: must be in (0, 1], got 0.0"),
    ("data_config.top_p", 1.5, "data_config.top_p: must be in (0, 1]"),
    ("data_config.top_k", -2, "data_config.top_k: must be >= -1"),
    ("data_config.seed", -1, "data_config.seed: must be a non-negative integer or null"),
    ("data_config.input_truncated_len", 0, "data_config.input_truncated_len: must be a positive integer"),
    ("data_config.dataset", "infinitebench",
     "data_config.dataset: must be one of 'default', 'LongBench', 'InfiniteBench', got 'infinitebench' "
     "(did you mean 'InfiniteBench'?)"),
    ("model_config.dtype", "fp32", "model_config.dtype: must be one of 'bfloat16', 'float32', 'float16'"),
    ("model_config.exe_mode", "acl_graph", "model_config.exe_mode: must be one of 'auto', 'eager', 'ge_graph', 'npugraph_ex'"),
    ("model_config.platform_version", "A5", "model_config.platform_version: must be one of 'A2', 'A3', '950'"),
    ("model_config.next_n", 4, "model_config.next_n: must be in [0, 3], got 4"),
    ("model_config.next_n", -1, "model_config.next_n: must be in [0, 3], got -1"),
    ("model_config.quant_type", "w8a8", "model_config.quant_type: must be one of 'w8a8-int', 'w4a8-int', "
     "'w4a8-mx', 'w4a8-mx-hif', got 'w8a8' (did you mean 'w8a8-int'?)"),
    ("model_config.plan_config", 1, "model_config.plan_config: must be a string, got 1 (int)"),
    ("model_config.graph_batch_sizes", [4, 2], "model_config.graph_batch_sizes: must be positive integers in "
     "ascending order, got [4, 2]"),
    ("model_config.graph_batch_sizes", [0, 8], "model_config.graph_batch_sizes: must be positive integers in "),
    ("model_config.graph_batch_sizes", [], "model_config.graph_batch_sizes: must be positive integers in "),
    ("model_config.graph_batch_sizes", [1.5], "model_config.graph_batch_sizes: must be a list of integers, got [1.5]"),
    ("model_config.graph_batch_sizes", 8, "model_config.graph_batch_sizes: must be a list of integers, got 8 (int)"),
    ("model_config.custom_params.moe_chunk_max_len", 0,
     "model_config.custom_params.moe_chunk_max_len: must be a positive integer, got 0"),
    ("model_config.custom_params.num_hidden_layers", 0, "model_config.custom_params.num_hidden_layers: must be a "),
    # parallel layout
    ("parallel_config.lmhead_tp_size", 3, "parallel_config.lmhead_tp_size: must divide world_size (16), got 3"),
    ("parallel_config.moe_tp_size", 0, "parallel_config.moe_tp_size: must be a positive integer, got 0"),
    ("parallel_config.world_size", 0, "parallel_config.world_size: must be a positive integer, got 0"),
    ("parallel_config.cp_size", 8, "parallel_config.cp_size: must be 1 or world_size (16), got 8"),
    # DeepSeek-V4 check_model_settings
    ("parallel_config.attn_tp_size", 2, "parallel_config.attn_tp_size: DeepSeek-V4 needs 1"),
    ("model_config.custom_params.enable_multi_streams", False,
     "model_config.custom_params.enable_limit_core: needs model_config.custom_params.enable_multi_streams: true"),
    ("model_config.custom_params.enable_pypto", True,
     "model_config.custom_params.enable_limit_core: cannot be combined with model_config.custom_params.enable_pypto"),
    ("model_config.platform_version", "950", "model_config.custom_params.enable_limit_core: A3 only"),
    ("model_config.exe_mode", "eager", "model_config.enable_static_kernel: needs exe_mode 'npugraph_ex'"),
    ("model_config.with_ckpt", False, "model_config.force_eplb: must be true with dummy weights"),
]


@pytest.mark.parametrize("key, value, message", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_values_name_their_key(key, value, message):
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(_with(GOOD, key, value))
    assert message in str(e.value)
    assert str(e.value).startswith(message.split(":")[0])


@pytest.mark.parametrize("raw, message", [
    ({"model_config": {"exe_mode": "eager", "enable_cache_compile": True}},
     "model_config.enable_cache_compile: needs a graph exe_mode"),
    ({"model_config": {"custom_params": {"enable_superkernel": True}}},
     "model_config.custom_params.enable_superkernel: needs a graph exe_mode"),
    ({"model_config": {"platform_version": "A2", "custom_params": {"enable_pypto": True}}},
     "model_config.custom_params.enable_pypto: A3 only"),
    ({"model_config": {"custom_params": {"enable_limit_core": True}}},
     "model_config.custom_params.enable_limit_core: needs model_config.custom_params.enable_multi_streams: true"),
    ({"model_config": {"custom_params": {"enable_limit_core": True, "enable_multi_streams": True,
                                         "enable_pypto": True}}},
     "model_config.custom_params.enable_limit_core: cannot be combined with model_config.custom_params.enable_pypto"),
    ({"model_config": {"platform_version": "950", "custom_params": {"enable_limit_core": True,
                                                                    "enable_multi_streams": True}}},
     "model_config.custom_params.enable_limit_core: A3 only"),
    ({"model_config": {"exe_mode": "ge_graph", "enable_static_kernel": True}},
     "model_config.enable_static_kernel: needs exe_mode 'npugraph_ex'"),
    ({"model_config": {"custom_params": {"moe_chunk_max_len": 0}}},
     "model_config.custom_params.moe_chunk_max_len: must be a positive integer"),
    ({"parallel_config": {"world_size": 8, "cp_size": 8}, "scheduler_config": {"batch_size": 8}},
     "scheduler_config.cp_mini_batch: must be 1 with context parallelism"),
    ({"parallel_config": {"world_size": 8, "cp_size": 8}, "scheduler_config": {"cp_mini_batch": 1, "batch_size": 8},
      "model_config": {"next_n": 1}},
     "model_config.next_n: MTP needs parallel_config.cp_size 1, got cp_size 8"),
    ({"parallel_config": {"world_size": 8, "cp_size": 8, "attn_tp_size": 2}},
     "parallel_config.attn_tp_size: must be 1 with context parallelism"),
    ({"parallel_config": {"world_size": 8, "offline_prefill_dp_group_size": 3}},
     "parallel_config.offline_prefill_dp_group_size: must divide world_size (8), got 3"),
    ([1, 2], "top level: must be a mapping of sections"),
    ({1: {}}, "1: unknown section (keys must be strings, got int)"),
])
def test_more_bad_combinations(raw, message):
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(raw)
    assert message in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("model_config: [unclosed\n", "invalid YAML"),
    ("- model_config\n", "top level: must be a mapping of sections"),
    ("", "run config is empty"),
    ("# only a comment\n", "run config is empty"),
    ("just a string\n", "top level: must be a mapping of sections"),
    ("scheduler_config:\n  block_size: 100\n", "scheduler_config.block_size: must be a power of two, got 100"),
    ("!!python/object/apply:os.system ['true']\n", "invalid YAML"),       # safe_load refuses to run code
])
def test_malformed_yaml_names_the_file(tmp_path, text, message):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        RunConfig.from_yaml(f)
    assert str(e.value).startswith(f"{f}: ") and message in str(e.value)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: run config not found"):
        RunConfig.from_yaml(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="cannot read run config"):
        RunConfig.from_yaml(tmp_path)                              # a directory


def test_prefix_caching_config():
    for extra in ({}, {"model_config": {"next_n": 1}}, {"parallel_config": {"world_size": 2}}):
        cfg = RunConfig.from_dict({**extra, "scheduler_config": {"enable_prefix_caching": True, "batch_size": 2}})
        assert cfg.scheduler_config.enable_prefix_caching
    with pytest.raises(ConfigError, match="prefix_cache_slots"):
        RunConfig.from_dict({"scheduler_config": {"prefix_cache_slots": -1}})


def test_exe_mode_auto_is_graph_mode_where_a_compiler_builds_it(monkeypatch, caplog):
    """``exe_mode`` auto: the captured step on a device, and on a CPU with a C++ compiler; on a CPU
    without one eager, with a warning that names the fix. The default stays upstream's eager."""
    import logging

    from engine.build import cpp_compiler, exec_config, resolve_exe_mode
    auto = RunConfig.from_dict({"model_config": {"exe_mode": "auto"}})
    assert RunConfig.from_dict({}).model_config.exe_mode == "eager"
    assert resolve_exe_mode("eager", "cuda") == "eager" and resolve_exe_mode("npugraph_ex", "cpu") == "npugraph_ex"
    assert resolve_exe_mode("auto", "npu") == resolve_exe_mode("auto", "cuda") == "npugraph_ex"
    if cpp_compiler() is not None:
        assert resolve_exe_mode("auto", "cpu") == "npugraph_ex" and exec_config(auto).graph
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with caplog.at_level(logging.WARNING):
        assert cpp_compiler() is None and resolve_exe_mode("auto", "cpu") == "eager"
    assert "no C++ compiler" in caplog.text and "g++" in caplog.text
    assert not exec_config(auto, "cpu").graph
