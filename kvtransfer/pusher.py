"""Prefill side of transfers: a thread that pushes state messages as the engine produces them.

The engine loop enqueues each layer's message the moment that layer is final (so sending
overlaps the rest of prefill), then a commit or a cancel. This thread owns the ``StateSender``
(handshake on first contact), waits for decode's acknowledgement of each commit, and reports
``acked`` / ``failed`` results back to the loop. After a failure, later messages of that
transfer are dropped (decode's lease then frees its reservation).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.transport import StateSender, TransportError

log = logging.getLogger(__name__)


@dataclass
class Result:
    """kind: acked | failed. ``cause`` (failed): handshake | send | timeout | nack. Bytes, seconds
    from the first message sent to the acknowledgement."""

    kind: str
    transfer_id: str
    nbytes: int = 0
    seconds: float = 0.0
    cause: str = ""
    message: str = ""


@dataclass
class _Track:
    t0: float
    nbytes: int = 0
    deadline: float | None = None


class Pusher:
    """``put(kind, transfer_id, dest, frames)`` from the engine loop; ``results()`` drains outcomes."""

    def __init__(self, make_sender: Callable[[], StateSender], ack_timeout_s: float = 60.0):
        self._make = make_sender
        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._timeout = ack_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-pusher", daemon=True)
        self._thread.start()

    def put(self, kind: str, transfer_id: str, dest: str, frames: list | Callable[[], list]) -> None:
        """kind: layer | commit | cancel | state (``state`` = whole state + commit in one).
        ``frames`` may be a callable that builds them (encoding and checksums then run on this
        thread, off the engine loop)."""
        self._jobs.put((kind, transfer_id, dest, frames))

    def results(self) -> list[Result]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        sender = self._make()
        track: dict[str, _Track] = {}
        dead: set[str] = set()
        try:
            while not self._stop.is_set():
                waiting = any(t.deadline is not None for t in track.values())
                try:
                    job = self._jobs.get_nowait() if waiting else self._jobs.get(timeout=0.02)
                except queue.Empty:
                    job = None
                if job is not None:
                    self._send(sender, job, track, dead)
                # waiting for acks with nothing to send: block in zmq (GIL released), not spin
                for _dest, msg in sender.poll_replies(0.002 if waiting and job is None else 0.0):
                    self._reply(msg, track)
                now = time.monotonic()
                for tid, t in list(track.items()):
                    if t.deadline is not None and t.deadline <= now:
                        del track[tid]
                        self._results.put(Result("failed", tid, t.nbytes, now - t.t0, "timeout",
                                                 f"no acknowledgement within {self._timeout:g} s"))
        finally:
            sender.close()

    def _send(self, sender: StateSender, job, track: dict, dead: set) -> None:
        kind, tid, dest, frames = job
        if tid in dead:
            return
        t = track.setdefault(tid, _Track(time.monotonic()))
        try:
            t.nbytes += sender.send(dest, frames() if callable(frames) else frames)
        except Exception as e:      # TransportError, TransferError, or a bug: fail this transfer, keep going
            if not isinstance(e, TransportError):
                log.exception("transfer %s: sending failed", tid)
            dead.add(tid)
            track.pop(tid, None)
            msg = f"{type(e).__name__}: {e}"
            cause = "handshake" if any(w in msg for w in ("refuse", "fingerprint", "layout", "handshake")) else "send"
            if kind != "cancel":
                self._results.put(Result("failed", tid, t.nbytes, time.monotonic() - t.t0, cause, msg))
            return
        if kind in ("commit", "state"):
            t.deadline = time.monotonic() + self._timeout
        elif kind == "cancel":
            track.pop(tid, None)
            dead.add(tid)
        if len(dead) > 100_000:          # ids are never reused: forgetting old ones is safe
            dead.clear()

    def _reply(self, msg: dict, track: dict) -> None:
        tid = msg.get("transfer_id")
        t = track.pop(tid, None) if isinstance(tid, str) else None
        if t is None:
            return
        secs = time.monotonic() - t.t0
        if msg.get("op") == "ack":
            self._results.put(Result("acked", tid, t.nbytes, secs))
        else:
            self._results.put(Result("failed", tid, t.nbytes, secs, str(msg.get("cause", "nack")),
                                     str(msg.get("reason", "refused by decode"))[:500]))
