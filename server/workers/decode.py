"""The decode worker: reserves state for a sample before its prefill runs, takes the state as it
arrives (verified, fenced), then decodes it in the running batch and streams token ids.

``reserve`` takes the state slots and a batch place under a lease (``lease_s``), or queues the
sample (FIFO, at most ``max_queued``; beyond that 429) until running samples make room. The gateway
renews the leases of the reservations it still waits on (``renew``, every third of a lease), so a
prefill queued or computing for minutes keeps its reservation; if a lease runs out (no word from
the gateway, no commit) the reservation is freed and the transfer id is fenced, so a late write
never lands. Every message is checked (``kvtransfer.receiver``: fingerprint, sizes, crc32) before
a byte is written; a bad one fails the sample (``error`` to the gateway, ``nack`` to prefill).
With MTP (next_n > 0) the commit brings the MTP window rows, loaded before the sample joins the
batch, and the drafts its first verify step checks.
"""
from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass

from engine.core.block_manager import CacheFullError
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.core.request import RequestOutput
from kvtransfer import make_receiver
from kvtransfer.receiver import Action, TransferReceiver
from server.protocol import Error, Kind, Out, OutItem, Renew, Reserve, Reserved, kind_of
from server.protocol_fields import MessageError, check_rid, pack_sampled
from server.workers.base import Worker, WorkerOptions

log = logging.getLogger(__name__)


class SampleState(enum.Enum):
    QUEUED = 1       # waiting (FIFO) for state slots and a batch place
    RESERVED = 2     # slots reserved; the state is on its way (its lease runs in ``table``)
    RUNNING = 3      # committed: in the running batch


@dataclass(eq=False)
class DecodeSample:
    """One sample held here, from ``reserve`` until it finishes, fails or is aborted.

    rid: its transfer id. owner: the gateway connection (ROUTER identity) its replies go to.
    prompt_ids / output_ids: token ids (output_ids: what a migrated stream already delivered).
    params: its sampling settings. lease_s: the reservation's lease (s). arrival: when ``reserve``
    came (monotonic s; its queue time runs from there). state: where it stands.
    """

    rid: str
    owner: bytes
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    lease_s: float
    arrival: float
    state: SampleState = SampleState.QUEUED

    @property
    def want_logprobs(self) -> bool:
        return self.params.logprobs is not None

    @property
    def num_before(self) -> int:
        """Output tokens made before decode: ``output_ids`` and token #1 from prefill."""
        return len(self.output_ids) + 1


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, engine: LLMEngine, opts: WorkerOptions):
        super().__init__(engine, opts)
        # dist: the engine's device picks the data plane (cpu gloo, cuda nccl, npu hccl)
        dist = {"device": str(engine.model.embed.weight.device)} if opts.transport == "dist" else {}
        self.receiver = make_receiver(opts.transport, opts.host, opts.state_port, self.fingerprint, self.layout,
                                      advertise_host=opts.advertise_host or opts.host, secret=opts.cluster_secret,
                                      receiver_id=f"decode-{self.instance_id}", **dist)
        self.state_addr = f"{self.receiver.address}#{self.receiver.receiver_id}"   # this process only
        self.receiver.set_notify(self.wake)      # a state message wakes the loop (no polling timer)
        self.table = TransferReceiver(self.receiver, self.fingerprint, len(engine.model.layers),
                                      f"decode instance {self.instance_id}")
        self.samples: dict[str, DecodeSample] = {}        # rid -> the sample, queued, reserved or running
        self.queue: deque[DecodeSample] = deque()         # the queued ones, oldest first
        self.transfers: OrderedDict[str, dict] = OrderedDict()   # last 1024 committed: bytes, seconds

    @property
    def owners(self) -> dict[str, bytes]:
        """rid -> gateway connection of every sample held here."""
        return {rid: s.owner for rid, s in self.samples.items()}

    def extra_load(self) -> dict:
        return {"state_addr": self.state_addr, "queued": len(self.queue)}

    def num_queued(self) -> int:
        return len(self.queue)

    def next_timer(self) -> float | None:
        """The earliest lease end of a reservation whose state has not been committed."""
        return min((p.deadline for p in self.table.pending.values()), default=None)

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        kind = kind_of(msg)
        if kind is Kind.RENEW:
            self._renew(identity, Renew.from_map(msg))
            return
        rid = check_rid(msg)
        if kind is Kind.RESERVE:
            if self.draining:
                self.reply(identity, Error(rid=rid, status=503, retry=True,
                                           message="decode worker is draining (shutting down)"))
                return
            self._reserve(identity, msg)
        elif kind is Kind.ABORT:
            self._abort(rid)
        else:
            raise MessageError(f"op: {msg['op']!r} is not a decode operation")

    def _reserve(self, identity: bytes, msg: dict) -> None:
        rid = msg["rid"]
        try:
            req = Reserve.from_map(msg)          # MessageError: answered 400 by ``Worker._handle_frames``
            if self.table.is_known(rid) or rid in self.samples:
                raise RequestError(f"rid: {rid!r} was already used (transfer ids are never reused)")
            # the shorter of the gateway's lease and this worker's
            lease = self.opts.lease_s if req.lease_s is None else min(req.lease_s, self.opts.lease_s)
            sample = DecodeSample(rid, identity, req.prompt_ids, req.output_ids, req.params, float(lease),
                                  time.monotonic())
            if self.queue:                             # FIFO: nobody overtakes the queue
                raise CacheFullError("queue not empty")
            self.engine.pd.reserve(rid, sample.prompt_ids, sample.params, sample.output_ids)
        except (RequestError, SamplingError) as e:
            self.reply(identity, Error(rid=rid, status=400, message=str(e)))
            return
        except CacheFullError as e:
            if len(self.queue) >= self.opts.max_queued:
                self.reply(identity, Error(rid=rid, status=429,
                                           message=f"decode is full and {len(self.queue)} samples wait: {e}"))
            else:
                self.samples[rid] = sample
                self.queue.append(sample)
                self.track_deadline(rid, req.deadline_s)
            return
        self.track_deadline(rid, req.deadline_s)
        self.metrics.queue.observe(0.0)
        self._reserved(sample)

    def _renew(self, identity: bytes, msg: Renew) -> None:
        """The gateway still waits for these reservations' state (their prefill is queued or
        computing): each lease restarts. Ids not pending for this connection are ignored."""
        for rid in msg.rids:
            self.table.renew(rid, identity)

    def _admit_queued(self) -> None:
        while self.queue:
            sample = self.queue[0]
            rid = sample.rid
            try:
                self.engine.pd.reserve(rid, sample.prompt_ids, sample.params, sample.output_ids)
            except CacheFullError:
                return
            except RequestError as e:
                self.queue.popleft()
                del self.samples[rid]
                self.reply(sample.owner, Error(rid=rid, status=400, message=str(e)))
                continue
            self.queue.popleft()                   # before any reply: a gone owner aborts what it holds
            self.metrics.queue.observe(time.monotonic() - sample.arrival)
            self._reserved(sample)

    def _reserved(self, sample: DecodeSample) -> None:
        rid = sample.rid
        self.table.expect(rid, len(sample.prompt_ids) + len(sample.output_ids), sample.lease_s, sample.owner)
        sample.state = SampleState.RESERVED
        self.samples[rid] = sample
        self.reply(sample.owner, Reserved(rid=rid, state_addr=self.state_addr, instance_id=self.instance_id,
                                          lease_s=sample.lease_s))   # gone: aborted

    def _abort(self, rid: str, reason: str = "abort") -> None:
        sample = self.samples.pop(rid, None)
        if sample is not None and sample.state is SampleState.QUEUED:
            self.queue.remove(sample)
            self.table.retire(rid)
            self.metrics.success(reason)
            return
        if sample is not None:
            self.metrics.success(reason)
        if self.table.retire(rid) is not None:
            self.engine.pd.unreserve(rid)
        else:
            self.engine.abort(rid)

    def _fail(self, rid: str, cause: str, message: str, peer: str | None = None) -> None:
        self.table.retire(rid)
        self.engine.pd.unreserve(rid)
        self.metrics.transfer_failure(cause)
        self.metrics.success("error")
        sample = self.samples.pop(rid, None)
        if sample is not None:
            self.reply(sample.owner, Error(rid=rid, status=502 if cause != "timeout" else 504,
                                           message=f"state transfer failed ({cause}): {message}"))
        if peer is not None:
            self.table.nack(peer, rid, cause, message)

    def _error(self, rid: str, status: int, message: str) -> None:
        """Fail ``rid`` (queued, reserved or running): ``error`` to its gateway, state freed."""
        sample = self.samples.get(rid)
        self._abort(rid, "error")
        if sample is not None:
            self.reply(sample.owner, Error(rid=rid, status=status, message=message))

    def on_deadline(self, rid: str) -> None:
        if rid in self.samples:
            self._error(rid, 504, "the request's deadline passed (timeout) on the decode worker")

    def live_rids(self):
        return self.samples

    def busy(self) -> bool:
        return bool(self.samples or self.table.pending) or self.engine.has_unfinished()

    def abort_all(self, status: int, message: str) -> None:
        for rid in list(self.samples):
            self._error(rid, status, message)
        for rid in list(self.table.pending):
            self._abort(rid)

    def gateway_connections(self) -> set[bytes]:
        return {s.owner for s in self.samples.values()}

    def owner_gone(self, owner: bytes) -> None:
        rids = [r for r, s in self.samples.items() if s.owner == owner]
        if rids:
            log.warning("decode: gateway connection gone: aborting %d samples", len(rids))
        for rid in rids:
            self._abort(rid)

    # ---- state -----------------------------------------------------------------------------------
    def tick(self) -> None:
        for act in self.table.poll():
            self._on_transfer(act)
        for p in self.table.expired():                # retired: a late write is fenced
            self._fail(p.transfer_id, "timeout", "no committed state within the lease")
        if self.queue:                                # last: after whatever freed room above
            self._admit_queued()

    def _on_transfer(self, act: Action) -> None:
        """One state message, already fenced, verified and classified (``kvtransfer.receiver``)."""
        tid = act.transfer_id
        if act.kind == "drop":
            if act.cause:                            # fenced / unknown (a cancel after an abort is expected)
                self.metrics.transfer_failure(act.cause)
        elif act.kind == "fail":
            self._fail(tid, act.cause, act.message, act.peer)
        elif act.kind == "cancel":
            self.engine.pd.unreserve(tid)
            self.samples.pop(tid, None)
        elif act.kind == "load":
            try:
                self.engine.pd.load_state(tid, act.tensors, None if act.layer is None else [act.layer])
            except RequestError as e:
                self._fail(tid, "malformed", str(e), act.peer)
                return
            if act.first_token is not None:          # a whole-state message: load + commit
                self._commit(tid, act)
        elif act.kind == "commit":
            self._commit(tid, act)

    def _commit(self, tid: str, act: Action) -> None:
        """Join ``tid`` with token #1 (``act``: a commit, or a whole state already loaded); a
        commit's tensors (the MTP rows) are loaded first. A decode running MTP takes only a
        state with its MTP rows: drafting from another request's ring would waste every step."""
        pending, peer = act.pending, act.peer
        try:
            if act.kind == "commit" and act.tensors:
                self.engine.pd.load_state(tid, act.tensors)
            if self.engine.spec is not None and not (act.tensors and any(k.startswith("mtp.") for k in act.tensors)):
                raise RequestError(f"state: no MTP state (mtp.*) for a decode running next_n {self.engine.spec.next_n}")
            self.engine.pd.commit(tid, act.first_token, act.draft_ids)
        except RequestError as e:
            self._fail(tid, "malformed", str(e), peer)
            return
        if (sample := self.samples.get(tid)) is not None:
            sample.state = SampleState.RUNNING
        secs = time.monotonic() - (pending.first_frame_time or time.monotonic())
        self.metrics.transfer_bytes.inc(pending.nbytes)
        self.metrics.transfer_time.observe(secs)
        self.metrics.prompt(pending.num_tokens, "kv_transfer")
        self.metrics.reservation_wait.observe(time.monotonic() - pending.reserved_at)
        self.table.ack(peer, tid, pending.nbytes)
        self.transfers[tid] = {"bytes": pending.nbytes, "payload_bytes": pending.payload_bytes, "seconds": secs,
                               "num_tokens": pending.num_tokens, "layers_before_commit": len(pending.received)}
        while len(self.transfers) > 1024:
            self.transfers.popitem(last=False)

    # ---- outputs ---------------------------------------------------------------------------------
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        batches: dict[bytes, list[OutItem]] = defaultdict(list)
        for out in outs:
            rid = out.request_id
            sample = self.samples.get(rid)
            if sample is None:
                continue
            # the first ``num_before`` tokens came from prefill (and from the decode a migrated stream lost)
            fresh = max(0, min(len(out.new_token_ids), out.num_output_tokens - sample.num_before))
            ids = list(out.new_token_ids[len(out.new_token_ids) - fresh:])
            lps = pack_sampled(out.new_logprobs[-len(ids):] if ids else []) if sample.want_logprobs else None
            reason = out.finish_reason.value if out.finish_reason is not None else None
            batches[sample.owner].append(OutItem(rid=rid, ids=ids, lps=lps, done=out.finished, reason=reason))
            self.metrics.generation_tokens.inc(len(ids))
            if out.finished:
                self.metrics.success(reason)
                del self.samples[rid]
        for owner, items in batches.items():
            self.reply(owner, Out(items))     # a gone owner's samples are aborted

    def close(self) -> None:
        super().close()
        self.receiver.close()
