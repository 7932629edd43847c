"""Prefix caching (engine.core.prefix_cache): a request whose prefix state is cached gives, token
for token and logprob for logprob, what it gives computed from token 0, through chunked prefill,
preemption and eviction; blocks are reference counted and never leak."""
from __future__ import annotations

import random

import pytest

from engine.core.block_manager import BlockPool
from engine.core.llm_engine import LLMEngine
from engine.core.prefix_cache import CHUNK, PrefixCache, chain_hashes
from engine.core.sampling_params import SamplingParams
from engine.checkpoint.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False)


def _engine(model, **kw):
    base = dict(block_size=16, batch_size=4, max_prefill_tokens=256, max_model_len=2048, num_kv_blocks=400,
                num_reserved_decode_tokens=0)
    return LLMEngine.build(model, **{**base, **kw})


def _params(i: int, n: int = 6) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_new_tokens=n, temperature=0)
    return SamplingParams(max_new_tokens=n, temperature=0.9, top_p=0.95, seed=77 + i, logprobs=2)


def _same(got, want) -> None:
    assert got.output_ids == want.output_ids
    assert [x.logprob for x in got.logprobs] == [x.logprob for x in want.logprobs]
    assert [x.top_logprobs for x in got.logprobs] == [x.top_logprobs for x in want.logprobs]


def _conversations(model, n_conv: int, system: int, seed: int):
    rng = random.Random(seed)
    V = model.args.vocab_size
    sys_p = [rng.randrange(V) for _ in range(system)]
    return rng, [sys_p + [rng.randrange(V) for _ in range(rng.randint(1, 150))] for _ in range(n_conv)]


@pytest.mark.parametrize("block_size", [16, 64])
def test_multi_turn_conversations_reuse_their_prefixes_exactly(model, block_size):
    """3 conversations x 3 turns sharing a 300-token system prompt, greedy and seeded: each turn
    re-sends the conversation; with the cache on, the later turns start from cached boundary
    states (block 64: the CSA block at a 128 boundary is partly filled and copied) and chunk the
    rest at 96 tokens, and every output equals the uncached run's."""
    rng, prompts = _conversations(model, 3, 300, seed=block_size)
    V = model.args.vocab_size
    ref = _engine(model, block_size=block_size)
    eng = _engine(model, block_size=block_size, max_prefill_tokens=96, prefix_slots=4)
    cached = []
    for turn in range(3):
        params = [_params(turn * 3 + i) for i in range(3)]
        want = [ref.generate([p], q)[0] for p, q in zip(prompts, params)]
        got = eng.generate(prompts, params)
        for g, w in zip(got, want):
            _same(g, w)
        cached.append([g.num_cached for g in got])
        prompts = [p + g.output_ids + [rng.randrange(V) for _ in range(rng.randint(1, 80))]
                   for p, g in zip(prompts, got)]
    # later turns hit (at least) the previous turn's last boundary
    assert all(c >= CHUNK * 2 and c % CHUNK == 0 for c in cached[1] + cached[2])
    pc = eng.cache.prefix
    assert 0 < pc.hits < pc.queries
    assert eng.cache.reset_prefix_cache() > 0
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_a_shared_system_prompt_is_kept_where_the_prompts_part(model):
    """The second request sharing a system prompt keeps the boundary where it leaves the first's
    prefix (256, inside the 300-token system prompt); the third starts there."""
    rng, _ = _conversations(model, 0, 0, seed=3)
    sys_p = [rng.randrange(model.args.vocab_size) for _ in range(300)]
    prompts = [sys_p + [rng.randrange(model.args.vocab_size) for _ in range(160)] for _ in range(3)]
    eng = _engine(model, prefix_slots=4)
    p = SamplingParams(max_new_tokens=2, temperature=0)
    got = [eng.generate([q], p)[0].num_cached for q in prompts]
    assert got == [0, 0, 256]
    ref = _engine(model)
    assert [eng.generate([q], p)[0].output_ids for q in prompts] == [ref.generate([q], p)[0].output_ids
                                                                      for q in prompts]


def test_eviction_and_preemption_under_memory_pressure_keep_the_tokens(model):
    """Pools too small for the batch and its cached prefixes: entries are evicted (least recently
    used first), running requests preempt each other, and outputs still equal the uncached ones."""
    rng, prefixes = _conversations(model, 6, 260, seed=9)
    V = model.args.vocab_size
    prompts = [prefixes[i % 6] + [rng.randrange(V) for _ in range(rng.randint(1, 60))] for i in range(12)]
    params = [_params(i, 24) for i in range(12)]
    ref = _engine(model, batch_size=1)
    want = [ref.generate([q], p)[0] for q, p in zip(prompts, params)]
    # (the schedule is deterministic: these sizes evict and preempt)
    eng = _engine(model, block_size=4, batch_size=6, max_prefill_tokens=128, max_model_len=512, num_kv_blocks=50,
                  prefix_slots=2)
    for lo in (0, 6):
        got = eng.generate(prompts[lo:lo + 6], params[lo:lo + 6])
        for g, w in zip(got, want[lo:lo + 6]):
            _same(g, w)
    pc = eng.cache.prefix
    assert eng.scheduler.num_preemptions > 0 and pc.evictions > 0 and pc.hits > 0
    eng.cache.reset_prefix_cache()
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_no_leak_after_400_requests_with_shared_prefixes_and_aborts(model):
    """400 short requests over 6 shared prefixes, a quarter aborted at random points: when all
    are done only cache entries hold blocks, and a reset returns every block."""
    rng, prefixes = _conversations(model, 6, 100, seed=5)
    V = model.args.vocab_size
    eng = _engine(model, batch_size=16, max_prefill_tokens=1024, num_kv_blocks=120, prefix_slots=3)
    live: list[str] = []
    for i in range(400):
        rid = f"r{i}"
        eng.add_request(rid, prefixes[rng.randrange(6)][:rng.randint(129, 136)]
                        + [rng.randrange(V) for _ in range(rng.randint(0, 3))],
                        SamplingParams(max_new_tokens=rng.randint(1, 2), temperature=0))
        live.append(rid)
        if rng.random() < 0.25:
            eng.abort(live.pop(rng.randrange(len(live))))
        if i % 16 == 15:
            eng.step()
    while eng.has_unfinished():
        eng.step()
    pc = eng.cache.prefix
    assert not eng.cache.seqs and pc.hits > 0 and 0 < len(pc.entries) <= 3 + eng.limits.batch_size
    held = {p: eng.num_total_blocks()[p] - eng.num_free_blocks()[p] for p in ("state", "win", "c4", "c128")}
    assert held["state"] == len(pc.entries)
    eng.cache.reset_prefix_cache()
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_block_pool_reference_counts():
    pool = BlockPool(4)
    a = pool.take(2)
    pool.share(a, cached=True)
    assert pool.num_free == 2 and pool.num_evictable == 0
    pool.give(a)                                  # the request lets go: only the entry holds them
    assert pool.num_free == 2 and pool.num_evictable == 2
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.give(a)
    pool.give(a, cached=True)
    assert pool.num_free == 4 and pool.num_evictable == 0
    with pytest.raises(RuntimeError, match="free block"):
        pool.share([0])


def test_plan_hits_the_longest_cached_boundary_and_keeps_the_last():
    pc = PrefixCache()
    toks = list(range(1000))
    plan = pc.plan(toks, 700)
    assert plan.hit is None and [n for n, _ in plan.snapshots] == [640]
    chain = chain_hashes(toks, 5)
    assert chain == list(plan.chain) and chain_hashes(toks[:256] + [0] * 384, 5)[:2] == chain[:2]
    assert chain_hashes(toks[:256] + [0] * 384, 5)[2] != chain[2]


def test_cache_config_refuses_bad_sizes():
    from engine.core.block_manager import CacheConfig
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(16, 2, {"c4": -1})
    with pytest.raises(ValueError, match="prefix_slots"):
        CacheConfig(16, 2, {"c4": 4}, prefix_slots=-1)
    assert CacheConfig(16, 2, {"c4": 4}, prefix_slots=3).num_slots == 5


def test_an_allocation_that_cannot_fit_evicts_nothing(model):
    """A request too large for the pools even with every entry evicted is refused with the cache
    intact (``reserve`` on decode calls ``allocate`` without asking ``can_allocate`` first)."""
    from engine.core.block_manager import CacheFullError
    _, prompts = _conversations(model, 2, 200, seed=4)
    eng = _engine(model, num_kv_blocks=40, max_model_len=1024, prefix_slots=2)
    for q in prompts:
        eng.generate([q], SamplingParams(max_new_tokens=1, temperature=0))
    n = len(eng.cache.prefix.entries)
    assert n > 0
    with pytest.raises(CacheFullError):
        eng.cache.allocate("huge", 10_000)
    assert len(eng.cache.prefix.entries) == n and eng.cache.prefix.evictions == 0
    assert "huge" not in eng.cache.seqs


def test_a_context_parallel_first_chunk_is_not_cut_at_a_short_shared_prefix(model):
    """Where the first chunk of a long prompt runs context parallel (``cp_first_chunk``: 512
    here), the boundary at a short shared prefix (128) is not kept: it would cut that chunk to
    128 tokens and run the whole prompt without CP. Without CP it is kept."""
    from engine.core.model_runner import ModelRunner

    class CPRunner(ModelRunner):
        cp_first_chunk = 512

    def cp_runner(model, pools, limits):
        return CPRunner(model, pools, limits.max_model_len, limits.batch_size)

    rng, prompts = _conversations(model, 2, 200, seed=8)
    prompts = [p[:200] + [rng.randrange(model.args.vocab_size) for _ in range(700)] for p in prompts]
    p = SamplingParams(max_new_tokens=1, temperature=0)
    kept = {}
    for name, runner in (("cp", cp_runner), ("plain", None)):
        eng = _engine(model, prefix_slots=4, max_prefill_tokens=1024, runner=runner)
        for q in prompts:
            eng.generate([q], p)
        kept[name] = sorted(e.num_tokens for e in eng.cache.prefix.entries.values())
    assert kept == {"cp": [896, 896], "plain": [128, 896, 896]}
