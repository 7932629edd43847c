"""POST /v1/messages (Anthropic Messages) and /v1/messages/count_tokens: one sample, converted,
rendered and shaped by DeepSeek's format library (``server.gateway.recipe_job``): its events
(thinking / text / tool_use content blocks, ``stop_reason``) as they come. The gateway adds the
sampling extras, the context check and Anthropic's error shape (``event: error``).
"""
from __future__ import annotations

from dataclasses import dataclass

import deepseek_recipe as dr

from server.gateway.dsformat import DeepSeekFormat
from server.gateway.jobs import sse
from server.gateway.protocol import MessagesRequest, anthropic_error_body
from server.gateway.recipe_job import RecipeJob, prepare_recipe


def count_message_tokens(req, fmt: DeepSeekFormat, max_model_len: int) -> dict:
    """POST /v1/messages/count_tokens: ``{"input_tokens": N}``, the prompt ids a Messages request
    would send (Anthropic's endpoint; Claude Code asks it). Raises ApiError as ``prepare_messages``."""
    cr, _ = fmt.convert("messages", req.model_dump(exclude_unset=True))
    return {"input_tokens": len(fmt.encode(cr, max_model_len, "messages"))}


def prepare_messages(req: MessagesRequest, fmt: DeepSeekFormat, tokenizer, max_model_len: int) -> MessagesJob:
    """Validate and convert a Messages request. Raises ApiError (400 naming the field / the recipe's message)."""
    return prepare_recipe(MessagesJob, req, fmt, tokenizer, max_model_len, "msg_", "messages")


@dataclass
class MessagesJob(RecipeJob):
    kind = "messages"
    api = "messages"
    response_cls = dr.MessagesResponse

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        return [sse(anthropic_error_body(message, status), "error")]
