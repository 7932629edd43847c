"""Serving an ASGI app on a real socket for the gateway tests: uvicorn on a free loopback port."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serve_app(app, start_timeout_s: float = 30) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread; yields its base URL ``http://127.0.0.1:PORT`` and
    stops it on exit. Fails (AssertionError) if it does not start within ``start_timeout_s``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        th.join(15)
        sock.close()


class ScriptedBackend:
    """A ``server.backends.base.Backend`` whose samples emit scripted token ids: the gateway's text path
    (recipe conversion, encoding, output parsing, shaping) checked without a model, for outputs a
    random tiny model never writes (DSML tool calls, ``</think>``).

    Args:
        script: ``prompt_ids -> (token ids, finish_reason)``, or a fixed pair for every sample.
        split: token ids per event (1: one event per token; 0: all ids in one event).
        max_model_len: the context the gateway checks prompts against.

    ``requests`` records every ``GenRequest`` received (prompt ids, sampling params), in order.
    """

    def __init__(self, script, split: int = 1, max_model_len: int = 65536):
        self._script, self.split, self.max_model_len = script, split, max_model_len
        self.requests: list = []

    async def generate(self, req):
        from server.backends.base import TokenEvent
        self.requests.append(req)
        ids, reason = self._script(req.prompt_ids) if callable(self._script) else self._script
        full = list(ids)
        ids = full[:req.params.max_new_tokens]
        if len(full) > len(ids):            # cut by max_tokens, as the engine would
            reason = "length"
        step = self.split or max(1, len(ids))
        for i in range(0, max(1, len(ids)), step):
            part = ids[i:i + step]
            last = i + step >= len(ids)
            yield TokenEvent(part, finished=last, finish_reason=reason if last else None,
                             num_prompt_tokens=len(req.prompt_ids))

    async def health(self):
        return {"healthy": True}

    async def start(self):
        pass

    async def close(self):
        pass


THINK_END_ID = 128822          # </think> in the DeepSeek-V4 tokenizer


def reasoning_from_ids(ids, starts_in_reasoning: bool, skip=()) -> int:
    """The gateway's reasoning-token count (``server/gateway/recipe_stream.py``, vLLM's way): the output ids
    before ``</think>`` in thinking mode, BOS / EOS and the positions in ``skip`` (a text-less final
    stop token) excepted. DeepSeek's recipe re-encodes the reasoning text instead, which can differ."""
    if not starts_in_reasoning:
        return 0
    n = 0
    for k, t in enumerate(ids):
        if t == THINK_END_ID:
            break
        n += t not in (0, 1) and k not in skip
    return n


def set_reasoning_usage(obj: dict, n: int) -> dict:
    """``obj`` (a chat / Responses response, or an event holding one) with its reported reasoning
    tokens set to ``n`` (in place; objects without them are left alone)."""
    for holder in (obj, obj.get("response") if isinstance(obj.get("response"), dict) else None):
        u = (holder or {}).get("usage") or {}
        for key in ("completion_tokens_details", "output_tokens_details"):
            if isinstance(u.get(key), dict) and "reasoning_tokens" in u[key]:
                u[key]["reasoning_tokens"] = n
    return obj
