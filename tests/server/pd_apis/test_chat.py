"""Chat Completions (sync, async, streamed, n=3; thinking on and off) and Completions through the
``openai`` SDK; the served name and the API key."""
from __future__ import annotations

import asyncio
import re

import anthropic
import httpx
import openai
import pytest

from engine.tokenizer import Tokenizer

from .common import KEY, MODEL, Recipe, chat_body, chat_kwargs, expect_message


CHAT_SYNC = ("Name a colour.", 8)
CHAT_ASYNC = [("Count to three.", True), ("Count to three.", False), ("Say a word. " * 20, True)]
CHAT_ASYNC_N = 6
CHAT_STREAM = ("Name an animal.", 7)
CHAT_N3 = ("Pick a number.", 5)
COMPLETION = ("The capital of France is", 9)


def greedy_cases(recipe: Recipe, bos_id: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) of every request this module compares with the engine (``greedy``)."""
    chat = [(chat_body(CHAT_SYNC[0], CHAT_SYNC[1], t), CHAT_SYNC[1]) for t in (True, False)]
    chat += [(chat_body(text, CHAT_ASYNC_N, t), CHAT_ASYNC_N) for text, t in CHAT_ASYNC]
    chat += [(chat_body(CHAT_STREAM[0], CHAT_STREAM[1], t), CHAT_STREAM[1]) for t in (True, False)]
    chat += [(chat_body(CHAT_N3[0], CHAT_N3[1], True), CHAT_N3[1])]
    out = [(recipe.prompt_ids("chat", b), n) for b, n in chat]
    out += [([bos_id] + recipe.tok.encode(COMPLETION[0]), COMPLETION[1])]
    return out


# ---- models, served name ---------------------------------------------------------------------------
def test_models_lists_the_served_name_and_workers_label_it(stack, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    for name, url in stack.metrics_urls.items():
        text = httpx.get(url, timeout=10).text
        labels = set(re.findall(r'model_name="([^"]*)"', text))
        assert labels == {MODEL}, (name, labels)
        assert re.search(r'^dsv4:generation_tokens_total\{[^}]*model_name="deepseek_v4"', text, re.M), name


def test_wrong_key_is_401_in_each_apis_shape(stack):
    bad = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    bad_a = anthropic.Anthropic(base_url=stack.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_a.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid or missing API key"}}


# ---- chat completions ------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_chat_sync_equals_engine_and_recipe(stack, oai, recipe, greedy, thinking):
    n = CHAT_SYNC[1]
    body = chat_body(CHAT_SYNC[0], n, thinking)
    r = oai.chat.completions.create(**chat_kwargs(body, return_token_ids=True))
    stack.ledger.append(r.usage.completion_tokens)
    ch = r.choices[0]
    prompt = recipe.prompt_ids("chat", body)
    want = greedy(prompt, n)
    assert r.model_extra["prompt_token_ids"] == prompt             # vLLM: top-level in a chat response
    assert ch.model_extra["token_ids"] == want
    msg = expect_message(recipe, body, want, r.id)
    assert ch.message.content == msg.get("content")
    assert getattr(ch.message, "reasoning_content", None) == msg.get("reasoning_content")
    if thinking:
        assert ch.message.content == "" and ch.message.reasoning_content     # no </think>: all reasoning
    else:
        assert ch.message.content and msg.get("reasoning_content") is None
    assert ch.finish_reason == "length" and ch.message.tool_calls is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), n)
    details = r.usage.completion_tokens_details
    assert (details.reasoning_tokens if details else None) == (n if thinking else None)


def test_chat_async_concurrent_equals_engine(stack, recipe, greedy):
    n = CHAT_ASYNC_N
    bodies = [chat_body(text, n, thinking) for text, thinking in CHAT_ASYNC]

    async def run():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(client.chat.completions.create(**chat_kwargs(b, return_token_ids=True))
                                          for b in bodies))
        finally:
            await client.close()
    results = asyncio.run(run())
    stack.ledger.extend(r.usage.completion_tokens for r in results)
    for body, r in zip(bodies, results):
        prompt = recipe.prompt_ids("chat", body)
        want = greedy(prompt, n)
        ch = r.choices[0]
        assert r.model_extra["prompt_token_ids"] == prompt
        assert ch.model_extra["token_ids"] == want
        msg = expect_message(recipe, body, want, r.id)
        assert (ch.message.content, getattr(ch.message, "reasoning_content", None)) == \
            (msg.get("content"), msg.get("reasoning_content"))
        assert r.usage.completion_tokens == n
    assert len({tuple(r.model_extra["prompt_token_ids"]) for r in results}) == 3


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_chat_stream_equals_engine_and_recipe(stack, oai, recipe, greedy, thinking):
    n = CHAT_STREAM[1]
    body = chat_body(CHAT_STREAM[0], n, thinking)
    chunks = list(oai.chat.completions.create(**chat_kwargs(body, return_token_ids=True), stream=True,
                                              stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    stack.ledger.append(usage.completion_tokens)
    prompt = recipe.prompt_ids("chat", body)
    want = greedy(prompt, n)
    ids, content, reasoning, finish = [], "", "", []
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1 and c.choices[0].index == 0
        d = c.choices[0].delta
        ids += c.choices[0].model_extra.get("token_ids") or []
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        finish += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert chunks[-1].choices == [] and len({c.id for c in chunks}) == 1
    assert ids == want
    msg = expect_message(recipe, body, want, chunks[0].id)
    assert content == (msg.get("content") or "")
    assert reasoning == (msg.get("reasoning_content") or "")
    assert bool(reasoning) == thinking and bool(content) != thinking
    assert finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_chat_n3_greedy_choices_all_equal_engine(stack, oai, recipe, greedy, stream):
    n = CHAT_N3[1]
    body = chat_body(CHAT_N3[0], n, True)
    kw = dict(chat_kwargs(body, return_token_ids=True), n=3)
    prompt = recipe.prompt_ids("chat", body)
    want = greedy(prompt, n)
    if not stream:
        r = oai.chat.completions.create(**kw)
        stack.ledger.append(r.usage.completion_tokens)
        assert [c.index for c in r.choices] == [0, 1, 2] and r.model_extra["prompt_token_ids"] == prompt
        msg = expect_message(recipe, body, want, r.id)
        for c in r.choices:
            assert c.model_extra["token_ids"] == want
            assert (c.message.content, c.message.reasoning_content) == (msg["content"], msg["reasoning_content"])
            assert c.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 3 * n)
        assert r.usage.completion_tokens_details.reasoning_tokens == 3 * n
        return
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    stack.ledger.append(usage.completion_tokens)
    ids, reasoning, finish = {}, {}, {}
    for c in chunks[:-1]:
        for ch in c.choices:
            ids.setdefault(ch.index, []).extend(ch.model_extra.get("token_ids") or [])
            reasoning[ch.index] = reasoning.get(ch.index, "") + (getattr(ch.delta, "reasoning_content", None) or "")
            if ch.finish_reason:
                finish[ch.index] = finish.get(ch.index, []) + [ch.finish_reason]
    msg = expect_message(recipe, body, want, chunks[0].id)
    assert ids == {0: want, 1: want, 2: want}
    assert reasoning == {i: msg["reasoning_content"] for i in range(3)}
    assert finish == {i: ["length"] for i in range(3)}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 3 * n)


# ---- completions -------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_completions_text_prompt_max_completion_tokens(stack, oai, recipe, greedy, ckpt, stream):
    text, n = COMPLETION                        # n: not the endpoint's default of 16
    tok = Tokenizer(ckpt)
    prompt = [tok.bos_id] + recipe.tok.encode(text)
    want = greedy(prompt, n)
    kw = dict(model=MODEL, prompt=text, temperature=0,
              extra_body={"max_completion_tokens": n, "return_token_ids": True})
    if not stream:
        r = oai.completions.create(**kw)
        stack.ledger.append(r.usage.completion_tokens)
        c = r.choices[0]
        got_ids, got_prompt, got_text, finish, usage = (c.model_extra["token_ids"], c.model_extra["prompt_token_ids"],
                                                        c.text, [c.finish_reason], r.usage)
    else:
        chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        stack.ledger.append(usage.completion_tokens)
        got_ids = [t for c in chunks[:-1] for ch in c.choices for t in ch.model_extra.get("token_ids") or []]
        got_text = "".join(ch.text for c in chunks[:-1] for ch in c.choices)
        finish = [ch.finish_reason for c in chunks[:-1] for ch in c.choices if ch.finish_reason]
        got_prompt = prompt                     # a streamed completion carries no prompt ids
    assert got_prompt == prompt
    assert got_ids == want
    assert got_text == tok.decode(want, skip_special_tokens=True)
    assert finish == ["length"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)
