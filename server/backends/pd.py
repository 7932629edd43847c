"""``PDBackend``: the gateway's side of the P/D path, routing samples over ZMQ to workers.

Per sample: the least-loaded healthy decode instance reserves state (``reserve``), then the
least-loaded healthy prefill instance prefills with the reservation as destination
(``prefill``); token #1 comes from prefill, the rest from decode. Only pairs whose pongs say the
transfer handshake would accept them are chosen (``server.backends.instances.pick_pair``): a sample
no compatible pair can serve gets 503 before any prefill. Closing the stream early
(client gone, stop string, deadline) aborts both legs. One attempt is a ``server.backends.leg.Leg``
whose explicit state (reserving, prefilling, transferring, decoding, finished) decides what a lost
instance means and what to abort.

Two health signals per instance:

- liveness: ZMTP heartbeats (libzmq's I/O threads answer them even while a worker is inside a
  long engine step) and the socket monitor. A worker killed (connection closed) or stopped (no
  heartbeat answer within ``worker_timeout_s``) is *disconnected* at once: every sample with a
  leg on it is failed or retried, and it gets no new samples until it is connected again.
- load and readiness: ``ping`` -> ``pong`` (the ``/ready`` body, answered between engine steps).
  An instance that is not ready (starting, draining), or whose last ``health_timeout_s`` of pings
  went unanswered, gets no new samples. A new ``instance_id`` in a pong means the process behind the
  address restarted: legs on the old process are lost.

A sample whose prefill or decode instance is lost before token #1 reaches the client is retried
from the reservation on (a new transfer id, ``max_retries`` times); after token #1 it ends with
an error event (a decode that dies mid-stream cannot be resumed without recomputing).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtransfer.secure import cluster_keys, secure_client
from server.backends.base import BackendError, GenRequest, TokenEvent
from server.backends.instances import Instance, incompatible_pairs, pair_mismatch, pick_pair
from server.backends.leg import Leg, LegLost, LegState
from server.workers.rpc import MessageError, pack, params_to_dict, set_heartbeat, unpack, unpack_sampled

log = logging.getLogger(__name__)


class PDBackend:
    """Implements ``server.backends.base.Backend`` over prefill / decode workers.

    Args:
        prefill_addrs / decode_addrs: ``host:port`` of each instance's request endpoint.
        lease_s: decode reservation lease (s).
        queue_timeout_s / first_token_timeout_s / token_timeout_s: longest wait for a reservation,
            for token #1, and between later tokens (s); each fails the sample with 504.
        worker_timeout_s: a worker that answers no heartbeat for this long is disconnected and its
            samples failed (or retried); also the ZMTP handshake timeout (s).
        health_interval_s / health_timeout_s: ping period; pings unanswered for this long (a worker
            stuck inside one engine step) take the instance out of routing.
        max_retries: attempts after the first when an instance is lost before token #1.
        cluster_secret: the cluster's shared secret (None: plain ZMQ): CURVE to the workers.
    """

    def __init__(self, prefill_addrs: list[str], decode_addrs: list[str], lease_s: float = 60.0,
                 queue_timeout_s: float = 600.0, first_token_timeout_s: float = 600.0,
                 token_timeout_s: float = 300.0, health_interval_s: float = 0.5, health_timeout_s: float = 30.0,
                 worker_timeout_s: float = 5.0, max_retries: int = 2, cluster_secret: str | None = None):
        if not prefill_addrs or not decode_addrs:
            raise ValueError("PREFILL_IPS / DECODE_IPS: need at least one prefill and one decode instance")
        if worker_timeout_s <= 0:
            raise ValueError("worker_timeout_s: must be > 0 seconds")
        self.ctx = zmq.asyncio.Context()
        self.worker_timeout_s, self.keys = worker_timeout_s, cluster_keys(cluster_secret)
        self.instances = [self._connect(r, a) for r, addrs in (("prefill", prefill_addrs), ("decode", decode_addrs))
                          for a in addrs]
        self.lease_s, self.queue_timeout_s = lease_s, queue_timeout_s
        self.first_token_timeout_s, self.token_timeout_s = first_token_timeout_s, token_timeout_s
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.max_retries = max_retries
        self._max_unanswered = max(2, round(health_timeout_s / health_interval_s))
        self._streams: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self.counters = {"retries": 0, "lost_legs": 0}

    def _connect(self, role: str, addr: str) -> Instance:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)          # no queueing towards an instance that is not connected
        s.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        set_heartbeat(s, self.worker_timeout_s)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        secure_client(s, self.keys)              # no-op without a secret
        return Instance(role, addr, s)            # connected in start(), once its monitor listens

    @property
    def max_model_len(self) -> int:
        lens = [i.load["max_model_len"] for i in self.instances if "max_model_len" in i.load]
        return min(lens) if lens else 1 << 40      # unknown until a worker answers: generate() says 503

    async def start(self) -> None:
        for inst in self.instances:
            mon = inst.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                               | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            self._tasks.append(asyncio.create_task(self._monitor(inst, mon)))
            self._tasks.append(asyncio.create_task(self._reader(inst)))
            inst.sock.connect(f"tcp://{inst.addr}")
        self._tasks.append(asyncio.create_task(self._pinger()))

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once at least one prefill and one decode instance are healthy."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if (await self.health())["healthy"]:
                return True
            await asyncio.sleep(0.1)
        return False

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for inst in self.instances:
            with contextlib.suppress(zmq.ZMQError):
                inst.sock.disable_monitor()
            inst.sock.close(0)
        self.ctx.term()

    async def health(self) -> dict:
        """Healthy when some healthy prefill pairs with some healthy decode (``kvtransfer.compat``);
        ``incompatible_pairs`` lists the healthy pairs that do not, each with its cause and reason."""
        h = {r: [i.addr for i in self.instances if i.role == r and i.healthy(self._max_unanswered)]
             for r in ("prefill", "decode")}
        bad = self.incompatible_pairs()
        pairs = len(h["prefill"]) * len(h["decode"]) - len(bad)
        return {"healthy": pairs > 0, "healthy_prefill": h["prefill"], "healthy_decode": h["decode"],
                "compatible_pairs": pairs, "incompatible_pairs": bad, **self.counters}

    def incompatible_pairs(self) -> list[dict]:
        """The healthy pairs that are never chosen (``instances.incompatible_pairs``)."""
        return incompatible_pairs(self.instances, self._max_unanswered)

    # ---- I/O tasks ------------------------------------------------------------------------------
    async def _pinger(self) -> None:
        ping = pack({"op": "ping"})
        while True:
            for inst in self.instances:
                was = inst.healthy(self._max_unanswered)
                inst.unanswered = min(inst.unanswered + 1, 1 << 30)
                if was and not inst.healthy(self._max_unanswered):
                    log.warning("gateway: %s %s left %d pings unanswered: no new samples until it answers",
                                inst.role, inst.addr, inst.unanswered - 1)
                with contextlib.suppress(zmq.Again, zmq.ZMQError):
                    await inst.sock.send(ping, zmq.NOBLOCK)
            await asyncio.sleep(self.health_interval_s)

    async def _monitor(self, inst: Instance, mon) -> None:
        failed = 0                                  # connections dropped before a handshake completed
        try:
            while True:
                ev = parse_monitor_message(await mon.recv_multipart())
                e = ev["event"]
                if e == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    inst.connected, failed = True, 0
                    log.info("gateway: %s %s connected", inst.role, inst.addr)
                elif e == zmq.EVENT_DISCONNECTED and inst.connected:
                    inst.connected = False
                    inst.load = {}                  # ready again only when it answers a ping
                    self._lose(inst, "disconnected (killed, stopped or unreachable)")
                else:                               # a handshake failed or was cut short
                    failed += 1
                    if failed == 3:                 # once per run of failures, not per retry
                        log.error("gateway: %s %s: the ZMQ handshake keeps failing: the cluster secret "
                                  "(DSV4_CLUSTER_SECRET) differs, the process is stopped, or it is not a "
                                  "dsv4-pd worker", inst.role, inst.addr)
        finally:
            mon.close(0)

    def _lose(self, inst: Instance, why: str) -> None:
        legs, inst.legs = inst.legs, set()
        if legs:
            log.warning("gateway: %s %s %s: %d samples affected", inst.role, inst.addr, why, len(legs))
        loop = asyncio.get_running_loop()
        for tid in legs:
            q = self._streams.get(tid)
            if q is not None:
                self.counters["lost_legs"] += 1
                # after what the worker sent before it went (an error, the last tokens): the reader
                # task delivers those first
                loop.call_later(0.1, q.put_nowait, ("lost", {"role": inst.role, "addr": inst.addr, "why": why}))

    async def _reader(self, inst: Instance) -> None:
        while True:
            frame = await inst.sock.recv()
            try:
                msg = unpack(frame)
            except MessageError as e:
                log.warning("gateway: bad message from %s %s: %s", inst.role, inst.addr, e)
                continue
            op = msg["op"]
            inst.unanswered = 0                     # any message: its loop is alive (pings wait for a step)
            if op == "pong":
                iid = msg.get("instance_id")
                if inst.instance_id is not None and iid != inst.instance_id:
                    self._lose(inst, f"restarted (instance {inst.instance_id} -> {iid})")
                inst.instance_id = iid
                inst.load = msg
            elif op == "out":
                items = msg.get("items")
                for item in items if isinstance(items, list) else []:
                    rid = item.get("rid") if isinstance(item, dict) else None
                    q = self._streams.get(rid) if isinstance(rid, str) else None
                    if q is not None:
                        q.put_nowait(("out", item))
            else:
                rid = msg.get("rid")
                q = self._streams.get(rid) if isinstance(rid, str) else None
                if q is not None:
                    q.put_nowait((op, msg))

    # ---- a sample ------------------------------------------------------------------------------
    def _pick(self, role: str, decode: Instance | None = None) -> Instance | None:
        """The least-loaded healthy ``role`` instance; with ``decode``, only a prefill that pairs with it."""
        ok = [i for i in self.instances if i.role == role and i.healthy(self._max_unanswered)
              and (decode is None or pair_mismatch(i, decode) is None)]
        return min(ok, key=Instance.score) if ok else None

    def _pick_pair(self) -> Instance:
        """The decode instance of a new sample (``instances.pick_pair``: only one some prefill pairs
        with). Raises BackendError 503 naming why there is none."""
        return pick_pair(self.instances, self._max_unanswered)

    async def _send(self, inst: Instance, msg: dict) -> None:
        try:
            await inst.sock.send(pack(msg), zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as e:
            raise BackendError(f"{inst.role} instance {inst.addr} is unreachable ({e})", 503) from None

    async def _get(self, q: asyncio.Queue, timeout: float, what: str, deadline: float | None):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < timeout:
            try:
                return await asyncio.wait_for(q.get(), max(0.0, left))
            except asyncio.TimeoutError:
                raise BackendError("the request's deadline passed (timeout) while waiting for " + what,
                                   504) from None
        try:
            return await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            raise BackendError(f"timed out after {timeout:g} s waiting for {what}", 504) from None

    async def generate(self, req: GenRequest) -> AsyncIterator[TokenEvent]:
        """The sample's token events. Raises BackendError (400 bad request, 429 decode queue full,
        502 a worker failed, 503 no healthy instance, 504 a timeout or the request's deadline)."""
        if req.request_id in self._streams:
            raise BackendError(f"request id {req.request_id!r} is in use", 400)
        try:
            pack({"prompt_ids": req.prompt_ids, "params": params_to_dict(req.params)})
        except (OverflowError, ValueError, TypeError) as e:     # e.g. an integer beyond 64 bits
            raise BackendError(f"a request field does not fit the worker protocol: {e}", 400) from None
        attempt = 0
        while True:
            tid = req.request_id if attempt == 0 else f"{req.request_id}~retry{attempt}"   # ids never reused
            inner = self._sample(req, tid)
            try:
                async for ev in inner:
                    yield ev
                return
            except LegLost as e:
                attempt += 1
                if attempt > self.max_retries:
                    raise BackendError(f"{e} (gave up after {attempt} attempts)", 502) from None
                self.counters["retries"] += 1
                log.warning("gateway: sample %s: %s; retrying (attempt %d)", req.request_id, e, attempt + 1)
            finally:
                await inner.aclose()

    async def _sample(self, req: GenRequest, rid: str) -> AsyncIterator[TokenEvent]:
        """One attempt under transfer id ``rid``. Raises LegLost before its first event if an instance
        of its legs is lost, BackendError otherwise."""
        dec = self._pick_pair()
        leg = Leg(rid, dec)
        self._streams[rid] = leg.queue
        try:
            params = params_to_dict(req.params)
            dest = await self._reserve(leg, req, params)
            first, early = await self._prefill(leg, req, params, dest)
            leg.first_token()
            tok = first["id"]
            yield TokenEvent([tok], unpack_sampled([tok], first.get("lps")), bool(first["done"]), first.get("reason"),
                             len(req.prompt_ids), first.get("queue_s"))
            if first["done"]:                  # token #1 ended it: free decode's reservation now
                leg.finished()
                with contextlib.suppress(BackendError):
                    await self._send(dec, {"op": "abort", "rid": rid})
                return
            pending = [("out", m) for m in early]
            while True:
                op, msg = pending.pop(0) if pending else await self._next(leg, req.deadline)
                ev = self._on_decode(leg, op, msg, len(req.prompt_ids))
                if ev is not None:
                    yield ev
                    if ev.finished:
                        leg.finished()
                        return
        finally:
            self._streams.pop(rid, None)
            for inst in leg.release():
                with contextlib.suppress(BackendError):
                    await self._send(inst, {"op": "abort", "rid": rid})

    @staticmethod
    def _left(deadline: float | None) -> dict:
        """``{"deadline_s": seconds the sample may still run}`` for a worker message ({}: no deadline)."""
        return {} if deadline is None else {"deadline_s": max(0.001, deadline - time.monotonic())}

    async def _reserve(self, leg: Leg, req: GenRequest, params: dict) -> str:
        """RESERVING: decode reserves the sample's state. Returns the reservation's state address.
        Raises LegLost (decode lost, or draining), BackendError (decode refused: its status)."""
        dec = leg.decode
        await self._send(dec, {"op": "reserve", "rid": leg.rid, "prompt_ids": req.prompt_ids, "params": params,
                               "lease_s": self.lease_s, **self._left(req.deadline)})
        op, msg = await self._get(leg.queue, self.queue_timeout_s, f"decode {dec.addr} to reserve state (queued)",
                                  req.deadline)
        if op == "lost":
            raise leg.lost(msg)
        if op == "error" and msg.get("retry"):      # draining: refused before it knew; go elsewhere
            dec.load["ready"] = False
            raise LegLost(f"decode instance {dec.addr}: {msg.get('message')}")
        if op != "reserved":
            raise BackendError(msg.get("message", f"decode answered {op}"), int(msg.get("status", 502)))
        return msg["state_addr"]

    async def _prefill(self, leg: Leg, req: GenRequest, params: dict, dest: str) -> tuple[dict, list[dict]]:
        """PREFILLING: the least-loaded prefill instance that pairs with the leg's decode (chosen
        now, when the state has a place) computes the prompt into ``dest``. Returns its ``first`` message (token #1) and decode's
        ``out`` messages that overtook it (two sockets). Raises LegLost / BackendError."""
        pre = self._pick("prefill", leg.decode)
        if pre is None:
            raise BackendError("no healthy prefill instance", 503)
        leg.prefill_on(pre)
        await self._send(pre, {"op": "prefill", "rid": leg.rid, "prompt_ids": req.prompt_ids, "params": params,
                               "dest": dest, **self._left(req.deadline)})
        early = []
        while True:
            op, msg = await self._get(leg.queue, self.first_token_timeout_s, f"prefill {pre.addr}", req.deadline)
            if op == "first":
                return msg, early
            if op == "lost":
                raise leg.lost(msg)
            if op == "error" and msg.get("retry"):
                pre.load["ready"] = False
                raise LegLost(f"prefill instance {pre.addr}: {msg.get('message')}")
            if op == "error":
                raise BackendError(msg.get("message", "prefill failed"), int(msg.get("status", 502)))
            if op == "out":
                early.append(msg)

    async def _next(self, leg: Leg, deadline: float | None) -> tuple[str, dict]:
        """The attempt's next event after token #1. While a lost prefill's grace runs (decode may
        still get the commit), its expiry raises that loss."""
        if leg.grace_until is None:
            return await self._get(leg.queue, self.token_timeout_s, f"decode {leg.decode.addr}", deadline)
        try:
            return await self._get(leg.queue, max(0.0, leg.grace_until - time.monotonic()), "", deadline)
        except BackendError as e:
            if e.status != 504 or "deadline" in str(e):
                raise
            raise leg.lost(leg.grace_loss) from None

    def _on_decode(self, leg: Leg, op: str, msg: dict, num_prompt: int) -> TokenEvent | None:
        """TRANSFERRING / DECODING: one event from the workers -> the tokens to deliver (None: none).
        Raises BackendError (decode failed, or lost mid-stream)."""
        if op == "out":
            leg.committed()                     # decode runs it: the state was committed
            ids = list(msg.get("ids") or [])
            return TokenEvent(ids, unpack_sampled(ids, msg.get("lps")), bool(msg.get("done")), msg.get("reason"),
                              num_prompt)
        if op == "error":
            raise BackendError(msg.get("message", "decode failed"), int(msg.get("status", 502)))
        if op == "lost":
            if msg["role"] != "prefill":
                raise leg.lost(msg)
            if leg.state is LegState.TRANSFERRING:      # wait briefly for decode's first tokens
                leg.grace_until, leg.grace_loss = time.monotonic() + self.worker_timeout_s, msg
        elif op == "transferred":
            leg.committed()
        return None
