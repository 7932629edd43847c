"""``dsv4-make-tiny --preset flash-real-width`` writes the real Flash widths: its config and shapes
against reference/dsv4-architecture.md §1.1 / §2.2 (Flash column), from the shard headers;
and loaded: as stored, with the logits of the dequantised path."""
import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from engine.checkpoint.layout import checkpoint_layout
from engine.checkpoint.shards import DTYPE_BYTES, scan_checkpoint
from engine.config import ModelArgs

pytestmark = pytest.mark.slow          # the session fixture writes 2.9 GB (about a minute on 2 cores)

# §1.1, Flash column; the preset keeps every width and cuts depth and expert count
FLASH_WIDTHS = dict(vocab_size=129280, hidden_size=4096, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
                    qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
                    index_n_heads=64, index_head_dim=128, index_topk=512, n_shared_experts=1, num_experts_per_tok=6,
                    moe_intermediate_size=2048, routed_scaling_factor=1.5, hc_mult=4)
CUT = dict(num_hidden_layers=2, num_nextn_predict_layers=1, n_routed_experts=8, num_hash_layers=1,
           compress_ratios=[4, 128, 0])
# §2.2, Flash column (the router's expert dim is the preset's 8): name -> (dtype, shape)
FLASH_SHAPES = {
    "embed.weight": ("BF16", [129280, 4096]), "head.weight": ("BF16", [129280, 4096]),
    "hc_head_fn": ("F32", [4, 16384]), "layers.1.hc_attn_fn": ("F32", [24, 16384]),
    "layers.0.attn.wq_a.weight": ("F8_E4M3", [1024, 4096]), "layers.0.attn.wq_a.scale": ("F8_E8M0", [8, 32]),
    "layers.0.attn.wq_b.weight": ("F8_E4M3", [32768, 1024]), "layers.0.attn.wq_b.scale": ("F8_E8M0", [256, 8]),
    "layers.0.attn.wkv.weight": ("F8_E4M3", [512, 4096]), "layers.0.attn.wkv.scale": ("F8_E8M0", [4, 32]),
    "layers.0.attn.wo_a.weight": ("F8_E4M3", [8192, 4096]), "layers.0.attn.wo_a.scale": ("F8_E8M0", [64, 32]),
    "layers.1.attn.wo_b.weight": ("F8_E4M3", [4096, 8192]), "layers.1.attn.wo_b.scale": ("F8_E8M0", [32, 64]),
    "layers.0.attn.attn_sink": ("F32", [64]),
    "layers.0.attn.compressor.wkv.weight": ("BF16", [1024, 4096]), "layers.0.attn.compressor.ape": ("F32", [4, 1024]),
    "layers.1.attn.compressor.wgate.weight": ("BF16", [512, 4096]),
    "layers.1.attn.compressor.ape": ("F32", [128, 512]),
    "layers.0.attn.indexer.wq_b.weight": ("F8_E4M3", [8192, 1024]),
    "layers.0.attn.indexer.wq_b.scale": ("F8_E8M0", [64, 8]),
    "layers.0.attn.indexer.weights_proj.weight": ("BF16", [64, 4096]),
    "layers.0.attn.indexer.compressor.wkv.weight": ("BF16", [256, 4096]),
    "layers.0.attn.indexer.compressor.ape": ("F32", [4, 256]),
    "layers.0.ffn.gate.weight": ("BF16", [8, 4096]), "layers.0.ffn.gate.tid2eid": ("I64", [129280, 6]),
    "layers.1.ffn.gate.bias": ("F32", [8]), "mtp.0.ffn.gate.bias": ("F32", [8]),
    "layers.1.ffn.shared_experts.w1.weight": ("F8_E4M3", [2048, 4096]),
    "layers.1.ffn.shared_experts.w1.scale": ("F8_E8M0", [16, 32]),
    "layers.1.ffn.shared_experts.w2.weight": ("F8_E4M3", [4096, 2048]),
    "layers.1.ffn.shared_experts.w2.scale": ("F8_E8M0", [32, 16]),
    "layers.0.ffn.experts.7.w3.weight": ("I8", [2048, 2048]), "layers.0.ffn.experts.7.w3.scale": ("F8_E8M0", [2048, 128]),
    "mtp.0.ffn.experts.0.w2.weight": ("I8", [4096, 1024]), "mtp.0.ffn.experts.0.w2.scale": ("F8_E8M0", [4096, 64]),
    "mtp.0.e_proj.weight": ("F8_E4M3", [4096, 4096]), "mtp.0.h_proj.scale": ("F8_E8M0", [32, 32]),
}


def test_flash_real_width_has_the_real_flash_widths_and_storage(real_width_ckpt):
    ckpt = Path(real_width_ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert {k: cfg[k] for k in FLASH_WIDTHS} == FLASH_WIDTHS and {k: cfg[k] for k in CUT} == CUT
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["expert_dtype"] == "fp4"
    args = ModelArgs.from_dict(cfg)
    assert [args.layer_kind(i) for i in range(2)] == ["csa", "hca"]
    assert [args.is_hash_layer(i) for i in range(2)] == [True, False]
    found = scan_checkpoint(ckpt)
    assert {n: (t.dtype, list(t.shape)) for n, t in found.items() if n in FLASH_SHAPES} == FLASH_SHAPES
    layout = checkpoint_layout(args)
    assert {n: (t.dtype, t.shape) for n, t in found.items()} == {n: (s.dtype, s.shape) for n, s in layout.items()}
    assert 2.6e9 < sum(math.prod(t.shape) * DTYPE_BYTES[t.dtype] for t in found.values()) < 3.0e9
    assert not any("layers.2" in n for n in found) and not any(".experts.8." in n for n in found)
    with safe_open(str(ckpt / found["layers.0.ffn.gate.tid2eid"].file), "pt") as f:
        tid2eid = f.get_tensor("layers.0.ffn.gate.tid2eid")
    assert all(len(set(r)) == 6 and max(r) < 8 for r in tid2eid[:1000].tolist())


def test_real_width_loads_as_stored_and_matches_the_dequantised_path(real_width_ckpt):
    """At real width every weight stays as stored (resident bytes = the stored bytes the model
    reads), and the packed model's logits equal the dequantised reference path's within the bound
    docs/checkpoints.md states: weights of several CPU tiles add their tiles' GEMMs in one output."""
    import torch

    from engine.checkpoint.loader import load_model
    ckpt = Path(real_width_ckpt)
    found = scan_checkpoint(ckpt)
    m = load_model(ckpt, progress=False)
    held = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
    assert held == sum(t.nbytes for n, t in found.items() if not n.startswith("mtp."))
    assert m.layers[0].attn.wq_b.weight.dtype == torch.float8_e4m3fn and m.head.weight.dtype == torch.bfloat16
    tokens = torch.tensor([0, 17, 2000, 129279, 55, 9, 64000, 3])
    packed = m.logits(m(tokens, m.new_state())[-2:])
    del m
    d = load_model(ckpt, progress=False, packed=False)
    dense = d.logits(d(tokens, d.new_state())[-2:])
    err = (packed - dense).abs().max() / dense.abs().max()
    assert err < 1e-5, err
    assert torch.equal(packed.argmax(-1), dense.argmax(-1))
