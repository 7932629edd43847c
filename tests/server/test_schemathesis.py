"""Schemathesis against the gateway's own OpenAPI schema: no 5xx, and the server keeps serving.

A real uvicorn server over ``LocalBackend`` and the tiny engine (as in tests/server/gateway/); the schema
is the app's ``/openapi.json``. Each operation gets Hypothesis examples from schemathesis's
strategies (``APIOperation.as_strategy``), schema-valid (positive) and schema-violating (negative)
mixed, derandomised so CI sees the same bodies every run. Bodies that would be served are kept
cheap before they are sent: at most ``MAX_TOKENS`` tokens, ``n`` <= 2, at most 4 prompts (the
tiny model makes ~50 tokens/s on CPU). Every 4xx must be the API's error shape: Anthropic's under
/v1/messages, OpenAI's elsewhere.
"""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")     # the dev extra installs it (Python >= 3.11)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from engine.build import build_engine  # noqa: E402
from engine.run_config import RunConfig  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from server.backends.local import LocalBackend  # noqa: E402
from server.gateway.app import create_app  # noqa: E402
from serve_util import serve_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-dsv4"
MAX_TOKENS = 3
EXAMPLES = 100
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("POST", "/v1/messages"), ("GET", "/v1/models")]


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    """(base_url, engine, loaded schema, statuses seen); the server runs for the whole module."""
    ckpt = tiny_ckpt("flash", 1)
    engine = build_engine(RunConfig.from_yaml(ROOT / "configs" / "tiny-flash.yaml"), ckpt, progress=False)
    with serve_app(create_app(LocalBackend(engine), Tokenizer(ckpt), MODEL)) as url:
        yield url, engine, schemathesis.openapi.from_url(url + "/openapi.json"), []


def _cheap(body):
    """Cap what a served body may cost (the caps are themselves valid values)."""
    if not isinstance(body, dict):
        return body
    for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(k)
        if v is None or (type(v) is int and v > MAX_TOKENS):
            body[k] = MAX_TOKENS       # null / absent would mean "up to the context limit"
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2
    if type(body.get("best_of")) is int and body["best_of"] > 2:
        body["best_of"] = 2
    if isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], (str, list)):
        body["prompt"] = body["prompt"][:4]
    return body


def _check(response, seen: list, path: str) -> None:
    seen.append(response.status_code)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        err = body["error"]
        if path == "/v1/messages":
            assert body["type"] == "error" and set(err) == {"type", "message"}, body
        else:
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == response.status_code, err
        assert isinstance(err["message"], str) and err["message"], err


def test_schema_has_the_operations(server):
    schema = server[2]
    for method, path in OPERATIONS:
        assert schema[path][method] is not None


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_fuzzed_requests_never_get_a_5xx(server, method, path):
    url, _, schema, seen = server
    op = schema[path][method]
    strategy = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        case.body = _cheap(case.body) if method == "POST" else case.body
        _check(case.call(base_url=url, timeout=60), seen, path)

    run()


def test_still_serving_and_nothing_leaked(server):
    url, engine, _, seen = server
    assert seen and all(s < 500 for s in seen)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    deadline = time.monotonic() + 5
    while engine.num_free_blocks() != engine.num_total_blocks():
        assert time.monotonic() < deadline, "state blocks leaked"
        time.sleep(0.02)
