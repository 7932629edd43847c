"""The serving layer without a model: a backend failure after streaming started, in each API's form;
stop-string hold-back."""
from __future__ import annotations

import asyncio
import json
import re

import httpx

from server.backends.base import BackendError, TokenEvent
from server.gateway.app import create_app
from server.gateway.completions import TokenStrings, prepare_completion
from server.gateway.protocol import CompletionRequest

from .common import HELLO, MODEL


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
