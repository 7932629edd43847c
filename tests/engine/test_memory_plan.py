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
