"""3. The gateway's extras beyond the recipe (chat): n=3, return_token_ids, include_stop_str_in_output,
usage chunks, skip_special_tokens, logprobs."""
from __future__ import annotations

import pytest

from engine.core.sampling_params import Sampled

from .corpus import CHAT, CORPUS, EOS_TEXT, MODEL, STREAM_USAGE, Case, case_ids, chat_request
from .harness import Client, run
from .reference import (assemble, body_summary, chat_chunks, chat_want, exact_message, recipe,
                        stream_summary, summary)


def _case(name: str) -> Case:
    return next(c for c in CORPUS if c.name == name)


def _text_only(summary_: dict) -> dict:
    return {k: summary_[k] for k in ("content", "reasoning", "calls", "finish")}


def test_n3_each_choice_equals_the_single_sample_result(stack):
    st = stack
    c = _case("dsml-think")
    ids = case_ids(st.tok, c)
    exp = recipe(st.rtok, "chat", chat_request(c), ids, c.finish)
    want_msg, want = exact_message(exp.response["choices"][0]["message"]), chat_want(exp)
    body = {**chat_request(c), "n": 3}

    async def go(cl: Client):
        return (await cl.post(CHAT, body, ids, c.finish),
                {"split=1": await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=1),
                 "one event": await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=0),
                 "k=7": await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, cuts=[7])})

    got, streams = run(st, go)
    assert [ch["index"] for ch in got["choices"]] == [0, 1, 2]
    assert all(exact_message(ch["message"]) == want_msg and ch["finish_reason"] == "tool_calls"
               for ch in got["choices"])
    P, N = len(exp.prompt_ids), 3 * want["completion_tokens"]           # the prompt counts once
    assert got["usage"] == {"prompt_tokens": P, "completion_tokens": N, "total_tokens": P + N,
                            "prompt_tokens_details": {"cached_tokens": 0},
                            "completion_tokens_details": {"reasoning_tokens": 3 * want["reasoning_tokens"]}}
    for how, text in streams.items():
        chunks = chat_chunks(text)
        s = assemble(chunks)
        assert sorted(s) == [0, 1, 2], how
        for i in range(3):
            assert _text_only(stream_summary(s[i])) == _text_only(want), (how, i)
            assert s[i]["roles"] == ["assistant"], (how, i)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == got["usage"], how
        assert all(ch["usage"] is None for ch in chunks[:-1]), how


@pytest.mark.parametrize("name", ["dsml-think", "stop-in-content", "cjk-chat"])
def test_return_token_ids(stack, name):
    """token_ids: every id the backend emitted up to the end of the output, across the chunks of
    each choice (n=2); prompt_token_ids: the prompt the backend got, on each choice's first chunk
    (streamed) / at the top of the response (vLLM's chat shape)."""
    st = stack
    c = _case(name)
    ids = case_ids(st.tok, c)
    exp = recipe(st.rtok, "chat", chat_request(c), ids, c.finish)
    want, used = chat_want(exp), ids[:exp.consumed]
    body = {**chat_request(c), "n": 2, "return_token_ids": True}

    async def go(cl: Client):
        out = {"body": await cl.post(CHAT, body, ids, c.finish)}
        for how, kw in {"split=1": {"split": 1}, "one event": {"split": 0}, "k=3": {"cuts": [3]}}.items():
            out[how] = await cl.post(CHAT, {**body, "stream": True}, ids, c.finish, **kw)
        return out

    out = run(st, go)
    prompt = st.backend.requests[-1].prompt_ids
    assert prompt == exp.prompt_ids
    full = out.pop("body")
    assert full["prompt_token_ids"] == prompt
    for i, ch in enumerate(full["choices"]):
        assert ch["index"] == i and ch["token_ids"] == used and "prompt_token_ids" not in ch
        assert _text_only(summary(ch["message"], ch["finish_reason"], None)) == _text_only(want)
    for how, text in out.items():
        chunks = chat_chunks(text)
        s = assemble(chunks)
        for i in (0, 1):
            assert s[i]["token_ids"] == used, (how, i)
            assert _text_only(stream_summary(s[i])) == _text_only(want), (how, i)
            mine = [ch for ch in chunks if ch["choices"][0]["index"] == i]
            assert mine[0]["prompt_token_ids"] == prompt and "role" in mine[0]["choices"][0]["delta"], (how, i)
            assert all("prompt_token_ids" not in ch for ch in mine[1:]), (how, i)


INCLUDE_STOP = [
    # (corpus case, stop strings, the stop string the recipe matched: content + it is the output)
    ("stop-in-content", None, "END"),
    ("stop-across-tokens", None, "lo wo"),
    ("stop-cjk", None, "世界"),
    ("two-stops-later-first", None, "yy"),
    # one token (" the") completes both stop strings: the recipe stops at the one that ends first
    # ("th"); at the same end, at the first listed. Output "Go th" / "Go the": a prefix of the text
    ("same-token-two-stops", ("th", "e"), "th"),
    ("same-end-shorter-listed-first", ("he", "the"), "he"),
    ("same-end-longer-listed-first", ("the", "he"), "the"),
]


@pytest.mark.parametrize("name,stops,matched", INCLUDE_STOP, ids=[x[0] for x in INCLUDE_STOP])
def test_include_stop_str_in_output_appends_the_matched_stop_string(stack, name, stops, matched):
    st = stack
    c = (_case(name) if stops is None else
         Case(name, "R.</think>Go the way", stop=stops))
    ids = case_ids(st.tok, c)
    exp = recipe(st.rtok, "chat", chat_request(c), ids, c.finish)
    want = chat_want(exp)
    assert want["finish"] == "stop" and exp.consumed < len(ids)            # a stop string ended it
    mb = {"model": MODEL, "messages": chat_request(c)["messages"], "max_tokens": 100, "stop_sequences": list(c.stop),
          "thinking": {"type": "enabled" if c.think else "disabled"}}
    assert recipe(st.rtok, "messages", mb, ids, c.finish).response["stop_sequence"] == matched
    want = {**want, "content": want["content"] + matched}
    body = {**chat_request(c), "include_stop_str_in_output": True}

    async def go(cl: Client):
        return (await cl.post(CHAT, body, ids, c.finish),
                [await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=sp) for sp in (1, 0)])

    got, streams = run(st, go)
    assert body_summary(got) == want
    for text in streams:
        assert stream_summary(assemble(chat_chunks(text))[0]) == want


def test_include_stop_str_in_output_final_stop_token(stack):
    """The final stop token's text is output only with include_stop_str_in_output: a stop token
    from stop_token_ids always, EOS only when skip_special_tokens is off (vLLM)."""
    st = stack
    bang = st.tok.encode("!")
    assert len(bang) == 1
    ids = st.tok.encode("R.</think>Yes") + bang                       # stopped by stop_token_ids=[!]
    base = {**chat_request(Case("stop-token", "")), "stop_token_ids": bang}
    plain = recipe(st.rtok, "chat", base, ids, "stop")                        # "!" counted, not output
    shown = recipe(st.rtok, "chat", base, ids, "stop", blank=set())          # "!" output
    assert body_summary(plain.response)["content"] == "Yes" and body_summary(shown.response)["content"] == "Yes!"
    eos_ids = st.tok.encode("R.</think>Yes") + [st.tok.eos_id]
    eos_plain = recipe(st.rtok, "chat", base, eos_ids, "stop")
    eos_shown = recipe(st.rtok, "chat", base, eos_ids, "stop", blank=set())
    assert body_summary(eos_shown.response)["content"] == "Yes" + EOS_TEXT
    runs = [  # (request extras, ids, the reference)
        ({}, ids, plain), ({"include_stop_str_in_output": True}, ids, shown),
        ({"include_stop_str_in_output": True}, eos_ids, eos_plain),
        ({"include_stop_str_in_output": True, "skip_special_tokens": False}, eos_ids, eos_shown),
        ({"skip_special_tokens": False}, eos_ids, eos_plain),
    ]

    async def go(cl: Client):
        out = []
        for extra, i, _ in runs:
            b = {**base, **extra}
            out.append((await cl.post(CHAT, b, i, "stop"),
                        await cl.post(CHAT, {**b, **STREAM_USAGE}, i, "stop", split=0)))
        return out

    for (extra, _, ref), (got, text) in zip(runs, run(st, go)):
        want = chat_want(ref)
        assert body_summary(got) == want, extra
        assert stream_summary(assemble(chat_chunks(text))[0]) == want, extra


def test_usage_chunks(stack):
    """No stream_options: no usage anywhere. include_usage: exactly one last chunk, empty choices,
    the non-streamed usage; null usage on every other chunk. continuous_usage_stats: usage on
    every chunk, completion_tokens = the ids returned so far."""
    st = stack
    c = _case("dsml-think")
    ids = case_ids(st.tok, c)
    body = chat_request(c)

    async def go(cl: Client):
        return (await cl.post(CHAT, {**body, "n": 2}, ids, c.finish),
                await cl.post(CHAT, {**body, "n": 2, "stream": True}, ids, c.finish),
                await cl.post(CHAT, {**body, "n": 2, **STREAM_USAGE}, ids, c.finish, cuts=[5, 9]),
                await cl.post(CHAT, {**body, "stream": True, "return_token_ids": True,
                                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                              ids, c.finish, cuts=[2, 3, 10, 40]),
                await cl.post(CHAT, body, ids, c.finish))

    got2, none, last, cont, got1 = run(st, go)
    chunks = chat_chunks(none)
    assert all(ch.get("usage") is None and ch["choices"] for ch in chunks)
    chunks = chat_chunks(last)
    assert [ch for ch in chunks if not ch["choices"]] == [chunks[-1]]
    assert chunks[-1]["usage"] == got2["usage"] and all(ch["usage"] is None for ch in chunks[:-1])
    chunks = chat_chunks(cont)
    P, seen = got1["usage"]["prompt_tokens"], 0
    for ch in chunks[:-1]:
        seen += len(ch["choices"][0]["token_ids"])
        u = ch["usage"]
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (P, seen, P + seen), ch
    assert seen == len(ids) and chunks[-1]["choices"] == [] and chunks[-1]["usage"] == got1["usage"]
    assert chunks[-2]["usage"] == got1["usage"]          # the finish chunk: the whole usage


@pytest.mark.parametrize("finish", ["length", "stop"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_skip_special_tokens_with_eos_and_bos_mid_output(stack, skip, finish):
    """ignore_eos: EOS (and BOS) met mid-output are counted; with skip_special_tokens (the
    default) their text is not output, as vLLM's detokenizer skips it; without, the recipe
    gets their text."""
    st = stack
    tok = st.tok
    ids = (tok.encode("Thinking") + [tok.eos_id] + tok.encode(" more.</think>A") + [tok.eos_id] + tok.encode(" B")
           + [tok.bos_id] + tok.encode(" C") + ([tok.eos_id] if finish == "stop" else []))
    special = {k for k, t in enumerate(ids) if t in (tok.eos_id, tok.bos_id)}
    last = {len(ids) - 1} if finish == "stop" else set()
    body = chat_request(Case("ignore-eos", ""))
    exp = recipe(st.rtok, "chat", body, ids, finish, blank=special | last if skip else last)
    want = chat_want(exp)
    if skip:
        assert (want["reasoning"], want["content"]) == ("Thinking more.", "A B C")
    else:
        assert EOS_TEXT in want["content"] + want["reasoning"]
    req = {**body, "ignore_eos": True, "skip_special_tokens": skip}

    async def go(cl: Client):
        return (await cl.post(CHAT, req, ids, finish),
                [await cl.post(CHAT, {**req, **STREAM_USAGE}, ids, finish, **kw) for kw in
                 ({"split": 1}, {"split": 0}, {"cuts": [len(ids) // 2]})])

    got, streams = run(st, go)
    assert exact_message(got["choices"][0]["message"]) == exact_message(exp.response["choices"][0]["message"])
    assert body_summary(got) == want
    for text in streams:
        assert stream_summary(assemble(chat_chunks(text))[0]) == want


@pytest.mark.parametrize("name", ["think-basic", "dsml-think", "cjk-chat", "stop-in-content"])
def test_logprobs_equal_recipe(stack, name):
    """Backend logprobs (one Sampled per id) reach the recipe, which places them per channel
    (content / reasoning_content); the final stop token's are dropped with its text."""
    st = stack
    c = _case(name)
    ids = case_ids(st.tok, c)
    sampled = [Sampled(t, -0.01 * (k + 1), [(t, -0.01 * (k + 1)), (7, -5.0 - k)]) for k, t in enumerate(ids)]
    lps = [(s.logprob, list(s.top_logprobs)) for s in sampled]
    body = {**chat_request(c), "logprobs": True, "top_logprobs": 2}
    exp = recipe(st.rtok, "chat", body, ids, c.finish, logprobs=lps)
    want_lp = exp.response["choices"][0]["logprobs"]
    assert want_lp and sum(map(len, want_lp.values())) >= 3

    async def go(cl: Client):
        return (await cl.post(CHAT, body, ids, c.finish, split=1, logprobs=sampled),
                [await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, split=sp, logprobs=sampled)
                 for sp in (1, 0)]
                + [await cl.post(CHAT, {**body, **STREAM_USAGE}, ids, c.finish, cuts=[4], logprobs=sampled)])

    got, streams = run(st, go)
    assert st.backend.requests[-1].params.logprobs == 2
    assert got["choices"][0]["logprobs"] == want_lp
    assert body_summary(got) == chat_want(exp)
    for text in streams:
        s = assemble(chat_chunks(text))[0]
        assert s["logprobs"] == {k: v for k, v in want_lp.items() if v}
        assert stream_summary(s) == chat_want(exp)
