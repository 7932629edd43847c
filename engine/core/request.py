"""A request inside the engine: its tokens, progress and timing, and when it finishes."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from collections.abc import Callable, Collection

from engine.core.sampling_params import Sampled, SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take; the message names the field (prompt, max_new_tokens, ...)."""


def check_request(request_id, prompt_ids, params, output_ids, vocab_size: int, max_model_len: int,
                  in_use: Callable[[str], bool]) -> None:
    """A new request's fields (``LLMEngine.add_request`` / ``reserve``): a free non-empty string
    id (``in_use``: whether the engine holds it), a ``SamplingParams``, token-id lists in
    ``[0, vocab_size)``, a non-empty prompt leaving room under ``max_model_len``, and fewer
    ``output_ids`` (a migrated stream's) than ``max_new_tokens``. Raises RequestError naming it."""
    if not isinstance(request_id, str) or not request_id:
        raise RequestError(f"request_id: must be a non-empty string, got {request_id!r}")
    if in_use(request_id):
        raise RequestError(f"request_id: {request_id!r} is in use (queued, running, held or finishing)")
    if not isinstance(params, SamplingParams):
        raise RequestError("sampling_params: must be a SamplingParams")
    for name, ids in (("prompt", prompt_ids), ("output_ids", output_ids)):
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"{name}: must be a list of token ids, got {type(ids).__name__}")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise RequestError(f"{name}: token ids must be Python ints, got {type(bad).__name__} {bad!r}")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"{name}: token id {bad} is not in [0, {vocab_size})")
    if not prompt_ids:
        raise RequestError("prompt: must contain at least one token")
    if len(prompt_ids) + len(output_ids) >= max_model_len:
        raise RequestError(f"prompt: {len(prompt_ids) + len(output_ids)} tokens leave no room to generate "
                           f"within the context limit max_model_len={max_model_len}")
    if len(output_ids) >= params.max_new_tokens:
        raise RequestError(f"output_ids: {len(output_ids)} tokens already reach max_new_tokens")


class SeqStatus(enum.Enum):
    WAITING = "waiting"          # queued (new, or preempted and waiting to recompute)
    RUNNING = "running"          # holds decode state: prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"                # EOS or a stop token id
    LENGTH = "length"            # max_new_tokens or the context limit
    ABORT = "abort"              # aborted by the caller


def finish_reason(token_id: int, num_output: int, num_tokens: int, params: SamplingParams,
                  eos_ids: Collection[int], max_model_len: int) -> FinishReason | None:
    """Whether a sample ends with ``token_id``, its ``num_output``-th generated token, which makes
    its sequence ``num_tokens`` tokens (prompt + output) long: STOP on an EOS id (unless
    ``params.ignore_eos``) or one of ``params.stop_token_ids``; else LENGTH at ``max_new_tokens``
    or at the context limit ``max_model_len``; else None. The one rule for the in-process engine
    and for a prefill worker deciding on token #1 (P/D must end where in-process does)."""
    if (token_id in eos_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
        return FinishReason.STOP
    if num_output >= params.max_new_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


@dataclass
class Sequence:
    """One sample: prompt ids, generated ids, and how many tokens the cache holds.

    ``num_computed``: tokens whose decode state is in the cache. The tokens still to run are
    ``all_ids[num_computed:]``: the prompt (or, after preemption, prompt + output to recompute),
    or the last sampled token while decoding.
    """

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    order: int = 0                # admission priority: position in arrival order
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    hold_state: bool = False      # prefill role: keep the state after finishing, for export
    scheduled_time: float | None = None   # first admitted to the running batch (monotonic s)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)   # MTP drafts for the next decode step
    spec_k: int = 0               # drafts the current step verifies (run after the pending token)
    num_cached: int = 0           # tokens whose state came from the prefix cache at admission
    # prefix caching: boundaries to keep once computed, as (tokens, key, chunk hashes), ascending
    snapshots: list[tuple[int, bytes, tuple[bytes, ...]]] = field(default_factory=list)
    matcher: object = None        # constrained decoding: the sample's xgrammar GrammarMatcher (engine.core.grammar)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.num_pending > 1 or not self.output_ids

    def token(self, i: int) -> int:
        """Token ``i`` of prompt + output, then of the drafts."""
        n = len(self.prompt_ids)
        if i < n:
            return self.prompt_ids[i]
        return self.output_ids[i - n] if i - n < len(self.output_ids) else self.draft_ids[i - self.num_tokens]

    def pending_ids(self, count: int) -> list[int]:
        """The next ``count`` tokens to run (past the pending ones: the drafts)."""
        return [self.token(i) for i in range(self.num_computed, self.num_computed + count)]


@dataclass
class RequestOutput:
    """What one engine step produced for one request (new tokens since the last output)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Sampled]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    queue_time_s: float | None = None     # on the first token: arrival -> first scheduled (s)
    num_cached_tokens: int = 0            # prompt tokens whose state came from the prefix cache

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This step's output followed by ``later`` (several accepted tokens in one step)."""
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_logprobs=self.new_logprobs + later.new_logprobs, queue_time_s=self.queue_time_s)


@dataclass
class StepStats:
    """Cumulative wall time (s): scheduling, and running the batch (forward + logits + sampling;
    ``sample_s`` is the sampling part of ``model_s``)."""

    steps: int = 0
    schedule_s: float = 0.0
    model_s: float = 0.0
    sample_s: float = 0.0
    tokens: int = 0
    history: list[tuple[int, int, float, float]] = field(default_factory=list)  # (seqs, tokens, sched_s, model_s)
