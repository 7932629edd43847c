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
import json
import os
import sys
import time
from pathlib import Path

from bench.gateway_load import FLEET_TOK_S, ROOT, run_level, start_gateway
from bench.gateway_replay import serve


# ---- the report --------------------------------------------------------------------------------------
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


# ---- the CLI -----------------------------------------------------------------------------------------
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
