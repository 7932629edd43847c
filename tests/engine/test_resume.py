"""A sample continued from its tokens so far (``output_ids``: a stream migrated off a lost decode)
gives exactly the tokens an undisturbed run gives after them: in one engine, and split P/D (a
prefill engine computes prompt + outputs and samples the next token, a decode engine continues)."""
from __future__ import annotations

import pytest
import torch

from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.sampling_params import SamplingParams
from engine.checkpoint.loader import load_model

PARAMS = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, presence_penalty=1.5, frequency_penalty=0.5,
                         repetition_penalty=1.3, ignore_eos=True)]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False)


def _engine(model):
    return LLMEngine.build(model, block_size=16, batch_size=4, max_prefill_tokens=64, max_model_len=512,
                           num_kv_blocks=60)


def _run(engine, rid):
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


@pytest.mark.parametrize("p", PARAMS, ids=["greedy", "top-p", "penalties"])
def test_resumed_sample_continues_exactly(model, p):
    prompt = torch.randint(2, model.args.vocab_size, (130,), generator=torch.Generator().manual_seed(5)).tolist()
    eng = _engine(model)
    full = eng.generate([prompt], p)[0].output_ids
    assert len(full) == 12
    for k in (1, 2, 5, 11):
        eng.add_request(f"r{k}", prompt, p, output_ids=full[:k])
        assert _run(eng, f"r{k}") == full[k:], k
    assert eng.num_free_blocks() == eng.num_total_blocks()


@pytest.mark.parametrize("p", PARAMS[1:], ids=["top-p", "penalties"])
def test_resumed_sample_split_pd_continues_exactly(model, p):
    prompt = torch.randint(2, model.args.vocab_size, (61,), generator=torch.Generator().manual_seed(6)).tolist()
    full = _engine(model).generate([prompt], p)[0].output_ids
    k = 4
    pre, dec = _engine(model), _engine(model)
    pre.add_request("m", prompt, SamplingParams(**{**p.__dict__, "max_new_tokens": k + 1}), hold_state=True,
                    output_ids=full[:k])
    assert _run(pre, "m") == [full[k]]                    # the next token, sampled where undisturbed
    seq, tensors = pre.pd.export_state("m")
    assert seq.num_computed == len(prompt) + k
    dec.pd.reserve("m", prompt, p, output_ids=full[:k])
    dec.pd.load_state("m", tensors)
    dec.pd.commit("m", full[k])
    assert _run(dec, "m") == full[k + 1:]
    assert pre.pd.release("m") and pre.num_free_blocks() == pre.num_total_blocks()
    assert dec.num_free_blocks() == dec.num_total_blocks()


def test_bad_output_ids_are_refused(model):
    eng = _engine(model)
    p = SamplingParams(max_new_tokens=3, temperature=0)
    for bad, field in (([1, -1], "output_ids: token id -1"), ([1, 2, 3], "already reach max_new_tokens"),
                       ([True], "output_ids: token ids must be Python ints")):
        with pytest.raises(RequestError, match=field):
            eng.add_request("x", [5, 6], p, output_ids=bad)
    with pytest.raises(RequestError, match="leave no room"):
        eng.add_request("x", [5] * 500, SamplingParams(max_new_tokens=100), output_ids=[5] * 20)
    assert not eng.has_unfinished()
