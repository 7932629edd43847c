"""The DeepSeek-V4 chat format, through DeepSeek's own library ``deepseek_recipe``.

One place turns an API request body (OpenAI Chat Completions, OpenAI Responses, Anthropic
Messages) into a conversation, renders and encodes it to prompt token ids, and builds the stream
processors that turn output token ids into the API's chunks / events (content, reasoning, DSML tool
calls, stop sequences, usage). The gateway has no other implementation of the format: what the
recipe renders is what the workers see, byte for byte, and what it parses is what the client gets.

What the gateway does around the recipe (vLLM's extensions and serving concerns, not the format):

* before conversion: ``developer`` messages become ``system`` ones (OpenAI's meaning for models
  without a separate developer role; the recipe's Chat Completions converter has no such role);
  ``max_completion_tokens`` becomes ``max_tokens`` (the recipe reads only the latter); vLLM's
  ``chat_template_kwargs.thinking`` / ``enable_thinking`` / ``reasoning_effort`` become DeepSeek's
  ``thinking: {"type": ...}`` / ``reasoning_effort`` when the body has none; ``n``, ``seed`` and
  vLLM's sampling extras are the gateway's own (``n > 1`` runs one processor per sample; the seed
  range is vLLM's 64-bit one) and are not passed on.
* the model name: the served name is the only one accepted (the gateway answers 404 before
  conversion) and selects the V4 encoding (``ModelVersion.DeepseekV4Pro``: V4-Flash and V4-Pro
  share it; ``DeepseekV41Flash`` is the V4.1 format).
* constraints: the recipe validates a response format (json_object, json_schema, regex; a 400
  naming the field) and gives the output constraint, which ``server.gateway.structured`` turns
  into the grammar the workers enforce; a required / named tool choice also opens the tool-call
  block in the prompt.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import deepseek_recipe as dr

from server.gateway.format_errors import image_part, locate, too_deep
from server.gateway.protocol import ApiError

#: The recipe's model version whose encoding the DeepSeek-V4 checkpoints (Flash and Pro) use.
V4 = dr.ModelVersion.DeepseekV4Pro

_REQUESTS = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}
# the field a constraint comes from, per API (named in the 400)
_CONSTRAINT_FIELD = {"chat": "response_format", "responses": "text.format", "messages": "output_format"}
# fields the gateway handles itself (n, seed) or that only vLLM knows; the recipe never sees them
_GATEWAY_FIELDS = ("n", "seed", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
                   "include_stop_str_in_output", "skip_special_tokens", "return_token_ids", "min_tokens",
                   "chat_template_kwargs", "max_completion_tokens", "logit_bias", "echo", "add_generation_prompt")
# the recipe's name for a field in its messages -> the request's, per API
_RENAMED = {"messages": {"stop": "stop_sequences"}}
MAX_DEPTH = 128          # the recipe's JSON nesting limit (serde_json's), checked first to name the field
_FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length,
           "abort": dr.InferenceFinishReason.Stop}
_RECIPE_MAX_TOKENS = (1 << 31) - 1        # the largest count the recipe's integers take


def finish_reason(reason: str | None) -> dr.InferenceFinishReason:
    """The recipe's finish reason for a backend one ("stop", "length", "abort")."""
    return _FINISH.get(reason or "stop", dr.InferenceFinishReason.Stop)


def _recipe_message(e: Exception) -> tuple[int, str]:
    """(status, message) of a recipe error: ``ConversionError`` carries an OpenAI-shaped body,
    a malformed body surfaces as ``ValueError`` from its deserialiser."""
    status = getattr(e, "status_code", 400)
    body = getattr(e, "body", None)
    if body:
        try:
            return status, json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return status, str(body)
    return status, str(e).strip()


def chat_body(body: dict[str, Any], model: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The Chat Completions body the recipe converts (see the module docstring), and the fields
    it moved: ``{recipe field: the request's field}`` (an error names the request's).

    Raises:
        ApiError: 400 naming ``chat_template_kwargs.thinking`` when it is not a boolean.
    """
    out = {k: v for k, v in body.items() if k not in _GATEWAY_FIELDS}
    out["model"] = model
    moved: dict[str, str] = {}
    if body.get("max_completion_tokens") is not None:       # OpenAI and vLLM: it wins over max_tokens
        out["max_tokens"], moved["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    kw = body.get("chat_template_kwargs") or {}
    for key in ("thinking", "enable_thinking"):
        if key in kw and not isinstance(kw[key], bool):
            raise ApiError(f"chat_template_kwargs.{key}: must be true or false, got {kw[key]!r}", 400,
                           f"chat_template_kwargs.{key}")
    thinking = kw.get("thinking", kw.get("enable_thinking"))
    if body.get("thinking") is None and isinstance(thinking, bool):
        out["thinking"] = {"type": "enabled" if thinking else "disabled"}
        moved["thinking"] = "chat_template_kwargs.thinking" if "thinking" in kw else "chat_template_kwargs.enable_thinking"
    if body.get("reasoning_effort") is None and "reasoning_effort" in kw:
        out["reasoning_effort"], moved["reasoning_effort"] = kw["reasoning_effort"], "chat_template_kwargs.reasoning_effort"
    msgs = out.get("messages")
    if isinstance(msgs, list) and any(isinstance(m, dict) and m.get("role") == "developer" for m in msgs):
        out["messages"] = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                           for m in msgs]
    return out, moved


def api_body(api: str, body: dict[str, Any], model: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The body of ``api`` ("chat" / "responses" / "messages") as the recipe converts it, and the
    fields moved on the way (``chat_body``)."""
    if api == "chat":
        return chat_body(body, model)
    out = {k: v for k, v in body.items() if k not in _GATEWAY_FIELDS}
    out["model"] = model
    return out, {}


class DeepSeekFormat:
    """The served model's chat format: conversion, prompt encoding and output processors.

    Args:
        model_dir: the checkpoint directory (its ``tokenizer.json`` is the recipe's tokenizer).
        model_name: the served model name (the only one a request may name).
        default_thinking: thinking mode of a request that does not choose (DeepSeek's API and the
            recipe default to enabled).
        max_token_chars: the most characters one token covers, so a prompt of C characters has at
            least C / max_token_chars tokens (``engine.tokenizer.Tokenizer.max_token_chars``);
            a prompt that cannot fit the context is refused before it is encoded.

    Raises:
        ApiError: never at construction; ``FileNotFoundError`` / ``ValueError`` for a checkpoint
            without a readable ``tokenizer.json``.
    """

    def __init__(self, model_dir: str | Path, model_name: str, default_thinking: bool = True,
                 max_token_chars: int = 256):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: {path} not found")
        self.tokenizer = dr.Tokenizer.from_file(str(path))
        self.model_name = model_name
        self.default_thinking = default_thinking
        self.max_token_chars = max_token_chars
        self.options = (dr.ConversionOptions(default_thinking_mode=default_thinking)
                        .with_model_versions_by_name({model_name: V4}))
        self.encoding = dr.DeepseekV4Encoding().with_tokenizer(self.tokenizer)
        self.think_end_id = self.tokenizer.encode(dr.SpecialToken.ThinkingEnd.default_str())[0]
        # markers a constraint matches as tokens (``server.gateway.structured``)
        self.marker_ids = {m: self.tokenizer.encode(m)[0] for m in ("<think>", "</think>", "｜DSML｜")}

    @staticmethod
    def starts_in_reasoning(cr: dr.ConversationRequest) -> bool:
        """Whether the output begins inside the reasoning (thinking mode, no continued answer)."""
        stage = cr.parsing_options.thinking_initial_stage
        return stage is not None and stage.starts_in_reasoning() and not cr.parsing_options.starts_in_tool_calls

    def convert(self, api: str, body: dict[str, Any]) -> tuple[dr.ConversationRequest, dict]:
        """Convert a request body; returns (the recipe's request, extras read before conversion:
        ``echo`` / ``namespace_tool_map`` for Responses).

        Raises:
            ApiError: 400 (or the recipe's status) with the recipe's message; 400 naming the
                constraint field for an invalid schema / regex.
        """
        cls = _REQUESTS[api]
        extras: dict = {}
        recipe_body, moved = api_body(api, body, self.model_name)
        for k, v in recipe_body.items():
            if too_deep(v, MAX_DEPTH - 1):
                raise ApiError(f"{k}: JSON nested deeper than {MAX_DEPTH} levels", 400, k)
        where = image_part(recipe_body)
        if where:
            raise ApiError(f"{where}: only text is supported (DeepSeek-V4 is a text model; no images, files or "
                           f"audio)", 400, where)
        try:
            req = cls(recipe_body)
            if api == "responses":
                extras = {"echo": req.echo(), "namespace_tool_map": req.namespace_tool_map(self.options)}
            cr = req.convert(self.options)
        except (dr.ConversionError, ValueError, TypeError, OverflowError) as e:
            status, msg = _recipe_message(e)
            msg = msg.removeprefix("invalid request body: ")
            param = locate(api, recipe_body, msg, not isinstance(e, dr.ConversionError),
                           lambda b: cls(b).convert(self.options), _RENAMED.get(api))
            if param:                            # a field the gateway moved: name the request's
                head, sep, rest = param.partition(".")
                if head in moved:
                    param = moved[head] + sep + rest
                    msg = msg[len(head):].lstrip(": ") if msg.startswith(head) else msg
            if param is None and msg.lower().startswith(("invalid json schema", "invalid regex",
                                                                    "required properties must match")):
                param = _CONSTRAINT_FIELD[api]        # the recipe's check of the output constraint
            if param and not msg.startswith(param):
                msg = f"{param}: {msg}"
            raise ApiError(msg, status if 400 <= status < 500 else 400, param) from None
        return cr, extras

    def encode(self, cr: dr.ConversationRequest, max_model_len: int, field: str) -> list[int]:
        """Render + encode the conversation to prompt token ids (special-token spellings in message
        text are text, never special ids: the recipe encodes only its own markers as specials).

        Raises:
            ApiError: 400 naming ``field`` when the prompt cannot fit ``max_model_len`` tokens.
        """
        rendered = self.encoding.render_conversation(cr.conversation)
        limit = max_model_len * self.max_token_chars
        if len(rendered.prompt) > limit:
            raise ApiError(f"{field}: {len(rendered.prompt)} characters cannot fit the context of {max_model_len} "
                           f"tokens (a token covers at most {self.max_token_chars} characters)", 400, field)
        try:
            return self.encoding.encode(cr.conversation)
        except RuntimeError as e:
            raise ApiError(f"{field}: cannot encode the conversation ({e})", 400, field) from None

    def max_tokens(self, cr: dr.ConversationRequest, prompt_tokens: int, max_model_len: int,
                   field: str = "messages", limit_field: str = "max_tokens") -> int:
        """Tokens to generate: the request's, or the recipe's default for the mode (8192 without
        thinking, 65536 with, 131072 at max effort), lowered to the context left.

        Raises:
            ApiError: 400 naming ``field`` when the prompt leaves no room to generate, naming
                ``limit_field`` when the prompt plus the requested limit exceeds the context.
        """
        if prompt_tokens >= max_model_len:
            raise ApiError(f"{field}: {prompt_tokens} tokens leave no room to generate within the model's context "
                           f"length of {max_model_len} tokens", 400, field)
        try:     # before any worker answered the context is unknown (huge); the recipe takes 32-bit counts
            return cr.resolve_max_tokens(prompt_tokens, min(max_model_len, _RECIPE_MAX_TOKENS))
        except (dr.ConversionError, ValueError) as e:
            raise ApiError(f"{limit_field}: {_recipe_message(e)[1]}", 400, limit_field) from None

    def processor(self, api: str, cr: dr.ConversationRequest, response_id: str, extras: dict,
                  parsing: dr.ParsingOptions | None = None) -> dr.StreamProcessor:
        """A new stream processor for one sample of ``cr`` (one per sample: each keeps its own
        parse state). ``parsing`` overrides the request's parsing options."""
        gen = _REQUESTS[api].chunk_generator(cr, response_id, self.model_name)
        if api == "responses":
            if extras.get("namespace_tool_map"):
                gen = gen.with_namespace_tool_map(extras["namespace_tool_map"])
            if extras.get("echo") is not None:
                gen = gen.with_echo(extras["echo"])
        return dr.StreamProcessor(gen, parsing or cr.parsing_options, self.tokenizer)
