"""POST /v1/responses (OpenAI Responses): one sample, converted, rendered and shaped by DeepSeek's
format library (``server.gateway.recipe_job``): its events (reasoning items, output_text,
function_call items, usage with reasoning tokens) as they come. The gateway adds the sampling
extras (seed over the 64-bit range, top_k, min_p, repetition_penalty), the context check and
OpenAI's error shape (an ``error`` event mid-stream).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import deepseek_recipe as dr

from server.gateway.dsformat import DeepSeekFormat
from server.gateway.jobs import sse
from server.gateway.protocol import ApiError, ResponsesRequest
from server.gateway.recipe_job import RecipeJob, prepare_recipe


def prepare_responses(req: ResponsesRequest, fmt: DeepSeekFormat, tokenizer, max_model_len: int) -> ResponsesJob:
    """Validate and convert a Responses request. Raises ApiError (400 naming the field / the recipe's message)."""
    if req.previous_response_id is not None:
        raise ApiError("previous_response_id: this server keeps no responses (send the whole input)", 400,
                       "previous_response_id")
    return prepare_recipe(ResponsesJob, req, fmt, tokenizer, max_model_len, "resp_", "input")


@dataclass
class ResponsesJob(RecipeJob):
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
