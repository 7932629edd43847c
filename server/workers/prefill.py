"""The prefill worker: runs chunked prefill, samples token #1, pushes the state to decode.

Per sample (``server.protocol.Prefill`` from the gateway):
the engine prefills it (``hold_state``, one token), each layer's state is pushed to ``dest`` (the
decode reservation's receiver) as soon as that layer is final, token #1 goes to the gateway the
moment it is sampled (``first``), then a commit (or, if token #1 already ends the sample, a
cancel) follows the layers and prefill's own copy of the state is freed at once. With MTP
(next_n > 0) the commit also carries the MTP window rows and the drafts made after token #1:
both are final only after the step that sampled it (``kvtransfer.wire``). Decode's ack
becomes ``transferred`` (bytes, seconds) to the gateway; a failure becomes ``error``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.core.llm_engine import LLMEngine, RequestError
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.core.request import FinishReason, RequestOutput
from kvtransfer import make_sender
from kvtransfer.sender import Pusher
from kvtransfer.wire import encode_cancel, encode_commit, encode_layer
from server.protocol import Error, First, Kind, Prefill, Transferred, kind_of
from server.protocol_fields import MessageError, check_rid, pack_sampled
from server.workers.base import Worker, WorkerOptions

log = logging.getLogger(__name__)


@dataclass
class _Job:
    identity: bytes
    dest: str
    params: SamplingParams
    num_tokens: int                      # prompt + outputs before this prefill (the state's L)
    num_before: int = 0                  # outputs a migrated stream had already delivered
    sent_layers: bool = False
    first_sent: bool = False


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, engine: LLMEngine, opts: WorkerOptions):
        super().__init__(engine, opts)
        self.jobs: dict[str, _Job] = {}
        self.num_layers = len(engine.model.layers)
        # dist: the engine's device picks the data plane (cpu gloo, cuda nccl, npu hccl)
        dist = {"device": str(engine.model.embed.weight.device)} if opts.transport == "dist" else {}
        self.pusher = Pusher(lambda: make_sender(opts.transport, self.fingerprint, self.layout,
                                                 f"prefill-{self.instance_id}", secret=opts.cluster_secret, **dist),
                             opts.transfer_timeout_s, notify=self.wake)   # an ack / failure wakes the loop

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        kind, rid = kind_of(msg), check_rid(msg)
        if kind is Kind.ABORT:
            self._abort(rid)
        elif kind is Kind.PREFILL:
            if self.draining:
                self.reply(identity, Error(rid=rid, status=503, retry=True,
                                           message="prefill worker is draining (shutting down)"))
                return
            self._prefill(identity, msg)
        else:
            raise MessageError(f"op: {msg['op']!r} is not a prefill operation")

    def _prefill(self, identity: bytes, msg: dict) -> None:
        rid = msg["rid"]
        try:
            req = Prefill.from_map(msg)          # MessageError: answered 400 by ``Worker._handle_frames``
            params, prompt, outs = req.params, req.prompt_ids, req.output_ids   # outs: a migrated stream's
            if params.seed is None:
                raise RequestError("params.seed: must be set (decode continues with it)")
            if rid in self.jobs:
                raise RequestError(f"rid: {rid!r} is in use")
            if len(outs) >= params.max_new_tokens:
                raise RequestError(f"output_ids: {len(outs)} tokens already reach max_new_tokens")
            self.engine.add_request(rid, prompt, params, hold_state=True, output_ids=outs)   # one token past outs
        except (RequestError, SamplingError) as e:
            self.reply(identity, Error(rid=rid, status=400, message=str(e)))
            return
        self.jobs[rid] = _Job(identity, req.dest, params, len(prompt) + len(outs), len(outs))
        self.track_deadline(rid, req.deadline_s)

    def on_deadline(self, rid: str) -> None:
        job = self.jobs.get(rid)
        if job is not None and not job.first_sent:       # after token #1 decode's lease governs
            self._fail(rid, job, 504, "the request's deadline passed (timeout) on the prefill worker")

    def live_rids(self):
        return self.jobs

    def busy(self) -> bool:
        return bool(self.jobs) or self.engine.has_unfinished()

    def abort_all(self, status: int, message: str) -> None:
        for rid, job in list(self.jobs.items()):
            self._fail(rid, job, status, message)

    def gateway_connections(self) -> set[bytes]:
        return {job.identity for job in self.jobs.values()}

    def owner_gone(self, owner: bytes) -> None:
        rids = [r for r, job in self.jobs.items() if job.identity == owner]
        if rids:
            log.warning("prefill: gateway connection gone: aborting %d samples", len(rids))
        for rid in rids:
            self._abort(rid)
            self.metrics.success("abort")

    def _abort(self, rid: str) -> None:
        job = self.jobs.pop(rid, None)
        self.engine.abort(rid)
        # the reservation learns it at once, even with no layer sent yet (a gone gateway cannot
        # abort it there; decode drops a cancel for an id it already retired)
        if job is not None and not job.first_sent:
            self.pusher.put("cancel", rid, job.dest, encode_cancel(rid, self.fingerprint, "aborted"))

    # ---- state push ------------------------------------------------------------------------
    def layer_hook(self):
        return self._on_layer_final

    def _on_layer_final(self, layer: int, done: list[tuple[str, int]]) -> None:
        for rid, L in done:
            job = self.jobs.get(rid)
            if job is None:
                continue
            tensors = self.engine.pd.layer_state(rid, L, layer)     # copies: safe to send later
            self.pusher.put("layer", rid, job.dest,
                            lambda t=tensors, r=rid, n=L, ly=layer: encode_layer(r, self.fingerprint, n, ly, t))
            job.sent_layers = True

    def on_outputs(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            job = self.jobs.get(out.request_id)
            if job is None:
                self.engine.pd.release(out.request_id)
                continue
            if not out.new_token_ids:            # failed in the engine (forward / sampling)
                self._fail(out.request_id, job, 502, "prefill failed in the engine")
                continue
            self._first(out, job)

    def _first(self, out: RequestOutput, job: _Job) -> None:
        rid, tok, p = out.request_id, out.new_token_ids[0], job.params
        e = self.engine
        if out.finish_reason is FinishReason.ABORT:      # token #1 broke its grammar (logged by the engine)
            self._fail(rid, job, 502, "prefill failed in the engine")
            return
        reason = out.finish_reason                       # the engine's one finish rule (None: decode goes on)
        lps = pack_sampled(out.new_logprobs) if p.logprobs is not None else None
        if not self.reply(job.identity, First(rid=rid, id=tok, lps=lps, done=reason is not None,
                                              reason=reason.value if reason else None, queue_s=out.queue_time_s,
                                              cached=out.num_cached_tokens)):
            return                               # its gateway is gone: aborted and freed (``owner_gone``)
        job.first_sent = True
        seq = e.pd.held.get(rid)
        # MTP: the rows (copies) and drafts must be taken before ``release`` frees the held state
        mtp = drafts = None
        if e.spec is not None and seq is not None:
            mtp, drafts = e.pd.mtp_state(rid), list(seq.draft_ids)
        e.pd.release(rid)
        m = self.metrics
        if seq is not None and seq.scheduled_time is not None and seq.first_token_time is not None:
            m.prefill_time.observe(seq.first_token_time - seq.scheduled_time)
        m.prompt(job.num_tokens - out.num_cached_tokens, "local_compute")
        if out.num_cached_tokens:
            m.prompt(out.num_cached_tokens, "cache_hit")
        m.generation_tokens.inc()
        if out.queue_time_s is not None:
            m.queue.observe(out.queue_time_s)
        if reason is not None:
            self.pusher.put("cancel", rid, job.dest, encode_cancel(rid, self.fingerprint, f"finished: {reason.value}"))
            del self.jobs[rid]
            m.success(reason.value)
        else:        # built on the lane (the MTP rows' encoding and checksums off the engine loop)
            self.pusher.put("commit", rid, job.dest, lambda: encode_commit(rid, self.fingerprint, job.num_tokens, tok,
                                                                           self.num_layers, mtp, drafts))

    def _fail(self, rid: str, job: _Job, status: int, message: str) -> None:
        self.jobs.pop(rid, None)
        self.engine.abort(rid)
        self.engine.pd.release(rid)
        if job.sent_layers:
            self.pusher.put("cancel", rid, job.dest, encode_cancel(rid, self.fingerprint, message))
        self.metrics.success("error")
        self.reply(job.identity, Error(rid=rid, status=status, message=message))

    def tick(self) -> None:
        for r in self.pusher.results():
            job = self.jobs.pop(r.transfer_id, None)
            if job is None:
                continue
            if r.kind == "acked":
                self.metrics.transfer_bytes.inc(r.nbytes)
                self.metrics.transfer_time.observe(r.seconds)
                self.metrics.success("length")      # prefill's leg ends after token #1
                self.reply(job.identity, Transferred(rid=r.transfer_id, bytes=r.nbytes, seconds=r.seconds))
            else:
                self.metrics.transfer_failure(r.cause)
                self.metrics.success("error")
                self.engine.abort(r.transfer_id)
                self.engine.pd.release(r.transfer_id)
                self.reply(job.identity, Error(rid=r.transfer_id, status=502,
                                               message=f"state transfer to decode failed ({r.cause}): {r.message}"))

    def extra_load(self) -> dict:
        return {"queued_tokens": sum(len(s.prompt_ids) for s in self.engine.scheduler.waiting)}

    def close(self) -> None:
        super().close()
        self.pusher.close()
