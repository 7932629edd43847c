"""The seam between the ZMQ control channel and a payload plane.

A ZMQ sender / receiver (``zmq_sender``, ``zmq_receiver``) owns the pair: handshake, header
frames, replies, limits, security. What carries a state message's tensor bytes is its *plane*:
``SenderPlane`` / ``ReceiverPlane`` as here send them as further frames of the same ZMQ message
(the zmq-tcp / zmq-ipc kinds); the dist kind's planes (``kvtransfer.transports.dist``) move them
over a torch.distributed pair group instead. A plane sees only ``Connection`` / ``Peer`` and the
receiver as a ``ReceiverHost``, never the sockets' internals.
"""
from __future__ import annotations

from typing import Protocol

from kvtransfer.interfaces import TAG_MSG, Delivered, Limits, check_message, frame_nbytes


class Connection:
    """One handshaked destination of a sender. ``dest``: the address as given; ``zdest``: its ZMQ
    endpoint; ``sock``: the DEALER socket; ``welcome``: the receiver's welcome; ``limits``: what it
    announced; ``state``: what the plane's ``open`` returned. ``mon``: the socket's monitor (its
    ZMTP session dropping, handshake failures); ``stale``: the session dropped since the last
    hello, so the next send says hello again first (``zmq_sender``)."""
    __slots__ = ("dest", "zdest", "sock", "welcome", "limits", "state", "mon", "stale")

    def __init__(self, dest: str, zdest: str, sock):
        self.dest, self.zdest, self.sock = dest, zdest, sock
        self.welcome: dict = {}
        self.limits = Limits()
        self.state = None
        self.mon = None
        self.stale = False


class Peer:
    """A handshaked sender as the receiver sees it: ``peer_id`` (its sender_id), ``rid`` (ZMQ
    routing id), ``state`` (what the plane's ``welcome`` set), ``extra`` (the plane's welcome
    fields, repeated when the same connection says hello again after a reconnect)."""
    __slots__ = ("peer_id", "rid", "state", "extra")

    def __init__(self, peer_id: str, rid: bytes):
        self.peer_id, self.rid, self.state, self.extra = peer_id, rid, None, {}


class ReceiverHost(Protocol):
    """What a receiver offers its plane (``ZmqStateReceiver`` documents each; any thread may call)."""
    limits: Limits
    receiver_id: str

    def deliver(self, d: Delivered, reserved: bool = False) -> None: ...   # to recv_messages

    def reserve(self, nbytes: int) -> None: ...      # pending bytes of a message still arriving

    def release(self, nbytes: int) -> None: ...      # undo reserve: that message never comes

    def count(self, key: str, n: int = 1) -> None: ...   # a stats counter

    def forget(self, peer: Peer, graceful: bool = False) -> bool: ...   # drop a peer (then peer_gone)

    def send_control(self, peer: Peer, msg: dict) -> None: ...   # a control message to the sender


class SenderPlane:
    """How a sender moves tensor bytes. This one: as frames of the state message itself.

    ``transport``: the name both sides compare in the handshake. ``dist_addresses``: destinations
    are ``dist+tcp://`` / ``dist+ipc://`` (``interfaces.split_dest``). Called on the sender's one
    thread only.
    """
    transport = "zmq"
    dist_addresses = False

    def handshake_fields(self) -> dict:
        """Extra hello fields the receiver must equal (compared by ``interfaces.handshake_mismatch``)."""
        return {}

    def open(self, conn: Connection, welcome: dict, deadline: float):
        """Finish ``conn`` after the welcome, by ``deadline`` (monotonic s); the result becomes
        ``conn.state``. Raises TransportError to fail ``connect``."""
        return None

    def prepare(self, conn: Connection, frames: list, header: dict):
        """Whatever ``send`` needs, built before anything is sent (may raise: nothing was sent)."""
        return None

    def send(self, conn: Connection, frames: list, prepared) -> None:
        """Send one checked message (``prepared`` from ``prepare``). Any exception ends ``conn``.
        zmq.Again: the send timed out."""
        conn.sock.send_multipart([TAG_MSG, *frames], copy=False)

    def close(self, conn: Connection) -> None:
        """Release what ``open`` built (``conn`` is being dropped or the sender closes)."""


class ReceiverPlane:
    """How a receiver takes tensor bytes. This one: from the frames of the state message itself.

    ``transport``, ``handshake_fields``: as for ``SenderPlane``. ``address_prefix``: put before the
    ZMQ endpoint in the receiver's address. ``counters``: extra ``stats`` keys (start at 0).
    ``welcome`` / ``accept`` / ``dropped`` run on the receiver's socket thread.
    """
    transport = "zmq"
    address_prefix = ""
    counters: tuple[str, ...] = ()
    rx: ReceiverHost

    def attach(self, rx: ReceiverHost) -> None:
        """Called once by the receiver, before its socket thread starts."""
        self.rx = rx

    def handshake_fields(self) -> dict:
        return {}

    def welcome(self, peer: Peer, hello: dict) -> dict:
        """Set up ``peer`` (``peer.state``); returns extra welcome fields. Raises to refuse the hello."""
        return {}

    def accept(self, peer: Peer, frames: list) -> None:
        """A state message ``frames`` = [header, ...] from a handshaked peer: check, then deliver (now
        or later). Raises wire.TransferError to drop it (the sender gets a reject)."""
        h = check_message(frames, self.rx.limits)
        self.rx.deliver(Delivered(peer.peer_id, h, frames, sum(frame_nbytes(f) for f in frames)))

    def dropped(self, peer: Peer) -> None:
        """A message of ``peer`` was dropped (``accept`` raised)."""

    def peer_gone(self, peer: Peer, graceful: bool = False) -> None:
        """``peer`` said bye (``graceful``: deliver what is under way), was superseded, failed, or
        the receiver is closing. Any thread."""

    def close(self) -> None:
        """Release what the plane owns (after the socket thread ended)."""
