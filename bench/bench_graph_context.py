"""``python -m bench.bench_graph_context``: the graph-mode decode step vs context, with and without
context buckets.

    python -m bench.bench_graph_context [--ckpt DIR] [--contexts 1024,32768,131072]
                                        [--max-model-len 1048576] [--steps 5] [--json]

At batch 1 on a synthetic paged state (``bench.engine_measure.synthetic_paged``: the pools of one
request filled as after a prefill), times the graph-mode step that brings it to ``context`` tokens
(``StaticDecoder``, called eager: the shapes a capture has) with the entry tables of the step's
context bucket (what ``DecodeRunner`` passes) beside the same step with tables as wide as
``max_model_len`` (the step before context buckets), and each one's ratio to its time at the
first context. Median of ``--steps`` steps after one warm-up, milliseconds. Also reports the
largest difference between the two hidden states (the wide tables add masked entries only).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_graph_context", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=str(ROOT / "models" / "tiny-flash"))
    ap.add_argument("--contexts", default="1024,32768,131072")
    ap.add_argument("--max-model-len", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        a.contexts = [int(c) for c in a.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts: comma-separated integers, got {a.contexts!r}")
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    if not a.contexts or min(a.contexts) < 2 or max(a.contexts) > a.max_model_len:
        ap.error(f"--contexts {a.contexts}: each must be >= 2 and at most --max-model-len {a.max_model_len}")
    return a


def _time(fn, steps: int) -> tuple[float, torch.Tensor]:
    out = fn()                                                        # warm-up
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, out


def measure(model, contexts: list[int], max_model_len: int, steps: int) -> list[dict]:
    """One row per context: ``bucket`` (tokens), ``bucketed_ms``, ``full_width_ms``, ``max_abs_diff``."""
    from bench.engine_measure import synthetic_paged
    from engine.core.graph_runner import context_buckets
    from engine.core.static_decode import StaticDecoder

    rows = []
    for ctx in contexts:
        # the step that brings the request to ``ctx`` tokens: position ctx - 1
        cache = synthetic_paged(model, ctx - 1, torch.Generator().manual_seed(ctx), headroom=8)
        static = StaticDecoder(model, cache.paged, max_model_len)
        held = cache.seqs[0]
        bucket = next(c for c in context_buckets(max_model_len) if c >= ctx)
        dev = model.embed.weight.device
        args = [torch.tensor([7], device=dev), torch.tensor([ctx - 1], device=dev),
                torch.tensor([held.state_slot], device=dev)]
        narrow, wide = static.tables([held.tables], 1, bucket), static.tables([held.tables], 1)
        # each call rewrites the same ring row / compressor slot: the same work every time
        b_ms, b_out = _time(lambda: static(*args, *(narrow[p].to(dev) for p in ("win", "c4", "c128"))), steps)
        f_ms, f_out = _time(lambda: static(*args, *(wide[p].to(dev) for p in ("win", "c4", "c128"))), steps)
        rows.append({"context": ctx, "bucket": bucket, "bucketed_ms": round(b_ms, 2), "full_width_ms": round(f_ms, 2),
                     "max_abs_diff": float((b_out.float() - f_out.float()).abs().max())})
        del cache, static
    base_b, base_f = rows[0]["bucketed_ms"], rows[0]["full_width_ms"]
    for r in rows:
        r["bucketed_ratio"] = round(r["bucketed_ms"] / base_b, 2)
        r["full_width_ratio"] = round(r["full_width_ms"] / base_f, 2)
    return rows


def table(rows: list[dict], max_model_len: int) -> str:
    lines = [f"graph-mode decode step, batch 1, max_model_len {max_model_len} (ms, median; ratio to the first context)",
             f"{'context':>9}{'bucket':>9}{'bucketed':>10}{'ratio':>7}{'full width':>12}{'ratio':>7}{'max |diff|':>12}"]
    for r in rows:
        lines.append(f"{r['context']:>9}{r['bucket']:>9}{r['bucketed_ms']:>10.1f}{r['bucketed_ratio']:>7.2f}"
                     f"{r['full_width_ms']:>12.1f}{r['full_width_ratio']:>7.2f}{r['max_abs_diff']:>12.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    from engine.checkpoint.loader import load_model
    if not Path(a.ckpt).is_dir():
        print(f"bench_graph_context: error: --ckpt {a.ckpt!r} is not a checkpoint directory (scripts/quickstart.sh "
              f"writes models/tiny-flash)", file=sys.stderr)
        return 2
    from engine.checkpoint.shards import CheckpointError
    try:
        model = load_model(a.ckpt, progress=False)
    except CheckpointError as e:
        print(f"bench_graph_context: error: --ckpt {a.ckpt!r}: {e}", file=sys.stderr)
        return 2
    rows = measure(model, a.contexts, a.max_model_len, a.steps)
    print(json.dumps(rows, indent=1) if a.json else table(rows, a.max_model_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
