"""Sampling parameters (torch-free: the gateway validates them without loading torch).

Semantics follow vLLM's ``SamplingParams`` (the OpenAI parameters): penalties first (repetition
over prompt + output, frequency / presence over the output), then temperature, top-k, top-p and
min-p, then a draw. Randomness is a pure function of ``(seed, position)``: the draw for the token
at sequence position p uses a generator seeded from both, so a sample's tokens do not depend on
the rest of the batch, on chunking, on preemption (recompute) or on which process samples it
(prefill samples token #1, decode the rest). The sampler is ``engine.core.sampler``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STRUCTURED_CHARS = 1 << 20      # a structural tag's JSON text (a long tool list fits)
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
    ``structured``: the output constraint as an xgrammar structural tag (JSON text), enforced by
    constrained decoding (``engine.core.grammar``); None: unconstrained.
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
    structured: str | None = None

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
        if self.structured is not None and not (isinstance(self.structured, str) and self.structured.startswith("{")
                                                and len(self.structured) <= MAX_STRUCTURED_CHARS):
            raise SamplingError(f"structured: must be null or a JSON object text of at most {MAX_STRUCTURED_CHARS} "
                                f"characters")      # not echoed: it can be that long
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
