"""A converted checkpoint (w4a8-mx-hif: HiF8 and MXFP8 linears kept as stored, MXFP4 experts,
HiF8 KV and indexer caches) served by real ``launch-pd`` processes: streams carry the in-process
engine's tokens, the quantised state crossing the P/D transfer as stored."""
from __future__ import annotations

import httpx
import pytest

from engine.build import build_engine
from engine.checkpoint.convert_model import convert_model
from engine.run_config import RunConfig
from pd_util import CONFIG, assert_completions_match, start_pd, wait_idle


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
        assert health["cache_dtype"] == {"kv": "hif8", "indexer": "hif8"}       # auto: the scheme's HiF8 caches
    assert_completions_match(cluster, reference, [(100, 0.0, 0), (131, 0.8, 7), (260, 0.0, 0)], 10)
    wait_idle(cluster, ["prefill0", "decode0"])
