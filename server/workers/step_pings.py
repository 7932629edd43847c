"""``StepPings``: the gateway's pings answered while a worker's loop is inside a long engine step.

A worker's loop owns its request socket (a ZMQ socket is used by one thread at a time) and answers
pings between engine steps. A step can run for seconds: a long prefill chunk at Flash size, or
any step on a loaded CPU. After a connection blip the gateway knows nothing of an instance's load
and routes nothing to it until a pong, so a blip during a long step turned into 503s for every new
sample of that role until the step ended.

The loop does not touch its socket during a step, so a helper thread may: once a step has run for
``after_s``, the helper takes the socket (under the lock both threads hold at each hand-over: the
full memory barrier ZMQ asks for when a socket changes threads), answers each ping with the load
report plus ``step_s``, the seconds the step has run so far, and keeps every other frame, in
order, for the loop to handle after the step. The gateway counts ``step_s`` as pings left
unanswered (``server.backends.links``), so a step that hangs still takes the instance out of
routing after ``health_timeout_s``, as before. A short step costs two uncontended lock
acquisitions; the helper wakes every ``after_s`` otherwise.
"""
from __future__ import annotations

import logging
import dataclasses
import socket
import threading
import time
from collections.abc import Callable

import zmq

from server.protocol import Kind, Pong, kind_of
from server.protocol_fields import MessageError, unpack

log = logging.getLogger(__name__)
BATCH = 64                  # frames read between two looks at the loop's interrupt
MAX_KEPT = 4096             # frames kept for the loop during one step, at most


class StepPings:
    """Answers pings on ``sock`` while the owner's step runs longer than ``after_s``.

    Args:
        sock: the worker's ROUTER socket (frames ``[identity, msgpack body]``).
        load: ``() -> Pong``, the load report (``Worker.load``; it only reads engine state, as the
            HTTP ``/ready`` handler does from its own thread); sent with ``step_s`` set.
        after_s: how long a step runs before the helper takes the socket (s).
    """

    def __init__(self, sock: zmq.Socket, load: Callable[[], Pong], after_s: float = 0.1):
        self.sock, self.load, self.after_s = sock, load, after_s
        self.answered = 0                      # pongs sent during steps (tests, logs)
        self._cv = threading.Condition()
        self._t0: float | None = None          # monotonic start of the running step; None: no step
        self._held = False                     # the helper holds the socket
        self._closed = False
        self._kept: list[list[bytes]] = []     # frames for the loop, in arrival order
        self._intr_r, self._intr_w = socket.socketpair()
        self._intr_r.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name="step-pings", daemon=True)
        self._thread.start()

    # ---- the loop's side ---------------------------------------------------------------------
    def begin(self) -> None:
        """The loop is about to step: the socket is the helper's to take from ``after_s`` on."""
        with self._cv:
            self._t0 = time.monotonic()

    def end(self) -> None:
        """The step is over: take the socket back (waits for the helper to let it go)."""
        with self._cv:
            self._t0 = None
            if self._held:
                self._intr_w.send(b"\0")
                while self._held:
                    self._cv.wait()

    def pending(self) -> bool:
        """Frames kept during a step wait for the loop."""
        return bool(self._kept)

    def take_kept(self) -> list[list[bytes]]:
        """The frames that arrived during steps (not pings), oldest first; the loop handles them."""
        with self._cv:
            kept, self._kept = self._kept, []
        return kept

    def close(self) -> None:
        """Stop the helper (after the loop's last step)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            if self._held:
                self._intr_w.send(b"\0")
        self._thread.join(5)
        self._intr_r.close()
        self._intr_w.close()

    # ---- the helper --------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._intr_r, zmq.POLLIN)
        failed = None                                  # the step whose serving failed: not retried
        while True:
            with self._cv:
                while not self._closed:
                    t0, left = self._t0, self.after_s
                    if t0 is not None and t0 != failed:
                        left = t0 + self.after_s - time.monotonic()
                        if left <= 0:
                            break
                    self._cv.wait(left)         # no notify per step: a short one costs the loop nothing
                if self._closed:
                    return
                self._held = True
            try:
                self._hold(poller, t0)
            except Exception:               # the socket closed under it (shutdown): the loop answers
                failed = t0
                log.warning("step pings: the helper stopped serving a step", exc_info=True)
            finally:
                with self._cv:
                    self._held = False
                    self._cv.notify_all()

    def _hold(self, poller: zmq.Poller, t0: float) -> None:
        """Serve the socket until the loop's ``end`` interrupts."""
        while True:
            events = dict(poller.poll())
            # the loop's end first: frames still queued stay in the socket, behind the kept ones,
            # so a stream of frames cannot hold the loop past its step
            if self._intr_r in events or self._intr_r.fileno() in events:
                self._wait_interrupt()
                return
            if self.sock in events:
                self._receive(t0)
                if len(self._kept) >= MAX_KEPT:     # the rest waits in the socket (its HWM holds senders)
                    self._wait_interrupt()
                    return

    def _wait_interrupt(self) -> None:
        """Block until the loop's ``end`` writes the interrupt, and consume it."""
        zmq.select([self._intr_r], [], [])
        try:
            while self._intr_r.recv(64):
                pass
        except OSError:
            pass

    def _receive(self, t0: float) -> None:
        """Up to ``BATCH`` frames (then the interrupt is looked at again), never past ``MAX_KEPT``
        kept ones: a batch cut short by an empty socket leaves the next one unaligned to the cap."""
        for _ in range(BATCH):
            if len(self._kept) >= MAX_KEPT:
                return
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) == 2 and _is_ping(parts[1]):
                try:
                    pong = dataclasses.replace(self.load(), step_s=round(time.monotonic() - t0, 3))
                    self.sock.send_multipart([parts[0], pong.pack()], zmq.NOBLOCK)
                    self.answered += 1
                except zmq.ZMQError:
                    pass                  # a gone gateway: the loop's own replies find it after the step
                except Exception:         # engine state read mid-step; the next ping will do
                    log.debug("step pings: load report failed", exc_info=True)
                continue
            self._kept.append(parts)


def _is_ping(frame: bytes) -> bool:
    if len(frame) > 64:                  # a ping is ~10 bytes; a prompt is not unpacked twice
        return False
    try:
        return kind_of(unpack(frame)) is Kind.PING
    except MessageError:
        return False
