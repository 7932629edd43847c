"""Issue 21: a reset state connection (``ss -K`` on the state port, a relay restart on zmq-ipc) with
both processes alive costs no transfer; a decode replaced behind the same address gets a fresh
handshake before the next transfer, and a transfer whose reservation died with the old decode
still fails cleanly (never hangs)."""
from __future__ import annotations

import time

import pytest

from kvtransfer import make_sender
from kvtransfer.receiver import TransferReceiver
from kvtransfer.sender import Pusher
from kvtransfer.wire import encode_commit, encode_layer

from .common import FP, KINDS, LAYOUT, free_port, same_tensors, sample_tensors
from relay_util import Relay

NUM_LAYERS = 3


def layer_tensors(seed: int, layer: int, big: int = 0) -> dict:
    t = {k.replace("layers.0.", f"layers.{layer}.").replace("layers.1.", f"layers.{layer}."): v
         for k, v in sample_tensors(seed * 10 + layer).items()}
    if big:
        t[f"layers.{layer}.big"] = sample_tensors(seed, big)["layers.2.big"]
    return t


def push(pusher: Pusher, tid: str, dest: str, seed: int, big: int = 0) -> dict:
    """A layer-by-layer transfer as the prefill worker pushes it; returns what decode must load."""
    want = {}
    for layer in range(NUM_LAYERS):
        t = layer_tensors(seed, layer, big)
        want.update(t)
        pusher.put("layer", tid, dest, encode_layer(tid, FP, 5, layer, t))
    pusher.put("commit", tid, dest, encode_commit(tid, FP, 5, 7, NUM_LAYERS))
    return want


def run_transfer(pusher: Pusher, trx: TransferReceiver, tid: str, timeout_s: float = 30.0):
    """Decode's loop for one transfer: load each layer, ack the commit. Returns (pusher Result,
    tensors loaded); fails the test if nothing comes back within ``timeout_s``."""
    got, end = {}, time.monotonic() + timeout_s
    while time.monotonic() < end:
        for act in trx.poll():
            if act.kind == "load":
                got.update(act.tensors)
            elif act.kind == "commit":
                trx.ack(act.peer, tid, act.pending.nbytes)
        res = [r for r in pusher.results() if r.transfer_id == tid]
        if res:
            return res[0], got
        time.sleep(0.005)
    pytest.fail(f"transfer {tid}: no result within {timeout_s} s (hang); receiver stats "
                f"{trx.transport.stats}")


def _addresses(kind: str, tmp_path):
    """(receiver kwargs, relay listen endpoint, dest prefix) for ``kind``."""
    prefix = "dist+" if kind.startswith("dist") else ""
    if kind in ("zmq-ipc", "dist-ipc"):   # dist-ipc: dist's ZMQ control channel over a unix socket
        return {"ipc_path": str(tmp_path / "rx.sock")}, f"ipc://{tmp_path / 'relay.sock'}", prefix
    return {}, f"tcp://127.0.0.1:{free_port()}", prefix


@pytest.mark.parametrize("kind", KINDS + ["dist-ipc"])
def test_a_reset_before_each_transfer_costs_none(net, kind, tmp_path):
    """10 transfers, the state connection aborted (both ends alive) before each: all 10 acked,
    byte-exact, and the receiver never saw a message from an unknown peer."""
    kw, listen, prefix = _addresses(kind, tmp_path)
    kind = kind.removesuffix("-ipc") if kind == "dist-ipc" else kind
    rx = net.rx(kind, **kw)
    relay = Relay(rx.address.removeprefix("dist+"), listen)
    net.items.append(relay)
    trx = TransferReceiver(rx, FP, NUM_LAYERS)
    sender_kw = {"op_timeout_s": 20} if kind == "dist" else {}
    pusher = Pusher(lambda: make_sender(kind, FP, LAYOUT, "prefill-reset", **sender_kw), ack_timeout_s=30)
    dest = prefix + relay.address
    try:
        for i in range(11):                      # t0 handshakes; t1..t10 each follow a reset
            if i:
                assert relay.reset() == 1        # the one live connection was aborted
            tid = f"t{i}"
            trx.expect(tid, 5, lease_s=60)
            want = push(pusher, tid, dest, i, big=300_000 if i % 3 == 0 else 0)
            res, got = run_transfer(pusher, trx, tid)
            assert res.kind == "acked", (i, res)
            assert same_tensors(dict(sorted(got.items())), dict(sorted(want.items())))
    finally:
        pusher.close()
    assert relay.resets == 10
    assert rx.stats["dropped_unknown_peer"] == 0 and rx.stats["dropped_malformed"] == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("named", [False, True], ids=["addr", "addr#receiver"])
def test_a_replaced_decode_fails_the_old_reservation_cleanly_and_serves_the_next(net, kind, named, tmp_path):
    """Decode replaced behind the same address mid-transfer (its layers already landed in the old
    one): that transfer fails promptly (nack ``unknown`` from the new decode, or TransportError when
    ``dest`` names the old receiver), never hangs; the next transfer, reserved on the new decode,
    is acked (the sender says hello again before it, it is not rejected)."""
    kw = {"port": free_port(), **({"ipc_path": str(tmp_path / "rx.sock")} if kind == "zmq-ipc" else {})}
    if kind == "dist":
        kw["store_port"] = free_port()
    old = net.rx(kind, receiver_id="decode-old", **kw)
    trx = TransferReceiver(old, FP, NUM_LAYERS)
    pusher = Pusher(lambda: make_sender(kind, FP, LAYOUT, "prefill-replaced"), ack_timeout_s=60)
    dest = lambda rx: rx.address + (f"#{rx.receiver_id}" if named else "")   # noqa: E731
    try:
        trx.expect("t0", 5, lease_s=60)
        push(pusher, "t0", dest(old), 0)
        assert run_transfer(pusher, trx, "t0")[0].kind == "acked"
        trx.expect("t1", 5, lease_s=60)
        for layer in range(NUM_LAYERS):
            pusher.put("layer", "t1", dest(old), encode_layer("t1", FP, 5, layer, layer_tensors(1, layer)))
        loaded, end = 0, time.monotonic() + 20
        while loaded < NUM_LAYERS and time.monotonic() < end:
            loaded += sum(a.kind == "load" for a in trx.poll())
        assert loaded == NUM_LAYERS
        old.close()                              # decode restarts: t1's reservation is gone
        new = net.rx(kind, receiver_id="decode-new", **kw)
        trx2 = TransferReceiver(new, FP, NUM_LAYERS)
        time.sleep(0.2)
        pusher.put("commit", "t1", dest(old), encode_commit("t1", FP, 5, 7, NUM_LAYERS))
        t_end = time.monotonic() + 15
        while time.monotonic() < t_end and not (res := [r for r in pusher.results() if r.transfer_id == "t1"]):
            trx2.poll()                          # the new decode nacks what it never reserved
            time.sleep(0.01)
        assert res and res[0].kind == "failed", res
        assert ("restarted" in res[0].message) if named else res[0].cause == "unknown", res[0]
        trx2.expect("t2", 5, lease_s=60)
        want = push(pusher, "t2", dest(new), 2)
        res2, got = run_transfer(pusher, trx2, "t2")
        assert res2.kind == "acked", res2
        assert same_tensors(dict(sorted(got.items())), dict(sorted(want.items())))
        assert new.stats["dropped_unknown_peer"] == 0
    finally:
        pusher.close()


@pytest.mark.parametrize("kind", ["zmq-tcp", "zmq-ipc"])
def test_a_reply_sent_while_the_sender_reconnects_arrives(net, kind, tmp_path):
    """decode acks while the connection is down (ROUTER_MANDATORY: EHOSTUNREACH): the ack is
    retried until libzmq has reconnected, not dropped (prefill would wait out its ack timeout)."""
    kw, listen, _ = _addresses(kind, tmp_path)
    rx = net.rx(kind, **kw)
    relay = Relay(rx.address, listen)
    net.items.append(relay)
    tx = net.tx(kind)
    tx.send(relay.address, encode_commit("a0", FP, 5, 7, NUM_LAYERS))
    (peer, _), = rx.recv(10.0)
    assert relay.reset() == 1
    time.sleep(0.02)                             # the receiver saw the connection go; no new one yet
    rx.reply(peer, {"op": "ack", "transfer_id": "a0"})
    got, end = [], time.monotonic() + 10
    while not got and time.monotonic() < end:
        got = tx.poll_replies(0.2)
    assert [m["transfer_id"] for _, m in got] == ["a0"]
    # the socket thread counts a reply after its send returns, so the count may trail the delivery
    end = time.monotonic() + 5
    while rx.stats["replies"] + rx.stats["replies_dropped"] == 0 and time.monotonic() < end:
        time.sleep(0.01)
    assert rx.stats["replies"] == 1 and rx.stats["replies_dropped"] == 0


def test_outbox_retries_an_unreachable_peer_in_order_then_gives_up():
    from kvtransfer.transports.outbox import Outbox
    box, up, sent = Outbox(grace_s=0.2), {b"a": False, b"b": True}, []

    def send(rid, tag, payload):
        if up[rid]:
            sent.append(payload)
        return up[rid]
    for rid, payload in ((b"a", b"1"), (b"b", b"2"), (b"a", b"3")):
        box.put(rid, b"R", payload)
    assert box.flush(send) == [(b"R", True)] and sent == [b"2"] and len(box) == 2 and box.retrying
    up[b"a"] = True
    assert box.flush(send) == [(b"R", True)] * 2 and sent == [b"2", b"1", b"3"] and len(box) == 0
    up[b"a"] = False
    box.put(b"a", b"R", b"4")
    box.flush(send)
    time.sleep(0.25)
    assert box.flush(send) == [(b"R", False)] and len(box) == 0   # grace over: dropped, counted
