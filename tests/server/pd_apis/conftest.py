"""One P/D stack (prefill, decode, gateway) for the whole package, the SDK clients on it, the recipe, and
the in-process engine's greedy outputs (``greedy``: the cases a module lists in ``greedy_cases``)."""
from __future__ import annotations

import contextlib

import anthropic
import openai
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from pd_util import start_pd

from .common import KEY, Recipe, generation_tokens


@pytest.fixture(scope="package")
def ckpt(tiny_ckpt) -> str:
    """The tiny flash checkpoint (seed 1, as tests/conftest.py's) at package scope: the one stack uses it."""
    return str(tiny_ckpt("flash", 1))


@pytest.fixture(scope="package")
def stack(ckpt, tmp_path_factory):
    """One prefill, one decode, one gateway (``--api-key``); ``stack.ledger``: completion tokens received,
    ``stack.gen0``: the gateway's generation_tokens_total before any request."""
    log = tmp_path_factory.mktemp("pd-apis") / "pd.log"
    pd = start_pd(ckpt, log, instance_args={"gateway": ["--api-key", KEY]})
    pd.ledger = []
    pd.gen0 = generation_tokens(pd)
    yield pd
    pd.stop()


@pytest.fixture(scope="package")
def oai(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def ant(stack):
    return anthropic.Anthropic(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def recipe(ckpt) -> Recipe:
    return Recipe(ckpt)


@contextlib.contextmanager
def _one_thread():
    """The in-process engine on one thread while it runs: the worker processes hold the other cores
    (oversubscribed OpenMP threads spin and stall each other)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def greedy(request, reference, recipe, ckpt):
    """greedy(prompt ids, n) -> the in-process engine's greedy output ids. Every case of the requesting
    module (its ``greedy_cases(recipe, bos_id)``) runs in one batched ``generate`` up front (the
    engine's output does not depend on the batch: tests/engine/test_batched_decode.py); any other is run alone
    when asked. Each case is chosen so the random model does not end by itself (n ids: the sample ends
    by length)."""
    cache: dict = {}

    def run(cases) -> None:
        todo = list(dict.fromkeys((tuple(p), n) for p, n in cases if (tuple(p), n) not in cache))
        if not todo:
            return
        with _one_thread():
            seqs = reference.generate([list(p) for p, _ in todo],
                                      [SamplingParams(max_new_tokens=n, temperature=0) for _, n in todo])
        for key, seq in zip(todo, seqs):
            assert len(seq.output_ids) == key[1], "the random model ended early: pick another prompt"
            cache[key] = seq.output_ids

    run(request.module.greedy_cases(recipe, Tokenizer(ckpt).bos_id))

    def get(prompt: list[int], n: int) -> list[int]:
        run([(prompt, n)])
        return cache[(tuple(prompt), n)]
    return get
