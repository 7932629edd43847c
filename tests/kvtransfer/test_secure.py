"""Cluster secret -> ZMQ CURVE on the state transports, and hostile peers, on real sockets (no mocks):
a shared secret transfers; a wrong / missing secret delivers nothing and fails ``connect`` fast;
raw sockets get nothing through a secured receiver; ~300 fuzzed messages leave an unsecured
receiver alive, counted, bounded and still serving; key derivation; the rate-limited log."""
from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import time

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from kvtransfer import make_receiver, make_sender
from kvtransfer.interfaces import TAG_CTL, TAG_MSG, TransportError
from kvtransfer.secure import (ClusterKeys, RateLimitedLog, cluster_keys, ensure_authenticator, secure_client,
                               secure_server, stop_authenticator)
from kvtransfer.wire import TransferError, decode_state, encode_state, model_fingerprint

FP = model_fingerprint({"name": "tiny-transport"}, torch.bfloat16, {"block_size": 16})
LAYOUT = {"kv_dtype": "bfloat16", "block_size": 16, "parallel": {"tp": 1, "dp": 1}}
SECRET = "dsv4-test-cluster-secret-0001"
OTHER = "dsv4-test-cluster-secret-0002"


class Net:
    """Creates receivers / senders / raw sockets for one test and closes them all at teardown."""

    def __init__(self):
        self.items, self.ctx = [], zmq.Context()

    def rx(self, kind="zmq-tcp", **kw):
        if kind == "dist":
            kw.setdefault("op_timeout_s", 20)
            kw.setdefault("rendezvous_timeout_s", 5)
        r = make_receiver(kind, "127.0.0.1", 0, FP, LAYOUT, **kw)
        self.items.append(r)
        return r

    def tx(self, kind="zmq-tcp", sender_id="prefill-0", **kw):
        if kind == "dist":
            kw.setdefault("op_timeout_s", 20)
        s = make_sender(kind, FP, LAYOUT, sender_id, **kw)
        self.items.append(s)
        return s

    def raw(self, addr, curve: tuple | None = None):
        """A raw DEALER (no dsv4 code); ``curve``: (client public, client secret, server public)."""
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        if curve:
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = curve
        s.connect(addr)
        return s

    def close(self):
        for it in reversed(self.items):
            it.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def net():
    n = Net()
    yield n
    n.close()


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.win_kv": torch.randn(7, 64, generator=g).bfloat16(),
            "layers.0.comp.kv": torch.randn(2, 32, generator=g),
            "layers.1.idx_kv": torch.randint(-128, 128, (5, 16), generator=g, dtype=torch.int8),
            "layers.1.fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
            "layers.1.empty_bf16": torch.empty(0, 128, dtype=torch.bfloat16)}


def _msg(tid: str, seed: int = 0) -> list:
    return encode_state(tid, FP, 100 + seed, seed, _tensors(seed))


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def _transfers(rx, tx, tid: str, seed: int) -> None:
    """tx -> rx delivers exactly one message that decodes to what was sent."""
    tx.send(rx.address, _msg(tid, seed))
    got, deadline = [], time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        got = rx.recv(0.5)
    assert len(got) == 1, f"stats {rx.stats}"
    h, tensors = decode_state(got[0][1], FP)
    assert h["transfer_id"] == tid and _same(tensors, _tensors(seed))


def _hello(sender_id: str, fingerprint: str = FP, layout=LAYOUT, **over) -> bytes:
    msg = {"op": "hello", "v": 1, "sender_id": sender_id, "nonce": os.urandom(8).hex(), "fingerprint": fingerprint,
           "layout": layout, "transport": "zmq", **over}
    return msgpack.packb(msg, use_bin_type=True)


def _raw_tcp(port: int, data: bytes) -> None:
    """Send bytes on a plain TCP connection; libzmq may reset it midway (that is the point)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(data)
            time.sleep(0.1)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------- #
# keys

def test_key_derivation_is_deterministic_and_checked():
    a, b = ClusterKeys.from_secret(SECRET), ClusterKeys.from_secret(SECRET)
    assert a == b and cluster_keys(SECRET) == a and cluster_keys(a) is a and cluster_keys(None) is None
    assert ClusterKeys.from_secret(SECRET.encode()) == a
    assert len({a.server_public, a.server_secret, a.client_public, a.client_secret}) == 4
    assert all(len(k) == 40 for k in (a.server_public, a.server_secret, a.client_public, a.client_secret))
    assert zmq.curve_public(a.server_secret) == a.server_public and zmq.curve_public(a.client_secret) == a.client_public
    c = ClusterKeys.from_secret(OTHER)
    assert c.server_public != a.server_public and c.client_public != a.client_public
    assert a.server_secret.decode() not in repr(a) and a.client_secret.decode() not in repr(a)
    with pytest.raises(ValueError, match="too short"):
        ClusterKeys.from_secret("short-secret")
    with pytest.raises(ValueError, match="empty"):
        ClusterKeys.from_secret("")
    with pytest.raises(TypeError):
        ClusterKeys.from_secret(12345678901234567890)
    with pytest.raises(ValueError, match="too short"):
        make_receiver("zmq-tcp", "127.0.0.1", 0, FP, LAYOUT, secret="x" * 15)
    with pytest.raises(ValueError, match="too short"):
        make_sender("zmq-tcp", FP, LAYOUT, "p", secret="x" * 15)


# --------------------------------------------------------------------------------------------- #
# secured pairs

@pytest.mark.parametrize("kind", ["zmq-tcp", "zmq-ipc", "dist"])
def test_same_secret_transfers(net, kind):
    rx = net.rx(kind, secret=SECRET)
    tx = net.tx(kind, secret=SECRET)
    _transfers(rx, tx, "t-secure", 1)
    assert rx.stats["handshakes"] == 1


@pytest.mark.parametrize("kind", ["zmq-tcp", "zmq-ipc"])
def test_wrong_or_missing_secret_delivers_nothing(net, kind):
    rx = net.rx(kind, secret=SECRET)
    for i, secret in enumerate((OTHER, None)):
        bad = net.tx(kind, sender_id=f"bad-{i}", secret=secret)
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="cluster secret"):
            bad.connect(rx.address, timeout_s=5)
        assert time.monotonic() - t0 < 5.5   # fails fast from the handshake events, at worst at timeout_s
        with pytest.raises(TransportError):
            bad.send(rx.address, _msg("t-bad"))
    assert rx.recv(0.3) == []
    st = rx.stats
    assert (st["messages"], st["handshakes"], st["peers"], st["dropped_malformed"]) == (0, 0, 0, 0)
    _transfers(rx, net.tx(kind, sender_id="good", secret=SECRET), "t-good", 2)   # still serving

    plain = net.rx(kind)   # a secret on the sender side only fails too
    with pytest.raises(TransportError, match="cluster secret"):
        net.tx(kind, sender_id="curve-only", secret=SECRET).connect(plain.address, timeout_s=5)
    assert plain.stats["handshakes"] == 0


def test_raw_sockets_get_nothing_through_a_secured_receiver(net):
    rx = net.rx(secret=SECRET)
    keys = ClusterKeys.from_secret(SECRET)
    intruder_pub, intruder_sec = zmq.curve_keypair()
    socks = [net.raw(rx.address),   # NULL mechanism: the handshake fails
             # knows the server's public key (leaked) but not the client key: the ZAP handler refuses it
             net.raw(rx.address, (intruder_pub, intruder_sec, keys.server_public))]
    for s in socks:
        s.send_multipart([TAG_CTL, _hello("intruder")])
        s.send_multipart([TAG_MSG, *[bytes(f) for f in _msg("t-intruder")]])
        s.send_multipart([os.urandom(37), os.urandom(5000)])
    _raw_tcp(rx.port, os.urandom(4096))   # not even ZMTP
    _raw_tcp(rx.port, b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(64))   # a ZMTP greeting, then garbage
    for s in socks:
        assert not s.poll(300), "a secured receiver answered an unauthenticated peer"
    assert rx.recv(0.2) == []
    st = rx.stats
    assert (st["messages"], st["handshakes"], st["refused"], st["dropped_malformed"], st["dropped_unknown_peer"]) \
        == (0, 0, 0, 0, 0)   # not a frame reached the application
    # the same raw DEALER with the cluster's client keys does get an answer (the test's control)
    ok = net.raw(rx.address, (keys.client_public, keys.client_secret, keys.server_public))
    ok.send_multipart([TAG_CTL, _hello("raw-but-keyed")])
    assert ok.poll(5000) and msgpack.unpackb(ok.recv_multipart()[1])["op"] == "welcome"
    _transfers(rx, net.tx(sender_id="good", secret=SECRET), "t-good", 3)


def test_secure_helpers_work_on_asyncio_contexts():
    """The server's worker ROUTER / gateway DEALER pattern: secure_server + secure_client on
    zmq.asyncio sockets; stop_authenticator before term."""
    keys = ClusterKeys.from_secret(SECRET)

    async def main():
        ctx = zmq.asyncio.Context()
        try:
            srv = ctx.socket(zmq.ROUTER)
            secure_server(srv, SECRET)
            assert ensure_authenticator(ctx, keys) is ensure_authenticator(ctx, SECRET)   # one per context
            with pytest.raises(ValueError):
                ensure_authenticator(ctx, OTHER)
            port = srv.bind_to_random_port("tcp://127.0.0.1")
            good, bad = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
            secure_client(good, SECRET)
            secure_client(bad, OTHER)
            for s in (good, bad):
                s.linger = 0
                s.connect(f"tcp://127.0.0.1:{port}")
            await bad.send(b"from-bad")
            await good.send(b"from-good")
            rid, body = await asyncio.wait_for(srv.recv_multipart(), 10)
            assert body == b"from-good"
            await srv.send_multipart([rid, b"pong"])
            assert await asyncio.wait_for(good.recv(), 10) == b"pong"
            assert not await srv.poll(300)
            for s in (srv, good, bad):
                s.close(linger=0)
        finally:
            assert stop_authenticator(ctx) and not stop_authenticator(ctx)
            ctx.term()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------- #
# fuzz

def _fuzz_messages(rng: random.Random, n: int) -> list[list[bytes]]:
    """Garbage and near-miss messages (without the ROUTER's routing id)."""
    good = [bytes(f) for f in _msg("t-fuzz", 5)]
    h = msgpack.unpackb(good[0])

    def header(**over):
        return msgpack.packb({**h, **over})

    def rnd(lo=0, hi=300):
        return rng.randbytes(rng.randint(lo, hi))

    makers = [
        lambda: [rnd() for _ in range(rng.randint(1, 8))],                          # random frames
        lambda: [rnd(2, 5), rnd()],                                                  # a tag of the wrong size
        lambda: [TAG_CTL, rnd()],                                                     # control garbage
        lambda: [TAG_CTL, msgpack.packb(rng.choice([1, "x", [1, 2], None, {"op": "nope"}, {"op": 7}]))],
        lambda: [TAG_CTL, _hello(f"s{rng.randint(0, 9)}", fingerprint="0" * 64)],     # wrong fingerprint
        lambda: [TAG_CTL, _hello("s", layout={"kv_dtype": "float32"})],               # wrong layout
        lambda: [TAG_CTL, _hello("s", v=99)],                                          # wrong version
        lambda: [TAG_CTL, _hello(12345)],                                              # malformed hello
        lambda: [TAG_CTL, _hello("x" * 5000)],
        lambda: [TAG_CTL, msgpack.packb({"op": "bye", "v": 1, "sender_id": "someone-else"})],
        lambda: [TAG_CTL, rnd(), rnd()],                                              # control with 2 frames
        lambda: [b"Z", rnd()],                                                        # unknown tag
        lambda: [TAG_MSG, *good],                                                     # no handshake (or handshaked)
        lambda: [TAG_MSG, good[0][: rng.randint(0, len(good[0]) - 1)], *good[1:]],   # truncated header
        lambda: [TAG_MSG, header(tensors=[{**h["tensors"][0], "nbytes": 1 << 40, "shape": [1 << 39]}]),
                 good[1]],                                                            # huge declared length
        lambda: [TAG_MSG, good[0], *good[1:-1]],                                      # a frame missing
        lambda: [TAG_MSG, good[0], *good[1:], rnd(1)],                                # a frame too many
        lambda: [TAG_MSG, good[0], good[1][:-1], *good[2:]],                          # a truncated tensor
        lambda: [TAG_MSG, header(kind="bogus"), *good[1:]],
        lambda: [TAG_MSG, header(tensors=[{"name": 1}]), rnd()],
        lambda: [TAG_MSG, msgpack.packb({**h, "tensors": [h["tensors"][0]] * 100})],   # over max_frames
        lambda: [TAG_MSG],                                                            # no header at all
        lambda: [TAG_MSG, good[0], bytes(len(good[1])), *good[2:]],                   # bad crc: decode refuses
        lambda: [TAG_MSG, header(fingerprint="f" * 64), *good[1:]],                   # another model
    ]
    return [rng.choice(makers)() for _ in range(n)]


def test_fuzzed_frames_leave_an_unsecured_receiver_alive_bounded_and_serving(net):
    rx = net.rx(max_peers=8, max_frames=64, max_message_bytes=1 << 20)   # MAXMSGSIZE 1 MiB
    rng = random.Random(1234)
    threads_before = threading.active_count()
    sent, socks = 0, []
    for i in range(12):   # each raw DEALER may handshake properly, then misbehave
        s = net.raw(rx.address)
        socks.append(s)
        if i % 2 == 0:
            s.send_multipart([TAG_CTL, _hello(f"fuzz-{i}")])
        for frames in _fuzz_messages(rng, 25):
            s.send_multipart(frames)
            sent += 1
    big = net.raw(rx.address)   # one frame over MAXMSGSIZE: libzmq drops that connection
    big.send_multipart([TAG_MSG, os.urandom(2 << 20)])
    big.send_multipart([TAG_CTL, _hello("after-oversize")])
    _raw_tcp(rx.port, os.urandom(8192))   # raw TCP garbage
    assert sent >= 300

    # wait until the receiver has handled what it got (counters stop moving)
    delivered, last, stable_since = [], None, time.monotonic()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        delivered += rx.recv(0.2)
        st = rx.stats
        key = (st["messages"], st["refused"], st["dropped_malformed"], st["dropped_unknown_peer"], st["handshakes"])
        if key != last:
            last, stable_since = key, time.monotonic()
        elif time.monotonic() - stable_since > 1.0:
            break
    assert rx._thread.is_alive()
    st = rx.stats
    assert st["dropped_malformed"] > 50 and st["refused"] > 20 and st["dropped_unknown_peer"] > 5, st
    assert st["handshakes"] >= 6 and st["peers"] <= 8, st
    bogus = 0
    for _, frames in delivered:   # only structurally valid messages pass the transport: each is either the
        try:                      # intact valid message a handshaked fuzzer also sent, or decode refuses it
            h, tensors = decode_state(frames, FP)
            assert h["transfer_id"] == "t-fuzz" and _same(tensors, _tensors(5))
        except TransferError:
            bogus += 1
    assert 0 < bogus < len(delivered)
    assert st["messages"] == len(delivered)
    # nothing held for garbage: no pending bytes, no queued replies, peers bounded, no new threads
    assert rx._pending == 0 and not rx._outbox and not rx._delivered
    assert len(rx._by_rid) == len(rx._by_id) == st["peers"] <= 8
    assert threading.active_count() <= threads_before

    # squatters fill the peer table (max_peers=8) with valid hellos; the ones over the limit are refused
    squatters = [net.raw(rx.address) for _ in range(10)]
    for i, s in enumerate(squatters):
        s.send_multipart([TAG_CTL, _hello(f"squatter-{i}")])
    answers = [msgpack.unpackb(s.recv_multipart()[1]) if s.poll(5000) else None for s in squatters]
    # the receiver takes hellos in arrival order, which need not be the send order: count refusals
    assert None not in answers and any("too many prefill peers" in a.get("reason", "") for a in answers)
    assert rx.stats["peers"] == 8

    for s in socks + [big] + squatters:   # all vanish without a bye: their entries must not lock others out
        s.close(linger=0)
    time.sleep(0.7)
    good = net.tx(sender_id="good")
    _transfers(rx, good, "t-after-fuzz", 6)
    st = rx.stats
    assert st["peers_pruned"] >= 7 and st["peers"] <= 8 and rx._thread.is_alive(), st


# --------------------------------------------------------------------------------------------- #
# rate-limited log

def test_rate_limited_log_counts_what_it_suppresses(caplog):
    now = [100.0]
    rl = RateLimitedLog(logging.getLogger("dsv4.test.ratelimit"), interval_s=10.0, max_causes=4,
                        clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="dsv4.test.ratelimit"):
        emitted = [rl.warning("bad-frame", "dropped %s", i) for i in range(100)]
        assert emitted.count(True) == 1 and rl.info("other", "another cause")
        now[0] += 10.5
        assert rl.warning("bad-frame", "dropped %s", 100)
        for i in range(50):   # many causes: memory stays bounded
            rl.warning(f"cause-{i}", "x")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["dropped 0", "another cause", "dropped 100 (99 more like this suppressed since the last one)"]
    assert len(rl._state) <= 4
