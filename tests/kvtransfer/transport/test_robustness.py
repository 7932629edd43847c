"""Garbage and malformed messages never kill a receiver; replies, several senders, back-pressure,
a sender in another process, pusher lanes and notifications (restarts: ``test_restarts.py``)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import torch
import zmq

from kvtransfer import make_sender
from kvtransfer.interfaces import REJECT_OP, TAG_CTL, TAG_MSG, TransportError
from kvtransfer.transports.dist_groups import transfer_plan
from kvtransfer.wire import TransferError, decode_state, encode_state

from .common import (FP, KINDS, LAYOUT, REPO, free_port, raw_dealer, raw_recv, recv_n, same_tensors,
                     sample_tensors, state_msg, tid_of)


@pytest.mark.parametrize("kind", KINDS)
def test_garbage_never_crashes_the_receiver(net, kind):
    rx = net.rx(kind)
    ctx = zmq.Context()
    raw = raw_dealer(ctx, rx)
    try:
        rnd = torch.Generator().manual_seed(0)
        junk = lambda n: bytes(torch.randint(0, 256, (n,), generator=rnd, dtype=torch.uint8).tolist())  # noqa: E731
        for frames in ([junk(100)], [junk(3), junk(5000)], [b""], [b"XY", junk(10)], [TAG_MSG],
                       [TAG_CTL, b"\xc1\xc1 not msgpack"], [TAG_CTL, msgpack.packb([1, 2, 3])],
                       [TAG_CTL, msgpack.packb({"op": "welcome"})], [TAG_CTL, b"a", b"b"], [b""] * 1000):
            raw.send_multipart(frames)
        raw.send_multipart([TAG_CTL, msgpack.packb({"op": "hello", "v": 1, "nonce": "n1"})])   # malformed hello
        assert raw_recv(raw) == {"op": "refuse", "v": 1, "nonce": "n1",
                                  "reason": "malformed hello (sender_id, nonce, fingerprint, layout)"}
        raw.send_multipart([TAG_MSG, *state_msg("t-sneaky", 1)])   # a real message, but no handshake
        rej = raw_recv(raw)
        assert rej["op"] == REJECT_OP and rej["transfer_id"] == "t-sneaky" and "no handshake" in rej["reason"]
    finally:
        raw.close()
        ctx.term()
    tx = net.tx(kind)                      # the receiver still works
    tx.send(rx.address, state_msg("t-ok", 2))
    (peer, frames), = recv_n(rx, 1)
    assert peer == "prefill-0" and tid_of(frames) == "t-ok"
    st = rx.stats
    assert st["messages"] == 1 and st["dropped_malformed"] >= 9 and st["dropped_unknown_peer"] == 1
    assert st["refused"] == 1


@pytest.mark.parametrize("kind", ["zmq-tcp", "zmq-ipc"])
def test_malformed_messages_after_handshake_are_dropped_and_rejected(net, kind):
    rx = net.rx(kind, max_frames=16, max_message_bytes=1 << 20)
    ctx = zmq.Context()
    raw = raw_dealer(ctx, rx)
    try:
        hello = {"op": "hello", "v": 1, "sender_id": "raw", "nonce": "n2", "fingerprint": FP, "layout": LAYOUT,
                 "transport": "zmq"}
        raw.send_multipart([TAG_CTL, msgpack.packb(hello)])
        w = raw_recv(raw)
        assert w["op"] == "welcome" and w["limits"] == {"max_frames": 16, "max_message_bytes": 1 << 20}
        good = [bytes(f) for f in state_msg("t-good", 1)]
        bad = {
            "frame count": good[:-1],
            "frame size": [*good[:-1], good[-1] + b"x"],
            "header": [b"\x92garbage", *good[1:]],
            "too many frames": [encode_state("t-many", FP, 1, 1, {f"x{i}": torch.zeros(1) for i in range(20)})[0],
                                *[b"\0\0\0\0"] * 20],
            "too big": encode_state("t-huge", FP, 1, 1, {f"x{i}": torch.zeros(100_000) for i in range(3)}),
        }   # (a single frame over max_message_bytes never gets this far: ZMQ drops that connection)
        for frames in bad.values():
            raw.send_multipart([TAG_MSG, *frames])
            rej = raw_recv(raw)
            assert rej["op"] == REJECT_OP and rej["reason"].startswith("dropped: ")
        raw.send_multipart([TAG_MSG, *good])
        (peer, frames), = recv_n(rx, 1)
        assert peer == "raw" and [bytes(f) for f in frames] == good
    finally:
        raw.close()
        ctx.term()
    assert rx.stats["dropped_malformed"] == len(bad) and rx.stats["messages"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_sender_checks_messages_before_sending(net, kind):
    rx = net.rx(kind, max_message_bytes=1 << 20)
    tx = net.tx(kind)
    good = state_msg("t", 1)
    with pytest.raises(TransferError, match="tensor frames for"):
        tx.send(rx.address, good[:-1])
    with pytest.raises(TransferError, match="frame has"):
        tx.send(rx.address, [*good[:-1], b"\0"])
    with pytest.raises(TransferError, match="header"):
        tx.send(rx.address, [b"nope", *good[1:]])
    with pytest.raises(TransferError, match="exceed 1048576"):   # the receiver's announced limit
        tx.send(rx.address, encode_state("t-huge", FP, 1, 1, {"x": torch.zeros(1 << 19)}))
    tx.send(rx.address, good)
    assert len(recv_n(rx, 1)) == 1 and rx.stats["dropped_malformed"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_reply_and_poll_replies_round_trip(net, kind):
    rx, tx = net.rx(kind), net.tx(kind)
    assert tx.poll_replies() == []
    tx.send(rx.address, state_msg("t-1", 1))
    (peer, _), = recv_n(rx, 1)
    ack = {"op": "ack", "transfer_id": "t-1", "n": [1, 2], "blob": b"\x00\x01"}
    rx.reply(peer, ack)
    assert tx.poll_replies(timeout_s=5) == [(rx.address, ack)]
    with pytest.raises(TransportError, match="unknown peer 'nobody'"):
        rx.reply("nobody", ack)

    def many(k):   # reply() is thread-safe
        for i in range(25):
            rx.reply(peer, {"op": "ack", "k": k, "i": i})
    threads = [threading.Thread(target=many, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    got, deadline = [], time.monotonic() + 10
    while len(got) < 100 and time.monotonic() < deadline:
        got += tx.poll_replies(timeout_s=0.5)
    assert len(got) == 100
    for k in range(4):
        assert [m["i"] for _, m in got if m["k"] == k] == list(range(25))
    deadline = time.monotonic() + 5        # counted by the socket thread just after each send
    while rx.stats["replies"] < 101 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats["replies"] == 101


@pytest.mark.parametrize("kind", KINDS)
def test_two_senders_into_one_receiver(net, kind):
    rx = net.rx(kind)
    txs = [net.tx(kind, sender_id=f"prefill-{c}") for c in "ab"]
    n = 30

    def push(tx, c):
        for i in range(n):
            tx.send(rx.address, state_msg(f"{c}{i}", i % 3, big=400_000 if i % 10 == 0 else 0))
    threads = [threading.Thread(target=push, args=(tx, c)) for tx, c in zip(txs, "ab")]
    [t.start() for t in threads]
    got = recv_n(rx, 2 * n)
    [t.join() for t in threads]
    for c in "ab":
        assert [tid_of(f) for p, f in got if p == f"prefill-{c}"] == [f"{c}{i}" for i in range(n)]
    assert rx.stats["peers"] == 2
    for c in "ab":
        rx.reply(f"prefill-{c}", {"op": "ack", "to": c})
    for tx, c in zip(txs, "ab"):
        assert tx.poll_replies(timeout_s=5) == [(rx.address, {"op": "ack", "to": c})]


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_stops_reading_while_the_decode_loop_is_behind(net, kind):
    rx = net.rx(kind, max_pending_bytes=1)
    tx = net.tx(kind)
    n = 8
    th = threading.Thread(target=lambda: [tx.send(rx.address, state_msg(f"t{i}", i)) for i in range(n)])
    th.start()
    time.sleep(0.5)
    assert rx.stats["messages"] == 1          # one delivered, then the socket is not read
    got = recv_n(rx, n)
    th.join(10)
    assert [tid_of(f) for _, f in got] == [f"t{i}" for i in range(n)]


def test_dist_control_can_run_over_ipc(net, tmp_path):
    rx = net.rx("dist", ipc_path=str(tmp_path / "ctl.sock"))
    assert rx.address == f"dist+ipc://{tmp_path / 'ctl.sock'}"
    tx = net.tx("dist")
    m = state_msg("t-ipc", 5, big=600_000)
    tx.send(rx.address, m)
    (_, frames), = recv_n(rx, 1)
    assert [bytes(f) for f in frames] == [bytes(f) for f in m]


def test_transfer_plan_packs_small_frames_first():
    assert transfer_plan([10, 0, 5 << 20, 3, 1 << 20], 1 << 20) == [[0, 3], [2], [4]]
    assert transfer_plan([0, 0], 1 << 20) == []
    assert transfer_plan([7], 0) == [[0]]


_CHILD = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[4])
from kvtransfer import make_sender
from tests.kvtransfer.transport.common import FP, LAYOUT, state_msg
kind, dest, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tx = make_sender(kind, FP, LAYOUT, "child-prefill")
total = sum(tx.send(dest, state_msg(f"c{i}", i, big=300_000 * (i % 2))) for i in range(n))
replies, deadline = [], time.monotonic() + 30
while not replies and time.monotonic() < deadline:
    replies = tx.poll_replies(timeout_s=0.5)
tx.close()
print("OK", total, replies[0][1]["op"] if replies else None, flush=True)
"""


@pytest.mark.parametrize("kind", KINDS)
def test_sender_in_another_process(net, kind):
    rx = net.rx(kind)
    n = 6
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, kind, rx.address, str(n), str(REPO)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        got = recv_n(rx, n, timeout=60)
        for i, (peer, frames) in enumerate(got):
            assert peer == "child-prefill"
            h, tensors = decode_state(frames, FP)
            assert h["transfer_id"] == f"c{i}" and same_tensors(tensors, sample_tensors(i, 300_000 * (i % 2)))
        rx.reply("child-prefill", {"op": "done"})
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert out.split() == ["OK", str(rx.stats["bytes"]), "done"]


@pytest.mark.parametrize("kind", ["zmq-tcp"])
def test_destination_names_its_receiver_so_a_restarted_one_is_refused(net, kind):
    """``ADDR#RECEIVER_ID``: delivered only to that receiver; another process at the same endpoint
    (a restarted decode) is refused at handshake, and the old connection is dropped. (The check is
    the ZMQ sender's handshake, which the dist sender shares; dist's broken gloo pair takes ~20 s.)"""
    port = free_port()
    old = net.rx(kind, port=port, receiver_id="decode-old")
    tx = net.tx(kind)
    tx.send(f"{old.address}#decode-old", encode_state("t-1", FP, 3, 0, sample_tensors(1)))
    assert [len(f) for _, f in old.recv(10.0)]
    old.close()
    time.sleep(0.2)
    new = net.rx(kind, port=port, receiver_id="decode-new")
    try:                                         # the old connection: refused (reject) or broken
        tx.send(f"{new.address}#decode-old", encode_state("t-2", FP, 3, 0, sample_tensors(2)))
    except TransportError:
        pass
    assert new.recv(0.5) == []                   # nothing from the old reservation landed
    tx.poll_replies(0.5)
    with pytest.raises(TransportError, match="restarted"):   # a new handshake names the other receiver
        tx.send(f"{new.address}#decode-old", encode_state("t-2", FP, 3, 0, sample_tensors(2)))
    assert new.recv(0.3) == []
    tx.send(f"{new.address}#decode-new", encode_state("t-3", FP, 3, 0, sample_tensors(3)))
    assert [len(f) for _, f in new.recv(10.0)]


def test_pusher_lanes_keep_a_dead_destination_from_stalling_the_others(net):
    """A destination that never completes the handshake holds only its own lane: a transfer to a
    live receiver is acked meanwhile; the dead one fails on its own (handshake timeout)."""
    from kvtransfer.sender import Pusher
    live = net.rx("zmq-tcp")
    dead_port = free_port()
    black_hole = socket.socket()                 # accepts TCP, never speaks ZMTP
    black_hole.bind(("127.0.0.1", dead_port))
    black_hole.listen(8)
    pusher = Pusher(lambda: make_sender("zmq-tcp", FP, LAYOUT, "prefill-lanes"), ack_timeout_s=30)
    try:
        pusher.put("state", "to-dead", f"tcp://127.0.0.1:{dead_port}", encode_state("to-dead", FP, 3, 0, sample_tensors(1)))
        time.sleep(0.2)                          # the dead lane is now blocked in its handshake
        t0 = time.monotonic()
        pusher.put("state", "to-live", live.address, encode_state("to-live", FP, 3, 0, sample_tensors(2)))
        got = []
        while not got and time.monotonic() - t0 < 8:
            for peer, frames in live.recv(0.05):
                live.reply(peer, {"op": "ack", "transfer_id": "to-live"})
            got = [r for r in pusher.results() if r.transfer_id == "to-live"]
        assert got and got[0].kind == "acked" and time.monotonic() - t0 < 5
        assert pusher.num_lanes == 2
        end = time.monotonic() + 20
        dead = []
        while not dead and time.monotonic() < end:
            dead = [r for r in pusher.results() if r.transfer_id == "to-dead"]
            time.sleep(0.1)
        assert dead and dead[0].kind == "failed"
    finally:
        pusher.close()
        black_hole.close()


@pytest.mark.parametrize("kind", KINDS)
def test_receiver_notifies_on_each_delivery(net, kind):
    """``set_notify``: called on the receiver's thread once per delivered message, after the message
    is queued (so a loop woken by it finds the message with a non-blocking ``recv``)."""
    rx = net.rx(kind)
    calls = []
    woken = threading.Event()

    def notify():
        calls.append(threading.current_thread().name)
        woken.set()
    rx.set_notify(notify)
    tx = net.tx(kind)
    for i in (1, 2):
        woken.clear()
        tx.send(rx.address, state_msg(f"n-{i}", i))
        assert woken.wait(20)
        assert len(rx.recv(0.0)) == 1 and len(calls) == i
    assert threading.current_thread().name not in calls
    rx.set_notify(None)
    tx.send(rx.address, state_msg("n-3", 3))
    assert recv_n(rx, 1) and len(calls) == 2


def test_pusher_notifies_each_result(net):
    """``Pusher(notify=...)``: an acknowledgement (or failure) of a transfer calls it, so the
    prefill loop wakes for it instead of polling on a timer."""
    from kvtransfer.sender import Pusher
    rx = net.rx("zmq-tcp")
    woken = threading.Event()
    pusher = Pusher(lambda: make_sender("zmq-tcp", FP, LAYOUT, "prefill-notify"), ack_timeout_s=30,
                    notify=woken.set)
    try:
        pusher.put("state", "p-1", rx.address, encode_state("p-1", FP, 3, 0, sample_tensors(1)))
        peer, _ = recv_n(rx, 1)[0]
        assert not woken.is_set() and pusher.results() == []
        rx.reply(peer, {"op": "ack", "transfer_id": "p-1"})
        assert woken.wait(10)
        assert [r.kind for r in pusher.results()] == ["acked"]
        woken.clear()
        pusher.put("state", "p-2", "garbage", encode_state("p-2", FP, 3, 0, sample_tensors(2)))   # fails at once
        assert woken.wait(10)
        assert [(r.transfer_id, r.kind) for r in pusher.results()] == [("p-2", "failed")]
    finally:
        pusher.close()
