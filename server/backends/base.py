"""What the gateway talks to: one sample in, a stream of token-id events out.

The gateway (``server.gateway.app``) turns an OpenAI request into ``GenRequest`` samples and consumes
``TokenEvent`` streams; it never sees workers. Two backends implement ``Backend``:

- ``server.backends.pd.PDBackend``: the P/D path (decode reserves, prefill computes and pushes state,
  decode streams), over ZMQ to ``launch-pd`` workers.
- ``server.backends.local.LocalBackend``: one in-process ``LLMEngine`` on a thread (tests, benchmarks).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.sampling_params import Sampled, SamplingParams


class BackendError(RuntimeError):
    """A sample could not be served. ``status`` is the HTTP status the gateway answers with
    (400 bad request, 429 overloaded, 503 no healthy instance / no capacity, 502 a worker failed,
    504 timed out)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenRequest:
    """One sample. ``request_id`` is unique per sample and never reused (it is the transfer id).
    ``params.seed`` is set (the gateway draws one when the client gave none) so both legs agree.
    ``deadline``: ``time.monotonic()`` after which the sample is aborted with 504 (None: none)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None = None


@dataclass
class TokenEvent:
    """New tokens of one sample. ``logprobs`` (when requested) has one ``Sampled`` per token id.
    The last event has ``finished`` True and ``finish_reason`` in {"stop", "length", "abort"}.
    ``first_token_time`` / ``queue_time_s`` are set on the first event (monotonic seconds)."""

    token_ids: list[int]
    logprobs: list[Sampled] | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    queue_time_s: float | None = None
    extra: dict = field(default_factory=dict)
    num_cached_tokens: int = 0          # first event: prompt tokens the prefix cache served


class Backend(Protocol):
    """Serves samples. ``generate`` raises ``BackendError`` before its first event when the sample
    cannot start; a failure after that ends the stream with ``BackendError``. Cancelling the
    iterator (client gone) aborts the sample everywhere and frees its state."""

    def generate(self, req: GenRequest) -> AsyncIterator[TokenEvent]: ...

    async def health(self) -> dict: ...

    @property
    def max_model_len(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
