"""1. The corpus through /v1/chat/completions (ASGI app: body, streamed at several splits) and through
the chat job at every split point: equal to the recipe."""
from __future__ import annotations

import pytest

from server.backends.base import TokenEvent
from server.gateway.chat_completions import prepare_chat
from server.gateway.protocol import ChatCompletionRequest

from .corpus import CHAT, CORPUS, DSML_MARK, MAX_LEN, STREAM_USAGE, THINK_END, Case, case_ids, chat_request
from .harness import Client, Stack, run
from .reference import (assemble, body_summary, chat_chunks, chat_want, exact_message, recipe,
                        stream_summary)


def test_corpus_covers_the_brief(stack):
    st = stack
    assert len(CORPUS) >= 45 and len({c.name for c in CORPUS}) == len(CORPUS)
    assert {c.think for c in CORPUS} == {True, False} and {c.tools for c in CORPUS} == {True, False}
    assert {c.finish for c in CORPUS} == {"stop", "length"}
    eos = st.tok.eos_id
    for c in CORPUS:
        ids = case_ids(st.tok, c)
        assert (ids[-1:] == [eos]) == (c.finish == "stop") and eos not in ids[:-1], c.name
    # the emoji case really is cut inside a character: its ids do not decode to whole characters
    e = next(c for c in CORPUS if c.name == "emoji-cut-mid-char")
    assert "\ufffd" in st.tok.decode(case_ids(st.tok, e))


@pytest.mark.parametrize("c", CORPUS, ids=lambda c: c.name)
def test_chat_corpus_equals_recipe(stack, c):
    st = stack
    ids = case_ids(st.tok, c)
    body = chat_request(c)
    exp = recipe(st.rtok, "chat", body, ids, c.finish)
    want_msg = exact_message(exp.response["choices"][0]["message"])
    want = chat_want(exp, c.drop > 0)
    _check_case_invariants(c, want)
    L = len(ids)
    ks = sorted({1, L // 2, L - 1} - {0, L}) if L > 1 else []

    async def go(cl: Client):
        got_body = await cl.post(CHAT, body, ids, c.finish)
        assert st.backend.requests[-1].prompt_ids == exp.prompt_ids     # the recipe's prompt, encoded alike
        sbody = {**body, **STREAM_USAGE}
        streams = {"split=1": await cl.post(CHAT, sbody, ids, c.finish, split=1),
                   "one event": await cl.post(CHAT, sbody, ids, c.finish, split=0)}
        for k in ks:
            streams[f"k={k}"] = await cl.post(CHAT, sbody, ids, c.finish, cuts=[k])
        return got_body, streams

    got_body, streams = run(st, go)
    assert exact_message(got_body["choices"][0]["message"]) == want_msg
    assert body_summary(got_body) == want
    assert got_body["usage"]["prompt_tokens"] == len(exp.prompt_ids)
    assert got_body["usage"]["total_tokens"] == len(exp.prompt_ids) + want["completion_tokens"]
    for how, text in streams.items():
        chunks = chat_chunks(text)
        s = assemble(chunks)
        assert list(s) == [0], how
        assert stream_summary(s[0]) == want, how
        assert s[0]["roles"] == ["assistant"] and chunks[-1]["choices"] == [], how
        assert all(ch["usage"] is None for ch in chunks[:-1]), how


def _check_case_invariants(c: Case, want: dict) -> None:
    """What the brief promises of the reference itself, so the corpus tests what it claims."""
    if c.tools and c.variant != "none":
        assert DSML_MARK not in want["content"], (c.name, want)
    if c.variant in ("required", "named"):
        assert want["calls"] and want["finish"] == ("tool_calls" if c.finish == "stop" else "length"), want
    if c.think:
        assert THINK_END not in want["content"] and THINK_END not in want["reasoning"]
    if c.name in ("stop-in-reasoning", "stop-straddles-end", "stop-is-think-end"):
        assert want["reasoning"] == "I think so." and want["content"] == "Final answer.", want
    if c.name == "stop-in-tool-block":
        assert want["calls"] == [("f", {"a": "x", "b": {"k": [1, 2]}})] and want["finish"] == "tool_calls"
    if c.name.startswith("two-stops"):
        assert want["content"] == "a " and want["finish"] == "stop"
    if c.name.startswith("dsml-") and c.tools and "unknown" not in c.name:
        assert want["calls"] and want["calls"][0][0] == "f", want


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
def test_every_split_point_at_the_job_level(stack, stream):
    """Two events split at token boundary k, for every k and every corpus output, through
    ``prepare_chat`` / ``ChatJob`` / its assemblers (what the gateway's ``Generation`` drives);
    streamed with return_token_ids and include_usage, so the ids must also come back whole."""
    st = stack
    for c in CORPUS:
        ids = case_ids(st.tok, c)
        body = chat_request(c)
        exp = recipe(st.rtok, "chat", body, ids, c.finish)
        want, want_msg = chat_want(exp, c.drop > 0), exact_message(exp.response["choices"][0]["message"])
        if stream:
            body = {**body, **STREAM_USAGE, "return_token_ids": True}
        for k in range(1, len(ids)):
            job, asms, sse = drive_job(st, body, [ids[:k], ids[k:]], c.finish)
            if stream:
                chunks = chat_chunks("".join(sse))
                s = assemble(chunks)[0]
                assert stream_summary(s) == want, (c.name, k)
                assert s["token_ids"] == ids[:exp.consumed], (c.name, k)
                assert all(ch["usage"] is None for ch in chunks[:-1]) and chunks[-1]["choices"] == []
            else:
                got = job.body(asms)
                assert body_summary(got) == want, (c.name, k)
                assert exact_message(got["choices"][0]["message"]) == want_msg, (c.name, k)


def drive_job(st: Stack, body: dict, events: list[list[int]], finish: str):
    """Run a chat job over scripted events the way ``server.gateway.Generation`` does (feed until
    the assembler finishes; abort if the events end first). Returns (job, assemblers, SSE texts)."""
    job = prepare_chat(ChatCompletionRequest.model_validate(body), st.fmt, st.tok, MAX_LEN, 8)
    asms = {s.index: job.assembler(s) for s in job.samples}
    out = list(job.head())
    for s in job.samples:
        asm = asms[s.index]
        for j, part in enumerate(events):
            last = j == len(events) - 1
            p = asm.feed(TokenEvent(list(part), finished=last, finish_reason=finish if last else None))
            if job.stream:
                out += job.events(s, p)
            if asm.finished:
                break
        if not asm.finished:
            p = asm.abort()
            if job.stream:
                out += job.events(s, p)
    if job.stream:
        out += job.tail(asms)
    return job, asms, out
