"""The transfer protocol between a prefill and a decode worker: the StateSender / StateReceiver
interfaces every transport implements, the control messages both sides exchange, and the checks
and address helpers they share. Pick a transport with ``kvtransfer.make_sender`` / ``make_receiver``.

A *message* is a list of frames exactly as ``kvtransfer.wire`` builds them: frame 0 is a msgpack
header that ``wire.decode_header`` parses, frames 1..n are the raw bytes of the tensors the header
lists (``header["tensors"][i]["nbytes"]`` bytes each; n may be 0). Transports never look at the
message kind and never verify crc32: they parse the header once to check sizes and hand it over
with the frames (``Delivered``); the decode side (``kvtransfer.receiver``) fences and verifies, so a
corrupted frame is delivered and counted there.

Kinds and the addresses a receiver advertises (``StateReceiver.address``, what senders pass as
``dest``):

    zmq-tcp   tcp://HOST:PORT                 ZMQ ROUTER (receiver) / DEALER (sender)
    zmq-ipc   ipc:///PATH                     same, over a unix socket
    dist      dist+tcp://HOST:PORT            control (handshake, headers, replies) over ZMQ as above,
              dist+ipc:///PATH                tensor bytes over a 2-rank torch.distributed group per
                                              (sender, receiver) pair: gloo (CPU), nccl (CUDA), hccl (NPU)

Handshake (msgpack control messages on the ZMQ pair, before any state message):

    sender -> receiver  {"op": "hello", "v": 1, "sender_id", "fingerprint", "layout", "transport",
                         "nonce", [dist: "backend"]}
    receiver -> sender  {"op": "welcome", "v": 1, "receiver_id", "peer_id", "nonce", "fingerprint",
                         "layout", "limits": {"max_frames", "max_message_bytes"},
                         [dist: "store_host", "store_port", "prefix", "rank", "coalesce_bytes"]}
                     or {"op": "refuse", "v": 1, "nonce", "reason"}   (reason names what differs)

Both sides judge with ``kvtransfer.compat.handshake_mismatch`` (torch-free), the same rule the
gateway applies to the ``handshake`` fields of the workers' pongs before it pairs them.

The receiver may later send ``{"op": "transport.reject", "v": 1, "reason", "transfer_id"}`` for a
state message it dropped (no handshake, malformed, over a limit, dist pair failed); the sender
surfaces it through ``poll_replies`` and handshakes again on its next ``send``.

Reconnects: a sender's DEALER has a routing id of its own per connection (random), and the
receiver's ROUTER takes it over on a new TCP / unix connection (ROUTER_HANDOVER), so when libzmq
reconnects a reset connection the receiver still knows the peer and nothing is rejected. The
sender watches its socket (monitor: EVENT_DISCONNECTED) and, before its next state message after
a drop, says hello again on the same socket (after what it already queued): the receiver that
knew that routing id and sender_id answers the same welcome and keeps the peer (and its dist
pair); another process there (a restarted decode) gets a fresh handshake, and a ``dest`` naming
the old receiver fails. A sender's
``close`` sends ``{"op": "bye", "v": 1, "sender_id"}``: the receiver forgets it after delivering
what is already under way. A hello whose sender_id is already connected supersedes that peer
(a restarted prefill worker), so sender ids must be unique per live sender. When its peer table
is full the receiver probes its peers with ``{"op": "ping", "v": 1}`` (senders ignore it) and
forgets those whose connection is gone.

Replies of the transfer itself (``StateReceiver.reply`` -> ``StateSender.poll_replies``), one per
transfer id, after its commit (or whole-state message) or when decode refuses it:

    decode -> prefill   {"op": "ack", "transfer_id", "bytes"}        ``ack_message``: state joined the batch
                        {"op": "nack", "transfer_id", "cause", "reason"}   ``nack_message``: refused / failed

Every ZMQ message also carries a leading one-byte tag frame (C control, M state message, R reply),
so control and state messages never depend on what the wire header contains.

No pickle anywhere: control messages are msgpack of plain types; every size is bounded (``Limits``).

Security: ``kvtransfer.make_receiver(..., secret=S)`` / ``make_sender(..., secret=S)`` with the
cluster's shared secret run the ZMQ pair (the dist kind's control channel too) under CURVE with ZAP
(``kvtransfer.secure``): encrypted, and a peer without S cannot deliver a single frame; a sender
whose secret differs gets TransportError from ``connect``. Both sides must agree (secret on one
side only fails the handshake). ``secret=None`` (the default): plain ZMQ, for loopback / trusted
networks. The dist kind's torch.distributed data plane is not covered (see kvtransfer.transports.dist).
"""
from __future__ import annotations

import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgpack

from kvtransfer.compat import handshake_mismatch, layout_diff  # noqa: F401  (the one rule; re-exported)
from kvtransfer.wire import TransferError, decode_header

PROTOCOL_VERSION = 1
MAX_ID = 256   # characters of a sender_id / receiver_id / nonce
REJECT_OP = "transport.reject"

# First frame of every ZMQ message on the pair: what the rest is.
TAG_CTL = b"C"   # one msgpack control frame (hello / welcome / refuse / transport.reject)
TAG_MSG = b"M"   # a state message: header frame [+ tensor frames for the zmq kinds]
TAG_REP = b"R"   # one msgpack reply frame from StateReceiver.reply


class TransportError(RuntimeError):
    """Connect / handshake refused or timed out, or the peer is gone. The message says which and why."""


@dataclass(frozen=True)
class Limits:
    """Size bounds a receiver enforces (and announces in its welcome so senders check first).

    max_frames: tensor frames per message. max_message_bytes: header + tensor bytes of one message
    (also the largest single ZMQ frame the socket accepts). max_control_bytes: one hello / reply /
    control frame. max_pending_bytes: delivered-but-not-yet-``recv``ed bytes before the receiver
    stops reading its socket (back-pressure). max_peers: live handshaked senders.
    """
    max_frames: int = 8192
    max_message_bytes: int = 16 << 30
    max_control_bytes: int = 1 << 20
    max_pending_bytes: int = 8 << 30
    max_peers: int = 1024

    def announce(self) -> dict:
        return {"max_frames": self.max_frames, "max_message_bytes": self.max_message_bytes}


def limits_from(kw: dict) -> Limits:
    """Pop Limits fields out of ``kw`` (so factories can take them as keyword arguments)."""
    fields = asdict(Limits())
    return Limits(**{k: int(kw.pop(k)) for k in list(kw) if k in fields})


# --------------------------------------------------------------------------------------------- #
# control messages

def pack_control(msg: dict, max_bytes: int) -> bytes:
    """msgpack of a dict of plain types. Raises TypeError (not packable) or ValueError (too big)."""
    if not isinstance(msg, dict):
        raise TypeError(f"a control message is a dict, found {type(msg).__name__}")
    blob = msgpack.packb(msg, use_bin_type=True)
    if len(blob) > max_bytes:
        raise ValueError(f"control message: {len(blob)} bytes exceeds {max_bytes}")
    return blob


def unpack_control(frame, max_bytes: int) -> dict | None:
    """msgpack frame -> dict, or None when it is too big, not msgpack or not a map (never raises)."""
    try:
        if len(frame) > max_bytes:
            return None
        msg = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=True)
    except Exception:   # msgpack raises several unrelated types on garbage
        return None
    return msg if isinstance(msg, dict) else None


def normalize_layout(layout: dict) -> dict:
    """The layout as the peer will see it after a msgpack round trip (tuples become lists)."""
    if not isinstance(layout, dict):
        raise TypeError(f"layout must be a dict, found {type(layout).__name__}")
    return msgpack.unpackb(msgpack.packb(layout, use_bin_type=True), raw=False, strict_map_key=False)


def ack_message(transfer_id: str, nbytes: int) -> dict:
    """Decode's reply: the transfer's state (``nbytes`` bytes, all frames) is loaded and committed."""
    return {"op": "ack", "transfer_id": transfer_id, "bytes": nbytes}


def nack_message(transfer_id: str, cause: str, reason: str) -> dict:
    """Decode's reply: the transfer failed or was refused. ``cause``: checksum | malformed | timeout |
    fenced | unknown (the ``kv_transfer_failures`` causes); ``reason``: for people."""
    return {"op": "nack", "transfer_id": transfer_id, "cause": cause, "reason": reason}


# --------------------------------------------------------------------------------------------- #
# message checks shared by senders (before sending) and receivers (before delivering)

def check_message(frames: list, limits: Limits, with_tensor_frames: bool = True) -> dict:
    """Structural checks of a state message, no crc32. Returns the parsed header.

    ``frames``: [header, tensor frames...] (``with_tensor_frames``) or just [header] (the dist
    control path, where the tensor sizes come from the header alone).

    Raises:
        wire.TransferError: unparseable header, too many frames, total bytes over
            ``limits.max_message_bytes``, frame count or a frame's size not what the header lists.
    """
    if not frames:
        raise TransferError("message: no frames")
    if len(frames) - 1 > limits.max_frames:
        raise TransferError(f"message: {len(frames) - 1} tensor frames exceed {limits.max_frames}")
    h = decode_header(frames[0])
    metas = h["tensors"]
    if len(metas) > limits.max_frames:
        raise TransferError(f"message: {len(metas)} tensors exceed {limits.max_frames}")
    total = len(frames[0]) + sum(m["nbytes"] for m in metas)
    if total > limits.max_message_bytes:
        raise TransferError(f"message: {total} bytes exceed {limits.max_message_bytes}")
    if with_tensor_frames:
        if len(frames) != 1 + len(metas):
            raise TransferError(f"message: {len(frames) - 1} tensor frames for {len(metas)} listed tensors")
        for m, f in zip(metas, frames[1:]):
            n = frame_nbytes(f)
            if n != m["nbytes"]:
                raise TransferError(f"tensor {m['name']}: frame has {n} bytes, header says {m['nbytes']}")
    elif len(frames) != 1:
        raise TransferError(f"message: {len(frames) - 1} tensor frames on the control path, expected 0")
    return h


def valid_id(v, n: int = MAX_ID) -> bool:
    """A sender_id / receiver_id / nonce: a non-empty str of at most ``n`` characters."""
    return isinstance(v, str) and 0 < len(v) <= n


def hello_refusal(hello: dict, mine: dict) -> str | None:
    """Why decode refuses a sender's ``hello`` (protocol version, malformed fields, then
    ``handshake_mismatch`` against ``mine``, decode's handshake fields), or None to welcome it."""
    if hello.get("v") != PROTOCOL_VERSION:
        return f"protocol version differs: prefill speaks {hello.get('v')!r}, decode speaks {PROTOCOL_VERSION}"
    if not (valid_id(hello.get("sender_id")) and valid_id(hello.get("nonce"), 64)
            and isinstance(hello.get("fingerprint"), str) and isinstance(hello.get("layout"), dict)):
        return "malformed hello (sender_id, nonce, fingerprint, layout)"
    return handshake_mismatch(mine, hello, me="decode", them="prefill")


def frame_nbytes(f) -> int:
    """Byte size of a frame (bytes, memoryview, zmq.Frame or torch.Tensor)."""
    if hasattr(f, "untyped_storage"):   # torch.Tensor (dist transport accepts device tensors)
        return f.numel() * f.element_size()
    if hasattr(f, "buffer"):   # zmq.Frame
        return len(f)
    return memoryview(f).nbytes


def transfer_id_of(frame0) -> str | None:
    """Best-effort transfer id of a message's header (for reject replies); None when unparseable."""
    try:
        return decode_header(frame0)["transfer_id"]
    except Exception:
        return None


# --------------------------------------------------------------------------------------------- #
# addresses

def split_dest(dest: str, dist: bool) -> str:
    """Sender destination -> ZMQ endpoint. ``dist`` senders take ``dist+tcp://`` / ``dist+ipc://``
    (a bare ``tcp://`` / ``ipc://`` too). A ``#RECEIVER_ID`` suffix (``dest_receiver_id``) is not
    part of the endpoint. Raises ValueError for any other scheme."""
    if not isinstance(dest, str):
        raise ValueError(f"dest must be a string, found {type(dest).__name__}")
    dest = dest.partition("#")[0]
    zdest = dest[5:] if dist and dest.startswith("dist+") else dest
    if not (zdest.startswith("tcp://") or zdest.startswith("ipc://")):
        want = "dist+tcp://HOST:PORT or dist+ipc:///PATH" if dist else "tcp://HOST:PORT or ipc:///PATH"
        raise ValueError(f"dest {dest!r}: expected {want}")
    return zdest


def dest_receiver_id(dest: str) -> str | None:
    """``tcp://h:p#decode-1a2b`` -> ``decode-1a2b``: the receiver (process) a destination names. A
    sender refuses to deliver to another one at that endpoint (a restarted decode), so a transfer
    reserved on the old process can never land in the new one's slots."""
    rid = dest.partition("#")[2] if isinstance(dest, str) else ""
    return rid or None


def tcp_endpoint(host: str, port: int) -> str:
    """ZMQ bind endpoint for host/port; port 0 picks a free port. IPv6 hosts are bracketed."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{port if port else '*'}"


def default_ipc_path(port: int) -> str:
    """``$TMPDIR/dsv4-pd-PORT.sock`` for a fixed port, a unique path for port 0."""
    name = f"dsv4-pd-{port}.sock" if port else f"dsv4-pd-{os.getpid()}-{uuid.uuid4().hex[:10]}.sock"
    return os.path.join(tempfile.gettempdir(), name)


# --------------------------------------------------------------------------------------------- #
# the interface

@dataclass(frozen=True)
class Delivered:
    """One complete state message as a receiver delivers it.

    ``frames``: [header, tensor frames...], tensor frames as buffers (memoryview / bytes) of exactly
    the listed nbytes, crc32 NOT checked. ``header``: ``wire.decode_header(frames[0])``, parsed once
    by the transport's own check (``check_message``), so the decode side never parses it again.
    ``nbytes``: all frames, header included.
    """
    peer_id: str
    header: dict
    frames: list
    nbytes: int


class StateSender(ABC):
    """Prefill side: pushes state messages to decode receivers. Used from ONE thread only."""

    @abstractmethod
    def connect(self, dest: str, timeout_s: float = 10.0) -> None:
        """Handshake with the receiver at ``dest`` (idempotent per dest).

        Raises:
            TransportError: refused (the reason names the differing fingerprint / layout key /
                transport) or no welcome within ``timeout_s`` seconds.
            ValueError: ``dest`` is not an address this kind understands.
        """

    @abstractmethod
    def send(self, dest: str, frames: list) -> int:
        """Send one message (``connect`` first if needed). Returns the bytes sent (sum of frame sizes).

        Frames are sent zero-copy where the transport allows: do not modify their buffers afterwards.

        Raises:
            wire.TransferError: the message is malformed or over the receiver's announced limits
                (nothing was sent). TransportError: handshake failed or the peer is gone.
        """

    @abstractmethod
    def poll_replies(self, timeout_s: float = 0.0) -> list[tuple[str, dict]]:
        """(dest, dict) control replies from receivers, waiting up to ``timeout_s`` s for the first
        (0: non-blocking). Includes ``{"op": "transport.reject", ...}`` for messages a receiver dropped."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets (and process groups). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StateReceiver(ABC):
    """Decode side: receives complete messages on a background thread; the decode loop drains them."""

    address: str
    _notify: Callable[[], None] | None = None

    def set_notify(self, fn: Callable[[], None] | None) -> None:
        """Call ``fn()`` after each delivered message (on the receiver's thread), so a loop that
        waits on its own poller can wake at once instead of polling ``recv`` on a timer (the decode
        worker passes ``Worker.wake``). ``fn`` must be cheap, thread-safe and must not raise; None
        removes it."""
        self._notify = fn

    @abstractmethod
    def recv_messages(self, timeout_s: float = 0.0) -> list[Delivered]:
        """Complete messages in arrival order (per sender, order preserved), waiting up to
        ``timeout_s`` s for the first."""

    def recv(self, timeout_s: float = 0.0) -> list[tuple[str, list]]:
        """``recv_messages`` as (peer_id, frames) pairs, for callers that need only the bytes."""
        return [(d.peer_id, d.frames) for d in self.recv_messages(timeout_s)]

    @abstractmethod
    def reply(self, peer_id: str, msg: dict) -> None:
        """Queue a msgpack control message back to ``peer_id``. Thread-safe.

        Raises:
            TransportError: unknown peer or the receiver is closed. TypeError / ValueError: ``msg``
                is not msgpack-able / over ``max_control_bytes``.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop the receiving thread(s), release the socket / store port. Idempotent."""

    @property
    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: messages, bytes, handshakes, refused, dropped_malformed, dropped_unknown_peer,
        replies, replies_dropped, peers (and pair_failures for dist)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
