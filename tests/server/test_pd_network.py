"""The network between the processes, with real ``launch-pd`` processes (2 prefill, 2 decode, two
gateways): gateway A reaches the prefills through TCP relays the tests cut and restore (a blip),
gateway B directly. What the ``openai`` client sees is asserted: exact tokens, no error."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai import AsyncOpenAI

from engine.core.sampling_params import SamplingParams
from pd_util import CONFIG, rand_prompt, wait_idle
from relay_util import Relay
from server.launch.local import LocalPD, free_port, log_tail

WORKERS = ("prefill0", "prefill1", "decode0", "decode1")


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.fixture(scope="module")
def net(ckpt, tmp_path_factory):
    """``(pd, relays, url_b)``: gateway A (``pd.base_url``) behind relays to the prefills; gateway B at ``url_b``."""
    log = tmp_path_factory.mktemp("net") / "pd.log"
    flags = ["--worker-timeout-s", "2", "--cpu-threads", "1"]
    extra = {r: list(flags) for r in ("prefill", "decode", "gateway")}
    pd = LocalPD(CONFIG, ckpt, num_prefill=2, num_decode=2, log_path=str(log), extra_args=extra)
    relays = [Relay(f"tcp://127.0.0.1:{_arg(pd.cmds[f'prefill{i}'], '--port')}", f"tcp://127.0.0.1:{free_port()}")
              for i in range(2)]
    gw = pd.cmds["gateway"]
    b = gw.copy()
    b[b.index("--port") + 1] = str(free_port())
    gw += ["--prefill-addrs", ",".join(r.address.removeprefix("tcp://") for r in relays)]   # the last one wins
    pd.cmds["gateway_b"] = b
    url_b = f"http://127.0.0.1:{_arg(b, '--port')}"
    pd.metrics_urls["gateway_b"] = url_b + "/metrics"
    try:
        pd.start(timeout_s=300)
        end = time.monotonic() + 60
        while httpx.get(url_b + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < end, "gateway B never became healthy"
            time.sleep(0.2)
    except (RuntimeError, AssertionError) as e:
        pytest.fail(f"{e}\n{log_tail(log, 40)}")
    pd.log = log
    yield pd, relays, url_b
    pd.stop()
    for r in relays:
        r.close()


async def _stream(url: str, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        stream = await client.completions.create(
            model="deepseek_v4", prompt=prompt, max_tokens=max_tokens, temperature=0.8, seed=seed, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        ids = []
        async for chunk in stream:
            for ch in chunk.choices:
                ids += (ch.model_extra or {}).get("token_ids") or []
        return ids


def _expected(reference, prompts, max_tokens, seeds):
    return [o.output_ids for o in reference.generate(
        prompts, [SamplingParams(max_new_tokens=max_tokens, temperature=0.8, seed=s, ignore_eos=True) for s in seeds])]


def test_a_gateway_prefill_blip_loses_no_request(net, reference):
    """4 samples in prefill while gateway A's connections to both prefills are cut for 0.3 s: the
    gateway retries each once the connection is back (within the default 5 s --reconnect-grace-s,
    though one step of these prompts can outlast it on a loaded machine: a prefill answers the
    ping that makes it healthy again during the step, ``StepPings``), so all four
    complete with the exact tokens; the orphaned first attempts are aborted on the prefills when
    they reconnect, so afterwards nothing is held anywhere."""
    pd, relays, _ = net
    prompts = [rand_prompt(1500 + 10 * i, 300 + i) for i in range(4)]
    seeds = list(range(4))
    retries = httpx.get(pd.base_url + "/health", timeout=5).json()["retries"]

    async def run():
        tasks = [asyncio.create_task(_stream(pd.base_url, p, 4, s)) for p, s in zip(prompts, seeds)]
        end = time.monotonic() + 60
        while not any(pd.ready(n)["running"] or pd.ready(n)["waiting"] for n in ("prefill0", "prefill1")):
            assert time.monotonic() < end, "no prefill picked the samples up"
            await asyncio.sleep(0.01)
        await asyncio.gather(*(asyncio.to_thread(r.reset, down_s=0.3) for r in relays))
        return await asyncio.gather(*tasks)
    got = asyncio.run(run())
    assert got == _expected(reference, prompts, 4, seeds)
    assert httpx.get(pd.base_url + "/health", timeout=5).json()["retries"] > retries
    wait_idle(pd, WORKERS)


def test_two_gateways_share_the_workers(net, reference):
    """32 concurrent streams, half through each gateway, on the same 2 prefill + 2 decode workers."""
    pd, _, url_b = net
    prompts = [rand_prompt(20 + 3 * i, 500 + i) for i in range(32)]
    seeds = list(range(32))

    async def run():
        return await asyncio.gather(*(_stream(pd.base_url if i % 2 else url_b, p, 3, s)
                                      for i, (p, s) in enumerate(zip(prompts, seeds))))
    assert asyncio.run(run()) == _expected(reference, prompts, 3, seeds)
    wait_idle(pd, WORKERS)
