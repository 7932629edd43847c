"""Sampling parameters and the sampler.

Semantics follow vLLM's ``SamplingParams`` (the OpenAI parameters): penalties first (repetition
over prompt + output, frequency / presence over the output), then temperature, top-k, top-p and
min-p, then a draw. Randomness is a pure function of ``(seed, position)``: the draw for the token
at sequence position p uses a generator seeded from both, so a sample's tokens do not depend on
the rest of the batch, on chunking, on preemption (recompute) or on which process samples it
(prefill samples token #1, decode the rest). Every step of the sampler is row-wise.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM names and ranges).

    temperature 0 is greedy. top_k -1 (or 0) disables top-k. ``logprobs``: None for none, else
    the number of top alternatives (0..20) returned beside the chosen token's logprob.
    ``seed`` None: the engine draws one at admission (so the P/D split still agrees).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise SamplingError(f"{name}: {rule}, got {getattr(self, name)!r}")

        def num(name):
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        def integer(name):
            v = getattr(self, name)
            return isinstance(v, int) and not isinstance(v, bool)

        need(integer("max_new_tokens") and self.max_new_tokens >= 1, "max_new_tokens", "must be an integer >= 1")
        need(num("temperature") and 0 <= self.temperature <= 100, "temperature", "must be in [0, 100]")
        need(num("top_p") and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(integer("top_k") and self.top_k >= -1, "top_k", "must be an integer >= -1 (-1 or 0 disables)")
        need(num("min_p") and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(num("presence_penalty") and -2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(num("frequency_penalty") and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "must be in [-2, 2]")
        need(num("repetition_penalty") and 0 < self.repetition_penalty <= 100, "repetition_penalty",
             "must be in (0, 100]")
        need(self.seed is None or (integer("seed") and -(1 << 63) <= self.seed < (1 << 64)), "seed",
             "must be a 64-bit integer or null")
        need(isinstance(self.stop_token_ids, (tuple, list)) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "must be a list of non-negative integers")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        need(self.logprobs is None or (integer("logprobs") and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"must be null or an integer in [0, {MAX_LOGPROBS}]")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """temperature below 1e-5 is greedy (vLLM's rule: smaller ones overflow the softmax)."""
        return self.temperature < _GREEDY_EPS

    def with_seed(self) -> "SamplingParams":
        """A copy with a drawn seed if none was given (fixes the draws of this request)."""
        if self.seed is not None:
            return self
        return SamplingParams(**{**self.__dict__, "seed": random.getrandbits(63)})


def position_seed(seed: int, position: int) -> int:
    """63-bit generator seed for the draw at ``position`` (splitmix64 of seed and position)."""
    z = ((seed & _MASK64) + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SampleRow:
    """What the sampler needs of one sequence: its params, position and token history."""

    params: SamplingParams
    position: int                 # sequence position of the token being sampled
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class Sampled:
    """One row's result: the token, its logprob and the top alternatives (raw model logprobs)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


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
