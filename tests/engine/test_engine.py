"""Engine: batch invariance, no leaks, abort anywhere, preemption by recompute, bad requests."""
from __future__ import annotations

import random

import pytest

from engine.core.block_manager import CacheConfig
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.request import FinishReason
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.checkpoint.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False)


def _engine(model, **kw):
    base = dict(block_size=16, batch_size=4, max_prefill_tokens=256, max_model_len=2048, num_kv_blocks=40,
                num_reserved_decode_tokens=0)
    return LLMEngine.build(model, **{**base, **kw})


def _requests(model, n, max_len, seed):
    rng = random.Random(seed)
    V = model.args.vocab_size
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, max_len))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=8, temperature=0) if i % 2 == 0 else
              SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=64, min_p=0.01,
                             presence_penalty=0.3, repetition_penalty=1.1, seed=1000 + i, logprobs=3)
              for i in range(n)]
    return prompts, params


def test_batch_invariance_greedy_and_seeded(model):
    """16 requests of 1-2000 tokens: run together (chunked at a 1,024-token budget beside decode
    rows, queueing, preemption) they produce, token for token and logprob for logprob, what each produces alone."""
    prompts, params = _requests(model, 16, 2000, seed=0)
    alone_eng = _engine(model, batch_size=1, max_prefill_tokens=4096)
    alone = [alone_eng.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert alone_eng.num_free_blocks() == alone_eng.num_total_blocks()
    expect = [s.output_ids for s in alone]
    assert all(len(e) == 8 for e in expect)
    # (block_size, batch_size, max_prefill_tokens, CSA blocks): pools tight enough that each run
    # queues and preempts (the schedule is deterministic: it depends on lengths, not on time)
    for block, batch_size, max_prefill, c4 in [(4, 16, 1024, 238)]:
        eng = LLMEngine.of(model, CacheConfig(block, batch_size, {"c4": c4, "c128": 64}),
                        SchedulerLimits(batch_size, max_prefill, 2048, 0), (model.args.eos_token_id,))
        got = eng.generate(prompts, params)
        assert [s.output_ids for s in got] == expect, (block, batch_size, max_prefill)
        for s, a in zip(got, alone):
            if s.params.logprobs is not None:
                assert [x.logprob for x in s.logprobs] == [x.logprob for x in a.logprobs]
                assert [x.top_logprobs for x in s.logprobs] == [x.top_logprobs for x in a.logprobs]
        assert eng.num_free_blocks() == eng.num_total_blocks()
        assert eng.scheduler.num_preemptions > 0 and len(eng.scheduler.running) == 0
        assert any(s.num_preemptions for s in got)


def test_preempted_request_recomputes_to_the_same_tokens(model):
    """Two requests fill the CSA pool; the first one's growth preempts the second, which is
    re-queued (not failed) and later recomputes prompt + output to the same tokens."""
    prompts, _ = _requests(model, 2, 60, seed=3)
    prompts = [p + [7] * (60 - len(p)) for p in prompts]
    params = [SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True)]
    eng = LLMEngine.of(model, CacheConfig(4, 4, {"c4": 8, "c128": 2}), SchedulerLimits(4, 512, 120, 0))
    got = eng.generate(prompts, params)
    assert [s.num_preemptions for s in got] == [0, 1]
    assert all(s.finish_reason is FinishReason.LENGTH and len(s.output_ids) == 20 for s in got)
    for p, q, s in zip(prompts, params, got):
        assert _engine(model).generate([p], q)[0].output_ids == s.output_ids
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_no_leaks_after_120_requests_with_aborts_and_preemption(model):
    rng = random.Random(7)
    V = model.args.vocab_size
    eng = _engine(model, batch_size=12, max_prefill_tokens=96, max_model_len=512, num_kv_blocks=9)
    total = eng.num_total_blocks()
    live, finished, aborted = set(), {}, set()
    for i in range(120):
        rid = f"r{i}"
        eng.add_request(rid, [rng.randrange(V) for _ in range(rng.randint(1, 200))],
                        SamplingParams(max_new_tokens=rng.randint(1, 6), temperature=rng.choice([0, 1.0]),
                                       ignore_eos=True))
        live.add(rid)
        if rng.random() < 0.6:
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
                    live.discard(out.request_id)
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            assert eng.abort(victim)
            aborted.add(victim)
            live.discard(victim)
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {f"r{i}" for i in range(120)}
    assert {r for r, o in finished.items() if o.finish_reason is FinishReason.ABORT} == aborted
    assert all(o.finish_reason is FinishReason.LENGTH for r, o in finished.items() if r not in aborted)
    assert eng.scheduler.num_preemptions > 0
    assert eng.num_free_blocks() == total
    assert not eng.seqs and not eng.cache.seqs


def test_abort_frees_at_once_queued_prefilling_decoding(model):
    eng = _engine(model, batch_size=2, max_prefill_tokens=64)
    total = eng.num_total_blocks()
    long_prompt = list(range(10, 310))
    for rid in ("decoding", "prefilling", "queued"):
        eng.add_request(rid, long_prompt if rid != "decoding" else [5, 6, 7], SamplingParams(max_new_tokens=50))
    eng.step()
    eng.step()
    seqs = eng.seqs
    assert seqs["decoding"].output_ids and seqs["prefilling"].num_computed < 300 and seqs["queued"].num_computed == 0
    for rid in ("queued", "prefilling", "decoding"):
        before = eng.num_free_blocks()
        held = eng.cache.seqs.get(rid)
        assert eng.abort(rid)
        after = eng.num_free_blocks()
        if held is not None:
            assert after["state"] == before["state"] + 1
            assert all(after[p] == before[p] + len(b) for p, b in held.tables.items())
        else:
            assert after == before
        assert not eng.abort(rid)                     # second abort: nothing left
    outs = eng.step()
    assert {o.request_id for o in outs} == {"queued", "prefilling", "decoding"}
    assert all(o.finished and o.finish_reason is FinishReason.ABORT for o in outs)
    assert eng.num_free_blocks() == total and not eng.has_unfinished()


def test_stop_conditions(model):
    eng = _engine(model)
    prompt = [11, 12, 13, 14]
    free_run = eng.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))[0]
    toks = free_run.output_ids
    assert free_run.finish_reason is FinishReason.LENGTH and len(toks) == 6
    # a stop token id ends the sample right after it (included in output_ids)
    s = eng.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[toks[2]]))[0]
    assert s.output_ids == toks[:toks.index(toks[2]) + 1] and s.finish_reason is FinishReason.STOP
    # EOS = the config's eos id; ignore_eos keeps going
    eos_eng = LLMEngine.build(model, block_size=16, batch_size=2, max_model_len=256, num_kv_blocks=8,
                              eos_ids=(toks[1],))
    s = eos_eng.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert s.output_ids == toks[:toks.index(toks[1]) + 1] and s.finish_reason is FinishReason.STOP
    s = eos_eng.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))[0]
    assert s.output_ids == toks
    # the context limit ends a sample with "length"
    short = LLMEngine.build(model, block_size=16, batch_size=2, max_model_len=6, num_kv_blocks=8)
    s = short.generate([prompt], SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))[0]
    assert s.output_ids == toks[:2] and s.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt"),
    ([1] * 2048, SamplingParams(), "prompt"),
    ([1, -3], SamplingParams(), "prompt"),
    ([1, 10**9], SamplingParams(), "prompt"),
])
def test_bad_requests_name_the_field(model, prompt, params, field):
    eng = _engine(model)
    with pytest.raises(RequestError, match=f"^{field}:"):
        eng.add_request("x", prompt, params)
    assert eng.num_free_blocks() == eng.num_total_blocks() and not eng.seqs
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_new_tokens=2))    # the next valid one is served
    assert eng.generate([[4, 5]], SamplingParams(max_new_tokens=2))[0].output_ids


def test_duplicate_request_id_and_capacity_check(model):
    eng = _engine(model)
    eng.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(RequestError, match="^request_id:"):
        eng.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        _engine(model, max_model_len=100_000, num_kv_blocks=4)


def test_a_failing_step_fails_its_requests_and_frees_them(model, monkeypatch):
    eng = _engine(model)
    eng.add_request("a", [3, 4, 5], SamplingParams(max_new_tokens=4))
    calls = {"n": 0}
    real = model.logits

    def flaky(hidden):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(hidden)

    monkeypatch.setattr(model, "logits", flaky)
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ABORT)]
    assert not eng.has_unfinished() and eng.num_free_blocks() == eng.num_total_blocks()
    eng.add_request("b", [3, 4, 5], SamplingParams(max_new_tokens=2))       # the engine keeps serving
    while eng.has_unfinished():
        eng.step()
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_request_ids_and_generate_are_all_or_nothing(model):
    eng = _engine(model)
    eng.add_request("b", [1, 2], SamplingParams())
    assert eng.abort("b")
    with pytest.raises(RequestError, match="^request_id: 'b' is in use"):     # its abort output is pending
        eng.add_request("b", [1, 2], SamplingParams())
    eng.step()
    for bad in (None, "", ["x"]):
        with pytest.raises(RequestError, match="^request_id:"):
            eng.add_request(bad, [1, 2], SamplingParams())
    with pytest.raises(RequestError, match="^prompt: must be a list"):
        eng.add_request("c", "hello", SamplingParams())
    with pytest.raises(RequestError, match="^prompt: token ids must be Python ints"):
        eng.add_request("c", [1, 2.0], SamplingParams())
    with pytest.raises(RequestError, match="^prompt:"):
        eng.generate([[1, 2], []], SamplingParams())
    with pytest.raises(RequestError, match="^sampling_params:"):
        eng.generate([[1, 2], [3]], [SamplingParams()])
    assert not eng.has_unfinished() and eng.num_free_blocks() == eng.num_total_blocks()
    tiny_t = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=1e-38))[0].output_ids
    assert tiny_t == eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0))[0].output_ids
