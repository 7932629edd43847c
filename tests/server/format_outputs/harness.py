"""The gateway under test: its app over a scripted backend (``Scripted``, one ``Stack`` per package) and
a client that scripts the backend for each request (``Client``, ``run``)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import deepseek_recipe as dr
import httpx

from engine.core.sampling_params import Sampled
from engine.tokenizer import Tokenizer
from serve_util import ScriptedBackend
from server.backends.base import TokenEvent
from server.gateway.dsformat import DeepSeekFormat

from .corpus import MAX_LEN


class Scripted(ScriptedBackend):
    """``ScriptedBackend`` with the script set per request, optional explicit event boundaries
    (``cuts``: events ids[0:c0], ids[c0:c1], ..., ids[cn:]) and optional logprobs (one
    ``Sampled`` per id, from ``logprobs``: id position -> Sampled)."""

    def __init__(self):
        super().__init__(lambda _prompt: self.script, split=1, max_model_len=MAX_LEN)
        self.script: tuple[list[int], str] = ([], "stop")
        self.cuts: list[int] | None = None
        self.logprobs: list[Sampled] | None = None

    def set(self, ids, reason, split=1, cuts=None, logprobs=None):
        self.script, self.split, self.cuts, self.logprobs = (list(ids), reason), split, cuts, logprobs

    async def generate(self, req):
        if self.cuts is None and self.logprobs is None:
            async for ev in super().generate(req):
                yield ev
            return
        self.requests.append(req)
        ids, reason = self.script
        bounds = ([0, *self.cuts, len(ids)] if self.cuts is not None
                  else list(range(0, len(ids), self.split or len(ids))) + [len(ids)])
        for a, b in zip(bounds, bounds[1:]):
            last = b == len(ids)
            yield TokenEvent(ids[a:b], None if self.logprobs is None else self.logprobs[a:b], finished=last,
                             finish_reason=reason if last else None, num_prompt_tokens=len(req.prompt_ids))


@dataclass
class Stack:
    tok: Tokenizer
    rtok: dr.Tokenizer
    fmt: DeepSeekFormat
    backend: Scripted
    app: object


class Client:
    """Requests to the ASGI app, each with the backend scripted for it."""

    def __init__(self, st: Stack, h: httpx.AsyncClient):
        self.st, self.h = st, h

    async def post(self, path, body, ids, reason, **script):
        self.st.backend.set(ids, reason, **script)
        r = await self.h.post(path, json=body)
        assert r.status_code == 200, (r.status_code, r.text[:500])
        return r.json() if not body.get("stream") else r.text


def run(st: Stack, fn):
    async def go():
        transport = httpx.ASGITransport(app=st.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as h:
            return await fn(Client(st, h))
    return asyncio.run(go())
