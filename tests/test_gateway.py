"""OpenAI gateway: a real uvicorn server, the real ``openai`` client, LocalBackend over the tiny engine.

Expected values come from the same engine run directly (``engine.generate``) before the server
starts: greedy text, seeded samples, logprobs. Tool-call / reasoning assembly is checked at the
serving layer by feeding the token ids of a DSML text (the random tiny model never writes one).
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
from engine.chat import apply_chat_template, prompt_token_ids
from engine.run_config import RunConfig
from engine.sampling import Sampled, SamplingParams
from engine.tokenizer import EOS_TOKEN, Tokenizer
from server.backend import BackendError, TokenEvent
from server.gateway import create_app
from server.local import LocalBackend
from serve_util import serve_app
from server.openai_serving import (ChoiceResult, SampleAssembler, TokenStrings, full_response, piece_chunk,
                                   prepare_chat, prepare_completion)
from server.protocol import ChatCompletionRequest, CompletionRequest

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
    chat_ids = prompt_token_ids(tok, apply_chat_template(HELLO))
    think_ids = prompt_token_ids(tok, apply_chat_template(HELLO, thinking=True))
    cmpl_ids = tok.encode(COMPLETION_PROMPT, add_bos=True)
    gen = engine.generate
    ref = {
        "chat": gen([chat_ids], _greedy(12))[0].output_ids,
        "think": gen([think_ids], _greedy(6))[0].output_ids,
        "cmpl": gen([cmpl_ids], _greedy(6))[0].output_ids,
        "lp": gen([chat_ids], SamplingParams(max_new_tokens=4, temperature=0, logprobs=3))[0].logprobs,
        "seeded": [gen([cmpl_ids], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7 + i))[0].output_ids
                   for i in range(3)],
        "chat_ids": chat_ids, "cmpl_ids": cmpl_ids,
    }
    with serve_app(create_app(LocalBackend(engine), tok, MODEL)) as url:
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
    assert m.reasoning_content == _text(tok, ref["think"]) and m.content == ""   # no </think>: all reasoning


# ---- errors ---------------------------------------------------------------------------------------------
BAD = [
    ("/v1/chat/completions", {"model": "nope", "messages": HELLO}, 404, "model"),
    ("/v1/chat/completions", {"messages": HELLO, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": HELLO, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"temperature": 0}, 400, "messages"),
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": HELLO, "tool_choice": {"type": "function", "function": {"name": "f"}},
                              "tools": [{"type": "function", "function": {"name": "g"}}]}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": HELLO, "chat_template_kwargs": {"reasoning_effort": "extreme"}}, 400,
     "chat_template_kwargs.reasoning_effort"),
    ("/v1/chat/completions", {"messages": HELLO, "stream": True, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": [5] * 4096}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [129280]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
]


def test_errors_are_openai_shaped_and_the_server_keeps_serving(stack, client):
    url, engine, tok, ref = stack
    with httpx.Client(base_url=url, timeout=30) as h:
        for path, body, status, param in BAD:
            r = h.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == status and err["message"].startswith(param), err
            assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        r = h.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
        assert h.get("/v1/nothing").status_code == 404 and "error" in h.get("/v1/nothing").json()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=-1)
    assert "temperature" in str(e.value)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, temperature=0)
    assert r.choices[0].message.content == _text(tok, ref["chat"][:2])
    assert _idle(engine)


def test_error_after_streaming_started_is_an_sse_event():
    """A backend failure after token #1: a final ``data: {"error": ...}`` event, then [DONE]."""
    class Failing:
        max_model_len = 64

        async def generate(self, req):
            yield TokenEvent([5], num_prompt_tokens=len(req.prompt_ids))
            raise BackendError("decode worker died", 502)

        async def health(self):
            return {"healthy": False}

        async def start(self):
            pass

        async def close(self):
            pass

    class Tok:
        vocab_size, bos_id, eos_id, max_token_chars = 100, 0, 1, 16

        def encode(self, text, add_bos=False):
            return [0, 7, 8] if add_bos else [7, 8]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(f"<{i}>" for i in ids)

    async def go():
        app = create_app(Failing(), Tok(), "m", api_keys=["k1"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
            body = {"prompt": "x", "max_tokens": 4, "stream": True}
            assert (await h.post("/v1/completions", json=body)).status_code == 401
            auth = {"Authorization": "Bearer k1"}
            r = await h.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200
            events = [x[len("data: "):] for x in r.text.split("\n\n") if x]
            assert json.loads(events[0])["choices"][0]["text"] == "<5>"
            assert json.loads(events[1])["error"]["code"] == 502 and events[2] == "[DONE]"
            r = await h.post("/v1/completions", json={**body, "stream": False}, headers=auth)
            assert r.status_code == 502 and r.json()["error"]["message"] == "decode worker died"
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


# ---- serving layer: tool calls, reasoning, stop hold-back (no model) ---------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer(tiny_ckpt("flash", 1))


def _feed_text(job, tok, text, reason="stop", eos=True):
    """Feed ``text``'s token ids one event each (+ EOS); returns the pieces of sample 0."""
    asm = SampleAssembler(job, job.samples[0], tok, TokenStrings(tok))
    ids = tok.encode(text) + ([tok.eos_id] if eos else [])
    pieces = []
    for j, t in enumerate(ids):
        last = j == len(ids) - 1
        pieces.append(asm.feed(TokenEvent([t], [Sampled(t, -0.5, [(t, -0.5)])], last, reason if last else None)))
        if asm.finished:
            break
    return asm, pieces


def test_tool_calls_and_reasoning_from_dsml_token_ids(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = ChatCompletionRequest(messages=HELLO, tools=tools, logprobs=True, stream=True,
                                chat_template_kwargs={"thinking": True})
    job = prepare_chat(req, tok, MODEL, 4096, 8)
    assert job.thinking and job.tools_enabled and job.samples[0].params.logprobs == 0
    dsml = ('I should call the tool.</think>Checking.\n\n<｜DSML｜tool_calls>\n'
            '<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            '</｜DSML｜tool_calls>')
    asm, pieces = _feed_text(job, tok, dsml)
    chunks = [c for c in (piece_chunk(job, job.samples[0], p) for p in pieces) if c]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call the tool."
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks) == asm.num_tokens
    assert all(EOS_TOKEN not in json.dumps(d, ensure_ascii=False) for d in deltas)
    res = ChoiceResult()
    for p in pieces:
        res.add(p)
    body = full_response(job, [res])
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should call the tool." and msg["content"] == "Checking."
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather" and "index" not in msg["tool_calls"][0]
    assert body["usage"]["completion_tokens"] == asm.num_tokens
    # tool_choice "none": tools left out of the prompt, DSML stays plain content
    job = prepare_chat(ChatCompletionRequest(messages=HELLO, tools=tools, tool_choice="none"), tok, MODEL, 4096, 8)
    assert not job.tools_enabled
    _, pieces = _feed_text(job, tok, dsml)
    assert "".join(p.text for p in pieces) == dsml and pieces[-1].finish_reason == "stop"
    # parallel_tool_calls=false keeps the first call only
    two = dsml.replace("</｜DSML｜tool_calls>", '<｜DSML｜invoke name="get_weather">\n</｜DSML｜invoke>\n'
                       "</｜DSML｜tool_calls>").replace("</think>", "")
    job = prepare_chat(ChatCompletionRequest(messages=HELLO, tools=tools, parallel_tool_calls=False), tok, MODEL,
                       4096, 8)
    _, pieces = _feed_text(job, tok, two.replace("I should call the tool.", ""))
    assert [c["function"]["name"] for p in pieces for c in p.tool_calls] == ["get_weather"]
    assert pieces[-1].finish_reason == "tool_calls"


def test_stop_string_hold_back_at_the_serving_layer(tok):
    req = CompletionRequest(prompt="x", stop=["STOP here", "xyz"], stream=True,
                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    job = prepare_completion(req, tok, MODEL, 4096, 8)
    text = "Some text. STOP nearly, then STOP here and more"
    asm, pieces = _feed_text(job, tok, text, reason=None, eos=False)
    chunks = [(p, piece_chunk(job, job.samples[0], p)) for p in pieces]
    assert all(c["usage"]["completion_tokens"] == p.total_tokens for p, c in chunks if c)
    assert "".join(p.text for p in pieces) == "Some text. STOP nearly, then "
    assert pieces[-1].finish_reason == "stop" and asm.stopped_by_string
    emitted = ""
    for p in pieces:         # no emitted prefix ever ends inside a possible stop string
        emitted += p.text
        assert not re.search(r"(S|ST|STO|STOP|STOP |STOP h\w*|x|xy)$", emitted) or p.finish_reason
    assert asm.num_tokens < len(tok.encode(text))
