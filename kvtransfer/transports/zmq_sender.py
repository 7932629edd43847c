"""ZMQ transport, prefill side: one DEALER socket per destination (the pair's framing and security:
``kvtransfer.transports``). Tensor bytes travel as its ``SenderPlane`` says.
"""
from __future__ import annotations

import time
import uuid

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtransfer.interfaces import (MAX_ID, PROTOCOL_VERSION, REJECT_OP, TAG_CTL, TAG_REP, Limits, StateSender,
                                   TransportError, check_message, dest_receiver_id, frame_nbytes, handshake_mismatch,
                                   normalize_layout, pack_control, split_dest, unpack_control, valid_id)
from kvtransfer.secure import cluster_keys, secure_client
from kvtransfer.transports.plane import Connection, SenderPlane

_WATCHED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)


def _session(welcome: dict) -> dict:
    """What identifies a receiver's session with us: its welcome but the per-hello nonce."""
    return {k: v for k, v in welcome.items() if k != "nonce"}


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
        plane: how tensor bytes travel (default: in the state message; the dist kind passes its own).
        hello_timeout_s: how long the hello that ``send`` says again after the connection to a
            destination dropped and libzmq reconnected may wait for its welcome (seconds).

    Raises:
        ValueError: bad sender_id, or a secret that is empty / too short.
    """

    def __init__(self, fingerprint: str, layout: dict, sender_id: str, send_timeout_s: float = 30.0,
                 linger_ms: int = 1000, max_control_bytes: int = 1 << 20, sndhwm: int = 1000, secret=None,
                 plane: SenderPlane | None = None, hello_timeout_s: float = 10.0):
        if not valid_id(sender_id):
            raise ValueError(f"sender_id must be a non-empty string of at most {MAX_ID} characters")
        self.plane = plane or SenderPlane()
        self._keys = cluster_keys(secret)
        self.fingerprint, self.layout, self.sender_id = fingerprint, normalize_layout(layout), sender_id
        self.send_timeout_s, self.linger_ms, self.max_control_bytes = send_timeout_s, linger_ms, max_control_bytes
        self.sndhwm = sndhwm
        self._ctx = zmq.Context()
        self.hello_timeout_s = hello_timeout_s
        self._conns: dict[str, Connection] = {}
        self._stash: list[tuple[str, dict]] = []   # replies read while awaiting a welcome
        self._closed = False

    # -- handshake -------------------------------------------------------------------------
    def _mine(self) -> dict:
        return {"transport": self.plane.transport, "fingerprint": self.fingerprint, "layout": self.layout,
                **self.plane.handshake_fields()}

    def _hello(self, nonce: str) -> dict:
        return {"op": "hello", "v": PROTOCOL_VERSION, "sender_id": self.sender_id, "nonce": nonce, **self._mine()}

    def connect(self, dest: str, timeout_s: float = 10.0) -> None:
        if self._closed:
            raise TransportError("sender is closed")
        if dest in self._conns:
            return
        zdest = split_dest(dest, self.plane.dist_addresses)
        for old in [d for d, c in self._conns.items() if c.zdest == zdest]:
            self._drop(old)              # another process at that endpoint before (a restarted decode)
        sock = self._ctx.socket(zmq.DEALER)
        # A routing id of our own (not libzmq's per-TCP-connection one): after libzmq reconnects
        # (a reset connection, a restarted relay) the receiver's ROUTER still knows this peer, so
        # messages queued meanwhile land instead of being rejected as from an unknown peer.
        sock.setsockopt(zmq.ROUTING_ID, b"P" + uuid.uuid4().bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.send_timeout_s * 1000)))
        sock.setsockopt(zmq.SNDHWM, self.sndhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_control_bytes + 64)   # replies only come this way
        if zdest.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        conn = Connection(dest, zdest, sock)
        try:
            secure_client(sock, self._keys)
            conn.mon = sock.get_monitor_socket(_WATCHED)   # refused handshakes fail fast; drops mark stale
            sock.connect(zdest)
            self._handshake(conn, timeout_s)
        except zmq.ZMQError as e:
            self._close_conn(conn, 0)
            raise TransportError(f"connect to {dest}: {e}") from None
        except BaseException:
            self._close_conn(conn, 0)
            raise
        sock.setsockopt(zmq.LINGER, self.linger_ms)
        self._conns[dest] = conn

    def _handshake(self, conn: Connection, timeout_s: float) -> None:
        """hello -> welcome on ``conn``'s socket, checked; (re)opens the plane unless the welcome
        repeats the session ``conn`` already has (the receiver kept us across a reconnect).
        Raises TransportError (refused, timed out, another receiver than ``dest`` names)."""
        deadline = time.monotonic() + timeout_s
        nonce = uuid.uuid4().hex
        hello = [TAG_CTL, pack_control(self._hello(nonce), self.max_control_bytes)]
        conn.sock.send_multipart(hello)
        welcome = self._await_welcome(conn, hello, nonce, deadline, timeout_s)
        before = conn.welcome
        self._check_welcome(conn, welcome)
        if _session(welcome) != _session(before):   # first contact, a restarted decode, or a new dist pair
            if before:
                self.plane.close(conn)
            conn.state = self.plane.open(conn, welcome, deadline)
        conn.stale = False

    @staticmethod
    def _stop_monitor(sock, mon) -> None:
        if mon is None:
            return
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(linger=0)

    def _watch(self, conn: Connection, failures: int, hello: list | None = None) -> int:
        """Read one monitor event of ``conn``: a dropped ZMTP session marks it stale (and re-sends
        ``hello``, which may have died with it); raises TransportError for a handshake that cannot
        succeed. Returns the count of unexplained (NO_DETAIL) handshake failures so far."""
        try:
            ev = recv_monitor_message(conn.mon, zmq.NOBLOCK)
        except zmq.ZMQError:
            return failures
        kind, dest = ev.get("event"), conn.dest
        if kind == zmq.EVENT_DISCONNECTED:
            conn.stale = True
            if hello is not None:
                conn.sock.send_multipart(hello, zmq.NOBLOCK)
        elif hello is None:
            pass                       # between transfers: the next hello reports what is wrong
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise TransportError(f"handshake with {dest} refused: the decode receiver did not accept this sender's "
                                 f"CURVE key (the cluster secrets differ)")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            why = ("this sender has a cluster secret (CURVE) and the receiver has none" if self._keys else
                   "the receiver requires a cluster secret (CURVE) and this sender has none")
            raise TransportError(f"handshake with {dest} failed: ZMTP security mechanism or protocol differs "
                                 f"({why}; or it is not a dsv4 state receiver)")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            failures += 1
            if self._keys and failures >= 2:   # persistent: the receiver cannot decrypt our CURVE HELLO
                raise TransportError(f"handshake with {dest} failed: the decode receiver dropped the CURVE "
                                     f"handshake (its cluster secret differs, or it has none)")
        return failures

    def _await_welcome(self, conn: Connection, hello: list, nonce: str, deadline: float, timeout_s: float) -> dict:
        sock, mon, dest = conn.sock, conn.mon, conn.dest
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        failures = 0
        while True:
            left = deadline - time.monotonic()
            events = dict(poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if mon in events:
                failures = self._watch(conn, failures, hello)
            if sock not in events:
                if time.monotonic() >= deadline:
                    hint = (f"; {failures} ZMTP handshake(s) failed (cluster secret / CURVE mismatch?)"
                            if failures else "")
                    raise TransportError(f"handshake with {dest} timed out after {timeout_s:g} s "
                                         f"(no receiver listening there, or it is not a dsv4 state receiver{hint})")
                continue
            frames = sock.recv_multipart()
            msg = unpack_control(frames[1], self.max_control_bytes) if len(frames) == 2 else None
            if not msg:
                continue
            if msg.get("nonce") != nonce:
                # a reply / reject to a message sent before this hello (a hello after a reconnect):
                # poll_replies hands it over; the hello already answers a reject
                if frames[0] == TAG_REP or msg.get("op") == REJECT_OP:
                    self._stash.append((dest, msg))
                continue
            if msg.get("op") == "refuse":
                raise TransportError(f"handshake with {dest} refused by the decode side: {msg.get('reason')}")
            if msg.get("op") == "welcome":
                return msg

    def _check_welcome(self, conn: Connection, w: dict) -> None:
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
        elif self._session_dropped(conn):
            self._resume(conn)
        h = check_message(frames, conn.limits)
        prepared = self.plane.prepare(conn, frames, h)   # may raise: nothing sent, the connection stays
        try:
            self.plane.send(conn, frames, prepared)
        except zmq.Again:
            self._drop(dest)
            raise TransportError(f"send to {dest} timed out after {self.send_timeout_s:g} s "
                                 f"(decode receiver gone or not reading)") from None
        except zmq.ZMQError as e:
            self._drop(dest)
            raise TransportError(f"send to {dest}: {e}") from None
        except BaseException:   # part of a message may be out: the peer can no longer parse this pair
            self._drop(dest)
            raise
        return sum(frame_nbytes(f) for f in frames)

    def _session_dropped(self, conn: Connection) -> bool:
        """True when ``conn``'s ZMTP session dropped since its last hello (monitor events so far)."""
        while not conn.stale and conn.mon.poll(0):
            self._watch(conn, 0)
        return conn.stale

    def _resume(self, conn: Connection) -> None:
        """Say hello again on ``conn``'s socket (after whatever it already queued) before the next
        message: the receiver there may be another process now (a restarted decode), which
        would reject that message. The same receiver answers with the same session, so nothing
        changes; another one gets a fresh handshake (and a ``dest`` naming the old one fails).
        Raises TransportError (the connection is dropped)."""
        try:
            self._handshake(conn, self.hello_timeout_s)
        except zmq.ZMQError as e:
            self._drop(conn.dest)
            raise TransportError(f"hello to {conn.dest} after a reconnect: {e}") from None
        except BaseException:
            self._drop(conn.dest)
            raise

    # -- replies ---------------------------------------------------------------------------
    def poll_replies(self, timeout_s: float = 0.0) -> list[tuple[str, dict]]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            out, self._stash = self._stash, []
            for dest, conn in list(self._conns.items()):
                self._drain(dest, conn, out)
            left = deadline - time.monotonic()
            if out or left <= 0 or not self._conns:
                return out
            poller = zmq.Poller()
            for conn in self._conns.values():
                poller.register(conn.sock, zmq.POLLIN)
            poller.poll(int(left * 1000) + 1)

    def _drain(self, dest: str, conn: Connection, out: list) -> None:
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

    def _close_conn(self, conn: Connection, linger_ms: int) -> None:
        try:
            self.plane.close(conn)
        finally:
            self._stop_monitor(conn.sock, conn.mon)
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
