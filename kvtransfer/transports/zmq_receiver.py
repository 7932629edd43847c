"""ZMQ transport, decode side: one ROUTER socket owned by a background thread (framing, security:
``kvtransfer.transports``); tensor bytes arrive as its ``ReceiverPlane`` says. ``reply`` (and a
plane's ``send_control``) queue to that thread and wake it through a socketpair: any thread may call.
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
import uuid

import zmq

from kvtransfer.interfaces import (PROTOCOL_VERSION, REJECT_OP, TAG_CTL, TAG_MSG, TAG_REP, Delivered, StateReceiver,
                                   TransportError, hello_refusal, limits_from, normalize_layout, pack_control,
                                   transfer_id_of, unpack_control, valid_id)
from kvtransfer.secure import RateLimitedLog, cluster_keys, stop_authenticator
from kvtransfer.transports.outbox import Outbox
from kvtransfer.transports.plane import Peer, ReceiverPlane
from kvtransfer.transports.zmq_bind import bind_receiver
from kvtransfer.wire import TransferError

log = logging.getLogger(__name__)


class ZmqStateReceiver(StateReceiver):
    """Decode side over a ZMQ ROUTER socket bound on ``host``:``port`` (kind "zmq-tcp") or on the
    unix socket ``ipc_path`` (kind "zmq-ipc"; default ``$TMPDIR/dsv4-pd-PORT.sock``).

    Args:
        fingerprint / layout: what a hello must equal (else refused, naming the difference).
        receiver_id: sent in the welcome (default: random). advertise_host: host put in
            ``address`` when binding a wildcard host. linger_ms: flush time for replies on close.
        secret: the cluster shared secret (str / bytes, >= 16 characters, or ``secure.ClusterKeys``):
            the socket is a CURVE server and only senders with the same secret get through.
            None: plain ZMQ.
        plane: how tensor bytes arrive (default: in the state message; the dist kind passes its own).
        reply_grace_s: how long a reply to a peer that is reconnecting is retried (``Outbox``; s).
        **limits: ``Limits`` fields (max_frames, max_message_bytes, ...).

    Its payload plane calls ``deliver``, ``reserve`` / ``release``, ``count``, ``forget`` and
    ``send_control`` (``kvtransfer.transports.plane``).

    Raises:
        zmq.ZMQError: the endpoint cannot be bound. TypeError: unknown keyword. ValueError: a
            secret that is empty / too short.
    """

    def __init__(self, kind: str, host: str, port: int, fingerprint: str, layout: dict, receiver_id: str | None = None,
                 ipc_path: str | None = None, advertise_host: str | None = None, linger_ms: int = 100, secret=None,
                 plane: ReceiverPlane | None = None, reply_grace_s: float = 5.0, **limits):
        self.limits = limits_from(limits)
        if limits:
            raise TypeError(f"unexpected keyword arguments {sorted(limits)}")
        keys = cluster_keys(secret)
        self.secured = keys is not None
        self._rlog = RateLimitedLog(log)
        self.kind = kind
        self.fingerprint, self.layout = fingerprint, normalize_layout(layout)
        self.receiver_id = receiver_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.linger_ms = linger_ms
        self.plane = plane or ReceiverPlane()
        self._stats = collections.Counter({k: 0 for k in ("messages", "bytes", "handshakes", "refused",
                                                          "dropped_malformed", "dropped_unknown_peer", "replies",
                                                          "replies_dropped", "peers_pruned", "resumed",
                                                          *self.plane.counters)})
        self._lock = threading.Lock()                  # peers, outbox, stats
        self._cond = threading.Condition(threading.Lock())   # delivered queue
        self._delivered: collections.deque = collections.deque()
        self._pending = 0                              # delivered (or reserved) and not yet recv()ed bytes
        self._outbox = Outbox(reply_grace_s)            # replies / plane control messages to send
        self._by_rid: dict[bytes, Peer] = {}
        self._by_id: dict[str, Peer] = {}
        self._stop = threading.Event()
        self._closed = False
        self._last_prune = float("-inf")

        self._ctx = zmq.Context()
        try:
            sock, zaddr, self._ipc_path, self.port = bind_receiver(
                self._ctx, kind, host, port, ipc_path, advertise_host, keys, linger_ms,
                max(self.limits.max_message_bytes, self.limits.max_control_bytes))
        except BaseException:
            stop_authenticator(self._ctx)
            self._ctx.term()
            raise
        self._sock = sock
        self.address = self.plane.address_prefix + zaddr
        self.plane.attach(self)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"state-rx-{self.receiver_id}", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------------
    def recv_messages(self, timeout_s: float = 0.0) -> list[Delivered]:
        with self._cond:
            if not self._delivered and timeout_s > 0:
                self._cond.wait_for(lambda: self._delivered or self._stop.is_set(), timeout_s)
            items = list(self._delivered)
            self._delivered.clear()
            was_full = self._pending >= self.limits.max_pending_bytes
            self._pending -= sum(d.nbytes for d in items)
            now_full = self._pending >= self.limits.max_pending_bytes
        if was_full and not now_full:
            self._wake()   # the socket thread resumes reading
        return items

    def reply(self, peer_id: str, msg: dict) -> None:
        payload = pack_control(msg, self.limits.max_control_bytes)
        with self._lock:
            if self._closed:
                raise TransportError("receiver is closed")
            peer = self._by_id.get(peer_id)
            if peer is None:
                raise TransportError(f"reply to unknown peer {peer_id!r} (never handshaked, superseded or gone)")
            self._outbox.put(peer.rid, TAG_REP, payload)
        self._wake()

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
            out["peers"] = len(self._by_id)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake()
        self._thread.join(10)
        with self._lock:
            peers = list(self._by_id.values())
            self._by_id.clear()
            self._by_rid.clear()
        for p in peers:
            self.plane.peer_gone(p)
        self.plane.close()
        with self._cond:
            self._cond.notify_all()
        stop_authenticator(self._ctx)   # its sockets would block term()
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()
        if self._ipc_path:   # libzmq leaves the socket file behind
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass

    # -- for the payload plane ---------------------------------------------------------------
    def deliver(self, d: Delivered, reserved: bool = False) -> None:
        """Hand ``d`` to ``recv_messages`` (any thread). ``reserved``: its bytes were counted by ``reserve``."""
        with self._cond:
            self._delivered.append(d)
            if not reserved:
                self._pending += d.nbytes
            self._cond.notify_all()
        with self._lock:
            self._stats["messages"] += 1
            self._stats["bytes"] += d.nbytes
        notify = self._notify
        if notify is not None:
            notify()

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` of a message still arriving as pending (back-pressure applies to it)."""
        with self._cond:
            self._pending += nbytes

    def release(self, nbytes: int) -> None:
        """Undo ``reserve`` for a message that will never be delivered."""
        with self._cond:
            self._pending -= nbytes

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to the ``stats`` counter ``key``."""
        with self._lock:
            self._stats[key] += n

    def send_control(self, peer: Peer, msg: dict) -> None:
        """Queue the control message ``msg`` (msgpack-able, <= max_control_bytes) to ``peer`` (any thread)."""
        payload = pack_control(msg, self.limits.max_control_bytes)
        self._outbox.put(peer.rid, TAG_CTL, payload)
        self._wake()

    def forget(self, peer: Peer, graceful: bool = False) -> bool:
        """Remove ``peer`` if it is still the registered one (any thread). True when removed.
        ``graceful`` (the sender said bye): messages already under way are still delivered."""
        with self._lock:
            if self._by_id.get(peer.peer_id) is not peer:
                return False
            del self._by_id[peer.peer_id]
            self._by_rid.pop(peer.rid, None)
        self.plane.peer_gone(peer, graceful)
        return True

    def _mine(self) -> dict:
        return {"transport": self.plane.transport, "fingerprint": self.fingerprint, "layout": self.layout,
                **self.plane.handshake_fields()}

    # -- internals -------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:   # buffer full (a wake is pending anyway) or closed
            pass

    def _reject(self, rid: bytes, reason: str, frame0=None) -> None:
        msg = {"op": REJECT_OP, "v": PROTOCOL_VERSION, "reason": reason[:1000],
               "transfer_id": transfer_id_of(frame0) if frame0 is not None else None}
        self._send_now(rid, TAG_CTL, pack_control(msg, self.limits.max_control_bytes))

    def _send_now(self, rid: bytes, tag: bytes, payload: bytes) -> bool:
        """Socket thread only. False when the peer is gone or its queue is full."""
        try:
            self._sock.send_multipart([rid, tag, payload], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:   # EHOSTUNREACH (ROUTER_MANDATORY) or EAGAIN
            return False

    def _run(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        reading = False
        try:
            while not self._stop.is_set():
                with self._cond:
                    want = self._pending < self.limits.max_pending_bytes
                if want != reading:   # back-pressure: stop reading while the decode loop is behind
                    if want:
                        poller.register(sock, zmq.POLLIN)
                    else:
                        poller.unregister(sock)
                    reading = want
                events = dict(poller.poll(20 if self._outbox.retrying else 500))
                if self._wake_r in events or self._wake_r.fileno() in events:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except OSError:
                        pass
                self._flush_outbox()
                if sock in events:
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(frames)
                        with self._cond:
                            if self._pending >= self.limits.max_pending_bytes:
                                break
            self._flush_outbox()
        finally:
            sock.close(linger=self.linger_ms)

    def _flush_outbox(self) -> None:
        for tag, ok in self._outbox.flush(self._send_now):
            if tag == TAG_REP:
                self.count("replies" if ok else "replies_dropped")

    def _dropped(self, stat: str, cause: str, why: str) -> None:
        """Count a dropped ZMQ message; a warning at most once per cause per 10 s (fuzzers cannot flood the log)."""
        self.count(stat)
        self._rlog.warning(cause, "state receiver %s: dropped a message: %s", self.receiver_id, why[:300])

    def _handle(self, frames: list) -> None:
        """One ZMQ message [routing id, tag, ...]. Never raises on garbage."""
        try:
            if len(frames) < 3 or len(frames[1]) != 1:
                self._dropped("dropped_malformed", "framing", f"{len(frames) - 1} frames without a valid tag")
                return
            rid, tag = frames[0].bytes, frames[1].bytes
            if tag == TAG_CTL and len(frames) == 3:
                self._on_control(rid, frames[2])
            elif tag == TAG_MSG:
                self._on_message(rid, frames[2:])
            else:
                self._dropped("dropped_malformed", "framing", f"tag {tag!r} with {len(frames) - 2} frames")
        except Exception as e:   # never let a bad message kill the socket thread
            self._dropped("dropped_malformed", "error", f"{type(e).__name__} while handling it")

    def _on_message(self, rid: bytes, zframes: list) -> None:
        with self._lock:
            peer = self._by_rid.get(rid)
        if peer is None:
            self._dropped("dropped_unknown_peer", "unknown-peer", "state message from a peer without a handshake")
            self._reject(rid, "no handshake with this decode receiver (restarted or superseded): send hello first",
                         zframes[0])
            return
        body = [f.buffer for f in zframes]
        try:
            self.plane.accept(peer, body)
        except TransferError as e:
            self._dropped("dropped_malformed", "bad-message", f"from {peer.peer_id}: {e}")
            self._reject(rid, f"dropped: {e}", body[0])
            self.plane.dropped(peer)

    def _refuse(self, rid: bytes, nonce, reason: str) -> None:
        self.count("refused")
        self._rlog.warning("refused", "state receiver %s: refused a hello: %s", self.receiver_id, reason[:300])
        msg = {"op": "refuse", "v": PROTOCOL_VERSION, "nonce": nonce if valid_id(nonce, 64) else "",
               "reason": reason}
        self._send_now(rid, TAG_CTL, pack_control(msg, self.limits.max_control_bytes))

    def _prune_dead_peers(self) -> int:
        """Socket thread only: forget handshaked peers whose connection is gone (a sender that
        vanished without ``bye``), so they cannot fill ``max_peers`` for good. Probes each routing
        id with a ``{"op": "ping"}`` control frame (senders ignore it): with ROUTER_MANDATORY a
        gone peer fails with EHOSTUNREACH. At most every 0.5 s. Returns the number forgotten."""
        now = time.monotonic()
        if now - self._last_prune < 0.5:
            return 0
        self._last_prune = now
        with self._lock:
            peers = list(self._by_rid.values())
        ping = pack_control({"op": "ping", "v": PROTOCOL_VERSION}, self.limits.max_control_bytes)
        gone = 0
        for p in peers:
            try:
                self._sock.send_multipart([p.rid, TAG_CTL, ping], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH and self.forget(p):
                    gone += 1
        if gone:
            self.count("peers_pruned", gone)
        return gone

    def _on_control(self, rid: bytes, frame) -> None:
        msg = unpack_control(frame, self.limits.max_control_bytes)
        if msg is not None and msg.get("op") == "bye":
            with self._lock:
                peer = self._by_rid.get(rid)
            if peer is not None and peer.peer_id == msg.get("sender_id"):
                self.forget(peer, graceful=True)
            return
        if msg is None or msg.get("op") != "hello":
            self._dropped("dropped_malformed", "bad-control", "control frame that is not a msgpack hello / bye")
            return
        nonce = msg.get("nonce")
        reason = hello_refusal(msg, self._mine())
        if reason:
            return self._refuse(rid, nonce, reason)
        sender_id = msg["sender_id"]
        with self._lock:   # the same connection after a reconnect: keep the peer (and its dist pair)
            cur = self._by_rid.get(rid)
            resumed = cur is not None and cur.peer_id == sender_id and self._by_id.get(sender_id) is cur
        if resumed:
            self.count("resumed")
            return self._welcome(cur, nonce)
        with self._lock:
            old = [p for p in (self._by_rid.pop(rid, None), self._by_id.get(sender_id)) if p is not None]
            for p in old:
                self._by_rid.pop(p.rid, None)
                if self._by_id.get(p.peer_id) is p:
                    del self._by_id[p.peer_id]
            full = len(self._by_id) >= self.limits.max_peers
        for p in {id(p): p for p in old}.values():
            self.plane.peer_gone(p)
        if full and self._prune_dead_peers():
            with self._lock:
                full = len(self._by_id) >= self.limits.max_peers
        if full:
            return self._refuse(rid, nonce, f"too many prefill peers (max_peers={self.limits.max_peers})")
        peer = Peer(sender_id, rid)
        try:
            peer.extra = self.plane.welcome(peer, msg)
        except Exception as e:
            return self._refuse(rid, nonce, f"decode side cannot set up the pair: {e}")
        with self._lock:
            self._by_rid[rid] = peer
            self._by_id[sender_id] = peer
            self._stats["handshakes"] += 1
        self._welcome(peer, nonce)

    def _welcome(self, peer: Peer, nonce: str) -> None:
        welcome = {"op": "welcome", "v": PROTOCOL_VERSION, "receiver_id": self.receiver_id, "peer_id": peer.peer_id,
                   "nonce": nonce, "limits": self.limits.announce(), **self._mine(), **peer.extra}
        self._send_now(peer.rid, TAG_CTL, pack_control(welcome, self.limits.max_control_bytes))
