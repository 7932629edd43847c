"""P/D workers in this process (threads), real ZMQ sockets and transports, driven by the gateway's
``PDBackend``: token ids equal the single engine's for the same seed; the state that travels is
exactly the reference §4 payload; corrupted, late and abandoned transfers free everything."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import torch
import zmq

from engine.build import build_engine
from engine.run_config import RunConfig
from engine.core.sampling_params import SamplingParams
from kvtransfer import make_receiver, make_sender
from kvtransfer.wire import decode_header, encode_commit, encode_layer
from server.backends.base import BackendError, GenRequest
from server.backends.pd import PDBackend
from server.launch.local import free_port
from server.workers.base import WorkerOptions
from server.workers.decode import DecodeWorker
from server.workers.prefill import PrefillWorker
from server.protocol_fields import pack, params_to_dict, unpack

from pd_util import collect_tokens

TRANSPORTS = ["zmq-tcp", "zmq-ipc", "dist"]


def _engine(ckpt):
    return build_engine(RunConfig.from_yaml("configs/tiny-flash.yaml"), ckpt, progress=False)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("flash", 1)


@pytest.fixture(scope="module")
def reference(ckpt):
    return _engine(ckpt)


class PD:
    """A prefill and a decode worker on threads, and the addresses a backend needs."""

    def __init__(self, ckpt, transport: str, lease_s: float = 60.0):
        self.prefill = PrefillWorker(_engine(ckpt), WorkerOptions(port=free_port(), http_port=0, transport=transport))
        self.decode = DecodeWorker(_engine(ckpt), WorkerOptions(port=free_port(), http_port=0, transport=transport,
                                                                state_port=free_port(), lease_s=lease_s))
        self.threads = [threading.Thread(target=w.run, daemon=True) for w in (self.prefill, self.decode)]
        for t in self.threads:
            t.start()

    def backend(self, **kw) -> PDBackend:
        return PDBackend([f"127.0.0.1:{self.prefill.opts.port}"], [f"127.0.0.1:{self.decode.opts.port}"], **kw)

    def close(self):
        for w in (self.prefill, self.decode):
            w.stop.set()
        for t in self.threads:
            t.join(10)
        self.prefill.close()
        self.decode.close()

    def idle(self) -> bool:
        e = self.decode.engine
        return e.num_free_blocks() == e.num_total_blocks() and not e.pd.reserved and not e.has_unfinished()


@pytest.fixture(scope="module", params=TRANSPORTS)
def pd(request, ckpt):
    p = PD(ckpt, request.param)
    yield p
    p.close()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 60000, (n,), generator=g).tolist() for n in lengths]


LENGTHS = [61, 127, 128, 129, 300]     # below, at and past the 128-token HCA / window boundaries


def test_pd_tokens_equal_the_single_engine(pd, reference):
    prompts = _prompts(LENGTHS)
    params = [SamplingParams(max_new_tokens=10, temperature=0.0, seed=7),
              SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234)]
    reqs = [GenRequest(f"t-{uuid.uuid4().hex}", pr, p) for pr in prompts for p in params]
    got = asyncio.run(collect_tokens(pd.backend(), reqs))
    want = reference.generate([r.prompt_ids for r in reqs], [r.params for r in reqs])
    for r, g, w in zip(reqs, got, want):
        assert g == w.output_ids, (len(r.prompt_ids), r.params.temperature)
    # every transfer went layer by layer and carried exactly the §4 payload
    for r in reqs:
        t = pd.decode.transfers[r.request_id]
        L = len(r.prompt_ids)
        assert t["num_tokens"] == L and t["layers_before_commit"] == len(pd.decode.engine.model.layers)
        assert t["payload_bytes"] == sum(x.numel() * x.element_size() for x in _state(reference, r.prompt_ids).values())
    deadline = time.monotonic() + 5
    while not pd.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pd.idle()
    assert pd.prefill.engine.num_free_blocks() == pd.prefill.engine.num_total_blocks()


def _state(engine, prompt):
    """State tensors of ``prompt`` prefilled by ``engine`` (the reference payload)."""
    rid = f"s-{uuid.uuid4().hex}"
    engine.add_request(rid, prompt, SamplingParams(max_new_tokens=1, temperature=0.0), hold_state=True)
    while engine.has_unfinished():
        engine.step()
    _, t = engine.pd.export_state(rid)
    engine.pd.release(rid)
    return t


class _Gateway:
    """A raw DEALER to a worker, speaking the control messages by hand."""

    def __init__(self, port: int):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, msg):
        self.sock.send(pack(msg))

    def recv(self, timeout_s=10.0, op=None):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.sock.poll(100):
                m = unpack(self.sock.recv())
                if op is None or m["op"] == op:
                    return m
        raise TimeoutError(op)

    def close(self):
        self.sock.close(0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_late_and_abandoned_transfers_free_everything(ckpt, reference, transport):
    pd = PD(ckpt, transport, lease_s=1.0)
    gw = _Gateway(pd.decode.opts.port)
    sender = make_sender(transport, pd.decode.fingerprint, pd.decode.layout, "test-prefill")
    try:
        prompt = _prompts([130], seed=3)[0]
        state = _state(reference, prompt)
        params = params_to_dict(SamplingParams(max_new_tokens=4, temperature=0.0, seed=1))
        dest = pd.decode.state_addr
        e = pd.decode.engine
        total = e.num_total_blocks()

        # 1. a corrupted frame: checksum failure, the sample fails, nothing is held
        gw.send({"op": "reserve", "rid": "bad-1", "prompt_ids": prompt, "params": params})
        assert gw.recv(op="reserved")["state_addr"] == dest
        assert e.num_free_blocks() != total
        frames = encode_layer("bad-1", pd.decode.fingerprint, len(prompt), 0,
                              {k: v for k, v in state.items() if k.startswith("layers.0.")})
        raw = bytearray(frames[1])
        raw[len(raw) // 2] ^= 0xFF
        sender.send(dest, [frames[0], bytes(raw), *frames[2:]])
        err = gw.recv(op="error")
        assert err["rid"] == "bad-1" and "checksum" in err["message"]
        nack = _reply(sender)
        assert nack["op"] == "nack" and nack["transfer_id"] == "bad-1" and nack["cause"] == "checksum"
        assert e.num_free_blocks() == total and not e.pd.reserved

        # 2. fencing: a late (valid) write for the failed id never lands
        before = e.num_free_blocks()
        sender.send(dest, encode_layer("bad-1", pd.decode.fingerprint, len(prompt), 1,
                                       {k: v for k, v in state.items() if k.startswith("layers.1.")}))
        time.sleep(0.3)
        assert e.num_free_blocks() == before == total

        # 3. abort of a reservation, then a late write: fenced
        gw.send({"op": "reserve", "rid": "ab-1", "prompt_ids": prompt, "params": params})
        gw.recv(op="reserved")
        gw.send({"op": "abort", "rid": "ab-1"})
        time.sleep(0.2)
        sender.send(dest, encode_layer("ab-1", pd.decode.fingerprint, len(prompt), 0,
                                       {k: v for k, v in state.items() if k.startswith("layers.0.")}))
        time.sleep(0.3)
        assert e.num_free_blocks() == total and not e.pd.reserved

        # 4. a reservation its gateway renews outlives its lease (a prefill may queue or compute for
        # minutes); renewals from another connection do not count; once they stop, the lease frees
        # it (504 to the gateway)
        other = _Gateway(pd.decode.opts.port)
        gw.send({"op": "reserve", "rid": "lease-1", "prompt_ids": prompt, "params": params})
        assert gw.recv(op="reserved")["lease_s"] == 1.0
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            gw.send({"op": "renew", "rids": ["lease-1", "no-such-id"]})
            other.send({"op": "renew", "rids": ["lease-1"]})
            time.sleep(0.25)
        assert "lease-1" in pd.decode.table.pending and e.pd.reserved
        t0 = time.monotonic()
        err = gw.recv(op="error", timeout_s=5)
        assert err["rid"] == "lease-1" and err["status"] == 504 and time.monotonic() - t0 < 1.5
        assert e.num_free_blocks() == total and not e.pd.reserved
        other.close()

        # 5. transfer ids are never reused
        gw.send({"op": "reserve", "rid": "lease-1", "prompt_ids": prompt, "params": params})
        err = gw.recv(op="error")
        assert err["status"] == 400 and "already used" in err["message"]
        text = pd.decode.metrics.render().decode()
        assert 'cause="checksum"' in text and 'cause="fenced"' in text and 'cause="timeout"' in text
    finally:
        sender.close()
        gw.close()
        pd.close()


def _reply(sender, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for _dest, msg in sender.poll_replies(0.1):
            if msg.get("op") in ("ack", "nack"):
                return msg
    raise TimeoutError("no reply")


def test_unknown_instance_and_token_one_that_ends_the_sample(pd, reference):
    """max_new_tokens=1: token #1 from prefill ends it; decode's reservation is freed at once."""
    prompt = _prompts([40], seed=5)[0]
    req = GenRequest(f"one-{uuid.uuid4().hex}", prompt, SamplingParams(max_new_tokens=1, temperature=0.0, seed=3))
    got = asyncio.run(collect_tokens(pd.backend(), [req]))
    assert got[0] == reference.generate([prompt], req.params)[0].output_ids
    deadline = time.monotonic() + 5
    while not pd.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pd.idle()

    async def no_decode():
        b = PDBackend([f"127.0.0.1:{pd.prefill.opts.port}"], [f"127.0.0.1:{free_port()}"])
        await b.start()
        try:
            await asyncio.sleep(0.5)
            with pytest.raises(BackendError, match="no healthy decode") as ei:
                async for _ in b.generate(GenRequest("x-1", prompt, req.params)):
                    pass
            assert ei.value.status == 503
        finally:
            await b.close()
    asyncio.run(no_decode())


def test_bad_destination_fails_that_sample_only(pd, reference):
    """A prefill whose destination is not a receiver: an error for that sample, the worker serves on."""
    gw = _Gateway(pd.prefill.opts.port)
    prompt = _prompts([20], seed=9)[0]
    params = SamplingParams(max_new_tokens=3, temperature=0.0, seed=2)
    try:
        gw.send({"op": "prefill", "rid": f"bad-{uuid.uuid4().hex}", "prompt_ids": prompt,
                 "params": params_to_dict(params), "dest": "garbage"})
        first = gw.recv(op="first")
        err = gw.recv(op="error", timeout_s=30)
        assert first["rid"] == err["rid"] and err["status"] == 502
    finally:
        gw.close()
    req = GenRequest(f"ok-{uuid.uuid4().hex}", prompt, params)
    assert asyncio.run(collect_tokens(pd.backend(), [req]))[0] == reference.generate([prompt], params)[0].output_ids
    assert pd.prefill.engine.num_free_blocks() == pd.prefill.engine.num_total_blocks()


def test_idle_loops_wake_on_messages_not_a_timer(ckpt, reference):
    """With an idle poll of 60 s, both workers still act at once: an idle loop blocks on its sockets
    and is woken by what arrives, the state receiver (decode: layers + commit, no request message)
    or the pusher (prefill: decode's answer to a transfer), never by a timer; idle, it does not spin."""
    opts = {"http_port": 0, "idle_poll_ms": 60_000}
    dec = DecodeWorker(_engine(ckpt), WorkerOptions(port=free_port(), state_port=free_port(), **opts))
    pre = PrefillWorker(_engine(ckpt), WorkerOptions(port=free_port(), **opts))
    threads = [threading.Thread(target=w.run, daemon=True) for w in (dec, pre)]
    for t in threads:
        t.start()
    gw_d, gw_p = _Gateway(dec.opts.port), _Gateway(pre.opts.port)
    sender = make_sender("zmq-tcp", dec.fingerprint, dec.layout, "test-prefill-wake")
    rx = make_receiver("zmq-tcp", "127.0.0.1", 0, pre.fingerprint, pre.layout)
    try:
        time.sleep(0.5)
        start = (dec.iterations, pre.iterations)
        time.sleep(1.0)
        assert dec.iterations - start[0] <= 2 and pre.iterations - start[1] <= 2     # blocked, not polling

        # decode: reserved, then only the state arrives; the receiver wakes the loop, which commits
        # and decodes (a timer-driven loop would sit in its 60 s poll)
        prompt = _prompts([70], seed=11)[0]
        params = SamplingParams(max_new_tokens=4, temperature=0.0, seed=1)
        want = reference.generate([prompt], [params])[0].output_ids
        gw_d.send({"op": "reserve", "rid": "wake-1", "prompt_ids": prompt, "params": params_to_dict(params)})
        gw_d.recv(op="reserved")
        state = _state(reference, prompt)
        num_layers = len(dec.engine.model.layers)
        time.sleep(0.2)                                                # idle again
        for layer in range(num_layers):
            part = {k: v for k, v in state.items() if k.startswith(f"layers.{layer}.")}
            sender.send(dec.state_addr, encode_layer("wake-1", dec.fingerprint, len(prompt), layer, part))
        sender.send(dec.state_addr, encode_commit("wake-1", dec.fingerprint, len(prompt), want[0], num_layers))
        ids, done = [], False
        while not done:
            for item in gw_d.recv(op="out", timeout_s=10)["items"]:
                ids += item["ids"]
                done = done or item["done"]
        assert ids == want[1:]

        # prefill: decode's nack comes while the loop is idle again; the pusher wakes it and the
        # sample's error reaches the gateway at once
        gw_p.send({"op": "prefill", "rid": "wake-2", "prompt_ids": prompt, "params": params_to_dict(params),
                   "dest": f"{rx.address}#{rx.receiver_id}"})
        assert gw_p.recv(op="first")["id"] == want[0]
        peer, end = None, time.monotonic() + 10
        while peer is None and time.monotonic() < end:
            for p, frames in rx.recv(0.1):
                if decode_header(frames[0])["kind"] == "commit":
                    peer = p
        assert peer is not None
        time.sleep(0.3)
        rx.reply(peer, {"op": "nack", "transfer_id": "wake-2", "cause": "checksum", "reason": "test nack"})
        err = gw_p.recv(op="error", timeout_s=10)
        assert err["rid"] == "wake-2" and err["status"] == 502 and "checksum" in err["message"]
    finally:
        for w in (dec, pre):
            w.stop.set()
            w.wake()
        for t in threads:
            t.join(10)
        sender.close()
        rx.close()
        gw_d.close()
        gw_p.close()
        dec.close()
        pre.close()
