"""Moving a request's decode state from a prefill worker to a decode worker.

``make_sender`` / ``make_receiver`` pick a transport by name and import only its module, so
importing ``kvtransfer`` (or its torch-free parts, e.g. ``kvtransfer.secure``) loads neither
torch nor a transport. The interfaces and control messages are in ``kvtransfer.interfaces``.
"""
from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtransfer.interfaces import StateReceiver, StateSender

KINDS = ("zmq-tcp", "zmq-ipc", "dist")


def make_receiver(kind: str, host: str = "127.0.0.1", port: int = 0, fingerprint: str = "",
                  layout: dict | None = None, secret=None, **kw) -> StateReceiver:
    """Bind a receiver of ``kind`` ("zmq-tcp" | "zmq-ipc" | "dist") on ``host``:``port`` (0: a free
    port). ``secret``: the cluster shared secret (str / bytes of >= 16 characters, or
    ``secure.ClusterKeys``) -> CURVE server accepting only senders with the same secret; None:
    plain ZMQ. Keyword arguments: ``receiver_id``, ``ipc_path`` (zmq-ipc, or dist over ipc),
    ``advertise_host``, ``linger_ms``, the ``Limits`` fields, and for dist ``store_port``,
    ``device``, ``op_timeout_s``, ``rendezvous_timeout_s``, ``coalesce_bytes``, ``deliver``.

    Raises:
        ValueError: unknown kind, or an empty / too short secret. zmq.ZMQError / OSError: the
            address (or store port) cannot be bound.
    """
    layout = {} if layout is None else layout
    if kind in ("zmq-tcp", "zmq-ipc"):
        from kvtransfer.transports.zmq_receiver import ZmqStateReceiver
        return ZmqStateReceiver(kind, host, port, fingerprint, layout, secret=secret, **kw)
    if kind == "dist":
        from kvtransfer.transports.dist import dist_receiver
        return dist_receiver(host, port, fingerprint, layout, secret=secret, **kw)
    raise ValueError(f"transport kind must be one of {KINDS}, found {kind!r}")


def make_sender(kind: str, fingerprint: str, layout: dict | None = None, sender_id: str = "", secret=None,
                **kw) -> StateSender:
    """A sender of ``kind``. "zmq-tcp" and "zmq-ipc" are the same sender (the dest address says
    which). ``secret``: the cluster shared secret (as for ``make_receiver``; must equal the
    receiver's) -> CURVE client; None: plain ZMQ. Keyword arguments: ``send_timeout_s``,
    ``linger_ms``, ``max_control_bytes``, and for dist ``device``, ``op_timeout_s``, ``local_host``.

    Raises:
        ValueError: unknown kind, or an empty / too short secret.
    """
    layout = {} if layout is None else layout
    sender_id = sender_id or f"prefill-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if kind in ("zmq-tcp", "zmq-ipc"):
        from kvtransfer.transports.zmq_sender import ZmqStateSender
        return ZmqStateSender(fingerprint, layout, sender_id, secret=secret, **kw)
    if kind == "dist":
        from kvtransfer.transports.dist import dist_sender
        return dist_sender(fingerprint, layout, sender_id, secret=secret, **kw)
    raise ValueError(f"transport kind must be one of {KINDS}, found {kind!r}")


def handshake_fields(kind: str, fingerprint: str, layout: dict | None = None, device: str | None = None) -> dict:
    """What a sender / receiver of ``kind`` made with this fingerprint and layout states in its hello /
    welcome: the fields ``kvtransfer.compat.handshake_mismatch`` compares ("transport",
    "fingerprint", "layout", and "backend" for dist, from ``device``: "cpu" gloo, "cuda" nccl,
    "npu" hccl). Workers put it in their pong so the gateway pairs only instances that would agree.

    Raises:
        ValueError: unknown kind, or (dist) a device without a backend.
    """
    from kvtransfer.interfaces import normalize_layout
    layout = normalize_layout({} if layout is None else layout)
    if kind in ("zmq-tcp", "zmq-ipc"):
        from kvtransfer.transports.plane import SenderPlane
        return {"transport": SenderPlane.transport, "fingerprint": fingerprint, "layout": layout}
    if kind == "dist":
        from kvtransfer.transports.dist import DistSenderPlane
        from kvtransfer.transports.dist_groups import backend_for
        return {"transport": DistSenderPlane.transport, "fingerprint": fingerprint, "layout": layout,
                "backend": backend_for(device or "cpu")}
    raise ValueError(f"transport kind must be one of {KINDS}, found {kind!r}")
