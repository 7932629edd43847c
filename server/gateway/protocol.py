"""Request models (pydantic v2) of the four endpoints and the OpenAI / Anthropic error shapes.

Field names, types and defaults follow OpenAI's API plus vLLM's extras (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens,
chat_template_kwargs, ...). Unknown fields are accepted and ignored, as vLLM does; a known field of
the wrong type is a 400 naming the field (``server.gateway.errors`` turns pydantic errors into a 400).
Range checks that need the prompt (max_tokens vs the context) live in the endpoint modules; the
conversation itself (messages, tools, tool_choice, thinking, response format) is validated by
DeepSeek's format library when it converts the request (``server.gateway.dsformat``).

Types are strict, as OpenAI's API is: an integer field refuses ``"2"``, ``2.0`` and ``true``, a
boolean refuses ``"yes"`` and ``1``, a number refuses strings, booleans, NaN and infinities (an
integer is a number). Limits (in the OpenAPI schema where static, else the endpoint modules):

* temperature [0, 2] (OpenAI; the engine itself allows up to 100), top_p (0, 1], top_k >= -1,
  min_p [0, 1], presence / frequency_penalty [-2, 2], repetition_penalty (0, 100] (vLLM: > 0; the
  engine's cap);
* max_tokens / max_completion_tokens >= 1 and prompt + max_tokens <= the context; n >= 1 and
  n x prompts <= the gateway's ``max_n`` (128 by default, OpenAI's bound); seed in
  [-2**63, 2**64) (vLLM: a 64-bit integer);
* top_logprobs and completions ``logprobs`` in [0, 20]: vLLM's default max_logprobs (OpenAI allows
  only 5 for completions; 20 keeps both endpoints alike and is what the engine returns);
  top_logprobs needs logprobs=true (OpenAI answers 400 too);
* stop: at most ``MAX_STOP`` = 16 strings (OpenAI allows 4, vLLM has no bound), each at most
  ``MAX_STOP_CHARS`` = 1024 characters: streaming holds back text that may start a stop string,
  so a long one delays output and costs a scan per token; ``stop_token_ids``: at most
  ``MAX_STOP_TOKEN_IDS`` = 256 (every sample carries them to both workers and checks each token);
* stream_options only with stream=true (OpenAI, vLLM); logit_bias: token-id keys, values in
  [-100, 100] (OpenAI), then refused as unsupported when non-empty;
* tools: each ``{"type": "function", "function": {"name": non-empty, "parameters": JSON schema}}``
  (the recipe checks them: a non-object ``parameters`` schema, an empty name, a tool_choice naming
  an undeclared function are 400s);
* the request body is at most ``create_app``'s ``max_body_bytes`` (32 MiB by default: a 1M-token
  context of text), enforced by ``server.gateway.body_limit`` before parsing.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.core.sampling_params import MAX_LOGPROBS

MAX_STOP = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256      # each is checked per generated token on both workers, per sample

# optional fields with their ranges (finite numbers: JSON's NaN / Infinity are refused)
_Temperature = Annotated[float | None, Field(ge=0, le=2, allow_inf_nan=False)]
_TopP = Annotated[float | None, Field(gt=0, le=1, allow_inf_nan=False)]
_MinP = Annotated[float | None, Field(ge=0, le=1, allow_inf_nan=False)]
_Penalty = Annotated[float | None, Field(ge=-2, le=2, allow_inf_nan=False)]
_RepetitionPenalty = Annotated[float | None, Field(gt=0, le=100, allow_inf_nan=False)]
_TopK = Annotated[int | None, Field(ge=-1)]
_Seed = Annotated[int | None, Field(ge=-(1 << 63), lt=1 << 64)]
_Logprobs = Annotated[int | None, Field(ge=0, le=MAX_LOGPROBS)]
_MaxTokens = Annotated[int | None, Field(ge=1)]

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

# OpenAPI documentation of the free-form fields (validated by the recipe on conversion); nothing
# here changes what pydantic accepts
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "additionalProperties": True, "properties": {
    "role": {"type": "string", "enum": list(ROLES)},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "reasoning_content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "tool_calls": {"type": "array", "items": {"type": "object"}},
    "tool_call_id": {"type": "string"}}}
_TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": True, "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": True, "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema of type 'object'"}}}}}


class ApiError(Exception):
    """A request the gateway answers with an OpenAI error body.

    Args:
        message: human-readable, starts with the offending field where there is one.
        status: HTTP status (400 bad input, 404 unknown model, 429 / 5xx from the backend).
        param: the request field at fault (None if none).
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param)


def error_type(status: int) -> str:
    """OpenAI error ``type`` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``; ``code`` is the HTTP status (as vLLM)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM extra: usage on every chunk


class _NullIsDefault(BaseModel):
    """``null`` for a field with a non-null default means the default (OpenAI and vLLM accept
    ``"n": null``, ``"stream": null`` ...)."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}
        return data


class _Extras(_NullIsDefault):
    """The model, streaming and the sampling fields every endpoint takes (OpenAI's and vLLM's
    extras; /v1/responses and /v1/messages take these, chat and completions more)."""

    model: str | None = None
    stream: bool = False
    seed: _Seed = None
    temperature: _Temperature = None
    top_p: _TopP = None
    top_k: _TopK = None
    min_p: _MinP = None
    repetition_penalty: _RepetitionPenalty = None


class _Sampling(_Extras):
    """Fields shared by chat and completions (OpenAI + vLLM extras)."""

    n: int = Field(1, ge=1)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: _Penalty = None
    frequency_penalty: _Penalty = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False            # vLLM extra: token_ids (and prompt_token_ids) in the response
    user: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. ``messages`` are converted and validated by the recipe.
    ``max_tokens`` / ``max_completion_tokens`` None: the recipe's default for the mode (8192
    without thinking, 65536 with), lowered to the context left."""

    messages: list[dict[str, Any]] = Field(json_schema_extra={"items": _MESSAGE, "minItems": 1})
    max_tokens: _MaxTokens = None
    max_completion_tokens: _MaxTokens = None
    logprobs: bool = False
    top_logprobs: _Logprobs = None
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra={"anyOf": [
        {"type": "array", "items": _TOOL}, {"type": "null"}]})
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | None = None          # DeepSeek: {"type": "enabled" | "disabled"}
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    echo: bool = False


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: a string, a list of strings (batch), a list of token ids
    or a list of token-id lists. ``max_tokens`` defaults to 16 (OpenAI / vLLM); null means up to
    the context limit."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: _MaxTokens = 16
    max_completion_tokens: _MaxTokens = None
    logprobs: _Logprobs = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class ResponsesRequest(_Extras):
    """POST /v1/responses (OpenAI Responses API): ``input`` (a string or a list of items),
    ``instructions``, ``tools``, ``tool_choice``, ``reasoning``, ``text``, ``max_output_tokens``
    are converted and validated by the recipe. Stateless: ``previous_response_id`` and
    ``store=true`` are not kept (400 for the former)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: _MaxTokens = None
    presence_penalty: _Penalty = None
    frequency_penalty: _Penalty = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None


class MessagesRequest(_Extras):
    """POST /v1/messages (Anthropic Messages API): ``messages``, ``system``, ``tools``,
    ``tool_choice``, ``thinking``, ``stop_sequences`` are converted and validated by the recipe;
    ``max_tokens`` is required (Anthropic's rule)."""

    messages: list[dict[str, Any]] = Field(json_schema_extra={"minItems": 1})
    max_tokens: Annotated[int, Field(ge=1)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class MessagesCountRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body without ``max_tokens``."""

    max_tokens: Annotated[int, Field(ge=1)] | None = None


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(message: str, status: int) -> dict:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(path: str, message: str, status: int, param: str | None = None) -> dict:
    """The error body for a request to ``path``: Anthropic's shape under /v1/messages, else OpenAI's."""
    if path.startswith("/v1/messages"):
        return anthropic_error_body(message, status)
    return error_body(message, status, param)
