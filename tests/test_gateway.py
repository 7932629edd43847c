"""OpenAI gateway: a real uvicorn server, the real ``openai`` client, LocalBackend over the tiny engine.

Expected values come from the same engine run directly (``engine.tools.generate``) before the server
starts: greedy text, seeded samples, logprobs; chat prompt ids are DeepSeek's recipe's encoding
(``server.gateway.dsformat``). The app runs with thinking off by default so the random model's text lands in
``content`` (stop strings apply to content only); thinking mode is checked on its own. DSML tool-call
and reasoning parsing are covered by tests/test_format_outputs.py (the random model never writes one).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.build import build_engine
from engine.run_config import RunConfig
from engine.core.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from server.backends.base import BackendError, TokenEvent
from server.backends.local import LocalBackend
from server.gateway.app import create_app
from server.gateway.completions import TokenStrings, prepare_completion
from server.gateway.dsformat import DeepSeekFormat
from serve_util import serve_app
from server.gateway.protocol import CompletionRequest

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-dsv4"
HELLO = [{"role": "user", "content": "Hello"}]
COMPLETION_PROMPT = "The capital of France is"


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0)


@pytest.fixture(scope="module")
def stack(tiny_ckpt):
    """(base_url, engine, tokenizer, references); the server runs for the whole module."""
    ckpt = tiny_ckpt("flash", 1)
    engine = build_engine(RunConfig.from_yaml(ROOT / "configs" / "tiny-flash.yaml"), ckpt, progress=False)
    tok = Tokenizer(ckpt)
    fmt = DeepSeekFormat(ckpt, MODEL, default_thinking=False)
    chat_ids = fmt.encode(fmt.convert("chat", {"messages": HELLO})[0], 4096, "messages")
    think_ids = fmt.encode(fmt.convert("chat", {"messages": HELLO, "thinking": {"type": "enabled"}})[0], 4096,
                           "messages")
    assert chat_ids[-2:] == [128804, 128822] and think_ids[-2:] == [128804, 128821]   # </think> vs <think>
    cmpl_ids = tok.encode(COMPLETION_PROMPT, add_bos=True)
    gen = engine.tools.generate
    ref = {
        "chat": gen([chat_ids], _greedy(12))[0].output_ids,
        "think": gen([think_ids], _greedy(6))[0].output_ids,
        "cmpl": gen([cmpl_ids], _greedy(6))[0].output_ids,
        "lp": gen([chat_ids], SamplingParams(max_new_tokens=4, temperature=0, logprobs=3))[0].logprobs,
        "seeded": [gen([cmpl_ids], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7 + i))[0].output_ids
                   for i in range(3)],
        "chat_ids": chat_ids, "cmpl_ids": cmpl_ids,
    }
    with serve_app(create_app(LocalBackend(engine), tok, MODEL, default_thinking=False)) as url:
        yield url, engine, tok, ref


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _idle(engine, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_free_blocks() == engine.num_total_blocks():
            return True
        time.sleep(0.02)
    return False


def _metrics(url) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def _metric(m, name, **labels) -> float:
    for k, v in m.items():
        if k.startswith("dsv4:" + name + "{") and all(f'{a}="{b}"' in k for a, b in labels.items()):
            return v
    return 0.0


# ---- happy paths ----------------------------------------------------------------------------------------
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


# ---- errors ---------------------------------------------------------------------------------------------
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
    ("/v1/chat/completions", {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, 400, "response_format", "constrained decoding"),
    ("/v1/chat/completions", {"messages": HELLO, "stream": True, "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": [5] * 4096}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": [129280]}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 3}, 400, "min_tokens", "min_tokens"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 5000}, 400, "max_completion_tokens",
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "json please"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format", "constrained"),
    ("/v1/chat/completions", {"messages": HELLO, "response_format": {"type": "regex", "regex": "a+"}}, 400,
     "response_format", "constrained"),
    ("/v1/responses", {"input": "json please", "text": {"format": {"type": "json_schema", "name": "x",
                                                                   "schema": {"type": "object"}}}}, 400,
     "text.format", "constrained"),
    # asked for, not done: a 400 naming the field, never silently ignored
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format",
     "constrained decoding"),
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
                                   ({"messages": HELLO, "max_tokens": 4, "output_format": {
                                       "type": "json_schema", "schema": {"type": "object"}}}, 400, "output_format"),
                                   ({"messages": HELLO, "max_tokens": 4, "output_config": {"format": {
                                       "type": "json_schema", "schema": {}}}}, 400, "output_config.format"),
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


def test_error_after_streaming_started_is_an_error_event_in_each_apis_form(tok):
    """A backend failure after token #1 ends the stream with the API's error event: OpenAI's
    ``data: {"error": ...}`` + [DONE] (chat, completions), Responses' ``event: error``, Anthropic's
    ``event: error`` with ``{"type": "error", "error": {...}}``; non-streamed, the status itself."""
    class Failing:
        max_model_len = 4096

        async def generate(self, req):
            yield TokenEvent([tok.encode("Hi")[0]], num_prompt_tokens=len(req.prompt_ids))
            raise BackendError("decode worker died", 502)

        async def health(self):
            return {"healthy": False}

        async def start(self):
            pass

        async def close(self):
            pass

    def sse(text):
        return [(ev.split("\n")[0][len("event: "):] if ev.startswith("event: ") else None,
                 ev.split("data: ", 1)[1]) for ev in text.split("\n\n") if ev]

    async def go():
        app = create_app(Failing(), tok, "m", api_keys=["k1"], default_thinking=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            body = {"prompt": "x", "max_tokens": 4, "stream": True}
            assert (await h.post("/v1/completions", json=body)).status_code == 401
            auth = {"Authorization": "Bearer k1"}
            r = await h.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200
            events = [d for _, d in sse(r.text)]
            assert json.loads(events[0])["choices"][0]["text"] == "Hi"
            assert json.loads(events[1])["error"]["code"] == 502 and events[2] == "[DONE]"
            r = await h.post("/v1/completions", json={**body, "stream": False}, headers=auth)
            assert r.status_code == 502 and r.json()["error"]["message"] == "decode worker died"
            chat = {"messages": HELLO, "max_tokens": 4, "stream": True}
            events = sse((await h.post("/v1/chat/completions", json=chat, headers=auth)).text)
            assert json.loads(events[-2][1])["error"]["code"] == 502 and events[-1][1] == "[DONE]"
            assert "Hi" in "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                                   for _, d in events[:-2])
            events = sse((await h.post("/v1/responses", json={"input": "Hi", "stream": True}, headers=auth)).text)
            assert events[0][0] == "response.created" and events[-1][0] == "error"
            err = json.loads(events[-1][1])
            assert err["type"] == "error" and err["message"] == "decode worker died" and err["code"] == "502"
            assert err["sequence_number"] == len(events) - 1
            msgs = {"messages": HELLO, "max_tokens": 4, "stream": True}
            assert (await h.post("/v1/messages", json=msgs)).status_code == 401
            r = await h.post("/v1/messages", json=msgs, headers={"x-api-key": "k1"})    # Anthropic's header
            events = sse(r.text)
            assert events[0][0] == "message_start" and events[-1][0] == "error"
            assert json.loads(events[-1][1]) == {"type": "error", "error": {"type": "api_error",
                                                                          "message": "decode worker died"}}
            r = await h.post("/v1/messages", json={**msgs, "stream": False}, headers={"x-api-key": "k1"})
            assert r.status_code == 502 and r.json()["error"]["type"] == "api_error"
            r = await h.post("/v1/messages", json=msgs, headers={"x-api-key": "wrong"})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert (await h.get("/health")).status_code == 503
    asyncio.run(go())


# ---- metrics and disconnects -----------------------------------------------------------------------------
def test_metrics_add_up_to_usage(stack, client):
    url = stack[0]
    before = _metrics(url)
    r1 = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0, n=2)
    r2 = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, max_tokens=2, temperature=0)
    after = _metrics(url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert _metric(d, "prompt_tokens_total") == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    assert _metric(d, "generation_tokens_total") == r1.usage.completion_tokens + r2.usage.completion_tokens == 8
    assert _metric(d, "request_success_total", finished_reason="length") == 3
    assert _metric(d, "time_to_first_token_seconds_count") == 3
    assert _metric(d, "e2e_request_latency_seconds_count") == 3
    assert _metric(d, "request_time_per_output_token_seconds_count") == 3
    assert _metric(d, "inter_token_latency_seconds_count") == 5     # (3-1) * 2 + (2-1) gaps
    assert _metric(after, "num_requests_running") == 0


def test_client_disconnect_aborts_the_sample(stack):
    url, engine, _, _ = stack
    before = _metric(_metrics(url), "request_success_total", finished_reason="abort")
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2000, "temperature": 0, "stream": True,
            "extra_field_ignored": 1}
    with httpx.Client(base_url=url, timeout=30) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert len(engine.seqs) == 1
    assert _idle(engine), "the disconnected sample still holds state"
    assert not engine.seqs
    # not streamed: the client gives up waiting (read timeout) and closes the connection
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2000, "temperature": 0}, timeout=1.0)
    assert _idle(engine) and not engine.seqs
    deadline = time.monotonic() + 5
    while _metric(_metrics(url), "request_success_total", finished_reason="abort") != before + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ---- serving layer: stop hold-back (no model) -------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer(tiny_ckpt("flash", 1))


def _feed_text(job, tok, text, reason="stop", eos=True):
    """Feed ``text``'s token ids one event each (+ EOS); returns the assembler and its pieces."""
    asm = job.assembler(job.samples[0])
    ids = tok.encode(text) + ([tok.eos_id] if eos else [])
    pieces = []
    for j, t in enumerate(ids):
        last = j == len(ids) - 1
        pieces.append(asm.feed(TokenEvent([t], None, last, reason if last else None)))
        if asm.finished:
            break
    return asm, pieces


def test_stop_string_hold_back_at_the_serving_layer(tok):
    req = CompletionRequest(prompt="x", stop=["STOP here", "xyz"], stream=True,
                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    job = prepare_completion(req, tok, TokenStrings(tok), MODEL, 4096, 8)
    text = "Some text. STOP nearly, then STOP here and more"
    asm, pieces = _feed_text(job, tok, text, reason=None, eos=False)
    chunks = [(p, json.loads(e[len("data: "):])) for p in pieces for e in job.events(job.samples[0], p)]
    assert all(c["usage"]["completion_tokens"] == p.total_tokens for p, c in chunks)
    assert "".join(p.text for p in pieces) == "Some text. STOP nearly, then "
    assert pieces[-1].finish_reason == "stop" and asm.stopped_by_string
    emitted = ""
    for p in pieces:         # no emitted prefix ever ends inside a possible stop string
        emitted += p.text
        assert not re.search(r"(S|ST|STO|STOP|STOP |STOP h\w*|x|xy)$", emitted) or p.finish_reason
    assert asm.num_tokens < len(tok.encode(text))
