"""Prefix caching on an MTP engine (next_n > 0): a hit at boundary B gives the state a full
prefill gives, MTP window rings included, and the same drafts, even where the hitting request's
token at B differs from the one the entry's maker had (the MTP row of B - 1 pairs with it, and is
redone from the entry's carried streams). Output tokens cannot show a wrong MTP row (drafts only
change how many tokens a step keeps), so the exported rings and the drafts are compared."""
from __future__ import annotations

import random

import pytest
import torch

from engine.checkpoint.loader import load_model
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    """MTP layer drafts what the trunk predicts (acceptance well above 0)."""
    return load_model(tiny_ckpt("flash", 1, mtp_agree=True), dtype=torch.float32, progress=False, mtp=True)


@pytest.fixture(scope="module")
def random_mtp(tiny_ckpt):
    """A random MTP layer: its input takes the trunk's streams and its attention reads its ring
    (the agreeing one's does neither), so a wrong ring row or carried row changes what it drafts."""
    return load_model(tiny_ckpt("flash", 1), dtype=torch.float32, progress=False, mtp=True)


def _engine(model, **kw):
    return LLMEngine.build(model, **{**dict(block_size=16, batch_size=4, max_prefill_tokens=96, max_model_len=1024,
                                            num_kv_blocks=300, num_reserved_decode_tokens=0, next_n=1), **kw})


def _prefill(eng, rid: str, prompt: list[int]):
    """Prefill role: the request's first token, drafts and exported state (MTP rings included)."""
    eng.add_request(rid, prompt, SamplingParams(max_new_tokens=1, temperature=0), hold_state=True)
    while eng.has_unfinished():
        eng.step()
    seq, tensors = eng.pd.export_state(rid)
    out = (seq.num_cached, list(seq.output_ids), list(seq.draft_ids), tensors)
    eng.pd.release(rid)
    return out


def test_a_hit_exports_the_state_and_drafts_of_a_full_prefill(random_mtp):
    """Three prompts share 256 tokens and part right at 256: the first leaves an entry there, the
    others hit it with their own token at 256 (the MTP ring's row 255 is exported: the prompts
    end within a window of it); then a follow-up turn of the third hits it too. Every request's
    exported state (trunk and MTP rings) and drafts equal an uncached engine's."""
    rng = random.Random(11)
    V = random_mtp.args.vocab_size
    shared = [rng.randrange(V) for _ in range(256)]
    prompts = [shared + [rng.randrange(V) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    prompts.append(prompts[2] + [rng.randrange(V) for _ in range(40)])       # a follow-up of the third
    assert len({p[256] for p in prompts[:3]}) == 3
    ref, eng = _engine(random_mtp), _engine(random_mtp, prefix_slots=4)
    for i, p in enumerate(prompts):
        n_ref, ids_ref, drafts_ref, want = _prefill(ref, f"w{i}", p)
        n, ids, drafts, got = _prefill(eng, f"g{i}", p)
        assert n_ref == 0 and n == [0, 256, 256, 256][i]
        assert (ids, drafts) == (ids_ref, drafts_ref) and len(drafts) == 1
        assert got.keys() == want.keys() and any(k.startswith("mtp.") for k in got)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
    eng.cache.reset_prefix_cache()
    assert eng.num_free_blocks() == eng.num_total_blocks()


@pytest.mark.parametrize("seed", [None, 5])
def test_multi_turn_with_drafts_gives_the_uncached_tokens_and_acceptance(model, seed):
    """Two conversations x 3 turns, greedy and seeded, next_n 1: tokens, logprobs and the drafts
    accepted per step equal the uncached engine's."""
    rng = random.Random(3)
    V = model.args.vocab_size
    sys_p = [rng.randrange(V) for _ in range(200)]
    prompts = [sys_p + [rng.randrange(V) for _ in range(rng.randint(1, 100))] for _ in range(2)]
    params = SamplingParams(max_new_tokens=10, temperature=0 if seed is None else 0.8, seed=seed, logprobs=1)
    ref, eng = _engine(model), _engine(model, prefix_slots=3)
    for turn in range(3):
        want, got = ref.generate(prompts, params), eng.generate(prompts, params)
        for g, w in zip(got, want):
            assert g.output_ids == w.output_ids
            assert [x.logprob for x in g.logprobs] == [x.logprob for x in w.logprobs]
        if turn:
            assert all(g.num_cached > 0 for g in got)
        prompts = [p + g.output_ids + [rng.randrange(V) for _ in range(30)] for p, g in zip(prompts, got)]
    assert eng.spec.stats == ref.spec.stats and (seed is not None or eng.spec.stats.num_accepted_tokens > 0)
