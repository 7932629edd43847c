"""A converted checkpoint (w4a8-mx-hif: HiF8 and MXFP8 linears kept as stored, MXFP4 experts)
served by real ``launch-pd`` processes: streams carry the in-process engine's tokens."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest
from openai import OpenAI

from engine.build import build_engine
from engine.convert_model import convert_model
from engine.run_config import RunConfig
from engine.sampling import SamplingParams
from pd_util import CONFIG, rand_prompt, start_pd, wait_idle


@pytest.fixture(scope="module")
def quant_ckpt(ckpt, tmp_path_factory):
    return str(convert_model(ckpt, tmp_path_factory.mktemp("pdq") / "hif", "w4a8-mx-hif", progress=False))


@pytest.fixture(scope="module")
def cluster(quant_ckpt, tmp_path_factory):
    pd = start_pd(quant_ckpt, tmp_path_factory.mktemp("pdq-log") / "pd.log")
    yield pd
    pd.stop()


def test_pd_serves_a_converted_checkpoint_with_the_in_process_tokens(cluster, quant_ckpt):
    reference = build_engine(RunConfig.from_yaml(CONFIG), quant_ckpt, progress=False)
    for name in ("prefill0", "decode0"):
        health = httpx.get(cluster.ready_urls[name].replace("/ready", "/health"), timeout=10).json()
        assert health["quantization"] == "w4a8-mx-hif"
    client = OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    cases = [(100, 0.0, 0), (131, 0.8, 7), (260, 0.0, 0)]

    def one(case):
        n, temperature, seed = case
        r = client.completions.create(model=model, prompt=rand_prompt(n, n), max_tokens=10, temperature=temperature,
                                      seed=seed, extra_body={"return_token_ids": True, "ignore_eos": True})
        return r.choices[0].model_extra["token_ids"]

    with cf.ThreadPoolExecutor(3) as ex:
        got = list(ex.map(one, cases))
    for (n, temperature, seed), ids in zip(cases, got):
        p = SamplingParams(max_new_tokens=10, temperature=temperature, seed=seed, ignore_eos=True)
        assert ids == reference.generate([rand_prompt(n, n)], p)[0].output_ids, (n, temperature)
    wait_idle(cluster, ["prefill0", "decode0"])
