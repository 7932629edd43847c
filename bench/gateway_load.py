"""The load side of ``dsv4-bench gateway`` (``bench.bench_gateway``): the gateway child started and
waited for, streaming clients that count SSE events on raw bytes (no JSON per chunk, so the client
costs little), one or several client processes per level, and the level's row: tokens, wall and CPU
seconds of the gateway process, ITL and TTFT (units: see ``bench.bench_gateway``).
"""
from __future__ import annotations

import array
import asyncio
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from bench.gateway_replay import MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
FLEET_TOK_S = 280_000


# ---- the client ---------------------------------------------------------------------------------------
def _body(tokens: int, stream: bool) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "stream": stream,
            "max_tokens": tokens + 16, "chat_template_kwargs": {"thinking": True},
            **({"stream_options": {"include_usage": True}} if stream else {})}


# a chunk that carries text: a non-empty "content" or "reasoning_content" string (a regex, no JSON
# parse per chunk: the client must stay cheap next to the gateway). The role chunk, a finish-only
# chunk, the usage chunk and [DONE] carry none, so the count does not depend on how the gateway
# places finish_reason.
_TEXT = re.compile(rb'"(?:reasoning_)?content": ?"[^"]')


async def _stream_one(client, body: dict, gaps: array.array) -> dict:
    """One streamed request: SSE events split on raw bytes and counted; only the usage chunk is parsed."""
    t0 = time.perf_counter()
    events = chunks = 0
    pending, prev, last, ttft = b"", [b"", b""], None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for buf in r.aiter_raw():
            now = time.perf_counter()
            evs = (pending + buf).split(b"\n\n")
            pending = evs.pop()                          # an event not yet complete
            if evs:
                if last is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                    gaps.extend([0.0] * (len(evs) - 1))     # events that came in the same read: no gap
                last = now
                events += len(evs)
                chunks += sum(1 for e in evs if _TEXT.search(e))
                prev = (prev + evs)[-2:]
    done = prev[-1] == b"data: [DONE]"
    try:
        tokens = json.loads(prev[-2][6:])["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        tokens = 0
    return {"events": events, "chunks": chunks, "done": done, "tokens": tokens, "ttft": ttft}


async def _plain_one(client, body: dict, gaps) -> dict:
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    return {"tokens": r.json()["usage"]["completion_tokens"], "done": True, "ttft": time.perf_counter() - t0}


async def _drive(url: str, body: dict, concurrency: int, streams: int) -> dict:
    """``streams`` requests, ``concurrency`` in flight; per-request results and the ITLs (s)."""
    import httpx
    gaps, results = array.array("d"), []
    one = _stream_one if body["stream"] else _plain_one
    left = streams
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                try:
                    results.append(await one(client, body, gaps))
                except Exception as e:                      # counted as failed, not fatal
                    results.append({"error": f"{type(e).__name__}: {e}"})
        t0, c0 = time.time(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        t1, c1 = time.time(), time.process_time()
    return {"results": results, "gaps": gaps.tolist(), "start": t0, "end": t1, "client_cpu_s": c1 - c0}


def _client_proc(url: str, body: dict, concurrency: int, streams: int, start_at: float) -> dict:
    """One client process: wait for the common start time (so the processes start together)."""
    time.sleep(max(0.0, start_at - time.time()))
    return asyncio.run(_drive(url, body, concurrency, streams))


def _ready(wait_s: float) -> None:
    """Warm a pool process (imports httpx); the wait makes every process of the pool take one."""
    importlib.import_module("httpx")
    time.sleep(wait_s)


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()       # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:8]]
    return (sum(t) - t[3] - t[4]) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def run_level(url: str, pid: int, tokens: int, concurrency: int, streams: int, clients: int,
              stream: bool = True, fleet: float = FLEET_TOK_S) -> dict:
    """One level: returns the row (see the module docstring for units)."""
    body = _body(tokens, stream)
    clients = max(1, min(clients, concurrency))
    if clients == 1:
        cpu0, busy0 = _cpu_s(pid), _machine_busy_s()
        parts = [asyncio.run(_drive(url, body, concurrency, streams))]
    else:       # several client processes when one cannot keep the gateway busy
        with ProcessPoolExecutor(clients, mp_context=get_context("spawn")) as ex:
            list(ex.map(_ready, [0.3] * clients))       # spawn + import first: not counted as "other" CPU
            cpu0, busy0 = _cpu_s(pid), _machine_busy_s()
            start_at = time.time() + 0.2
            futs = [ex.submit(_client_proc, url, body, concurrency // clients + (i < concurrency % clients),
                              streams // clients + (i < streams % clients), start_at) for i in range(clients)]
            parts = [f.result() for f in futs]
    gw_cpu, busy = _cpu_s(pid) - cpu0, _machine_busy_s() - busy0
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    res = [r for p in parts for r in p["results"]]
    gaps = [g for p in parts for g in p["gaps"]]
    ok = [r for r in res if "error" not in r and r["done"] and r["tokens"] == tokens]
    got = sum(r.get("tokens", 0) for r in res)
    chunks = sorted({r["chunks"] for r in ok if "chunks" in r})           # one value: every stream alike
    events = sorted({r["events"] for r in ok if "events" in r})
    per_cpu = got / gw_cpu if gw_cpu > 0 else 0.0
    return {"concurrency": concurrency, "stream": stream, "streams": len(res), "failed": len(res) - len(ok),
            "errors": sorted({r["error"] for r in res if "error" in r})[:5], "tokens": got,
            "chunks_per_stream": chunks, "events_per_stream": events, "wall_s": wall, "wall_tok_s": got / wall,
            "gateway_cpu_s": gw_cpu, "gateway_util": gw_cpu / wall, "tok_per_gateway_cpu_s": per_cpu,
            "gateways_for_fleet": fleet / per_cpu if per_cpu else None, "clients": clients,
            "client_cpu_s": sum(p["client_cpu_s"] for p in parts),
            # whatever else ran on the machine meanwhile (another user's tests): wall figures then drop
            "other_cpu_s": max(0.0, busy - gw_cpu - sum(p["client_cpu_s"] for p in parts)),
            "itl_p50_ms": _pct(gaps, 50) * 1e3, "itl_p99_ms": _pct(gaps, 99) * 1e3,
            "ttft_p50_ms": _pct([r["ttft"] for r in ok], 50) * 1e3}


# ---- the gateway child ---------------------------------------------------------------------------------
def start_gateway(model: str, tokens: int, reply_file: str | None = None) -> tuple[subprocess.Popen, str, int]:
    """Start ``--serve`` in a child; returns (process, base URL, tokens per stream) once /health is 200."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "bench.bench_gateway", "--serve", "--port", str(port), "--model", model,
           "--tokens-per-stream", str(tokens)] + (["--reply-file", reply_file] if reply_file else [])
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        p.wait()
        raise RuntimeError(f"the gateway child exited with status {p.returncode} before serving")
    n = json.loads(line)["tokens"]
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return p, url, n
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise RuntimeError(f"the gateway child exited with status {p.returncode}")
        time.sleep(0.1)
    p.kill()
    raise RuntimeError("the gateway child did not answer /health within 60 s")
