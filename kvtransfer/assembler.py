"""Decode side of a transfer: which transfer ids may land, when their lease ends, what has arrived.

A transfer id becomes *expected* when decode reserves state for it (before prefill computes). Only
expected ids are accepted; one that was cancelled, aborted, expired or completed is *retired* and
never accepted again (fencing: a late write for a dead id can never land in a reused slot). Layers
may arrive in any order, each once; ``commit`` is accepted only when every layer has arrived.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass
class Pending:
    """One expected transfer: ``num_tokens`` L, the layers still missing, lease deadline (monotonic s)."""

    transfer_id: str
    num_tokens: int
    num_layers: int
    deadline: float
    owner: bytes = b""                     # the gateway connection the sample's tokens go to
    received: set[int] = field(default_factory=set)
    nbytes: int = 0                        # all frames, headers included
    payload_bytes: int = 0                 # tensor bytes only (reference §4 formula)
    first_frame_time: float | None = None


@dataclass
class Action:
    """What decode must do for one message. kind: load | commit | cancel | drop | fail.

    load: write ``tensors`` of ``layer``; commit: join with ``first_token``; cancel: free quietly;
    drop: ignore the message (``cause``: fenced, unknown); fail: free, report ``cause`` / ``message``.
    """

    kind: str
    transfer_id: str
    layer: int | None = None
    tensors: dict[str, torch.Tensor] | None = None
    first_token: int | None = None
    cause: str = ""
    message: str = ""


class TransferTable:
    """Expected transfers and fencing. ``retired_capacity`` bounds the memory of retired ids."""

    def __init__(self, num_layers: int, retired_capacity: int = 1 << 20):
        self.num_layers = num_layers
        self.pending: dict[str, Pending] = {}
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._cap = retired_capacity

    def is_known(self, transfer_id: str) -> bool:
        return transfer_id in self.pending or transfer_id in self._retired

    def expect(self, transfer_id: str, num_tokens: int, lease_s: float, owner: bytes = b"") -> Pending:
        """Start accepting ``transfer_id``. Raises ValueError if the id was ever used here."""
        if self.is_known(transfer_id):
            raise ValueError(f"transfer_id {transfer_id!r} was already used (ids are never reused)")
        p = Pending(transfer_id, num_tokens, self.num_layers, time.monotonic() + lease_s, owner)
        self.pending[transfer_id] = p
        return p

    def retire(self, transfer_id: str) -> Pending | None:
        """Stop accepting ``transfer_id`` for good; returns what was pending (None if nothing)."""
        p = self.pending.pop(transfer_id, None)
        self._retired[transfer_id] = None
        while len(self._retired) > self._cap:
            self._retired.popitem(last=False)
        return p

    def expired(self, now: float | None = None) -> list[Pending]:
        """Pending transfers whose lease ran out (retired here)."""
        now = time.monotonic() if now is None else now
        dead = [p for p in self.pending.values() if p.deadline <= now]
        for p in dead:
            self.retire(p.transfer_id)
        return dead

    def on_message(self, header: dict, tensors: dict[str, torch.Tensor], nbytes: int) -> Action:
        """Classify a verified message (``wire.decode_state`` passed). Retires on commit / cancel / fail."""
        tid, kind = header["transfer_id"], header["kind"]
        p = self.pending.get(tid)
        if p is None:
            return Action("drop", tid, cause="fenced" if tid in self._retired else "unknown",
                          message=f"{kind} for a transfer id that is not expected here")
        if p.first_frame_time is None:
            p.first_frame_time = time.monotonic()
        p.nbytes += nbytes
        p.payload_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if kind == "cancel":
            self.retire(tid)
            return Action("cancel", tid, message=header["reason"])
        if header["num_tokens"] != p.num_tokens:
            self.retire(tid)
            return Action("fail", tid, cause="malformed",
                          message=f"state covers {header['num_tokens']} tokens, reserved for {p.num_tokens}")
        if kind == "layer":
            layer = header["layer"]
            if not 0 <= layer < self.num_layers or layer in p.received:
                self.retire(tid)
                return Action("fail", tid, cause="malformed", message=f"layer {layer} out of range or repeated")
            bad = [n for n in tensors if not n.startswith(f"layers.{layer}.")]
            if bad:
                self.retire(tid)
                return Action("fail", tid, cause="malformed", message=f"layer {layer} message carries {bad[0]}")
            p.received.add(layer)
            return Action("load", tid, layer=layer, tensors=tensors)
        if kind == "state":
            if p.received:
                self.retire(tid)
                return Action("fail", tid, cause="malformed", message="whole state after per-layer messages")
            p.received = set(range(self.num_layers))
            return Action("load", tid, tensors=tensors, first_token=header["first_token"])
        # commit
        missing = sorted(set(range(self.num_layers)) - p.received)
        if missing or header["num_layers"] != self.num_layers:
            self.retire(tid)
            return Action("fail", tid, cause="malformed", message=f"commit with layers {missing[:4]} missing")
        self.retire(tid)
        return Action("commit", tid, first_token=header["first_token"])
