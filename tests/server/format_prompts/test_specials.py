"""Special-token spellings in client text are text (every chat field, Responses, Messages, every
added token); /v1/completions maps them to special ids, deliberately."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from .corpus import (ASSISTANT, BOS, CHAT, CHAT_TAIL, CMPL, END_THINK, EOS, GROUNDING, MSGS, OFF, RESP, SPELLINGS,
                     THINK, USER, call, tool)
from .corpus_apis import MESSAGES_TOOLS, RESPONSES_TOOLS, fcall, fout, msgs
from .env import Env


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
