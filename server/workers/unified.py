"""The unified worker: prefill and decode of its samples in one engine (vLLM's layout), so one
process steps prefill chunks and decode rows together on all the cores or the device it has.

To the gateway it is a prefill and a decode instance at one address (``PREFILL_IPS`` and
``DECODE_IPS`` both list it; its pongs say ``role: unified``, and ``server.backends.instances``
pairs it with itself only). The gateway's P/D messages keep their meaning, and no state moves:

    reserve  -> ``reserved`` with this worker's own state address (the engine admits the sample
                when its prefill arrives; beyond ``max_queued`` waiting samples: 429)
    prefill  -> the whole sample goes into the engine (dest must be that address): token #1 is
                ``first`` to the prefill connection, then ``transferred`` (0 bytes), and every
                later token is ``out`` to the reserving connection, as a decode worker sends them
    abort    -> from either connection, the sample is aborted and its state freed

A reservation the gateway never follows with a prefill is freed when its connection goes, or
after its lease (``lease_s``).
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.request import FinishReason, RequestOutput
from engine.core.sampling_params import SamplingError
from server.protocol import (Error, First, Kind, Out, OutItem, Prefill, Reserve, Reserved, Transferred,
                             kind_of)
from server.protocol_fields import MessageError, check_rid, pack_sampled
from server.workers.base import Worker, WorkerOptions

log = logging.getLogger(__name__)


@dataclass(eq=False)
class UnifiedSample:
    """One sample held here. owner: the reserving (decode-role) gateway connection, which gets
    ``out``; prefill_owner: the prefill-role connection (None until its ``prefill``), which gets
    ``first``. reserved_until: the reservation's end (monotonic s) until the prefill arrives.
    num_tokens: prompt + the output tokens a migrated stream already delivered (what its prefill
    computes or finds cached). first_sent: token #1 went out."""

    rid: str
    owner: bytes
    reserved_until: float
    prefill_owner: bytes | None = None
    num_tokens: int = 0
    want_logprobs: bool = False
    first_sent: bool = False


class UnifiedWorker(Worker):
    role = "unified"

    def __init__(self, engine: LLMEngine, opts: WorkerOptions):
        super().__init__(engine, opts)
        self.state_addr = f"local#unified-{self.instance_id}"     # no state moves: names this process
        self.samples: dict[str, UnifiedSample] = {}

    def extra_load(self) -> dict:
        return {"state_addr": self.state_addr, "queued": len(self.engine.scheduler.waiting) + self.num_queued(),
                "queued_tokens": sum(len(s.prompt_ids) for s in self.engine.scheduler.waiting)}

    def num_queued(self) -> int:
        """Samples reserved here whose prefill has not come yet (outside the engine's own queue)."""
        return sum(s.prefill_owner is None for s in self.samples.values())

    def next_timer(self) -> float | None:
        return min((s.reserved_until for s in self.samples.values() if s.prefill_owner is None), default=None)

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        kind = kind_of(msg)
        if kind is Kind.RENEW:                  # a reservation here holds no state: nothing to renew
            return
        rid = check_rid(msg)
        if kind is Kind.ABORT:
            self._abort(rid, "abort")
        elif kind in (Kind.RESERVE, Kind.PREFILL) and self.draining:
            self.reply(identity, Error(rid=rid, status=503, retry=True,
                                       message="unified worker is draining (shutting down)"))
        elif kind is Kind.RESERVE:
            self._reserve(identity, Reserve.from_map(msg))
        elif kind is Kind.PREFILL:
            self._prefill(identity, Prefill.from_map(msg))
        else:
            raise MessageError(f"op: {msg['op']!r} is not a unified worker operation")

    def _reserve(self, identity: bytes, req: Reserve) -> None:
        rid = req.rid
        if rid in self.samples:
            self.reply(identity, Error(rid=rid, status=400, message=f"rid: {rid!r} is in use"))
            return
        waiting = len(self.engine.scheduler.waiting) + self.num_queued()
        if waiting >= self.opts.max_queued:
            self.reply(identity, Error(rid=rid, status=429, message=f"{waiting} samples wait for the engine"))
            return
        lease = self.opts.lease_s if req.lease_s is None else min(req.lease_s, self.opts.lease_s)
        self.samples[rid] = UnifiedSample(rid, identity, time.monotonic() + lease)
        self.track_deadline(rid, req.deadline_s)
        self.reply(identity, Reserved(rid=rid, state_addr=self.state_addr, instance_id=self.instance_id,
                                      lease_s=float(lease)))

    def _prefill(self, identity: bytes, req: Prefill) -> None:
        rid, params, outs = req.rid, req.params, req.output_ids
        s = self.samples.get(rid)
        if s is not None and s.prefill_owner is not None:       # a live sample's: never end it from here
            self.reply(identity, Error(rid=None, status=400, message=f"rid: {rid!r} is already prefilling here"))
            return
        try:
            if s is None:
                raise RequestError(f"rid: {rid!r} holds no reservation here")
            if req.dest != self.state_addr:
                raise RequestError(f"dest: {req.dest!r} is not this worker's ({self.state_addr!r}); a unified "
                                   "worker prefills only the samples it reserved")
            if len(outs) >= params.max_new_tokens:
                raise RequestError(f"output_ids: {len(outs)} tokens already reach max_new_tokens")
            self.engine.add_request(rid, req.prompt_ids, params, output_ids=outs)
        except (RequestError, SamplingError) as e:
            if s is not None and s.prefill_owner is None:      # the reservation ends with its prefill
                del self.samples[rid]
            self.reply(identity, Error(rid=rid, status=400, message=str(e)))
            return
        s.prefill_owner, s.want_logprobs = identity, params.logprobs is not None
        s.num_tokens = len(req.prompt_ids) + len(outs)
        self.track_deadline(rid, req.deadline_s)

    def _abort(self, rid: str, reason: str) -> None:
        s = self.samples.pop(rid, None)
        if s is None:
            return
        if s.prefill_owner is not None:
            self.engine.abort(rid)
        self.metrics.success(reason)

    def _error(self, rid: str, status: int, message: str) -> None:
        s = self.samples.get(rid)
        if s is None:
            return
        self._abort(rid, "error")
        self.reply(s.prefill_owner if not s.first_sent and s.prefill_owner else s.owner,
                   Error(rid=rid, status=status, message=message))

    def on_deadline(self, rid: str) -> None:
        self._error(rid, 504, "the request's deadline passed (timeout) on the unified worker")

    def live_rids(self):
        return self.samples

    def busy(self) -> bool:
        return bool(self.samples) or self.engine.has_unfinished()

    def abort_all(self, status: int, message: str) -> None:
        for rid in list(self.samples):
            self._error(rid, status, message)

    def gateway_connections(self) -> set[bytes]:
        return {s.owner for s in self.samples.values()} | {s.prefill_owner for s in self.samples.values()
                                                           if s.prefill_owner is not None and not s.first_sent}

    def owner_gone(self, owner: bytes) -> None:
        """After token #1 a sample answers to its reserving connection only (as on a decode
        worker): the prefill connection going then ends nothing."""
        rids = [r for r, s in self.samples.items()
                if owner == s.owner or (owner == s.prefill_owner and not s.first_sent)]
        if rids:
            log.warning("unified: gateway connection gone: aborting %d samples", len(rids))
        for rid in rids:
            self._abort(rid, "abort")

    def tick(self) -> None:
        now = time.monotonic()
        for rid in [r for r, s in self.samples.items() if s.prefill_owner is None and s.reserved_until <= now]:
            self._error(rid, 504, "no prefill for the reservation within its lease")

    # ---- outputs ---------------------------------------------------------------------------------
    def on_outputs(self, outs: list[RequestOutput]) -> None:
        batches: dict[bytes, list[OutItem]] = defaultdict(list)
        for out in outs:
            rid = out.request_id
            s = self.samples.get(rid)
            if s is None:
                continue
            ids, lps = list(out.new_token_ids), list(out.new_logprobs)
            if not ids or (not s.first_sent and out.finish_reason is FinishReason.ABORT):
                self._error(rid, 502, "the sample failed in the engine")     # forward / sampling / grammar
                continue
            reason = out.finish_reason.value if out.finish_reason is not None else None
            if not s.first_sent:
                self._first(s, out, ids[0], lps[:1], reason if len(ids) == 1 else None)
                if s.rid not in self.samples:
                    continue
                ids, lps = ids[1:], lps[1:]
                if not ids and not out.finished:
                    continue
            batches[s.owner].append(OutItem(rid=rid, ids=ids, lps=pack_sampled(lps) if s.want_logprobs else None,
                                            done=out.finished, reason=reason))
            self.metrics.generation_tokens.inc(len(ids))
            if out.finished:
                self.metrics.success(reason)
                del self.samples[rid]
        for owner, items in batches.items():
            self.reply(owner, Out(items))         # a gone owner's samples are aborted

    def _first(self, s: UnifiedSample, out: RequestOutput, tok: int, lps: list, reason: str | None) -> None:
        """Token #1 to the prefill connection (then ``transferred``: decode goes on in place)."""
        m, rid = self.metrics, s.rid
        done = reason is not None
        if not self.reply(s.prefill_owner, First(rid=rid, id=tok, lps=pack_sampled(lps) if s.want_logprobs else None,
                                                 done=done, reason=reason, queue_s=out.queue_time_s,
                                                 cached=out.num_cached_tokens)):
            return                                 # its gateway is gone: aborted (``owner_gone``)
        s.first_sent = True
        m.generation_tokens.inc()
        if out.queue_time_s is not None:
            m.queue.observe(out.queue_time_s)
        m.prompt(s.num_tokens - out.num_cached_tokens, "local_compute")
        if out.num_cached_tokens:
            m.prompt(out.num_cached_tokens, "cache_hit")
        if done:
            m.success(reason)
            del self.samples[rid]
        else:
            self.reply(s.prefill_owner, Transferred(rid=rid, bytes=0, seconds=0.0))
