"""torch.distributed transport: a ZMQ sender / receiver whose payload planes move tensor bytes over
a 2-rank process group per pair.

Address: ``dist+tcp://HOST:PORT`` (or ``dist+ipc:///PATH``) names the receiver's ZMQ control
endpoint. The receiver also hosts a ``torch.distributed.TCPStore`` (``store_port``, default a free
port); its welcome tells the sender the store host/port, a pair prefix never reused, and the
ranks (sender 0, receiver 1). Both sides then build ``ProcessGroup{Gloo,NCCL,HCCL}(PrefixStore
(prefix, store), rank, 2, ...)``; the receiver does it on the pair's own thread, never on the
socket thread. The global default group is never touched, so a process can talk to many peers.

Per message: the header frame goes over ZMQ ([M, header]); the tensor bytes follow on the pair's
group in a plan both sides derive from the header alone: frames under ``coalesce_bytes`` are packed
into one buffer (one op instead of hundreds of tiny ones), larger frames go one op each, zero-copy
from the sender's buffers; empty frames send nothing. Tag = op index within the message. The
receiver reassembles [header, buf_1 .. buf_n] so ``wire.decode_state`` works unchanged.

Backend by device: "cpu" -> gloo, "cuda[:i]" -> nccl, "npu[:i]" -> hccl (torch_npu); only gloo is
exercised here. The data plane trusts its peer like any c10d group does: gloo aborts the process
when a peer sends more bytes than a posted recv (the sender checks every frame size against the
header before sending, and a receiver that drops a header tears the pair down so the plan can never
desynchronise). Keep the store and group ports on the cluster network.

Security: ``secret`` (the cluster shared secret, passed through to the ZMQ sender / receiver)
secures the ZMQ control channel only -- hello / welcome / headers / replies under CURVE + ZAP
(``kvtransfer.secure``), so no peer without the secret can handshake and obtain a pair prefix.
The torch.distributed side cannot be authenticated or encrypted: the TCPStore and the gloo /
nccl / hccl connections accept any peer that reaches their ports and speaks their protocol, and
gloo aborts the process on unexpected bytes. The receiver binds the store to the configured
``host`` only (never all interfaces unless ``host`` is a wildcard), gloo to the same host; keep
that host on a private cluster network (or use zmq-tcp, fully covered by the secret).
"""
from __future__ import annotations

import datetime
import queue
import socket
import threading
import time
import uuid
from itertools import count

import torch
import torch.distributed as dist

from kvtransfer.interfaces import PROTOCOL_VERSION, REJECT_OP, TAG_MSG, Delivered, TransportError, check_message
from kvtransfer.transports.dist_groups import (as_u8, backend_for, local_ip_towards, make_pair_group, tcp_host,
                                               transfer_plan, wait_all)
from kvtransfer.transports.plane import Connection, Peer, ReceiverPlane, SenderPlane
from kvtransfer.transports.zmq_receiver import ZmqStateReceiver
from kvtransfer.transports.zmq_sender import ZmqStateSender
from kvtransfer.wire import TransferError


class _TxPair:
    __slots__ = ("store", "pg", "peer_rank", "coalesce")

    def __init__(self, store, pg, peer_rank, coalesce):
        self.store, self.pg, self.peer_rank, self.coalesce = store, pg, peer_rank, coalesce


def dist_sender(fingerprint: str, layout: dict, sender_id: str, device: str = "cpu", op_timeout_s: float = 120.0,
                local_host: str | None = None, **kw) -> ZmqStateSender:
    """Prefill side of the dist transport: a ZMQ sender (``ZmqStateSender``'s keyword arguments)
    whose tensor bytes go over a pair group. Frames may also be torch tensors (any device); CPU
    buffers are moved to ``device`` when it is an accelerator.

    Args: device ("cpu" -> gloo, "cuda:i" -> nccl, "npu:i" -> hccl), op_timeout_s (per group
        op), local_host (address gloo listens on; default the local address routing to the receiver).

    Raises:
        ValueError: a device without a backend, a bad sender_id or secret.
    """
    return ZmqStateSender(fingerprint, layout, sender_id, plane=DistSenderPlane(device, op_timeout_s, local_host),
                          **kw)


class DistSenderPlane(SenderPlane):
    """Tensor bytes of each message over the connection's 2-rank group, in ``transfer_plan`` order."""
    transport = "dist"
    dist_addresses = True

    def __init__(self, device: str = "cpu", op_timeout_s: float = 120.0, local_host: str | None = None):
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.op_timeout_s, self.local_host = op_timeout_s, local_host

    def handshake_fields(self) -> dict:
        return {"backend": self.backend}

    def open(self, conn: Connection, w: dict, deadline: float) -> _TxPair:
        if not (isinstance(w.get("store_port"), int) and isinstance(w.get("prefix"), str)
                and w.get("rank") in (0, 1) and isinstance(w.get("coalesce_bytes"), int)):
            raise TransportError(f"handshake with {conn.dest}: welcome lacks the dist rendezvous fields")
        host = w.get("store_host") or tcp_host(conn.zdest)
        left = max(0.5, deadline - time.monotonic())
        try:
            store = dist.TCPStore(host, w["store_port"], None, False, datetime.timedelta(seconds=left),
                                  wait_for_workers=False)
            pg = make_pair_group(self.backend, dist.PrefixStore(w["prefix"], store), w["rank"], self.op_timeout_s,
                                 self.local_host or local_ip_towards(host))
        except Exception as e:
            raise TransportError(f"dist rendezvous with {conn.dest} (store {host}:{w['store_port']}) failed: "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        return _TxPair(store, pg, 1 - w["rank"], w["coalesce_bytes"])

    def close(self, conn: Connection) -> None:
        conn.state = None   # drops the group: its connections close, a pending peer op errors

    def prepare(self, conn: Connection, frames: list, header: dict) -> list[torch.Tensor]:
        sizes = [m["nbytes"] for m in header["tensors"]]
        return [self._op_buffer(frames, op, sizes) for op in transfer_plan(sizes, conn.state.coalesce)]

    def send(self, conn: Connection, frames: list, bufs: list[torch.Tensor]) -> None:
        # any failure from here on ends the connection (the sender drops it): the receiver expects exactly these ops
        pair: _TxPair = conn.state
        conn.sock.send_multipart([TAG_MSG, frames[0]])
        try:
            wait_all([pair.pg.send([t], pair.peer_rank, tag) for tag, t in enumerate(bufs)])
        except RuntimeError as e:
            raise TransportError(f"dist send to {conn.dest} failed (decode peer gone?): "
                                 f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def _op_buffer(self, frames: list, op: list[int], sizes: list[int]) -> torch.Tensor:
        """The uint8 tensor one group op sends: the frame itself (zero-copy) or small frames packed."""
        if len(op) == 1:
            return as_u8(frames[1 + op[0]], self.device)
        if self.device.type == "cpu" and not any(isinstance(frames[1 + i], torch.Tensor) for i in op):
            packed, off = bytearray(sum(sizes[i] for i in op)), 0   # plain memcpy, no intra-op threads
            for i in op:
                packed[off:off + sizes[i]] = memoryview(frames[1 + i]).cast("B")
                off += sizes[i]
            return torch.frombuffer(packed, dtype=torch.uint8)
        t = torch.empty(sum(sizes[i] for i in op), dtype=torch.uint8, device=self.device)
        off = 0
        for i in op:
            t[off:off + sizes[i]].copy_(as_u8(frames[1 + i], self.device))
            off += sizes[i]
        return t


class _RxPair:
    """Receiver side of one pair: its thread builds the group, then receives messages in order."""

    def __init__(self, peer: Peer, prefix: str):
        self.peer, self.prefix = peer, prefix
        self.q: queue.SimpleQueue = queue.SimpleQueue()   # (header buffer, header dict, nbytes) | None
        self.lock = threading.Lock()                      # ``dead`` and what is queued
        self.stop = threading.Event()
        self.dead = False
        self.thread: threading.Thread | None = None


def dist_receiver(host: str, port: int, fingerprint: str, layout: dict, store_port: int = 0,
                  advertise_host: str | None = None, device: str = "cpu", op_timeout_s: float = 120.0,
                  coalesce_bytes: int = 1 << 20, deliver: str = "cpu", ipc_path: str | None = None,
                  rendezvous_timeout_s: float = 30.0, **kw) -> ZmqStateReceiver:
    """Decode side of the dist transport: a ZMQ receiver (``ZmqStateReceiver``'s keyword arguments)
    at ``dist+tcp://HOST:PORT`` (``dist+ipc://PATH`` with ``ipc_path``) whose tensor bytes arrive
    over one pair group per sender.

    Args: store_port (TCPStore, 0: a free port), advertise_host (store host put in the welcome;
        default the bind host, or the sender's dest host for wildcards), device (as for the
        sender), op_timeout_s (per group op), rendezvous_timeout_s (how long a pair thread waits
        for the sender to join its group), coalesce_bytes (frames smaller than this are packed
        into one op), deliver ("cpu": frames are host buffers for wire.decode_state; "device":
        uint8 device tensors, accelerators only).

    Raises:
        ValueError: bad ``deliver`` / device. OSError, zmq.ZMQError: an address cannot be bound.
    """
    plane = DistReceiverPlane(host, store_port, advertise_host, device, op_timeout_s, coalesce_bytes, deliver,
                              rendezvous_timeout_s)
    try:
        return ZmqStateReceiver("zmq-ipc" if ipc_path else "zmq-tcp", host, port, fingerprint, layout,
                                ipc_path=ipc_path, advertise_host=advertise_host, plane=plane, **kw)
    except BaseException:
        plane.close()
        raise


class DistReceiverPlane(ReceiverPlane):
    """Hosts the TCPStore; one pair (group + thread) per handshaked sender (``dist_receiver``'s args)."""
    transport = "dist"
    address_prefix = "dist+"
    counters = ("pair_failures",)

    def __init__(self, host: str, store_port: int, advertise_host: str | None, device: str, op_timeout_s: float,
                 coalesce_bytes: int, deliver: str, rendezvous_timeout_s: float):
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.op_timeout_s, self.coalesce_bytes, self.deliver_to = op_timeout_s, int(coalesce_bytes), deliver
        if deliver not in ("cpu", "device"):
            raise ValueError(f"deliver must be 'cpu' or 'device', found {deliver!r}")
        wildcard = host in ("0.0.0.0", "::", "*", "")
        # TCPStore alone listens on every interface: hand it a socket bound to ``host`` instead
        lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind(("0.0.0.0" if host in ("*", "") else host, store_port))
            lsock.listen(128)
            self.store_port = lsock.getsockname()[1]
            self._store = dist.TCPStore(host if not wildcard else "0.0.0.0", self.store_port, None, True,
                                        datetime.timedelta(seconds=rendezvous_timeout_s), wait_for_workers=False,
                                        master_listen_fd=lsock.detach())
        finally:
            lsock.close()
        self._store_host = advertise_host or (None if wildcard else host)
        self._gloo_host = None if wildcard else host
        self._pairs_n = count()
        self._pairs: set[_RxPair] = set()
        self._pairs_lock = threading.Lock()

    def handshake_fields(self) -> dict:
        return {"backend": self.backend}

    def welcome(self, peer: Peer, hello: dict) -> dict:
        pair = _RxPair(peer, f"dsv4-pd/{self.rx.receiver_id}/{uuid.uuid4().hex[:8]}/{next(self._pairs_n)}")
        pair.thread = threading.Thread(target=self._pair_main, args=(pair,), daemon=True,
                                       name=f"state-rx-pair-{peer.peer_id}")
        peer.state = pair
        with self._pairs_lock:
            self._pairs.add(pair)
        pair.thread.start()
        return {"store_host": self._store_host, "store_port": self.store_port, "prefix": pair.prefix, "rank": 0,
                "coalesce_bytes": self.coalesce_bytes}

    def accept(self, peer: Peer, frames: list) -> None:
        h = check_message(frames, self.rx.limits, with_tensor_frames=False)
        nbytes = len(frames[0]) + sum(m["nbytes"] for m in h["tensors"])
        pair: _RxPair = peer.state
        with pair.lock:   # the pair thread sets ``dead`` under this lock before releasing its queue
            if pair.dead:
                raise TransferError("dist pair failed; handshake again")
            self.rx.reserve(nbytes)
            pair.q.put((frames[0], h, nbytes))

    def dropped(self, peer: Peer) -> None:
        # the sender will push this message's tensors anyway: never let the plan desynchronise
        self.rx.forget(peer)

    def peer_gone(self, peer: Peer, graceful: bool = False) -> None:
        pair: _RxPair | None = peer.state
        if pair is not None:
            if not graceful:   # graceful: the pair thread finishes the queued messages first
                pair.stop.set()
            pair.q.put(None)

    def close(self) -> None:
        with self._pairs_lock:
            pairs = list(self._pairs)
        for p in pairs:
            p.stop.set()
            p.q.put(None)
        for p in pairs:
            p.thread.join(5)   # one still in rendezvous / mid-message ends at its timeout (daemon)
        self._store = None    # releases the store port once no group holds it

    # -- the pair thread -------------------------------------------------------------------
    def _pair_main(self, pair: _RxPair) -> None:
        pg = None
        try:
            pg = make_pair_group(self.backend, dist.PrefixStore(pair.prefix, self._store), 1, self.op_timeout_s,
                                 self._gloo_host)
            while not pair.stop.is_set():
                item = pair.q.get()
                if item is None:
                    break
                hbuf, h, nbytes = item
                frames = self._recv_tensors(pg, h)
                self.rx.deliver(Delivered(pair.peer.peer_id, h, [hbuf, *frames], nbytes), reserved=True)
        except Exception as e:
            if not pair.stop.is_set():
                self.rx.count("pair_failures")
                if self.rx.forget(pair.peer):
                    self.rx.send_control(pair.peer, {
                        "op": REJECT_OP, "v": PROTOCOL_VERSION, "transfer_id": None,
                        "reason": f"dist pair failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"})
        finally:
            with pair.lock:
                pair.dead = True
                while True:   # release reservations of messages that will never arrive
                    try:
                        item = pair.q.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        self.rx.release(item[2])
            with self._pairs_lock:
                self._pairs.discard(pair)
            del pg

    def _recv_tensors(self, pg, h: dict) -> list:
        metas = h["tensors"]
        sizes = [m["nbytes"] for m in metas]
        plan = transfer_plan(sizes, self.coalesce_bytes)
        bufs = [torch.empty(sum(sizes[i] for i in op), dtype=torch.uint8, device=self.device) for op in plan]
        works = [pg.recv([b], 0, tag) for tag, b in enumerate(bufs)]
        wait_all(works)
        frames: list = [b""] * len(sizes)
        to_host = self.deliver_to == "cpu" or self.device.type == "cpu"
        for op, b in zip(plan, bufs):
            buf = memoryview(b.cpu().numpy()) if to_host else b   # both slice without copying
            off = 0
            for i in op:
                frames[i] = buf[off:off + sizes[i]]
                off += sizes[i]
        if self.deliver_to == "device" and self.device.type != "cpu":
            frames = [f if isinstance(f, torch.Tensor) else torch.empty(0, dtype=torch.uint8, device=self.device)
                      for f in frames]
        return frames
