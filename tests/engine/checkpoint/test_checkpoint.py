"""dsv4-make-tiny writes the original layout; the loader rejects malformed checkpoints in one line."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.fp8_mxfp4 import dequant_fp8_block
from engine.checkpoint.layout import checkpoint_layout
from engine.checkpoint.loader import load_model
from engine.checkpoint.make_tiny import main as make_tiny_main
from engine.checkpoint.shards import CheckpointError, scan_checkpoint
from engine.config import ConfigError, ModelArgs
from engine.tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"


@pytest.mark.parametrize("preset, head", [("flash", [0, 0, 4, 128]), ("pro", [128, 128, 4, 128])])
def test_tiny_checkpoint_is_the_original_layout(tiny_ckpt, preset, head):
    ckpt = Path(tiny_ckpt(preset, 1))
    cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "compress_rope_theta",
                "hc_mult", "o_groups", "index_topk", "quantization_config"):
        assert key in cfg
    assert cfg["compress_ratios"][:4] == head and cfg["compress_ratios"][-1] == 0          # trailing MTP entry
    args = ModelArgs.from_dict(cfg)
    found = scan_checkpoint(ckpt)
    layout = checkpoint_layout(args)
    assert {n: (t.dtype, t.shape) for n, t in found.items()} == {n: (s.dtype, s.shape) for n, s in layout.items()}
    assert len({t.file for t in found.values()}) > 1                                      # sharded
    assert any(n.startswith("mtp.0.") for n in found) and found["layers.3.ffn.experts.0.w1.weight"].dtype == "I8"
    # FP8 dims are multiples of 128 or below 128 (HF derives the block from the grid)
    for n, t in found.items():
        if t.dtype == "F8_E4M3":
            assert all(d % 128 == 0 or d < 128 for d in t.shape), n
    tid2eid = load_file(str(ckpt / found["layers.0.ffn.gate.tid2eid"].file))["layers.0.ffn.gate.tid2eid"]
    assert all(len(set(r)) == args.num_experts_per_tok for r in tid2eid[:1000].tolist())
    tok = Tokenizer(ckpt)
    assert tok.vocab_size == 129280 and tok.bos_id == 0 and tok.eos_id == 1
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == 1


def test_make_tiny_is_deterministic_and_refuses_nonempty_out(tmp_path, capsys):
    assert make_tiny_main(["--preset", "flash", "--seed", "7", "--out", str(tmp_path / "a")]) == 0
    assert make_tiny_main(["--preset", "flash", "--seed", "7", "--out", str(tmp_path / "b")]) == 0
    for f in sorted(os.listdir(tmp_path / "a")):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert make_tiny_main(["--preset", "flash", "--out", str(tmp_path / "a")]) == 2
    assert "not an empty directory" in capsys.readouterr().err


def test_make_tiny_interrupted_leaves_nothing_and_bad_out_is_named(tmp_path, monkeypatch, capsys):
    import engine.checkpoint.make_tiny as tiny

    def boom(out):
        raise KeyboardInterrupt
    monkeypatch.setattr(tiny, "copy_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        tiny.make_tiny("flash", 0, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []                            # no half checkpoint, no temp dir
    (tmp_path / "file").write_text("x")
    assert make_tiny_main(["--out", str(tmp_path / "file" / "sub")]) == 2
    assert make_tiny_main(["--out", str(tmp_path), "--seed", str(2 ** 64)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'file' / 'sub'}: cannot write there" in err and "--seed must be in" in err


def _state_dict(ckpt: Path) -> dict:
    sd = {}
    for f in {t.file for t in scan_checkpoint(ckpt).values()}:
        sd.update(load_file(str(ckpt / f)))
    return sd


def test_loader_keeps_every_tensor_as_stored_including_mtp(tiny_ckpt):
    ckpt = Path(tiny_ckpt("flash", 1))
    model = load_model(ckpt, progress=False, mtp=True)
    sd = _state_dict(ckpt)
    assert torch.equal(model.mtp[0].e_proj.weight, sd["mtp.0.e_proj.weight"]) and model.mtp[0].e_proj.fmt == "fp8"
    assert torch.equal(model.mtp[0].e_proj.scale, sd["mtp.0.e_proj.scale"])
    assert torch.equal(model.mtp[0].hc_head_fn, sd["mtp.0.hc_head_fn"])
    assert torch.equal(model.mtp[0].attn.attn_sink, sd["mtp.0.attn.attn_sink"])
    assert torch.equal(model.mtp[0].ffn.gate.bias, sd["mtp.0.ffn.gate.bias"])
    assert torch.equal(model.layers[0].ffn.gate.tid2eid, sd["layers.0.ffn.gate.tid2eid"])
    assert torch.equal(model.embed.weight, sd["embed.weight"]) and model.embed.weight.dtype == torch.bfloat16
    e = model.layers[3].ffn.experts
    assert e.fmt == "fp4" and torch.equal(e.w2[5], sd["layers.3.ffn.experts.5.w2.weight"])
    assert torch.equal(e.w2_scale[5], sd["layers.3.ffn.experts.5.w2.scale"])
    # resident bytes are exactly the stored bytes (no upcast, no dense copy)
    stored = sum(t.nbytes for t in scan_checkpoint(ckpt).values())
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert resident == stored
    # the dequantised reference path: dense weights in the compute dtype
    dense = load_model(ckpt, progress=False, packed=False, mtp=True)
    bs = model.args.quant.weight_block_size
    assert torch.equal(dense.mtp[0].e_proj.weight, dequant_fp8_block(sd["mtp.0.e_proj.weight"], sd["mtp.0.e_proj.scale"], bs))


def test_mtp_weights_are_read_only_when_asked(tiny_ckpt):
    ckpt = Path(tiny_ckpt("flash", 1))
    model = load_model(ckpt, progress=False)
    found = scan_checkpoint(ckpt)
    assert len(model.mtp) == 0
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert resident == sum(t.nbytes for n, t in found.items() if not n.startswith("mtp."))


def test_bf16_keeps_the_stored_dtypes(tiny_ckpt):
    m = load_model(tiny_ckpt("flash", 1), dtype=torch.bfloat16, progress=False)
    l2 = m.layers[2]
    assert m.embed.weight.dtype == torch.bfloat16 and l2.attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert l2.ffn.experts.w1.dtype == torch.int8
    for t in (l2.ffn.gate.weight, l2.attn.compressor.wkv.weight, l2.attn_norm.weight, m.head.weight,
              l2.attn.indexer.weights_proj.weight):
        assert t.dtype == torch.bfloat16
    for t in (l2.attn.compressor.ape, l2.hc_attn_fn, l2.attn.attn_sink):
        assert t.dtype == torch.float32
    dense = load_model(tiny_ckpt("flash", 1), dtype=torch.bfloat16, progress=False, packed=False)
    assert dense.layers[2].attn.wq_b.weight.dtype == torch.bfloat16 and dense.layers[2].ffn.experts.w1.dtype == torch.bfloat16


# ---- malformed checkpoints ---------------------------------------------------------------------
def _clone(src: Path, dst: Path) -> Path:
    """Copy config/index/tokenizer; symlink the shards (cheap); a test rewrites what it breaks."""
    dst.mkdir()
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            os.symlink(p, dst / p.name)
        else:
            shutil.copyfile(p, dst / p.name)
    return dst


def _rewrite(ckpt: Path, tensor: str, change):
    index = json.loads((ckpt / INDEX).read_text())
    shard = index["weight_map"][tensor]
    sd = load_file(str(ckpt / shard))
    change(sd)
    (ckpt / shard).unlink()
    save_file(sd, str(ckpt / shard))
    return index, shard


def _load_error(ckpt) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as e:
        load_model(ckpt, progress=False)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def broken(tiny_ckpt, tmp_path):
    return _clone(Path(tiny_ckpt("flash", 1)), tmp_path / "ckpt")


def test_missing_tensor(broken):
    name = "layers.2.attn.wq_a.scale"
    index, shard = _rewrite(broken, name, lambda sd: sd.pop(name))
    del index["weight_map"][name]
    (broken / INDEX).write_text(json.dumps(index))
    msg = _load_error(broken)
    assert f"tensor '{name}' is missing (expected F8_E8M0 [1, 2])" in msg


def test_extra_tensor(broken):
    _rewrite(broken, "layers.0.attn_norm.weight", lambda sd: sd.update({"layers.0.attn.bogus": torch.zeros(3)}))
    (broken / INDEX).unlink()                                        # shards found by glob
    assert "unexpected tensor 'layers.0.attn.bogus' (F32 [3]" in _load_error(broken)


def test_misshaped_tensor(broken):
    name = "layers.3.attn.compressor.ape"
    _rewrite(broken, name, lambda sd: sd.update({name: torch.zeros(64, 128)}))
    assert f"tensor '{name}' has shape [64, 128], expected [128, 128]" in _load_error(broken)


def test_mistyped_tensor(broken):
    name = "layers.2.attn.wq_b.weight"
    _rewrite(broken, name, lambda sd: sd.update({name: sd[name].to(torch.bfloat16)}))
    assert f"tensor '{name}' has dtype BF16, expected F8_E4M3" in _load_error(broken)


def test_truncated_shard(broken):
    index = json.loads((broken / INDEX).read_text())
    shard = index["weight_map"]["layers.2.attn.wq_a.weight"]
    data = (broken / shard).read_bytes()
    (broken / shard).unlink()
    (broken / shard).write_bytes(data[: len(data) - 1000])
    msg = _load_error(broken)
    assert f"shard {shard} is truncated" in msg and "tensor '" in msg


def test_shard_named_in_index_missing(broken):
    index = json.loads((broken / INDEX).read_text())
    shard = index["weight_map"]["embed.weight"]
    (broken / shard).unlink()
    assert f"shard {shard} named in {INDEX} is missing" in _load_error(broken)


def test_tid2eid_out_of_range(broken):
    name = "layers.1.ffn.gate.tid2eid"
    _rewrite(broken, name, lambda sd: sd[name].__setitem__((5, 0), 99))
    assert f"tensor '{name}' has expert ids outside [0, 16)" in _load_error(broken)


def test_nan_values(broken):
    name = "layers.4.attn.attn_sink"
    _rewrite(broken, name, lambda sd: sd[name].__setitem__(0, float("nan")))
    assert f"tensor '{name}' holds NaN or inf values" in _load_error(broken)


def test_config_inconsistent_with_shards(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["hidden_size"] = 512
    (broken / "config.json").write_text(json.dumps(cfg))
    assert "expected" in _load_error(broken)
    del cfg["hidden_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    assert "missing required field 'hidden_size'" in _load_error(broken)


def _write_header(path: Path, meta: dict, data: bytes = b""):
    head = json.dumps(meta).encode()
    path.unlink()
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)


@pytest.mark.parametrize("meta, data, msg", [
    ([1, 2], b"", "header that is not a JSON object"),
    ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "malformed header entry for tensor 'a'"),
    ({"a": "x"}, b"", "malformed header entry for tensor 'a'"),
    ({"a": {"dtype": "F32", "shape": None, "data_offsets": [0, 4]}}, b"\0" * 4, "malformed header entry"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "spans 4 bytes, but F32 [2] needs 8"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 20, "16 unexpected bytes after"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, b"\0" * 8, "overlapping or non-contiguous"),
    ({"__metadata__": {"format": 5}}, b"", "malformed __metadata__"),
])
def test_malformed_shard_header(broken, meta, data, msg):
    shard = json.loads((broken / INDEX).read_text())["weight_map"]["embed.weight"]
    _write_header(broken / shard, meta, data)
    assert msg in _load_error(broken)


@pytest.mark.parametrize("weight_map, msg", [
    ([], "'weight_map' must map tensor names to shard file names"),
    ({"embed.weight": 5}, "'weight_map' must map tensor names to shard file names"),
    ({}, "'weight_map' lists no tensors"),
])
def test_malformed_index(broken, weight_map, msg):
    (broken / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    assert msg in _load_error(broken)


def test_tensor_in_two_shards(broken):
    (broken / INDEX).unlink()
    save_file({"norm.weight": torch.ones(256, dtype=torch.bfloat16)}, str(broken / "zz-extra.safetensors"))
    assert "tensor 'norm.weight' is stored in both" in _load_error(broken)


def test_tokenizer_config_errors_are_named(broken):
    from engine.tokenizer import TokenizerError
    for text, msg in [('{"bos_token": 5}', "'bos_token' must be a string"), ("[]", "expected a JSON object"),
                      ("garbage", "tokenizer_config.json: invalid JSON")]:
        (broken / "tokenizer_config.json").write_text(text)
        with pytest.raises(TokenizerError, match=msg):
            Tokenizer(broken)


def test_reduced_layer_run_reads_the_first_layers_only(tiny_ckpt):
    """``custom_params.num_hidden_layers`` 4 (upstream's reduced-layer runs): the first four
    backbone layers (SWA, SWA, CSA, HCA) and the MTP layer; layer 3's output streams are the full
    model's, bit for bit, and nothing past layer 3 is read."""
    ckpt = tiny_ckpt("flash", 1)
    full = load_model(ckpt, progress=False)
    cut = load_model(ckpt, progress=False, mtp=True, num_layers=4, max_position_embeddings=4096)
    a = cut.args
    assert (a.num_hidden_layers, a.compress_ratios, a.max_position_embeddings) == (4, (0, 0, 4, 128, 0), 4096)
    assert len(cut.layers) == 4 and len(cut.mtp) == 1 and a.num_hash_layers == 3
    seen = []
    full.layers[3].register_forward_hook(lambda mod, inp, out: seen.append(out))
    tokens = torch.randint(0, a.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    _, streams = cut.forward_batch(tokens, [cut.new_state()], [150], streams=True)
    full.forward(tokens, full.new_state())
    assert torch.equal(streams, seen[0])
    with pytest.raises(ConfigError, match=r"custom_params\.num_hidden_layers: must be 1\.\.6"):
        load_model(ckpt, progress=False, num_layers=7)
