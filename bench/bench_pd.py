"""TTFT and ITL through the P/D path (gateway -> prefill -> decode, real processes) vs the same
requests on the in-process engine, side by side. One request at a time, so the figures are the
path's overhead, not queueing.

    .venv/bin/python bench/bench_pd.py [--lengths 128 1024] [--max-tokens 32] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.build import build_engine  # noqa: E402
from engine.cache import state_tensors  # noqa: E402
from engine.run_config import RunConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from server.launcher import LocalPD, log_tail  # noqa: E402


def in_process(engine, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT s, ITLs s) of one request stepped on ``engine``."""
    t0 = time.perf_counter()
    engine.add_request("bench", prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        for out in engine.step():
            times += [time.perf_counter()] * len(out.new_token_ids)
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def through_gateway(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    times = []
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                times += [time.perf_counter()] * n
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def state_bytes(engine, prompt: list[int]) -> int:
    engine.add_request("sb", prompt, SamplingParams(max_new_tokens=1, temperature=0.0), hold_state=True)
    while engine.has_unfinished():
        engine.step()
    n = sum(t.numel() * t.element_size() for t in state_tensors(engine.cache, "sb", len(prompt)).values())
    engine.release("sb")
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-flash.yaml")
    ap.add_argument("--model", default="models/tiny-flash")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transport", default="zmq-tcp")
    ap.add_argument("--cpu-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="torch threads of each worker and of the in-process engine (same compute on both sides)")
    a = ap.parse_args()
    torch.set_num_threads(a.cpu_threads)
    engine = build_engine(RunConfig.from_yaml(a.config), a.model, progress=False)
    Path("bench/out").mkdir(parents=True, exist_ok=True)
    log = "bench/out/bench_pd.log"
    threads = ["--cpu-threads", str(a.cpu_threads)]
    pd = LocalPD(a.config, a.model, transport=a.transport, log_path=log,
                 extra_args={"prefill": threads, "decode": threads})
    try:
        pd.start(timeout_s=600)
    except RuntimeError as e:
        print(f"{e}\n{log_tail(log)}", file=sys.stderr)
        return 1
    rows = []
    try:
        model = httpx.get(pd.base_url + "/v1/models").json()["data"][0]["id"]
        g = torch.Generator().manual_seed(0)
        through_gateway(pd.base_url, model, [1000] * 16, 2)        # warm-up
        in_process(engine, [1000] * 16, 2)
        for L in a.lengths:
            prompt = torch.randint(1000, 60000, (L,), generator=g).tolist()
            ours, gw = [], []
            for _ in range(a.reps):
                ours.append(in_process(engine, prompt, a.max_tokens))
                gw.append(through_gateway(pd.base_url, model, prompt, a.max_tokens))
            med = statistics.median
            row = {"prompt_tokens": L, "state_bytes": state_bytes(engine, prompt),
                   "ttft_in_process_ms": 1e3 * med(t for t, _ in ours), "ttft_pd_ms": 1e3 * med(t for t, _ in gw),
                   "itl_in_process_ms": 1e3 * med(x for _, i in ours for x in i),
                   "itl_pd_ms": 1e3 * med(x for _, i in gw for x in i)}
            rows.append(row)
    finally:
        pd.stop()
    print(f"\nP/D path vs in-process engine, tiny flash, {a.transport}, greedy, {a.max_tokens} tokens, "
          f"median of {a.reps} (one request at a time), {a.cpu_threads} torch thread(s) each\n")
    print("| prompt | state bytes | TTFT in-process | TTFT P/D | overhead | ITL in-process | ITL P/D | overhead |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['state_bytes'] / 2**20:.2f} MiB | {r['ttft_in_process_ms']:.1f} ms | "
              f"{r['ttft_pd_ms']:.1f} ms | {r['ttft_pd_ms'] - r['ttft_in_process_ms']:+.1f} ms | "
              f"{r['itl_in_process_ms']:.1f} ms | {r['itl_pd_ms']:.1f} ms | "
              f"{r['itl_pd_ms'] - r['itl_in_process_ms']:+.2f} ms |")
    Path("bench/out/bench_pd.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
