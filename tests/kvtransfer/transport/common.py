"""What the transport tests share: the fingerprint and layout, a ``Net`` that closes what a test
opened, message builders and receive helpers."""
from __future__ import annotations

import time
from pathlib import Path

import msgpack
import torch
import zmq

from kvtransfer import make_receiver, make_sender
from kvtransfer.interfaces import TAG_CTL
from kvtransfer.wire import encode_state, model_fingerprint
# below the ephemeral range: a port a test binds twice (close-then-rebind) is never an outgoing
# connection's local port in between
from server.launch.local import free_port  # noqa: F401  (re-exported to the transport tests)

KINDS = ["zmq-tcp", "zmq-ipc", "dist"]
REPO = Path(__file__).resolve().parents[3]
FP = model_fingerprint({"name": "tiny-transport"}, torch.bfloat16, {"block_size": 16})
LAYOUT = {"kv_dtype": "bfloat16", "block_size": 16, "parallel": {"tp": 1, "dp": 1}}


class Net:
    """Creates receivers / senders for one test and closes them all at teardown."""

    def __init__(self, tmp_path):
        self.tmp, self.items = tmp_path, []

    def rx(self, kind, fingerprint=FP, layout=LAYOUT, **kw):
        if kind == "dist":
            kw.setdefault("op_timeout_s", 20)
            kw.setdefault("rendezvous_timeout_s", 5)
        r = make_receiver(kind, "127.0.0.1", kw.pop("port", 0), fingerprint, layout, **kw)
        self.items.append(r)
        return r

    def tx(self, kind, fingerprint=FP, layout=LAYOUT, sender_id="prefill-0", **kw):
        if kind == "dist":
            kw.setdefault("op_timeout_s", 20)
        s = make_sender(kind, fingerprint, layout, sender_id, **kw)
        self.items.append(s)
        return s

    def close(self):
        for it in reversed(self.items):
            it.close()


def sample_tensors(seed: int, big: int = 0) -> dict[str, torch.Tensor]:
    """Several dtypes incl. bfloat16 / fp8 and empty tensors; ``big`` adds a bf16 tensor of that many
    elements (2 bytes each) so the dist transport also takes its one-op-per-frame path."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "layers.0.win_kv": torch.randn(7, 64, generator=g).bfloat16(),
        "layers.0.cmp_kv": torch.randn(3, 64, generator=g).half(),
        "layers.0.comp.kv": torch.randn(2, 32, generator=g),
        "layers.0.comp.score": torch.empty(0, 32),
        "layers.1.idx_kv": torch.randint(-128, 128, (5, 16), generator=g, dtype=torch.int8),
        "layers.1.raw": torch.randint(0, 256, (9,), generator=g, dtype=torch.uint8),
        "layers.1.fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "layers.1.empty_bf16": torch.empty(0, 128, dtype=torch.bfloat16),
    }
    if big:
        out["layers.2.big"] = torch.randn(big, generator=g).bfloat16()
    return out


def state_msg(tid: str, seed: int = 0, big: int = 0, empty: bool = False) -> list:
    return encode_state(tid, FP, 100 + seed, seed, {} if empty else sample_tensors(seed, big))


def recv_n(rx, n: int, timeout: float = 30.0) -> list:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += rx.recv(0.5)
    assert len(out) == n, f"got {len(out)} of {n} messages; stats {rx.stats}"
    return out


def same_tensors(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def tid_of(frames) -> str:
    return msgpack.unpackb(bytes(frames[0]))["transfer_id"]


def raw_dealer(ctx, rx):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(rx.address.removeprefix("dist+"))
    return s


def raw_recv(sock, timeout_s=5.0) -> dict:
    assert sock.poll(int(timeout_s * 1000)), "no answer from the receiver"
    tag, payload = sock.recv_multipart()
    assert tag == TAG_CTL
    return msgpack.unpackb(payload)
