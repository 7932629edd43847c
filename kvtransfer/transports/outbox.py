"""What a ZMQ receiver's socket thread sends on behalf of other threads (``zmq_receiver``): replies
and plane control messages, queued by any thread, sent by the socket thread only.

A message whose peer is unreachable right now (ROUTER_MANDATORY: EHOSTUNREACH while libzmq
reconnects a reset connection; EAGAIN on a full queue) is kept and retried for ``grace_s``
seconds instead of dropped: an ``ack`` lost that way would cost the transfer (prefill waits its
whole ack timeout, then fails the request), although the sender is back within milliseconds.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable


class Outbox:
    """FIFO of (routing id, tag, payload) with retry of unsent ones, per-peer order kept.

    Args:
        grace_s: how long an unsent message is retried (seconds) before it counts as dropped.
        max_parked: at most this many messages wait for a retry (more are dropped at once), so
            a peer gone for good cannot hold memory: a reply is a small msgpack frame.
    """

    def __init__(self, grace_s: float = 5.0, max_parked: int = 4096):
        self.grace_s, self.max_parked = grace_s, max_parked
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()    # (rid, tag, payload)
        self._parked: collections.deque = collections.deque()   # (deadline, rid, tag, payload)

    def put(self, rid: bytes, tag: bytes, payload: bytes) -> None:
        """Queue one message (any thread)."""
        with self._lock:
            self._queue.append((rid, tag, payload))

    def __len__(self) -> int:
        """Messages queued or waiting for a retry."""
        return len(self._queue) + len(self._parked)

    @property
    def retrying(self) -> bool:
        """True while some message waits for a retry (the socket thread then polls more often)."""
        return bool(self._parked)

    def flush(self, send: Callable[[bytes, bytes, bytes], bool]) -> list[tuple[bytes, bool]]:
        """Socket thread: try the waiting messages first (older), then the queued ones, with
        ``send(rid, tag, payload) -> sent``. Returns (tag, sent) for each message finished now:
        sent, or dropped (its grace is over, or too many wait); the others wait for the next call."""
        now = time.monotonic()
        with self._lock:
            items = [*self._parked, *((None, *m) for m in self._queue)]
            self._parked.clear()
            self._queue.clear()
        done, blocked = [], set()
        for deadline, rid, tag, payload in items:
            # a peer whose older message waits keeps waiting too: its replies stay in order
            if rid not in blocked and send(rid, tag, payload):
                done.append((tag, True))
                continue
            deadline = now + self.grace_s if deadline is None else deadline
            if now < deadline and len(self._parked) < self.max_parked:
                blocked.add(rid)
                self._parked.append((deadline, rid, tag, payload))
            else:
                done.append((tag, False))
        return done
