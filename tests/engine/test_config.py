"""config.json of the real Flash / Pro checkpoints is read as is; bad fields name themselves."""
import json

import pytest

from engine.config import CSA, HCA, SWA, ConfigError, ModelArgs

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
         "weight_block_size": [128, 128]}
# reference/dsv4-architecture.md §1.1
FLASH = dict(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
             num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128,
             index_topk=512, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6,
             moe_intermediate_size=2048, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
             routed_scaling_factor=1.5, swiglu_limit=10.0, num_hash_layers=3, hc_mult=4, hc_sinkhorn_iters=20,
             hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000, compress_rope_theta=160000, rope_scaling=YARN,
             max_position_embeddings=1048576, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1,
             tie_word_embeddings=False, torch_dtype="bfloat16", quantization_config=QUANT,
             compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0])
PRO = dict(FLASH, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
           index_topk=1024, n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
           expert_dtype="fp4", compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0])


def test_flash_config_reads_as_published():
    a = ModelArgs.from_dict(FLASH)
    kinds = [a.layer_kind(i) for i in range(a.num_hidden_layers)]
    assert kinds[:2] == [SWA, SWA] and kinds.count(CSA) == 21 and kinds.count(HCA) == 20
    assert [a.is_hash_layer(i) for i in range(4)] == [True, True, True, False]
    assert a.num_mtp_layers == 1 and a.quant.weight_block_size == (128, 128) and a.quant.expert_dtype == "fp4"
    assert a.nope_head_dim == 448


def test_pro_config_reads_as_published(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRO))
    a = ModelArgs.from_json(tmp_path)
    kinds = [a.layer_kind(i) for i in range(a.num_hidden_layers)]
    assert kinds[:2] == [HCA, HCA] and kinds.count(CSA) == 30 and kinds.count(HCA) == 31 and SWA not in kinds
    assert a.routed_scaling_factor == 2.5 and a.index_topk == 1024


def test_round_trip_to_dict():
    a = ModelArgs.from_dict(FLASH)
    assert ModelArgs.from_dict(a.to_dict()) == a


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": None}, "hidden_size"),                              # deleted below
    ({"num_hidden_layers": "43"}, "num_hidden_layers"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ({"norm_topk_prob": 1}, "norm_topk_prob"),
    ({"compress_ratios": [0, 0, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 0] + [4, 64] * 20 + [4] + [0]}, "compress_ratios"),
    ({"compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [4]}, "compress_ratios"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"o_groups": 7}, "o_groups"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"index_head_dim": 32}, "index_head_dim"),
    ({"num_hash_layers": 50}, "num_hash_layers"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type"),
    ({"rope_scaling": dict(YARN, factor=-1)}, "rope_scaling.factor"),
    ({"quantization_config": dict(QUANT, quant_method="gptq")}, "quantization_config.quant_method"),
    ({"quantization_config": dict(QUANT, weight_block_size=[128])}, "quantization_config.weight_block_size"),
    ({"quantization_config": dict(QUANT, scale_fmt="fp32")}, "quantization_config.scale_fmt"),
    ({"expert_dtype": "int4"}, "expert_dtype"),
    ({"index_topk": 0}, "index_topk"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"rope_theta": 0}, "rope_theta"),                               # values that would give NaN logits
    ({"compress_rope_theta": -1}, "compress_rope_theta"),
    ({"routed_scaling_factor": 1e308}, "routed_scaling_factor"),
    ({"hc_eps": 1e308}, "hc_eps"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"sliding_window": 10 ** 10}, "sliding_window"),                 # values that would exhaust memory
    ({"index_topk": 10 ** 10}, "index_topk"),
    ({"eos_token_id": 999999}, "eos_token_id"),
    ({"bos_token_id": -5}, "bos_token_id"),
    ({"rope_scaling": dict(YARN, factor=float("inf"))}, "rope_scaling.factor"),
    ({"rope_scaling": dict(YARN, factor=0.5)}, "rope_scaling.factor"),
    ({"max_position_embeddings": float("nan")}, "max_position_embeddings"),
])
def test_bad_field_is_named(change, field):
    raw = dict(FLASH, **change)
    if change.get("hidden_size", 0) is None:
        del raw["hidden_size"]
    with pytest.raises(ConfigError) as e:
        ModelArgs.from_dict(raw)
    msg = str(e.value)
    assert f"'{field}'" in msg and "\n" not in msg, msg


def test_missing_and_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelArgs.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelArgs.from_json(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="config.json: invalid JSON"):
        ModelArgs.from_json(tmp_path)


def test_unknown_keys_are_ignored_with_a_warning(caplog):
    a = ModelArgs.from_dict(dict(FLASH, some_future_key=3))
    assert a.extra["some_future_key"] == 3 and "some_future_key" in caplog.text
