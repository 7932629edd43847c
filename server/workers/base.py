"""What prefill and decode workers share: the ZMQ request endpoint, the HTTP side (/health,
/ready, /metrics), the engine loop and the load report the gateway routes by.

One thread runs the loop (requests in, one engine step, outputs out), as in nano-vllm / vLLM's
engine core; the HTTP server runs on a daemon thread and only reads. While the engine has no work
the loop blocks in one ``zmq.Poller`` on everything that can give it some: the request socket and a
wake-up socket that the state receiver (decode: a state message arrived) and the state pusher
(prefill: a transfer was acknowledged or failed) write to (``wake``). So nothing on a request's
path waits for a timer; the poll timeout is only the next deadline (a sample's, a lease's, capped
at ``idle_poll_ms``).

Liveness towards the gateway is ZMTP heartbeats (``server.heartbeat``), answered by
libzmq's I/O thread even during a long step; load reports (``ping`` -> ``pong``) are answered
between steps, and during a long one by ``StepPings``'s helper thread. ``begin_drain``
(SIGTERM) turns ``/ready`` false and refuses new samples with 503; the loop ends once in-flight
samples finish, or at ``drain_timeout_s`` after aborting the rest with an error. A sample's
``deadline_s`` is enforced here too (504), so a lost abort from the gateway cannot keep state
forever.
"""
from __future__ import annotations

import heapq
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import uvicorn
import zmq

from engine.core.llm_engine import LLMEngine
from engine.run_config import DEFAULT_MODEL_NAME
from engine.core.request import RequestOutput
from kvtransfer import handshake_fields
from kvtransfer.secure import secure_server, stop_authenticator
from server.heartbeat import set_heartbeat
from server.metrics import WorkerMetrics
from server.protocol import Error, Kind, Message, Pong, Probe, kind_of
from server.protocol_fields import MAX_MESSAGE_BYTES, MessageError, unpack
from server.workers.http import WorkerHttp, serve_http
from server.workers.layout import quantization_label, state_fingerprint
from server.workers.loop_calls import LoopCalls
from server.workers.step_pings import StepPings

log = logging.getLogger(__name__)


@dataclass
class WorkerOptions:
    """Addresses (host / ports), timeouts (s) and the transport of one worker."""

    host: str = "127.0.0.1"
    port: int = 5555                 # ZMQ request endpoint (ROUTER)
    http_port: int = 8001            # /health /ready /metrics; 0: none
    state_port: int = 5558           # decode: state receiver
    transport: str = "zmq-tcp"       # zmq-tcp | zmq-ipc | dist
    lease_s: float = 60.0            # decode: a reservation's state must be committed within this
    transfer_timeout_s: float = 60.0  # prefill: commit sent -> ack
    idle_poll_ms: int = 50           # longest idle wait; messages and transfer events wake the loop at once
    max_queued: int = 1024           # decode: samples waiting for a reservation (then 429)
    model_name: str = DEFAULT_MODEL_NAME
    advertise_host: str | None = None  # decode: the host in the state address (None: ``host``)
    heartbeat_timeout_s: float = 5.0   # a silent gateway connection is dropped after this
    drain_timeout_s: float = 30.0      # SIGTERM: in-flight samples get this long, then are aborted
    cluster_secret: str | None = None  # CURVE on every ZMQ socket, and HTTP needs "Bearer <secret>"
    weights_digest: str | None = None  # engine.checkpoint.digest: part of the fingerprint (None: unknown)


class Worker:
    """Base of ``PrefillWorker`` / ``DecodeWorker``: subclasses implement ``handle``, ``tick``,
    ``on_outputs`` and ``extra_load``."""

    role = "worker"

    def __init__(self, engine: LLMEngine, opts: WorkerOptions):
        self.engine, self.opts = engine, opts
        self.instance_id = uuid.uuid4().hex[:12]
        self.fingerprint, self.layout = state_fingerprint(engine, opts.weights_digest)
        # what this worker's sender / receiver will state in the handshake; in every pong, so the
        # gateway pairs only instances that would agree (kvtransfer.compat, the same rule)
        self.handshake = handshake_fields(opts.transport, self.fingerprint, self.layout,
                                          engine.describe()["device"])
        self.metrics = WorkerMetrics(opts.model_name, self.role)
        if engine.spec is not None:          # MTP: the spec_decode_* counters, read from the engine's stats
            self.metrics.track_spec(lambda: engine.spec.stats)
        self.prefix_cache = getattr(engine.cache, "prefix", None)   # engine.core.prefix_cache (None: off)
        if self.prefix_cache is not None:
            self.metrics.track_prefix_cache(lambda: self.prefix_cache)
        self.calls = LoopCalls(self.wake)      # HTTP handlers' engine calls, run on the loop
        self.ctx = zmq.Context()         # its own: close() terms it, which flushes the last replies
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        set_heartbeat(self.sock, opts.heartbeat_timeout_s)
        secure_server(self.sock, opts.cluster_secret)     # before bind; no-op without a secret
        self.sock.bind(f"tcp://{opts.host}:{opts.port}")
        # a self-pipe: other threads (state receiver, pusher lanes), signal handlers and close()
        # write a byte to wake the loop out of its poll
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.step_pings = StepPings(self.sock, self.load)
        self.iterations = 0              # loop iterations (tests: an idle loop does not spin)
        self.stop = threading.Event()
        self.ready = False
        self.draining = False
        self._drain_deadline = float("inf")
        self._deadlines: list[tuple[float, str]] = []      # heap of (monotonic deadline, rid)
        self._bad_requests = 0
        self._last_bad_log = self._last_gone_log = 0.0
        self._http: uvicorn.Server | None = None
        self.rank_failure: str | None = None   # multi-rank: why a rank was lost (server.launch.rank_worker)
        self.parallel_info = None                # multi-rank: () -> dict for /health

    # ---- subclass hooks ----------------------------------------------------------------------
    def handle(self, identity: bytes, msg: dict) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        """Per-iteration work besides requests and the engine step (transfers, leases)."""

    def on_outputs(self, outs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def extra_load(self) -> dict:
        """The role's own ``Pong`` fields (decode: state_addr, queued; prefill: queued_tokens)."""
        return {}

    def num_queued(self) -> int:
        """Samples waiting outside the engine for room (decode: for a reservation)."""
        return 0

    def layer_hook(self):
        """The engine step's layer hook (``LLMEngine.step``'s ``on_layer_final``; None: none)."""
        return None

    def next_timer(self) -> float | None:
        """Monotonic time (s) of the subclass's next timed event (decode: a lease ends), or None."""
        return None

    def busy(self) -> bool:
        """Samples in flight (drain waits for them)."""
        return self.engine.has_unfinished()

    def abort_all(self, status: int, message: str) -> None:
        """Fail every sample in flight with ``error`` (drain deadline)."""

    def on_deadline(self, rid: str) -> None:
        """``rid``'s deadline passed: abort it with 504 if it still runs."""

    def owner_gone(self, owner: bytes) -> None:
        """The gateway connection ``owner`` is gone (a reply to it failed: killed, or a blip the
        gateway retries elsewhere): nobody reads its samples, so abort them and free their state."""

    def gateway_connections(self) -> set[bytes]:
        """The gateway connections of the samples held here (probed once a second: a reply to a
        gone one fails at once, so a dead gateway's samples are freed within a second)."""
        return set()

    # ---- deadlines and drain -----------------------------------------------------------------
    def live_rids(self) -> set[str] | dict:
        """The samples a deadline can still apply to."""
        return set()

    def track_deadline(self, rid: str, deadline_s: float | None) -> None:
        if deadline_s is None:
            return
        heapq.heappush(self._deadlines, (time.monotonic() + deadline_s, rid))
        if len(self._deadlines) > 4096 and len(self._deadlines) > 4 * len(self.live_rids()):
            live = self.live_rids()          # drop the entries of finished samples (long deadlines)
            self._deadlines = [d for d in self._deadlines if d[1] in live]
            heapq.heapify(self._deadlines)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            self.on_deadline(heapq.heappop(self._deadlines)[1])

    def begin_drain(self, timeout_s: float | None = None) -> None:
        """Stop admitting (``/ready`` 503, new samples 503); ``run`` returns when idle or at the
        deadline. Safe from a signal handler."""
        if not self.draining:
            self._drain_deadline = time.monotonic() + (self.opts.drain_timeout_s if timeout_s is None else timeout_s)
            self.draining = True
            self.ready = False
            self.wake()
            log.info("%s: draining (up to %g s)", self.role, self._drain_deadline - time.monotonic())

    def rank_lost(self, reason: str) -> None:
        """A rank of this instance is gone: not ready from now on, and the loop ends after its
        current step without answering more (the process then exits, so the gateway handles the
        samples in flight as a killed worker's: retried elsewhere before token #1, an error event
        after). Any thread."""
        self.rank_failure = reason
        self.ready = False
        self.stop.set()
        self.wake()

    def _bad_request(self, what: str) -> None:
        """Log bad requests at most once per 10 s (a fuzzer must not flood the log)."""
        self._bad_requests += 1
        now = time.monotonic()
        if now - self._last_bad_log >= 10:
            log.warning("%s: bad request: %s (%d bad requests so far)", self.role, what, self._bad_requests)
            self._last_bad_log = now

    # ---- plumbing ------------------------------------------------------------------------------
    def wake(self) -> None:
        """Wake the loop out of its idle poll. Any thread, and signal handlers; never blocks."""
        try:
            self._wake_w.send(b"\0")
        except OSError:                  # buffer full (a wake is pending anyway) or closed
            pass

    def _clear_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:                  # drained (EAGAIN) or closed
            pass

    def _idle_timeout_ms(self) -> int:
        """How long an idle loop may block: until the next deadline, at most ``idle_poll_ms``."""
        t = self.next_timer()
        if self._deadlines:
            t = self._deadlines[0][0] if t is None else min(t, self._deadlines[0][0])
        if self.draining:
            t = self._drain_deadline if t is None else min(t, self._drain_deadline)
        if t is None:
            return self.opts.idle_poll_ms
        return max(0, min(self.opts.idle_poll_ms, int((t - time.monotonic()) * 1000) + 1))

    def reply(self, identity: bytes, msg: Message) -> bool:
        """Send to a gateway connection; False (logged) if it is gone, whose samples are then
        aborted (``owner_gone``: a pong every ping period finds a dead gateway within one)."""
        try:
            self.sock.send_multipart([identity, msg.pack()], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            now = time.monotonic()
            if now - self._last_gone_log >= 10:
                log.warning("%s: reply %s to a gone gateway connection: %s", self.role, msg.KIND.value, e)
                self._last_gone_log = now
            self.owner_gone(identity)
            return False

    def load(self) -> Pong:
        """The load report (``ping``'s answer; ``/ready``'s body). Reads engine state only, so the
        HTTP thread and ``StepPings`` may call it too."""
        e = self.engine
        free, total = e.num_free_blocks(), e.num_total_blocks()
        used = self._kv_usage(free, total)
        return Pong(role=self.role, instance_id=self.instance_id, ready=self.ready,
                    running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
                    reserved=len(e.pd.reserved), batch_size=e.limits.batch_size, kv_usage=used,
                    free_blocks=free, total_blocks=total, max_model_len=e.limits.max_model_len,
                    prefix_caching=self.prefix_cache is not None,
                    fingerprint=self.fingerprint, handshake=self.handshake, **self.extra_load())

    def _drain_requests(self) -> None:
        for parts in self.step_pings.take_kept():      # arrived during the last step: first, in order
            self._handle_frames(parts)
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle_frames(parts)

    def _handle_frames(self, parts: list[bytes]) -> None:
        """One ROUTER message ``[identity, body]``: a ping is answered, anything else handled;
        a bad one gets a 400 error reply (the loop goes on)."""
        if len(parts) != 2:
            self._bad_request(f"a {len(parts) - 1}-frame message")
            return
        identity, frame = parts
        msg = None
        try:
            msg = unpack(frame)
            if kind_of(msg) is Kind.PING:
                self.reply(identity, self.load())
            else:
                self.handle(identity, msg)
        except Exception as e:       # MessageError; anything else is a bug, but must not end the loop
            if not isinstance(e, MessageError) and time.monotonic() - self._last_bad_log >= 10:
                log.exception("%s: request %s failed", self.role, str(msg)[:200])
            self._bad_request(f"{type(e).__name__}: {e}")
            rid = msg.get("rid") if isinstance(msg, dict) else None
            self.reply(identity, Error(rid=rid if isinstance(rid, str) else None, status=400, message=f"{e}"[:1000]))

    def update_gauges(self) -> None:
        e, m = self.engine, self.metrics
        m.running.set(len(e.scheduler.running))
        m.waiting.set(len(e.scheduler.waiting) + len(e.pd.reserved) + self.num_queued())
        m.kv_usage.set(self._kv_usage(e.num_free_blocks(), e.num_total_blocks()))

    def _kv_usage(self, free: dict, total: dict) -> float:
        """The fullest pool's used fraction; blocks only prefix-cache entries hold count as free
        (an allocation evicts them), as vLLM counts its cached free blocks."""
        if self.prefix_cache is not None:
            free = {p: n + self.engine.cache.pools[p].num_evictable for p, n in free.items()}
        return max(1 - free[p] / total[p] for p in total if total[p])

    def run(self) -> None:
        """The loop: requests, role work, one engine step, outputs. Returns when ``stop`` is set."""
        self.ready = not self.draining
        last_gauges = last_probe = 0.0
        stepped = False
        try:
            while not self.stop.is_set():
                self.iterations += 1
                # after a step, look again at once: it may have freed room (decode admits queued
                # samples in ``tick``) or ended the last sample of a drain
                busy = stepped or self.engine.has_unfinished()
                events = dict(self.poller.poll(0 if busy else self._idle_timeout_ms()))
                if self._wake_r in events or self._wake_r.fileno() in events:
                    self._clear_wake()
                if self.sock in events or self.step_pings.pending():
                    self._drain_requests()
                if self._deadlines:
                    self._expire()
                self.calls.run()
                self.tick()
                if self.draining and (not self.busy() or time.monotonic() > self._drain_deadline):
                    if self.busy():
                        self.abort_all(503, f"the {self.role} worker shut down (drain deadline)")
                    # let the gateway read our last replies (final tokens, errors) before we
                    # disconnect: its DEALER drops unread messages of a connection that went away
                    time.sleep(0.3)
                    log.info("%s: drained", self.role)
                    return
                stepped = self.engine.has_unfinished()
                if stepped:
                    self.step_pings.begin()
                    try:
                        outs = self.engine.step(self.layer_hook())
                    finally:
                        self.step_pings.end()
                    if self.rank_failure is not None:   # a rank was lost in the step: say nothing more
                        return
                    self.on_outputs(outs)
                now = time.monotonic()
                if now - last_gauges > 0.1:
                    self.update_gauges()
                    last_gauges = now
                if now - last_probe > 1.0:
                    for owner in self.gateway_connections():
                        self.reply(owner, Probe())
                    last_probe = now
        finally:
            self.ready = False

    # ---- HTTP --------------------------------------------------------------------------------
    def start_http(self) -> None:
        """Serve /health /ready /metrics on ``opts.http_port`` (0: none) from a daemon thread.
        Raises OSError now if the port cannot be bound."""
        if self.opts.http_port:
            reset = None if self.prefix_cache is None else self.reset_prefix_cache
            hooks = WorkerHttp(self.role, self.opts.cluster_secret, self.health_info, lambda: self.load().report(),
                               lambda: self.ready, reset, self.render_metrics)
            self._http = serve_http(self.opts.host, self.opts.http_port, hooks)

    def health_info(self) -> dict:
        """The ``/health`` body: what runs here (device, weights, cache dtype, MTP, prefix cache,
        graph mode, parallel layout). Reads engine state only (the HTTP thread calls it)."""
        e = self.engine.describe()       # device, cache dtype, MTP (next_n, spec_decode), exe_mode, graph
        return {"status": "ok", "role": self.role, "instance_id": self.instance_id, "device": e["device"],
                "quantization": quantization_label(self.engine.args.quant), "cache_dtype": e["cache_dtype"],
                "next_n": e["next_n"], "spec_decode": e["spec_decode"],
                "prefix_cache": None if (pc := self.prefix_cache) is None else
                {"entries": len(pc.entries), "queries": pc.queries, "hits": pc.hits, "evictions": pc.evictions},
                "exe_mode": e["exe_mode"], "graph": e["graph"],
                "parallel": self.parallel_info() if self.parallel_info else {"world_size": 1}}

    def reset_prefix_cache(self) -> int:
        """Evict every prefix-cache entry, on the loop (any thread; waits for it). Returns how many."""
        return self.calls.call(self.engine.reset_prefix_cache)

    def render_metrics(self) -> bytes:
        """The Prometheus text, gauges refreshed first (any thread)."""
        self.update_gauges()
        return self.metrics.render()

    def close(self) -> None:
        self.stop.set()
        self.wake()
        if self._http is not None:
            self._http.should_exit = True
        self.step_pings.close()
        self.sock.close(linger=1000)
        stop_authenticator(self.ctx)
        self.ctx.term()                  # waits (<= linger) until the last replies are sent
        self._wake_r.close()
        self._wake_w.close()
