"""MTP speculative decoding on ``dsv4-make-tiny --mtp-agree``, whose MTP layer drafts what the trunk
predicts next: greedy drafts are accepted at >= 90% for next_n 1 and 3, the engine runs fewer
target forwards than next_n 0, and the tokens are still next_n 0's (greedy and seeded); with drafts
partly accepted the state stays byte-identical to next_n 0's (the random model's tests cover
rejection only). The checkpoint keeps the real layout and is the random one with only the
documented changes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.checkpoint import make_tiny as mt
from engine.checkpoint.fp8_mxfp4 import dequant_fp8_block, e8m0_to_float
from engine.checkpoint.layout import checkpoint_layout
from engine.checkpoint.loader import load_model
from engine.checkpoint.shards import scan_checkpoint
from engine.config import ModelArgs
from engine.core.llm_engine import LLMEngine
from spec_util import assert_same_states, states_by_length
from engine.core.sampling_params import SamplingParams

PROMPTS = [[1000 + 7 * i for i in range(n)] for n in (3, 9, 17)]
NEW = 12


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt("flash", 1, mtp_agree=True), dtype=torch.float32, progress=False, mtp=True)


def _run(model, next_n: int, params: SamplingParams):
    eng = LLMEngine.build(model, block_size=16, batch_size=4, max_prefill_tokens=64, max_model_len=256,
                          num_kv_blocks=40, num_reserved_decode_tokens=0, next_n=next_n)
    out = eng.generate(PROMPTS, params)
    assert eng.num_free_blocks() == eng.num_total_blocks()            # nothing leaks
    return [s.output_ids for s in out], eng


@pytest.fixture(scope="module")
def greedy(model):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    return {n: _run(model, n, params) for n in (0, 1, 3)}


def test_the_trunk_is_not_a_bare_bigram(model):
    """Block outputs at eps gain still matter: teacher-forced over 256 random tokens, the trunk's
    greedy token differs from ``head(norm(embed(t)))`` on a few positions (not many: the MTP
    layer, exactly that bigram, must agree), and the context moves the logits of a token."""
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(1000, 60000, (256,), generator=g)
    with torch.no_grad():
        trunk = model.logits(model(toks, model.new_state())).argmax(-1)
        bigram = model.logits(model.norm(model.embed_tokens(toks).float()).to(model.dtype)).argmax(-1)
        last = [model.logits(model(torch.cat([ctx, toks[-1:]]), model.new_state())[-1:])[0]
                for ctx in (toks[:40], toks[100:140])]
    assert 1 <= int((trunk != bigram).sum()) <= 256 * 0.05
    assert (last[0] - last[1]).abs().max() > 1e-3


@pytest.mark.parametrize("next_n", [1, 3])
def test_greedy_drafts_are_accepted_and_the_tokens_are_next_n_0s(greedy, next_n):
    want, base = greedy[0]
    got, eng = greedy[next_n]
    assert got == want
    st = eng.spec.stats
    assert st.num_draft_tokens >= len(PROMPTS) * 2 and st.acceptance_rate >= 0.9, st
    assert sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens
    assert st.num_accepted_tokens_per_pos == sorted(st.num_accepted_tokens_per_pos, reverse=True)
    # one prefill step (the prompts fit one 64-token budget), then target forwards: each request's
    # decode rows plus the drafts it accepted are its NEW - 1 decoded tokens
    forwards = sum(seqs for seqs, *_ in eng.stats.history[1:])
    assert forwards + st.num_accepted_tokens == len(PROMPTS) * (NEW - 1)
    assert forwards >= st.num_drafts
    assert eng.stats.steps < base.stats.steps == NEW
    assert st.mean_acceptance_length > (1.8 if next_n == 1 else 3.4)


def test_seeded_sampling_gives_next_n_0s_tokens(model):
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, seed=11 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want, _ = _run(model, 0, params)
    got, eng = _run(model, 3, params)
    assert got == want
    assert eng.spec.stats.num_draft_tokens > 0   # at temperature 0.8 the tiny model's p(draft) is small


def test_the_agree_checkpoint_is_the_random_one_with_the_documented_changes():
    """Same random draws; trunk block outputs exactly eps times the random ones' (a power of two:
    the FP8 / FP4 codes stay, the e8m0 scales shift); MTP e_proj identity, h_proj / wo_b / w2 zero,
    enorm 1, its norm the trunk's; every other tensor bit-identical; the real layout throughout."""
    args = ModelArgs.from_dict(mt.PRESETS["flash"])
    rnd, agr = mt.make_tensors(args, 1), mt.make_tensors(args, 1, mtp_agree=True)
    assert rnd.keys() == agr.keys()
    assert all(agr[k].dtype == rnd[k].dtype and agr[k].shape == rnd[k].shape for k in rnd)
    changed = {k for k in rnd if not torch.equal(rnd[k].view(torch.uint8) if rnd[k].element_size() == 1 else rnd[k],
                                                 agr[k].view(torch.uint8) if agr[k].element_size() == 1 else agr[k])}
    outputs = ("wo_b.scale", "w2.scale")
    trunk = {k for k in changed if k.startswith("layers.")}
    assert trunk and all(k.endswith(outputs) for k in trunk)
    for k in trunk:
        assert torch.equal(e8m0_to_float(agr[k]), e8m0_to_float(rnd[k]) * mt.MTP_AGREE_EPS), k
    H = args.hidden_size
    assert torch.equal(agr["mtp.0.enorm.weight"].float(), torch.ones(H))
    assert torch.equal(agr["mtp.0.norm.weight"], agr["norm.weight"])
    e = dequant_fp8_block(agr["mtp.0.e_proj.weight"], agr["mtp.0.e_proj.scale"], (128, 128), torch.float32)
    assert torch.equal(e, torch.eye(H))
    assert not agr["mtp.0.h_proj.weight"].float().any()
    mtp_out = [k for k in agr if k.startswith("mtp.0.") and k.endswith(("wo_b.weight", "w2.weight"))]
    assert mtp_out and not any(agr[k].view(torch.uint8).any() for k in mtp_out)   # fp8 / fp4 zero codes
    assert all(k.startswith("mtp.") or k.endswith(outputs) for k in changed)


def test_cli_flag_writes_the_same_checkpoint_in_the_original_layout(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "agree"
    assert mt.main(["--preset", "flash", "--seed", "1", "--mtp-agree", "--out", str(out)]) == 0
    assert "--mtp-agree checkpoint (seed 1)" in capsys.readouterr().out
    ref = Path(tiny_ckpt("flash", 1, mtp_agree=True))
    assert sorted(os.listdir(out)) == sorted(os.listdir(ref))
    for f in os.listdir(ref):
        assert (out / f).read_bytes() == (ref / f).read_bytes(), f
    args = ModelArgs.from_json(out)
    found = scan_checkpoint(out)
    assert {n: (t.dtype, t.shape) for n, t in found.items()} == \
        {n: (s.dtype, s.shape) for n, s in checkpoint_layout(args).items()}


def test_state_after_partly_accepted_drafts_is_byte_identical(model):
    """Seeded sampling at temperature 0.1: a greedy draft is accepted with the target's p(draft),
    so verify steps keep 0 .. 3 of 3 drafts (the random model keeps ~0): the compressor remainders
    are restored and the kept rows replayed. Across CSA windows and the HCA window at 128, the state
    at each length both runs reach equals, byte for byte, next_n 0's."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1000, 60000, (118,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=20, temperature=0.1, seed=5, ignore_eos=True)

    def engine(next_n):
        return LLMEngine.build(model, block_size=16, batch_size=1, max_prefill_tokens=256, max_model_len=256,
                               num_kv_blocks=40, num_reserved_decode_tokens=0, next_n=next_n)
    plain = states_by_length(engine(0), prompt, params)
    eng = engine(3)
    spec = states_by_length(eng, prompt, params)
    st = eng.spec.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and 0 < st.num_accepted_tokens_per_pos[-1]
    assert_same_states(plain, spec, min_common=5, past=128)


def test_a_held_request_drafting_before_its_first_sample_keeps_its_prompt_state(model):
    """Prefill role (hold_state, max_new_tokens 1): a 64-token chunk leaves one prompt token of 65
    pending, so the request drafts before its first sample (as a decode does) and the next step
    verifies them; the agreeing model accepts them, but the request ends at token #1, so its held
    state must be the prompt's (num_computed 65), ready for export, and the step must not fail."""
    eng = LLMEngine.build(model, block_size=16, batch_size=2, max_prefill_tokens=64, max_model_len=256,
                          num_kv_blocks=40, num_reserved_decode_tokens=0, next_n=3)
    prompt = [1000 + 7 * i for i in range(65)]
    eng.add_request("r", prompt, SamplingParams(max_new_tokens=1, temperature=0.0, seed=1), hold_state=True)
    eng.step()
    assert eng.seqs["r"].num_computed == 64 and len(eng.seqs["r"].draft_ids) == 3
    while eng.has_unfinished():
        eng.step()
    seq, _ = eng.pd.export_state("r")
    assert seq.num_computed == 65 and len(seq.output_ids) == 1


def test_verify_spans_run_batched_and_equal_the_per_sequence_path(model):
    """The verify spans of all requests (1 + next_n rows each) and the MTP layer's catch-up and
    chained drafts go through the batched decode step (``StaticDecoder.run`` / ``.mtp``, eager),
    and give, id for id and logprob for logprob, what the same step gives run one sequence at a
    time (which the tests above hold to next_n 0's tokens and states)."""
    params = [SamplingParams(max_new_tokens=10, temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=2,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    spans, rows = [], []
    per_sequence = False

    def cat(parts):
        return tuple(torch.cat(p) for p in zip(*parts)) if isinstance(parts[0], tuple) else torch.cat(parts)

    def run():
        eng = LLMEngine.build(model, block_size=16, batch_size=4, max_prefill_tokens=64, max_model_len=256,
                              num_kv_blocks=40, num_reserved_decode_tokens=0, next_n=3)
        r, dec = eng.runner, eng.runner.decoder
        decode, decode_rows, mtp = r.decode, dec.run, dec.mtp

        def spy_decode(step_rows, sel, every=None):      # the runner's verify spans of one step
            spans.append(sum(1 for i in sel if step_rows[i].num_drafts))
            return decode(step_rows, sel, every)

        def spy_run(step):
            return cat([decode_rows([x]) for x in step]) if per_sequence else decode_rows(step)

        def spy_mtp(X, tok, mrows, layer=0):
            rows.append(len(mrows))
            if not per_sequence:
                return mtp(X, tok, mrows, layer)
            offs = [0]
            for _, n, _ in mrows:
                offs.append(offs[-1] + n)
            return cat([mtp(X[o:e], tok[o:e], [m], layer) for o, e, m in zip(offs, offs[1:], mrows)])

        r.decode, dec.run, dec.mtp = spy_decode, spy_run, spy_mtp
        out = eng.generate(PROMPTS, params)
        assert eng.num_free_blocks() == eng.num_total_blocks()
        return [(s.output_ids, [(x.logprob, x.top_logprobs) for x in s.logprobs]) for s in out], eng

    batched, eng = run()
    assert spans and max(spans) == len(PROMPTS)          # all requests' spans in one sub-step
    assert rows and max(rows) == len(PROMPTS)            # e.g. the chained drafts of all requests
    assert eng.spec.stats.num_accepted_tokens > 0
    per_sequence = True
    assert run()[0] == batched


def test_a_request_finishing_inside_an_accepted_run_is_not_settled_after_its_free(model):
    """Accepted drafts end a request (max_new_tokens reached inside the kept run): its state is
    freed by the finish, so no rank holds it (under attention DP ``rank_of`` would raise) and the
    model runner is never asked to roll it back (``DraftPlan.settle``); the outputs are next_n 0's."""
    eng = LLMEngine.build(model, block_size=16, batch_size=4, max_prefill_tokens=64, max_model_len=256,
                          num_kv_blocks=40, num_reserved_decode_tokens=0, next_n=3)
    settled, draft = [], eng.runner.draft

    def checked(plan):
        for seq_id, kept in plan.settle:
            assert seq_id in eng.cache.seqs, f"settle of {seq_id} after its state was freed"
            settled.append(seq_id)
        return draft(plan)
    eng.runner.draft = checked
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    got = eng.generate(PROMPTS, params)
    assert [s.output_ids for s in got] == _run(model, 0, params)[0]
    assert settled and eng.spec.stats.num_accepted_tokens > 0
