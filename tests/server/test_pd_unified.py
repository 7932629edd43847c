"""A unified worker (``launch-pd --role unified``: prefill and decode in one engine) behind the
gateway, as ``launch-pd --role local`` starts it: real processes, the ``openai`` client. Its
tokens equal the in-process engine's (greedy, seeded, batched, chunked); token #1 that ends a
sample, logprobs, a client that goes away and bad messages all behave as on the P/D split."""
from __future__ import annotations

import re
import time

import httpx
import msgpack
import pytest
import yaml
import zmq
from openai import OpenAI

from engine.core.sampling_params import SamplingParams
from server.protocol import Abort, Prefill, Reserve

from pd_util import CONFIG, assert_completions_match, drop_stream, rand_prompt, start_pd, wait_idle

WORKER = "unified0"
MAX_QUEUED = 6


@pytest.fixture(scope="module")
def chunked_cfg(tmp_path_factory):
    """tiny-flash.yaml with 96-token prefill chunks: a 300-token prompt prefills over 4 steps,
    beside the decode rows of the others."""
    cfg = yaml.safe_load(open(CONFIG))
    cfg["scheduler_config"]["max_prefill_tokens"] = 96
    path = tmp_path_factory.mktemp("unified-cfg") / "chunked.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def cluster(ckpt, chunked_cfg, tmp_path_factory):
    pd = start_pd(ckpt, tmp_path_factory.mktemp("unified") / "pd.log", num_prefill=0, num_decode=0, num_unified=1,
                  config=str(chunked_cfg), instance_args={"unified": ["--max-queued", str(MAX_QUEUED)]})
    yield pd
    pd.stop()


def _client(pd) -> OpenAI:
    return OpenAI(base_url=pd.base_url + "/v1", api_key="none", max_retries=0)


def test_one_engine_serves_both_roles(cluster):
    health = httpx.get(cluster.base_url + "/health", timeout=10).json()
    assert health["healthy"] and health["healthy_prefill"] == health["healthy_decode"]
    assert health["compatible_pairs"] == 1 and health["incompatible_pairs"] == []
    assert set(cluster.procs) == {WORKER, "gateway"}
    ready = cluster.ready(WORKER)
    assert ready["role"] == "unified" and ready["state_addr"].startswith("local#unified-")


def test_batched_chunked_tokens_equal_in_process(cluster, reference):
    """Concurrent greedy and seeded samples, two of them longer than a prefill chunk."""
    assert_completions_match(cluster, reference, [(100, 0.0, 0), (300, 0.8, 7), (129, 0.0, 3), (250, 1.0, 11),
                                                  (40, 0.0, 5)], 10)
    wait_idle(cluster, [WORKER])
    text = httpx.get(cluster.metrics_urls[WORKER], timeout=10).text
    local = re.search(r'dsv4:prompt_tokens_by_source_total\{[^}]*role="unified"[^}]*source="local_compute"[^}]*\} '
                      r'(\S+)', text)
    assert local and float(local.group(1)) >= 100 + 300 + 129 + 250 + 40
    gen = re.search(r'dsv4:generation_tokens_total\{[^}]*role="unified"[^}]*\} (\S+)', text)
    assert gen and float(gen.group(1)) >= 50


def test_token_one_that_ends_it_and_logprobs(cluster, reference):
    c = _client(cluster)
    model = c.models.list().data[0].id
    prompt = rand_prompt(70, 70)
    one = c.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True})
    ref = reference.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True,
                                                      logprobs=2))[0]
    assert one.choices[0].model_extra["token_ids"] == ref.output_ids[:1]
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    stream = c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, stream=True,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    ids, lps = [], []
    for chunk in stream:
        for ch in chunk.choices:
            ids += ch.model_extra.get("token_ids") or []
            if ch.logprobs is not None:
                lps += ch.logprobs.token_logprobs
    assert ids == ref.output_ids
    assert lps == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    wait_idle(cluster, [WORKER])


def test_client_disconnect_frees_the_state(cluster):
    body = {"model": "deepseek_v4", "prompt": "Tell me a very long story. " * 10, "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    drop_stream(cluster.base_url, body)
    wait_idle(cluster, [WORKER], timeout_s=15)
    text = httpx.get(cluster.metrics_urls[WORKER], timeout=10).text
    assert re.search(r'dsv4:request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]', text)


def test_prefill_without_its_reservation_is_refused(cluster):
    """Only the samples it reserved: a prefill for another destination, or with no reservation, is
    a 400 naming the field; the worker holds nothing after."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.LINGER, 0)
    addr = cluster.cmds[WORKER][cluster.cmds[WORKER].index("--port") + 1]
    sock.connect(f"tcp://127.0.0.1:{addr}")
    params = SamplingParams(max_new_tokens=4, temperature=0.0, seed=1)

    def ask(msg) -> dict:
        sock.send(msg.pack())
        return msgpack.unpackb(sock.recv(), raw=False)
    try:
        r = ask(Prefill(rid="nores", prompt_ids=[5, 6, 7], params=params, dest="local#x"))
        assert r["op"] == "error" and r["status"] == 400 and "no reservation" in r["message"]
        r = ask(Reserve(rid="bad-dest", prompt_ids=[5, 6, 7], params=params, lease_s=5.0))
        assert r["op"] == "reserved"
        r = ask(Prefill(rid="bad-dest", prompt_ids=[5, 6, 7], params=params, dest="tcp://elsewhere:1#d"))
        assert r["op"] == "error" and r["status"] == 400 and r["message"].startswith("dest:")
        r = ask(Reserve(rid="bad-dest", prompt_ids=[5, 6, 7], params=params))
        assert r["op"] == "reserved"             # the refused prefill ended the first reservation
        r = ask(Prefill(rid="bad-dest", prompt_ids=[5, 6, 7], params=params, dest=r["state_addr"]))
        first = r if r["op"] == "first" else ask_until(sock, "first")
        assert first["id"] >= 0
    finally:
        sock.close()
        ctx.term()
    wait_idle(cluster, [WORKER], timeout_s=15)


def _dealer(cluster, ctx):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{cluster.cmds[WORKER][cluster.cmds[WORKER].index('--port') + 1]}")
    return sock


def _ask(sock, msg) -> dict:
    sock.send(msg.pack())
    return msgpack.unpackb(sock.recv(), raw=False)


def test_the_prefill_connection_going_after_token_one_ends_nothing(cluster, reference):
    """Reserved on one connection, prefilled on another that closes once token #1 came: the
    reserving connection still gets every later token (as from a decode worker)."""
    ctx = zmq.Context()
    a, b = _dealer(cluster, ctx), _dealer(cluster, ctx)
    prompt, params = rand_prompt(60, 60), SamplingParams(max_new_tokens=120, temperature=0.0, seed=1, ignore_eos=True)
    try:
        r = _ask(a, Reserve(rid="two-conns", prompt_ids=prompt, params=params))
        assert r["op"] == "reserved"
        first = _ask(b, Prefill(rid="two-conns", prompt_ids=prompt, params=params, dest=r["state_addr"]))
        assert first["op"] == "first" and msgpack.unpackb(b.recv(), raw=False)["op"] == "transferred"
        b.close()
        ids, done = [first["id"]], False
        while not done:
            m = msgpack.unpackb(a.recv(), raw=False)
            for item in m.get("items", []):
                ids += item["ids"]
                done = done or item["done"]
        assert ids == reference.generate([prompt], params)[0].output_ids
    finally:
        a.close()
        ctx.term()
    wait_idle(cluster, [WORKER], timeout_s=15)


def test_reservations_waiting_for_their_prefill_count_against_max_queued(cluster):
    ctx = zmq.Context()
    a = _dealer(cluster, ctx)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, seed=1)
    try:
        for i in range(MAX_QUEUED):
            assert _ask(a, Reserve(rid=f"q{i}", prompt_ids=[5, 6], params=params))["op"] == "reserved"
        assert cluster.ready(WORKER)["queued"] == MAX_QUEUED
        r = _ask(a, Reserve(rid="one-too-many", prompt_ids=[5, 6], params=params))
        assert r["op"] == "error" and r["status"] == 429
        for i in range(MAX_QUEUED):
            a.send(Abort(rid=f"q{i}").pack())
        end = time.monotonic() + 10
        while cluster.ready(WORKER)["queued"] and time.monotonic() < end:
            time.sleep(0.1)
        assert cluster.ready(WORKER)["queued"] == 0
    finally:
        a.close()
        ctx.term()


def ask_until(sock, op: str, timeout_s: float = 20) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        m = msgpack.unpackb(sock.recv(), raw=False)
        if m.get("op") == op:
            return m
    raise AssertionError(f"no {op}")
