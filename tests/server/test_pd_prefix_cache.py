"""Prefix caching through ``launch-pd``: 2 prefill instances with ``--enable-prefix-caching``, one
decode, the gateway routing prefill ``cache_aware``. 8 conversations x 4 turns (each turn re-sends
the conversation, through the ``openai`` SDK): follow-up turns go to the prefill instance that
holds their prefix and start from its cached state, the instances share the conversations, and
every output equals the uncached in-process engine's (greedy and seeded)."""
from __future__ import annotations

import random

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from engine.core.prefix_cache import CHUNK
from engine.core.sampling_params import SamplingParams
from server.launch.local import LocalPD, log_tail

CONFIG = "configs/tiny-flash.yaml"


@pytest.fixture(scope="module")
def cluster(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("pd") / "pd.log"
    pd = LocalPD(CONFIG, ckpt, num_prefill=2, num_decode=1, log_path=str(log),
                 extra_args={"prefill": ["--enable-prefix-caching"]})
    try:
        pd.start(timeout_s=300)
    except RuntimeError as e:
        pytest.fail(f"{e}\n{log_tail(log, 40)}")
    yield pd
    pd.stop()


def _counter(url: str, name: str) -> float:
    text = httpx.get(url, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_follow_up_turns_reuse_the_prefix_on_the_instance_that_holds_it(cluster, reference):
    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    rng = random.Random(0)
    V = reference.model.args.vocab_size
    system = [rng.randrange(2, V) for _ in range(256)]
    convs = [system + [rng.randrange(2, V) for _ in range(300)] for _ in range(8)]
    prompt_total = cached_total = seen = 0
    prev_len = [0] * len(convs)          # each conversation's previous prompt length
    for turn in range(4):
        for c, prompt in enumerate(convs):
            seeded = (turn + c) % 2 == 1
            kw = dict(temperature=0.8, seed=turn * 8 + c) if seeded else dict(temperature=0.0, seed=0)
            r = client.completions.create(model=model, prompt=prompt, max_tokens=3, extra_body={
                "return_token_ids": True}, **kw)
            out = r.choices[0].model_extra["token_ids"]
            want = reference.generate([prompt], SamplingParams(max_new_tokens=3, temperature=kw["temperature"],
                                                               seed=kw["seed"]))[0].output_ids
            assert out == want, (turn, c)
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert cached % CHUNK == 0 and cached < len(prompt)
            seen += cached
            if turn:        # the previous turn's last boundary, at least
                assert cached >= (prev_len[c] - 1) // CHUNK * CHUNK, (turn, c)
                prompt_total += len(prompt)
                cached_total += cached
            convs[c] = prompt + out + [rng.randrange(2, V) for _ in range(40)]
        prev_len = [len(p) - len(out) - 40 for p in convs]
    assert cached_total / prompt_total > 0.8
    health = httpx.get(cluster.base_url + "/health", timeout=10).json()
    assert health["prefill_routing"]["policy"] == "cache_aware"
    assert health["prefill_routing"]["by_prefix"] >= 24
    # both instances took conversations: their prompt tokens are within 2:1 of each other
    per = [_counter(cluster.metrics_urls[f"prefill{i}"], "dsv4:prefix_cache_queries_total") for i in range(2)]
    assert min(per) > 0 and max(per) <= 2 * min(per), per
    hits = sum(_counter(cluster.metrics_urls[f"prefill{i}"], "dsv4:prefix_cache_hits_total") for i in range(2))
    assert hits == seen                  # every cached token the clients saw, counted by the workers
    by_source = sum(_counter(cluster.metrics_urls[f"prefill{i}"], "dsv4:prompt_tokens_by_source_total")
                    for i in range(2))
    assert by_source == sum(per)


def test_reset_prefix_cache_evicts_every_entry(cluster):
    base = cluster.metrics_urls["prefill0"].rsplit("/", 1)[0]
    r = httpx.post(base + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["evicted"] >= 0
    health = httpx.get(base + "/health", timeout=10).json()
    assert health["prefix_cache"]["entries"] == 0
    ready = httpx.get(base + "/ready", timeout=10).json()
    assert ready["free_blocks"] == ready["total_blocks"]
    dec = cluster.metrics_urls["decode0"].rsplit("/", 1)[0]
    r = httpx.post(dec + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 400 and "enable_prefix_caching" in r.json()["error"]["message"]


def test_chat_responses_and_messages_report_the_cached_prompt_tokens(cluster):
    """A repeated conversation: its second request reports the served prefix in each API's usage
    field (Chat: prompt_tokens_details.cached_tokens; Responses: input_tokens_details.cached_tokens;
    Anthropic Messages: cache_read_input_tokens)."""
    import anthropic
    system = " ".join(f"rule {i}: answer briefly." for i in range(120))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]
    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    chat = [client.chat.completions.create(model=model, messages=msgs, max_tokens=2, temperature=0).usage
            for _ in range(2)]
    assert chat[0].prompt_tokens > 2 * CHUNK
    assert chat[1].prompt_tokens_details.cached_tokens >= CHUNK * ((chat[1].prompt_tokens - 1) // CHUNK) - CHUNK
    resp = [client.responses.create(model=model, instructions=system, input="hello there", max_output_tokens=2,
                                    temperature=0).usage for _ in range(2)]
    assert resp[1].input_tokens_details.cached_tokens > 0
    anth = anthropic.Anthropic(base_url=cluster.base_url, api_key="none", max_retries=0)
    msg = [anth.messages.create(model=model, system=system, messages=[{"role": "user", "content": "hello there"}],
                                max_tokens=2).usage for _ in range(2)]
    assert msg[1].cache_read_input_tokens > 0
