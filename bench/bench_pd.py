"""TTFT and ITL through the P/D path (gateway -> prefill -> decode, real processes) vs the same
requests on the in-process engine, side by side. One request at a time, so the figures are the
path's overhead, not queueing.

    .venv/bin/python bench/bench_pd.py [--lengths 128 1024] [--max-tokens 32] [--reps 5] [--new-client]

Each repetition runs the request in-process and through the gateway back to back (interleaved), so
both see the same load on a shared machine; figures are medians over ``--reps``.

- TTFT overhead: median over repetitions of (TTFT P/D - TTFT in-process).
- path: median of (TTFT P/D - the prefill worker's own prefill time for that request, read from
  its ``dsv4:request_prefill_time_seconds`` histogram): what the P/D path adds around the prefill
  compute (HTTP, the three hops, handoffs), free of the compute's run-to-run spread on a busy CPU.
- allowed: the target, 10 ms + state bytes / bandwidth, the bandwidth measured here first as
  ``bench/bench_transfer.py`` does (send -> ack of a message of at least the state's size over
  ``--transport``, sender in another process, median of 5).
- ITL: median over all tokens after the first; its overhead is the median over repetitions of the
  difference of the two requests' median ITLs. ITL #1 is token 1 -> 2 (through P/D: the hand-off
  from prefill to decode, the last layer + commit and decode's first step).

The client is one ``httpx.Client`` kept open (a connection reused, as the openai SDK does);
``--new-client`` builds a new one per request instead (TLS context + TCP connect in the client:
~30 ms on this machine, before the request leaves it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.build import build_engine  # noqa: E402
from engine.cache_dtype import SETTINGS as CACHE_SETTINGS, CacheDtype  # noqa: E402
from engine.run_config import RunConfig  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from server.launch.local import LocalPD, log_tail  # noqa: E402

TARGET_FIXED_S = 0.010          # the target: TTFT overhead <= 10 ms + state bytes / bandwidth


def in_process(engine, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT s, ITLs s) of one request stepped on ``engine``."""
    t0 = time.perf_counter()
    engine.add_request("bench", prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        for out in engine.step():
            times += [time.perf_counter()] * len(out.new_token_ids)
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def through_gateway(client: httpx.Client | None, url: str, model: str, prompt: list[int],
                    max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT s, ITLs s) of one streamed request; ``client`` None: a new client for it."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    times = []
    t0 = time.perf_counter()
    stream = (client.stream if client is not None else httpx.stream)("POST", url + "/v1/completions", json=body,
                                                                     timeout=600)
    with stream as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                times += [time.perf_counter()] * n
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])]


def prefill_time_sum(client: httpx.Client, metrics_url: str) -> float | None:
    """The prefill worker's ``dsv4:request_prefill_time_seconds_sum`` (s); None if it has none."""
    m = re.search(r"^dsv4:request_prefill_time_seconds_sum\{[^}]*\} (\S+)$", client.get(metrics_url).text, re.M)
    return float(m.group(1)) if m else None


def state_bytes(engine, prompt: list[int]) -> int:
    """Bytes of the decode state a prefill worker sends for ``prompt`` (``engine.pd.export_state``:
    the trunk's state, and with MTP its window rings)."""
    engine.add_request("sb", prompt, SamplingParams(max_new_tokens=1, temperature=0.0), hold_state=True)
    while engine.has_unfinished():
        engine.step()
    _, tensors = engine.pd.export_state("sb")
    engine.pd.release("sb")
    return sum(t.numel() * t.element_size() for t in tensors.values())


def cache_setting(engine) -> str:
    """The ``scheduler_config.kv_cache_dtype`` name of ``engine``'s cache storage."""
    return next(k for k, v in CACHE_SETTINGS.items() if CacheDtype(*v) == engine.cache.config.cache_dtype)


def transfer_bandwidth(kind: str, nbytes: list[int], setting: str = "bfloat16", reps: int = 5) -> dict[int, float]:
    """Bytes / s of a send -> ack over ``kind`` for a message of at least each of ``nbytes`` (whole
    MiB, as ``bench/bench_transfer.py`` measures it, its caches stored as ``setting``, a
    ``scheduler_config.kv_cache_dtype``). Small messages are latency bound, so this is the time a
    state of that size takes, not the link's peak."""
    from bench.bench_transfer import receive
    sizes = {n: f"{max(1, math.ceil(n / 2**20))}M" for n in nbytes}
    res = {r["size"]: r for r in receive(kind, sorted(set(sizes.values())), reps, setting)["results"]}
    return {n: res[s]["bytes"] / statistics.median(res[s]["times_s"]) for n, s in sizes.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-flash.yaml")
    ap.add_argument("--model", default="models/tiny-flash")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", default="zmq-tcp")
    ap.add_argument("--new-client", action="store_true",
                    help="a new httpx client (TLS context, TCP connection) per request instead of one kept open")
    ap.add_argument("--cpu-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="torch threads of each worker and of the in-process engine (same compute on both sides)")
    a = ap.parse_args()
    torch.set_num_threads(a.cpu_threads)
    engine = build_engine(RunConfig.from_yaml(a.config), a.model, progress=False)
    g = torch.Generator().manual_seed(0)
    prompts = {L: torch.randint(1000, 60000, (L,), generator=g).tolist() for L in a.lengths}
    sbytes = {L: state_bytes(engine, p) for L, p in prompts.items()}
    by_size = transfer_bandwidth(a.transport, list(sbytes.values()), cache_setting(engine))
    bw = {L: by_size[n] for L, n in sbytes.items()}
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
    med = statistics.median
    try:
        client = httpx.Client()
        use = None if a.new_client else client
        model = client.get(pd.base_url + "/v1/models").json()["data"][0]["id"]
        for _ in range(2):                                          # warm-up (handshakes, first steps)
            through_gateway(use, pd.base_url, model, [1000] * 16, 2)
            in_process(engine, [1000] * 16, 2)
        for L, prompt in prompts.items():
            ours, gw, path = [], [], []
            for _ in range(a.reps):
                ours.append(in_process(engine, prompt, a.max_tokens))
                before = prefill_time_sum(client, pd.metrics_urls["prefill0"])
                gw.append(through_gateway(use, pd.base_url, model, prompt, a.max_tokens))
                after = prefill_time_sum(client, pd.metrics_urls["prefill0"])
                if before is not None and after is not None:
                    path.append(gw[-1][0] - (after - before))
            rows.append({
                "prompt_tokens": L, "state_bytes": sbytes[L], "transfer_gbps": bw[L] / 1e9,
                "allowed_ms": 1e3 * (TARGET_FIXED_S + sbytes[L] / bw[L]),
                "ttft_in_process_ms": 1e3 * med(t for t, _ in ours), "ttft_pd_ms": 1e3 * med(t for t, _ in gw),
                "ttft_overhead_ms": 1e3 * med(p[0] - o[0] for p, o in zip(gw, ours)),
                "path_overhead_ms": 1e3 * med(path) if path else None,
                "itl_in_process_ms": 1e3 * med(x for _, i in ours for x in i),
                "itl_pd_ms": 1e3 * med(x for _, i in gw for x in i),
                "itl_overhead_ms": 1e3 * med(med(p[1]) - med(o[1]) for p, o in zip(gw, ours) if p[1] and o[1]),
                "itl1_in_process_ms": 1e3 * med(i[0] for _, i in ours if i),
                "itl1_pd_ms": 1e3 * med(i[0] for _, i in gw if i)})
        client.close()
    finally:
        pd.stop()
    print(f"\nP/D path vs in-process engine, tiny flash, {a.transport}, greedy, {a.max_tokens} tokens, "
          f"median of {a.reps} interleaved (one request at a time), {a.cpu_threads} torch thread(s) each, "
          f"{'a new client per request' if a.new_client else 'one client kept open'}\n")
    print("| prompt | state sent | TTFT in-process | TTFT P/D | overhead | path | allowed | "
          "ITL in-process | ITL P/D | overhead | ITL #1 in-process | ITL #1 P/D |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        path = f"{r['path_overhead_ms']:+.1f} ms" if r["path_overhead_ms"] is not None else "-"
        print(f"| {r['prompt_tokens']} | {r['state_bytes'] / 2**20:.2f} MiB | {r['ttft_in_process_ms']:.1f} ms | "
              f"{r['ttft_pd_ms']:.1f} ms | {r['ttft_overhead_ms']:+.1f} ms | {path} | {r['allowed_ms']:.1f} ms | "
              f"{r['itl_in_process_ms']:.1f} ms | {r['itl_pd_ms']:.1f} ms | "
              f"{r['itl_overhead_ms']:+.2f} ms | {r['itl1_in_process_ms']:.1f} ms | "
              f"{r['itl1_pd_ms']:.1f} ms |")
    print(f"\nallowed = {1e3 * TARGET_FIXED_S:g} ms + state bytes / {a.transport} bandwidth measured here "
          + ", ".join(f"{r['transfer_gbps']:.2f} GB/s" for r in rows) + "; path = TTFT P/D - the prefill "
          "worker's prefill time")
    Path("bench/out/bench_pd.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
