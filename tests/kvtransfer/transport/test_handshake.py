"""Round trips are byte-exact and ordered; the handshake refuses another fingerprint, layout or
transport by name; connecting without a receiver times out."""
from __future__ import annotations

import time

import pytest

from kvtransfer.interfaces import TransportError, handshake_mismatch
from kvtransfer.wire import TransferError, decode_state

from .common import FP, KINDS, LAYOUT, free_port, recv_n, same_tensors, sample_tensors, state_msg, tid_of


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_byte_exact(net, kind):
    rx = net.rx(kind)
    tx = net.tx(kind)
    tx.connect(rx.address)
    tx.connect(rx.address)   # idempotent
    msgs = [state_msg("t-small", 1), state_msg("t-none", 2, empty=True), state_msg("t-big", 3, big=1_500_000)]
    sent = [tx.send(rx.address, m) for m in msgs]
    assert sent == [sum(memoryview(f).nbytes for f in m) for m in msgs]
    got = recv_n(rx, 3)
    for m, (peer, frames), seed in zip(msgs, got, (1, 2, 3)):
        assert peer == "prefill-0"
        assert [bytes(f) for f in frames] == [bytes(f) for f in m]
        h, tensors = decode_state(frames, FP)
        assert (h["num_tokens"], h["first_token"]) == (100 + seed, seed)
        assert same_tensors(tensors, {} if seed == 2 else sample_tensors(seed, 1_500_000 if seed == 3 else 0))
    st = rx.stats
    assert (st["messages"], st["bytes"], st["handshakes"], st["dropped_malformed"]) == (3, sum(sent), 1, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_many_messages_keep_their_order(net, kind):
    rx, tx = net.rx(kind), net.tx(kind)
    n = 120
    for i in range(n):
        tx.send(rx.address, state_msg(f"t{i}", i % 5, big=600_000 if i % 17 == 0 else 0, empty=i % 7 == 0))
    got = recv_n(rx, n)
    assert [tid_of(f) for _, f in got] == [f"t{i}" for i in range(n)]
    assert all(decode_state(f, FP) for _, f in got[:10])


@pytest.mark.parametrize("kind", KINDS)
def test_corrupted_frame_is_delivered_and_decode_refuses_it(net, kind):
    rx, tx = net.rx(kind), net.tx(kind)
    frames = [bytes(f) for f in state_msg("t-bad", 4, big=700_000)]
    bad = bytearray(frames[3])
    bad[len(bad) // 2] ^= 0xFF
    frames[3] = bytes(bad)
    tx.send(rx.address, frames)
    (_, got), = recv_n(rx, 1)
    assert [bytes(f) for f in got] == frames          # the transport does not hide it
    with pytest.raises(TransferError, match="checksum"):
        decode_state(got, FP)
    assert rx.stats["dropped_malformed"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_handshake_refuses_another_fingerprint(net, kind):
    rx = net.rx(kind)
    tx = net.tx(kind, fingerprint="0" * 64)
    with pytest.raises(TransportError, match="refused by the decode side: fingerprint differs: prefill runs model 0000"):
        tx.connect(rx.address, timeout_s=5)
    with pytest.raises(TransportError, match="fingerprint differs"):
        tx.send(rx.address, state_msg("t", 1))       # send handshakes too, and refuses again
    assert rx.stats["refused"] == 2 and rx.stats["peers"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_handshake_refuses_another_layout_naming_the_key(net, kind):
    rx = net.rx(kind)
    other = {**LAYOUT, "kv_dtype": "float8_e4m3fn", "parallel": {"tp": 4, "dp": 1}}
    tx = net.tx(kind, layout=other)
    with pytest.raises(TransportError) as e:
        tx.connect(rx.address, timeout_s=5)
    msg = str(e.value)
    assert "layout.kv_dtype differs: prefill has 'float8_e4m3fn', decode has 'bfloat16'" in msg
    assert "layout.parallel.tp differs: prefill has 4, decode has 1" in msg
    assert "fingerprint" not in msg and rx.stats["refused"] == 1


def test_handshake_refuses_another_transport(net):
    rx = net.rx("dist")
    tx = net.tx("zmq-tcp")
    with pytest.raises(TransportError, match="transport differs: prefill uses 'zmq', decode uses 'dist'"):
        tx.connect(rx.address[len("dist+"):], timeout_s=5)
    with pytest.raises(ValueError, match="expected tcp://"):
        tx.connect(rx.address)


def test_mismatch_reason_is_symmetric_and_none_when_equal():
    a = {"transport": "zmq", "fingerprint": FP, "layout": LAYOUT}
    assert handshake_mismatch(a, dict(a), "decode", "prefill") is None
    b = {**a, "layout": {**LAYOUT, "extra": 1}}
    assert handshake_mismatch(a, b, "decode", "prefill") == "layout.extra differs: prefill has 1, decode has None"


@pytest.mark.parametrize("kind", ["zmq-tcp", "dist"])
def test_connect_times_out_without_a_receiver(net, kind):
    tx = net.tx(kind)
    dest = ("dist+" if kind == "dist" else "") + f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="timed out after 0.5 s"):
        tx.connect(dest, timeout_s=0.5)
    assert time.monotonic() - t0 < 3
