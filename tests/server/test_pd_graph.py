"""A decode worker in graph mode (exe_mode npugraph_ex: torch.compile on CPU) behind real
``launch-pd`` processes: it compiles before it reports ready, and its streams carry the eager
in-process engine's tokens."""
from __future__ import annotations

import time

import httpx
import pytest
import yaml

from engine.build import build_engine
from engine.run_config import RunConfig

from graph_cfg import GRAPH_THREADS, graph_run_config
from pd_util import assert_completions_match, start_pd, wait_idle


@pytest.fixture(scope="module")
def graph_cfg(tmp_path_factory):
    """tests/graph_cfg.py's config (tiny-flash.yaml in graph mode, batch 2, the first 4 layers) for
    every process and the reference alike: the compile test of test_graph_decode compiled the
    same graph, so the decode worker reads it from the inductor cache."""
    cfg = tmp_path_factory.mktemp("pd-graph-cfg") / "graph.yaml"
    cfg.write_text(yaml.safe_dump(graph_run_config()))
    return cfg


@pytest.fixture(scope="module")
def reference(ckpt):
    """The eager in-process engine on the same 4 layers."""
    return build_engine(RunConfig.from_dict(graph_run_config("eager")), ckpt, progress=False)


@pytest.fixture(scope="module")
def cluster(ckpt, graph_cfg, tmp_path_factory):
    d = tmp_path_factory.mktemp("pd-graph")
    pd = start_pd(ckpt, d / "pd.log", config=str(graph_cfg),
                  instance_args={"decode": ["--cpu-threads", str(GRAPH_THREADS)]})
    yield pd
    pd.stop()


def _wait_ready(pd, name: str, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while httpx.get(pd.ready_urls[name], timeout=5).status_code != 200:
        if time.monotonic() > end:
            pytest.fail(f"{name} not ready within {timeout_s} s")
        time.sleep(0.5)


def test_graph_decode_worker_streams_the_eager_tokens(cluster, reference):
    for name in ("prefill0", "decode0"):
        _wait_ready(cluster, name)
    health = httpx.get(cluster.ready_urls["decode0"].replace("/ready", "/health"), timeout=10).json()
    assert health["exe_mode"] == "npugraph_ex" and health["graph"]["backend"] == "torch.compile (inductor, per layer kind)"
    assert health["graph"]["buckets"] == [2] and health["graph"]["warmup_s"] > 0
    # prompts + 12 tokens inside the smallest context bucket (256): the one shape warmed up; on
    # CPU a longer request would pay a compile on first use
    assert_completions_match(cluster, reference, [(100, 0.0, 0), (129, 0.8, 7), (230, 0.0, 0), (61, 1.0, 11)], 12)
    wait_idle(cluster, ["prefill0", "decode0"])


def test_graph_unified_worker_streams_the_eager_tokens(ckpt, graph_cfg, reference, tmp_path_factory):
    """One engine prefilling eager and decoding in its captured step (``launch-pd --role local``'s
    default layout), with every core: the eager engine's tokens."""
    pd = start_pd(ckpt, tmp_path_factory.mktemp("unified-graph") / "pd.log", num_prefill=0, num_decode=0,
                  num_unified=1, config=str(graph_cfg))
    try:
        _wait_ready(pd, "unified0")
        health = httpx.get(pd.ready_urls["unified0"].replace("/ready", "/health"), timeout=10).json()
        assert health["role"] == "unified" and health["graph"]["buckets"] == [2]
        assert_completions_match(pd, reference, [(100, 0.0, 0), (129, 0.8, 7), (230, 0.0, 0), (61, 1.0, 11)], 12)
        wait_idle(pd, ["unified0"])
    finally:
        pd.stop()
