"""POST /v1/chat/completions through DeepSeek's format library (``server.gateway.dsformat``).

The recipe converts the request, renders + encodes the prompt and shapes each sample's chunks;
this module adds what a vLLM user expects beyond DeepSeek's API: ``n`` > 1 (one processor per
sample, the chunk's choice ``index`` set to the sample's), ``seed`` over the 64-bit range, vLLM's
sampling extras, ``return_token_ids`` (``prompt_token_ids`` on the first chunk / in each choice,
``token_ids`` per chunk and choice), ``include_stop_str_in_output`` and OpenAI's usage rules
(``stream_options.include_usage``: one last chunk with empty choices and the usage; with vLLM's
``continuous_usage_stats`` too: usage on every chunk; no usage otherwise), with
``completion_tokens_details.reasoning_tokens`` summed over the samples.

Sampling: a temperature / top_p the client sends is used as sent (vLLM's behaviour: greedy and
reproducible evaluation need it); one it leaves out takes the recipe's value for the mode (1.0 in
thinking mode, DeepSeek's top_p for the model version).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import deepseek_recipe as dr

from engine.core.sampling_params import MAX_LOGPROBS
from server.gateway.dsformat import DeepSeekFormat
from server.gateway.jobs import (Job, Piece, Sample, check_common, check_logprobs, check_stops, refuse_not_done,
                                 sample_seed, sampling_params, sse, usage)
from server.gateway.protocol import ApiError, ChatCompletionRequest, error_body
from server.gateway.recipe_stream import RecipeAssembler
from server.gateway.structured import structural_tag


def recipe_sampling(body: dict, cr: dr.ConversationRequest) -> dict:
    """Sampling fields: the request's, with temperature / top_p from the recipe when not sent."""
    io = cr.inference_options
    fields = dict(body)
    if fields.get("temperature") is None:
        fields["temperature"] = io.temperature
    if fields.get("top_p") is None:
        fields["top_p"] = io.top_p
    return fields


def prepare_chat(req: ChatCompletionRequest, fmt: DeepSeekFormat, tokenizer, max_model_len: int,
                 max_n: int) -> ChatJob:
    """Validate, convert (recipe), encode once and build the samples of a chat request.

    Raises:
        ApiError: 400 naming the field for the gateway's checks; the recipe's message for its own.
    """
    check_common(req, max_n)
    if req.echo:
        raise ApiError("echo: not supported for chat completions", 400, "echo")
    logprobs = check_logprobs(req.logprobs, req.top_logprobs, MAX_LOGPROBS)
    stops = check_stops(req.stop, "stop")
    body = req.model_dump(exclude_unset=True)
    refuse_not_done(body)
    cr, _ = fmt.convert("chat", body)
    ids = fmt.encode(cr, max_model_len, "messages")
    max_new = fmt.max_tokens(cr, len(ids), max_model_len, "messages",
                             "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    fields = recipe_sampling(body, cr)
    structured, field = structural_tag("chat", cr, body, fmt.starts_in_reasoning(cr), fmt.marker_ids)
    base = f"chatcmpl-{uuid.uuid4().hex}"
    samples = [Sample(i, 0, f"{base}-{i}", sampling_params(fields, max_new, logprobs, sample_seed(req.seed, i),
                                                           "top_logprobs", structured))
               for i in range(req.n)]
    so = req.stream_options
    special = frozenset((tokenizer.bos_id, tokenizer.eos_id))
    return ChatJob(base, int(time.time()), fmt.model_name, [ids], samples, req.stream,
                   include_usage=bool(so and so.include_usage),
                   continuous_usage=bool(so and so.include_usage and so.continuous_usage_stats),
                   return_token_ids=req.return_token_ids, fmt=fmt, request=cr, stops=stops,
                   include_stop=req.include_stop_str_in_output, special_ids=special, decode=tokenizer.decode,
                   skip_special=req.skip_special_tokens, constraint_field=field)


@dataclass
class ChatJob(Job):
    """A chat request: the recipe's chunks, re-indexed per sample, with OpenAI's usage rules."""

    fmt: DeepSeekFormat = None
    request: dr.ConversationRequest = None
    stops: tuple[str, ...] = ()
    include_stop: bool = False
    special_ids: frozenset[int] = frozenset()
    decode: object = None
    skip_special: bool = True

    kind = "chat"

    def __post_init__(self):
        self._pending_ids: dict[int, list[int]] = {}     # return_token_ids not yet on a chunk
        self._thinking = self.request.parsing_options.thinking_initial_stage is not None

    def assembler(self, sample: Sample) -> RecipeAssembler:
        acc = None if self.stream else dr.ChatCompletionResponse(self.id, self.model, self.created,
                                                                 len(self.prompts[0]), 0)
        return RecipeAssembler(self.fmt.processor("chat", self.request, self.id, {}), len(self.prompts[0]), acc,
                               self.special_ids, self.include_stop, self.stops, self.decode,
                               self.fmt.starts_in_reasoning(self.request), self.fmt.think_end_id, self.skip_special)

    def events(self, sample: Sample, p: Piece) -> list[str]:
        if self.return_token_ids and p.token_ids:
            self._pending_ids.setdefault(sample.index, []).extend(p.token_ids)
        shaped = []
        for c in p.chunks:
            d = json.loads(c.to_json())
            d.pop("usage", None)                      # OpenAI's usage rules below
            if d.get("choices"):
                shaped.append(d)
        carrier = len(shaped) - 1           # a piece's ids ride on its last chunk with text (vLLM)
        for k in range(len(shaped) - 1, -1, -1):
            delta = shaped[k]["choices"][0].get("delta", {})
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                carrier = k
                break
        out = []
        for k, d in enumerate(shaped):
            ch = d["choices"][0]
            ch["index"] = sample.index
            if ch.get("finish_reason") is not None:
                if p.finish_reason == "abort":
                    ch["finish_reason"] = "abort"
                if p.text:                      # include_stop_str_in_output: the matched stop string
                    ch["delta"]["content"] = (ch["delta"].get("content") or "") + p.text
            if self.return_token_ids:
                if "role" in ch.get("delta", {}):
                    d["prompt_token_ids"] = self.prompts[0]
                ch["token_ids"] = self._pending_ids.pop(sample.index, []) if k == carrier else []
            if self.continuous_usage:                  # a piece's tokens count from its carrier chunk on
                done = p.total_tokens if k >= carrier else p.total_tokens - p.num_tokens
                d["usage"] = usage(len(self.prompts[0]), done, p.reasoning_tokens if self._thinking else None,
                                   self.cached.get(0, 0))
            elif self.include_usage:
                d["usage"] = None
            out.append(sse(d))
        return out

    def tail(self, asms) -> list[str]:
        out = []
        if self.include_usage:
            out.append(sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model, "choices": [], "usage": self._usage(asms)}))
        return out + ["data: [DONE]\n\n"]

    def _usage(self, asms) -> dict:
        thinking = self.request.parsing_options.thinking_initial_stage is not None
        return usage(self.prompt_tokens, sum(a.num_tokens for a in asms.values()),
                     sum(a.reasoning_tokens for a in asms.values()) if thinking else None, self.cached_tokens)

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        return [sse(error_body(message, status, param)), "data: [DONE]\n\n"]

    def body(self, asms) -> dict:
        choices, reasoning, head = [], 0, None
        for s in self.samples:
            asm = asms[s.index]
            d = json.loads(asm.response.to_json())
            head = head or d
            reasoning += asm.reasoning_tokens
            c = d["choices"][0]
            c["index"] = s.index
            if asm.finish_reason == "abort":
                c["finish_reason"] = "abort"
            if asm.stop_suffix:
                c["message"]["content"] = (c["message"].get("content") or "") + asm.stop_suffix
            if self.return_token_ids:
                c["token_ids"] = asm.token_ids
            choices.append(c)
        head["choices"] = choices
        if self.return_token_ids:                 # vLLM: the chat response's prompt_token_ids are top-level
            head["prompt_token_ids"] = self.prompts[0]
        thinking = self.request.parsing_options.thinking_initial_stage is not None
        head["usage"] = usage(self.prompt_tokens, sum(a.num_tokens for a in asms.values()),
                              reasoning if thinking else None, self.cached_tokens)
        return head
