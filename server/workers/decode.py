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

import logging
import time
from collections import OrderedDict, defaultdict

from engine.core.block_manager import CacheFullError
from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.sampling_params import SamplingError
from engine.core.request import RequestOutput
from kvtransfer import make_receiver
from kvtransfer.receiver import Action, TransferReceiver
from server.workers.base import Worker, WorkerOptions
from server.workers.rpc import MessageError, check_deadline, check_ids, pack_sampled, params_from_dict

log = logging.getLogger(__name__)


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
        self.owners: dict[str, bytes] = {}       # rid -> gateway connection
        self.emit: dict[str, tuple[bool, int]] = {}   # rid -> (logprobs wanted, outputs made before decode)
        self.transfers: OrderedDict[str, dict] = OrderedDict()   # last 1024 committed: bytes, seconds
        self.queued: OrderedDict[str, tuple] = OrderedDict()     # rid -> (identity, prompt, outs, params, lease, arrival)

    def extra_load(self) -> dict:
        return {"state_addr": self.state_addr, "queued": len(self.queued)}

    def next_timer(self) -> float | None:
        """The earliest lease end of a reservation whose state has not been committed."""
        return min((p.deadline for p in self.table.pending.values()), default=None)

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        op, rid = msg["op"], msg.get("rid")
        if op == "renew":
            self._renew(identity, msg.get("rids"))
            return
        if not isinstance(rid, str):
            raise MessageError("rid: expected a string")
        if op == "reserve":
            if self.draining:
                self.reply(identity, {"op": "error", "rid": rid, "status": 503, "retry": True,
                                      "message": "decode worker is draining (shutting down)"})
                return
            self._reserve(identity, rid, msg)
        elif op == "abort":
            self._abort(rid)
        else:
            raise MessageError(f"op: {op!r} is not a decode operation")

    def _reserve(self, identity: bytes, rid: str, msg: dict) -> None:
        prompt = check_ids(msg.get("prompt_ids"), "prompt_ids")
        outs = check_ids(msg.get("output_ids", []), "output_ids")     # a migrated stream's tokens so far
        lease = msg.get("lease_s", self.opts.lease_s)
        if not isinstance(lease, (int, float)) or not 0 < lease <= 3600:
            raise MessageError("lease_s: expected seconds in (0, 3600]")
        lease = min(float(lease), self.opts.lease_s)     # the shorter of the gateway's and this worker's
        deadline_s = check_deadline(msg)
        try:
            params = params_from_dict(msg.get("params"))
            if self.table.is_known(rid) or rid in self.queued:
                raise RequestError(f"rid: {rid!r} was already used (transfer ids are never reused)")
            if self.queued:                            # FIFO: nobody overtakes the queue
                raise CacheFullError("queue not empty")
            self.engine.reserve(rid, prompt, params, outs)
        except (RequestError, SamplingError) as e:
            self.reply(identity, {"op": "error", "rid": rid, "status": 400, "message": str(e)})
            return
        except CacheFullError as e:
            if len(self.queued) >= self.opts.max_queued:
                self.reply(identity, {"op": "error", "rid": rid, "status": 429,
                                      "message": f"decode is full and {len(self.queued)} samples wait: {e}"})
            else:
                self.queued[rid] = (identity, prompt, outs, params, float(lease), time.monotonic())
                self.owners[rid] = identity
                self.track_deadline(rid, deadline_s)
            return
        self.track_deadline(rid, deadline_s)
        self.metrics.queue.observe(0.0)
        self._reserved(identity, rid, prompt, outs, params, float(lease))

    def _renew(self, identity: bytes, rids) -> None:
        """The gateway still waits for these reservations' state (their prefill is queued or
        computing): each lease restarts. Ids not pending for this connection are ignored."""
        if not isinstance(rids, list) or len(rids) > 1 << 16 or not all(isinstance(r, str) for r in rids):
            raise MessageError("rids: expected a list of transfer ids")
        for rid in rids:
            self.table.renew(rid, identity)

    def _admit_queued(self) -> None:
        while self.queued:
            rid, (identity, prompt, outs, params, lease, arrival) = next(iter(self.queued.items()))
            try:
                self.engine.reserve(rid, prompt, params, outs)
            except CacheFullError:
                return
            except RequestError as e:
                del self.queued[rid]
                self.owners.pop(rid, None)
                self.reply(identity, {"op": "error", "rid": rid, "status": 400, "message": str(e)})
                continue
            del self.queued[rid]                   # before any reply: a gone owner aborts what it holds
            self.metrics.queue.observe(time.monotonic() - arrival)
            self._reserved(identity, rid, prompt, outs, params, lease)

    def _reserved(self, identity: bytes, rid: str, prompt: list[int], outs: list[int], params,
                  lease: float) -> None:
        self.table.expect(rid, len(prompt) + len(outs), lease, identity)
        self.owners[rid] = identity
        self.emit[rid] = (params.logprobs is not None, len(outs) + 1)     # + token #1 from prefill
        self.reply(identity, {"op": "reserved", "rid": rid, "state_addr": self.state_addr,
                              "instance_id": self.instance_id, "lease_s": lease})   # gone: aborted

    def _abort(self, rid: str, reason: str = "abort") -> None:
        if self.queued.pop(rid, None) is not None:
            self.owners.pop(rid, None)
            self.table.retire(rid)
            self.metrics.success(reason)
            return
        if self.owners.pop(rid, None) is not None:
            self.metrics.success(reason)
        self.emit.pop(rid, None)
        if self.table.retire(rid) is not None:
            self.engine.unreserve(rid)
        else:
            self.engine.abort(rid)

    def _fail(self, rid: str, cause: str, message: str, peer: str | None = None) -> None:
        self.table.retire(rid)
        self.engine.unreserve(rid)
        self.metrics.transfer_failure(cause)
        self.metrics.success("error")
        owner = self.owners.pop(rid, None)
        self.emit.pop(rid, None)
        if owner is not None:
            self.reply(owner, {"op": "error", "rid": rid, "status": 502 if cause != "timeout" else 504,
                               "message": f"state transfer failed ({cause}): {message}"})
        if peer is not None:
            self.table.nack(peer, rid, cause, message)

    def _error(self, rid: str, status: int, message: str) -> None:
        """Fail ``rid`` (queued, reserved or running): ``error`` to its gateway, state freed."""
        owner = self.owners.get(rid)
        self._abort(rid, "error")
        if owner is not None:
            self.reply(owner, {"op": "error", "rid": rid, "status": status, "message": message})

    def on_deadline(self, rid: str) -> None:
        if rid in self.owners:
            self._error(rid, 504, "the request's deadline passed (timeout) on the decode worker")

    def live_rids(self):
        return self.owners

    def busy(self) -> bool:
        return bool(self.owners or self.queued or self.table.pending) or self.engine.has_unfinished()

    def abort_all(self, status: int, message: str) -> None:
        for rid in list(self.owners):
            self._error(rid, status, message)
        for rid in list(self.table.pending):
            self._abort(rid)

    def gateway_connections(self) -> set[bytes]:
        return set(self.owners.values())

    def owner_gone(self, owner: bytes) -> None:
        rids = [r for r, o in self.owners.items() if o == owner]
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
        if self.queued:                               # last: after whatever freed room above
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
            self.engine.unreserve(tid)
            self.owners.pop(tid, None)
            self.emit.pop(tid, None)
        elif act.kind == "load":
            try:
                self.engine.load_state(tid, act.tensors, None if act.layer is None else [act.layer])
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
                self.engine.load_state(tid, act.tensors)
            if self.engine.spec is not None and not (act.tensors and any(k.startswith("mtp.") for k in act.tensors)):
                raise RequestError(f"state: no MTP state (mtp.*) for a decode running next_n {self.engine.spec.next_n}")
            self.engine.commit(tid, act.first_token, act.draft_ids)
        except RequestError as e:
            self._fail(tid, "malformed", str(e), peer)
            return
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
        batches: dict[bytes, list] = defaultdict(list)
        for out in outs:
            rid = out.request_id
            owner = self.owners.get(rid)
            if owner is None:
                continue
            want_lps, before = self.emit.get(rid, (False, 1))
            # tokens up to ``before`` came from prefill (and from the decode a migrated stream lost)
            fresh = max(0, min(len(out.new_token_ids), out.num_output_tokens - before))
            ids = list(out.new_token_ids[len(out.new_token_ids) - fresh:])
            lps = pack_sampled(out.new_logprobs[-len(ids):] if ids else []) if want_lps else None
            reason = out.finish_reason.value if out.finish_reason is not None else None
            batches[owner].append({"rid": rid, "ids": ids, "lps": lps, "done": out.finished, "reason": reason})
            self.metrics.generation_tokens.inc(len(ids))
            if out.finished:
                self.metrics.success(reason)
                self.owners.pop(rid, None)
                self.emit.pop(rid, None)
        for owner, items in batches.items():
            self.reply(owner, {"op": "out", "items": items})     # a gone owner's samples are aborted

    def close(self) -> None:
        super().close()
        self.receiver.close()
