"""Bad input to the gateway: each case an OpenAI-shaped 4xx naming the field, never a 5xx, and the
next valid request is served.

A real uvicorn server over ``LocalBackend`` and the tiny engine (as in tests/server/gateway/), raw bodies
posted with httpx. The app runs with ``max_body_bytes=LIMIT`` (1 MiB) so the oversize cases stay
cheap; the 32 MiB default is checked on the signature. Limits the cases rely on (documented in
``server.gateway.protocol``): context 4096 tokens (configs/tiny-flash.yaml), n <= 128 choices, temperature
in [0, 2], top_logprobs / completions logprobs <= 20 (vLLM's max_logprobs), at most 16 stop strings
of at most 1024 characters each.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from engine.build import build_engine
from engine.run_config import RunConfig
from engine.tokenizer import Tokenizer
from server.backends.local import LocalBackend
from server.gateway.app import create_app
from server.gateway.body_limit import BodyLimit
from serve_util import serve_app

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-dsv4"
LIMIT = 1 << 20
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]
JSON_CT = {"content-type": "application/json"}


@dataclass
class Case:
    """``body``: a dict (sent as JSON), bytes (sent raw) or a callable giving an iterator of chunks
    (sent chunked). ``name``: a substring of the message that names the field; ``param``: the
    expected ``param`` (default: ``name`` for dict bodies, where the message must start with it)."""

    id: str
    path: str
    body: object
    status: int
    name: str
    param: str | None = "="
    headers: dict = field(default_factory=lambda: dict(JSON_CT))

    def __post_init__(self):
        if self.param == "=":
            self.param = self.name if isinstance(self.body, dict) else None


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 1, **kw}


def cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 1, **kw}


def tool(**fn) -> dict:
    return {"type": "function", "function": {"name": "get_weather", **fn}}


def _nested(depth: int):
    x = "leaf"
    for _ in range(depth):
        x = [x]
    return x


def _oversize_chunks():
    chunk = b" " * 65536
    yield b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1'
    for _ in range(LIMIT // len(chunk) + 1):
        yield chunk
    yield b"}"


CASES = [
    # -- malformed bodies
    Case("json-truncated", CHAT, b'{"messages": [', 400, "invalid JSON"),
    Case("json-trailing-garbage", CHAT, b'{"messages": []} xyz', 400, "invalid JSON"),
    Case("json-not-object", CHAT, b'"hello"', 400, "request body"),
    Case("json-array", CHAT, b'[{"role": "user", "content": "x"}]', 400, "request body"),
    Case("json-number", CMPL, b"42", 400, "request body"),
    Case("json-empty-body", CHAT, b"", 400, "request body"),
    Case("json-wrong-content-type", CHAT, json.dumps(chat()).encode(), 400, "request body",
         headers={"content-type": "text/plain"}),
    Case("json-deeply-nested", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "body"),
    Case("json-nan", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "temperature": NaN}', 400,
         "temperature", "temperature"),
    Case("invalid-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}], "max_tokens": 1}', 400, "body"),
    Case("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}', 400,
         "messages", "messages"),
    Case("lone-surrogate-prompt", CMPL, b'{"prompt": "a\\udfffb", "max_tokens": 1}', 400, "prompt", "prompt"),
    Case("oversize-content-length", CHAT, b'{"messages": [], "x": "' + b"a" * LIMIT + b'"}', 413, "request body"),
    Case("oversize-chunked", CHAT, _oversize_chunks, 413, "request body"),
    Case("oversize-messages", "/v1/messages", b'{"messages": [], "x": "' + b"a" * LIMIT + b'"}', 413,
         "request body"),
    # -- wrong types
    Case("messages-string", CHAT, chat(messages="hi"), 400, "messages"),
    Case("messages-object", CHAT, chat(messages={"role": "user", "content": "x"}), 400, "messages"),
    Case("messages-item-string", CHAT, chat(messages=["hi"]), 400, "messages[0]"),
    Case("model-int", CHAT, chat(model=5), 400, "model"),
    Case("max_tokens-string", CHAT, chat(max_tokens="2"), 400, "max_tokens"),
    Case("max_tokens-float", CHAT, chat(max_tokens=2.5), 400, "max_tokens"),
    Case("max_tokens-integral-float", CMPL, cmpl(max_tokens=2.0), 400, "max_tokens"),
    Case("max_tokens-bool", CMPL, cmpl(max_tokens=True), 400, "max_tokens"),
    Case("temperature-string", CHAT, chat(temperature="0.5"), 400, "temperature"),
    Case("temperature-bool", CMPL, cmpl(temperature=False), 400, "temperature"),
    Case("n-float", CHAT, chat(n=1.5), 400, "n"),
    Case("n-string", CMPL, cmpl(n="1"), 400, "n"),
    Case("stream-yes", CHAT, chat(stream="yes"), 400, "stream"),
    Case("stream-int", CMPL, cmpl(stream=1), 400, "stream"),
    Case("logprobs-string", CHAT, chat(logprobs="true"), 400, "logprobs"),
    Case("seed-string", CHAT, chat(seed="1"), 400, "seed"),
    Case("stop-int", CHAT, chat(stop=5), 400, "stop"),
    Case("stop-list-of-ints", CMPL, cmpl(stop=[1, 2]), 400, "stop"),
    Case("user-int", CHAT, chat(user=5), 400, "user"),
    Case("prompt-int", CMPL, cmpl(prompt=5), 400, "prompt"),
    Case("prompt-mixed-list", CMPL, cmpl(prompt=["a", 5]), 400, "prompt"),
    # -- messages
    Case("messages-missing", CHAT, {"model": MODEL}, 400, "messages"),
    Case("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    Case("role-unknown", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    Case("role-missing", CHAT, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    Case("content-missing", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    Case("content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    Case("content-part-image", CHAT,       # a text model: refused, not replaced by placeholder text
         chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
         "messages[0].content[0]"),
    Case("content-part-unknown-type", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": "hologram", "hologram": "x"}]}]), 400,
         "messages[0].content[0].type"),
    # a "type" that is not a string (the fuzzer's find: an object was looked up in a set, a 500)
    Case("content-part-type-object", CHAT,
         chat(messages=[{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]), 400, "messages[0]"),
    Case("content-part-no-text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
         "messages[0].content[0].text"),
    Case("prompt-missing", CMPL, {"model": MODEL, "max_tokens": 1}, 400, "prompt"),
    Case("prompt-empty-list", CMPL, cmpl(prompt=[]), 400, "prompt"),
    Case("prompt-token-out-of-vocab", CMPL, cmpl(prompt=[129280]), 400, "prompt"),
    # -- lengths
    Case("chat-prompt-over-context", CHAT, chat(messages=[{"role": "user", "content": "hello " * 5000}]), 400,
         "messages"),
    Case("prompt-over-context", CMPL, cmpl(prompt=[5] * 4096), 400, "prompt"),
    # too many characters for any tokenisation: refused before tokenising (no GIL-bound stall)
    Case("chat-text-over-context-chars", CHAT, chat(messages=[{"role": "user", "content": "x" * 600_000}]), 400,
         "messages", "messages"),
    Case("prompt-text-over-context-chars", CMPL, cmpl(prompt="y" * 600_000), 400, "prompt", "prompt"),
    Case("stop-token-ids-too-many", CHAT, chat(stop_token_ids=list(range(257))), 400, "stop_token_ids",
         "stop_token_ids"),
    Case("max_tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    Case("max_tokens-negative", CMPL, cmpl(max_tokens=-1), 400, "max_tokens"),
    Case("max_tokens-huge", CHAT, chat(max_tokens=10 ** 6), 400, "max_tokens"),
    Case("max_tokens-beyond-int64", CMPL, cmpl(max_tokens=1 << 70), 400, "max_tokens"),
    Case("max_completion_tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    Case("n-zero", CHAT, chat(n=0), 400, "n"),
    Case("n-negative", CMPL, cmpl(n=-1), 400, "n"),
    Case("n-over-limit", CHAT, chat(n=129), 400, "n"),
    Case("n-times-prompts-over-limit", CMPL, cmpl(prompt=["a", "b"], n=100), 400, "n"),
    # -- sampling ranges
    Case("temperature-negative", CHAT, chat(temperature=-0.1), 400, "temperature"),
    Case("temperature-above-2", CMPL, cmpl(temperature=2.5), 400, "temperature"),
    Case("top_p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    Case("top_p-above-1", CMPL, cmpl(top_p=1.5), 400, "top_p"),
    Case("top_k-below-minus-1", CHAT, chat(top_k=-2), 400, "top_k"),
    Case("min_p-negative", CHAT, chat(min_p=-0.1), 400, "min_p"),
    Case("min_p-above-1", CMPL, cmpl(min_p=1.5), 400, "min_p"),
    Case("presence_penalty-above-2", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty"),
    Case("frequency_penalty-below-minus-2", CMPL, cmpl(frequency_penalty=-3), 400, "frequency_penalty"),
    Case("repetition_penalty-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    Case("repetition_penalty-negative", CMPL, cmpl(repetition_penalty=-1), 400, "repetition_penalty"),
    Case("seed-above-u64", CHAT, chat(seed=1 << 64), 400, "seed"),
    Case("seed-below-i64", CMPL, cmpl(seed=-(1 << 63) - 1), 400, "seed"),
    # -- logprobs
    Case("top_logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    Case("top_logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    Case("top_logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    Case("completions-logprobs-21", CMPL, cmpl(logprobs=21), 400, "logprobs"),
    Case("completions-logprobs-negative", CMPL, cmpl(logprobs=-1), 400, "logprobs"),
    # -- stop
    Case("stop-too-many", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    Case("stop-too-long", CMPL, cmpl(stop="x" * 1025), 400, "stop"),
    Case("stop-too-long-in-list", CHAT, chat(stop=["ok", "y" * 1025]), 400, "stop"),
    Case("stop_token_ids-negative", CMPL, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids[0]"),
    # -- tools
    Case("tools-not-a-list", CHAT, chat(tools={"type": "function"}), 400, "tools"),
    Case("tool-type-unknown", CHAT, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400,
         "tools[0].type"),
    Case("tool-no-function-name", CHAT, chat(tools=[{"type": "function", "function": {"description": "d"}}]),
         400, "tools[0].function.name"),
    Case("tool-no-function", CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    # the recipe validates the schema; the param names the tool's parameters, its message the problem
    Case("tool-parameters-not-object", CHAT, chat(tools=[tool(parameters="string")]), 400,
         "tools[0].function.parameters"),
    Case("tool-parameters-unknown-type", CHAT, chat(tools=[tool(parameters={"type": "strin"})]), 400,
         "tools[0].function.parameters"),
    Case("tool-parameters-top-level-not-object", CHAT, chat(tools=[tool(parameters={"type": "string"})]), 400,
         "tools[0].function.parameters"),
    Case("tool-parameters-nested-unknown-type", CHAT,
         chat(tools=[tool(parameters={"type": "object", "properties": {"city": {"type": "float"}}})]), 400,
         "tools[0].function.parameters"),
    Case("tool-parameters-properties-not-object", CHAT,
         chat(tools=[tool(parameters={"type": "object", "properties": ["city"]})]), 400,
         "tools[0].function.parameters"),
    Case("tool-parameters-required-not-list", CHAT,
         chat(tools=[tool(parameters={"type": "object", "required": "city"})]), 400,
         "tools[0].function.parameters"),
    Case("tool-nested-too-deep", CHAT, chat(tools=[tool(parameters={"type": "object", "x-deep": _nested(600)})]),
         400, "tools"),
    Case("tool_choice-unknown-tool", CHAT,
         chat(tools=[tool()], tool_choice={"type": "function", "function": {"name": "nope"}}), 400, "tool_choice"),
    Case("tool_choice-unknown-string", CHAT, chat(tools=[tool()], tool_choice="sometimes"), 400, "tool_choice"),
    # -- model, misc
    Case("model-unknown-chat", CHAT, chat(model="gpt-4"), 404, "model"),
    Case("model-unknown-completions", CMPL, cmpl(model="gpt-4"), 404, "model"),
    Case("logit_bias-list", CHAT, chat(logit_bias=[1, 2]), 400, "logit_bias"),
    Case("logit_bias-bad-key", CMPL, cmpl(logit_bias={"abc": 1}), 400, "logit_bias"),
    Case("logit_bias-out-of-range", CHAT, chat(logit_bias={"5": 500}), 400, "logit_bias"),
    Case("stream_options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    Case("stream_options-without-stream-cmpl", CMPL, cmpl(stream_options={"include_usage": True}), 400,
         "stream_options"),
    Case("stream_options-include_usage-string", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}),
         400, "stream_options.include_usage"),
    Case("response_format-unknown-type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    Case("response_format-string", CHAT, chat(response_format="json"), 400, "response_format"),
    Case("echo-in-chat", CHAT, chat(echo=True), 400, "echo"),
    Case("suffix", CMPL, cmpl(suffix="x"), 400, "suffix"),
]


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    """(base_url, engine, statuses seen); the server runs for the whole module."""
    ckpt = tiny_ckpt("flash", 1)
    engine = build_engine(RunConfig.from_yaml(ROOT / "configs" / "tiny-flash.yaml"), ckpt, progress=False)
    with serve_app(create_app(LocalBackend(engine), Tokenizer(ckpt), MODEL, max_body_bytes=LIMIT)) as url:
        yield url, engine, []


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=60) as h:
        yield h


def _post(h: httpx.Client, case: Case) -> httpx.Response:
    if isinstance(case.body, dict):
        return h.post(case.path, json=case.body)
    content = case.body() if callable(case.body) else case.body
    return h.post(case.path, content=content, headers=case.headers)


def _served(h: httpx.Client) -> None:
    r = h.post(CHAT, json=chat(max_tokens=1, temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_enough_cases():
    assert len(CASES) >= 45 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_a_named_4xx_and_the_server_keeps_serving(server, http, case):
    r = _post(http, case)
    server[2].append(r.status_code)
    assert r.status_code == case.status, r.text
    body = r.json()
    if case.path.startswith("/v1/messages"):         # Anthropic's shape there
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == {413: "request_too_large"}.get(case.status, "invalid_request_error")
        assert case.name in body["error"]["message"], body
        _served(http)
        return
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["code"] == case.status and isinstance(err["message"], str)
    assert err["type"] == ("not_found_error" if case.status == 404 else "invalid_request_error")
    assert case.name in err["message"], err
    assert err["param"] == case.param, err
    if case.param is not None:
        assert err["message"].startswith(case.param), err
    _served(http)


def test_body_limit_default_and_exact_size(server, http):
    """32 MiB by default; a body of exactly the limit is read and served."""
    assert inspect.signature(create_app).parameters["max_body_bytes"].default == 32 << 20
    raw = json.dumps(chat(max_tokens=1, temperature=0)).encode()
    r = http.post(CHAT, content=raw[:-1] + b" " * (LIMIT - len(raw)) + b"}", headers=JSON_CT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text

    def chunks():        # chunked, exactly at the limit
        yield raw[:-1]
        yield b" " * (LIMIT - len(raw))
        yield b"}"
    r = http.post(CHAT, content=chunks(), headers=JSON_CT)
    assert r.status_code == 200, r.text


def test_content_length_over_the_default_is_refused_unread():
    """A declared body over 32 MiB: 413 without calling the app or reading a byte."""
    limit = inspect.signature(create_app).parameters["max_body_bytes"].default
    calls, sent = [], []

    async def app(scope, receive, send):
        calls.append("app")

    async def receive():
        calls.append("receive")
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": [(b"content-length", b"%d" % (limit + 1))]}
    asyncio.run(BodyLimit(app, max_body_bytes=limit)(scope, receive, send))
    assert calls == [] and sent[0]["status"] == 413
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == 413 and str(limit) in err["message"] and err["message"].startswith("request body")


def test_no_5xx_and_all_state_freed(server, http):
    _, engine, seen = server
    assert seen and all(400 <= s < 500 for s in seen), seen
    _served(http)
    deadline = time.monotonic() + 5
    while engine.num_free_blocks() != engine.num_total_blocks():
        assert time.monotonic() < deadline, "state blocks leaked"
        time.sleep(0.02)
