"""``WorkerLinks``: the gateway's connections to its worker instances, and what it knows of each.

One DEALER socket per instance (CURVE with a cluster secret), and three I/O tasks on them:

- liveness: ZMTP heartbeats (libzmq's I/O threads answer them even while a worker is inside a
  long engine step) and the socket monitor. A worker killed (connection closed) or stopped (no
  heartbeat answer within ``worker_timeout_s``) is *disconnected* at once (``on_lost``), and gets
  no new samples until it is connected again.
- load and readiness: ``ping`` -> ``pong`` (the ``/ready`` body, answered between engine steps,
  and during a long one by the worker's ``StepPings`` with ``step_s``, the step's age so far).
  An instance that is not ready (starting, draining), whose last ``health_timeout_s`` of pings
  went unanswered, or whose step has run longer than that, gets no new samples. A new
  ``instance_id`` in a pong means the process behind the address restarted: legs on the old
  process are lost.
- every reply about a sample is read into its ``server.protocol`` class and handed to
  ``deliver(rid, kind, message)`` (``out`` batches split into their ``OutItem`` per sample).

An abort that cannot be sent (the instance is disconnected: a blip) is kept and sent when the
connection is back, with a ping at once, so no work is orphaned there and samples waiting for a
healthy instance need not wait a ping period.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvtransfer.secure import cluster_keys, secure_client
from server.backends.base import BackendError
from server.backends.instances import Instance
from server.heartbeat import set_heartbeat
from server.protocol import REPLIES, Abort, Kind, Message, Out, Ping, kind_of, read
from server.protocol_fields import MAX_MESSAGE_BYTES, MessageError, unpack

log = logging.getLogger(__name__)

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class WorkerLinks:
    """Sockets, liveness and load of the prefill / decode instances.

    Args:
        prefill_addrs / decode_addrs: ``host:port`` of each instance's request endpoint.
        deliver: called as ``(rid, kind, message)`` for each reply about a sample (``message``: its
            ``server.protocol`` class; ``out``: one ``OutItem``).
        on_lost: called as ``(instance, why)`` when an instance disconnects or restarted.
        worker_timeout_s / health_interval_s / health_timeout_s / cluster_secret: as ``PDBackend``.
    """

    def __init__(self, prefill_addrs: list[str], decode_addrs: list[str],
                 deliver: Callable[[str, Kind, object], None], on_lost: Callable[[Instance, str], None],
                 worker_timeout_s: float = 5.0, health_interval_s: float = 0.5, health_timeout_s: float = 30.0,
                 cluster_secret: str | None = None):
        self.ctx = zmq.asyncio.Context()
        self.worker_timeout_s, self.keys = worker_timeout_s, cluster_keys(cluster_secret)
        self.deliver, self.on_lost = deliver, on_lost
        self.health_interval_s = health_interval_s
        self.max_unanswered = max(2, round(health_timeout_s / health_interval_s))
        self.instances = [self._connect(r, a) for r, addrs in (("prefill", prefill_addrs), ("decode", decode_addrs))
                          for a in addrs]
        self._tasks: list[asyncio.Task] = []

    def _connect(self, role: str, addr: str) -> Instance:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)          # no queueing towards an instance that is not connected
        s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        set_heartbeat(s, self.worker_timeout_s)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        secure_client(s, self.keys)              # no-op without a secret
        return Instance(role, addr, s)            # connected in start(), once its monitor listens

    def start(self) -> None:
        """Connect every instance and start the I/O tasks (``close`` cancels them)."""
        for inst in self.instances:
            mon = inst.sock.get_monitor_socket(_EVENTS)
            self._tasks.append(asyncio.create_task(self._monitor(inst, mon)))
            self._tasks.append(asyncio.create_task(self._reader(inst)))
            inst.sock.connect(f"tcp://{inst.addr}")
        self._tasks.append(asyncio.create_task(self._pinger()))

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

    def healthy(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role and i.healthy(self.max_unanswered)]

    # ---- sending -------------------------------------------------------------------------------
    async def send(self, inst: Instance, msg: Message) -> None:
        """Send ``msg`` to ``inst`` now. Raises BackendError 503 if it is unreachable (not connected)."""
        try:
            await inst.sock.send(msg.pack(), zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as e:
            raise BackendError(f"{inst.role} instance {inst.addr} is unreachable ({e})", 503) from None

    async def abort(self, inst: Instance, rid: str) -> None:
        """Abort ``rid`` on ``inst``; one that cannot be sent now (disconnected) is sent on reconnect."""
        try:
            await self.send(inst, Abort(rid))
        except BackendError:
            inst.pending_aborts[rid] = None
            while len(inst.pending_aborts) > 1 << 16:          # the oldest are the least likely still running
                del inst.pending_aborts[next(iter(inst.pending_aborts))]

    async def send_quietly(self, inst: Instance, msg: Message) -> None:
        """Send ``msg`` if ``inst`` is reachable (a renewal, a ping: the next one will do)."""
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            await inst.sock.send(msg.pack(), zmq.NOBLOCK)

    # ---- I/O tasks -----------------------------------------------------------------------------
    async def _pinger(self) -> None:
        ping = Ping().pack()
        while True:
            for inst in self.instances:
                was = inst.healthy(self.max_unanswered)
                inst.unanswered = min(inst.unanswered + 1, 1 << 30)
                if was and not inst.healthy(self.max_unanswered):
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
                    await self._reconnected(inst)
                elif e == zmq.EVENT_DISCONNECTED and inst.connected:
                    inst.connected = False
                    inst.load = {}                  # ready again only when it answers a ping
                    self.on_lost(inst, "disconnected (killed, stopped or unreachable)")
                else:                               # a handshake failed or was cut short
                    failed += 1
                    if failed == 3:                 # once per run of failures, not per retry
                        log.error("gateway: %s %s: the ZMQ handshake keeps failing: the cluster secret "
                                  "(DSV4_CLUSTER_SECRET) differs, the process is stopped, or it is not a "
                                  "dsv4-pd worker", inst.role, inst.addr)
        finally:
            mon.close(0)

    async def _reconnected(self, inst: Instance) -> None:
        """A (re)connected instance: the aborts it missed while away are sent now, then a ping."""
        aborts, inst.pending_aborts = inst.pending_aborts, {}
        for rid in aborts:
            await self.abort(inst, rid)         # dropped again (kept) if the connection went meanwhile
        await self.send_quietly(inst, Ping())

    async def _reader(self, inst: Instance) -> None:
        while True:
            frame = await inst.sock.recv()
            try:
                msg = unpack(frame)
                kind = kind_of(msg)
                inst.unanswered = 0                 # any message: its loop is alive
                if kind is Kind.PONG:
                    self._on_pong(inst, msg)
                elif kind is Kind.OUT:
                    for item in Out.read(msg).items:
                        self.deliver(item.rid, kind, item)
                elif kind in REPLIES and isinstance(rid := msg.get("rid"), str):
                    self.deliver(rid, kind, read(REPLIES[kind], msg))
            except MessageError as e:
                log.warning("gateway: bad message from %s %s: %s", inst.role, inst.addr, e)

    def _on_pong(self, inst: Instance, msg: dict) -> None:
        """Keep the pong's map as the instance's load (``instances`` reads its fields with defaults)."""
        step_s = msg.get("step_s")                  # answered during a step that has run this long
        if isinstance(step_s, (int, float)) and 0 < step_s < 1e9:
            # a step past health_timeout_s counts as that many unanswered pings: a hung
            # step still takes the instance out of routing
            inst.unanswered = min(int(step_s / self.health_interval_s), 1 << 30)
        iid = msg.get("instance_id")
        if inst.instance_id is not None and iid != inst.instance_id:
            self.on_lost(inst, f"restarted (instance {inst.instance_id} -> {iid})")
        inst.instance_id = iid
        inst.load = msg
