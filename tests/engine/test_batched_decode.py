"""The eager batched decode path (the decode step, ``StaticDecoder.run``: the captured step's code
with exact per-row ops) gives every row the bits of the per-sequence path
(``Transformer.forward_batch``): hidden states, MTP output streams, and the decode state each
request is left with (``state_tensors``: window ring, entries, indexer keys, compressor
remainders). Outside that live state the step writes only scratch: the trash rows of open
windows and the remainder row of a token that closes its window."""
from __future__ import annotations

import pytest
import torch

from engine.core.block_manager import CacheConfig
from engine.core.kv_cache import LocalCache
from engine.core.model_runner import ModelRunner
from engine.core.pd_state import mtp_state_tensors, state_tensors
from engine.core.static_decode import StaticDecoder
from engine.core.step import ScheduledRow
from engine.checkpoint.loader import load_model

# prompt lengths: a decode at position p = length. Covers p < window, the first CSA entry (p = 3),
# CSA windows closing (p % 4 == 3) and not, the first HCA entry (p = 127), HCA closing at 255,
# and different entry counts in one batch (separate softmax groups)
LENGTHS = [0, 3, 5, 126, 127, 130, 255, 259, 400, 511]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False, mtp=True)


def _prefill(model, cache, prompts, room):
    for i, p in enumerate(prompts):
        cache.allocate(i, len(p) + room)
        if len(p):
            model.forward_batch(p, [cache.sequence_state(i, 0)], [len(p)])


def _live_state_equal(a: LocalCache, b: LocalCache, lengths: list[int], mtp: bool = False) -> None:
    for i, n in enumerate(lengths):
        for get in (state_tensors, mtp_state_tensors) if mtp else (state_tensors,):
            sa, sb = get(a.paged, a.seqs[i], n), get(b.paged, b.seqs[i], n)
            assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), (i, n)


@pytest.mark.parametrize("span", [1, 3])
def test_batched_rows_equal_one_at_a_time(model, span):
    """Ten requests' decode rows through the decode step at once, one token each (span 1) or MTP
    verify spans of 1..3 tokens, for six steps: each row's hidden state (and output streams)
    equals its own per-sequence call, and so does every request's state afterwards."""
    torch.manual_seed(0)
    V = model.args.vocab_size
    prompts = [torch.randint(0, V, (n,)) for n in LENGTHS]
    cfg = CacheConfig(16, len(LENGTHS), {"c4": 120, "c128": 16}, next_n=span - 1)
    together, alone = LocalCache(model.args, cfg, torch.float32), LocalCache(model.args, cfg, torch.float32)
    _prefill(model, together, prompts, 8 * span)
    _prefill(model, alone, prompts, 8 * span)
    step = StaticDecoder(model, together.paged, 1024, span=span)
    pos = list(LENGTHS)
    for k in range(6):                                  # crosses more window closings
        ns = [1 + (i + k) % span for i in range(len(LENGTHS))]
        toks = [torch.randint(0, V, (n,)) for n in ns]
        rows = [(t.tolist(), p, together.seqs[i].state_slot, together.seqs[i].tables)
                for i, (t, p) in enumerate(zip(toks, pos))]
        out = step.run(rows)
        ref = [model.forward_batch(t, [alone.sequence_state(i, p)], [len(t)], streams=span > 1)
               for i, (t, p) in enumerate(zip(toks, pos))]
        if span == 1:
            assert torch.equal(out, torch.cat(ref)), k
        else:
            assert torch.equal(out[0], torch.cat([r[0] for r in ref])), k
            assert torch.equal(out[1], torch.cat([r[1] for r in ref])), k
        pos = [p + n for p, n in zip(pos, ns)]
    _live_state_equal(together, alone, pos)


def test_the_mtp_layer_rows_equal_its_per_sequence_path(model):
    """The MTP layer's short spans through the decode step (``StaticDecoder.mtp``) equal
    ``Transformer.forward_mtp`` row for row, and leave the same MTP ring rows."""
    torch.manual_seed(2)
    a, V = model.args, model.args.vocab_size
    lengths = [0, 3, 5, 126, 127, 130, 255]
    cfg = CacheConfig(16, len(lengths), {"c4": 120, "c128": 16}, next_n=2)
    together, alone = LocalCache(a, cfg, torch.float32), LocalCache(a, cfg, torch.float32)
    for c in (together, alone):
        for i, n in enumerate(lengths):
            c.allocate(i, n + 40)
    step = StaticDecoder(model, together.paged, 1024, span=3)
    pos = list(lengths)
    for k in range(5):
        ns = [1 + (i + k) % 3 for i in range(len(lengths))]
        X_in = torch.randn(sum(ns), a.hc_mult, a.hidden_size)
        toks = torch.randint(0, V, (sum(ns),))
        X, hid = step.mtp(X_in, toks, [(p, n, together.seqs[i].tables["win"]) for i, (p, n) in enumerate(zip(pos, ns))])
        X2, hid2 = model.forward_mtp(X_in, toks, [alone.mtp_state(i, p) for i, p in enumerate(pos)], ns)
        assert torch.equal(X, X2) and torch.equal(hid, hid2), k
        pos = [p + n for p, n in zip(pos, ns)]
    for i, p in enumerate(pos):
        sa, sb = mtp_state_tensors(together.paged, together.seqs[i], p), mtp_state_tensors(alone.paged, alone.seqs[i], p)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_mixed_batch_prefill_and_decode_rows(model):
    """A prefill chunk packed with decode rows in one runner step: each row equals its own call
    (the chunk runs the per-sequence path, the decode rows the decode step)."""
    torch.manual_seed(1)
    V = model.args.vocab_size
    cfg = CacheConfig(16, 3, {"c4": 64, "c128": 8})
    c1, c2 = LocalCache(model.args, cfg, torch.float32), LocalCache(model.args, cfg, torch.float32)
    prompts = [torch.randint(0, V, (n,)) for n in (131, 300)]
    for c in (c1, c2):
        _prefill(model, c, prompts, 8)
        c.allocate(2, 200)
    chunk, toks = torch.randint(0, V, (90,)), torch.randint(0, V, (2,))
    runner = ModelRunner(model, c1.paged, 1024, 3)

    def row(i, start, ids):
        return ScheduledRow(f"r{i}", start, ids, state_slot=c1.seqs[i].state_slot, block_tables=c1.seqs[i].tables)
    h = runner.run_rows([row(0, 131, toks[:1].tolist()), row(2, 0, chunk.tolist()), row(1, 300, toks[1:].tolist())])
    ref = torch.cat([model.forward_batch(toks[:1], [c2.sequence_state(0, 131)], [1]),
                     model.forward_batch(chunk, [c2.sequence_state(2, 0)], [90]),
                     model.forward_batch(toks[1:], [c2.sequence_state(1, 300)], [1])])
    assert torch.equal(h, ref)


def test_a_row_past_its_blocks_fails_instead_of_writing_elsewhere(model):
    """A decode row whose table lacks the block its new entry goes to (an allocation bug in the
    caller) raises, as the per-sequence path does; another request's entries stay untouched."""
    V = model.args.vocab_size
    c = LocalCache(model.args, CacheConfig(16, 2, {"c4": 64, "c128": 8}), torch.float32)
    _prefill(model, c, [torch.randint(0, V, (600,)), torch.randint(0, V, (127,))], 8)
    c.seqs[1].tables["c128"] = []                       # position 127 closes HCA entry 0: no block for it
    before = [t.parts[0][:-1].clone() for t in c.paged.cmp_kv.values()]      # all but the trash row
    step = StaticDecoder(model, c.paged, 1024)
    with pytest.raises((IndexError, RuntimeError)):
        step.run([([5], 600, c.seqs[0].state_slot, c.seqs[0].tables), ([6], 127, c.seqs[1].state_slot, c.seqs[1].tables)])
    hca = [l for l in c.paged.cmp_kv if model.args.compress_ratios[l] == 128]
    assert all(torch.equal(c.paged.cmp_kv[l].parts[0][:-1], before[list(c.paged.cmp_kv).index(l)]) for l in hca)


def test_the_model_imports_no_serving_code():
    """engine/model is the network only: the serving engine's batched decode step reaches it as
    ``engine.core.static_decode`` calling the model's modules, not as an import of engine.core or
    engine.parallel."""
    import subprocess
    import sys
    code = ("import sys, engine.model.transformer, engine.model.state; "
            "bad = sorted(m for m in sys.modules if m.startswith(('engine.core', 'engine.parallel'))); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
