"""``PDBackend``: the gateway's side of the P/D path, routing samples over ZMQ to workers.

Per sample: the least-loaded healthy decode instance reserves state (``reserve``), then the
least-loaded healthy prefill instance prefills with the reservation as destination
(``prefill``); token #1 comes from prefill, the rest from decode. Only pairs whose pongs say the
transfer handshake would accept them are chosen (``server.backends.instances.pick_pair``): a sample
no compatible pair can serve gets 503 before any prefill. Closing the stream early
(client gone, stop string, deadline) aborts both legs. One attempt is a ``server.backends.leg.Leg``
whose explicit state (reserving, prefilling, transferring, decoding, finished) decides what a lost
instance means and what to abort.

The connections, liveness and load of the instances are ``server.backends.links.WorkerLinks``: an
instance it finds disconnected or restarted loses its legs here (failed, retried or migrated).

A sample whose prefill or decode instance is lost before token #1 reaches the client is retried
from the reservation on (a new transfer id, ``max_retries`` times). After token #1 it *migrates*
(``max_migrations`` times, then an error event): a new pair prefills prompt + the tokens delivered
so far and samples on at the same positions with the same seed, so the stream carries exactly the
tokens an undisturbed run gives (Dynamo's request migration, made exact by the per-position draws).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from server.backends.base import BackendError, GenRequest, TokenEvent
from server.backends.instances import Instance, incompatible_pairs, pair_mismatch, pick_pair
from server.backends.leg import Leg, LegLost, LegState, LostMidStream
from server.backends.links import WorkerLinks
from server.backends.prefill_router import PrefillRouter
from server.protocol import Error, First, Kind, OutItem, Prefill, Renew, Reserve, Reserved
from server.protocol_fields import unpack_sampled

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
        max_migrations: times a sample whose decode (or prefill, before the commit) is lost after
            token #1 continues on another pair from the tokens delivered so far.
        reconnect_grace_s: how long a sample waits for a healthy instance of a role before 503 (a
            connection blip reconnects within it; a dead instance's role-mates are taken at once).
        cluster_secret: the cluster's shared secret (None: plain ZMQ): CURVE to the workers.
    """

    def __init__(self, prefill_addrs: list[str], decode_addrs: list[str], lease_s: float = 60.0,
                 queue_timeout_s: float = 600.0, first_token_timeout_s: float = 600.0,
                 token_timeout_s: float = 300.0, health_interval_s: float = 0.5, health_timeout_s: float = 30.0,
                 worker_timeout_s: float = 5.0, max_retries: int = 2, max_migrations: int = 1,
                 reconnect_grace_s: float = 5.0,
                 cluster_secret: str | None = None, prefill_routing: str = "cache_aware"):
        if not prefill_addrs or not decode_addrs:
            raise ValueError("PREFILL_IPS / DECODE_IPS: need at least one prefill and one decode instance")
        if worker_timeout_s <= 0:
            raise ValueError("worker_timeout_s: must be > 0 seconds")
        self.links = WorkerLinks(prefill_addrs, decode_addrs, self._deliver, self._lose, worker_timeout_s,
                                 health_interval_s, health_timeout_s, cluster_secret)
        self.instances, self.worker_timeout_s = self.links.instances, worker_timeout_s
        self.lease_s, self.queue_timeout_s = lease_s, queue_timeout_s
        self.first_token_timeout_s, self.token_timeout_s = first_token_timeout_s, token_timeout_s
        self.max_retries, self.max_migrations, self.reconnect_grace_s = max_retries, max_migrations, reconnect_grace_s
        self._max_unanswered = self.links.max_unanswered
        self._streams: dict[str, asyncio.Queue] = {}
        self._legs: dict[str, Leg] = {}          # attempts in flight, by transfer id (lease renewal)
        self._renew_task: asyncio.Task | None = None
        self.counters = {"retries": 0, "migrations": 0, "lost_legs": 0}
        self.router = PrefillRouter(prefill_routing)

    @property
    def max_model_len(self) -> int:
        lens = [i.load["max_model_len"] for i in self.instances if "max_model_len" in i.load]
        return min(lens) if lens else 1 << 40      # unknown until a worker answers: generate() says 503

    async def start(self) -> None:
        self.links.start()
        self._renew_task = asyncio.create_task(self._renewer())

    async def wait_ready(self, timeout_s: float) -> bool:
        """True once at least one prefill and one decode instance are healthy."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if (await self.health())["healthy"]:
                return True
            await asyncio.sleep(0.1)
        return False

    async def close(self) -> None:
        if self._renew_task is not None:
            self._renew_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._renew_task
        await self.links.close()

    async def health(self) -> dict:
        """Healthy when some healthy prefill pairs with some healthy decode (``kvtransfer.compat``);
        ``incompatible_pairs`` lists the healthy pairs that do not, each with its cause and reason."""
        h = {r: [i.addr for i in self.instances if i.role == r and i.healthy(self._max_unanswered)]
             for r in ("prefill", "decode")}
        bad = self.incompatible_pairs()
        pairs = len(h["prefill"]) * len(h["decode"]) - len(bad)
        return {"healthy": pairs > 0, "healthy_prefill": h["prefill"], "healthy_decode": h["decode"],
                "compatible_pairs": pairs, "incompatible_pairs": bad, **self.counters,
                "prefill_routing": {"policy": self.router.policy, "routed": self.router.routed,
                                    "by_prefix": self.router.by_prefix}}

    def incompatible_pairs(self) -> list[dict]:
        """The healthy pairs that are never chosen (``instances.incompatible_pairs``)."""
        return incompatible_pairs(self.instances, self._max_unanswered)

    async def _renewer(self) -> None:
        """Renews, a third of a lease after the last renewal, the reservations whose state is
        still on its way (prefill queued, computing or pushing): one ``renew`` per decode instance.
        A lease thus bounds the time without word from the gateway, not the prefill's compute time."""
        while True:
            await asyncio.sleep(min(1.0, self.lease_s / 3))
            now, due = time.monotonic(), {}
            for rid, leg in self._legs.items():
                if leg.awaits_state and now - leg.renewed_at >= leg.lease_s / 3:
                    leg.renewed_at = now
                    due.setdefault(leg.decode.addr, (leg.decode, []))[1].append(rid)
            for inst, rids in due.values():
                await self.links.send_quietly(inst, Renew(rids))

    def _deliver(self, rid: str, op: Kind, msg) -> None:
        """A worker's reply about ``rid`` (a ``server.protocol`` message) -> its attempt's queue."""
        q = self._streams.get(rid)
        if q is not None:
            q.put_nowait((op, msg))

    def _lose(self, inst: Instance, why: str) -> None:
        self.router.forget(inst.addr)         # a lost or restarted prefill's cache is gone or unknown
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

    # ---- a sample ------------------------------------------------------------------------------
    def _pick(self, role: str, decode: Instance | None = None, prompt_ids: list[int] | None = None
              ) -> Instance | None:
        """The least-loaded healthy ``role`` instance; with ``decode``, only a prefill that pairs
        with it, chosen by ``router`` for ``prompt_ids``."""
        ok = [i for i in self.instances if i.role == role and i.healthy(self._max_unanswered)
              and (decode is None or pair_mismatch(i, decode) is None)]
        if not ok:
            return None
        return self.router.choose(ok, prompt_ids) if prompt_ids is not None else min(ok, key=Instance.score)

    async def _pick_within(self, role: str, decode: Instance | None = None, prompt_ids: list[int] | None = None
                           ) -> Instance | None:
        """``_pick(role, decode, prompt_ids)``, waiting up to ``reconnect_grace_s`` for one to become healthy."""
        end = time.monotonic() + self.reconnect_grace_s
        while (inst := self._pick(role, decode, prompt_ids)) is None and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return inst

    async def _pick_pair(self) -> Instance:
        """The decode instance of a new sample (``instances.pick_pair``: only one some prefill pairs
        with), waiting up to ``reconnect_grace_s`` for one (a connection blip reconnecting).
        Raises BackendError 503 naming why there is none."""
        end = time.monotonic() + self.reconnect_grace_s
        while True:
            try:
                return pick_pair(self.instances, self._max_unanswered)
            except BackendError:
                if time.monotonic() >= end:
                    raise
            await asyncio.sleep(0.05)

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
            Reserve(rid=req.request_id, prompt_ids=req.prompt_ids, params=req.params).pack()   # as it would travel
        except (OverflowError, ValueError, TypeError) as e:     # e.g. an integer beyond 64 bits
            raise BackendError(f"a request field does not fit the worker protocol: {e}", 400) from None
        attempt = migrations = 0
        done: list[int] = []            # tokens delivered: a migration continues after them
        while True:
            tid = req.request_id if attempt == 0 else f"{req.request_id}~retry{attempt}"   # ids never reused
            inner = self._sample(req, tid, done)
            try:
                async for ev in inner:
                    done += ev.token_ids
                    yield ev
                return
            except LegLost as e:
                attempt += 1
                if attempt > self.max_retries + migrations:
                    raise BackendError(f"{e} (gave up after {attempt} attempts)", 502) from None
                self.counters["retries"] += 1
                log.warning("gateway: sample %s: %s; retrying (attempt %d)", req.request_id, e, attempt + 1)
            except LostMidStream as e:
                migrations += 1
                if migrations > self.max_migrations:
                    raise BackendError(str(e), 502) from None
                attempt += 1
                self.counters["migrations"] += 1
                log.warning("gateway: sample %s: %s; continuing after its %d tokens on another pair",
                            req.request_id, e, len(done))
            finally:
                await inner.aclose()

    async def _sample(self, req: GenRequest, rid: str, done: list[int]) -> AsyncIterator[TokenEvent]:
        """One attempt under transfer id ``rid``, continuing after the tokens ``done`` (a migration:
        both workers compute prompt + ``done`` and sample on from there). Raises LegLost before its
        first event if an instance of its legs is lost, LostMidStream after, BackendError otherwise."""
        dec = await self._pick_pair()
        leg = Leg(rid, dec)
        self._streams[rid], self._legs[rid] = leg.queue, leg
        try:
            t0 = time.monotonic()
            dest = await self._reserve(leg, req, done)
            room_s = time.monotonic() - t0          # waited for decode room: part of the queue time
            first, early = await self._prefill(leg, req, done, dest)
            leg.first_token()
            tok = first.id
            if first.done:                     # token #1 ended it: free decode's reservation now
                leg.finished()
                await self.links.abort(dec, rid)
            yield TokenEvent([tok], unpack_sampled([tok], first.lps), bool(first.done), first.reason,
                             len(req.prompt_ids), None if done or first.queue_s is None else room_s + first.queue_s,
                             num_cached_tokens=first.cached if isinstance(first.cached, int) else 0)
            if first.done:
                return
            pending = [(Kind.OUT, m) for m in early]
            while True:
                op, msg = pending.pop(0) if pending else await self._next(leg, req.deadline)
                ev = self._on_decode(leg, op, msg, len(req.prompt_ids))
                if ev is not None:
                    if ev.finished:            # before the yield: a consumer may close us there
                        leg.finished()
                    yield ev
                    if ev.finished:
                        return
        finally:
            self._streams.pop(rid, None)
            self._legs.pop(rid, None)
            for inst in leg.release():
                await self.links.abort(inst, rid)

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        """Seconds the sample may still run, for a worker message's ``deadline_s`` (None: no deadline)."""
        return None if deadline is None else max(0.001, deadline - time.monotonic())

    async def _reserve(self, leg: Leg, req: GenRequest, done: list[int]) -> str:
        """RESERVING: decode reserves the sample's state (continuing after ``done``, the tokens
        delivered so far). Returns the reservation's state address.
        Raises LegLost (decode lost, or draining), BackendError (decode refused: its status)."""
        dec = leg.decode
        await self.links.send(dec, Reserve(rid=leg.rid, prompt_ids=req.prompt_ids, params=req.params,
                                           output_ids=list(done), lease_s=self.lease_s,
                                           deadline_s=self._left(req.deadline)))
        op, msg = await self._get(leg.queue, self.queue_timeout_s, f"decode {dec.addr} to reserve state (queued)",
                                  req.deadline)
        if op == "lost":
            raise leg.lost(msg)
        if op is Kind.ERROR and msg.retry:          # draining: refused before it knew; go elsewhere
            dec.load["ready"] = False
            raise LegLost(f"decode instance {dec.addr}: {msg.message}")
        if op is Kind.ERROR:
            raise _refused(msg, f"decode answered {op}")
        if not isinstance(msg, Reserved):
            raise BackendError(f"decode answered {op}", 502)
        lease = msg.lease_s                         # decode's (it keeps the shorter of its own and ours)
        leg.lease_s = float(lease) if isinstance(lease, (int, float)) and lease > 0 else self.lease_s
        leg.renewed_at = time.monotonic()
        return msg.state_addr

    async def _prefill(self, leg: Leg, req: GenRequest, done: list[int], dest: str) -> tuple[First, list[OutItem]]:
        """PREFILLING: a prefill instance that pairs with the leg's decode (chosen now, when the
        state has a place, by ``router``) computes the prompt into ``dest``. Returns its ``first``
        message (token #1) and decode's ``out`` messages that overtook it (two sockets).
        Raises LegLost / BackendError."""
        pre = await self._pick_within("prefill", leg.decode, req.prompt_ids + done)
        if pre is None:
            raise BackendError("no healthy prefill instance", 503)
        leg.prefill_on(pre)
        await self.links.send(pre, Prefill(rid=leg.rid, prompt_ids=req.prompt_ids, params=req.params,
                                           output_ids=list(done), dest=dest, deadline_s=self._left(req.deadline)))
        early = []
        while True:
            op, msg = await self._get(leg.queue, self.first_token_timeout_s, f"prefill {pre.addr}", req.deadline)
            if op is Kind.FIRST:
                return msg, early
            if op == "lost":
                raise leg.lost(msg)
            if op is Kind.ERROR and msg.retry:
                pre.load["ready"] = False
                raise LegLost(f"prefill instance {pre.addr}: {msg.message}")
            if op is Kind.ERROR:
                raise _refused(msg, "prefill failed")
            if op is Kind.OUT:
                early.append(msg)

    async def _next(self, leg: Leg, deadline: float | None) -> tuple[str, object]:
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

    def _on_decode(self, leg: Leg, op: str, msg, num_prompt: int) -> TokenEvent | None:
        """TRANSFERRING / DECODING: one event from the workers -> the tokens to deliver (None: none).
        Raises BackendError (decode failed, or lost mid-stream)."""
        if op is Kind.OUT:
            leg.committed()                     # decode runs it: the state was committed
            ids = list(msg.ids or [])
            return TokenEvent(ids, unpack_sampled(ids, msg.lps), bool(msg.done), msg.reason, num_prompt)
        if op is Kind.ERROR:
            raise _refused(msg, "decode failed")
        if op == "lost":
            if msg["role"] != "prefill":
                raise leg.lost(msg)
            if leg.state is LegState.TRANSFERRING:      # wait briefly for decode's first tokens
                leg.grace_until, leg.grace_loss = time.monotonic() + self.worker_timeout_s, msg
        elif op is Kind.TRANSFERRED:
            leg.committed()
        return None


def _refused(err: Error, default: str) -> BackendError:
    """The BackendError of a worker's ``error`` (its status, else 502; its message, else ``default``)."""
    return BackendError(err.message if err.message is not None else default, int(err.status))
