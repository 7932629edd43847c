"""The loader's cheap value checks on stored tensors (engine/checkpoint/values.py), each a one-line
CheckpointError naming the tensor; and an e8m0 NaN scale in a real shard refused at load."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.int8_int4 import scale_to_u64
from engine.checkpoint.loader import load_model
from engine.checkpoint.shards import CheckpointError
from engine.checkpoint.values import check_values
from engine.config import ModelArgs


@pytest.fixture(scope="module")
def args(tiny_ckpt):
    return ModelArgs.from_json(Path(tiny_ckpt("flash", 1)))


def _refused(name, t, args, words):
    with pytest.raises(CheckpointError) as e:
        check_values(name, t, args)
    assert f"tensor '{name}'" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_nan_scales_of_every_e8m0_kind_and_int4_scales(args):
    mx = torch.full((4, 2), 127, dtype=torch.uint8)
    check_values("layers.2.attn.wq_b.scale", mx, args)
    mx[1, 1] = 255
    _refused("layers.2.attn.wq_b.scale", mx, args, "NaN scales (e8m0 code 255)")
    _refused("layers.2.attn.wq_a.scale", mx.view(torch.float8_e8m0fnu), args, "NaN scales")
    s = scale_to_u64(torch.full((4, 1), 0.01))
    check_values("layers.3.ffn.experts.1.w1.scale", s, args)
    hi = s.clone()
    hi.view(torch.int64)[2, 0] |= 1 << 40
    _refused("layers.3.ffn.experts.1.w1.scale", hi, args, "non-zero high 32 bits")
    _refused("layers.3.ffn.experts.1.w1.scale", scale_to_u64(torch.tensor([[0.01], [float("nan")]])), args,
             "NaN or inf")
    _refused("layers.0.attn_norm.weight", torch.tensor([1.0, float("inf")], dtype=torch.bfloat16), args, "NaN or inf")
    check_values("layers.2.attn.wq_b.weight", torch.full((4, 4), 0x7F, dtype=torch.uint8), args)   # weight bytes: not scanned


def test_a_nan_e8m0_scale_in_a_shard_is_refused_at_load(tiny_ckpt, tmp_path):
    src, dst = Path(tiny_ckpt("flash", 1)), tmp_path / "ckpt"
    dst.mkdir()
    for p in src.iterdir():
        (os.symlink if p.suffix == ".safetensors" else shutil.copyfile)(p, dst / p.name)
    name = "layers.3.ffn.experts.5.w2.scale"
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    sd = load_file(str(dst / shard))
    sd[name].view(torch.uint8)[3, 1] = 255
    (dst / shard).unlink()
    save_file(sd, str(dst / shard))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' holds NaN scales"):
        load_model(dst, progress=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_on_the_bits(dtype):
    from engine.checkpoint.values import all_finite
    x = torch.randn(1000).to(dtype)
    x[7] = torch.finfo(dtype).max
    x[8] = -torch.finfo(dtype).max
    x[9] = torch.finfo(dtype).tiny / 4                                  # a subnormal
    assert all_finite(x) and all_finite(x[:0])
    for bad in (float("nan"), float("inf"), float("-inf"), -float("nan")):
        y = x.clone()
        y[500] = bad
        assert not all_finite(y) and not all_finite(y[400:600])
