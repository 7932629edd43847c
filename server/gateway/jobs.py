"""A validated request as the gateway runs it: a ``Job`` of ``Sample`` s, each fed by one backend stream.

No I/O here. Each endpoint module builds a ``Job`` subclass (``server.gateway.completions``,
``server.gateway.chat_completions``, ``server.gateway.responses``, ``server.gateway.messages``) whose
methods shape the output:
``assembler`` (one per sample: token events -> ``Piece`` s), ``head`` / ``events`` / ``tail`` (SSE text
of a stream), ``error_events`` (a failure after the headers went out) and ``body`` (the non-streamed
response). ``server.gateway.app`` drives them the same way for every endpoint.

Seeds: every sample's ``SamplingParams.seed`` is set (both P/D legs must draw alike). With a
client ``seed`` s, choice i uses ``(s + i) mod 2**64`` (vLLM v1's rule for n > 1), so choice i of
an n-sample request equals a single request with seed s + i. Without one, each sample draws a
random 63-bit seed.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.sampling_params import SamplingError, SamplingParams
from server.backends.base import BackendError, TokenEvent
from server.gateway.protocol import MAX_STOP, MAX_STOP_CHARS, ApiError

_U64 = 1 << 64


@dataclass(frozen=True)
class Sample:
    """One choice: ``index`` in the response, ``prompt_index`` into ``Job.prompts``."""

    index: int
    prompt_index: int
    request_id: str
    params: SamplingParams


@dataclass
class Piece:
    """What one event of one sample adds. ``text`` / ``logprobs``: completions; ``chunks``: the
    recipe's chunks / events (streamed chat, Responses, Messages); ``finish_reason`` set on the
    last piece; ``num_tokens`` new tokens, ``total_tokens`` so far, ``token_ids`` the new ids;
    ``reasoning_tokens``: reasoning tokens so far, counted from the ids (``RecipeAssembler``)."""

    text: str = ""
    logprobs: dict | None = None
    chunks: list = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    total_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    reasoning_tokens: int = 0


class Assembler(Protocol):
    """One sample's token events -> pieces. ``finished`` turns True on the piece carrying
    ``finish_reason`` ("stop" / "length" / "abort", the backend's reasons); ``stopped_by_string``
    means the gateway must close the backend stream (aborting the sample)."""

    num_tokens: int
    finish_reason: str | None
    stopped_by_string: bool

    @property
    def finished(self) -> bool: ...

    def feed(self, ev: TokenEvent) -> Piece: ...

    def abort(self, reason: str = "abort") -> Piece: ...


@dataclass
class Job:
    """A validated request. ``prompts``: token ids of each distinct prompt (chat: one)."""

    id: str
    created: int
    model: str
    prompts: list[list[int]]
    samples: list[Sample]
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False      # vLLM extra: ids beside the text
    cached: dict[int, int] = field(default_factory=dict)   # prompt index -> prefix-cache tokens
    constraint_field: str = "response_format"   # the request field an output constraint comes from

    kind = "job"                        # the endpoint, for logs
    media_type = "text/event-stream"

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def backend_error(self, e: BackendError) -> Exception:
        """A worker's refusal as the client sees it: an output constraint that does not compile
        (``structured: ...``, a 400 from the worker) names the request field it came from."""
        msg = str(e)
        if e.status == 400 and msg.startswith("structured: "):
            f = self.constraint_field
            return ApiError(f"{f}: {msg.removeprefix('structured: ')}", 400, f)
        return e

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served (``cached``: by prompt index, from the first event
        of its first sample)."""
        return sum(self.cached.values())

    def assembler(self, sample: Sample) -> Assembler:
        raise NotImplementedError

    def head(self) -> list[str]:
        """SSE text sent before the first piece."""
        return []

    def events(self, sample: Sample, piece: Piece) -> list[str]:
        raise NotImplementedError

    def tail(self, asms: dict[int, Assembler]) -> list[str]:
        """SSE text after every sample finished."""
        return []

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        raise NotImplementedError

    def body(self, asms: dict[int, Assembler]) -> dict:
        """The non-streamed response once every sample finished (``asms`` by choice index)."""
        raise NotImplementedError


def sse(obj: Any, event: str | None = None) -> str:
    """One SSE message (``event:`` line when named); ``obj`` is a dict or already JSON text."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
          cached_tokens: int = 0) -> dict:
    """OpenAI usage; ``completion_tokens_details.reasoning_tokens`` when the mode reports it,
    ``prompt_tokens_details.cached_tokens``: prompt tokens whose state the prefix cache served."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return u


def sample_seed(seed: int | None, i: int) -> int:
    """Seed of choice ``i``: ``(seed + i) mod 2**64``, or a random 63-bit one when ``seed`` is None."""
    return random.getrandbits(63) if seed is None else (seed + i) % _U64


def sampling_params(fields: dict[str, Any], max_new_tokens: int, logprobs: int | None, seed: int,
                    logprobs_field: str = "logprobs", structured: str | None = None) -> SamplingParams:
    """``SamplingParams`` from request fields (None / absent: the engine's default) and the output
    constraint the gateway built (``server.gateway.structured``; never a request field).

    Raises:
        ApiError: 400 naming the field of a value the sampler refuses.
    """
    def opt(name, default):
        v = fields.get(name)
        return default if v is None else v
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=opt("temperature", 1.0), top_p=opt("top_p", 1.0),
            top_k=opt("top_k", -1), min_p=opt("min_p", 0.0), presence_penalty=opt("presence_penalty", 0.0),
            frequency_penalty=opt("frequency_penalty", 0.0), repetition_penalty=opt("repetition_penalty", 1.0),
            seed=seed, stop_token_ids=tuple(fields.get("stop_token_ids") or ()),
            ignore_eos=bool(fields.get("ignore_eos")), logprobs=logprobs, structured=structured)
    except SamplingError as e:
        msg = str(e)
        name = msg.split(":", 1)[0]
        name = {"max_new_tokens": "max_tokens", "logprobs": logprobs_field}.get(name, name)
        raise ApiError(name + msg[msg.find(":"):] if ":" in msg else msg, 400, name) from None


def check_common(req, max_n: int) -> None:
    """Checks of the OpenAI sampling fields that do not depend on the prompt; ApiError naming the field."""
    if not 1 <= req.n <= max_n:
        raise ApiError(f"n: must be in [1, {max_n}], got {req.n}", 400, "n")
    if req.seed is not None and not -(1 << 63) <= req.seed < _U64:
        raise ApiError(f"seed: must be a 64-bit integer, got {req.seed}", 400, "seed")
    if req.min_tokens > 0:
        raise ApiError("min_tokens: not supported by this server (use 0)", 400, "min_tokens")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options: only allowed when stream is true", 400, "stream_options")
    if req.logit_bias:
        for k, v in req.logit_bias.items():
            if not k.lstrip("-").isdigit() or int(k) < 0:
                raise ApiError(f"logit_bias: keys must be token ids, got {k!r}", 400, "logit_bias")
            if not -100 <= v <= 100:
                raise ApiError(f"logit_bias: values must be in [-100, 100], got {v} for {k!r}", 400, "logit_bias")
        raise ApiError("logit_bias: not supported by this server", 400, "logit_bias")
    check_stops(req.stop, "stop")


def check_stops(stop, name: str) -> tuple[str, ...]:
    """Validate stop strings (a string or a list of them); the non-empty ones. ApiError naming ``name``."""
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise ApiError(f"{name}: must be a string or a list of strings", 400, name)
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP:
        raise ApiError(f"{name}: at most {MAX_STOP} stop strings, got {len(stops)}", 400, name)
    for j, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            f = name if isinstance(stop, str) else f"{name}[{j}]"
            raise ApiError(f"{f}: at most {MAX_STOP_CHARS} characters, got {len(s)}", 400, name)
    return tuple(s for s in stops if s)


# Request fields that would change the output but that this server does not do; each is a 400
# naming it rather than silently ignored (vLLM's extras included). Value: the values that mean
# "not asked" (left alone).
_NOT_DONE = {"guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
             "structured_outputs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
             "prompt_logprobs": (None,), "use_beam_search": (None, False), "truncate_prompt_tokens": (None,),
             "logits_processors": (None, []), "functions": (None, []), "function_call": (None,),
             "continue_final_message": (None, False), "add_generation_prompt": (None, True)}
_HINTS = {"functions": "use tools", "function_call": "use tool_choice",
          "continue_final_message": "end the messages with an assistant message with \"prefix\": true",
          "add_generation_prompt": "the assistant turn is always opened",
          "max_tokens": "use max_output_tokens", "max_completion_tokens": "use max_output_tokens",
          **{k: "use response_format" for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                                "structured_outputs")},
          "response_format": "structured outputs are served on /v1/chat/completions, /v1/responses and /v1/messages"}


def refuse_not_done(body: dict[str, Any], extra: dict[str, tuple] | None = None) -> None:
    """ApiError 400 naming the first field of ``body`` that asks for something this server does
    not do (``_NOT_DONE``, plus ``extra``: field -> values that mean "not asked")."""
    for k, neutral in {**_NOT_DONE, **(extra or {})}.items():
        if k in body and body[k] not in neutral:
            hint = _HINTS.get(k, "")
            raise ApiError(f"{k}: not supported by this server" + (f" ({hint})" if hint else ""), 400, k)


def check_logprobs(logprobs: bool, top_logprobs: int | None, max_logprobs: int) -> int | None:
    """Chat-style logprobs / top_logprobs -> alternatives per token (None: no logprobs)."""
    if top_logprobs is not None:
        if not logprobs:
            raise ApiError("top_logprobs: requires logprobs=true", 400, "top_logprobs")
        if not 0 <= top_logprobs <= max_logprobs:
            raise ApiError(f"top_logprobs: must be in [0, {max_logprobs}], got {top_logprobs}", 400, "top_logprobs")
    return (top_logprobs or 0) if logprobs else None
