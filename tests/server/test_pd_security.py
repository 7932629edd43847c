"""Hostile peers against real ``launch-pd`` processes: with a cluster secret, ZMQ peers without it
get nothing through (CURVE) and worker HTTP needs the secret; without one, fuzzed frames and
messages sent to every internal port (worker request ports, decode state port, HTTP ports) are
rejected without a crash or a leak. After each attack the cluster answers a real request and
holds no state."""
from __future__ import annotations

import random
import socket
import time

import httpx
import msgpack
import zmq
from openai import OpenAI

from kvtransfer.secure import secure_client
from pd_util import start_pd, wait_idle
from server.launch.local import log_tail
SECRET = "correct horse battery staple 42"


def _start(ckpt, log, secret=None):
    return start_pd(ckpt, log, flags=["--worker-timeout-s", "2", "--lease-s", "3"], cluster_secret=secret)


def _ports(pd) -> dict[str, int]:
    """Every internal port: worker ZMQ request ports, the decode state port, worker HTTP ports."""
    out = {}
    for name in ("prefill0", "decode0"):
        cmd = pd.cmds[name]
        out[f"{name}.zmq"] = int(cmd[cmd.index("--port") + 1])
        out[f"{name}.http"] = int(cmd[cmd.index("--http-port") + 1])
        if "--state-port" in cmd:
            out[f"{name}.state"] = int(cmd[cmd.index("--state-port") + 1])
    return out


def _serves(pd) -> list[int]:
    c = OpenAI(base_url=pd.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.completions.create(model="deepseek_v4", prompt=[1000 + i for i in range(40)], max_tokens=4,
                             temperature=0.0, extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 4
    return ids


def _idle(pd) -> None:
    wait_idle(pd, ("prefill0", "decode0"))


def _ping(port: int, secret=None, timeout_ms: int = 1500) -> dict | None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(s, secret)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(msgpack.packb({"op": "ping"}))
        return msgpack.unpackb(s.recv()) if s.poll(timeout_ms) else None
    finally:
        s.close(0)
        ctx.term()


def _tcp_garbage(port: int, rng: random.Random) -> None:
    for _ in range(5):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                c.sendall(rng.randbytes(rng.choice([1, 10, 64, 1000, 70_000])))
                c.settimeout(0.2)
                try:
                    c.recv(100)
                except OSError:
                    pass
        except OSError:
            pass


def _fuzz_message(rng: random.Random) -> list[bytes]:
    """A random request: raw bytes, non-map msgpack, or a map with a real op and wrong fields."""
    junk = [None, True, -1, 2 ** 63, 1.5, "x" * 300, b"\x00\xff", [], {}, [1, -5, 2 ** 40], {"a": 1}]
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 2000))]
    if kind == 1:
        return [msgpack.packb(rng.choice(junk))]
    if kind == 2:
        return [rng.randbytes(10), rng.randbytes(10)]              # two frames
    op = rng.choice(["reserve", "prefill", "abort", "ping", "first", "nope", ""])
    msg = {"op": op}
    for k in ("rid", "prompt_ids", "params", "lease_s", "deadline_s", "dest"):
        if rng.random() < 0.7:
            msg[k] = rng.choice(junk + ["fz-%d" % rng.randrange(10 ** 6), [rng.randrange(129280) for _ in range(5)],
                                        {"temperature": rng.choice(junk), "seed": rng.choice(junk)},
                                        {"max_new_tokens": 2, "seed": 1}, "tcp://127.0.0.1:1#x"])
    return [msgpack.packb(msg)]


def test_secured_cluster_refuses_peers_without_the_secret(ckpt, tmp_path):
    pd = _start(ckpt, tmp_path / "sec.log", SECRET)
    try:
        want = _serves(pd)                                    # gateway -> workers and prefill -> decode: CURVE
        ports = _ports(pd)
        for name in ("prefill0", "decode0"):
            zp = ports[f"{name}.zmq"]
            assert _ping(zp, None) is None                    # plain ZMQ: no handshake, no answer
            assert _ping(zp, "another secret, long enough") is None
            assert _ping(zp, SECRET)["op"] == "pong"
            url = f"http://127.0.0.1:{ports[f'{name}.http']}"
            for path in ("/ready", "/metrics", "/health"):
                assert httpx.get(url + path, timeout=5).status_code == 401
                assert httpx.get(url + path, timeout=5, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert httpx.get(url + "/metrics", timeout=5, headers=pd.headers).status_code == 200
        rng = random.Random(1)
        for port in ports.values():
            _tcp_garbage(port, rng)
        assert pd.alive()
        assert _serves(pd) == want
        _idle(pd)
    finally:
        pd.stop()


def test_fuzzed_frames_on_every_internal_port_neither_crash_nor_leak(ckpt, tmp_path):
    pd = _start(ckpt, tmp_path / "fuzz.log")
    try:
        want = _serves(pd)
        ports = _ports(pd)
        rng = random.Random(5)
        ctx = zmq.Context()
        try:
            for key in ("prefill0.zmq", "decode0.zmq", "decode0.state"):
                socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
                for s in socks:
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(f"tcp://127.0.0.1:{ports[key]}")
                for _ in range(200):
                    rng.choice(socks).send_multipart(_fuzz_message(rng))
                time.sleep(0.5)
                for s in socks:
                    while s.poll(0):
                        s.recv_multipart()                    # replies (errors) are fine; nothing else
                    s.close(0)
        finally:
            ctx.term()
        for port in ports.values():
            _tcp_garbage(port, rng)
        for key in ("prefill0.http", "decode0.http"):
            url = f"http://127.0.0.1:{ports[key]}"
            assert httpx.post(url + "/ready", content=rng.randbytes(100), timeout=5).status_code in (404, 405)
            assert httpx.get(url + "/nope", timeout=5).status_code == 404
        assert pd.alive()
        assert _serves(pd) == want
        _idle(pd)                                             # fuzzed reservations expire with their lease
        text = log_tail(pd.log, 400)
        assert text.count("bad request") < 20                 # rate-limited, not one line per frame
    finally:
        pd.stop()
