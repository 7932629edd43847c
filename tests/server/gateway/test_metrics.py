"""/metrics adds up to the usage the responses report; a client that disconnects aborts its sample."""
from __future__ import annotations

import time

import httpx
import pytest

from .common import COMPLETION_PROMPT, HELLO, MODEL, _idle, _metric, _metrics


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
