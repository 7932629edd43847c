"""The decode side's ROUTER socket, secured and bound (``ZmqStateReceiver``).

Options, and why: CURVE + ZAP before bind (``kvtransfer.secure``; a no-op without a secret);
``ROUTER_MANDATORY`` so a reply to a gone sender fails instead of vanishing; ``ROUTER_HANDOVER``
because senders set their own routing id, and when libzmq reconnects one (a reset connection)
the new connection must take that id over even if the dead one is not yet torn down here;
``MAXMSGSIZE`` so an oversize frame is dropped by libzmq before it is buffered.
"""
from __future__ import annotations

import zmq

from kvtransfer.interfaces import default_ipc_path, tcp_endpoint
from kvtransfer.secure import secure_server


def bind_receiver(ctx: zmq.Context, kind: str, host: str, port: int, ipc_path: str | None,
                  advertise_host: str | None, keys, linger_ms: int, max_msg_bytes: int
                  ) -> tuple[zmq.Socket, str, str | None, int | None]:
    """A ROUTER on ``ctx`` bound for ``kind`` ("zmq-ipc": the unix socket ``ipc_path``, default
    ``default_ipc_path(port)``; else TCP ``host:port``, port 0 picks one).

    Returns ``(socket, address senders connect to, ipc path or None, bound TCP port or None)``;
    the address names ``advertise_host`` when given. Raises zmq.ZMQError when it cannot bind
    (the socket is closed first).
    """
    sock = ctx.socket(zmq.ROUTER)
    try:
        secure_server(sock, keys)   # before bind; starts the context's ZAP handler
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
        sock.setsockopt(zmq.LINGER, linger_ms)
        if kind == "zmq-ipc":
            path = ipc_path or default_ipc_path(port)
            sock.bind(f"ipc://{path}")
            return sock, f"ipc://{path}", path, None
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(tcp_endpoint(host, port))
        bound = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        return sock, tcp_endpoint(advertise_host or host, bound), None, bound
    except BaseException:
        sock.close(linger=0)
        raise
