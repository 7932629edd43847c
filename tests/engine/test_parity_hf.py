"""Logit parity with HF transformers 5.23.0 DeepseekV4ForCausalLM on the same checkpoint (fp32).

Both presets, two seeds each: prefill lengths around every window / compress boundary, chunked
prefill with uneven chunks, and 150 greedy decode steps crossing 128-multiples, against one full
HF forward. Max abs logit difference <= 1e-4. Top-k ties: see ``hf_oracle`` (tie-tolerant).
"""
from types import SimpleNamespace

import pytest
import torch

from engine.checkpoint.loader import load_model
from hf_oracle import HFPicks, TieGuard, hf_logits, hf_logits_forced, load_hf, picks_agree

pytestmark = pytest.mark.slow
ATOL = 1e-4
PROMPT = 700
LENGTHS = [1, 3, 4, 5, 127, 128, 129, 255, 256, 257, PROMPT]


@pytest.fixture(scope="module", params=[("flash", 1), ("flash", 2), ("pro", 1), ("pro", 2)],
                ids=lambda p: f"{p[0]}-seed{p[1]}")
def pair(request, tiny_ckpt):
    preset, seed = request.param
    ckpt = tiny_ckpt(preset, seed)
    hf = load_hf(ckpt)
    picks = HFPicks(hf)
    ours = load_model(ckpt, progress=False)
    guard = TieGuard(ours.args)
    ours_guarded = load_model(ckpt, ops=guard.ops, progress=False)
    prompt = torch.randint(2, ours.args.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(100 + seed))
    ref = hf_logits(hf, prompt)
    natural = {k: dict(v) for k, v in picks.natural.items()}
    yield SimpleNamespace(hf=hf, picks=picks, ours=ours, guarded=ours_guarded, guard=guard, prompt=prompt,
                          ref=ref, prompt_picks=natural)


def run(model, guard, tokens, state):
    """One forward with the guard told the positions; returns logits [T, V]."""
    guard.set_positions(torch.arange(state.num_tokens, state.num_tokens + tokens.shape[0]))
    return model.logits(model(tokens, state))


def check(pair, logits, ids, ref=None):
    """Strict parity at every position; HF re-run with our near-tie decisions if picks differ."""
    if ref is None or not picks_agree(pair.guard, pair.picks):
        ref = hf_logits_forced(pair.hf, pair.picks, pair.guard, ids)
    diff = (logits - ref[: logits.shape[0]]).abs().max().item()
    assert diff <= ATOL, f"max |ours - HF| = {diff:.3e} over {logits.shape[0]} positions"


def test_hf_oracle_runs_the_same_config(pair):
    hf_cfg = pair.hf.config
    a = pair.ours.args
    kinds = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert [kinds[t] for t in hf_cfg.layer_types] == list(a.compress_ratios[: a.num_hidden_layers])
    assert hf_cfg.mlp_layer_types.count("hash_moe") == a.num_hash_layers
    rot = pair.hf.model.rotary_emb
    assert torch.equal(pair.ours.rope_compress.inv_freq, rot.compress_inv_freq.float())   # YaRN, no mscale
    assert torch.equal(pair.ours.rope_main.inv_freq, rot.main_inv_freq.float())
    assert rot.compress_attention_scaling == 1.0


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill(pair, length):
    g = pair.guard
    g.reset()
    logits = run(pair.guarded, g, pair.prompt[:length], pair.guarded.new_state())
    pair.picks.natural = {k: dict(v) for k, v in pair.prompt_picks.items()}
    check(pair, logits, pair.prompt[:length], pair.ref)


def test_chunked_prefill_uneven_chunks(pair):
    g = pair.guard
    g.reset()
    state, outs = pair.guarded.new_state(), []
    for c in [1, 3, 60, 127, 200, 100, 209]:
        outs.append(run(pair.guarded, g, pair.prompt[state.num_tokens:state.num_tokens + c], state))
    assert state.num_tokens == PROMPT
    pair.picks.natural = {k: dict(v) for k, v in pair.prompt_picks.items()}
    check(pair, torch.cat(outs), pair.prompt, pair.ref)


def test_decode_150_steps_crossing_128_multiples(pair):
    g, m = pair.guard, pair.guarded
    g.reset()
    start = 250                                  # positions 250..399 cross 256 and 384
    state = m.new_state()
    logits = [run(m, g, pair.prompt[:start], state)]
    nxt = logits[0][-1:].argmax(-1)
    tokens = [pair.prompt[:start]]
    for _ in range(150):
        tokens.append(nxt)
        logits.append(run(m, g, nxt, state))
        nxt = logits[-1].argmax(-1)
    ids = torch.cat(tokens)
    check(pair, torch.cat(logits), ids)          # one full HF forward over prompt + generated
    # the guard changes nothing: plain reference ops give bit-identical logits
    st2 = pair.ours.new_state()
    assert torch.equal(pair.ours.logits(pair.ours(ids[:start], st2)), logits[0])
    assert torch.equal(pair.ours.logits(pair.ours(ids[start:start + 1], st2)), logits[1])
