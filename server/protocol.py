"""OpenAI request models (pydantic v2) and the OpenAI error shape.

Field names, types and defaults follow OpenAI's API plus vLLM's extras (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens,
chat_template_kwargs, ...). Unknown fields are accepted and ignored, as vLLM does; a known field of
the wrong type is a 400 naming the field (``gateway`` turns pydantic errors into ``ApiError``).
Range checks that need the prompt (max_tokens vs the context) live in ``openai_serving``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


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
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM extra: usage on every chunk


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI + vLLM extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False            # vLLM extra: token_ids (and prompt_token_ids) in the response
    user: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. ``messages`` are validated by ``engine.chat`` (ChatError names
    the field). ``max_tokens`` / ``max_completion_tokens`` None: up to the context limit."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    echo: bool = False


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: a string, a list of strings (batch), a list of token ids
    or a list of token-id lists. ``max_tokens`` defaults to 16 (OpenAI / vLLM); null means up to
    the context limit."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
