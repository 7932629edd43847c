"""2. /v1/responses and /v1/messages: the recipe's whole response object and its whole event sequence;
no EOS text in their output."""
from __future__ import annotations

import json

import pytest

from .corpus import API_CASES, DSML_MARK, EOS_TEXT, MODEL, MSG, THINK_END, ApiCase
from .harness import Client, run
from .reference import normalise, parse_sse, recipe


def _check_api_case(c: ApiCase, resp: dict) -> None:
    chk = c.check or {}
    if c.api == "responses":
        assert [o["type"] for o in resp["output"]] == chk["types"], resp["output"]
        if "status" in chk:
            assert resp["status"] == chk["status"]
        texts = [p["text"] for o in resp["output"] if o["type"] == "message" for p in o["content"]]
    else:
        assert [b["type"] for b in resp["content"]] == chk["types"], resp["content"]
        assert resp["stop_reason"] == chk["stop_reason"] and resp["stop_sequence"] == chk.get("stop_sequence")
        texts = [b["text"] for b in resp["content"] if b["type"] == "text"]
        if "text" in chk:
            assert texts == [chk["text"]]
    assert all(DSML_MARK not in t and THINK_END not in t for t in texts), texts


@pytest.mark.parametrize("c", API_CASES, ids=lambda c: c.name)
def test_responses_and_messages_equal_recipe(stack, c):
    st = stack
    ids = st.tok.encode(c.text) + ([st.tok.eos_id] if c.finish == "stop" else [])
    body = {"model": MODEL, **c.body}
    exp = recipe(st.rtok, c.api, body, ids, c.finish)
    _check_api_case(c, exp.response)
    want = normalise(exp.response, "RID")
    want_events = [normalise(e, "RID") for e in exp.events]
    path = "/v1/responses" if c.api == "responses" else "/v1/messages"

    async def go(cl: Client):
        got = await cl.post(path, body, ids, c.finish)
        assert st.backend.requests[-1].prompt_ids == exp.prompt_ids
        sbody = {**body, "stream": True}
        streams = {"split=1": await cl.post(path, sbody, ids, c.finish, split=1),
                   "one event": await cl.post(path, sbody, ids, c.finish, split=0),
                   "k=mid": await cl.post(path, sbody, ids, c.finish, cuts=[len(ids) // 2])}
        return got, streams

    got, streams = run(st, go)
    rid = got["id"]
    assert rid.startswith("resp_" if c.api == "responses" else "msg_")
    assert normalise(got, rid) == want
    for how, text in streams.items():
        msgs = parse_sse(text)
        events = [json.loads(d) for _, d in msgs]
        assert [n for n, _ in msgs] == [e["type"] for e in events], how        # event: line == data type
        for e, (n, _) in zip(events, msgs):
            e["_event"] = n
        first = events[0]["response"]["id"] if c.api == "responses" else events[0]["message"]["id"]
        assert [normalise(e, first) for e in events] == want_events, how


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_responses_and_messages_never_output_eos_text(stack, api):
    """/v1/responses and /v1/messages accept vLLM's ``ignore_eos`` (an extra field; the sampler
    honours it), so EOS can occur mid-output there too. Its text must not reach the output:
    vLLM's skip_special_tokens default, as on /v1/chat/completions. Either the request must not
    ask the backend to ignore EOS, or the output is the recipe's with EOS counted without text."""
    st = stack
    tok = st.tok
    ids = tok.encode("R.</think>A") + [tok.eos_id] + tok.encode(" B") + [tok.eos_id]
    body = ({"model": MODEL, "input": "hi", "ignore_eos": True} if api == "responses" else
            {"model": MODEL, "messages": MSG, "max_tokens": 100, "ignore_eos": True})
    recipe_body = {k: v for k, v in body.items() if k != "ignore_eos"}
    exp = recipe(st.rtok, api, recipe_body, ids, "stop", blank={ids.index(tok.eos_id), len(ids) - 1})
    path = "/v1/responses" if api == "responses" else "/v1/messages"

    async def go(cl: Client):
        return (await cl.post(path, body, ids, "stop"),
                await cl.post(path, {**body, "stream": True}, ids, "stop", split=0))

    got, text = run(st, go)
    if not st.backend.requests[-1].params.ignore_eos:
        return                      # the backend stops at EOS: no EOS mid-output can occur
    for how, out in (("body", json.dumps(got, ensure_ascii=False)), ("stream", text)):
        i = out.find(EOS_TEXT)
        assert i < 0, f"{how}: EOS text in the output: ...{out[max(0, i - 60):i + 40]}..."
    assert normalise(got, got["id"]) == normalise(exp.response, "RID")
