"""The sampler (vLLM semantics; parameters in ``engine.core.sampling_params``).

Penalties first (repetition over prompt + output, frequency / presence over the output), then
temperature, top-k, top-p and min-p, then an exponential-race draw from a generator seeded by
``(seed, position)``. Every step is row-wise, so a row's token does not depend on the batch.
"""
from __future__ import annotations

import random
import torch

from engine.core.sampling_params import Sampled, SampleRow, SamplingParams, position_seed


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    B, V = logits.shape
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool)
            seen[torch.tensor(r.prompt_ids + r.output_ids, dtype=torch.long)] = True
            row = logits[i]
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, pen, row)
        if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
            counts = torch.bincount(torch.tensor(r.output_ids, dtype=torch.long), minlength=V)[:V].float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled probabilities ``[V]`` with top-k / top-p / min-p applied (renormalised)."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_k > 0 and p.top_k < probs.shape[-1]:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sp, order = probs.sort(descending=True, stable=True)
        cum = sp.cumsum(-1) / sp.sum()
        keep_sorted = (cum - sp / sp.sum()) < p.top_p          # keep tokens until mass reaches top_p
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[Sampled]:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` fp32 model logits (not modified).
        rows: B sequences' params, positions and histories.
    Returns:
        B ``Sampled``. logprobs are the model's raw log-softmax (before penalties and temperature),
        as vLLM reports them by default; top alternatives sorted by logprob, ties by token id.
    """
    # one row at a time: a reduction over a whole vocab row is split across threads differently
    # when the batch has one row or many, which would make results depend on the batch
    # on the host: draws are then the same whichever device (or process) produced the logits
    logits = logits.detach().float().cpu()
    penalised = any(r.params.repetition_penalty != 1.0 or r.params.frequency_penalty or r.params.presence_penalty
                    for r in rows)
    work = _apply_penalties(logits.clone(), rows) if penalised else logits
    out = []
    for i, r in enumerate(rows):
        p = r.params
        raw_lp = torch.log_softmax(logits[i], dim=-1) if p.logprobs is not None else None
        if p.greedy:
            tok = int(torch.argmax(work[i]))                    # first maximum: lowest id on ties
        else:
            probs = _filter(work[i], p)
            seed = p.seed if p.seed is not None else random.getrandbits(63)     # unseeded: not reproducible
            g = torch.Generator(device="cpu").manual_seed(position_seed(seed, r.position))
            u = torch.rand(probs.shape[-1], generator=g, dtype=torch.float64)
            race = probs.double() / -torch.log1p(-u)            # exponential race: P(tok) = probs[tok]
            tok = int(torch.argmax(race))
        res = Sampled(tok)
        if p.logprobs is not None:
            res.logprob = float(raw_lp[tok])
            if p.logprobs:
                vals, ids = torch.sort(raw_lp, descending=True, stable=True)
                res.top_logprobs = [(int(t), float(v)) for t, v in zip(ids[:p.logprobs], vals[:p.logprobs])]
            else:
                res.top_logprobs = []
        out.append(res)
    return out
