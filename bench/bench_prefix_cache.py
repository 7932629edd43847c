"""Multi-turn chat through ``launch-pd`` (2 prefill + 1 decode on this machine): prefix caching
off vs on, and round-robin vs cache-aware prefill routing, side by side.

    .venv/bin/python -m bench.bench_prefix_cache [--conversations 8] [--turns 4] [--system-len 2048]

The workload (issue 26): every conversation opens with the same ``--system-len``-token system
prompt and a ``--user-len``-token question; each later turn re-sends the whole conversation (the
previous prompt, the answer streamed back, a new question), as chat clients do. Conversations
run concurrently (``--concurrency`` at a time), each turn waiting for the one before; requests go
to ``/v1/completions`` as token ids, streamed (``bench.serve_bench.send``: TTFT from the first
token, ``usage.prompt_tokens_details.cached_tokens``). Per setup: TTFT p50 / p99 over all turns and
over follow-up turns, prompt tokens computed by the prefill workers (their
``dsv4:prompt_tokens_by_source{source="local_compute"}``) and the cache hit rate. Exit 1 if a
cluster does not start or a request fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_bench import send
from bench.serve_metrics import RequestRecord
from server.launch.local import LocalPD, log_tail

SETUPS = {"off-round_robin": (False, "round_robin"), "on-round_robin": (True, "round_robin"),
          "on-cache_aware": (True, "cache_aware")}


def computed_tokens(url: str) -> float:
    """A prefill worker's prompt tokens prefilled here (``source="local_compute"``)."""
    text = httpx.get(url, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "dsv4:prompt_tokens_by_source_total" and s.labels.get("source") == "local_compute")


async def conversations(base: str, model: str, a, rng: random.Random) -> list[tuple[int, RequestRecord]]:
    """Run the workload; (turn, record) of every request."""
    system = [rng.randrange(1000, 60000) for _ in range(a.system_len)]
    firsts = [system + [rng.randrange(1000, 60000) for _ in range(a.user_len)] for _ in range(a.conversations)]
    out: list[tuple[int, RequestRecord]] = []
    sem = asyncio.Semaphore(a.concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        async def one(c: int) -> None:
            prompt = firsts[c]
            async with sem:
                for turn in range(a.turns):
                    rec = RequestRecord(c * a.turns + turn, prompt_tokens=len(prompt), max_tokens=a.output_len)
                    body = {"model": model, "prompt": prompt, "max_tokens": a.output_len, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True}
                    await send(client, base + "/v1/completions", body, rec, False, t0, None)
                    out.append((turn, rec))
                    if not rec.success:
                        return
                    prompt = prompt + rec.output_ids + [rng.randrange(1000, 60000) for _ in range(a.user_len)]
        await asyncio.gather(*(one(c) for c in range(a.conversations)))
    return out


def run_setup(name: str, a, log: str) -> dict:
    caching, routing = SETUPS[name]
    extra = {"gateway": ["--prefill-routing", routing]}
    if caching:
        extra["prefill"] = ["--enable-prefix-caching"]
    pd = LocalPD(a.config, a.model, num_prefill=2, num_decode=1, log_path=log, extra_args=extra)
    try:
        pd.start(timeout_s=600)
    except RuntimeError as e:
        raise SystemExit(f"{name}: {e}\n{log_tail(log)}") from None
    try:
        model = httpx.get(pd.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        recs = asyncio.run(conversations(pd.base_url, model, a, random.Random(a.seed)))
        computed = sum(computed_tokens(pd.metrics_urls[f"prefill{i}"]) for i in range(2))
    finally:
        pd.stop()
    bad = [r.error for _, r in recs if not r.success]
    if bad:
        raise SystemExit(f"{name}: {len(bad)} requests failed: {bad[0]}")
    ttft = [r.ttft_s * 1e3 for _, r in recs]
    later = [r.ttft_s * 1e3 for t, r in recs if t > 0]
    prompt = sum(r.prompt_tokens for _, r in recs)
    return {"setup": name, "requests": len(recs), "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "followup_ttft_p50_ms": float(np.percentile(later, 50)) if later else None,
            "prompt_tokens": prompt, "prefill_tokens_computed": int(computed),
            "cache_hit_rate": sum(r.cached_tokens for _, r in recs) / prompt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny-flash.yaml")
    ap.add_argument("--model", default="models/tiny-flash")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    ap.add_argument("--out", default="bench/out/prefix_cache.json")
    a = ap.parse_args(argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    rows = [run_setup(name, a, str(Path(a.out).with_suffix(f".{name}.log"))) for name in a.setups]
    print(f"{a.conversations} conversations x {a.turns} turns, system prompt {a.system_len} tokens, "
          f"{a.user_len}-token questions, {a.output_len}-token answers, {a.concurrency} at a time")
    print(f"{'setup':<18}{'TTFT p50':>10}{'TTFT p99':>10}{'turn>1 p50':>12}{'prompt tok':>12}"
          f"{'computed':>10}{'hit rate':>10}")
    for r in rows:
        f50 = f"{r['followup_ttft_p50_ms']:.0f}" if r["followup_ttft_p50_ms"] is not None else "-"
        print(f"{r['setup']:<18}{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>10.0f}{f50:>12}{r['prompt_tokens']:>12}"
              f"{r['prefill_tokens_computed']:>10}{r['cache_hit_rate']:>10.2f}")
    Path(a.out).write_text(json.dumps({"config": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
