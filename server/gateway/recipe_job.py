"""The half the Responses and Messages APIs share: a request converted, rendered and encoded by
DeepSeek's format library (``server.gateway.dsformat``), and a one-sample job whose events are the
recipe's own (Responses events; Messages content blocks), sent as they come, ``event:`` line included.
A non-streamed request gets the recipe's accumulated response object.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import deepseek_recipe as dr

from server.gateway.chat_completions import recipe_sampling
from server.gateway.dsformat import DeepSeekFormat
from server.gateway.jobs import Job, Piece, Sample, refuse_not_done, sample_seed, sampling_params, sse
from server.gateway.protocol import ApiError
from server.gateway.recipe_stream import RecipeAssembler
from server.gateway.structured import structural_tag


# fields of the other APIs a client may send here by mistake, and what asks for an output format
_NOT_HERE = {"responses": {"max_tokens": (None,), "max_completion_tokens": (None,)},
             "messages": {"response_format": (None, {"type": "text"})}}


def prepare_recipe(job_cls: type, req, fmt: DeepSeekFormat, tokenizer, max_model_len: int, prefix: str,
                   field: str):
    """Convert, render and encode a ``responses`` / ``messages`` request (``job_cls.api``) into its
    one-sample job (``job_cls``, a ``RecipeJob``; request id ``prefix`` + hex). Raises ApiError (400
    naming the field, or the recipe's message; the context check)."""
    api = job_cls.api
    body = req.model_dump(exclude_unset=True)
    refuse_not_done(body, _NOT_HERE[api])
    cr, extras = fmt.convert(api, body)
    ids = fmt.encode(cr, max_model_len, field)
    max_new = fmt.max_tokens(cr, len(ids), max_model_len, field,
                             "max_output_tokens" if api == "responses" else "max_tokens")
    logprobs = None
    if api == "responses" and (body.get("top_logprobs") or 0) > 0:
        raise ApiError("top_logprobs: not supported on /v1/responses (use /v1/chat/completions)", 400,
                       "top_logprobs")
    rid = f"{prefix}{uuid.uuid4().hex}"
    structured, field = structural_tag(api, cr, body, fmt.starts_in_reasoning(cr), fmt.marker_ids)
    sample = Sample(0, 0, f"{rid}-0", sampling_params(recipe_sampling(body, cr), max_new, logprobs,
                                                      sample_seed(req.seed, 0), structured=structured))
    return job_cls(rid, int(time.time()), fmt.model_name, [ids], [sample], cr.stream, fmt=fmt, request=cr,
                   extras=extras, special_ids=frozenset((tokenizer.bos_id, tokenizer.eos_id)), decode=tokenizer.decode,
                   constraint_field=field)


@dataclass
class RecipeJob(Job):
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
