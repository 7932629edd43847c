"""A request's state exported from a prefill engine and imported into a decode engine (in process):
the P/D split changes no token, the payload is exactly the live state of reference §4."""
from __future__ import annotations

import pytest
import torch

from engine.core.block_manager import CacheFullError
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.pd_state import expected_shapes
from engine.core.sampling_params import SamplingParams
from engine.checkpoint.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1), progress=False)


def _engine(model, batch_size=4):
    return LLMEngine.build(model, block_size=16, batch_size=batch_size, max_prefill_tokens=200, max_model_len=1024,
                           num_kv_blocks=40)


def _payload_bytes_formula(a, L, e=4):
    """Reference §4 ("HF logical minimum" + our fp32 remainders): window min(L, W-1) tokens on every
    layer; per CSA layer floor(L/4) entries of d + dI, the (L mod 4) open-window rows of kv+score
    at 2d and 2dI, and the closed window's Ca/Za (4 x d, 4 x dI, kv+score) once L >= 4; per HCA
    layer floor(L/128) entries of d and (L mod 128) rows of kv+score at d."""
    d, dI, W = a.head_dim, a.index_head_dim, a.sliding_window
    total = a.num_hidden_layers * min(L, W - 1) * d * e
    for m in a.compress_ratios[:a.num_hidden_layers]:
        if m == 4:
            total += (L // 4) * (d + dI) * e + (L % 4) * 2 * (2 * d + 2 * dI) * 4
            total += (L >= 4) * 2 * 4 * (d + dI) * 4
        elif m == 128:
            total += (L // 128) * d * e + (L % 128) * 2 * d * 4
    return total


@pytest.mark.parametrize("length", [1, 3, 4, 5, 127, 128, 129, 515])
def test_pd_split_gives_the_same_tokens(model, length):
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(2, model.args.vocab_size, (length,), generator=g).tolist()
    for params in (SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True),
                   SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)):
        ref = _engine(model).generate([prompt], params)[0].output_ids
        p_eng, d_eng = _engine(model), _engine(model)
        p_eng.add_request("r", prompt, SamplingParams(**{**params.__dict__, "max_new_tokens": 1}), hold_state=True)
        while p_eng.has_unfinished():
            p_eng.step()
        seq, tensors = p_eng.pd.export_state("r")
        shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
        assert shapes == expected_shapes(p_eng.runner.pools, length)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) == _payload_bytes_formula(model.args, length)
        assert p_eng.pd.release("r") and p_eng.num_free_blocks() == p_eng.num_total_blocks()
        d_eng.pd.add_prefilled("r", prompt, seq.output_ids[0],
                               SamplingParams(**{**params.__dict__, "seed": seq.params.seed}), tensors)
        out = [seq.output_ids[0]]
        while d_eng.has_unfinished():
            out += [t for o in d_eng.step() for t in o.new_token_ids]
        assert out == ref, params
        assert d_eng.num_free_blocks() == d_eng.num_total_blocks()


def test_import_refuses_bad_state_and_holds_nothing(model):
    p_eng, d_eng = _engine(model), _engine(model, batch_size=1)
    params = SamplingParams(max_new_tokens=1, temperature=0, seed=1)
    p_eng.add_request("r", list(range(2, 140)), params, hold_state=True)
    while p_eng.has_unfinished():
        p_eng.step()
    seq, tensors = p_eng.pd.export_state("r")
    first = seq.output_ids[0]
    bad = dict(tensors)
    bad["layers.2.cmp_kv"] = bad["layers.2.cmp_kv"][:-1]
    with pytest.raises(RequestError, match="^state: .*layers.2.cmp_kv"):
        d_eng.pd.add_prefilled("r", seq.prompt_ids, first, params, bad)
    missing = {k: v for k, v in tensors.items() if k != "layers.0.win_kv"}
    with pytest.raises(RequestError, match="^state: .*missing"):
        d_eng.pd.add_prefilled("r", seq.prompt_ids, first, params, missing)
    with pytest.raises(RequestError, match="^sampling_params.seed"):
        d_eng.pd.add_prefilled("r", seq.prompt_ids, first, SamplingParams(max_new_tokens=4), tensors)
    assert d_eng.num_free_blocks() == d_eng.num_total_blocks() and not d_eng.seqs
    d_eng.pd.add_prefilled("r", seq.prompt_ids, first, SamplingParams(max_new_tokens=4, seed=1), tensors)
    with pytest.raises(CacheFullError, match="batch full"):
        d_eng.pd.add_prefilled("r2", seq.prompt_ids, first, SamplingParams(max_new_tokens=4, seed=1), tensors)
    assert d_eng.abort("r") and p_eng.abort("r")             # abort releases held prefill state too
    d_eng.step()
    assert d_eng.num_free_blocks() == d_eng.num_total_blocks()
    assert p_eng.num_free_blocks() == p_eng.num_total_blocks()
