"""Decode side of a transfer: each delivered message is fenced, verified and classified here, once.

A transfer id becomes *expected* when decode reserves state for it (before prefill computes). Only
expected ids are accepted; one that was cancelled, aborted, expired or completed is *retired* and
never accepted again (fencing: a late write for a dead id can never land in a reused slot), and
its sender gets a ``nack``. Layers may arrive in any order, each once; ``commit`` is accepted only
when every layer has arrived, and carries no tensors but the MTP state (``mtp.*``, with
``draft_ids``: ``kvtransfer.wire``). The header is the one the transport parsed (``Delivered.header``);
tensors are checked (fingerprint, sizes, crc32) only for an expected id.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from kvtransfer.interfaces import Delivered, StateReceiver, ack_message, nack_message
from kvtransfer.wire import TransferError, decode_tensors


@dataclass
class Pending:
    """One expected transfer: ``num_tokens`` L, the layers still missing, lease deadline (monotonic s)."""

    transfer_id: str
    num_tokens: int
    num_layers: int
    deadline: float
    owner: bytes = b""                     # the gateway connection the sample's tokens go to
    lease_s: float = 0.0                   # how far a renewal pushes ``deadline`` (s)
    received: set[int] = field(default_factory=set)
    nbytes: int = 0                        # all frames, headers included
    payload_bytes: int = 0                 # tensor bytes only (reference §4 formula)
    first_frame_time: float | None = None
    reserved_at: float = field(default_factory=time.monotonic)


@dataclass
class Action:
    """What decode must do for one message. kind: load | commit | cancel | drop | fail.

    load: write ``tensors`` of ``layer`` (None: the whole state, then commit with ``first_token``);
    commit: write ``tensors`` (the MTP state ``mtp.*``; None without MTP), then join with
    ``first_token``. Both joins pass ``draft_ids`` (MTP drafts after token #1, [] without).
    cancel: free quietly; drop: ignore the message (``cause``: fenced, unknown, or "" for a cancel
    of a retired id; the sender was told); fail: free, report ``cause`` / ``message``. The id is
    retired already for every kind but load of one layer. ``peer``: the sender to ack / nack;
    ``pending``: the transfer's record (None for drop).
    """

    kind: str
    transfer_id: str
    layer: int | None = None
    tensors: dict[str, torch.Tensor] | None = None
    first_token: int | None = None
    draft_ids: list[int] = field(default_factory=list)
    cause: str = ""
    message: str = ""
    peer: str = ""
    pending: Pending | None = None


class TransferReceiver:
    """Expected transfers, fencing and classification over one ``StateReceiver`` (decode loop only).

    Args:
        transport: where messages arrive and replies go.
        fingerprint: ``wire.model_fingerprint`` of this decode's model (others fail verification).
        num_layers: layers a transfer must carry before its commit.
        where: names this side in a nack for an unknown id ("decode instance 3f2a").
        retired_capacity: how many retired ids are remembered (oldest forgotten first).
    """

    def __init__(self, transport: StateReceiver, fingerprint: str, num_layers: int, where: str = "decode",
                 retired_capacity: int = 1 << 20):
        self.transport, self.fingerprint, self.num_layers, self.where = transport, fingerprint, num_layers, where
        self.pending: dict[str, Pending] = {}
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._cap = retired_capacity

    # ---- fencing -----------------------------------------------------------------------------
    def is_known(self, transfer_id: str) -> bool:
        return transfer_id in self.pending or transfer_id in self._retired

    def expect(self, transfer_id: str, num_tokens: int, lease_s: float, owner: bytes = b"") -> Pending:
        """Start accepting ``transfer_id`` for ``lease_s`` seconds. Raises ValueError if the id was ever used here."""
        if self.is_known(transfer_id):
            raise ValueError(f"transfer_id {transfer_id!r} was already used (ids are never reused)")
        p = Pending(transfer_id, num_tokens, self.num_layers, time.monotonic() + lease_s, owner, lease_s)
        self.pending[transfer_id] = p
        return p

    def renew(self, transfer_id: str, owner: bytes) -> bool:
        """Push the lease of ``transfer_id`` to now + its lease, if it is pending for ``owner``.
        Returns whether it was (a renewal for a retired id, or from another connection, does nothing)."""
        p = self.pending.get(transfer_id)
        if p is None or p.owner != owner:
            return False
        p.deadline = max(p.deadline, time.monotonic() + p.lease_s)
        return True

    def retire(self, transfer_id: str) -> Pending | None:
        """Stop accepting ``transfer_id`` for good (idempotent); returns what was pending (None if nothing)."""
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

    # ---- messages ----------------------------------------------------------------------------
    def poll(self) -> list[Action]:
        """Take every message delivered so far (non-blocking), in arrival order."""
        return [self.take(d) for d in self.transport.recv_messages(0.0)]

    def take(self, d: Delivered) -> Action:
        """Fence ``d`` on its transfer id (nack to its sender), verify its tensors, classify it."""
        h = d.header
        tid = h["transfer_id"]
        p = self.pending.get(tid)
        if p is None:
            if h["kind"] == "cancel":            # a cancel after an abort is expected
                return Action("drop", tid, peer=d.peer_id)
            cause = "fenced" if tid in self._retired else "unknown"
            why = ("retired (aborted, expired or done): fenced" if cause == "fenced" else
                   f"not reserved on {self.where} (restarted?)")
            self.nack(d.peer_id, tid, cause, f"transfer {tid} is {why}")
            return Action("drop", tid, cause=cause, message=why, peer=d.peer_id)
        try:
            tensors = decode_tensors(h, d.frames, self.fingerprint)
        except TransferError as e:
            self.retire(tid)
            return Action("fail", tid, cause="checksum" if "checksum" in str(e) else "malformed", message=str(e),
                          peer=d.peer_id, pending=p)
        act = self._classify(p, h, tensors, d.nbytes)
        act.peer, act.pending = d.peer_id, p
        return act

    def ack(self, peer: str, transfer_id: str, nbytes: int) -> None:
        """Tell ``peer`` its transfer is committed (``nbytes``: all its frames)."""
        self.transport.reply(peer, ack_message(transfer_id, nbytes))

    def nack(self, peer: str, transfer_id: str, cause: str, reason: str) -> None:
        """Tell ``peer`` its transfer failed (``cause`` as in ``interfaces.nack_message``)."""
        self.transport.reply(peer, nack_message(transfer_id, cause, reason))

    def _classify(self, p: Pending, header: dict, tensors: dict[str, torch.Tensor], nbytes: int) -> Action:
        """A verified message of the expected transfer ``p``. Retires on commit / state / cancel / fail."""
        tid, kind = p.transfer_id, header["kind"]
        if p.first_frame_time is None:
            p.first_frame_time = time.monotonic()
        p.nbytes += nbytes
        p.payload_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if kind == "cancel":
            self.retire(tid)
            return Action("cancel", tid, message=header["reason"])
        if header["num_tokens"] != p.num_tokens:
            return self._fail(tid, f"state covers {header['num_tokens']} tokens, reserved for {p.num_tokens}")
        if kind == "layer":
            layer = header["layer"]
            if not 0 <= layer < self.num_layers or layer in p.received:
                return self._fail(tid, f"layer {layer} out of range or repeated")
            bad = [n for n in tensors if not n.startswith(f"layers.{layer}.")]
            if bad:
                return self._fail(tid, f"layer {layer} message carries {bad[0]}")
            p.received.add(layer)
            return Action("load", tid, layer=layer, tensors=tensors)
        if kind == "state":
            if p.received:
                return self._fail(tid, "whole state after per-layer messages")
            p.received = set(range(self.num_layers))
            self.retire(tid)                     # complete: nothing more may land for it
            return Action("load", tid, tensors=tensors, first_token=header["first_token"],
                          draft_ids=header.get("draft_ids", []))
        # commit
        missing = sorted(set(range(self.num_layers)) - p.received)
        self.retire(tid)
        if missing or header["num_layers"] != self.num_layers:
            return Action("fail", tid, cause="malformed", message=f"commit with layers {missing[:4]} missing")
        bad = [n for n in tensors if not n.startswith("mtp.")]
        if bad:
            return Action("fail", tid, cause="malformed", message=f"commit carries {bad[0]} (only mtp.* may)")
        return Action("commit", tid, tensors=tensors or None, first_token=header["first_token"],
                      draft_ids=header.get("draft_ids", []))

    def _fail(self, tid: str, message: str) -> Action:
        self.retire(tid)
        return Action("fail", tid, cause="malformed", message=message)
