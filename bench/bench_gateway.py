"""``dsv4-bench gateway``: output tokens per second that ONE gateway process turns into SSE chunks.

    dsv4-bench gateway [--concurrency 1,64,512] [--tokens-per-stream 800] [--label before] \\
        [--out bench/out/gateway.json]
    dsv4-bench gateway --compare bench/out/gateway-before.json bench/out/gateway-after.json

The gateway (``server.gateway.app.create_app``) runs in its own child process on loopback with a
``ReplayBackend`` in place of the workers: every sample replays one fixed, realistic thinking-mode
reply (reasoning with some Chinese and an emoji, ``</think>``, answer) one token per event, as fast
as the event loop allows. So what is measured is the gateway's text path alone: detokenising,
reasoning parsing, chunk JSON, SSE, HTTP. Clients stream ``/v1/chat/completions`` with httpx and
count events and text-carrying chunks on raw bytes (no JSON per chunk), so the client costs little;
it still shares the machine's cores with the gateway, which is why the robust figure is tokens per
second of the gateway's own CPU time (user + system of the child process), not wall-clock tok/s.

Units: tok/s are output tokens per second; CPU and wall times in seconds; ITL (time between chunks
as the client reads them) and TTFT in milliseconds. "gateways" is how many gateway processes (one
core each: the gateway is one event loop) a fleet emitting ``--fleet-tok-s`` needs (default 280,000
tok/s: a 64-chip Ascend A3 decode fleet at ~4,400 tok/s/chip).
"""
from __future__ import annotations

import argparse
import array
import asyncio
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

ROOT = Path(__file__).resolve().parents[1]
FLEET_TOK_S = 280_000
MODEL_NAME = "deepseek-v4-flash"

# A realistic thinking-mode reply. English with some Chinese and an emoji: multi-byte characters
# split over byte-level BPE tokens exercise the detokeniser's hold-back, as real replies do.
REASONING = (
    "The user asks how to make a distributed cache survive a node failure without losing writes. "
    "Let me think about what they actually need. A cache is usually allowed to lose data, but they said "
    "writes, so this is closer to a write-back cache, where the cache is the only copy for a while. "
    "Options: replicate every write to a second node before acknowledging it (synchronous replication), "
    "or write ahead to a durable log and replay it on restart. Synchronous replication doubles the "
    "network traffic per write but keeps latency low if the replica is in the same rack; the log costs "
    "an fsync per batch. 用户可能在中文环境里部署，所以我应该把关键术语也用中文说明：同步复制、预写日志、"
    "一致性哈希。 Consistent hashing matters too: when a node fails, only its key range moves, so the "
    "warm-up after a failure touches 1/N of the keys instead of all of them. I should also mention "
    "quorum reads (R + W > N) because otherwise a read right after failover can return a stale value. "
    "Edge cases: a network partition where both sides think they are primary (split brain) needs "
    "fencing tokens or a lease; clock skew breaks lease-based approaches unless the lease is generous. "
    "Let me structure the answer: the short recommendation first, then the two designs, then the "
    "failure cases, then a small configuration example. Keep it practical. 🙂 "
)
ANSWER = (
    "**Short answer:** replicate each write synchronously to one replica in a different failure domain "
    "before acknowledging it, and place keys with consistent hashing so a failure only moves 1/N of "
    "them.\n\n## Two designs\n\n1. **Synchronous replication (同步复制).** The primary forwards the write "
    "to its replica and acknowledges the client only after the replica confirms. Cost: one extra "
    "round trip inside the rack, typically 100 to 300 microseconds.\n2. **Write-ahead log (预写日志).** "
    "Each node appends writes to a local log, fsynced in batches every few milliseconds, and replays it "
    "after a restart. Cost: you lose at most one batch if the disk survives, everything if it does not."
    "\n\n## Failure cases\n\n- **Split brain:** use fencing tokens; a stale primary's writes are "
    "rejected by the storage layer.\n- **Stale reads after failover:** use quorum reads and writes "
    "(R + W > N), for example N = 3, W = 2, R = 2.\n- **Hot keys:** replicate them to more nodes and "
    "read from any replica.\n\n## Example\n\n```yaml\nreplication_factor: 3\nwrite_quorum: 2\n"
    "read_quorum: 2\nlog_fsync_interval_ms: 5\n```\n\nStart with synchronous replication; add the log "
    "only if you must survive losing a whole rack. 🚀"
)
THINK_END = "</think>"


# ---- the fake backend --------------------------------------------------------------------------------
def _fit(tok, text: str, n: int) -> list[int]:
    """Exactly ``n`` token ids of ``text`` (repeated as needed). A cut inside a multi-byte character
    is patched with "." tokens, so the replay never ends a part with a broken character."""
    ids = tok.encode(text)
    if not ids or n <= 0:
        return []
    ids = (ids * (n // len(ids) + 1))[:n]
    dot = tok.encode(".")[0]
    k = n
    while k > 0 and tok.decode(ids[:k]).endswith("\ufffd"):
        k -= 1
    return ids[:k] + [dot] * (n - k)


def reply_ids(tok, tokens: int, reasoning: str = REASONING, answer: str = ANSWER) -> list[int]:
    """``tokens`` ids: reasoning, the ``</think>`` token, answer, split in proportion to the two texts'
    own lengths. ``tokens`` 0: the texts as they are."""
    r, a = tok.encode(reasoning), tok.encode(answer)
    end = tok.encode(THINK_END)
    if not tokens:
        return r + end + a
    n_r = round((tokens - len(end)) * len(r) / (len(r) + len(a)))
    return _fit(tok, reasoning, n_r) + end + _fit(tok, answer, tokens - len(end) - n_r)


class ReplayBackend:
    """A ``server.backends.base.Backend`` that answers every sample with ``token_ids`` (capped at the
    sample's max_new_tokens), one token per event, the last with finish_reason "length". Between
    events it yields to the event loop once, so concurrent streams interleave as they would with a
    decode worker emitting one token per step for the whole batch."""

    def __init__(self, token_ids: list[int], max_model_len: int = 1 << 20):
        self.token_ids, self._max_len = list(token_ids), max_model_len

    async def generate(self, req):
        from server.backends.base import TokenEvent
        ids = self.token_ids[:req.params.max_new_tokens]
        last = len(ids) - 1
        for i, t in enumerate(ids):
            yield TokenEvent([t], finished=i == last, finish_reason="length" if i == last else None,
                             num_prompt_tokens=len(req.prompt_ids), queue_time_s=0.0 if i == 0 else None)
            await asyncio.sleep(0)

    async def health(self) -> dict:
        return {"healthy": True}

    @property
    def max_model_len(self) -> int:
        return self._max_len

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def build_app(model_dir: str | Path, name: str, token_ids: list[int]):
    """The gateway app under test: the ONE place that knows ``create_app``'s signature.

    Today: ``create_app(backend, engine.tokenizer.Tokenizer(model_dir), name)``. When the chat path
    moves to ``deepseek_recipe`` and the second argument becomes the checkpoint directory (or a format
    object built from it), the parameter's name decides which is passed; adapt here only."""
    import inspect

    from server.gateway.app import create_app
    backend = ReplayBackend(token_ids)
    second = list(inspect.signature(create_app).parameters)[1]
    if second == "tokenizer":
        from engine.tokenizer import Tokenizer
        return create_app(backend, Tokenizer(model_dir), name)
    return create_app(backend, str(model_dir), name)     # the new signature: the checkpoint directory


def serve(args) -> int:
    """The child: tokenise the reply, print one JSON line (tokens per stream), serve until killed."""
    import uvicorn

    from engine.tokenizer import Tokenizer
    reasoning, answer = REASONING, ANSWER
    if args.reply_file:
        reasoning, _, answer = Path(args.reply_file).read_text(encoding="utf-8").partition(THINK_END)
    ids = reply_ids(Tokenizer(args.model), args.tokens_per_stream, reasoning, answer)
    app = build_app(args.model, MODEL_NAME, ids)
    print(json.dumps({"tokens": len(ids)}), flush=True)
    # the same uvicorn settings as the production gateway (server/launch/roles.py)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                  access_log=False)).run()
    return 0


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
    import httpx  # noqa: F401
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


# ---- the gateway child, the table -------------------------------------------------------------------
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


def format_table(res: dict) -> str:
    c = res["config"]
    head = (f"gateway text path [{res['label']}]: {c['tokens_per_stream']} tok/stream, {c['cpus']} CPUs, "
            f"fleet {c['fleet_tok_s']:,.0f} tok/s\n"
            f"{'streams':>8} {'mode':>6} {'n':>5} {'fail':>4} {'wall tok/s':>10} {'gw CPU s':>8} {'gw util':>7} "
            f"{'tok/gw-CPU-s':>12} {'client CPU s':>12} {'other CPU s':>11} {'ITL p50/p99 ms':>14} {'gateways':>8}")
    rows = [head]
    for r in res["levels"]:
        itl = f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f}" if r["stream"] else "-"
        rows.append(f"{r['concurrency']:>8} {'stream' if r['stream'] else 'plain':>6} {r['streams']:>5} "
                    f"{r['failed']:>4} {r['wall_tok_s']:>10,.0f} {r['gateway_cpu_s']:>8.2f} "
                    f"{r['gateway_util']:>7.2f} {r['tok_per_gateway_cpu_s']:>12,.0f} {r['client_cpu_s']:>12.2f} "
                    f"{r['other_cpu_s']:>11.2f} "
                    f"{itl:>14} {r['gateways_for_fleet'] or 0:>8.1f}")
    rows.append("gw util: gateway CPU s / wall s (about 1.0: the gateway was the bottleneck; lower: the client or\n"
                "the shared cores were). other CPU s: the rest of the machine meanwhile, not this benchmark.\n"
                "gateways: fleet tok/s / tok per gateway CPU-second (one gateway process uses one core).")
    return "\n".join(rows)


def format_compare(a: dict, b: dict) -> str:
    """Two runs side by side, matched by (concurrency, mode): wall tok/s, tok per gateway CPU-second
    (the figure to compare), B / A of it, and gateways for the fleet."""
    w = max(10, len(a["label"]), len(b["label"]))
    pair = f"{a['label']:>{w}} {b['label']:>{w}}"
    rows = [f"{'':>15} {'wall tok/s':^{2 * w + 1}} | {'tok per gateway CPU-s':^{2 * w + 8}} | "
            f"{'gateways for the fleet':^{2 * w + 1}}",
            f"{'streams':>8} {'mode':>6} {pair} | {pair} {'B/A':>6} | {pair}"]
    bl = {(r["concurrency"], r["stream"]): r for r in b["levels"]}
    for r in a["levels"]:
        s = bl.get((r["concurrency"], r["stream"]))
        if s is None:
            continue
        x = s["tok_per_gateway_cpu_s"] / r["tok_per_gateway_cpu_s"] if r["tok_per_gateway_cpu_s"] else 0
        rows.append(f"{r['concurrency']:>8} {'stream' if r['stream'] else 'plain':>6} {r['wall_tok_s']:>{w},.0f} "
                    f"{s['wall_tok_s']:>{w},.0f} | {r['tok_per_gateway_cpu_s']:>{w},.0f} "
                    f"{s['tok_per_gateway_cpu_s']:>{w},.0f} {x:>6.2f} | {r['gateways_for_fleet'] or 0:>{w}.1f} "
                    f"{s['gateways_for_fleet'] or 0:>{w}.1f}")
    return "\n".join(rows)


def _levels(s: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not v or min(v) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-bench gateway", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default=str(ROOT / "models" / "tiny-flash"), help="checkpoint directory (its tokenizer)")
    a("--concurrency", type=_levels, default="1,64,512", help="streams in flight, one level each")
    a("--tokens-per-stream", type=int, default=800, help="output tokens of every reply (0: the texts' own)")
    a("--streams-per-level", type=int, default=0, help="requests per level (0: max(16, 2 x concurrency))")
    a("--non-stream", type=int, default=64, metavar="C", help="also a non-streamed level at C (0: none)")
    a("--clients", type=int, default=1, help="client processes per level (the machine's cores are shared)")
    a("--reply-file", help="reply text: reasoning, then </think>, then answer (none: built in)")
    a("--fleet-tok-s", type=float, default=FLEET_TOK_S, help="the fleet's output tok/s to size gateways for")
    a("--label", default="run", help="names this run in the table and the JSON (e.g. before / after)")
    a("--out", help="write the results here (JSON)")
    a("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two saved runs side by side and exit")
    a("--serve", action="store_true", help=argparse.SUPPRESS)        # the gateway child
    a("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve:
        return serve(args)
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.compare)
        print(format_compare(a, b))
        return 0
    p, url, n = start_gateway(args.model, args.tokens_per_stream, args.reply_file)
    try:
        run_level(url, p.pid, n, 4, 4, 1)                 # warm-up: imports, caches, first connections
        plan = [(c, True) for c in args.concurrency] + ([(args.non_stream, False)] if args.non_stream else [])
        levels = []
        for c, stream in plan:
            streams = args.streams_per_level or max(16, 2 * c)
            levels.append(run_level(url, p.pid, n, c, streams, args.clients, stream, args.fleet_tok_s))
            r = levels[-1]
            print(f"  {c} {'streamed' if stream else 'plain'}: {r['wall_tok_s']:,.0f} tok/s wall, "
                  f"{r['tok_per_gateway_cpu_s']:,.0f} tok per gateway CPU-s", file=sys.stderr, flush=True)
    finally:
        p.terminate()
        p.wait(10)
    res = {"label": args.label, "levels": levels,
           "config": {"model": args.model, "tokens_per_stream": n, "clients": args.clients,
                      "fleet_tok_s": args.fleet_tok_s, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                      "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}}
    print(format_table(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if all(r["failed"] == 0 for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
