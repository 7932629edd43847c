"""What the API tests share: the served name and key, request bodies per API, DeepSeek's recipe used
directly (``Recipe``: prompt ids, events and response objects for given output ids), clock fields
dropped, SDK objects as JSON, and the gateway's generation-token counter."""
from __future__ import annotations

import json
import re

import deepseek_recipe as dr
import httpx

from serve_util import reasoning_from_ids, set_reasoning_usage

MODEL = "deepseek_v4"
KEY = "test-key-pd-apis"
LENGTH = dr.InferenceFinishReason.Length
# clock fields: the gateway's and the recipe's clocks read different seconds
CLOCK = frozenset({"created", "created_at", "completed_at"})
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
THINK_OFF = {"type": "disabled"}
THINK_ON = {"type": "enabled", "budget_tokens": 1024}


class Recipe:
    """DeepSeek's format library used directly (not through server/): conversion, prompt encoding
    and the stream processor, configured as the gateway says it is (served name -> V4 encoding,
    thinking on by default)."""

    REQ = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}
    RESP = {"chat": dr.ChatCompletionResponse, "responses": dr.ResponsesResponse, "messages": dr.MessagesResponse}

    def __init__(self, ckpt: str):
        self.tok = dr.Tokenizer.from_file(f"{ckpt}/tokenizer.json")
        self.opts = (dr.ConversionOptions(default_thinking_mode=True)
                     .with_model_versions_by_name({MODEL: dr.ModelVersion.DeepseekV4Pro}))
        self.enc = dr.DeepseekV4Encoding().with_tokenizer(self.tok)

    def _convert(self, api: str, body: dict):
        req = self.REQ[api](body)
        echo = req.echo() if api == "responses" else None
        return req.convert(self.opts), echo

    def prompt_ids(self, api: str, body: dict) -> list[int]:
        return self.enc.encode(self._convert(api, body)[0].conversation)

    def _process(self, api: str, body: dict, ids: list[int], rid: str) -> tuple[list, int]:
        """(the recipe's chunk / event objects, prompt tokens) for output ``ids`` ending by length,
        one token a chunk (as the gateway feeds them)."""
        cr, echo = self._convert(api, body)
        gen = self.REQ[api].chunk_generator(cr, rid, MODEL)
        if echo is not None:
            gen = gen.with_echo(echo)
        proc = dr.StreamProcessor(gen, cr.parsing_options, self.tok)
        n_prompt = len(self.enc.encode(cr.conversation))
        out = proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=n_prompt)))
        for t in ids:
            out += proc.push(dr.InferenceChunk.tokens([t]))
        out += proc.push(dr.InferenceChunk.finish(LENGTH))
        po = cr.parsing_options
        stage = po.thinking_initial_stage
        starts = stage is not None and stage.starts_in_reasoning() and not po.starts_in_tool_calls
        return out + proc.finish(), n_prompt, reasoning_from_ids(ids, starts)

    def events(self, api: str, body: dict, ids: list[int], rid: str) -> list[dict]:
        """The recipe's chunks / events (JSON) for output ``ids``, reasoning tokens counted from the ids."""
        out, _, n_reason = self._process(api, body, ids, rid)
        return [set_reasoning_usage(json.loads(e.to_json()), n_reason) for e in out]

    def response(self, api: str, body: dict, ids: list[int], rid: str) -> dict:
        """The recipe's accumulated response object for output ``ids`` (clock fields dropped),
        reasoning tokens counted from the ids (the gateway's rule)."""
        out, n_prompt, n_reason = self._process(api, body, ids, rid)
        acc = self.RESP[api](rid, MODEL, 0, n_prompt, 0)
        for e in out:
            acc.accumulate(e)
        return noclock(set_reasoning_usage(json.loads(acc.to_json()), n_reason))


def noclock(x):
    if isinstance(x, dict):
        return {k: noclock(v) for k, v in x.items() if k not in CLOCK}
    if isinstance(x, list):
        return [noclock(v) for v in x]
    return x


def dump(model) -> dict:
    """An SDK object as the JSON it was built from (fields the server sent), clock fields dropped."""
    return noclock(model.model_dump(mode="json", exclude_unset=True))


def generation_tokens(pd) -> float:
    text = httpx.get(pd.metrics_urls["gateway"], timeout=10).text
    m = re.search(r'^dsv4:generation_tokens_total\{model_name="deepseek_v4"\} (\S+)$', text, re.M)
    assert m, "dsv4:generation_tokens_total{model_name=\"deepseek_v4\"} missing from the gateway's /metrics"
    return float(m.group(1))


def chat_body(content: str, n_tokens: int, thinking: bool) -> dict:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": content}],
            "max_tokens": n_tokens, "temperature": 0}
    if not thinking:
        body["thinking"] = THINK_OFF
    return body


def chat_kwargs(body: dict, **extra_body) -> dict:
    """openai SDK kwargs for a recipe body (``thinking`` is not an SDK argument: extra_body)."""
    kw = {k: v for k, v in body.items() if k != "thinking"}
    eb = dict(extra_body)
    if "thinking" in body:
        eb["thinking"] = body["thinking"]
    return {**kw, "extra_body": eb}


def expect_message(recipe, body, ids, rid) -> dict:
    return recipe.response("chat", body, ids, rid)["choices"][0]["message"]


def responses_body(n: int, thinking: bool) -> dict:
    body = {"model": MODEL, "input": "Describe the sea in one sentence.", "instructions": "Be brief.",
            "max_output_tokens": n, "temperature": 0}
    if not thinking:
        body["reasoning"] = {"effort": "none"}
    return body


def output_texts(output: list[dict]) -> tuple[str, str]:
    """(output text, reasoning text) of Responses output items (JSON)."""
    text = "".join(p["text"] for o in output if o["type"] == "message" for p in o["content"]
                   if p["type"] == "output_text")
    reasoning = "".join(p["text"] for o in output if o["type"] == "reasoning" for p in o.get("content") or []
                        if p["type"] == "reasoning_text")
    return text, reasoning


def messages_body(n: int, thinking: bool, tools: bool) -> dict:
    body = {"model": MODEL, "max_tokens": n, "system": "You answer in one word.",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "thinking": THINK_ON if thinking else THINK_OFF}
    if tools:
        body["tools"] = [WEATHER]
    return body


def messages_kwargs(body: dict) -> dict:
    # anthropic 2.x's messages.create has no temperature argument: extra_body
    return {**body, "extra_body": {"temperature": 0}}
