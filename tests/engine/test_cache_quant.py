"""Quantised decode-state caches in the engine (engine.cache_dtype, engine.ops.cache_codec): the
state a request holds and ships is the §4 formula at the stored widths; batching, chunking, the
captured step and the P/D split change no token; the accuracy cost against unquantised caches."""
from __future__ import annotations

import pytest
import torch

from engine.cache_dtype import CacheDtype, indexer_row_bytes, kv_row_bytes
from engine.checkpoint.loader import load_model
from engine.core.graph_runner import ExecConfig
from engine.core.llm_engine import LLMEngine
from engine.core.pd_state import expected_shapes
from engine.core.sampling_params import SamplingParams
from engine.tools.cache_accuracy import accuracy

CACHES = {"int8": CacheDtype("none", "int8"), "fp8": CacheDtype("fp8", "fp8"), "hif8": CacheDtype("hif8", "hif8")}
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False)


def _engine(model, cache, batch_size=4, max_prefill_tokens=200, graph=None):
    return LLMEngine.build(model, block_size=16, batch_size=batch_size, max_prefill_tokens=max_prefill_tokens,
                           max_model_len=1024, num_kv_blocks=48, cache_dtype=cache, graph=graph)


def _prompt(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.args.vocab_size, (n,), generator=g).tolist()


def _prefill(eng, prompt, params):
    eng.add_request("r", prompt, SamplingParams(**{**params.__dict__, "max_new_tokens": 1}), hold_state=True)
    while eng.has_unfinished():
        eng.step()
    return eng.pd.export_state("r")


def state_bytes(a, L: int, cache: CacheDtype, act_bytes: int = 4) -> int:
    """Reference §4 at the stored widths: window min(L, W-1) rows on every layer; per CSA layer
    floor(L/4) KV rows + indexer rows, the open-window fp32 rows (kv + score, 2d and 2dI wide) and,
    once L >= 4, the closed window's Ca/Za; per HCA layer floor(L/128) KV rows + (L mod 128) fp32
    rows of kv + score."""
    d, dI, W = a.head_dim, a.index_head_dim, a.sliding_window
    kv = kv_row_bytes(cache.kv, d, a.qk_rope_head_dim, act_bytes)
    idx = indexer_row_bytes(cache.indexer, dI, act_bytes)
    total = a.num_hidden_layers * min(L, W - 1) * kv
    for m in a.compress_ratios[:a.num_hidden_layers]:
        if m == 4:
            total += (L // 4) * (kv + idx) + (L % 4) * 2 * (2 * d + 2 * dI) * 4 + (L >= 4) * 2 * 4 * (d + dI) * 4
        elif m == 128:
            total += (L // 128) * kv + (L % 128) * 2 * d * 4
    return total


@pytest.mark.parametrize("name", sorted(CACHES))
def test_pd_split_ships_the_stored_state_and_changes_no_token(model, name):
    cache = CACHES[name]
    for length in (3, 129, 515):
        prompt = _prompt(model, length, seed=length)
        for params in (GREEDY, SAMPLED):
            ref = _engine(model, cache).generate([prompt], params)[0].output_ids
            p_eng, d_eng = _engine(model, cache), _engine(model, cache)
            seq, tensors = _prefill(p_eng, prompt, params)
            shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
            assert shapes == expected_shapes(p_eng.runner.pools, length)
            sent = sum(t.numel() * t.element_size() for t in tensors.values())
            assert sent == state_bytes(model.args, length, cache)
            assert sent < state_bytes(model.args, length, CacheDtype()) or length < 4
            p_eng.pd.release("r")
            d_eng.pd.add_prefilled("r", prompt, seq.output_ids[0],
                                   SamplingParams(**{**params.__dict__, "seed": seq.params.seed}), tensors)
            out = [seq.output_ids[0]]
            while d_eng.has_unfinished():
                out += [t for o in d_eng.step() for t in o.new_token_ids]
            assert out == ref, (name, length, params)
            assert d_eng.num_free_blocks() == d_eng.num_total_blocks()


def test_a_quantised_state_is_refused_by_an_unquantised_decode(model):
    from engine.core.llm_engine import RequestError
    prompt = _prompt(model, 140)
    seq, tensors = _prefill(_engine(model, CACHES["fp8"]), prompt, GREEDY)
    d_eng = _engine(model, CacheDtype())
    with pytest.raises(RequestError, match="^state: .*(win_kv|idx_kv)"):
        d_eng.pd.add_prefilled("r", prompt, seq.output_ids[0], SamplingParams(**{**GREEDY.__dict__,
                                                                                  "seed": seq.params.seed}), tensors)
    assert d_eng.num_free_blocks() == d_eng.num_total_blocks()


@pytest.mark.parametrize("name", sorted(CACHES))
def test_chunking_and_batching_change_nothing(model, name):
    """Chunks of 64 vs one 600-token chunk: the same stored bytes; four requests batched vs each
    alone: the same tokens (greedy and sampled)."""
    cache = CACHES[name]
    prompt = _prompt(model, 600, seed=1)
    _, whole = _prefill(_engine(model, cache, max_prefill_tokens=1024), prompt, GREEDY)
    _, chunked = _prefill(_engine(model, cache, max_prefill_tokens=64), prompt, GREEDY)
    assert whole.keys() == chunked.keys()
    for k in whole:
        assert torch.equal(whole[k], chunked[k]), k
    prompts = [_prompt(model, n, seed=n) for n in (1, 126, 255, 300)]
    params = [GREEDY, SAMPLED, GREEDY, SAMPLED]
    together = _engine(model, cache).generate(prompts, params)
    for p, sp, t in zip(prompts, params, together):
        assert _engine(model, cache, batch_size=1).generate([p], sp)[0].output_ids == t.output_ids


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_captured_decode_step_reads_the_same_cache(model, name):
    """The static (graph) decode step over quantised pools: the eager engine's tokens."""
    cache = CACHES[name]
    prompts = [_prompt(model, n, seed=n) for n in (1, 255, 300)]
    ref = _engine(model, cache).generate(prompts, GREEDY)
    eng = _engine(model, cache, graph=ExecConfig(exe_mode="npugraph_ex"))
    eng.runner.graph.use_eager()                                               # the captured math, run eagerly
    got = eng.generate(prompts, GREEDY)
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_contiguous_state_equals_the_pools(model):
    """``model.forward`` over a contiguous ``SequenceState`` with the same cache storage gives the
    paged engine's hidden states bit for bit (the teacher-forced accuracy below uses it)."""
    from engine.core.block_manager import CacheConfig
    from engine.core.kv_cache import LocalCache
    cache = CACHES["fp8"]
    toks = torch.tensor(_prompt(model, 300, seed=4))
    h = model.forward(toks, model.new_state(cache=cache))
    pc = LocalCache(model.args, CacheConfig(16, 1, {"c4": 8, "c128": 1}, 0, cache), model.dtype)
    pc.allocate(0, 300)
    hp = model.forward_batch(toks, [pc.sequence_state(0, 0)], [300])
    assert torch.equal(h, hp)


# bounds per cache: (min top-1 agreement, max mean relative error, max max relative error); measured
# on the tiny seed-1 checkpoints, 320 positions: flash int8 1.000 / 9.2e-4 / 3.7e-2, fp8 0.988 / 4.9e-3 /
# 5.4e-2, hif8 0.981 / 6.7e-3 / 5.4e-2; pro int8 1.000 / 9.1e-4 / 8.1e-2, fp8 0.991 / 5.7e-3 / 0.107,
# hif8 0.988 / 7.0e-3 / 0.104
BOUNDS = {"int8": (0.99, 0.003, 0.15), "fp8": (0.96, 0.02, 0.25), "hif8": (0.96, 0.02, 0.25)}


@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_accuracy_against_unquantised_caches(tiny_ckpt, preset):
    model = load_model(tiny_ckpt(preset, 1), progress=False)
    for name, cache in CACHES.items():
        acc = accuracy(model, cache)
        print(f"{preset} {name}: top-1 {acc['top1']:.4f}  mean rel {acc['mean_rel']:.2e}  max rel {acc['max_rel']:.2e}")
        lo_top1, hi_mean, hi_max = BOUNDS[name]
        assert acc["top1"] >= lo_top1 and acc["mean_rel"] <= hi_mean and acc["max_rel"] <= hi_max, (name, acc)
        assert acc["mean_rel"] > 0                           # the cache really is quantised
