"""Happy paths: models and health, chat and completions equal to the engine (streamed or not), n and
seeds, stop strings and stop token ids, logprobs, Anthropic's count_tokens, tools and thinking."""
from __future__ import annotations

import httpx
import openai
import pytest

from server.gateway.dsformat import DeepSeekFormat

from .common import COMPLETION_PROMPT, HELLO, MODEL, _idle, _text


def test_models_and_health(stack, client):
    url, engine, _, _ = stack
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == engine.limits.max_model_len
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json()["healthy"] is True


def test_chat_greedy_equals_engine_stream_equals_nonstream(stack, client):
    _, engine, tok, ref = stack
    want = _text(tok, ref["chat"][:8])
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    c = r.choices[0]
    assert c.message.content == want and c.message.role == "assistant" and c.finish_reason == "length"
    assert r.object == "chat.completion" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ref["chat_ids"]), 8, len(ref["chat_ids"]) + 8)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_completion_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage is None for ch in chunks[:-1])
    assert _idle(engine)


def test_completions_prompt_forms_and_echo(stack, client):
    _, _, tok, ref = stack
    want = _text(tok, ref["cmpl"])
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=6, temperature=0)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ref["cmpl_ids"])
    r = client.completions.create(model=MODEL, prompt=ref["cmpl_ids"], max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == _text(tok, ref["cmpl_ids"]) + want
    r = client.completions.create(model=MODEL, prompt=[COMPLETION_PROMPT, "Hi"], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == _text(tok, ref["cmpl"][:3])
    assert r.usage.prompt_tokens == len(ref["cmpl_ids"]) + len(tok.encode("Hi", add_bos=True))
    chunks = list(client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=6, temperature=0,
                                            stream=True, echo=True))
    assert "".join(c.choices[0].text for c in chunks) == COMPLETION_PROMPT + want
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[0].object == "text_completion"


def test_n_with_seed_is_reproducible_and_matches_engine(stack, client):
    _, _, tok, ref = stack
    kw = dict(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices] == [_text(tok, ids) for ids in ref["seeded"]]
    assert len(set(texts)) > 1 and a.usage.completion_tokens == 18
    one = client.completions.create(**{**kw, "n": 1, "seed": 8})          # choice i == seed + i
    assert one.choices[0].text == texts[1]
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, n=2, temperature=0,
                                                 stream=True))
    got = {0: "", 1: ""}
    for ch in chunks:
        got[ch.choices[0].index] += ch.choices[0].delta.content or ""
    assert got[0] == got[1] == _text(tok, ref["chat"][:3])


def test_stop_strings_truncate_and_hold_back(stack, client):
    _, engine, tok, ref = stack
    full = _text(tok, ref["chat"])
    # a stop string completed at token 7 (of 12), starting inside the text: found where it first occurs
    k = len(_text(tok, ref["chat"][:6]))
    stop = full[k - 2:k + 1]
    cut = full.find(stop)
    assert 0 <= cut < k
    base = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    r = client.chat.completions.create(**base, stop=[stop, "never-seen-stop-string"])
    assert r.choices[0].message.content == full[:cut] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 12
    r = client.chat.completions.create(**base, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == full[:cut] + stop
    chunks = list(client.chat.completions.create(**base, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert _idle(engine)          # the stop string aborted the sample: its state is freed


def test_stop_token_ids(stack, client):
    _, _, tok, ref = stack
    ids = ref["chat"]
    i = 3
    stop_id = ids[i]
    first = ids.index(stop_id)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0,
                                       extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    assert r.choices[0].message.content == _text(tok, ids[:first])     # the stop token's text is not output


def test_logprobs_shapes_and_values(stack, client):
    _, _, tok, ref = stack
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e, s in zip(content, ref["lp"]):
        assert e.token == tok.decode([s.token_id]) and e.logprob == pytest.approx(s.logprob)
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
    r = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.tokens == [tok.decode([t]) for t in ref["cmpl"][:4]]
    assert lp.text_offset == [sum(map(len, lp.tokens[:j])) for j in range(4)]
    assert all(1 <= len(d) <= 3 and max(d.values()) == pytest.approx(x) for d, x in zip(lp.top_logprobs,
                                                                                       lp.token_logprobs))
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)


def test_anthropic_count_tokens_is_the_prompt_a_messages_request_sends(stack):
    """Anthropic's /v1/messages/count_tokens (Claude Code asks it): the prompt ids' count."""
    url, engine, tok, _ = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "system": "Be brief.",
            "thinking": {"type": "disabled"}}
    fmt = DeepSeekFormat(tok.model_dir, MODEL)
    want = len(fmt.encode(fmt.convert("messages", body)[0], 4096, "messages"))
    with httpx.Client(base_url=url, timeout=30) as h:
        r = h.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 200 and r.json() == {"input_tokens": want}
        r = h.post("/v1/messages", json={**body, "max_tokens": 1, "temperature": 0})
        assert r.json()["usage"]["input_tokens"] == want
        r = h.post("/v1/messages/count_tokens", json={**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_max_tokens_one_tools_and_thinking(stack, client):
    _, _, tok, ref = stack
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == _text(tok, ref["chat"][:1])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    assert m.reasoning_content == _text(tok, ref["think"]) and not m.content   # no </think>: all reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens == 6
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                       extra_body={"thinking": {"type": "enabled"}})
    assert r.choices[0].message.reasoning_content == _text(tok, ref["think"])
