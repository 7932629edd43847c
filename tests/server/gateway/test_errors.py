"""Bad requests get each API's error shape (status, param, message) and the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest

from .common import HELLO, MODEL, _idle, _text


# (path, body, status, param, what the message says). Conversation errors are the recipe's messages.
BAD = [
    ("/v1/chat/completions", {"model": "nope", "messages": HELLO}, 404, "model", "model"),
    ("/v1/chat/completions", {"messages": HELLO, "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/chat/completions", {"messages": HELLO, "temperature": "hot"}, 400, "temperature", "temperature"),
    ("/v1/chat/completions", {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": HELLO, "n": 0}, 400, "n", "n"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"temperature": 0}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 5000}, 400, "max_tokens", "maximum context length"),
    ("/v1/chat/completions", {"messages": HELLO, "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "tools": [{"type": "function", "function": {"name": "g"}}]}, 400, "tool_choice", "'f'"),
    ("/v1/chat/completions", {"messages": HELLO, "thinking": {"type": "sometimes"}}, 400, "thinking.type",
     "sometimes"),
    # an invalid schema (the recipe's check), or one the worker cannot compile: 400 naming the field
    ("/v1/chat/completions", {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}}, 400,
     "response_format", "Invalid json schema"),
    ("/v1/chat/completions", {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, 400,
     "response_format", "cannot be compiled: Invalid range"),
    ("/v1/chat/completions", {"messages": HELLO, "stream": True, "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": [5] * 4096}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": [129280]}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 3}, 400, "min_tokens", "min_tokens"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 5000}, 400, "max_completion_tokens",
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HELLO + [{"role": "assistant", "content": "{", "prefix": True}],
                              "response_format": {"type": "regex", "regex": "a+"}}, 400, "response_format",
     "prefilled assistant message"),
    ("/v1/chat/completions", {"messages": HELLO, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"s": {"type": "string", "minLength": 5,
                                                                        "maxLength": 2}}}}}]}, 400, "tools",
     "cannot be compiled"),
    ("/v1/chat/completions", {"messages": HELLO, "response_format": {"type": "regex", "regex": "a("}}, 400,
     "response_format", "cannot be compiled: Regex parsing error"),
    ("/v1/responses", {"input": "json please", "text": {"format": {"type": "json_schema", "name": "x",
                                                                   "schema": {"type": "object", "minProperties": "x"}}}},
     400, "text.format", "Invalid json schema"),
    # asked for, not done: a 400 naming the field, never silently ignored
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format",
     "/v1/chat/completions"),
    ("/v1/chat/completions", {"messages": HELLO, "guided_json": {"type": "object"}}, 400, "guided_json",
     "not supported"),
    ("/v1/chat/completions", {"messages": HELLO, "add_generation_prompt": False}, 400, "add_generation_prompt",
     "always opened"),
    ("/v1/chat/completions", {"messages": HELLO, "functions": [{"name": "f"}]}, 400, "functions", "use tools"),
    ("/v1/chat/completions", {"messages": HELLO, "chat_template_kwargs": {"thinking": "no"}}, 400,
     "chat_template_kwargs.thinking", "true or false"),
    ("/v1/chat/completions", {"messages": HELLO, "chat_template_kwargs": {"reasoning_effort": 5}}, 400,
     "chat_template_kwargs.reasoning_effort", "chat_template_kwargs.reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "file", "file": {
        "file_data": "x"}}]}]}, 400, "messages[0].content[0]", "only text"),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens", "maximum context length"),      # max_completion_tokens wins (OpenAI, vLLM)
    ("/v1/responses", {"input": "x", "max_tokens": 4}, 400, "max_tokens", "max_output_tokens"),
    ("/v1/responses", {"input": [{"type": "input_file", "file_id": "f"}]}, 400, "input[0]", "only text"),
    ("/v1/responses", {"input": 5}, 400, "input", "input"),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id",
     "previous_response_id"),
]


def test_errors_are_openai_shaped_and_the_server_keeps_serving(stack, client):
    url, engine, tok, ref = stack
    with httpx.Client(base_url=url, timeout=30) as h:
        for path, body, status, param, says in BAD:
            r = h.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == status and says in err["message"], err
            assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        tool_image = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]
        for body, status, says in [({"messages": HELLO}, 400, "max_tokens"),      # Anthropic requires it
                                   ({"messages": HELLO, "max_tokens": 4, "output_format": {"type": "text"}}, 400,
                                    "output_format"),
                                   ({"messages": HELLO, "max_tokens": 4, "output_config": {"format": {
                                       "type": "json_schema", "schema": {"type": "bogus"}}}}, 400,
                                    "output_config.format: the output constraint cannot be compiled"),
                                   ({"messages": tool_image, "max_tokens": 4}, 400,
                                    "messages[2].content[0].content[0]"),
                                   ({"messages": HELLO, "max_tokens": 4, "stop_sequences": [""]}, 400, "stop_sequences"),
                                   ({"messages": HELLO, "max_tokens": 4, "model": "nope"}, 404, "nope"),
                                   ({"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4}, 400, "robot")]:
            r = h.post("/v1/messages", json=body)
            assert r.status_code == status, r.text
            e = r.json()
            assert e["type"] == "error" and says in e["error"]["message"], e
            assert e["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        r = h.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
        assert h.get("/v1/nothing").status_code == 404 and "error" in h.get("/v1/nothing").json()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=-1)
    assert "temperature" in str(e.value)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    assert r.choices[0].message.content == _text(tok, ref["chat"][:2])
    assert _idle(engine)
