"""Constrained decoding in the engine (``engine.core.grammar``): with the random tiny model only
the grammar makes the output valid. Constrained and unconstrained rows share a step without
changing the unconstrained rows' tokens; MTP, preemption and a migrated stream give the tokens
a plain run gives; a bad constraint is a RequestError naming the field, with nothing held."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.checkpoint.loader import load_model
from engine.core.block_manager import CacheConfig
from engine.core.grammar import GrammarBackend, token_bitmask
from engine.core.llm_engine import LLMEngine
from engine.core.request import FinishReason, RequestError
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerLimits
from engine.tokenizer import Tokenizer

PROMPT = [0, 128803, 3476, 477, 260, 11502, 22896, 128804, 128822]      # BOS User ... Assistant </think>
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user"]},
                         "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "format": "date"}}}}
C4_BLOCKS = 8
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"


def tag(fmt: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


JSON_TAG = tag({"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 4})
REGEX_TAG = tag({"type": "regex", "pattern": REGEX})
# free text up to </think>, then a regex: drafts agree with the trunk inside the free part
THINK_TAG = tag({"type": "sequence", "elements": [
    {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": ["<think>"]}, "end": "</think>"},
    {"type": "regex", "pattern": "[0-9]{3}"}]})


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("flash", 1, mtp_agree=True)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype=torch.float32, progress=False, mtp=True)


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer(ckpt)


def _engine(model, ckpt, **kw) -> LLMEngine:
    eng = LLMEngine.build(model, **{**dict(block_size=16, batch_size=8, max_prefill_tokens=256, max_model_len=1024,
                                           num_kv_blocks=200, num_reserved_decode_tokens=0), **kw})
    eng.grammar = GrammarBackend(ckpt, model.args.vocab_size, tuple(eng.eos_ids))
    return eng


def _text(tok, seq) -> str:
    return tok.decode([t for t in seq.output_ids if t != tok.eos_id])


def _params(structured, i, n=160, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0 if i % 2 else 1.0, seed=i, structured=structured, **kw)


def test_constrained_outputs_are_valid_and_end_with_stop(model, ckpt, tok):
    eng = _engine(model, ckpt)
    seqs = eng.generate([PROMPT] * 8, [_params(JSON_TAG if i < 4 else REGEX_TAG, i) for i in range(8)])
    for i, s in enumerate(seqs):
        assert s.finish_reason is FinishReason.STOP and s.output_ids[-1] == tok.eos_id, (i, _text(tok, s))
        if i < 4:
            jsonschema.validate(json.loads(_text(tok, s)), SCHEMA, format_checker=jsonschema.FormatChecker())
        else:
            assert re.fullmatch(REGEX, _text(tok, s)), _text(tok, s)
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_unconstrained_rows_keep_their_tokens_beside_constrained_ones(model, ckpt):
    eng = _engine(model, ckpt)
    free = [SamplingParams(max_new_tokens=12, temperature=t, seed=7, ignore_eos=True) for t in (0.0, 0.9)]
    alone = [s.output_ids for s in eng.generate([PROMPT, PROMPT[:5]], free)]
    mixed = eng.generate([PROMPT, PROMPT[:5]] + [PROMPT] * 4, free + [_params(JSON_TAG, i) for i in range(4)])
    assert [s.output_ids for s in mixed[:2]] == alone
    assert all(s.finish_reason is FinishReason.STOP for s in mixed[2:])


@pytest.mark.parametrize("next_n", [1, 2])
def test_mtp_keeps_the_constrained_tokens_of_a_plain_run(model, ckpt, next_n):
    """Row j of a verify step is masked by the state after drafts 1..j: kept tokens are those of
    next_n 0, greedy and seeded; drafts are accepted inside the grammar's free text."""
    tags = [THINK_TAG, JSON_TAG, REGEX_TAG, THINK_TAG]
    params = [_params(t, i, n=48) for i, t in enumerate(tags)]
    plain = [(s.output_ids, s.finish_reason) for s in _engine(model, ckpt).generate([PROMPT] * 4, params)]
    eng = _engine(model, ckpt, next_n=next_n)
    assert [(s.output_ids, s.finish_reason) for s in eng.generate([PROMPT] * 4, params)] == plain
    assert eng.spec.stats.num_accepted_tokens > 0


def test_the_draft_rows_leave_the_matcher_where_it_was(model, ckpt, tok):
    eng = _engine(model, ckpt)
    m = eng.grammar.matcher(REGEX_TAG)
    seq = type("S", (), {"matcher": m, "spec_k": 3, "draft_ids": tok.encode("ab@c")[:3]})()
    before = token_bitmask([seq], 1 + seq.spec_k, model.args.vocab_size, torch.device("cpu"))
    again = token_bitmask([seq], 1 + seq.spec_k, model.args.vocab_size, torch.device("cpu"))
    assert torch.equal(before[0], again[0]) and before[1] == again[1]
    assert token_bitmask([type("S", (), {"matcher": None, "spec_k": 0})()], 1, 8, torch.device("cpu")) is None


def test_preemption_and_a_migrated_stream_continue_the_grammar(model, ckpt):
    params = [_params(JSON_TAG, i) for i in range(4)]
    ref = [s.output_ids for s in _engine(model, ckpt).generate([PROMPT] * 4, params)]
    # block size 4, 8 CSA blocks: the pool holds 2 of these requests at full length (~58 tokens)
    tight = LLMEngine.of(model, CacheConfig(4, 4, {"c4": C4_BLOCKS, "c128": 2}), SchedulerLimits(4, 512, 64, 0),
                         (model.args.eos_token_id,))
    tight.grammar = GrammarBackend(ckpt, model.args.vocab_size, tuple(tight.eos_ids))
    got = tight.generate([PROMPT] * 4, params)
    assert [s.output_ids for s in got] == ref and sum(s.num_preemptions for s in got) > 0
    eng = _engine(model, ckpt)                  # a stream moved off a lost decode after 5 tokens
    eng.add_request("m", PROMPT, params[1], output_ids=ref[1][:5])
    seq = eng.seqs["m"]
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == ref[1] and seq.finish_reason is FinishReason.STOP


def test_a_bad_constraint_is_refused_naming_the_field(model, ckpt, tok):
    eng = _engine(model, ckpt)
    with pytest.raises(RequestError, match=r"^structured: .*Regex parsing error"):
        eng.add_request("a", PROMPT, SamplingParams(structured=tag({"type": "regex", "pattern": "a("})))
    with pytest.raises(RequestError, match=r"^output_ids: token .* not allowed"):
        eng.pd.reserve("b", PROMPT, SamplingParams(seed=1, structured=REGEX_TAG), tok.encode("123"))
    bare = LLMEngine.build(model, block_size=16, batch_size=2, max_model_len=256, num_kv_blocks=40)
    with pytest.raises(RequestError, match="no tokenizer"):
        bare.add_request("c", PROMPT, SamplingParams(structured=REGEX_TAG))
    assert not eng.seqs and not eng.pd.reserved and eng.num_free_blocks() == eng.num_total_blocks()
    with pytest.raises(ValueError, match="structured"):
        SamplingParams(structured="not json")
