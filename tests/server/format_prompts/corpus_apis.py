"""The /v1/responses and /v1/messages corpora (``Conv`` with ``path`` RESP / MSGS) and their tools."""
from __future__ import annotations

import json

from .corpus import (BOS, CHAT_TAIL, END_THINK, EOS, HI, HIGH, MAX, MSGS, OFF, RESP, THINK, THINK_TAIL, TOOL_PREFILL,
                     TOOLS_HEADER, USER, Conv)


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
