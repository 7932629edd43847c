"""Calls from other threads (HTTP handlers) run on a worker's engine loop, which alone touches the
engine (it is not thread-safe)."""
from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future


class LoopCalls:
    """``call(fn)`` from any thread queues ``fn`` and wakes the loop (``wake``); the loop runs what
    is queued with ``run()`` once per iteration."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def call(self, fn: Callable[[], object], timeout_s: float = 30.0):
        """``fn()``'s result, run on the loop. Raises TimeoutError (the loop did not get to it:
        it still runs later), or what ``fn`` raised."""
        fut: Future = Future()
        self._q.put((fn, fut))
        self._wake()
        return fut.result(timeout_s)

    def run(self) -> None:
        while True:
            try:
                fn, fut = self._q.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as e:      # noqa: BLE001 - the caller's to handle
                fut.set_exception(e)
