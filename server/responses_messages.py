"""POST /v1/responses (OpenAI Responses) and POST /v1/messages (Anthropic Messages).

Both are one sample each, converted, rendered and shaped by DeepSeek's format library
(``server.dsformat``): its Responses events (reasoning items, output_text, function_call items,
usage with reasoning tokens) and its Messages events (thinking / text / tool_use content blocks,
``stop_reason``) are sent as they come, ``event:`` line included; a non-streamed request gets the
recipe's accumulated response object. The gateway adds the sampling extras (seed over the 64-bit
range, top_k, min_p, repetition_penalty), the context check and its error shapes: OpenAI's for
Responses (an ``error`` event mid-stream), Anthropic's for Messages (``event: error``).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import deepseek_recipe as dr

from server.chat_completions import recipe_sampling
from server.dsformat import DeepSeekFormat
from server.jobs import Job, Piece, Sample, refuse_not_done, sample_seed, sampling_params, sse
from server.protocol import ApiError, MessagesRequest, ResponsesRequest, anthropic_error_body
from server.recipe_stream import RecipeAssembler


# fields of the other APIs a client may send here by mistake, and what asks for an output format
_NOT_HERE = {"responses": {"max_tokens": (None,), "max_completion_tokens": (None,)},
             "messages": {"output_format": (None,), "response_format": (None, {"type": "text"})}}


def _prepare(api: str, req, fmt: DeepSeekFormat, tokenizer, max_model_len: int, prefix: str, field: str):
    body = req.model_dump(exclude_unset=True)
    refuse_not_done(body, _NOT_HERE[api])
    fmt_cfg = body.get("output_config")
    if api == "messages" and isinstance(fmt_cfg, dict) and fmt_cfg.get("format") is not None:
        raise ApiError("output_config.format: a structured output needs constrained decoding, which this server "
                       "does not do yet", 400, "output_config.format")
    cr, extras = fmt.convert(api, body)
    ids = fmt.encode(cr, max_model_len, field)
    max_new = fmt.max_tokens(cr, len(ids), max_model_len, field,
                             "max_output_tokens" if api == "responses" else "max_tokens")
    logprobs = None
    if api == "responses" and (body.get("top_logprobs") or 0) > 0:
        raise ApiError("top_logprobs: not supported on /v1/responses (use /v1/chat/completions)", 400,
                       "top_logprobs")
    rid = f"{prefix}{uuid.uuid4().hex}"
    sample = Sample(0, 0, f"{rid}-0", sampling_params(recipe_sampling(body, cr), max_new, logprobs,
                                                      sample_seed(req.seed, 0)))
    return rid, ids, sample, cr, extras


def prepare_responses(req: ResponsesRequest, fmt: DeepSeekFormat, tokenizer, max_model_len: int) -> ResponsesJob:
    """Validate and convert a Responses request. Raises ApiError (400 naming the field / the recipe's message)."""
    if req.previous_response_id is not None:
        raise ApiError("previous_response_id: this server keeps no responses (send the whole input)", 400,
                       "previous_response_id")
    rid, ids, sample, cr, extras = _prepare("responses", req, fmt, tokenizer, max_model_len, "resp_", "input")
    return ResponsesJob(rid, int(time.time()), fmt.model_name, [ids], [sample], cr.stream, fmt=fmt, request=cr,
                        extras=extras, special_ids=frozenset((tokenizer.bos_id, tokenizer.eos_id)),
                        decode=tokenizer.decode)


def count_message_tokens(req, fmt: DeepSeekFormat, max_model_len: int) -> dict:
    """POST /v1/messages/count_tokens: ``{"input_tokens": N}``, the prompt ids a Messages request
    would send (Anthropic's endpoint; Claude Code asks it). Raises ApiError as ``prepare_messages``."""
    cr, _ = fmt.convert("messages", req.model_dump(exclude_unset=True))
    return {"input_tokens": len(fmt.encode(cr, max_model_len, "messages"))}


def prepare_messages(req: MessagesRequest, fmt: DeepSeekFormat, tokenizer, max_model_len: int) -> MessagesJob:
    """Validate and convert a Messages request. Raises ApiError (400 naming the field / the recipe's message)."""
    rid, ids, sample, cr, extras = _prepare("messages", req, fmt, tokenizer, max_model_len, "msg_", "messages")
    return MessagesJob(rid, int(time.time()), fmt.model_name, [ids], [sample], cr.stream, fmt=fmt, request=cr,
                       extras=extras, special_ids=frozenset((tokenizer.bos_id, tokenizer.eos_id)),
                        decode=tokenizer.decode)


@dataclass
class _RecipeJob(Job):
    """One sample whose events are the recipe's, sent as they come."""

    fmt: DeepSeekFormat = None
    request: dr.ConversationRequest = None
    extras: dict = None
    special_ids: frozenset[int] = frozenset()      # BOS / EOS: counted, never output as text
    decode: object = None                            # the tokenizer's ids -> text

    api = ""
    response_cls = None

    def __post_init__(self):
        self.sent = 0                       # events sent (Responses numbers its events from 0)

    def assembler(self, sample: Sample) -> RecipeAssembler:
        acc = None if self.stream else self.response_cls(self.id, self.model, self.created, len(self.prompts[0]), 0)
        return RecipeAssembler(self.fmt.processor(self.api, self.request, self.id, self.extras or {}),
                               len(self.prompts[0]), acc, self.special_ids, decode=self.decode,
                               reasoning_from_start=self.fmt.starts_in_reasoning(self.request),
                               think_end_id=self.fmt.think_end_id)

    def events(self, sample: Sample, p: Piece) -> list[str]:
        name = self.response_cls.sse_event_name
        self.sent += len(p.chunks)
        out = [(c.to_json(), name(c)) for c in p.chunks]
        if p.finish_reason is not None:
            out = [(self._fix_usage(data, p.reasoning_tokens), ev) for data, ev in out]
        return [sse(data, ev) for data, ev in out]

    def _fix_usage(self, data: str, reasoning: int) -> str:
        """An event's usage with the reasoning tokens counted from the ids (Responses reports them)."""
        return data

    def body(self, asms) -> dict:
        return json.loads(self._fix_usage(asms[0].response.to_json(), asms[0].reasoning_tokens))


@dataclass
class ResponsesJob(_RecipeJob):
    kind = "responses"
    api = "responses"
    response_cls = dr.ResponsesResponse

    def _fix_usage(self, data: str, reasoning: int) -> str:
        if '"output_tokens_details"' not in data:
            return data
        d = json.loads(data)
        u = (d.get("response") or d).get("usage")
        if not (u and isinstance(u.get("output_tokens_details"), dict)):
            return data
        u["output_tokens_details"]["reasoning_tokens"] = reasoning
        return json.dumps(d, ensure_ascii=False)

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        return [sse({"type": "error", "code": str(status), "message": message, "param": param,
                     "sequence_number": self.sent}, "error")]


@dataclass
class MessagesJob(_RecipeJob):
    kind = "messages"
    api = "messages"
    response_cls = dr.MessagesResponse

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        return [sse(anthropic_error_body(message, status), "error")]
