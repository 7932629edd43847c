"""Anthropic Messages (``create`` and ``stream``; tools, thinking on / off) through the ``anthropic``
SDK; each API's error shape."""
from __future__ import annotations

import anthropic
import openai
import pytest

from .common import MODEL, Recipe, dump, messages_body, messages_kwargs


# Anthropic's stream events (the SDK's helper adds "text" / "thinking" / "signature" events of its own)
_WIRE_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                "message_delta", "message_stop"}
MESSAGES_CREATE_N, MESSAGES_STREAM_N = 8, 8
MESSAGES_STREAM = [(True, True), (False, False)]      # (thinking, tools)


def greedy_cases(recipe: Recipe, bos_id: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of every request this module compares with the engine (``greedy``)."""
    msgs = [(t, tools, MESSAGES_CREATE_N) for t in (True, False) for tools in (True, False)]
    msgs += [(t, tools, MESSAGES_STREAM_N) for t, tools in MESSAGES_STREAM]
    return [(recipe.prompt_ids("messages", {**messages_body(n, t, tools), "temperature": 0}), n)
            for t, tools, n in msgs]


def _messages_expected(recipe, greedy, body):
    rbody = {**body, "temperature": 0}
    prompt = recipe.prompt_ids("messages", rbody)
    want = greedy(prompt, body["max_tokens"])
    return prompt, want, rbody


@pytest.mark.parametrize("tools", [True, False], ids=["tools", "no-tools"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_messages_create_equals_recipe_of_engine_ids(stack, ant, recipe, greedy, thinking, tools):
    n = MESSAGES_CREATE_N
    body = messages_body(n, thinking, tools)
    raw = ant.messages.with_raw_response.create(**messages_kwargs(body))
    m = raw.parse()
    stack.ledger.append(m.usage.output_tokens)
    prompt, want, rbody = _messages_expected(recipe, greedy, body)
    expected = recipe.response("messages", rbody, want, m.id)
    assert raw.http_response.json() == expected
    kinds = [b.type for b in m.content]
    assert kinds == (["thinking"] if thinking else ["text"])
    got = m.content[0].thinking if thinking else m.content[0].text
    want_block = expected["content"][0]
    assert got and got == want_block["thinking" if thinking else "text"]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (len(prompt), n)
    assert m.model == MODEL and m.role == "assistant"


def test_messages_tools_change_the_prompt(recipe):
    """The tool definitions reach the rendered prompt (so the tools cases above test another prompt)."""
    with_tools = recipe.prompt_ids("messages", {**messages_body(4, False, True), "temperature": 0})
    without = recipe.prompt_ids("messages", {**messages_body(4, False, False), "temperature": 0})
    assert len(with_tools) > len(without) + 10


@pytest.mark.parametrize("thinking,tools", MESSAGES_STREAM, ids=["thinking-tools", "plain"])
def test_messages_stream_equals_recipe_of_engine_ids(stack, ant, recipe, greedy, thinking, tools):
    n = MESSAGES_STREAM_N
    body = messages_body(n, thinking, tools)
    with ant.messages.stream(**messages_kwargs(body)) as s:
        events = [e for e in s if e.type in _WIRE_EVENTS]      # the helper adds its own "text" / "thinking"
        final = s.get_final_message()
    stack.ledger.append(final.usage.output_tokens)
    prompt, want, rbody = _messages_expected(recipe, greedy, body)
    # the SDK drops "ping" events (the recipe sends one after the first content_block_start)
    expected = [e for e in recipe.events("messages", rbody, want, final.id) if e["type"] != "ping"]
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert types == [e["type"] for e in expected]
    # the helper adds snapshots of its own to the stop events; the rest is the wire's
    own = {"content_block_stop": "content_block", "message_stop": "message"}
    assert [{k: v for k, v in dump(e).items() if k != own.get(e.type)} for e in events] == expected
    message = dump(final)
    assert message.pop("stop_details", None) is None          # the helper copies it from message_delta
    assert message == recipe.response("messages", rbody, want, final.id)
    assert final.stop_reason == "max_tokens"
    assert [b.type for b in final.content] == (["thinking"] if thinking else ["text"])
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(prompt), n)


def test_errors_have_each_apis_shape(oai, ant):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:                  # OpenAI's shape on /v1/responses
        oai.responses.create(model="gpt-nope", input="hi", max_output_tokens=4)
    assert e.value.status_code == 404
    assert e.value.body == {"message": e.value.body["message"], "type": "not_found_error", "param": "model",
                            "code": 404} and "gpt-nope" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        ant.messages.create(model="claude-nope", max_tokens=4, messages=msgs)
    assert e.value.status_code == 404
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):                 # streamed: refused before the headers
        with ant.messages.stream(model="claude-nope", max_tokens=4, messages=msgs) as s:
            list(s)
    for bad in ({"max_tokens": 0, "messages": msgs},                        # pydantic: max_tokens >= 1
                {"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}):   # the recipe refuses
        with pytest.raises(anthropic.BadRequestError) as e:
            ant.messages.create(model=MODEL, **bad)
        assert e.value.status_code == 400
        assert set(e.value.body) == {"type", "error"} and e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error" and e.value.body["error"]["message"]
