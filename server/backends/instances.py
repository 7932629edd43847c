"""The worker instances the P/D backend routes to: their addresses and what the gateway knows of each
(connection, readiness and load from its last ``pong``, the legs it holds), and which pairs of them
may serve a sample together.

Pairing: every pong carries the worker's ``handshake`` fields (transport, model fingerprint, state
layout with kv dtype, config and weights digests); a prefill and a decode instance pair only when
``kvtransfer.compat.handshake_mismatch`` -- the rule the transfer handshake itself applies -- finds
no difference. A sample goes only to a decode instance some healthy prefill pairs with, so a
mismatched pair is found here, before any prefill, not by a refused transfer after one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import zmq.asyncio

from kvtransfer.compat import mismatch_cause
from kvtransfer.compat import pair_mismatch as _fields_mismatch
from server.backends.base import BackendError


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


def pair_mismatch(pre: Instance, dec: Instance) -> str | None:
    """Why ``pre`` must not push state to ``dec`` (the handshake's rule on the fields of their last
    pongs, worded as decode's side of the handshake words it); None when they pair or a side has
    not answered yet. A unified worker (``server.workers.unified``: prefill and decode in one
    engine) pairs with itself only: the same address under both roles."""
    unified = [i.addr for i in (pre, dec) if i.load.get("role") == "unified"]
    if unified:
        if pre.addr == dec.addr and len(unified) == 2:
            return None
        return (f"unified worker {unified[0]} prefills and decodes its own samples (it pairs only with "
                "itself: list its address in both PREFILL_IPS and DECODE_IPS)")
    return _fields_mismatch(pre.load.get("handshake"), dec.load.get("handshake"))


def _healthy(instances: list[Instance], role: str, max_unanswered: int) -> list[Instance]:
    return [i for i in instances if i.role == role and i.healthy(max_unanswered)]


def pick_pair(instances: list[Instance], max_unanswered: int) -> Instance:
    """The least-loaded healthy decode instance that some healthy prefill instance pairs with (that
    prefill is chosen once the state has a place). Raises BackendError 503 naming why there is
    none: no healthy decode / prefill, or no compatible pair (the first pair's difference)."""
    pres, decs = _healthy(instances, "prefill", max_unanswered), _healthy(instances, "decode", max_unanswered)
    if not decs or not pres:
        raise BackendError("no healthy " + ("decode" if not decs else "prefill") + " instance", 503)
    ok = [d for d in decs if any(pair_mismatch(p, d) is None for p in pres)]
    if not ok:
        more = len(pres) * len(decs) - 1
        raise BackendError(f"no compatible prefill/decode pair: prefill {pres[0].addr} -> decode {decs[0].addr}: "
                           f"{pair_mismatch(pres[0], decs[0])}" + (f" (and {more} more pairs)" if more else ""), 503)
    return min(ok, key=Instance.score)


def incompatible_pairs(instances: list[Instance], max_unanswered: int) -> list[dict]:
    """The healthy (prefill, decode) pairs that must not exchange state, never chosen: [{"prefill",
    "decode" (addresses), "cause" (one of ``kvtransfer.compat.CAUSES``), "reason"}]."""
    out = []
    for p in _healthy(instances, "prefill", max_unanswered):
        for d in _healthy(instances, "decode", max_unanswered):
            reason = pair_mismatch(p, d)
            if reason is not None:
                out.append({"prefill": p.addr, "decode": d.addr, "reason": reason,
                            "cause": mismatch_cause(d.load["handshake"], p.load["handshake"]) or "layout"})
    return out
