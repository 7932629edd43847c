"""What the P/D process tests share: starting a ``LocalPD`` on the tiny flash checkpoint, random
token prompts, checking concurrent completions against an in-process engine, and waiting until
workers hold no state."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import math
import time

import pytest
import torch

from server.launch.local import LocalPD, log_tail

CONFIG = "configs/tiny-flash.yaml"


def start_pd(ckpt: str, log, num_prefill: int = 1, num_decode: int = 1, flags: list[str] = (),
             cluster_secret: str | None = None, config: str = CONFIG,
             instance_args: dict[str, list[str]] | None = None, up=None, timeout_s: float = 300,
             num_unified: int = 0) -> LocalPD:
    """A started LocalPD with ``flags`` on every process and ``instance_args`` on the instances
    named ("prefill", "decode1": see ``LocalPD``) (``pd.log``: its log); fails the test with the
    log's tail if it does not come up within ``timeout_s`` (``up``: as ``LocalPD.start``'s)."""
    extra = {r: list(flags) for r in ("prefill", "decode", "unified", "gateway")}
    for name, args in (instance_args or {}).items():
        extra[name] = extra.get(name, []) + list(args)
    pd = LocalPD(config, ckpt, num_prefill=num_prefill, num_decode=num_decode, num_unified=num_unified,
                 log_path=str(log), cluster_secret=cluster_secret, extra_args=extra)
    try:
        pd.start(timeout_s=timeout_s, up=up)
    except RuntimeError as e:
        pytest.fail(f"{e}\n{log_tail(log, 40)}")
    pd.log = log
    return pd


def rand_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1000, 60000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_completions_match(pd: LocalPD, reference, cases, max_tokens: int) -> None:
    """Concurrent ``/v1/completions`` (``openai`` client) for ``cases`` of (prompt length,
    temperature, seed) carry the token ids ``reference`` (an in-process engine) gives each alone."""
    from openai import OpenAI

    from engine.core.sampling_params import SamplingParams
    client = OpenAI(base_url=pd.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def one(case):
        n, temperature, seed = case
        r = client.completions.create(model=model, prompt=rand_prompt(n, n), max_tokens=max_tokens,
                                      temperature=temperature, seed=seed,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        return r.choices[0].model_extra["token_ids"]

    with cf.ThreadPoolExecutor(len(cases)) as ex:
        got = list(ex.map(one, cases))
    for (n, temperature, seed), ids in zip(cases, got):
        p = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)
        assert ids == reference.generate([rand_prompt(n, n)], p)[0].output_ids, (n, temperature)


def state_payload_bytes(engine, num_tokens: int) -> int:
    """Tensor bytes of one request's P/D transfer after ``num_tokens`` prompt tokens on ``engine``'s
    model and caches: reference §4's live items (``expected_shapes``) and, when the engine runs MTP,
    its window rows: min(L, W-1) rows per MTP layer as the KV cache stores them (``mtp.k.win_kv``)."""
    from engine.core.pd_state import expected_shapes

    def nbytes(shape, dtype) -> int:
        return math.prod(shape) * dtype.itemsize

    pools = engine.runner.pools
    total = sum(nbytes(*sd) for sd in expected_shapes(pools, num_tokens).values())
    if engine.spec is not None:
        rows = min(num_tokens, engine.model.args.sliding_window - 1)
        total += engine.model.args.num_mtp_layers * sum(nbytes(*sd) for sd in pools.kv_codec.part_shapes(rows))
    return total


def wait_idle(pd: LocalPD, names, timeout_s: float = 30) -> None:
    """Every worker named holds nothing: all blocks free, nothing reserved, running, waiting or queued."""
    end = time.monotonic() + timeout_s
    while True:
        loads = {n: pd.ready(n) for n in names}
        busy = {n: ld for n, ld in loads.items() if ld["free_blocks"] != ld["total_blocks"] or ld["reserved"]
                or ld["running"] or ld["waiting"] or ld.get("queued")}
        if not busy:
            return
        if time.monotonic() > end:
            pytest.fail(f"state not freed: {busy}")
        time.sleep(0.1)


async def collect_tokens(backend, reqs) -> list[list[int]]:
    """Start ``backend`` (a ``server.backends.pd.PDBackend``), stream ``reqs`` (``GenRequest``s)
    concurrently and return each one's token ids; the backend is closed after."""
    await backend.start()
    try:
        assert await backend.wait_ready(30)

        async def one(r):
            ids = []
            async for ev in backend.generate(r):
                ids += ev.token_ids
            return ids
        return await asyncio.gather(*(one(r) for r in reqs))
    finally:
        await backend.close()


def wait_incompatible_pair(pd, timeout_s: float = 60) -> dict:
    """The gateway's /health once it reports an incompatible pair (it is up once one pair is,
    before the other decode's pong arrives); fails the test after ``timeout_s``."""
    import httpx
    end = time.monotonic() + timeout_s
    while not (h := httpx.get(pd.base_url + "/health", timeout=10).json())["incompatible_pairs"]:
        assert time.monotonic() < end, h
        time.sleep(0.1)
    return h


def drop_stream(base_url: str, body: dict, chunks: int = 3) -> None:
    """POST a streamed ``/v1/completions`` and close the connection after ``chunks`` data chunks
    (a client going away mid-stream)."""
    import httpx
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == chunks:
                        return
