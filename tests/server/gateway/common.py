"""Names and helpers the modules share: the served model name, the prompts, text of ids, engine idle,
the gateway's /metrics."""
from __future__ import annotations

import time

import httpx

MODEL = "tiny-dsv4"
HELLO = [{"role": "user", "content": "Hello"}]
COMPLETION_PROMPT = "The capital of France is"


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _idle(engine, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_free_blocks() == engine.num_total_blocks():
            return True
        time.sleep(0.02)
    return False


def _metrics(url) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def _metric(m, name, **labels) -> float:
    for k, v in m.items():
        if k.startswith("dsv4:" + name + "{") and all(f'{a}="{b}"' in k for a, b in labels.items()):
            return v
    return 0.0
