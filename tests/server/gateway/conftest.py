"""One server for the whole package (a real uvicorn server, LocalBackend over the tiny engine) with the
engine's own outputs computed before it starts, the ``openai`` client on it, and the tokenizer."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from engine.build import build_engine
from engine.run_config import RunConfig
from engine.core.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from server.backends.local import LocalBackend
from server.gateway.app import create_app
from server.gateway.dsformat import DeepSeekFormat
from serve_util import serve_app

from .common import COMPLETION_PROMPT, HELLO, MODEL

ROOT = Path(__file__).resolve().parents[3]


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0)


@pytest.fixture(scope="package")
def stack(tiny_ckpt):
    """(base_url, engine, tokenizer, references); the server runs for the whole package."""
    ckpt = tiny_ckpt("flash", 1)
    engine = build_engine(RunConfig.from_yaml(ROOT / "configs" / "tiny-flash.yaml"), ckpt, progress=False)
    tok = Tokenizer(ckpt)
    fmt = DeepSeekFormat(ckpt, MODEL, default_thinking=False)
    chat_ids = fmt.encode(fmt.convert("chat", {"messages": HELLO})[0], 4096, "messages")
    think_ids = fmt.encode(fmt.convert("chat", {"messages": HELLO, "thinking": {"type": "enabled"}})[0], 4096,
                           "messages")
    assert chat_ids[-2:] == [128804, 128822] and think_ids[-2:] == [128804, 128821]   # </think> vs <think>
    cmpl_ids = tok.encode(COMPLETION_PROMPT, add_bos=True)
    gen = engine.generate
    ref = {
        "chat": gen([chat_ids], _greedy(12))[0].output_ids,
        "think": gen([think_ids], _greedy(6))[0].output_ids,
        "cmpl": gen([cmpl_ids], _greedy(6))[0].output_ids,
        "lp": gen([chat_ids], SamplingParams(max_new_tokens=4, temperature=0, logprobs=3))[0].logprobs,
        "seeded": [gen([cmpl_ids], SamplingParams(max_new_tokens=6, temperature=1.0, seed=7 + i))[0].output_ids
                   for i in range(3)],
        "chat_ids": chat_ids, "cmpl_ids": cmpl_ids,
    }
    with serve_app(create_app(LocalBackend(engine), tok, MODEL, default_thinking=False)) as url:
        yield url, engine, tok, ref


@pytest.fixture(scope="package")
def client(stack):
    return openai.OpenAI(base_url=stack[0] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="package")
def tok(tiny_ckpt):
    return Tokenizer(tiny_ckpt("flash", 1))
