"""Pings answered during a long engine step (``server.workers.step_pings``), on real sockets: the
helper answers only once a step has run ``after_s`` and hands every other frame back in order; a
real prefill worker in a 2,000-token step answers the gateway's ping with the step's age, handles
a request sent meanwhile after the step, and the gateway counts a step's age as unanswered pings."""
from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import zmq

from engine.build import build_engine
from engine.core.sampling_params import SamplingParams
from engine.run_config import RunConfig
from server.backends.links import WorkerLinks
from server.launch.local import free_port
from server.workers.base import WorkerOptions
from server.workers.prefill import PrefillWorker
from server.protocol import Pong
from server.protocol_fields import pack, params_to_dict, unpack
from server.workers.step_pings import MAX_KEPT, StepPings


class _Pair:
    """A worker-like ROUTER with its StepPings, and a gateway-like DEALER."""

    def __init__(self, after_s: float):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        pong = Pong(role="prefill", instance_id="test", ready=True, running=0, waiting=3, reserved=0, batch_size=1,
                    kv_usage=0.0, free_blocks={}, total_blocks={}, max_model_len=1, prefix_caching=False,
                    fingerprint="", handshake={})
        self.pings = StepPings(self.router, lambda: pong, after_s)

    def recv(self, timeout_s: float) -> dict | None:
        return unpack(self.dealer.recv()) if self.dealer.poll(int(timeout_s * 1000)) else None

    def close(self):
        self.pings.close()
        for s in (self.router, self.dealer):
            s.close(0)
        self.ctx.term()


def test_the_helper_answers_only_inside_a_long_step_and_keeps_the_rest_in_order():
    p = _Pair(after_s=0.2)
    try:
        p.dealer.send(pack({"op": "ping"}))
        assert p.recv(0.4) is None                      # no step: the owner's socket, nobody reads it
        p.pings.begin()
        t0 = time.monotonic()
        pong = p.recv(5.0)                              # the waiting ping, once the step is 0.2 s old
        assert pong is not None and time.monotonic() - t0 >= 0.15
        assert pong["waiting"] == 3 and 0.15 <= pong["step_s"] < 5
        p.dealer.send(pack({"op": "prefill", "rid": "a"}))
        p.dealer.send(b"not msgpack")
        p.dealer.send(pack({"op": "ping"}))
        p.dealer.send(pack({"op": "abort", "rid": "a"}))
        assert p.recv(2.0)["step_s"] >= pong["step_s"]
        p.pings.end()
        kept = p.pings.take_kept()
        assert [f[1] for f in kept] == [pack({"op": "prefill", "rid": "a"}), b"not msgpack",
                                        pack({"op": "abort", "rid": "a"})]
        assert not p.pings.pending() and p.pings.answered == 2

        # a step shorter than after_s: the helper never takes the socket
        p.pings.begin()
        p.dealer.send(pack({"op": "ping"}))
        time.sleep(0.05)
        p.pings.end()
        assert p.router.poll(1000) and unpack(p.router.recv_multipart()[1])["op"] == "ping"
        assert p.pings.answered == 2 and p.recv(0.3) is None
    finally:
        p.close()


def test_a_stream_of_frames_cannot_hold_the_loop_past_its_step():
    """Senders that never let the socket run empty: ``end`` still takes the socket back (the
    interrupt is looked at every ``BATCH`` frames, first), at most ``MAX_KEPT`` frames are kept,
    and the rest stay in the socket, in order behind them. The flood starts with a short batch, so
    the batches after it are not aligned to the cap."""
    p = _Pair(after_s=0.05)
    done, go = threading.Event(), threading.Event()

    def flood():
        d = p.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(p.router.getsockopt(zmq.LAST_ENDPOINT).decode())
        i = 0
        while not done.is_set():
            try:
                d.send(pack({"op": "abort", "rid": str(i)}), zmq.NOBLOCK)
                i += 1
                if i == 30:                     # a short first batch
                    go.wait(10)
            except zmq.Again:
                time.sleep(0.001)
        d.close(0)

    t = threading.Thread(target=flood)
    t.start()
    try:
        p.pings.begin()
        end = time.monotonic() + 30
        while len(p.pings._kept) < 30 and time.monotonic() < end:
            time.sleep(0.01)
        go.set()
        while len(p.pings._kept) < MAX_KEPT and time.monotonic() < end:   # the flood fills the cap
            time.sleep(0.05)
        p.pings.end()                                   # returns while the flood goes on
        done.set()
        kept = [unpack(f[1])["rid"] for f in p.pings.take_kept()]
        assert len(kept) == MAX_KEPT and kept == [str(i) for i in range(MAX_KEPT)]
        assert p.router.poll(5000)
        rest = [unpack(p.router.recv_multipart()[1])["rid"] for _ in range(100)]
        assert rest == [str(i) for i in range(MAX_KEPT, MAX_KEPT + 100)]
    finally:
        done.set()
        t.join(10)
        p.close()


def test_a_step_that_runs_past_the_health_timeout_takes_the_instance_out_of_routing():
    """The gateway's links read ``step_s`` as pings left unanswered: a worker whose step has run
    past ``health_timeout_s`` gets no new samples, one whose step ended does again."""
    ctx = zmq.Context()
    worker = ctx.socket(zmq.ROUTER)
    port = worker.bind_to_random_port("tcp://127.0.0.1")

    async def run():
        links = WorkerLinks([f"127.0.0.1:{port}"], ["127.0.0.1:1"], lambda *a: None, lambda *a: None,
                            health_interval_s=0.2, health_timeout_s=1.0)
        links.start()
        inst = links.instances[0]
        seen = []
        try:
            for step_s in (None, 0.6, 1.6, None):
                end = time.monotonic() + 10
                while time.monotonic() < end:           # answer pings until the gateway has read one
                    if worker.poll(0):
                        ident, _ = worker.recv_multipart()
                        pong = {"op": "pong", "ready": True, **({} if step_s is None else {"step_s": step_s})}
                        worker.send_multipart([ident, pack(pong)])
                        await asyncio.sleep(0.05)
                        if inst.load.get("step_s") == step_s:
                            break
                    await asyncio.sleep(0.01)
                seen.append(bool(links.healthy("prefill")))
        finally:
            await links.close()
        return seen

    try:
        assert asyncio.run(run()) == [True, True, False, True]
    finally:
        worker.close(0)
        ctx.term()


@pytest.fixture(scope="module")
def prefill(tiny_ckpt):
    eng = build_engine(RunConfig.from_yaml("configs/tiny-flash.yaml"), tiny_ckpt("flash", 1), progress=False)
    w = PrefillWorker(eng, WorkerOptions(port=free_port(), http_port=0))
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    yield w
    w.stop.set()
    t.join(30)
    w.close()


def test_a_prefill_worker_answers_pings_during_a_long_step(prefill):
    """A 2,000-token prefill is one step of a second or more on any CPU: the pings sent during it
    are answered with ``step_s`` before its token #1, and a request sent during it is served after."""
    V = prefill.engine.model.args.vocab_size
    rng = random.Random(0)
    params = params_to_dict(SamplingParams(max_new_tokens=2, temperature=0.0, seed=1))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{prefill.opts.port}")
    try:
        sock.send(pack({"op": "ping"}))
        assert sock.poll(10_000) and "step_s" not in unpack(sock.recv())       # idle: the loop answers
        long = [rng.randrange(V) for _ in range(2000)]
        sock.send(pack({"op": "prefill", "rid": "long", "prompt_ids": long, "params": params, "dest": "nowhere"}))
        got: list[dict] = []
        sent_second = False
        end = time.monotonic() + 120
        while not any(m["op"] == "first" and m["rid"] == "short" for m in got) and time.monotonic() < end:
            sock.send(pack({"op": "ping"}))
            while sock.poll(100):
                got.append(unpack(sock.recv()))
            if not sent_second and any("step_s" in m for m in got):
                sock.send(pack({"op": "prefill", "rid": "short", "prompt_ids": long[:30], "params": params,
                                "dest": "nowhere"}))
                sent_second = True
        ops = [(m["op"], m.get("rid"), "step_s" in m) for m in got]
        in_step = [i for i, o in enumerate(ops) if o == ("pong", None, True)]
        first_long = ops.index(("first", "long", False))
        first_short = ops.index(("first", "short", False))
        assert in_step and in_step[0] < first_long < first_short, ops
        assert prefill.step_pings.answered >= 1
        pong = got[in_step[0]]
        assert pong["ready"] and pong["role"] == "prefill" and pong["instance_id"] == prefill.instance_id
    finally:
        sock.close(0)
