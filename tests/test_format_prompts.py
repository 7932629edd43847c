"""The prompt the gateway sends to the workers is DeepSeek's own, for every API and shape of request.

Each conversation goes through the real gateway app (``create_app`` over a ``ScriptedBackend`` that
records the ``GenRequest`` it gets), in process over ASGI. The prompt ids the backend received must
EQUAL ``deepseek_recipe``'s encoding of the same request, computed here independently:
``ChatCompletionRequest`` / ``ResponsesRequest`` / ``MessagesRequest(body).convert(options)`` with
the served name mapped to ``ModelVersion.DeepseekV4Pro``, then ``DeepseekV4Encoding().encode``.
Where a body uses one of the gateway's own normalisations (``developer`` role,
``max_completion_tokens``, vLLM's ``chat_template_kwargs``, vLLM's sampling extras) the expected
side is written by hand in DeepSeek's terms (``system``, ``thinking: {"type": ...}``,
``reasoning_effort``, the extras left out), so the normalisation itself is what is checked. Each
case also pins a value of the decoded prompt (its tail, substrings in order, text that must be
absent) so that an equal-but-wrong rendering on both sides would still fail.

Why: a prompt that differs from the one the model was trained on degrades it silently (no error,
worse answers); and a special-token spelling in user-controlled text that became a special id
would let a client forge turns (a fake ``<｜Assistant｜>``, an early ``</think>``, a BOS). So:

* the chat corpus covers thinking modes (the gateway's default, ``thinking``, vLLM's
  ``chat_template_kwargs`` and their precedence), every ``reasoning_effort`` and its precedence
  over / under ``thinking``, multi-turn history with and without ``reasoning_content``, tools with
  nested schemas, tool results in and out of call order, parallel calls, ``tool_choice`` (a
  required / named choice prefills the tool-call block without thinking and is a 400 with it),
  content parts, system / developer / latest_reminder messages, an assistant-final conversation and
  a ``prefix`` continuation, and hard text (CJK, emoji, RTL, very long lines, empty strings);
  plus /v1/responses and /v1/messages corpora checked against the recipe's converters;
* special-token injection: every spelling the recipe knows (each ``SpecialToken``'s
  ``default_str()``, BOS / EOS / think / User / Assistant / DSML) and, once, every added token of
  the vocabulary, placed in every text field a client controls: the prompt holds exactly the
  special ids the structure needs (one exception, the recipe's: grounding tokens such as
  ``<｜box｜>`` in ASSISTANT text are fed back as the specials the model wrote, see ``GROUNDING``).
  /v1/completions, whose prompt is raw model input (vLLM's behaviour), DOES map the same
  spellings to special ids: the difference is deliberate;
* the served name: only ``deepseek_v4`` is accepted (404 in the API's error shape otherwise), and a
  chat request without a ``model`` is served.

The tokenizer is the real DeepSeek-V4 one (``engine.checkpoint.make_tiny.copy_tokenizer``, the file every tiny
checkpoint ships); no model weights are needed.
"""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass

import deepseek_recipe as dr
import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine.checkpoint.make_tiny import copy_tokenizer
from engine.tokenizer import Tokenizer
from server.gateway import create_app
from serve_util import ScriptedBackend

NAME = "deepseek_v4"
CHAT, RESP, MSGS, CMPL = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"
RECIPE_REQUEST = {CHAT: dr.ChatCompletionRequest, RESP: dr.ResponsesRequest, MSGS: dr.MessagesRequest}

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK, DSML = "<think>", "</think>", "｜DSML｜"
#: the prompt's last turn opener: a thinking turn / a chat (non-thinking) turn / a required tool call
THINK_TAIL = ASSISTANT + THINK
CHAT_TAIL = ASSISTANT + END_THINK
TOOL_PREFILL = ASSISTANT + END_THINK + "\n\n<｜DSML｜tool_calls>\n"
#: the system-prompt preamble of high / xhigh (and of thinking with no effort) and of max effort
HIGH = "Reasoning Effort: Absolute maximum with no shortcuts permitted."
MAX = "Reasoning Effort: Beyond maximum"
EFFORT = "Reasoning Effort:"
TOOLS_HEADER = "## Tools"

#: every special-token spelling the recipe knows, plus the ones a chat template spells out
SPELLINGS = list(dict.fromkeys(
    [getattr(dr.SpecialToken, n).default_str() for n in dir(dr.SpecialToken)
     if isinstance(getattr(dr.SpecialToken, n), dr.SpecialToken)]
    + [BOS, EOS, THINK, END_THINK, USER, ASSISTANT, DSML]))

#: grounding tokens (the model's own output markup for boxes / points / polygons): in ASSISTANT text
#: (content, reasoning_content, thinking blocks) the recipe encodes their spellings as the special
#: ids, so a history the model wrote is fed back as it wrote it; everywhere else they are text
GROUNDING = frozenset(getattr(dr.SpecialToken, n).default_str()
                      for n in ("Ref", "RefEnd", "Box", "BoxEnd", "Point", "PointEnd", "Polygon", "PolygonEnd"))

ON = {"thinking": {"type": "enabled"}}
OFF = {"thinking": {"type": "disabled"}}
HI = [{"role": "user", "content": "hi"}]


# ---- the gateway and the recipe -----------------------------------------------------------------------
@dataclass
class Env:
    tok: Tokenizer                         # the gateway's tokenizer (decode, completions)
    hf: HFTokenizer                        # the same tokenizer.json, through HF tokenizers
    encoding: dr.DeepseekV4Encoding
    apps: dict                             # default_thinking -> app
    backends: dict                         # default_thinking -> ScriptedBackend
    special_ids: frozenset                 # every added token of the vocabulary

    def sid(self, spelling: str) -> int:
        """The special id of ``spelling`` (the full-vocabulary encode of it alone)."""
        ids = self.hf.encode(spelling, add_special_tokens=False).ids
        assert len(ids) == 1, (spelling, ids)
        return ids[0]

    def recipe_ids(self, path: str, body: dict, default_thinking: bool = True) -> list[int]:
        """The recipe's own prompt ids for ``body`` (the served name -> DeepSeek-V4's encoding)."""
        opts = (dr.ConversionOptions(default_thinking_mode=default_thinking)
                .with_model_versions_by_name({NAME: dr.ModelVersion.DeepseekV4Pro}))
        cr = RECIPE_REQUEST[path]({**body, "model": NAME}).convert(opts)
        return self.encoding.encode(cr.conversation)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def send(self, path: str, body: dict, default_thinking: bool = True, model: str | None = NAME
             ) -> tuple[httpx.Response, list]:
        """POST ``body`` (with ``model`` unless None) to the gateway; (response, the GenRequests it sent)."""
        app, backend = self.apps[default_thinking], self.backends[default_thinking]
        before = len(backend.requests)
        payload = body if model is None else {"model": model, **body}

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                         timeout=30) as c:
                return await c.post(path, json=payload)

        r = asyncio.run(go())
        return r, backend.requests[before:]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    d = tmp_path_factory.mktemp("dsv4-tokenizer")
    copy_tokenizer(d)
    tok = Tokenizer(d)
    reply = tok.encode("Sure.")             # two plain tokens: reasoning in thinking mode, content otherwise
    backends = {t: ScriptedBackend((reply, "stop")) for t in (True, False)}
    apps = {t: create_app(backends[t], tok, NAME, default_thinking=t) for t in (True, False)}
    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    encoding = dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(d / "tokenizer.json")))
    return Env(tok, hf, encoding, apps, backends, frozenset(hf.get_added_tokens_decoder()))


# ---- the corpus -----------------------------------------------------------------------------------------
@dataclass
class Conv:
    """One conversation: ``body`` is posted to ``path``; ``expect`` is the same request in the recipe's
    terms (default: ``body``). The decoded prompt ends with ``tail``, holds ``has`` in this order
    and none of ``lacks``. ``default_thinking``: the gateway's ``--default-thinking``."""

    id: str
    body: dict
    tail: str
    has: tuple = ()
    lacks: tuple = ()
    expect: dict | None = None
    default_thinking: bool = True
    path: str = CHAT


def tool(name: str, parameters: dict, description: str = "", **extra) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters,
                                             **extra}}


WEATHER = tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
               "Current weather of a city")
TIME = tool("get_time", {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}})
TRIP = tool("book_trip", {
    "type": "object",
    "$defs": {"leg": {"type": "object", "additionalProperties": False, "required": ["from", "to", "mode"],
                      "properties": {"from": {"type": "string"}, "to": {"type": "string"},
                                     "mode": {"type": "string", "enum": ["air", "rail", "sea"]}}}},
    "properties": {
        "legs": {"type": "array", "items": {"$ref": "#/$defs/leg"}, "minItems": 1},
        "travellers": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
            "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                           "tags": {"type": "array", "items": {"type": "string", "enum": ["vip", "child"]}}}}},
        "class": {"type": "string", "enum": ["economy", "business"]},
        "notes": {"type": ["string", "null"]},
        "budget": {"anyOf": [{"type": "number"}, {
            "type": "object", "additionalProperties": False, "required": ["amount", "currency"],
            "properties": {"amount": {"type": "number"}, "currency": {"type": "string", "enum": ["EUR", "USD"]}}}]}},
    "required": ["legs", "travellers", "class", "notes", "budget"], "additionalProperties": False},
    "Book a multi-leg trip", strict=True)
TRIP_LAX = {"type": "function", "function": {k: v for k, v in TRIP["function"].items() if k != "strict"}}
# strict without additionalProperties: the recipe normalises the schema of a strict tool (closes its objects)
STRICT_LOOSE = tool("lookup", {"type": "object", "required": ["q", "opts"], "properties": {
    "q": {"type": "string"},
    "opts": {"type": "object", "required": ["limit"], "properties": {"limit": {"type": "integer"}}}}},
    "Look something up", strict=True)


def call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def tool_turns(order: tuple[str, ...], reasoning: str | None = "need the weather") -> list[dict]:
    """A weather question, one assistant turn with two parallel calls, their results in ``order``."""
    results = {"c1": "Paris: 15C", "c2": "Rome: 20C"}
    asst = {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_weather", {"city": "Paris"}),
                                                               call("c2", "get_weather", {"city": "Rome"})]}
    if reasoning is not None:
        asst["reasoning_content"] = reasoning
    return [{"role": "user", "content": "Weather in Paris and Rome?"}, asst,
            *({"role": "tool", "tool_call_id": c, "content": results[c]} for c in order)]


LONG_LINE = " ".join(f"w{i}" for i in range(6000))          # one ~40k-character line
NO_SPACE = "x" * 20000                                        # one 20k-character word
CJK = "你好，世界。日本語のテキスト、한국어 텍스트"
EMOJI = "👨‍👩‍👧‍👦 🇯🇵 👍🏽 e\u0301 🤖"
RTL = "مرحبا بالعالم \u202eשלום עולם\u202c"

CHAT_CASES = [
    # -- thinking mode: the gateway default, explicit, vLLM's chat_template_kwargs
    Conv("default-thinking-on", {"messages": HI}, USER + "hi" + THINK_TAIL, has=(BOS + HIGH,)),
    Conv("default-thinking-off", {"messages": HI}, BOS + USER + "hi" + CHAT_TAIL, default_thinking=False),
    Conv("thinking-enabled-on-off-gateway", {"messages": HI, **ON}, USER + "hi" + THINK_TAIL, has=(HIGH,),
         default_thinking=False),
    Conv("thinking-disabled", {"messages": HI, **OFF}, BOS + USER + "hi" + CHAT_TAIL),
    Conv("kwargs-thinking-false", {"messages": HI, "chat_template_kwargs": {"thinking": False}},
         BOS + USER + "hi" + CHAT_TAIL, expect={"messages": HI, **OFF}),
    Conv("kwargs-thinking-true", {"messages": HI, "chat_template_kwargs": {"thinking": True}},
         USER + "hi" + THINK_TAIL, expect={"messages": HI, **ON}, default_thinking=False),
    Conv("kwargs-enable-thinking-false", {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}},
         BOS + USER + "hi" + CHAT_TAIL, expect={"messages": HI, **OFF}),
    Conv("kwargs-enable-thinking-true", {"messages": HI, "chat_template_kwargs": {"enable_thinking": True}},
         USER + "hi" + THINK_TAIL, expect={"messages": HI, **ON}, default_thinking=False),
    Conv("kwargs-thinking-over-enable-thinking",
         {"messages": HI, "chat_template_kwargs": {"thinking": False, "enable_thinking": True}},
         BOS + USER + "hi" + CHAT_TAIL, expect={"messages": HI, **OFF}),
    Conv("body-thinking-over-kwargs", {"messages": HI, **ON, "chat_template_kwargs": {"thinking": False}},
         USER + "hi" + THINK_TAIL, expect={"messages": HI, **ON}, default_thinking=False),
    Conv("null-thinking-then-kwargs", {"messages": HI, "thinking": None, "chat_template_kwargs": {"thinking": False}},
         BOS + USER + "hi" + CHAT_TAIL, expect={"messages": HI, **OFF}),
    Conv("null-effort-then-kwargs",
         {"messages": HI, "reasoning_effort": None, "chat_template_kwargs": {"reasoning_effort": "max"}},
         USER + "hi" + THINK_TAIL, has=(MAX,), expect={"messages": HI, "reasoning_effort": "max"}),
    Conv("kwargs-reasoning-effort", {"messages": HI, "chat_template_kwargs": {"reasoning_effort": "max"}},
         USER + "hi" + THINK_TAIL, has=(MAX,), expect={"messages": HI, "reasoning_effort": "max"}),
    Conv("body-effort-over-kwargs-effort",
         {"messages": HI, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "max"}},
         BOS + USER + "hi" + THINK_TAIL, lacks=(EFFORT,), expect={"messages": HI, "reasoning_effort": "low"}),
    # -- every reasoning_effort, and its precedence with thinking
    Conv("effort-none", {"messages": HI, "reasoning_effort": "none"}, BOS + USER + "hi" + CHAT_TAIL),
    Conv("effort-minimal", {"messages": HI, "reasoning_effort": "minimal"}, BOS + USER + "hi" + THINK_TAIL),
    Conv("effort-low", {"messages": HI, "reasoning_effort": "low"}, BOS + USER + "hi" + THINK_TAIL),
    Conv("effort-medium", {"messages": HI, "reasoning_effort": "medium"}, USER + "hi" + THINK_TAIL, has=(HIGH,)),
    Conv("effort-high", {"messages": HI, "reasoning_effort": "high"}, USER + "hi" + THINK_TAIL, has=(HIGH,)),
    Conv("effort-xhigh", {"messages": HI, "reasoning_effort": "xhigh"}, USER + "hi" + THINK_TAIL, has=(HIGH,)),
    Conv("effort-max", {"messages": HI, "reasoning_effort": "max"}, USER + "hi" + THINK_TAIL, has=(BOS + MAX,),
         lacks=(HIGH,)),
    Conv("effort-none-thinking-enabled", {"messages": HI, "reasoning_effort": "none", **ON},
         USER + "hi" + THINK_TAIL, has=(HIGH,)),
    Conv("effort-max-thinking-disabled", {"messages": HI, "reasoning_effort": "max", **OFF},
         BOS + USER + "hi" + CHAT_TAIL),
    Conv("effort-low-enables-thinking", {"messages": HI, "reasoning_effort": "low"}, BOS + USER + "hi" + THINK_TAIL,
         default_thinking=False),
    Conv("effort-none-on-off-gateway", {"messages": HI, "reasoning_effort": "none"}, BOS + USER + "hi" + CHAT_TAIL,
         default_thinking=False),
    # -- multi-turn history
    Conv("multiturn-with-reasoning",
         {"messages": [{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
                       {"role": "user", "content": "and 3+3?"}]},
         USER + "2+2?" + CHAT_TAIL + "4" + EOS + USER + "and 3+3?" + THINK_TAIL, lacks=("two plus two",)),
    Conv("multiturn-without-reasoning",
         {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                       {"role": "user", "content": "and 3+3?"}]},
         USER + "2+2?" + CHAT_TAIL + "4" + EOS + USER + "and 3+3?" + THINK_TAIL),
    Conv("multiturn-chat-mode",
         {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"},
                       {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                       {"role": "assistant", "content": "d", "reasoning_content": "hidden"},
                       {"role": "user", "content": "e"}], **OFF},
         BOS + "Be terse." + USER + "a" + CHAT_TAIL + "b" + EOS + USER + "c" + CHAT_TAIL + "d" + EOS + USER + "e"
         + CHAT_TAIL, lacks=("hidden",)),
    # -- tools
    Conv("tools-nested-schema", {"messages": [{"role": "user", "content": "Book Paris-Rome by rail"}],
                                 "tools": [TRIP_LAX, TIME]},
         USER + "Book Paris-Rome by rail" + THINK_TAIL,
         has=(TOOLS_HEADER, '"name": "book_trip"', '"$defs": {"leg": ', '"enum": ["air", "rail", "sea"]',
              '"$ref": "#/$defs/leg"', '"minItems": 1', '"name": "get_time"')),
    # (the recipe renders a strict tool without its $defs: test_strict_tool_schema_keeps_what_its_refs_point_to)
    Conv("tools-nested-schema-strict", {"messages": [{"role": "user", "content": "Book it"}],
                                        "tools": [TRIP, STRICT_LOOSE], **OFF},
         USER + "Book it" + CHAT_TAIL,
         has=(TOOLS_HEADER, '"name": "book_trip"', '"enum": ["vip", "child"]', '"type": ["string", "null"]',
              '"enum": ["EUR", "USD"]', '"name": "lookup"',
              '"properties": {"limit": {"type": "integer"}}, "additionalProperties": false')),
    Conv("tools-two-chat-mode", {"messages": HI, "tools": [WEATHER, TIME], **OFF}, USER + "hi" + CHAT_TAIL,
         has=(TOOLS_HEADER, '"name": "get_weather"', '"name": "get_time"')),
    Conv("tool-results-in-order", {"messages": tool_turns(("c1", "c2")), "tools": [WEATHER]},
         "<tool_result>Paris: 15C</tool_result>\n\n<tool_result>Rome: 20C</tool_result>" + THINK_TAIL,
         has=(THINK + "need the weather" + END_THINK, '<｜DSML｜invoke name="get_weather">', "Paris",
              '<｜DSML｜invoke name="get_weather">', "Rome",
              "</｜DSML｜tool_calls>" + EOS + USER + "<tool_result>")),
    Conv("tool-results-out-of-order", {"messages": tool_turns(("c2", "c1")), "tools": [WEATHER]},
         "<tool_result>Paris: 15C</tool_result>\n\n<tool_result>Rome: 20C</tool_result>" + THINK_TAIL),
    Conv("parallel-calls-no-reasoning-chat-mode",
         {"messages": tool_turns(("c1", "c2"), reasoning=None), "tools": [WEATHER], **OFF},
         "<tool_result>Rome: 20C</tool_result>" + CHAT_TAIL,
         has=(USER + "Weather in Paris and Rome?" + CHAT_TAIL + "\n\n<｜DSML｜tool_calls>",)),
    Conv("tool-call-then-answer-then-user",
         {"messages": [*tool_turns(("c1", "c2")), {"role": "assistant", "content": "15C and 20C."},
                       {"role": "user", "content": "Thanks"}], "tools": [WEATHER]},
         "15C and 20C." + EOS + USER + "Thanks" + THINK_TAIL),
    Conv("tool-call-null-content",
         {"messages": [{"role": "user", "content": "time?"},
                       {"role": "assistant", "content": None, "tool_calls": [call("t", "get_time", {"tz": "UTC"})]},
                       {"role": "tool", "tool_call_id": "t", "content": "12:00"}], "tools": [TIME], **OFF},
         "<tool_result>12:00</tool_result>" + CHAT_TAIL, has=('string="true">UTC',)),
    Conv("tool-choice-none", {"messages": HI, "tools": [WEATHER], "tool_choice": "none"},
         USER + "hi" + THINK_TAIL, lacks=(TOOLS_HEADER,)),
    Conv("tool-choice-auto", {"messages": HI, "tools": [WEATHER], "tool_choice": "auto"}, USER + "hi" + THINK_TAIL,
         has=(TOOLS_HEADER,)),
    Conv("tool-choice-required-chat-mode", {"messages": HI, "tools": [WEATHER, TIME], "tool_choice": "required",
                                            **OFF}, USER + "hi" + TOOL_PREFILL, has=(TOOLS_HEADER,)),
    Conv("tool-choice-named-chat-mode",
         {"messages": HI, "tools": [WEATHER, TIME], **OFF,
          "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         USER + "hi" + TOOL_PREFILL, has=(TOOLS_HEADER,)),
    Conv("parallel-tool-calls-false", {"messages": HI, "tools": [WEATHER], "parallel_tool_calls": False},
         USER + "hi" + THINK_TAIL, has=(TOOLS_HEADER,)),
    # -- content shapes and roles
    Conv("content-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                                      {"type": "text", "text": "part two"}]}]},
         USER + "part one\n\npart two" + THINK_TAIL),
    Conv("system-message", {"messages": [{"role": "system", "content": "You are a pirate."}, *HI], **OFF},
         BOS + "You are a pirate." + USER + "hi" + CHAT_TAIL),
    Conv("system-content-parts",
         {"messages": [{"role": "system", "content": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]},
                       *HI], **OFF}, BOS + "S1\n\nS2" + USER + "hi" + CHAT_TAIL),
    Conv("developer-message", {"messages": [{"role": "developer", "content": "Answer in French."}, *HI], **OFF},
         BOS + "Answer in French." + USER + "hi" + CHAT_TAIL,
         expect={"messages": [{"role": "system", "content": "Answer in French."}, *HI], **OFF}),
    Conv("system-and-developer",
         {"messages": [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, *HI]},
         USER + "hi" + THINK_TAIL, has=(HIGH, "S", "D" + USER),
         expect={"messages": [{"role": "system", "content": "S"}, {"role": "system", "content": "D"}, *HI]}),
    Conv("latest-reminder", {"messages": [*HI, {"role": "latest_reminder", "content": "Today is Monday."}], **OFF},
         USER + "hi<｜latest_reminder｜>Today is Monday." + CHAT_TAIL),
    Conv("ends-in-assistant-turn", {"messages": [*HI, {"role": "assistant", "content": "Hello!"}], **OFF},
         USER + "hi" + CHAT_TAIL + "Hello!" + EOS + CHAT_TAIL),
    Conv("prefix-continuation-chat-mode",
         {"messages": [*HI, {"role": "assistant", "content": "Once upon a", "prefix": True}], **OFF},
         BOS + USER + "hi" + CHAT_TAIL + "Once upon a"),
    Conv("prefix-continuation-thinking",
         {"messages": [*HI, {"role": "assistant", "content": "Once upon a", "prefix": True}]},
         USER + "hi" + THINK_TAIL + END_THINK + "Once upon a"),
    Conv("response-format-text", {"messages": HI, "response_format": {"type": "text"}, **OFF},
         BOS + USER + "hi" + CHAT_TAIL),
    # -- text that is hard to get right
    Conv("cjk", {"messages": [{"role": "system", "content": CJK}, {"role": "user", "content": CJK}], **OFF},
         BOS + CJK + USER + CJK + CHAT_TAIL),
    Conv("emoji", {"messages": [{"role": "user", "content": EMOJI}]}, USER + EMOJI + THINK_TAIL),
    Conv("rtl", {"messages": [{"role": "user", "content": RTL}], **OFF}, USER + RTL + CHAT_TAIL),
    Conv("very-long-lines", {"messages": [{"role": "user", "content": LONG_LINE + "\n" + NO_SPACE}], **OFF},
         USER + LONG_LINE + "\n" + NO_SPACE + CHAT_TAIL),
    Conv("whitespace-and-controls", {"messages": [{"role": "user", "content": "  a\t\r\n\n b \u00a0\u200b\u2028 "}],
                                     **OFF}, USER + "  a\t\r\n\n b \u00a0\u200b\u2028 " + CHAT_TAIL),
    Conv("empty-strings",
         {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                       {"role": "assistant", "content": ""}, {"role": "user", "content": ""}], **OFF},
         BOS + USER + CHAT_TAIL + EOS + USER + CHAT_TAIL),
    Conv("empty-tool-result", {"messages": [{"role": "user", "content": "t?"},
                                            {"role": "assistant", "content": "", "tool_calls": [
                                                call("t", "get_time", {})]},
                                            {"role": "tool", "tool_call_id": "t", "content": ""}],
                               "tools": [TIME], **OFF}, "<tool_result></tool_result>" + CHAT_TAIL),
    # -- fields that are not the format's: normalised or left out by the gateway
    Conv("max-completion-tokens", {"messages": HI, "max_completion_tokens": 7, **OFF}, BOS + USER + "hi" + CHAT_TAIL,
         expect={"messages": HI, "max_tokens": 7, **OFF}),
    Conv("vllm-extras", {"messages": HI, "n": 2, "seed": 5, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1,
                         "stop_token_ids": [5], "ignore_eos": False, "include_stop_str_in_output": True,
                         "skip_special_tokens": False, "return_token_ids": True, "add_generation_prompt": True},
         USER + "hi" + THINK_TAIL, expect={"messages": HI}),
    Conv("openai-sampling-fields", {"messages": HI, "temperature": 0.3, "top_p": 0.9, "presence_penalty": 0.5,
                                    "frequency_penalty": 0.1, "stop": ["END"], "logprobs": True, "top_logprobs": 2,
                                    "user": "u-1", "max_tokens": 9, **OFF}, BOS + USER + "hi" + CHAT_TAIL),
    Conv("streamed", {"messages": HI, "stream": True, "stream_options": {"include_usage": True}},
         USER + "hi" + THINK_TAIL),
]

RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}}]


def fcall(cid: str, city: str) -> dict:
    return {"type": "function_call", "call_id": cid, "name": "get_weather", "arguments": json.dumps({"city": city})}


def fout(cid: str, out: str) -> dict:
    return {"type": "function_call_output", "call_id": cid, "output": out}


RESPONSES_CASES = [
    Conv("input-string", {"input": "hi"}, USER + "hi" + THINK_TAIL, has=(HIGH,), path=RESP),
    Conv("input-string-chat-gateway", {"input": "hi"}, BOS + USER + "hi" + CHAT_TAIL, default_thinking=False,
         path=RESP),
    Conv("instructions-effort-low", {"input": "hi", "instructions": "Be brief.", "reasoning": {"effort": "low"}},
         BOS + "Be brief." + USER + "hi" + THINK_TAIL, path=RESP),
    Conv("effort-none", {"input": "hi", "reasoning": {"effort": "none"}}, BOS + USER + "hi" + CHAT_TAIL, path=RESP),
    Conv("effort-high", {"input": "hi", "reasoning": {"effort": "high"}}, USER + "hi" + THINK_TAIL, has=(HIGH,),
         path=RESP),
    Conv("effort-max", {"input": "hi", "reasoning": {"effort": "max"}}, USER + "hi" + THINK_TAIL, has=(MAX,),
         path=RESP),
    Conv("message-items", {"input": [{"type": "message", "role": "system", "content": "Sys."},
                                     {"type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": "q1"},
                                                  {"type": "input_text", "text": "q2"}]}],
                           "reasoning": {"effort": "none"}},
         BOS + "Sys." + USER + "q1\n\nq2" + CHAT_TAIL, path=RESP),
    # the recipe's Responses converter makes a developer item user text (the chat endpoint's gateway
    # normalisation makes a developer message a system one instead)
    Conv("developer-item", {"input": [{"type": "message", "role": "developer", "content": "Use French."},
                                      {"type": "message", "role": "user", "content": "q"}],
                            "reasoning": {"effort": "none"}},
         BOS + USER + "Use French.\n\nq" + CHAT_TAIL, path=RESP),
    Conv("multiturn-items", {"input": [
        {"type": "message", "role": "user", "content": "a"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "thought"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "message", "role": "user", "content": "c"}]},
        USER + "a" + CHAT_TAIL + "b" + EOS + USER + "c" + THINK_TAIL, path=RESP),
    Conv("function-call-items", {"input": [
        {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        fcall("c1", "Paris"), fcall("c2", "Rome"), fout("c1", "15C"), fout("c2", "20C")],
        "tools": RESPONSES_TOOLS},
        "<tool_result>15C</tool_result>\n\n<tool_result>20C</tool_result>" + THINK_TAIL,
        has=(TOOLS_HEADER, THINK + "look" + END_THINK, "Paris", "Rome"), path=RESP),
    Conv("function-call-outputs-out-of-order", {"input": [
        {"type": "message", "role": "user", "content": "Weather?"}, fcall("c1", "Paris"), fcall("c2", "Rome"),
        fout("c2", "20C"), fout("c1", "15C")], "tools": RESPONSES_TOOLS, "reasoning": {"effort": "none"}},
        "<tool_result>15C</tool_result>\n\n<tool_result>20C</tool_result>" + CHAT_TAIL, path=RESP),
    Conv("tool-choice-required-no-reasoning", {"input": "x", "tools": RESPONSES_TOOLS, "tool_choice": "required",
                                               "reasoning": {"effort": "none"}}, USER + "x" + TOOL_PREFILL,
         path=RESP),
    Conv("streamed", {"input": "hi", "stream": True}, USER + "hi" + THINK_TAIL, path=RESP),
    Conv("text-format-text-and-extras", {"input": "hi", "text": {"format": {"type": "text"}}, "top_k": 3,
                                         "seed": 1, "max_output_tokens": 9}, USER + "hi" + THINK_TAIL, path=RESP),
]

MESSAGES_TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}}]


def msgs(messages: list, **kw) -> dict:
    return {"max_tokens": 64, "messages": messages, **kw}


MESSAGES_CASES = [
    Conv("user-only", msgs(HI), USER + "hi" + THINK_TAIL, path=MSGS),
    Conv("system-string", msgs(HI, system="You are terse.", **OFF), BOS + "You are terse." + USER + "hi" + CHAT_TAIL,
         path=MSGS),
    Conv("system-blocks", msgs(HI, system=[{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}], **OFF),
         BOS + "S1\n\nS2" + USER + "hi" + CHAT_TAIL, path=MSGS),
    Conv("thinking-enabled-budget", msgs(HI, thinking={"type": "enabled", "budget_tokens": 1024}),
         USER + "hi" + THINK_TAIL, default_thinking=False, path=MSGS),
    Conv("thinking-disabled", msgs(HI, **OFF), BOS + USER + "hi" + CHAT_TAIL, path=MSGS),
    Conv("text-blocks", msgs([{"role": "user", "content": [{"type": "text", "text": "p1"},
                                                           {"type": "text", "text": "p2"}]}]),
         USER + "p1\n\np2" + THINK_TAIL, path=MSGS),
    Conv("multiturn-thinking-blocks", msgs([
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "secret", "signature": "s"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"}]),
        USER + "a" + CHAT_TAIL + "b" + EOS + USER + "c" + THINK_TAIL, lacks=("secret",), path=MSGS),
    Conv("tool-use-tool-result", msgs([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "call it", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "15C"}]}],
        tools=MESSAGES_TOOLS), "<tool_result>15C</tool_result>" + THINK_TAIL,
        has=(TOOLS_HEADER, THINK + "call it" + END_THINK, 'string="true">Paris'), path=MSGS),
    Conv("parallel-tool-use-out-of-order", msgs([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "20C"}]},
            {"type": "tool_result", "tool_use_id": "t1", "content": "15C", "is_error": True}]}],
        tools=MESSAGES_TOOLS, **OFF),
        "<tool_result>15C</tool_result>\n\n<tool_result>20C</tool_result>" + CHAT_TAIL, path=MSGS),
    # a final assistant message is a finished turn in the recipe's Messages conversion, not Anthropic's
    # prefill (which the model would continue)
    Conv("ends-in-assistant", msgs([*HI, {"role": "assistant", "content": "The answer is"}], **OFF),
         USER + "hi" + CHAT_TAIL + "The answer is" + EOS + CHAT_TAIL, path=MSGS),
    Conv("streamed", msgs(HI, stream=True, **OFF), BOS + USER + "hi" + CHAT_TAIL, path=MSGS),
    Conv("extras-and-stop-sequences", msgs(HI, stop_sequences=["END"], top_k=5, metadata={"user_id": "u"}, seed=3),
         USER + "hi" + THINK_TAIL, path=MSGS),
]


def _check_prompt(env: Env, c: Conv) -> None:
    r, reqs = env.send(c.path, c.body, c.default_thinking)
    assert r.status_code == 200, r.text
    want = env.recipe_ids(c.path, c.expect if c.expect is not None else c.body, c.default_thinking)
    assert reqs, "nothing reached the backend"
    for q in reqs:
        assert q.prompt_ids == want, env.decode(q.prompt_ids)[-2000:]
    text = env.decode(want)
    assert text.startswith(BOS) and text.count(BOS) == 1
    assert text.endswith(c.tail), text[-300:]
    at = 0
    for s in c.has:
        at = text.find(s, at)
        assert at >= 0, (s, text)
        at += len(s)
    for s in c.lacks:
        assert s not in text


def test_corpus_sizes():
    assert (len(CHAT_CASES), len(RESPONSES_CASES), len(MESSAGES_CASES)) == (62, 14, 12)
    for cases in (CHAT_CASES, RESPONSES_CASES, MESSAGES_CASES):
        assert len({c.id for c in cases}) == len(cases)


@pytest.mark.parametrize("c", CHAT_CASES, ids=lambda c: c.id)
def test_chat_prompt_is_the_recipes(env, c):
    _check_prompt(env, c)


@pytest.mark.parametrize("c", RESPONSES_CASES, ids=lambda c: c.id)
def test_responses_prompt_is_the_recipes(env, c):
    _check_prompt(env, c)


@pytest.mark.parametrize("c", MESSAGES_CASES, ids=lambda c: c.id)
def test_messages_prompt_is_the_recipes(env, c):
    _check_prompt(env, c)


def test_max_completion_tokens_and_n_reach_the_backend(env):
    """The normalised fields do what they say: max_completion_tokens is the sample's budget, n=2 is two
    samples of the one prompt."""
    r, reqs = env.send(CHAT, {"messages": HI, "max_completion_tokens": 7, "n": 2, "seed": 5, **OFF})
    assert r.status_code == 200, r.text
    assert [q.params.max_new_tokens for q in reqs] == [7, 7]
    assert reqs[0].prompt_ids == reqs[1].prompt_ids == env.recipe_ids(CHAT, {"messages": HI, **OFF})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


FORCED_IN_THINKING = "tool_choice: Thinking mode does not support this tool_choice"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("thinking", [{"thinking": {"type": "enabled"}}, {"reasoning_effort": "high"}, {}],
                         ids=["thinking", "effort", "default"])
def test_forced_tool_choice_with_thinking_is_400(env, choice, thinking):
    """The recipe prefills the tool-call block only outside thinking mode; with thinking (explicit,
    implied by an effort, or the gateway's default) a forced choice is refused, not silently relaxed."""
    r, reqs = env.send(CHAT, {"messages": HI, "tools": [WEATHER], "tool_choice": choice, **thinking})
    assert (r.status_code, reqs) == (400, [])
    assert r.json() == {"error": {"message": FORCED_IN_THINKING, "type": "invalid_request_error",
                                  "param": "tool_choice", "code": 400}}


def test_forced_tool_choice_with_thinking_is_400_on_responses_and_messages(env):
    r, reqs = env.send(RESP, {"input": "x", "tools": RESPONSES_TOOLS, "tool_choice": "required"})
    assert (r.status_code, reqs) == (400, [])
    assert r.json() == {"error": {"message": FORCED_IN_THINKING, "type": "invalid_request_error",
                                  "param": "tool_choice", "code": 400}}
    r, reqs = env.send(MSGS, msgs(HI, tools=MESSAGES_TOOLS, tool_choice={"type": "tool", "name": "get_weather"}))
    assert (r.status_code, reqs) == (400, [])
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": FORCED_IN_THINKING}}


@pytest.mark.xfail(strict=True, reason="deepseek-recipe 0.2: the schema normalisation of a strict tool drops "
                                       "$defs / definitions but keeps the $ref that points there")
def test_strict_tool_schema_keeps_what_its_refs_point_to(env):
    """A strict tool's ``$ref: #/$defs/leg`` must still resolve in the prompt the model reads (the
    non-strict tool keeps ``$defs``: see the ``tools-nested-schema`` case)."""
    r, reqs = env.send(CHAT, {"messages": HI, "tools": [TRIP], **OFF})
    assert r.status_code == 200, r.text
    text = env.decode(reqs[0].prompt_ids)
    assert '"$ref": "#/$defs/leg"' in text
    assert '"$defs": {"leg": ' in text


# ---- special-token spellings in client text ----------------------------------------------------------------
def _count_specials(env: Env, ids: list[int]) -> Counter:
    return Counter(i for i in ids if i in env.special_ids)


def _chat_injected(s: str) -> dict:
    """Every client-controlled text field of a chat request holds ``s``."""
    return {"messages": [
        {"role": "system", "content": f"sys {s} sys"},
        {"role": "developer", "content": f"dev {s}"},
        {"role": "user", "content": f"u1 {s} u1"},
        {"role": "assistant", "content": f"a1 {s}", "reasoning_content": f"r1 {s}"},
        {"role": "user", "content": [{"type": "text", "text": f"u2 {s}"}, {"type": "text", "text": f"{s}"}]},
        {"role": "assistant", "content": f"a2 {s}", "reasoning_content": f"r2 {s}",
         "tool_calls": [call("c1", "lookup", {"q": f"arg {s}"})]},
        {"role": "tool", "tool_call_id": "c1", "content": f"res {s}"},
        {"role": "latest_reminder", "content": f"rem {s}"}],
        "tools": [tool("lookup", {"type": "object", "properties": {"q": {"type": "string", "description": f"d {s}"}}},
                       f"Look {s} up")]}


def _neutral_specials(env: Env, path: str, neutral: dict, s: str, assistant_fields: int) -> Counter:
    """The special ids the structure of ``neutral`` needs, plus ``assistant_fields`` grounding ids when
    ``s`` is a grounding token (see ``GROUNDING``)."""
    want = _count_specials(env, env.recipe_ids(path, neutral))
    if s in GROUNDING:
        want[env.sid(s)] += assistant_fields
    return want


def _dev_to_system(body: dict) -> dict:
    return {**body, "messages": [{**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]]}


@pytest.mark.parametrize("s", SPELLINGS)
def test_special_spellings_in_chat_are_text(env, s):
    body = _chat_injected(s)
    r, reqs = env.send(CHAT, body)
    assert r.status_code == 200, r.text
    ids = reqs[0].prompt_ids
    assert ids == env.recipe_ids(CHAT, _dev_to_system(body))
    # the structure's specials, and no more: the same conversation with a neutral word in place of s
    # (4 grounding ids more for a grounding spelling: a1, r1, a2, r2 are the assistant's text)
    assert _count_specials(env, ids) == _neutral_specials(env, CHAT, _dev_to_system(_chat_injected("X")), s, 4)
    counts = Counter(ids)
    # one BOS; EOS closing the two assistant turns; User: two turns + the tool result; Assistant: two
    # turns + the generation prompt; <think>: both turns' reasoning (kept: the conversation has tools)
    # + the generation's + 2 literal ones in the recipe's tools preamble; </think>: 2 closers + 2 there
    assert {x: counts[env.sid(x)] for x in (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)} == {
        BOS: 1, EOS: 2, USER: 3, ASSISTANT: 3, THINK: 5, END_THINK: 4}
    text = env.decode(ids)
    for piece in (f"sys {s} sys", f"dev {s}", f"u1 {s} u1", f"a1 {s}", f"r1 {s}", f"u2 {s}", f"r2 {s}", f"res {s}",
                  f"rem {s}", f"Look {s} up", f"arg {s}"):
        assert piece in text, piece


def _spelled_as_text(env, api, body, s, labels) -> None:
    """``body`` (with ``s`` spelled in every text field, each prefixed by a label) encodes as the
    recipe does, with ``s`` as text: as many special ids as the same body with a neutral word (two
    assistant fields excepted, see ``_neutral_specials``), one BOS, three user and assistant turns."""
    r, reqs = env.send(api, body)
    assert r.status_code == 200, r.text
    ids = reqs[0].prompt_ids
    assert ids == env.recipe_ids(api, body)
    neutral = json.loads(json.dumps(body).replace(json.dumps(s)[1:-1], "X"))
    assert _count_specials(env, ids) == _neutral_specials(env, api, neutral, s, 2)
    counts = Counter(ids)
    assert (counts[env.sid(BOS)], counts[env.sid(USER)], counts[env.sid(ASSISTANT)]) == (1, 3, 3)
    text = env.decode(ids)
    for label in labels:
        assert f"{label} {s}" in text, label


@pytest.mark.parametrize("s", SPELLINGS)
def test_special_spellings_in_responses_are_text(env, s):
    body = {"instructions": f"ins {s}", "tools": RESPONSES_TOOLS, "input": [
        {"type": "message", "role": "system", "content": f"sys {s}"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"u1 {s}"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"a1 {s}"}]},
        {"type": "message", "role": "user", "content": f"u2 {s}"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": f"r {s}"}]},
        fcall("c1", f"city {s}"), fout("c1", f"out {s}")]}
    _spelled_as_text(env, RESP, body, s, ("ins", "sys", "u1", "a1", "u2", "r", "city", "out"))   # a1, r: assistant


@pytest.mark.parametrize("s", SPELLINGS)
def test_special_spellings_in_messages_are_text(env, s):
    body = msgs([
        {"role": "user", "content": f"u1 {s}"},
        {"role": "assistant", "content": [{"type": "text", "text": f"a1 {s}"}]},
        {"role": "user", "content": [{"type": "text", "text": f"u2 {s}"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": f"t {s}", "signature": "sig"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": f"city {s}"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": f"res {s}"}]}],
        system=[{"type": "text", "text": f"sys {s}"}], tools=MESSAGES_TOOLS)
    _spelled_as_text(env, MSGS, body, s, ("sys", "u1", "a1", "u2", "t", "city", "res"))   # a1, t: assistant


def test_every_added_token_in_user_text_is_text(env):
    """All 1283 added tokens of the vocabulary (FIM, tool-call and placeholder tokens included),
    spelled in one user message: the prompt holds only the structure's BOS / User / Assistant / </think>."""
    spellings = [t.content for t in env.hf.get_added_tokens_decoder().values()]
    assert len(spellings) == 1283
    content = "|".join(spellings)
    body = {"messages": [{"role": "user", "content": content}], **OFF}
    r, reqs = env.send(CHAT, body)
    assert r.status_code == 200, r.text
    ids = reqs[0].prompt_ids
    assert ids == env.recipe_ids(CHAT, body)
    assert _count_specials(env, ids) == Counter({env.sid(BOS): 1, env.sid(USER): 1, env.sid(ASSISTANT): 1,
                                                 env.sid(END_THINK): 1})
    assert env.decode(ids) == BOS + USER + content + CHAT_TAIL


def test_completions_prompt_is_raw_model_input(env):
    """/v1/completions encodes its prompt as raw model input (vLLM): a spelled special token IS that
    token, the opposite of the chat endpoints above, deliberately."""
    r, reqs = env.send(CMPL, {"prompt": f"{USER}hi{ASSISTANT}{END_THINK}", "max_tokens": 2})
    assert r.status_code == 200, r.text
    hi = env.hf.encode("hi", add_special_tokens=False).ids
    assert reqs[0].prompt_ids == [env.sid(BOS), env.sid(USER), *hi, env.sid(ASSISTANT), env.sid(END_THINK)]
    # every single-token spelling the recipe knows maps to its id, once each
    single = [s for s in SPELLINGS if len(env.hf.encode(s, add_special_tokens=False).ids) == 1]
    assert len(single) == len(SPELLINGS) - 1            # all but <｜System｜>, which is not in the V4 vocabulary
    prompt = " ".join(single)
    r, reqs = env.send(CMPL, {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    ids = reqs[0].prompt_ids
    assert ids == [env.sid(BOS), *env.hf.encode(prompt, add_special_tokens=False).ids]
    counts = Counter(ids)
    assert {s: counts[env.sid(s)] for s in single} == {s: 2 if s == BOS else 1 for s in single}
    # the same text as a chat message: none of them (only the structure's own)
    r, reqs = env.send(CHAT, {"messages": [{"role": "user", "content": prompt}], **OFF})
    assert _count_specials(env, reqs[0].prompt_ids) == Counter(
        {env.sid(BOS): 1, env.sid(USER): 1, env.sid(ASSISTANT): 1, env.sid(END_THINK): 1})


# ---- the served name ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["DeepSeek-V4-Pro", "deepseek-v4-flash", "deepseek-chat", "deepseek_v4 ", ""])
def test_other_model_names_are_404(env, name):
    msg = f"model: the model `{name}` does not exist (served: `{NAME}`)"
    for path, body in ((CHAT, {"messages": HI}), (RESP, {"input": "hi"})):
        r, reqs = env.send(path, body, model=name)
        assert (r.status_code, reqs) == (404, [])
        assert r.json() == {"error": {"message": msg, "type": "not_found_error", "param": "model", "code": 404}}
    r, reqs = env.send(MSGS, msgs(HI), model=name)
    assert (r.status_code, reqs) == (404, [])
    assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message": msg}}


@pytest.mark.parametrize("path,body", [(CHAT, {"messages": HI}), (RESP, {"input": "hi"}), (MSGS, msgs(HI))],
                         ids=["chat", "responses", "messages"])
def test_no_model_field_is_the_served_model(env, path, body):
    r, reqs = env.send(path, body, model=None)
    assert r.status_code == 200, r.text
    assert reqs[0].prompt_ids == env.recipe_ids(path, body)
    assert r.json()["model"] == NAME
