"""The worker instances the P/D backend routes to: their addresses and what the gateway knows of each
(connection, readiness and load from its last ``pong``, the legs it holds)."""
from __future__ import annotations

from dataclasses import dataclass, field

import zmq.asyncio


def parse_addrs(value: str | list[str] | None, default_port: int) -> list[str]:
    """``"h1 h2:5600,h3"`` -> ``["h1:<default_port>", "h2:5600", "h3:<default_port>"]``.
    Raises ValueError naming a bad entry."""
    if value is None:
        return []
    items = value if isinstance(value, list) else value.replace(",", " ").split()
    out = []
    for it in items:
        host, _, port = it.strip().rpartition(":") if ":" in it else (it.strip(), "", str(default_port))
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"instance address {it!r}: expected host or host:port")
        out.append(f"{host}:{int(port)}")
    return out


@dataclass
class Instance:
    """One worker instance as the gateway sees it."""

    role: str
    addr: str
    sock: zmq.asyncio.Socket
    load: dict = field(default_factory=dict)
    unanswered: int = 1 << 30         # pings sent since its last message (counted by the pinger, so a
    inflight: int = 0                 # busy gateway loop cannot make a live instance look stale)
    connected: bool = False           # ZMTP handshake done and heartbeats answered
    instance_id: str | None = None    # of the process behind addr (a new one: it restarted)
    legs: set[str] = field(default_factory=set)     # transfer ids with a leg here
    pending_aborts: dict[str, None] = field(default_factory=dict)   # to send when it reconnects (ordered)

    def healthy(self, max_unanswered: int) -> bool:
        return self.connected and bool(self.load.get("ready")) and self.unanswered <= max_unanswered

    def score(self) -> float:
        ld = self.load
        if self.role == "decode":
            busy = ld.get("running", 0) + ld.get("reserved", 0) + ld.get("queued", 0) + self.inflight
            return busy / max(1, ld.get("batch_size", 1)) + ld.get("kv_usage", 0.0)
        return self.inflight + ld.get("waiting", 0)
