"""Eager prefill on this CPU: one prompt's prefill time by length, and the wall-clock time of each
op of the seam (``engine.ops.Ops``) inside it.

    .venv/bin/python -m bench.bench_prefill --checkpoint models/tiny-flash --tokens 256,1024

The ops are timed with ``time.perf_counter`` around each call (outermost calls only), not with
torch.profiler: the profiler's per-op overhead makes a prefill's thousands of small ops look
several times their cost. Times are medians of ``--repeats`` prefills of fresh random prompts
(one request in the engine, ``max_new_tokens`` 1); the breakdown is of the median-length run.
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from dataclasses import fields
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


class OpTimer:
    """Per op name: seconds and calls of the outermost calls made through a timed ``Ops``."""

    def __init__(self):
        self.seconds, self.calls, self._depth = Counter(), Counter(), 0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if torch.compiler.is_compiling():          # a graph step traces the plain op
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds[name] += time.perf_counter() - t0
                    self.calls[name] += 1
        return timed

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def timed_engine(ckpt: Path, exe_mode: str, timer: OpTimer):
    """An engine of ``configs/tiny-flash.yaml`` on ``ckpt`` whose modules call a timed copy of their ops."""
    from engine.build import build_engine
    from engine.run_config import RunConfig
    raw = yaml.safe_load((ROOT / "configs/tiny-flash.yaml").read_text())
    raw["model_config"]["exe_mode"] = exe_mode
    raw["scheduler_config"]["max_prefill_tokens"] = max(raw["scheduler_config"]["max_prefill_tokens"], 8192)
    engine = build_engine(RunConfig.from_dict(raw), ckpt, progress=False)
    timed = {}
    for module in engine.model.modules():
        ops = getattr(module, "ops", None)
        if ops is not None and not isinstance(ops, type):
            if id(ops) not in timed:
                timed[id(ops)] = ops.with_overrides(**{f.name: timer.wrap(f.name, getattr(ops, f.name))
                                                        for f in fields(ops)})
            module.ops = timed[id(ops)]
    return engine


def prefill_ms(engine, tokens: int, rng: random.Random) -> float:
    from engine.core.sampling_params import SamplingParams
    vocab = engine.model.args.vocab_size
    engine.add_request(f"p{rng.random()}", [rng.randrange(vocab) for _ in range(tokens)],
                       SamplingParams(max_new_tokens=1, temperature=0))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models/tiny-flash")
    ap.add_argument("--tokens", default="256,1024", help="comma-separated prompt lengths")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exe-mode", default="eager", help="eager, or a graph mode (prefill still runs eager)")
    a = ap.parse_args(argv)
    try:
        lengths = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: expected comma-separated integers, got {a.tokens!r}")
    if min(lengths) < 1 or a.repeats < 1 or a.threads < 1:
        ap.error("--tokens, --repeats and --threads must be >= 1")
    torch.set_num_threads(a.threads)
    timer = OpTimer()
    engine = timed_engine(a.checkpoint, a.exe_mode, timer)
    rng = random.Random(0)
    print(f"prefill of one prompt, {a.checkpoint.name}, {a.exe_mode}, {a.threads} threads, "
          f"median of {a.repeats} (ms)\n\n| tokens | median | min | max |\n|---:|---:|---:|---:|")
    for n in lengths:
        prefill_ms(engine, n, rng)                                      # warm-up
        runs = []
        for _ in range(a.repeats):
            timer.clear()
            runs.append((prefill_ms(engine, n, rng), dict(timer.seconds), dict(timer.calls)))
        runs.sort(key=lambda r: r[0])
        ms, seconds, calls = runs[len(runs) // 2]
        print(f"| {n} | {ms:.1f} | {runs[0][0]:.1f} | {runs[-1][0]:.1f} |")
        breakdown = (ms, seconds, calls)
    ms, seconds, calls = breakdown
    print(f"\nops of the median {n}-token prefill\n\n| op | ms | calls | share |\n|---|---:|---:|---:|")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {s * 1e3:.1f} | {calls[name]} | {s * 1e3 / ms:.0%} |")
    outside = ms - 1e3 * sum(seconds.values())
    print(f"| (outside the ops: embedding, scheduling, sampling) | {outside:.1f} | | {outside / ms:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
