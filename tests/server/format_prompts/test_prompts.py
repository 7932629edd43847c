"""The prompt of every conversation of the corpora equals the recipe's; forced tool choices in
thinking mode; the served name."""
from __future__ import annotations

import pytest

from .corpus import BOS, CHAT, CHAT_CASES, HI, MSGS, NAME, OFF, RESP, TRIP, WEATHER, Conv
from .corpus_apis import MESSAGES_CASES, MESSAGES_TOOLS, RESPONSES_CASES, RESPONSES_TOOLS, msgs
from .env import Env


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
