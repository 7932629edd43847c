"""Issue 21 across processes: the decode receiver runs in a child process behind a relay; the
state connection is aborted before each transfer, then the child is killed (SIGKILL) and a new one
starts at the same address. Every transfer is answered with a sha256 of the frames the child got."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest

from .common import REPO, free_port, state_msg
from relay_util import Relay

_DECODE = r"""
import hashlib, sys
sys.path.insert(0, sys.argv[1])
from kvtransfer import make_receiver
from tests.kvtransfer.transport.common import FP, LAYOUT
kind, where = sys.argv[2], sys.argv[3]
kw = {"ipc_path": where} if kind == "zmq-ipc" else {"port": int(where)}
rx = make_receiver(kind, "127.0.0.1", fingerprint=FP, layout=LAYOUT, receiver_id=sys.argv[4], **kw)
print(rx.address, flush=True)
while True:
    for peer, frames in rx.recv(0.5):
        sha = hashlib.sha256(b"".join(bytes(f) for f in frames)).hexdigest()
        rx.reply(peer, {"op": "ack", "transfer_id": sys.argv[4], "sha": sha, "stats": rx.stats})
"""


def _start_decode(kind: str, where: str, name: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", _DECODE, str(REPO), kind, where, name], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    addr = p.stdout.readline().strip()
    assert addr, p.stderr.read() if p.poll() is not None else "decode child printed no address"
    return p, addr


def _roundtrip(tx, dest: str, i: int) -> dict:
    msg = state_msg(f"p{i}", i, big=200_000 * (i % 2))
    tx.send(dest, msg)
    want = hashlib.sha256(b"".join(bytes(f) for f in msg)).hexdigest()
    end = time.monotonic() + 20
    while time.monotonic() < end:
        for _, r in tx.poll_replies(0.2):
            assert r.get("op") == "ack", r           # a transport.reject would be the bug
            assert r["sha"] == want, f"transfer {i}: bytes differ"
            return r
    pytest.fail(f"transfer {i}: no answer from the decode child within 20 s")


@pytest.mark.parametrize("kind", ["zmq-tcp", "zmq-ipc"])
def test_resets_and_a_killed_decode_process(net, kind, tmp_path):
    where = str(tmp_path / "rx.sock") if kind == "zmq-ipc" else str(free_port())
    listen = f"ipc://{tmp_path / 'relay.sock'}" if kind == "zmq-ipc" else f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        p, addr = _start_decode(kind, where, "decode-a")
        procs.append(p)
        relay = Relay(addr, listen)
        net.items.append(relay)
        tx = net.tx(kind, sender_id="prefill-proc")
        for i in range(11):                       # p0 handshakes; p1..p10 each follow a reset
            if i:
                assert relay.reset() == 1
            r = _roundtrip(tx, relay.address, i)
            assert r["transfer_id"] == "decode-a" and r["stats"]["handshakes"] == 1
        assert r["stats"]["dropped_unknown_peer"] == 0 and r["stats"]["messages"] == 11
        p.kill()                                  # decode dies without a word; a new one takes the address
        p.wait(10)
        p2, addr2 = _start_decode(kind, where, "decode-b")
        procs.append(p2)
        assert addr2 == addr
        time.sleep(0.2)
        r = _roundtrip(tx, relay.address, 11)     # hello to the new process first, not a reject
        assert r["transfer_id"] == "decode-b" and r["stats"]["dropped_unknown_peer"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
