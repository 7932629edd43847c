"""Sampler: parameter checks, each transform's math, seeded draws independent of the batch, the
device-side result and its noise."""
from __future__ import annotations

import math

import pytest
import torch

from engine.core.sampling_params import SampleRow, SamplingError, SamplingParams, position_seed
from engine.core.sampler import exponential_noise, noise_key, sample, sample_device, unpack


def _row(params, position=10, prompt=(), output=()):
    return SampleRow(params, position, list(prompt), list(output))


@pytest.mark.parametrize("kw, field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"), (dict(min_p=1.5), "min_p"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed="7"), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(SamplingError, match=f"^{field}:"):
        SamplingParams(**kw)


def test_greedy_top_k1_and_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert sample(logits, [_row(SamplingParams(temperature=0))])[0].token_id == 1      # lowest id on ties
    distinct = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    for seed in range(20):
        assert sample(distinct, [_row(SamplingParams(top_k=1, seed=seed))])[0].token_id == 1


def test_top_p_min_p_top_k_masks():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    seen = {sample(logits, [_row(SamplingParams(top_p=0.8, seed=s), position=p)])[0].token_id
            for s in range(10) for p in range(30)}
    assert seen == {0, 1}                                      # 0.5 + 0.3 reaches 0.8
    seen = {sample(logits, [_row(SamplingParams(min_p=0.35, seed=s), position=p)])[0].token_id
            for s in range(10) for p in range(30)}
    assert seen == {0, 1}                                      # 0.15 < 0.35 * 0.5
    seen = {sample(logits, [_row(SamplingParams(top_k=3, seed=s), position=p)])[0].token_id
            for s in range(10) for p in range(30)}
    assert seen == {0, 1, 2}


def test_draw_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log()[None]
    n = 4000
    counts = torch.zeros(4)
    for p in range(n):
        counts[sample(logits, [_row(SamplingParams(seed=123), position=p)])[0].token_id] += 1
    # each count within 5 standard deviations of n * p
    sd = (n * probs * (1 - probs)).sqrt()
    assert ((counts - n * probs).abs() < 5 * sd).all(), counts


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    def freq0(t):
        return sum(sample(logits, [_row(SamplingParams(temperature=t, seed=1), position=p)])[0].token_id == 0
                   for p in range(600)) / 600
    assert freq0(0.2) > 0.95 and 0.4 < freq0(1.0) < 0.8 and freq0(5.0) < 0.5


def test_penalties_math():
    # repetition (prompt + output): positive logits divided, negative multiplied; presence and
    # frequency (output only): logit - freq * count - presence * [count > 0]  (vLLM semantics)
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9]])
    rp = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [_row(rp, prompt=[0])])[0].token_id == 3               # 2.0/2 < 1.9
    fp = SamplingParams(temperature=0, frequency_penalty=0.06)
    assert sample(logits, [_row(fp, output=[0, 0])])[0].token_id == 3           # 2.0 - 0.12 < 1.9
    assert sample(logits, [_row(fp, output=[0])])[0].token_id == 0               # 1.94 > 1.9
    pp = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sample(logits, [_row(pp, output=[0, 0, 0])])[0].token_id == 3         # 1.8 < 1.9
    assert sample(logits, [_row(pp, prompt=[0])])[0].token_id == 0               # prompt tokens not counted


def test_logprobs_are_raw_log_softmax_sorted():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    res = sample(logits, [_row(SamplingParams(temperature=0.7, seed=3, logprobs=5, repetition_penalty=1.5),
                               prompt=[1, 2])])[0]
    ref = torch.log_softmax(logits[0], -1)
    assert res.logprob == float(ref[res.token_id])
    assert [t for t, _ in res.top_logprobs] == ref.argsort(descending=True)[:5].tolist()
    assert all(math.isclose(v, float(ref[t])) for t, v in res.top_logprobs)
    assert sample(logits, [_row(SamplingParams(logprobs=0))])[0].top_logprobs == []
    assert sample(logits, [_row(SamplingParams())])[0].logprob is None


def test_seeded_draw_independent_of_batch_and_order():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 1000, generator=g)
    rows = [_row(SamplingParams(temperature=1.0, top_p=0.9, seed=s), position=100 + s) for s in range(6)]
    together = [x.token_id for x in sample(logits, rows)]
    alone = [sample(logits[i:i + 1], [rows[i]])[0].token_id for i in range(6)]
    reversed_ = [x.token_id for x in sample(logits.flip(0), rows[::-1])][::-1]
    assert together == alone == reversed_
    # the draw depends on (seed, position) only
    assert position_seed(7, 3) == position_seed(7, 3) != position_seed(7, 4) != position_seed(8, 3)


def test_unseeded_requests_get_a_seed_at_admission():
    p = SamplingParams(temperature=1.0).with_seed()
    assert isinstance(p.seed, int) and p.with_seed() is p


def _mixed_rows():
    P = SamplingParams
    return [_row(P(temperature=0), 5), _row(P(temperature=0.8, top_k=40, seed=1), 6),
            _row(P(temperature=1.2, top_p=0.7, min_p=0.01, seed=2, logprobs=3), 7),
            _row(P(temperature=0, repetition_penalty=1.3, logprobs=0), 8, prompt=[3, 9], output=[4]),
            _row(P(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, seed=3), 9, output=[7, 7, 2]),
            _row(P(temperature=0.5, top_k=3, top_p=0.5, seed=4, logprobs=20), 10)]


def test_mixed_batch_at_the_real_vocab_equals_each_row_alone():
    # greedy, drawn, penalised and logprob rows in one batch of DeepSeek-V4's 129,280-entry rows:
    # every field of every row (id, logprob, alternatives) equals that row sampled alone
    logits = torch.randn(6, 129280, generator=torch.Generator().manual_seed(5)) * 4
    rows = _mixed_rows()
    together = sample(logits, rows)
    assert together == [sample(logits[i:i + 1], [r])[0] for i, r in enumerate(rows)]
    assert together[::-1] == sample(logits.flip(0), rows[::-1])
    assert [len(x.top_logprobs) if x.top_logprobs is not None else None for x in together] == \
        [None, None, 3, 0, None, 20]
    assert together[0].token_id == int(logits[0].argmax())


def test_one_small_result_per_step_and_non_finite_rows_flagged():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(6))
    logits[4, 17] = float("nan")
    res = sample_device(logits, _mixed_rows())
    assert res.shape == (6, 3 + 2 * 20) and res.dtype == torch.float32      # widest logprobs ask: 20
    sampled, finite = unpack(res.tolist(), _mixed_rows())
    assert finite == [True, True, True, True, False, True]
    assert [s.token_id for s in sampled] == res[:, 0].long().tolist()
    with pytest.raises(ValueError, match="2\\^24"):
        sample_device(torch.zeros(1, 1 << 24), [_row(SamplingParams())])


def test_more_alternatives_than_the_vocab_returns_the_whole_vocab():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    res = sample(logits, [_row(SamplingParams(temperature=0, logprobs=20))])[0]
    assert [t for t, _ in res.top_logprobs] == [1, 2, 0]


def test_a_top_p_below_fp32_range_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    for seed in range(10):
        assert sample(logits, [_row(SamplingParams(top_p=1e-46, seed=seed), position=seed)])[0].token_id == 2


def test_top_logprobs_ties_by_token_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]])
    res = sample(logits, [_row(SamplingParams(temperature=0, logprobs=4))])[0]
    assert res.token_id == 1 and [t for t, _ in res.top_logprobs] == [1, 3, 5, 2]


def test_noise_is_a_pure_positive_function_of_the_key():
    keys = torch.tensor([noise_key(position_seed(7, p)) for p in range(4)], dtype=torch.int32)
    e = exponential_noise(keys, 50000)
    assert torch.equal(e, exponential_noise(keys, 50000))
    assert torch.equal(e[2:3], exponential_noise(keys[2:3], 50000))          # row by row
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    # Exp(1): mean and variance 1; rows with different keys are unrelated
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.03
    assert abs(float(torch.corrcoef(e[:2])[0, 1])) < 0.02
    assert noise_key(0) == 0 and noise_key((1 << 63) - 1) == -1
