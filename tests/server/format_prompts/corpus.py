"""The chat corpus: conversations posted to /v1/chat/completions, each with what its prompt must
show (``Conv``), and the spellings and markers the checks look for in a decoded prompt."""
from __future__ import annotations

import json
from dataclasses import dataclass

import deepseek_recipe as dr

NAME = "deepseek_v4"
CHAT, RESP, MSGS, CMPL = "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"
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
