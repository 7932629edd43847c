"""The main job end to end: real ``launch-pd`` processes (2 prefill, 2 decode, 1 gateway) on
loopback, the ``openai`` client, streamed chat and completions. Token ids equal the in-process
engine's for the same seed; /metrics counters add up; a client that goes away frees its state."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from engine.core.sampling_params import SamplingParams
from server.launch.local import LocalPD, log_tail

from pd_util import drop_stream

CONFIG = "configs/tiny-flash.yaml"


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("pd") / "pd.log"
    pd = LocalPD(CONFIG, ckpt, num_prefill=2, num_decode=2, log_path=str(log))
    try:
        pd.start(timeout_s=300)
    except RuntimeError as e:
        pytest.fail(f"{e}\n{log_tail(log, 40)}")
    yield pd
    pd.stop()


def _client(pd) -> OpenAI:
    return OpenAI(base_url=pd.base_url + "/v1", api_key="none", max_retries=0)


def _model(pd) -> str:
    return _client(pd).models.list().data[0].id


def _reference_ids(engine, prompt, max_tokens, temperature, seed, **kw):
    p = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed, **kw)
    return engine.generate([prompt], p)[0].output_ids


def _stream_ids(stream) -> tuple[list[int], list[int] | None, str]:
    ids, prompt, text = [], None, ""
    for chunk in stream:
        for ch in chunk.choices:
            extra = ch.model_extra or {}
            ids += extra.get("token_ids") or []
            if getattr(ch, "delta", None) is not None:
                text += ch.delta.content or ""
            else:
                text += ch.text or ""
        prompt = (chunk.model_extra or {}).get("prompt_token_ids") or prompt
    return ids, prompt, text


@pytest.mark.parametrize("length", [100, 128, 129, 300])
@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 4242)])
def test_completion_stream_equals_in_process(cluster, reference, length, temperature, seed):
    prompt = torch.randint(1000, 60000, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    stream = _client(cluster).completions.create(
        model=_model(cluster), prompt=prompt, max_tokens=8, temperature=temperature, seed=seed, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    ids, _, _ = _stream_ids(stream)
    assert ids == _reference_ids(reference, prompt, 8, temperature, seed, ignore_eos=True)


def test_chat_stream_equals_in_process(cluster, reference):
    c = _client(cluster)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour. " * 40}]
    for temperature, seed in ((0.0, 1), (1.0, 99)):
        stream = c.chat.completions.create(model=_model(cluster), messages=msgs, max_tokens=10, seed=seed,
                                           temperature=temperature, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True, "thinking": {"type": "disabled"}})
        ids, prompt, text = _stream_ids(stream)
        assert prompt and len(prompt) > 128
        want = _reference_ids(reference, prompt, 10, temperature, seed)
        assert ids == want
        full = c.chat.completions.create(model=_model(cluster), messages=msgs, max_tokens=10, seed=seed,
                                         temperature=temperature, extra_body={"thinking": {"type": "disabled"}})
        assert full.choices[0].message.content == text


def _scrape(url: str) -> dict[str, float]:
    """Sum of each ``dsv4:*_total`` counter (over all label sets) plus per-reason successes."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = re.match(r"^(dsv4:[a-z_]+_total)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            r = re.search(r'(?:finished_reason|source)="(\w+)"', m.group(2) or "")
            if r:
                key = f"{m.group(1)}[{r.group(1)}]"
                out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _histogram_count(text: str, name: str) -> float:
    """The ``_count`` of histogram ``name`` in Prometheus text ``text`` (0 if absent)."""
    m = re.search(rf"^{re.escape(name)}_count(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _delta(before, after, key):
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_64_concurrent_streams_complete_and_metrics_add_up(cluster, reference):
    g = torch.Generator().manual_seed(64)
    prompts = [torch.randint(1000, 60000, (int(n),), generator=g).tolist()
               for n in torch.randint(20, 260, (64,), generator=g)]
    max_tokens = [int(x) for x in torch.randint(2, 7, (64,), generator=g)]
    before = {n: _scrape(u) for n, u in cluster.metrics_urls.items()}
    before_text = {n: httpx.get(u, timeout=10).text for n, u in cluster.metrics_urls.items()}
    model = _model(cluster)

    async def run():
        client = AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0, timeout=600)

        async def one(i):
            stream = await client.completions.create(
                model=model, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0.7, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True})
            ids, usage = [], None
            async for chunk in stream:
                for ch in chunk.choices:
                    ids += (ch.model_extra or {}).get("token_ids") or []
                usage = chunk.usage or usage
            return ids, usage
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()
    results = asyncio.run(run())
    want = reference.generate(prompts, [SamplingParams(max_new_tokens=m, temperature=0.7, seed=i, ignore_eos=True)
                                        for i, m in enumerate(max_tokens)])
    for (ids, usage), w, p in zip(results, want, prompts):
        assert ids == w.output_ids
        assert usage.prompt_tokens == len(p) and usage.completion_tokens == len(ids)
    time.sleep(1.0)
    after = {n: _scrape(u) for n, u in cluster.metrics_urls.items()}
    after_text = {n: httpx.get(u, timeout=10).text for n, u in cluster.metrics_urls.items()}
    P, G = sum(map(len, prompts)), sum(max_tokens)
    gw = lambda k: _delta(before["gateway"], after["gateway"], k)  # noqa: E731
    assert gw("dsv4:prompt_tokens_total") == P
    assert gw("dsv4:generation_tokens_total") == G
    assert gw("dsv4:request_success_total[length]") == 64
    pre = [n for n in after if n.startswith("prefill")]
    dec = [n for n in after if n.startswith("decode")]
    sum_ = lambda names, k: sum(_delta(before[n], after[n], k) for n in names)  # noqa: E731
    assert sum_(pre, "dsv4:prompt_tokens_total") == P          # each prompt prefilled exactly once
    assert sum_(pre, "dsv4:generation_tokens_total") == 64     # token #1 of each sample
    assert sum_(dec, "dsv4:prompt_tokens_total") == P          # ... whose state decode received
    assert sum_(dec, "dsv4:generation_tokens_total") == G - 64
    assert sum_(dec, "dsv4:kv_transfer_bytes_total") > 0
    assert sum_(dec, "dsv4:kv_transfer_failures_total") == 0
    # a finished sample is never aborted: each role's successes and transfers add up to the gateway's
    for names in (pre, dec):
        assert sum_(names, "dsv4:request_success_total") == sum_(names, "dsv4:request_success_total[length]") == 64
        assert sum_(names, "dsv4:kv_transfer_failures_total") == 0
    assert sum_(pre, "dsv4:kv_transfer_bytes_total") == sum_(dec, "dsv4:kv_transfer_bytes_total")
    assert sum_(pre, "dsv4:prompt_tokens_by_source_total[local_compute]") == P
    assert sum_(dec, "dsv4:prompt_tokens_by_source_total[kv_transfer]") == P
    for names in (pre, dec):
        assert sum(_histogram_count(after_text[n], "dsv4:kv_transfer_latency_seconds")
                   - _histogram_count(before_text[n], "dsv4:kv_transfer_latency_seconds") for n in names) == 64
    assert sum(_histogram_count(after_text[n], "dsv4:request_reservation_wait_seconds")
               - _histogram_count(before_text[n], "dsv4:request_reservation_wait_seconds") for n in dec) == 64
    for names in (dec, ["gateway"]):       # decode: the wait for room; gateway: that + prefill's queue
        assert sum(_histogram_count(after_text[n], "dsv4:request_queue_time_seconds")
                   - _histogram_count(before_text[n], "dsv4:request_queue_time_seconds") for n in names) == 64
    used = {n: _delta(before[n], after[n], "dsv4:prompt_tokens_total") for n in pre + dec}
    assert all(used.values()), f"least-loaded routing should use every instance: {used}"


def _decode_idle(cluster) -> bool:
    for name in cluster.ready_urls:
        if name.startswith("decode"):
            r = cluster.ready(name)
            if r["free_blocks"] != r["total_blocks"] or r["running"] or r["reserved"] or r.get("queued"):
                return False
    return True


def test_client_disconnect_aborts_decode_and_frees_its_state(cluster):
    assert _decode_idle(cluster)
    body = {"model": _model(cluster), "prompt": "Tell me a very long story. " * 10, "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    drop_stream(cluster.base_url, body)             # the connection is closed mid-stream
    busy = not _decode_idle(cluster)
    deadline = time.monotonic() + 10
    while not _decode_idle(cluster) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _decode_idle(cluster), "decode did not abort the sample"
    text = httpx.get(cluster.metrics_urls["gateway"]).text
    assert re.search(r'dsv4:request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]', text), busy


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "top_k": 2 ** 70}, None),
    ({"prompt": "hi", "stop_token_ids": [2 ** 64]}, None),
    ({"prompt": "\ud800 lone surrogate"}, "prompt"),
])
def test_out_of_range_and_invalid_unicode_are_400_not_500(cluster, body, param):
    r = httpx.post(cluster.base_url + "/v1/completions", timeout=60,
                   content=__import__("json").dumps({"model": _model(cluster), "max_tokens": 2, **body}).encode())
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    ok = _client(cluster).completions.create(model=_model(cluster), prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2
