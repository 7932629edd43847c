"""Prefill side of transfers: one lane per destination pushes state messages as the engine
produces them.

The engine loop enqueues each layer's message the moment that layer is final (so sending
overlaps the rest of prefill), then a commit or a cancel. A thread per destination owns a
``StateSender`` (handshake on first contact), waits for decode's acknowledgement of each commit,
and reports ``acked`` / ``failed`` results back to the loop. After a failure, later messages of that
transfer are dropped (decode's lease then frees its reservation).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.interfaces import StateSender, TransportError

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
    """``put(kind, transfer_id, dest, frames)`` from the engine loop; ``results()`` drains outcomes.
    ``notify()``, if given, is called (on a lane thread) after each outcome is queued, so the loop
    can wait on its own poller and wake for it (the prefill worker passes ``Worker.wake``); it must
    be cheap, thread-safe and must not raise.

    One lane (thread + ``StateSender``) per destination, so a destination that hangs (a decode
    host gone dark: a 10 s handshake, a send blocked on a full queue) delays only its own
    transfers. A lane idle for ``idle_s`` with nothing awaiting an ack closes its sender and ends.
    """

    def __init__(self, make_sender: Callable[[], StateSender], ack_timeout_s: float = 60.0, idle_s: float = 60.0,
                 notify: Callable[[], None] | None = None):
        self._make = make_sender
        self._notify = notify
        self._results: queue.Queue = queue.Queue()
        self._timeout, self._idle_s = ack_timeout_s, idle_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}

    def put(self, kind: str, transfer_id: str, dest: str, frames: list | Callable[[], list]) -> None:
        """kind: layer | commit | cancel | state (``state`` = whole state + commit in one).
        ``frames`` may be a callable that builds them (encoding and checksums then run on the
        destination's lane, off the engine loop)."""
        with self._lock:
            lane = self._lanes.get(dest)
            if lane is None:
                lane = self._lanes[dest] = _Lane(self, dest)
            lane.jobs.put((kind, transfer_id, dest, frames))

    def results(self) -> list[Result]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def _result(self, r: Result) -> None:
        """A lane's outcome for the loop (any lane thread)."""
        self._results.put(r)
        if self._notify is not None:
            self._notify()

    @property
    def num_lanes(self) -> int:
        with self._lock:
            return len(self._lanes)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            lanes = list(self._lanes.values())
        end = time.monotonic() + 5
        for lane in lanes:
            lane.thread.join(max(0.0, end - time.monotonic()))

    def _retire(self, lane: "_Lane") -> bool:
        """Called by an idle lane: True (it is removed and must end) unless a job just arrived."""
        with self._lock:
            if not lane.jobs.empty():
                return False
            if self._lanes.get(lane.dest) is lane:
                del self._lanes[lane.dest]
            return True


class _Lane:
    """One destination's sender thread."""

    def __init__(self, pusher: Pusher, dest: str):
        self.p, self.dest = pusher, dest
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"kv-pusher-{dest[-24:]}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        p = self.p
        sender = None
        track: dict[str, _Track] = {}
        dead: set[str] = set()
        idle_since = time.monotonic()
        try:
            sender = p._make()
            while not p._stop.is_set():
                waiting = any(t.deadline is not None for t in track.values())
                try:
                    job = self.jobs.get_nowait() if waiting else self.jobs.get(timeout=0.02)
                except queue.Empty:
                    job = None
                if job is not None:
                    idle_since = time.monotonic()
                    self._send(sender, job, track, dead)
                # waiting for acks with nothing to send: block in zmq (GIL released), not spin
                for _dest, msg in sender.poll_replies(0.002 if waiting and job is None else 0.0):
                    _reply_result(p, msg, track)
                now = time.monotonic()
                for tid, t in list(track.items()):
                    if t.deadline is not None and t.deadline <= now:
                        del track[tid]
                        p._result(Result("failed", tid, t.nbytes, now - t.t0, "timeout",
                                         f"no acknowledgement within {p._timeout:g} s"))
                if not track and job is None and now - idle_since > p._idle_s and p._retire(self):
                    return
        except Exception as e:               # the sender could not even be made: fail what comes
            log.exception("state pusher lane %s failed", self.dest)
            while True:
                try:
                    kind, tid, _, _ = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if kind != "cancel":
                    p._result(Result("failed", tid, 0, 0.0, "send", f"{type(e).__name__}: {e}"))
            p._retire(self)
        finally:
            if sender is not None:
                sender.close()

    def _send(self, sender: StateSender, job, track: dict, dead: set) -> None:
        kind, tid, dest, frames = job
        p = self.p
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
                p._result(Result("failed", tid, t.nbytes, time.monotonic() - t.t0, cause, msg))
            return
        if kind in ("commit", "state"):
            t.deadline = time.monotonic() + p._timeout
        elif kind == "cancel":
            track.pop(tid, None)
            dead.add(tid)
        if len(dead) > 100_000:          # ids are never reused: forgetting old ones is safe
            dead.clear()


def _reply_result(p: Pusher, msg: dict, track: dict) -> None:
    """An ack / nack / reject from decode for one of ``track``'s transfers -> a Result."""
    tid = msg.get("transfer_id")
    t = track.pop(tid, None) if isinstance(tid, str) else None
    if t is None:
        return
    secs = time.monotonic() - t.t0
    if msg.get("op") == "ack":
        p._result(Result("acked", tid, t.nbytes, secs))
    else:
        p._result(Result("failed", tid, t.nbytes, secs, str(msg.get("cause", "nack")),
                         str(msg.get("reason", "refused by decode"))[:500]))
