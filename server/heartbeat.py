"""ZMTP heartbeats on the gateway <-> worker control sockets (both ends set them)."""
from __future__ import annotations

import zmq


def set_heartbeat(sock: zmq.Socket, timeout_s: float) -> None:
    """ZMTP 3.1 heartbeats on ``sock`` (libzmq answers them on its I/O thread, so a worker inside a
    long engine step still answers): a peer silent for ``timeout_s`` (killed, stopped,
    unreachable) has its connection dropped, which the socket monitor reports as disconnected.
    Also the handshake's timeout (at least 2 s)."""
    ms = max(100, int(timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(ms, 6_553_500))
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(ms, 2000))
