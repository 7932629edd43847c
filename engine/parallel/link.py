"""The leader -> follower step channel of one multi-rank instance (ZMQ, msgpack + raw tensor frames).

The leader (rank 0) binds a ROUTER; every follower connects a DEALER and says hello (its rank and
cache layout). Each step the leader sends one message to every follower: a msgpack header and
the raw bytes of the tensors it names. Nothing is pickled. Peer loss is seen by ZMTP heartbeats on
the socket's monitor (``watch``): a SIGKILLed rank's TCP connection closes at once, a stopped one
misses heartbeats for ``timeout_s``. torch.distributed carries only the model's collectives.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgpack
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)
_MAX_MSG = 1 << 40                  # a step message carries a whole imported state


class LinkError(RuntimeError):
    """A follower is missing, gone, or disagrees with the leader."""


def encode(t: torch.Tensor) -> tuple[list, bytes]:
    """A tensor as (``[dtype name, shape]``, raw bytes); any dtype (bf16 included), CPU copy."""
    t = t.detach().contiguous().cpu()
    return [str(t.dtype).removeprefix("torch."), list(t.shape)], t.view(torch.uint8).numpy().tobytes()


def decode(meta: list, buf) -> torch.Tensor:
    """Inverse of ``encode``. Raises LinkError on a size / dtype mismatch."""
    dtype, shape = getattr(torch, str(meta[0]), None), [int(s) for s in meta[1]]
    if not isinstance(dtype, torch.dtype):
        raise LinkError(f"tensor dtype {meta[0]!r} is not a torch dtype")
    n = torch.Size(shape).numel() * dtype.itemsize
    if len(buf) != n:
        raise LinkError(f"tensor frame of {len(buf)} bytes, expected {n} for {meta}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(dtype).reshape(shape)


def _heartbeat(sock: zmq.Socket, timeout_s: float) -> None:
    ivl = max(100, int(timeout_s * 1000) // 4)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout_s * 1000))


def watch(sock: zmq.Socket, ctx: zmq.Context, on_lost: Callable[[str], None], name: str,
          fds: dict[int, int] | None = None) -> threading.Thread:
    """Call ``on_lost(reason)`` (once, from a daemon thread) when a connection of ``sock`` closes;
    ``fds`` {file descriptor: rank}: only those connections count (a port scan's does not)."""
    addr = f"inproc://rank-monitor-{id(sock)}"
    sock.monitor(addr, zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)

    def run():
        mon = ctx.socket(zmq.PAIR)
        mon.connect(addr)
        try:
            while True:
                ev = recv_monitor_message(mon)
                if ev["event"] == zmq.EVENT_DISCONNECTED and fds is not None and ev["value"] not in fds:
                    continue
                if ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    # a CLOSED event's value is the listening socket's fd, not a peer's
                    who = f"rank {fds[ev['value']]}" if fds and ev["value"] in fds else repr(ev.get("endpoint", b"?"))
                    on_lost(f"{name}: the connection to {who} closed")
                    return
        except zmq.ZMQError:              # context terminated: we are shutting down
            return
        finally:
            mon.close(0)

    t = threading.Thread(target=run, name=f"{name}-monitor", daemon=True)
    t.start()
    return t


class LeaderLink:
    """Rank 0's end: bind, wait for ``world_size - 1`` hellos, then ``send`` to all of them."""

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 5.0,
                 secure: Callable[[zmq.Socket], None] | None = None):
        self.world_size, self.timeout_s = world_size, timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)        # only hellos come in
        _heartbeat(self.sock, timeout_s)
        if secure is not None:           # e.g. kvtransfer.secure.secure_server (CURVE), before bind
            secure(self.sock)
        self.sock.bind(f"tcp://{host}:{port}")
        self.peers: dict[int, bytes] = {}
        self.hellos: dict[int, dict] = {}
        self.fds: dict[int, int] = {}     # a follower's connection (file descriptor) -> its rank

    def wait_followers(self, expect: dict, startup_s: float) -> None:
        """Collect every follower's hello; each must report ``expect`` (cache layout). Raises
        LinkError naming the ranks that did not come within ``startup_s`` or that disagree."""
        end = time.monotonic() + startup_s
        while len(self.peers) < self.world_size - 1:
            left = end - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                missing = sorted(set(range(1, self.world_size)) - set(self.peers))
                raise LinkError(f"ranks {missing} did not connect within {startup_s:g} s")
            parts = self.sock.recv_multipart(copy=False)
            try:
                hello = msgpack.unpackb(parts[1].bytes) if len(parts) == 2 else None
            except ValueError:
                hello = None
            if not isinstance(hello, dict):
                log.warning("step channel: dropped a message that is not a hello")
                continue
            ident, r = parts[0].bytes, hello.get("rank")
            if not isinstance(r, int) or not 0 < r < self.world_size or r in self.peers:
                raise LinkError(f"bad hello from a follower: rank {r!r}")
            if hello.get("layout") != expect:
                raise LinkError(f"rank {r}: its layout {hello.get('layout')} differs from the leader's {expect} "
                                f"(same config, checkpoint and scheduler_config on every rank?)")
            self.peers[r], self.hellos[r] = ident, hello
            self.fds[parts[1].get(zmq.SRCFD)] = r
        for ident in self.peers.values():
            self.sock.send_multipart([ident, msgpack.packb({"op": "welcome"})])

    def send(self, header: dict, frames: list[bytes] = (), to: int | None = None) -> None:
        """One step message to every follower (``to``: only that rank). Raises LinkError if one
        is gone."""
        head = msgpack.packb(header)
        try:
            for r, ident in self.peers.items():
                if to is None or r == to:
                    self.sock.send_multipart([ident, head, *frames], copy=False)
        except zmq.ZMQError as e:
            raise LinkError(f"a follower rank is gone: {e}") from None

    def close(self, before_term: Callable[[zmq.Context], object] | None = None) -> None:
        self.sock.close(0)
        if before_term is not None:      # e.g. kvtransfer.secure.stop_authenticator
            before_term(self.ctx)
        self.ctx.term()


class FollowerLink:
    """Rank r's end: connect, hello, then ``recv`` step messages."""

    def __init__(self, host: str, port: int, rank: int, layout: dict, timeout_s: float = 5.0,
                 startup_s: float = 600.0, secure: Callable[[zmq.Socket], None] | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MSG)
        _heartbeat(self.sock, timeout_s)
        if secure is not None:           # e.g. kvtransfer.secure.secure_client (CURVE), before connect
            secure(self.sock)
        self.sock.connect(f"tcp://{host}:{port}")
        self.sock.send(msgpack.packb({"rank": rank, "layout": layout, "pid": os.getpid(),
                                      "host": socket.gethostname()}))
        if not self.sock.poll(int(startup_s * 1000)):
            raise LinkError(f"rank {rank}: no welcome from the leader at {host}:{port} within {startup_s:g} s")
        if msgpack.unpackb(self.sock.recv()).get("op") != "welcome":
            raise LinkError(f"rank {rank}: unexpected first message from the leader")

    def recv(self) -> tuple[dict, list]:
        parts = self.sock.recv_multipart(copy=False)
        return msgpack.unpackb(parts[0].bytes), [p.buffer for p in parts[1:]]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
