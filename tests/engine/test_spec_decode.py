"""MTP speculative decoding (engine.core.spec_decode) on the random tiny model, where drafts are
almost always rejected: every output token equals next_n 0's (greedy and seeded, batched with
preemption, chunked), the state after rejected drafts is byte-identical to a run that never
drafted, the emitted tokens follow the target distribution, and nothing leaks."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine.checkpoint.loader import load_model
from engine.core.block_manager import CacheConfig
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.model_runner import ModelRunner
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.core.spec_decode import SpecStats, num_accepted
from bench.census_count import SyncCounter
from spec_util import assert_same_states, states_by_length


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False, mtp=True)


def _engine(model, next_n, **kw):
    base = dict(block_size=16, batch_size=4, max_prefill_tokens=256, max_model_len=1024, num_kv_blocks=60,
                num_reserved_decode_tokens=0, next_n=next_n)
    return LLMEngine.build(model, **{**base, **kw})


def _prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1000, 60000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_num_accepted_is_the_longest_matching_prefix():
    assert num_accepted([5, 6, 7, 8], [5, 6, 7]) == 3
    assert num_accepted([5, 9, 7, 8], [5, 6, 7]) == 1
    assert num_accepted([4, 6], [5]) == 0
    assert num_accepted([4], []) == 0
    st = SpecStats(num_accepted_tokens_per_pos=[0, 0, 0])
    st.record(3, 2)
    st.record(3, 0)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (2, 6, 2)
    assert st.num_accepted_tokens_per_pos == [1, 1, 0]
    assert st.acceptance_rate == pytest.approx(1 / 3) and st.mean_acceptance_length == 2.0


@pytest.mark.parametrize("next_n", [1, 3])
def test_greedy_and_seeded_tokens_equal_next_n_0(model, next_n):
    """Mixed greedy / seeded-sampling requests, chunked prefill (64-token budget), 4 at a time:
    token for token and logprob for logprob what next_n 0 gives; drafts were verified."""
    prompts = _prompts(4, 1, 150, seed=next_n)
    params = [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, repetition_penalty=1.1,
                             seed=100 + i, logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    want = _engine(model, 0, max_prefill_tokens=64).generate(prompts, params)
    eng = _engine(model, next_n, max_prefill_tokens=64)
    got = eng.generate(prompts, params)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    for g, w in zip(got, want):
        if g.params.logprobs is not None:
            assert [x.logprob for x in g.logprobs] == [x.logprob for x in w.logprobs]
            assert [x.top_logprobs for x in g.logprobs] == [x.top_logprobs for x in w.logprobs]
    st = eng.spec.stats
    assert st.num_drafts > 0 and st.num_draft_tokens <= next_n * st.num_drafts
    assert len(st.num_accepted_tokens_per_pos) == next_n
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_preemption_with_drafts_keeps_tokens(model):
    """Pools so tight that decodes preempt (and drafts are dropped when their room is short):
    the outputs still equal next_n 0's and every block comes back."""
    prompts = _prompts(4, 60, 100, seed=7)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want = _engine(model, 0).generate(prompts, params)
    eng = LLMEngine.of(model, CacheConfig(4, 4, {"c4": 22, "c128": 8}, next_n=3),
                       SchedulerLimits(4, 128, 300, 0), (model.args.eos_token_id,))
    got = eng.generate(prompts, params)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert eng.scheduler.num_preemptions > 0 and any(s.num_preemptions for s in got)
    assert eng.spec.stats.num_drafts > 0
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_a_draft_step_copies_its_drafts_to_the_host_once(model):
    """next_n 3: a draft step chains its 3 greedy drafts on the device and copies them to the host
    in one transfer, not one per draft: the draft code's host syncs are at one site, at most one
    per engine step."""
    eng = _engine(model, 3)
    for i, p in enumerate(_prompts(2, 20, 40, seed=5)):
        eng.add_request(f"r{i}", p, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))
    steps = 0
    with SyncCounter() as c:
        while eng.has_unfinished():
            eng.step()
            steps += 1
    sites = {site: n for (_, site), n in c.sites.items() if site.startswith("engine/core/mtp_runner.py")}
    assert len(sites) == 1 and 0 < sum(sites.values()) <= steps, (sites, steps)
    assert eng.spec.stats.num_draft_tokens > eng.spec.stats.num_drafts > 0        # several drafts per step


def test_state_after_rejected_drafts_is_byte_identical(model):
    """A request whose decode crosses CSA windows every step and an HCA window (position 128):
    after each verify step (drafts rejected, compressor remainders restored and replayed) its
    state equals, byte for byte, the state of a run without MTP at the same length."""
    prompt = _prompts(1, 118, 118, seed=3)[0]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    plain = states_by_length(_engine(model, 0), prompt, params)
    eng = _engine(model, 3)
    spec = states_by_length(eng, prompt, params)
    assert eng.spec.stats.num_draft_tokens > eng.spec.stats.num_accepted_tokens      # drafts were rejected
    assert_same_states(plain, spec, min_common=10, past=128)


def test_mtp_pools_only_with_next_n(model):
    e0, e3 = _engine(model, 0), _engine(model, 3)
    assert e0.runner.pools.mtp_win == [] and e0.spec is None
    p3 = e3.runner.pools
    assert len(p3.mtp_win) == 1 and p3.mtp_win[0].num_rows == p3.win[0].num_rows
    assert e3.cache.geometry.ring_len >= model.args.sliding_window + 3
    # the MTP layer is the model runner's to check (SpecDecoder is torch-free policy)
    with pytest.raises(ValueError, match="MTP layer"):
        ModelRunner(SimpleNamespace(mtp=torch.nn.ModuleList()), SimpleNamespace(config=SimpleNamespace(next_n=1)),
                    64, 1)


def test_abort_and_limits_with_drafts(model):
    """Abort mid-decode frees everything; max_new_tokens and the context limit cut the drafts so
    a verify step never emits past them; drafts handed to commit are checked."""
    eng = _engine(model, 3, max_model_len=64)
    p = SamplingParams(max_new_tokens=7, temperature=0.0, ignore_eos=True)
    eng.add_request("a", _prompts(1, 30, 30, 1)[0], p)
    eng.add_request("b", _prompts(1, 40, 40, 2)[0], SamplingParams(max_new_tokens=100, temperature=0.0,
                                                                   ignore_eos=True))
    eng.add_request("c", _prompts(1, 20, 20, 3)[0], p)
    done: dict[str, list[int]] = {}

    def step():
        for o in eng.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id + ".reason"] = o.finish_reason
    step()
    step()
    assert eng.seqs["a"].draft_ids and len(eng.seqs["a"].draft_ids) <= 3
    assert eng.abort("c")
    while eng.has_unfinished():
        step()
    assert len(done["a"]) == 7 and done["a.reason"] == "length"
    assert 40 + len(done["b"]) == 64 and done["b.reason"] == "length"        # the context limit
    assert done["c.reason"] == "abort"
    assert eng.num_free_blocks() == eng.num_total_blocks()
    eng.pd.reserve("d", [5, 6, 7], SamplingParams(max_new_tokens=4, seed=1))
    with pytest.raises(RequestError, match="draft_ids"):
        eng.pd.commit("d", 9, [1, 2, 3, 4])
    with pytest.raises(RequestError, match="draft_ids"):
        eng.pd.commit("d", 9, [-1])
    assert eng.pd.unreserve("d") and eng.num_free_blocks() == eng.num_total_blocks()


def test_emitted_tokens_follow_the_target_distribution(model):
    """Sampling with drafts (temperature 1, top_k 4): over 100 seeds the token the first verify
    step emits, grouped by the token before it, fits the target's top-4 distribution at that
    position (the raw logprobs a plain engine reports there): chi-square below the 0.1% quantile
    per group (3 degrees of freedom: 16.27)."""
    prompt = _prompts(1, 12, 12, seed=11)[0]
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True)
              for s in range(100)]
    eng = _engine(model, 1, batch_size=50, num_kv_blocks=200)
    got = eng.generate([prompt] * len(params), params)
    assert eng.spec.stats.num_drafts >= len(params)          # every second token went through a verify step
    groups: dict[int, list[int]] = {}
    for s in got:
        groups.setdefault(s.output_ids[0], []).append(s.output_ids[1])
    plain, tested = _engine(model, 0), 0
    for first, seconds in groups.items():
        if len(seconds) < 20:
            continue
        ref = plain.generate([prompt + [first]], SamplingParams(max_new_tokens=1, logprobs=4))[0]
        top = ref.logprobs[0].top_logprobs                        # raw logprobs at that position
        p = torch.softmax(torch.tensor([v for _, v in top], dtype=torch.float64), 0).tolist()
        counts = [seconds.count(t) for t, _ in top]
        assert sum(counts) == len(seconds)                        # never outside the top 4
        n = len(seconds)
        chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, p) if q > 0)
        assert chi2 < 16.27, (first, counts, p)
        tested += 1
    assert tested >= 1
