"""The gateway <-> worker control protocol: one dataclass per message (``Kind`` names them), each a
msgpack map of plain types on the wire (never pickle) in one ZMQ frame of at most
``MAX_MESSAGE_BYTES``: ``"op"`` (the kind), then the fields in the order the class declares them,
those in ``OPTIONAL`` only when set. Torch-free: the gateway process imports it.

    gateway -> any:      ping -> pong (the load report; during a long step with ``step_s``)
    gateway -> decode:   reserve -> reserved | error;  renew (leases restart);  abort
    gateway -> prefill:  prefill -> first (token #1), then transferred | error;  abort
    decode -> gateway:   out (once per step: each sample's new tokens);  error
    worker -> gateway:   probe (is the connection still there? ignored)

Workers check what the gateway sends (``from_map``: ``MessageError`` naming the field, or
``SamplingError`` for a sampling value out of range); the gateway reads what workers send with the
defaults its classes declare (``read``), so a field it can do without never fails a sample.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import ClassVar

from engine.core.sampling_params import SamplingParams
from server.protocol_fields import (MessageError, check_deadline, check_ids, check_rid, pack, params_from_dict,
                                    params_to_dict)

class Kind(enum.StrEnum):
    """The ``"op"`` of each message."""

    PING, RESERVE, RENEW, PREFILL, ABORT = "ping", "reserve", "renew", "prefill", "abort"      # gateway -> worker
    PONG, RESERVED, FIRST, TRANSFERRED = "pong", "reserved", "first", "transferred"           # worker -> gateway
    OUT, ERROR, PROBE = "out", "error", "probe"


def kind_of(msg: dict) -> Kind | None:
    """The kind of an unpacked map; None for an op this protocol does not have."""
    try:
        return Kind(msg["op"])
    except ValueError:
        return None


class Message:
    """Base of the message classes: ``to_map()`` is the wire map, ``pack()`` its frame."""

    KIND: ClassVar[Kind]
    OPTIONAL: ClassVar[tuple[str, ...]] = ()      # keys left off the wire while unset (None, False, [])

    def to_map(self) -> dict:
        """``{"op": kind, field: value, ...}``, in declaration order (``__init__`` sets them so)."""
        m = {"op": self.KIND.value}
        for k, v in vars(self).items():
            if k in self.OPTIONAL and (v is None or v is False or v == []):
                continue
            m[k] = params_to_dict(v) if isinstance(v, SamplingParams) else v
        return m

    def pack(self) -> bytes:
        return pack(self.to_map())


# ---- gateway -> worker ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ping(Message):
    """Asks for the worker's load report (``Pong``)."""

    KIND: ClassVar[Kind] = Kind.PING


@dataclass(frozen=True, kw_only=True)
class Reserve(Message):
    """Decode: reserve state slots and a batch place for a sample (or queue it until there is room).
    rid: the transfer id (one per sample and attempt, never reused). prompt_ids: token ids. params:
    sampling settings. output_ids: tokens a migrated stream already delivered (its decode was
    lost; decode continues after prompt + these). lease_s: seconds the reservation waits for its
    state without word from the gateway, in (0, 3600] (None: the worker's; it keeps the shorter).
    deadline_s: seconds the sample may still run, in (0, 1e7] (then ``error`` 504; None: none)."""

    KIND: ClassVar[Kind] = Kind.RESERVE
    OPTIONAL: ClassVar[tuple[str, ...]] = ("output_ids", "lease_s", "deadline_s")
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    lease_s: float | None = None
    deadline_s: float | None = None

    @classmethod
    def from_map(cls, m: dict) -> Reserve:
        """Raises MessageError naming the field, or SamplingError (a sampling value out of range)."""
        rid, prompt, outs = _sample_fields(m)
        lease = None
        if "lease_s" in m:
            lease = m["lease_s"]
            if not isinstance(lease, (int, float)) or not 0 < lease <= 3600:
                raise MessageError("lease_s: expected seconds in (0, 3600]")
            lease = float(lease)
        deadline_s = check_deadline(m)
        return cls(rid=rid, prompt_ids=prompt, params=params_from_dict(m.get("params")), output_ids=outs,
                   lease_s=lease, deadline_s=deadline_s)


@dataclass(frozen=True, kw_only=True)
class Prefill(Message):
    """Prefill: compute a sample's prompt, answer token #1 (``First``) and push the state to decode.
    rid, prompt_ids, params, output_ids, deadline_s: as ``Reserve`` (prefill computes prompt +
    output_ids and samples one token after them). dest: the reservation's ``Reserved.state_addr``."""

    KIND: ClassVar[Kind] = Kind.PREFILL
    OPTIONAL: ClassVar[tuple[str, ...]] = ("output_ids", "deadline_s")
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    dest: str
    deadline_s: float | None = None

    @classmethod
    def from_map(cls, m: dict) -> Prefill:
        """Raises MessageError naming the field, or SamplingError (a sampling value out of range)."""
        rid, prompt, outs = _sample_fields(m)
        dest = m.get("dest")
        if not isinstance(dest, str) or not dest:
            raise MessageError("dest: expected the decode reservation's state address")
        deadline_s = check_deadline(m)
        return cls(rid=rid, prompt_ids=prompt, params=params_from_dict(m.get("params")), output_ids=outs,
                   dest=dest, deadline_s=deadline_s)


def _sample_fields(m: dict) -> tuple[str, list[int], list[int]]:
    """rid, prompt_ids, output_ids ([] when absent) of a reserve / prefill. Raises MessageError."""
    outs = m.get("output_ids", [])
    return check_rid(m), check_ids(m.get("prompt_ids"), "prompt_ids"), check_ids(outs, "output_ids")


@dataclass(frozen=True)
class Renew(Message):
    """Decode: the gateway still waits for these reservations' state (prefill queued or
    computing), so each lease restarts. rids: transfer ids (at most 65536). ``from_map`` raises
    MessageError (rids)."""

    KIND: ClassVar[Kind] = Kind.RENEW
    rids: list[str]

    @classmethod
    def from_map(cls, m: dict) -> Renew:
        rids = m.get("rids")
        if not isinstance(rids, list) or len(rids) > 1 << 16 or not all(isinstance(r, str) for r in rids):
            raise MessageError("rids: expected a list of transfer ids")
        return cls(rids)


@dataclass(frozen=True)
class Abort(Message):
    """Abort sample ``rid`` (a transfer id) and free what it holds; an unknown one is ignored.
    ``from_map`` raises MessageError (rid)."""

    KIND: ClassVar[Kind] = Kind.ABORT
    rid: str

    @classmethod
    def from_map(cls, m: dict) -> Abort:
        return cls(check_rid(m))


# ---- worker -> gateway ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """A worker's load report (the ``/ready`` body: the same fields); the gateway routes by it.
    role: "prefill" | "decode". instance_id: the worker process's (a new one: it restarted).
    ready: takes new samples. running / waiting / reserved: samples in the running batch, in the
    waiting queue, and reservations awaiting state; batch_size: the running batch's limit.
    kv_usage: the fullest state pool's used fraction in [0, 1]. free_blocks / total_blocks: blocks
    per pool name. max_model_len: tokens. prefix_caching: the prefix cache is on. fingerprint /
    handshake: what the transfer handshake states (``kvtransfer.compat``). Decode only: state_addr
    (its state receiver), queued (samples waiting for a reservation); prefill only: queued_tokens
    (prompt tokens waiting). step_s: answered during an engine step that has run this long (s).
    The gateway keeps a pong as its map (``Instance.load``) and reads its fields with defaults."""

    KIND: ClassVar[Kind] = Kind.PONG
    OPTIONAL: ClassVar[tuple[str, ...]] = ("state_addr", "queued", "queued_tokens", "step_s")
    role: str
    instance_id: str
    ready: bool
    running: int
    waiting: int
    reserved: int
    batch_size: int
    kv_usage: float
    free_blocks: dict[str, int]
    total_blocks: dict[str, int]
    max_model_len: int
    prefix_caching: bool
    fingerprint: str
    handshake: dict
    state_addr: str | None = None
    queued: int | None = None
    queued_tokens: int | None = None
    step_s: float | None = None

    def report(self) -> dict:
        """The fields that are set, without ``op``, in wire order: the ``/ready`` body."""
        m = self.to_map()
        del m["op"]
        return m


@dataclass(frozen=True, kw_only=True)
class Reserved(Message):
    """Decode reserved sample ``rid``'s state. state_addr: where prefill pushes it (``Prefill.dest``);
    instance_id: the decode worker's; lease_s: the lease it keeps (s; the shorter of both sides')."""

    KIND: ClassVar[Kind] = Kind.RESERVED
    rid: str
    state_addr: str
    instance_id: str | None = None
    lease_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class First(Message):
    """Prefill's token #1 of sample ``rid``: id (token id), lps (``pack_sampled`` of it, None
    unless logprobs were asked for), done (it ends the sample), reason (the finish reason, None
    unless done), queue_s (seconds it waited for prefill; None: unknown), cached (prompt tokens
    the prefix cache served)."""

    KIND: ClassVar[Kind] = Kind.FIRST
    rid: str
    id: int
    lps: list | None = None
    done: bool
    reason: str | None = None
    queue_s: float | None = None
    cached: int = 0


@dataclass(frozen=True, kw_only=True)
class Transferred(Message):
    """Prefill: decode acknowledged sample ``rid``'s state: bytes (sent), seconds (commit to ack)."""

    KIND: ClassVar[Kind] = Kind.TRANSFERRED
    rid: str
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, kw_only=True)
class OutItem:
    """One sample's tokens of one decode step: ids (new token ids), lps (``pack_sampled``, None
    unless logprobs were asked for), done (the sample ended), reason (finish reason, None unless done)."""

    rid: str
    ids: list[int] = field(default_factory=list)
    lps: list | None = None
    done: bool = False
    reason: str | None = None

    def to_map(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class Out(Message):
    """Decode: one step's tokens, for the samples of one gateway connection."""

    KIND: ClassVar[Kind] = Kind.OUT
    items: list[OutItem]

    def to_map(self) -> dict:
        return {"op": self.KIND.value, "items": [i.to_map() for i in self.items]}

    @classmethod
    def read(cls, m: dict) -> Out:
        """Gateway side: items that are not maps with a string rid are skipped."""
        items = m.get("items")
        return cls([read(OutItem, i) for i in (items if isinstance(items, list) else [])
                    if isinstance(i, dict) and isinstance(i.get("rid"), str)])


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    """A sample's leg failed on the worker. rid: its transfer id (None: the request named none);
    status: the HTTP status it means (400 bad request, 429 decode full, 502 a failure, 503
    draining, 504 a deadline or lease); retry: refused before any work (draining), so the gateway
    may go to another instance; message: why, naming the field for bad input."""

    KIND: ClassVar[Kind] = Kind.ERROR
    OPTIONAL: ClassVar[tuple[str, ...]] = ("retry",)
    rid: str | None = None
    status: int = 502
    retry: bool = False
    message: str | None = None


@dataclass(frozen=True)
class Probe(Message):
    """A worker's check that a gateway connection still takes replies (a gone one fails at once);
    the gateway ignores it."""

    KIND: ClassVar[Kind] = Kind.PROBE


def read(cls: type, m: dict):
    """Gateway side: a ``cls`` (a worker reply) from map ``m``, absent fields at their defaults and
    values as sent (a worker is the cluster's own peer; the gateway checks what it relies on).
    Raises MessageError naming a field without a default that ``m`` lacks."""
    kw = {}
    for name, required in _fields_of(cls):
        if name in m:
            kw[name] = m[name]
        elif required:
            raise MessageError(f"{name}: missing")
    return cls(**kw)


@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, bool], ...]:
    return tuple((f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


# the replies about a sample that the gateway reads with ``read`` (``out``: ``Out.read``)
REPLIES: dict[Kind, type] = {Kind.RESERVED: Reserved, Kind.FIRST: First, Kind.TRANSFERRED: Transferred,
                             Kind.ERROR: Error}
