"""``LocalBackend``: one in-process ``LLMEngine`` stepping on its own thread (tests, benchmarks).

The same engine the workers run, without the P/D split: the reference the P/D path is compared
against (same seed -> same tokens).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.request import RequestOutput
from server.backends.base import BackendError, GenRequest, TokenEvent

log = logging.getLogger(__name__)


def to_event(out: RequestOutput, want_logprobs: bool) -> TokenEvent:
    """An engine output as a ``TokenEvent`` (logprobs only when the sample asked for them)."""
    return TokenEvent(list(out.new_token_ids), list(out.new_logprobs) if want_logprobs else None, out.finished,
                      out.finish_reason.value if out.finish_reason is not None else None, out.num_prompt_tokens,
                      out.queue_time_s, num_cached_tokens=out.num_cached_tokens)


class LocalBackend:
    """Serves samples from ``engine`` (which this backend then owns: only its thread touches it)."""

    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = {}
        self._idle = idle_wait_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    async def health(self) -> dict:
        alive = self._thread is not None and self._thread.is_alive()
        e = self.engine
        return {"healthy": alive, "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting)}

    async def generate(self, req: GenRequest) -> AsyncIterator[TokenEvent]:
        """Raises BackendError 400 for a request the engine refuses, 504 past ``req.deadline``."""
        if self._thread is None or not self._thread.is_alive():
            raise BackendError("engine is not running", 503)
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(("add", req, asyncio.get_running_loop(), q))
        finished = False
        try:
            while True:
                if req.deadline is None:
                    item = await q.get()
                else:
                    try:
                        item = await asyncio.wait_for(q.get(), max(0.0, req.deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        raise BackendError("the request's deadline passed (timeout)", 504) from None
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._cmds.put(("abort", req.request_id))

    # ---- engine thread ---------------------------------------------------------------------------
    def _post(self, rid: str, item) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            loop, q, _ = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _command(self, cmd) -> None:
        if cmd[0] == "add":
            _, req, loop, q = cmd
            try:
                self.engine.add_request(req.request_id, req.prompt_ids, req.params)
            except RequestError as e:
                loop.call_soon_threadsafe(q.put_nowait, BackendError(str(e), 400))
                return
            self._streams[req.request_id] = (loop, q, req.params.logprobs is not None)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
            self._streams.pop(cmd[1], None)

    def _run(self) -> None:
        e = self.engine
        while not self._stop.is_set():
            try:
                cmd = self._cmds.get(timeout=self._idle) if not e.has_unfinished() else self._cmds.get_nowait()
                self._command(cmd)
                continue
            except queue.Empty:
                pass
            if not e.has_unfinished():
                continue
            try:
                outs = e.step()
            except Exception as exc:       # an engine bug: fail what is in flight, keep serving
                log.exception("engine step failed")
                for rid in list(self._streams):
                    e.abort(rid)
                    self._post(rid, BackendError(f"engine failure: {type(exc).__name__}", 500))
                    self._streams.pop(rid, None)
                continue
            for out in outs:
                entry = self._streams.get(out.request_id)
                if entry is None:
                    continue
                self._post(out.request_id, to_event(out, entry[2]))
                if out.finished:
                    self._streams.pop(out.request_id, None)
