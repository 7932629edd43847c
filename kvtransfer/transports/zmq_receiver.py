"""ZMQ transport: ROUTER (decode receiver, binds) / DEALER (prefill sender, connects), multipart frames.

Every ZMQ message on the pair starts with a one-byte tag frame (``transport.TAG_*``):

    sender -> receiver   [C, hello]                      control (msgpack)
                         [M, header, tensor_1 .. tensor_n] a state message (frames as wire builds them)
    receiver -> sender   [C, welcome | refuse | transport.reject]
                         [R, reply]                      StateReceiver.reply (msgpack)

The receiver owns its ROUTER socket on one background thread; ``reply`` queues to that thread and
wakes it through a socketpair, so any thread may call it. Tensor frames are sent with
``copy=False`` (zero-copy for frames over pyzmq's copy threshold) and received as zmq.Frame
buffers (memoryviews), never copied by the transport.

Security: with a cluster ``secret`` (both sides, ``kvtransfer.secure``) the pair runs CURVE
(ZMQ RFC 26, encryption + mutual authentication; the receiver's ZAP handler, RFC 27, accepts only
the cluster's client key): a peer without the secret never gets a frame to the receiver, and a
sender whose secret differs fails ``connect`` with TransportError (fast, from the socket's
handshake-failure events; at worst at ``timeout_s``). Without a secret, plain ZMQ: bind to
loopback or a trusted network. Either way every socket bounds one frame (``MAXMSGSIZE``), the
receiver never raises on garbage, drops what it cannot parse (counted in ``stats``, a warning
at most once per cause per 10 s) and keeps at most ``max_peers`` peers, pruning disconnected ones
when full.
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
from zmq.utils.monitor import recv_monitor_message

from kvtransfer import wire
from kvtransfer.secure import RateLimitedLog, cluster_keys, secure_client, secure_server, stop_authenticator
from kvtransfer.interfaces import (PROTOCOL_VERSION, REJECT_OP, TAG_CTL, TAG_MSG, TAG_REP, Delivered, Limits, StateReceiver,
                                  StateSender, TransportError, check_message, default_ipc_path, frame_nbytes,
                                  handshake_mismatch, limits_from, normalize_layout, pack_control, split_dest, dest_receiver_id,
                                  tcp_endpoint, transfer_id_of, unpack_control)

_MAX_ID = 256   # characters of sender_id / receiver_id / nonce
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
log = logging.getLogger(__name__)


def _is_str(v, n: int = _MAX_ID) -> bool:
    return isinstance(v, str) and 0 < len(v) <= n


class _Conn:
    """One handshaked destination of a sender."""
    __slots__ = ("dest", "zdest", "sock", "welcome", "limits", "extra")

    def __init__(self, dest, zdest, sock):
        self.dest, self.zdest, self.sock = dest, zdest, sock
        self.welcome: dict = {}
        self.limits = Limits()
        self.extra = None


class ZmqStateSender(StateSender):
    """Prefill side over ZMQ DEALER sockets, one per destination. One thread only.

    Args:
        fingerprint: ``wire.model_fingerprint`` of this prefill's model.
        layout: plain dict (dtypes, block layout, parallel layout...) the receiver must equal.
        sender_id: unique per live sender; a new hello with the same id supersedes the old one
            on the receiver (a restarted prefill worker).
        send_timeout_s: how long ``send`` may block on a full queue (peer gone / not reading)
            before TransportError. linger_ms: how long ``close`` flushes queued messages.
        max_control_bytes: bound on one reply frame.
        secret: the cluster shared secret (str / bytes, >= 16 characters, or ``secure.ClusterKeys``):
            CURVE client towards receivers started with the same secret. None: plain ZMQ.

    Raises:
        ValueError: bad sender_id, or a secret that is empty / too short.
    """
    transport_name = "zmq"
    _dist = False

    def __init__(self, fingerprint: str, layout: dict, sender_id: str, send_timeout_s: float = 30.0,
                 linger_ms: int = 1000, max_control_bytes: int = 1 << 20, sndhwm: int = 1000, secret=None):
        if not _is_str(sender_id):
            raise ValueError(f"sender_id must be a non-empty string of at most {_MAX_ID} characters")
        self._keys = cluster_keys(secret)
        self.fingerprint, self.layout, self.sender_id = fingerprint, normalize_layout(layout), sender_id
        self.send_timeout_s, self.linger_ms, self.max_control_bytes = send_timeout_s, linger_ms, max_control_bytes
        self.sndhwm = sndhwm
        self._ctx = zmq.Context()
        self._conns: dict[str, _Conn] = {}
        self._closed = False

    # -- handshake -------------------------------------------------------------------------
    def _mine(self) -> dict:
        return {"transport": self.transport_name, "fingerprint": self.fingerprint, "layout": self.layout}

    def _hello(self, nonce: str) -> dict:
        return {"op": "hello", "v": PROTOCOL_VERSION, "sender_id": self.sender_id, "nonce": nonce, **self._mine()}

    def _on_welcome(self, conn: _Conn, welcome: dict, deadline: float) -> None:
        """Hook: finish the connection after a welcome (the dist sender joins its process group)."""

    def _close_extra(self, conn: _Conn) -> None:
        """Hook: release what ``_on_welcome`` built."""

    def connect(self, dest: str, timeout_s: float = 10.0) -> None:
        if self._closed:
            raise TransportError("sender is closed")
        if dest in self._conns:
            return
        zdest = split_dest(dest, self._dist)
        for old in [d for d, c in self._conns.items() if c.zdest == zdest]:
            self._drop(old)              # another process at that endpoint before (a restarted decode)
        deadline = time.monotonic() + timeout_s
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.send_timeout_s * 1000)))
        sock.setsockopt(zmq.SNDHWM, self.sndhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_control_bytes + 64)   # replies only come this way
        if zdest.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        conn = _Conn(dest, zdest, sock)
        mon = None
        try:
            secure_client(sock, self._keys)
            mon = sock.get_monitor_socket(_HANDSHAKE_FAILED)   # a refused handshake fails fast
            sock.connect(zdest)
            nonce = uuid.uuid4().hex
            sock.send_multipart([TAG_CTL, pack_control(self._hello(nonce), self.max_control_bytes)])
            welcome = self._await_welcome(sock, mon, dest, nonce, deadline, timeout_s)
            self._check_welcome(conn, welcome)
            self._on_welcome(conn, welcome, deadline)
        except zmq.ZMQError as e:
            self._close_conn(conn, 0, mon)
            raise TransportError(f"connect to {dest}: {e}") from None
        except BaseException:
            self._close_conn(conn, 0, mon)
            raise
        self._stop_monitor(sock, mon)
        sock.setsockopt(zmq.LINGER, self.linger_ms)
        self._conns[dest] = conn

    @staticmethod
    def _stop_monitor(sock, mon) -> None:
        if mon is None:
            return
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(linger=0)

    def _handshake_failed(self, mon, dest: str, failures: int) -> int:
        """Read one monitor event; raise TransportError for a handshake that cannot succeed.
        Returns the count of unexplained (NO_DETAIL) failures so far."""
        try:
            ev = recv_monitor_message(mon, zmq.NOBLOCK)
        except zmq.ZMQError:
            return failures
        kind = ev.get("event")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise TransportError(f"handshake with {dest} refused: the decode receiver did not accept this sender's "
                                 f"CURVE key (the cluster secrets differ)")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = ("this sender has a cluster secret (CURVE) and the receiver has none" if self._keys else
                   "the receiver requires a cluster secret (CURVE) and this sender has none")
            raise TransportError(f"handshake with {dest} failed: ZMTP security mechanism or protocol differs "
                                 f"({why}; or it is not a dsv4 state receiver)")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            failures += 1
            if self._keys and failures >= 2:   # persistent: the receiver cannot decrypt our CURVE HELLO
                raise TransportError(f"handshake with {dest} failed: the decode receiver dropped the CURVE "
                                     f"handshake (its cluster secret differs, or it has none)")
        return failures

    def _await_welcome(self, sock, mon, dest: str, nonce: str, deadline: float, timeout_s: float) -> dict:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if mon is not None:
            poller.register(mon, zmq.POLLIN)
        failures = 0
        while True:
            left = deadline - time.monotonic()
            events = dict(poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if mon is not None and mon in events:
                failures = self._handshake_failed(mon, dest, failures)
            if sock not in events:
                if time.monotonic() >= deadline:
                    hint = (f"; {failures} ZMTP handshake(s) failed (cluster secret / CURVE mismatch?)"
                            if failures else "")
                    raise TransportError(f"handshake with {dest} timed out after {timeout_s:g} s "
                                         f"(no receiver listening there, or it is not a dsv4 state receiver{hint})")
                continue
            frames = sock.recv_multipart()
            if len(frames) != 2 or frames[0] != TAG_CTL:
                continue   # a reply / stale frame from an earlier connection
            msg = unpack_control(frames[1], self.max_control_bytes)
            if not msg or msg.get("nonce") != nonce:
                continue
            if msg.get("op") == "refuse":
                raise TransportError(f"handshake with {dest} refused by the decode side: {msg.get('reason')}")
            if msg.get("op") == "welcome":
                return msg

    def _check_welcome(self, conn: _Conn, w: dict) -> None:
        """The sender verifies too (both sides check fingerprint / layout / transport)."""
        if w.get("v") != PROTOCOL_VERSION:
            raise TransportError(f"handshake with {conn.dest}: protocol version {w.get('v')!r}, "
                                 f"this prefill speaks {PROTOCOL_VERSION}")
        reason = handshake_mismatch(self._mine(), w, me="prefill", them="decode")
        if reason:
            raise TransportError(f"handshake with {conn.dest} refused by the prefill side: {reason}")
        want = dest_receiver_id(conn.dest)
        if want is not None and w.get("receiver_id") != want:
            raise TransportError(f"handshake with {conn.dest}: the receiver there is {w.get('receiver_id')!r}, "
                                 f"not {want!r} (the decode process restarted): its reservation is gone")
        lim = w.get("limits")
        if not (isinstance(lim, dict) and isinstance(lim.get("max_frames"), int)
                and isinstance(lim.get("max_message_bytes"), int)):
            raise TransportError(f"handshake with {conn.dest}: welcome without limits")
        conn.limits = Limits(max_frames=lim["max_frames"], max_message_bytes=lim["max_message_bytes"])
        conn.welcome = w

    # -- sending ---------------------------------------------------------------------------
    def send(self, dest: str, frames: list) -> int:
        conn = self._conns.get(dest)
        if conn is None:
            self.connect(dest)
            conn = self._conns[dest]
        h = check_message(frames, conn.limits)
        try:
            self._send_payload(conn, frames, h)
        except zmq.Again:
            self._drop(dest)
            raise TransportError(f"send to {dest} timed out after {self.send_timeout_s:g} s "
                                 f"(decode receiver gone or not reading)") from None
        except zmq.ZMQError as e:
            self._drop(dest)
            raise TransportError(f"send to {dest}: {e}") from None
        return sum(frame_nbytes(f) for f in frames)

    def _send_payload(self, conn: _Conn, frames: list, header: dict) -> None:
        conn.sock.send_multipart([TAG_MSG, *frames], copy=False)

    # -- replies ---------------------------------------------------------------------------
    def poll_replies(self, timeout_s: float = 0.0) -> list[tuple[str, dict]]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            out: list[tuple[str, dict]] = []
            for dest, conn in list(self._conns.items()):
                self._drain(dest, conn, out)
            left = deadline - time.monotonic()
            if out or left <= 0 or not self._conns:
                return out
            poller = zmq.Poller()
            for conn in self._conns.values():
                poller.register(conn.sock, zmq.POLLIN)
            poller.poll(int(left * 1000) + 1)

    def _drain(self, dest: str, conn: _Conn, out: list) -> None:
        while True:
            try:
                frames = conn.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            msg = unpack_control(frames[1], self.max_control_bytes)
            if msg is None:
                continue
            if frames[0] == TAG_REP:
                out.append((dest, msg))
            elif frames[0] == TAG_CTL and msg.get("op") == REJECT_OP:
                out.append((dest, msg))
                self._drop(dest)   # the receiver forgot us (restart / superseded): handshake again
                return

    # -- teardown --------------------------------------------------------------------------
    def _drop(self, dest: str) -> None:
        conn = self._conns.pop(dest, None)
        if conn is not None:
            self._close_conn(conn, 0)

    def _close_conn(self, conn: _Conn, linger_ms: int, mon=None) -> None:
        try:
            self._close_extra(conn)
        finally:
            self._stop_monitor(conn.sock, mon)
            conn.sock.close(linger=linger_ms)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        bye = pack_control({"op": "bye", "v": PROTOCOL_VERSION, "sender_id": self.sender_id}, self.max_control_bytes)
        for dest in list(self._conns):
            conn = self._conns.pop(dest)
            try:   # lets the receiver forget us now (after the messages already queued)
                conn.sock.send_multipart([TAG_CTL, bye], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._close_conn(conn, self.linger_ms)
        self._ctx.term()


class _Peer:
    """A handshaked sender as the receiver sees it."""
    __slots__ = ("peer_id", "rid", "extra")

    def __init__(self, peer_id: str, rid: bytes):
        self.peer_id, self.rid, self.extra = peer_id, rid, None


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
        **limits: ``Limits`` fields (max_frames, max_message_bytes, ...).

    Raises:
        zmq.ZMQError: the endpoint cannot be bound. TypeError: unknown keyword. ValueError: a
            secret that is empty / too short.
    """
    transport_name = "zmq"

    def __init__(self, kind: str, host: str, port: int, fingerprint: str, layout: dict, receiver_id: str | None = None,
                 ipc_path: str | None = None, advertise_host: str | None = None, linger_ms: int = 100, secret=None,
                 **limits):
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
        self._stats = collections.Counter({k: 0 for k in ("messages", "bytes", "handshakes", "refused",
                                                          "dropped_malformed", "dropped_unknown_peer", "replies",
                                                          "replies_dropped", "peers_pruned")})
        self._lock = threading.Lock()                  # peers, outbox, stats
        self._cond = threading.Condition(threading.Lock())   # delivered queue
        self._delivered: collections.deque = collections.deque()
        self._pending = 0                              # delivered (or reserved) and not yet recv()ed bytes
        self._outbox: collections.deque = collections.deque()
        self._by_rid: dict[bytes, _Peer] = {}
        self._by_id: dict[str, _Peer] = {}
        self._stop = threading.Event()
        self._closed = False
        self._last_prune = float("-inf")

        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            secure_server(sock, keys)   # before bind; starts the context's ZAP handler
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, max(self.limits.max_message_bytes, self.limits.max_control_bytes))
            sock.setsockopt(zmq.LINGER, linger_ms)
            if kind == "zmq-ipc":
                self._ipc_path = ipc_path or default_ipc_path(port)
                sock.bind(f"ipc://{self._ipc_path}")
                zaddr = f"ipc://{self._ipc_path}"
            else:
                self._ipc_path = None
                if ":" in host:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.bind(tcp_endpoint(host, port))
                bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
                self.port = int(bound.rsplit(":", 1)[1])
                adv = advertise_host or host
                zaddr = f"{tcp_endpoint(adv, self.port)}"
        except BaseException:
            sock.close(linger=0)
            stop_authenticator(self._ctx)
            self._ctx.term()
            raise
        self._sock = sock
        self.address = self._public_address(zaddr)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"state-rx-{self.receiver_id}", daemon=True)
        self._thread.start()

    def _public_address(self, zaddr: str) -> str:
        return zaddr

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
            self._outbox.append((peer.rid, TAG_REP, payload))
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
            self._peer_gone(p)
        self._close_extra()
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

    # -- hooks for the dist receiver -------------------------------------------------------
    def _welcome_extra(self, peer: _Peer, hello: dict) -> dict:
        """Extra welcome fields; may raise to refuse (message in the reason)."""
        return {}

    def _accept(self, peer: _Peer, body: list) -> None:
        """A state message from a handshaked peer: check and deliver. Raises wire.TransferError to drop."""
        h = check_message(body, self.limits)
        self._deliver(Delivered(peer.peer_id, h, body, sum(frame_nbytes(f) for f in body)), reserved=False)

    def _on_dropped(self, peer: _Peer) -> None:
        """Hook: a handshaked peer's message was dropped."""

    def _peer_gone(self, peer: _Peer, graceful: bool = False) -> None:
        """Hook: peer said bye (graceful), was superseded, failed, or the receiver is closing."""

    def _close_extra(self) -> None:
        """Hook: release what the subclass owns (after the socket thread ended)."""

    def _mine(self) -> dict:
        return {"transport": self.transport_name, "fingerprint": self.fingerprint, "layout": self.layout}

    # -- internals -------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:   # buffer full (a wake is pending anyway) or closed
            pass

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _deliver(self, d: Delivered, reserved: bool) -> None:
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

    def _queue_out(self, rid: bytes, tag: bytes, payload: bytes) -> None:
        with self._lock:
            self._outbox.append((rid, tag, payload))
        self._wake()

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
                events = dict(poller.poll(500))
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
        while True:
            with self._lock:
                if not self._outbox:
                    return
                rid, tag, payload = self._outbox.popleft()
            ok = self._send_now(rid, tag, payload)
            if tag == TAG_REP:
                self._count("replies" if ok else "replies_dropped")

    def _dropped(self, stat: str, cause: str, why: str) -> None:
        """Count a dropped ZMQ message; a warning at most once per cause per 10 s (fuzzers cannot flood the log)."""
        self._count(stat)
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
            self._accept(peer, body)
        except wire.TransferError as e:
            self._dropped("dropped_malformed", "bad-message", f"from {peer.peer_id}: {e}")
            self._reject(rid, f"dropped: {e}", body[0])
            self._on_dropped(peer)

    def _refuse(self, rid: bytes, nonce, reason: str) -> None:
        self._count("refused")
        self._rlog.warning("refused", "state receiver %s: refused a hello: %s", self.receiver_id, reason[:300])
        msg = {"op": "refuse", "v": PROTOCOL_VERSION, "nonce": nonce if _is_str(nonce, 64) else "",
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
                if e.errno == zmq.EHOSTUNREACH and self._forget(p):
                    gone += 1
        if gone:
            self._count("peers_pruned", gone)
        return gone

    def _on_control(self, rid: bytes, frame) -> None:
        msg = unpack_control(frame, self.limits.max_control_bytes)
        if msg is not None and msg.get("op") == "bye":
            with self._lock:
                peer = self._by_rid.get(rid)
            if peer is not None and peer.peer_id == msg.get("sender_id"):
                self._forget(peer, graceful=True)
            return
        if msg is None or msg.get("op") != "hello":
            self._dropped("dropped_malformed", "bad-control", "control frame that is not a msgpack hello / bye")
            return
        nonce = msg.get("nonce")
        if msg.get("v") != PROTOCOL_VERSION:
            return self._refuse(rid, nonce, f"protocol version differs: prefill speaks {msg.get('v')!r}, "
                                            f"decode speaks {PROTOCOL_VERSION}")
        if not (_is_str(msg.get("sender_id")) and _is_str(nonce, 64) and isinstance(msg.get("fingerprint"), str)
                and isinstance(msg.get("layout"), dict)):
            return self._refuse(rid, nonce, "malformed hello (sender_id, nonce, fingerprint, layout)")
        reason = handshake_mismatch(self._mine(), msg, me="decode", them="prefill")
        if reason:
            return self._refuse(rid, nonce, reason)
        sender_id = msg["sender_id"]
        with self._lock:
            old = [p for p in (self._by_rid.pop(rid, None), self._by_id.get(sender_id)) if p is not None]
            for p in old:
                self._by_rid.pop(p.rid, None)
                if self._by_id.get(p.peer_id) is p:
                    del self._by_id[p.peer_id]
            full = len(self._by_id) >= self.limits.max_peers
        for p in {id(p): p for p in old}.values():
            self._peer_gone(p)
        if full and self._prune_dead_peers():
            with self._lock:
                full = len(self._by_id) >= self.limits.max_peers
        if full:
            return self._refuse(rid, nonce, f"too many prefill peers (max_peers={self.limits.max_peers})")
        peer = _Peer(sender_id, rid)
        try:
            extra = self._welcome_extra(peer, msg)
        except Exception as e:
            return self._refuse(rid, nonce, f"decode side cannot set up the pair: {e}")
        with self._lock:
            self._by_rid[rid] = peer
            self._by_id[sender_id] = peer
            self._stats["handshakes"] += 1
        welcome = {"op": "welcome", "v": PROTOCOL_VERSION, "receiver_id": self.receiver_id, "peer_id": sender_id,
                   "nonce": nonce, "limits": self.limits.announce(), **self._mine(), **extra}
        self._send_now(rid, TAG_CTL, pack_control(welcome, self.limits.max_control_bytes))

    def _forget(self, peer: _Peer, graceful: bool = False) -> bool:
        """Remove ``peer`` if it is still the registered one (any thread). True when removed.
        ``graceful`` (the sender said bye): messages already under way are still delivered."""
        with self._lock:
            if self._by_id.get(peer.peer_id) is not peer:
                return False
            del self._by_id[peer.peer_id]
            self._by_rid.pop(peer.rid, None)
        self._peer_gone(peer, graceful)
        return True
