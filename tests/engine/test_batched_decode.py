"""Decode rows batched across requests (engine.core.batched_decode) give every row the bits of
the per-sequence path: hidden states, and the ring / compressor state / entry pools they leave."""
from __future__ import annotations

import pytest
import torch

from engine.core.block_manager import CacheConfig
from engine.core.kv_cache import PagedCache
from engine.checkpoint.loader import load_model

# prompt lengths: a decode at position p = length. Covers p < window, the first CSA entry (p = 3),
# CSA windows closing (p % 4 == 3) and not, the first HCA entry (p = 127), HCA closing at 255,
# and different entry counts in one batch (separate softmax groups)
LENGTHS = [0, 3, 5, 126, 127, 130, 255, 259, 400, 511]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False)


def _prefill(model, cache, prompts):
    for i, p in enumerate(prompts):
        cache.allocate(i, len(p) + 8)
        if len(p):
            model.forward_batch(p, [cache.sequence_state(i, 0)], [len(p)])


def test_batched_rows_equal_one_at_a_time(model):
    torch.manual_seed(0)
    V = model.args.vocab_size
    prompts = [torch.randint(0, V, (n,)) for n in LENGTHS]
    cfg = CacheConfig(16, len(LENGTHS), {"c4": 120, "c128": 16})
    together, alone = PagedCache(model.args, cfg, torch.float32), PagedCache(model.args, cfg, torch.float32)
    _prefill(model, together, prompts)
    _prefill(model, alone, prompts)
    assert model._batch_decode
    for step in range(6):                               # crosses more window closings
        toks = torch.randint(0, V, (len(LENGTHS),))
        pos = [n + step for n in LENGTHS]
        h = model.forward_batch(toks, [together.sequence_state(i, p) for i, p in enumerate(pos)], [1] * len(pos))
        model._batch_decode = False                     # the per-sequence path, one request per call
        try:
            ref = torch.cat([model.forward_batch(toks[i:i + 1], [alone.sequence_state(i, p)], [1])
                             for i, p in enumerate(pos)])
        finally:
            model._batch_decode = True
        assert torch.equal(h, ref), step
    for a, b in zip(together.tensors(), alone.tensors()):
        assert torch.equal(a, b)


def test_mixed_batch_prefill_and_decode_rows(model):
    """A prefill chunk packed with decode rows: each row equals its own call (the chunk runs the
    per-sequence path, the decode rows the batched one)."""
    torch.manual_seed(1)
    V = model.args.vocab_size
    cfg = CacheConfig(16, 3, {"c4": 64, "c128": 8})
    c1, c2 = PagedCache(model.args, cfg, torch.float32), PagedCache(model.args, cfg, torch.float32)
    prompts = [torch.randint(0, V, (n,)) for n in (131, 300)]
    for c in (c1, c2):
        _prefill(model, c, prompts)
        c.allocate(2, 200)
    chunk, toks = torch.randint(0, V, (90,)), torch.randint(0, V, (2,))
    h = model.forward_batch(torch.cat([toks[:1], chunk, toks[1:]]),
                            [c1.sequence_state(0, 131), c1.sequence_state(2, 0), c1.sequence_state(1, 300)],
                            [1, 90, 1])
    ref = torch.cat([model.forward_batch(toks[:1], [c2.sequence_state(0, 131)], [1]),
                     model.forward_batch(chunk, [c2.sequence_state(2, 0)], [90]),
                     model.forward_batch(toks[1:], [c2.sequence_state(1, 300)], [1])])
    assert torch.equal(h, ref)


def test_a_row_past_its_blocks_fails_instead_of_writing_elsewhere(model):
    """A decode row whose table lacks the block its new entry goes to (an allocation bug in the
    caller) raises, as the per-sequence path does; another request's entries stay untouched."""
    V = model.args.vocab_size
    c = PagedCache(model.args, CacheConfig(16, 2, {"c4": 64, "c128": 8}), torch.float32)
    _prefill(model, c, [torch.randint(0, V, (600,)), torch.randint(0, V, (127,))])
    c.seqs[1].tables["c128"] = []                       # position 127 closes HCA entry 0: no block for it
    before = [t.parts[0].clone() for t in c.cmp_kv.values()]
    with pytest.raises((IndexError, RuntimeError)):
        model.forward_batch(torch.tensor([5, 6]), [c.sequence_state(0, 600), c.sequence_state(1, 127)], [1, 1])
    hca = [l for l in c.cmp_kv if model.args.compress_ratios[l] == 128]
    assert all(torch.equal(c.cmp_kv[l].parts[0], before[list(c.cmp_kv).index(l)]) for l in hca)


def test_the_model_imports_no_serving_code():
    """engine/model is the network only: batched paged decode reaches it as the states' per-step
    context (``decode_context``), not as an import of engine.core or engine.parallel."""
    import subprocess
    import sys
    code = ("import sys, engine.model.transformer, engine.model.state; "
            "bad = sorted(m for m in sys.modules if m.startswith(('engine.core', 'engine.parallel'))); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
