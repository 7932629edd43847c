"""One attempt of one sample over the P/D path, as the gateway tracks it: the decode instance that
reserved its state, the prefill instance that computes it, and where the attempt stands.

The state is explicit (SGLang's ``KVPoll`` seen from the router): every message the workers send
about the attempt moves it forward, and the state alone decides what a lost instance means, whether
the attempt may be retried, and what must be aborted when it ends.

    RESERVING --reserved--> PREFILLING --first--> TRANSFERRING --transferred / out--> DECODING
    TRANSFERRING (token #1 was the last) or DECODING --out (done)--> FINISHED
"""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from server.backends.base import BackendError
from server.backends.instances import Instance


class LegLost(Exception):
    """An instance of the attempt died or restarted before token #1 reached the client: the sample
    may be retried under a new transfer id."""


class LostMidStream(BackendError):
    """An instance of the attempt died or restarted after token #1 reached the client: the sample
    may continue on another pair from the tokens delivered so far (a migration)."""

    def __init__(self, message: str):
        super().__init__(message, 502)


class LegState(enum.Enum):
    RESERVING = 1      # ``reserve`` sent to decode; waiting for its reservation
    PREFILLING = 2     # ``prefill`` sent with the reservation as destination; waiting for token #1
    TRANSFERRING = 3   # token #1 delivered; prefill still pushes the state to decode
    DECODING = 4       # decode holds the committed state (prefill said ``transferred``, or decode's tokens came)
    FINISHED = 5       # the last token was delivered: nothing left to abort


@dataclass
class Leg:
    """The attempt under transfer id ``rid``; counts itself in its instances' ``inflight`` / ``legs``
    while they work for it (routing and loss detection read those).

    Args:
        rid: the transfer id (the request id, or ``<id>~retry<k>``; never reused).
        decode: the decode instance asked to reserve state.
    """

    rid: str
    decode: Instance
    prefill: Instance | None = None
    state: LegState = LegState.RESERVING
    # (kind, server.protocol message) from the reader tasks, or ("lost", {"role", "addr", "why"})
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    grace_until: float | None = None    # prefill lost after token #1: decode may still get the commit until
    grace_loss: dict | None = None      # ... then this loss ends the attempt
    lease_s: float = 60.0               # decode's lease of the reservation (s) ...
    renewed_at: float = 0.0             # ... last started or renewed at (monotonic s)

    def __post_init__(self):
        self.decode.inflight += 1
        self.decode.legs.add(self.rid)

    @property
    def delivered(self) -> bool:
        """Token #1 has reached the client: a loss now ends the sample (no retry)."""
        return self.state.value >= LegState.TRANSFERRING.value

    @property
    def awaits_state(self) -> bool:
        """Decode holds a reservation whose state has not been committed yet (its lease runs)."""
        return self.state in (LegState.PREFILLING, LegState.TRANSFERRING)

    def prefill_on(self, inst: Instance) -> None:
        """RESERVING -> PREFILLING: ``inst`` computes the prompt into decode's reservation."""
        self.prefill, self.state = inst, LegState.PREFILLING
        inst.inflight += 1
        inst.legs.add(self.rid)

    def first_token(self) -> None:
        """PREFILLING -> TRANSFERRING: token #1 is about to reach the client."""
        self.prefill.inflight -= 1          # its compute is done; it holds the leg until the commit
        self.state = LegState.TRANSFERRING

    def committed(self) -> None:
        """TRANSFERRING -> DECODING: decode holds the state, prefill is free of the leg (idempotent)."""
        if self.state is LegState.TRANSFERRING:
            self.state = LegState.DECODING
            self.grace_until = self.grace_loss = None
            self.prefill.legs.discard(self.rid)

    def finished(self) -> None:
        """-> FINISHED: the last token was delivered; no instance holds the leg any more."""
        self.state = LegState.FINISHED
        self.prefill.legs.discard(self.rid)

    def lost(self, msg: dict) -> Exception:
        """The exception for a ``lost`` event (``{"role", "addr", "why"}``): LegLost (retry) before
        token #1 was delivered, LostMidStream (migrate, else 502) after."""
        what = f"{msg['role']} instance {msg['addr']} {msg['why']}"
        return LostMidStream(what + " mid-stream") if self.delivered else LegLost(what)

    def release(self) -> list[Instance]:
        """Take the leg off its instances. Returns the instances to send ``abort`` to: both (once
        each) unless the sample finished."""
        insts = [self.decode] + ([self.prefill] if self.prefill is not None else [])
        for inst in insts:
            inst.legs.discard(self.rid)
        self.decode.inflight -= 1
        if self.state is LegState.PREFILLING:
            self.prefill.inflight -= 1
        return [] if self.state is LegState.FINISHED else insts
