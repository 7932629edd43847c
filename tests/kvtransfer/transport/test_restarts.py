"""Receivers going away: close releases the address for a new one, a sender survives a receiver's
restart, and a receiver that forgot a sender rejects it until a new hello."""
from __future__ import annotations

import errno
import os
import time

import pytest

from kvtransfer import make_receiver, make_sender
from kvtransfer.interfaces import REJECT_OP, TransportError

from .common import FP, KINDS, LAYOUT, free_port, recv_n, state_msg, tid_of

def _bind_again(make, within_s: float = 10.0):
    """``make()``, retried while its address is still in use: the dist store's listening socket
    is closed by c10d's server thread shortly after ``close`` returns, not within it (under a
    loaded CI machine that took long enough for an immediate rebind to fail)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return make()
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("kind", KINDS)
def test_close_releases_the_address(net, kind, tmp_path):
    kw = {"port": free_port()}
    if kind == "dist":
        kw["store_port"] = free_port()
    if kind == "zmq-ipc":
        kw["ipc_path"] = str(tmp_path / "rx.sock")
    for round_ in range(2):
        rx = _bind_again(lambda: make_receiver(kind, "127.0.0.1", fingerprint=FP, layout=LAYOUT, **kw))
        tx = make_sender(kind, FP, LAYOUT, f"p{round_}")
        try:
            tx.send(rx.address, state_msg(f"t{round_}", round_, big=round_ * 600_000))
            tx.close()                      # says bye: the message under way still arrives
            (_, frames), = recv_n(rx, 1)
            assert tid_of(frames) == f"t{round_}"
            deadline = time.monotonic() + 5
            while rx.stats["peers"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert rx.stats["peers"] == 0
        finally:
            tx.close()
            rx.close()
            rx.close()   # idempotent
    if kind == "zmq-ipc":
        assert not os.path.exists(kw["ipc_path"])
    with pytest.raises(TransportError, match="closed"):
        rx.reply("p1", {})


@pytest.mark.parametrize("kind", KINDS)
def test_sender_survives_a_receiver_restart(net, kind, tmp_path):
    kw = {"port": free_port()}
    if kind == "dist":
        kw["store_port"] = free_port()
    if kind == "zmq-ipc":
        kw["ipc_path"] = str(tmp_path / "rx.sock")
    rx1 = net.rx(kind, **kw)
    tx = net.tx(kind)
    tx.send(rx1.address, state_msg("t0", 0))
    recv_n(rx1, 1)
    rx1.close()
    rx2 = net.rx(kind, **kw)
    assert rx2.address == rx1.address
    time.sleep(0.2)   # the sender's socket notices the dropped connection (a restart takes longer)
    tx.send(rx2.address, state_msg("t1", 1))   # so it says hello to the new receiver first
    tx.send(rx2.address, state_msg("t2", 2))
    assert [tid_of(f) for _, f in recv_n(rx2, 2)] == ["t1", "t2"]
    assert rx2.stats["handshakes"] == 1 and rx2.stats["dropped_unknown_peer"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_receiver_that_forgot_the_sender_rejects_then_gets_a_hello(net, kind):
    """A receiver that no longer knows a connected sender (it pruned or superseded it, a dist pair
    failed; or a restarted decode the sender did not notice yet) rejects its message with
    transport.reject; the sender drops that connection and handshakes on its next send."""
    rx = net.rx(kind)
    tx = net.tx(kind)
    tx.send(rx.address, state_msg("t0", 0))
    recv_n(rx, 1)
    assert rx.forget(rx._by_id["prefill-0"])
    try:
        tx.send(rx.address, state_msg("t-lost", 1))
    except TransportError:   # dist: forgetting the peer closed its pair group, the tensor send fails
        assert kind == "dist"
    else:
        got, deadline = [], time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = tx.poll_replies(timeout_s=0.5)
        assert got and got[0][1]["op"] == REJECT_OP and got[0][1]["transfer_id"] == "t-lost"
        assert "send hello first" in got[0][1]["reason"]
    tx.send(rx.address, state_msg("t2", 2))   # handshakes again
    (_, frames), = recv_n(rx, 1)
    assert tid_of(frames) == "t2" and rx.stats["handshakes"] == 2
