"""Paged state pools: sizing, exact block accounting, and bit-equality with the contiguous state."""
from __future__ import annotations

import pytest
import torch

from engine.core.block_manager import CacheConfig, CacheFullError, Geometry, plan_cache
from engine.core.kv_cache import LocalCache
from engine.checkpoint.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False)


def test_geometry_and_block_needs(model):
    g = Geometry.of(model.args, 16)
    assert g.ring_len == 128 and g.blocks_needed("win", 0) == 8
    need = [g.blocks_needed("c4", n) for n in (3, 4, 64, 67, 68)]          # floor(L/4) entries, 16 per block
    assert need == [0, 1, 1, 1, 2]
    assert [g.blocks_needed("c128", n) for n in (127, 128, 128 * 16, 128 * 17)] == [0, 1, 1, 2]
    # MTP leaves room: a longer ring and an extra ratio group in the compressor state
    g3 = Geometry.of(model.args, 16, next_n=3)
    assert g3.ring_len == 144 and g3.state_rows == {4: 12, 128: 256}
    assert Geometry.of(model.args, 128).state_rows == {4: 8, 128: 128}      # NPU sfa_kv_state sizes (§4)


def test_plan_cache_uses_the_budget(model):
    a = model.args
    cfg = plan_cache(a, torch.bfloat16, 128, 8, 64 << 20)
    g = Geometry.of(a, 128)
    used = 8 * (g.bytes_per_block("win", 2) + g.state_bytes()) + sum(
        cfg.num_blocks[p] * g.bytes_per_block(p, 2) for p in ("c4", "c128"))
    assert 0.9 * (64 << 20) < used <= 64 << 20 and cfg.num_blocks["c128"] >= 8
    # the CSA pool holds ~32x the entries of the HCA pool's blocks: both fill at the same length
    assert abs((cfg.num_blocks["c4"] - 8) / 32 - (cfg.num_blocks["c128"] - 8)) <= 1
    with pytest.raises(ValueError, match="below the minimum"):
        plan_cache(a, torch.bfloat16, 128, 1000, 1 << 20)


def test_allocate_free_exact_counts_and_two_phase(model):
    c = LocalCache(model.args, CacheConfig(16, 3, {"c4": 10, "c128": 2}), torch.float32)
    total = c.num_free()
    assert total == {"win": 24, "state": 3, "c4": 10, "c128": 2}
    c.allocate("a", 300)                          # 75 entries -> 5 CSA blocks, 2 HCA entries -> 1 block
    assert c.num_free() == {"win": 16, "state": 2, "c4": 5, "c128": 1}
    c.allocate("a", 330)                          # grows by 1 CSA block only
    assert c.num_free()["c4"] == 4 and len(c.seqs["a"].tables["c4"]) == 6
    assert not c.can_allocate("b", 300)
    with pytest.raises(CacheFullError, match="c4 needs 5 blocks, 4 free"):
        c.allocate("b", 300)
    assert c.num_free() == {"win": 16, "state": 2, "c4": 4, "c128": 1}   # refused: nothing taken
    c.free("a")
    c.free("a")                                   # idempotent
    assert c.num_free() == total and not c.seqs
    with pytest.raises(RuntimeError, match="freed twice"):
        c.pools["c4"].give([0])


def test_paged_state_is_bit_identical_to_contiguous(model):
    """A request run in chunks over the pools, beside another request, gives the logits of the
    contiguous single-sequence state; a reused state slot starts clean."""
    torch.manual_seed(0)
    V = model.args.vocab_size
    a, b = torch.randint(0, V, (700,)), torch.randint(0, V, (300,))
    st = model.new_state()
    ref = [model.logits(model(a[:600], st))] + [model.logits(model(a[i:i + 1], st)) for i in range(600, 660)]
    ref = torch.cat(ref)
    c = LocalCache(model.args, CacheConfig(16, 2, {"c4": 64, "c128": 8}), torch.float32)
    for attempt in range(2):                      # second pass reuses the freed slots and blocks
        c.allocate("b", 300)
        c.allocate("a", 700)
        outs, na, nb = [], 0, 0
        for ca, cb in [(100, 37), (250, 200), (250, 63)]:
            h = model.forward_batch(torch.cat([b[nb:nb + cb], a[na:na + ca]]),
                                    [c.sequence_state("b", nb), c.sequence_state("a", na)], [cb, ca])
            outs.append(model.logits(h[cb:]))
            na, nb = na + ca, nb + cb
        for i in range(600, 660):                  # decode crosses 640 (an HCA entry)
            outs.append(model.logits(model.forward_batch(a[i:i + 1], [c.sequence_state("a", i)], [1])))
        assert torch.equal(torch.cat(outs), ref), attempt
        c.free("a")
        c.free("b")


def test_scheduler_and_block_manager_load_no_torch():
    """The accounting the scheduler and attention DP need imports no torch (the tensors live in
    engine.core.kv_cache)."""
    import subprocess
    import sys
    code = ("import sys, engine.core.scheduler, engine.core.block_manager; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('engine'))")
    subprocess.run([sys.executable, "-c", code], check=True)
