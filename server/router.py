"""``PDBackend``: the gateway's side of the P/D path, routing samples over ZMQ to workers.

Per sample: the least-loaded healthy decode instance reserves state (``reserve``), then the
least-loaded healthy prefill instance prefills with the reservation as destination
(``prefill``); token #1 comes from prefill, the rest from decode. Closing the stream early
(client gone, stop string) aborts both legs. Instances are pinged every ``health_interval_s``;
one that has left ``health_timeout_s / health_interval_s`` pings unanswered (or says it is not
ready) gets no new samples. Workers answer between engine steps, so the timeout must exceed the
longest step (a long prefill).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from server.backend import BackendError, GenRequest, TokenEvent
from server.messages import MessageError, pack, params_to_dict, unpack, unpack_sampled

log = logging.getLogger(__name__)


def parse_addrs(value: str | list[str] | None, default_port: int) -> list[str]:
    """``"h1 h2:5600,h3"`` -> ``["h1:<default_port>", "h2:5600", "h3:<default_port>"]``.
    Raises ValueError naming a bad entry."""
    if value is None:
        return []
    items = value if isinstance(value, list) else value.replace(",", " ").split()
    out = []
    for it in items:
        host, _, port = it.strip().rpartition(":") if ":" in it else (it.strip(), "", str(default_port))
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"instance address {it!r}: expected host or host:port")
        out.append(f"{host}:{int(port)}")
    return out


@dataclass
class Instance:
    """One worker instance as the gateway sees it."""

    role: str
    addr: str
    sock: zmq.asyncio.Socket
    load: dict = field(default_factory=dict)
    unanswered: int = 1 << 30         # pings sent since its last message (counted by the pinger, so a
    inflight: int = 0                 # busy gateway loop cannot make a live instance look stale)

    def healthy(self, max_unanswered: int) -> bool:
        return bool(self.load.get("ready")) and self.unanswered <= max_unanswered

    def score(self) -> float:
        ld = self.load
        if self.role == "decode":
            busy = ld.get("running", 0) + ld.get("reserved", 0) + ld.get("queued", 0) + self.inflight
            return busy / max(1, ld.get("batch_size", 1)) + ld.get("kv_usage", 0.0)
        return self.inflight + ld.get("waiting", 0)


class PDBackend:
    """Implements ``server.backend.Backend`` over prefill / decode workers."""

    def __init__(self, prefill_addrs: list[str], decode_addrs: list[str], lease_s: float = 60.0,
                 queue_timeout_s: float = 600.0, first_token_timeout_s: float = 600.0,
                 token_timeout_s: float = 300.0, health_interval_s: float = 0.5, health_timeout_s: float = 30.0):
        if not prefill_addrs or not decode_addrs:
            raise ValueError("PREFILL_IPS / DECODE_IPS: need at least one prefill and one decode instance")
        self.ctx = zmq.asyncio.Context()
        self.instances = [self._connect(r, a) for r, addrs in (("prefill", prefill_addrs), ("decode", decode_addrs))
                          for a in addrs]
        self.lease_s, self.queue_timeout_s = lease_s, queue_timeout_s
        self.first_token_timeout_s, self.token_timeout_s = first_token_timeout_s, token_timeout_s
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self._max_unanswered = max(2, round(health_timeout_s / health_interval_s))
        self._streams: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._ready = asyncio.Event()

    def _connect(self, role: str, addr: str) -> Instance:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)          # no queueing towards an instance that is not connected
        s.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        s.connect(f"tcp://{addr}")
        return Instance(role, addr, s)

    @property
    def max_model_len(self) -> int:
        lens = [i.load["max_model_len"] for i in self.instances if "max_model_len" in i.load]
        return min(lens) if lens else 1 << 40      # unknown until a worker answers: generate() says 503

    async def start(self) -> None:
        for inst in self.instances:
            self._tasks.append(asyncio.create_task(self._reader(inst)))
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
            inst.sock.close(0)
        self.ctx.term()

    async def health(self) -> dict:
        h = {r: [i.addr for i in self.instances if i.role == r and i.healthy(self._max_unanswered)]
             for r in ("prefill", "decode")}
        return {"healthy": bool(h["prefill"] and h["decode"]), "healthy_prefill": h["prefill"],
                "healthy_decode": h["decode"]}

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
                inst.load = msg
            elif op == "out":
                for item in msg.get("items") or []:
                    q = self._streams.get(item.get("rid")) if isinstance(item, dict) else None
                    if q is not None:
                        q.put_nowait(("out", item))
            else:
                q = self._streams.get(msg.get("rid"))
                if q is not None:
                    q.put_nowait((op, msg))

    # ---- a sample ------------------------------------------------------------------------------
    def _pick(self, role: str) -> Instance | None:
        ok = [i for i in self.instances if i.role == role and i.healthy(self._max_unanswered)]
        return min(ok, key=Instance.score) if ok else None

    async def _send(self, inst: Instance, msg: dict) -> None:
        try:
            await inst.sock.send(pack(msg), zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as e:
            raise BackendError(f"{inst.role} instance {inst.addr} is unreachable ({e})", 503) from None

    async def _get(self, q: asyncio.Queue, timeout: float, what: str):
        try:
            return await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            raise BackendError(f"timed out after {timeout:g} s waiting for {what}", 504) from None

    async def generate(self, req: GenRequest) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        if rid in self._streams:
            raise BackendError(f"request id {rid!r} is in use", 400)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        dec = self._pick("decode")
        if dec is None or self._pick("prefill") is None:
            del self._streams[rid]
            raise BackendError("no healthy " + ("decode" if dec is None else "prefill") + " instance", 503)
        pre = dec                        # until prefill is picked (after the reservation)
        dec.inflight += 1
        legs = [dec]
        finished = False
        params = params_to_dict(req.params)
        try:
            pack({"prompt_ids": req.prompt_ids, "params": params})
        except (OverflowError, ValueError, TypeError) as e:     # e.g. an integer beyond 64 bits
            del self._streams[rid]
            dec.inflight -= 1
            raise BackendError(f"a request field does not fit the worker protocol: {e}", 400) from None
        try:
            await self._send(dec, {"op": "reserve", "rid": rid, "prompt_ids": req.prompt_ids, "params": params,
                                   "lease_s": self.lease_s})
            op, msg = await self._get(q, self.queue_timeout_s, f"decode {dec.addr} to reserve state (queued)")
            if op != "reserved":
                raise BackendError(msg.get("message", f"decode answered {op}"), int(msg.get("status", 502)))
            picked = self._pick("prefill")    # chosen now: the least loaded when the state has a place
            if picked is None:
                raise BackendError("no healthy prefill instance", 503)
            pre = picked
            legs.append(pre)
            pre.inflight += 1
            await self._send(pre, {"op": "prefill", "rid": rid, "prompt_ids": req.prompt_ids, "params": params,
                                   "dest": msg["state_addr"]})
            early = []                 # decode's tokens can overtake prefill's reply (two sockets)
            while True:
                op, msg = await self._get(q, self.first_token_timeout_s, f"prefill {pre.addr}")
                if op == "first":
                    break
                if op == "error":
                    raise BackendError(msg.get("message", "prefill failed"), int(msg.get("status", 502)))
                if op == "out":
                    early.append(msg)
            pre.inflight -= 1
            legs.remove(pre)
            tok = msg["id"]
            yield TokenEvent([tok], unpack_sampled([tok], msg.get("lps")), bool(msg["done"]), msg.get("reason"),
                             len(req.prompt_ids), msg.get("queue_s"))
            if msg["done"]:                  # token #1 ended it: free decode's reservation now
                finished = True
                with contextlib.suppress(BackendError):
                    await self._send(dec, {"op": "abort", "rid": rid})
                return
            pending = list(early)
            while True:
                if pending:
                    op, msg = "out", pending.pop(0)
                else:
                    op, msg = await self._get(q, self.token_timeout_s, f"decode {dec.addr}")
                if op == "out":
                    ids = list(msg.get("ids") or [])
                    yield TokenEvent(ids, unpack_sampled(ids, msg.get("lps")), bool(msg.get("done")),
                                     msg.get("reason"), len(req.prompt_ids))
                    if msg.get("done"):
                        finished = True
                        return
                elif op == "error":
                    raise BackendError(msg.get("message", "decode failed"), int(msg.get("status", 502)))
                # "transferred" from prefill: informational
        finally:
            self._streams.pop(rid, None)
            for inst in legs:
                inst.inflight -= 1
            if not finished:
                for inst in {id(i): i for i in (dec, pre)}.values():
                    with contextlib.suppress(BackendError):
                        await self._send(inst, {"op": "abort", "rid": rid})
