"""Sampler cost per step at DeepSeek-V4's vocab: ms and bytes copied to the host.

    python -m bench.bench_sampler [--batch 1,8,32] [--repeat 20] [--json OUT]

For each batch size and mode (greedy, seeded temperature, top-p, greedy with 5 logprobs) it runs
``engine.core.sampler.sample`` on random ``[B, 129280]`` fp32 logits and prints the ms per step
beside the bytes the step copies to the host: the sampler's ``[B, 3 + 2 * top_n]`` result, against
the ``[B, V]`` fp32 logits a host-side sampler copies. On a CPU the copy is free; on an NPU / GPU
it is a PCIe transfer and a stream sync per step.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine.core.sampler import sample, sample_device
from engine.core.sampling_params import SampleRow, SamplingParams

VOCAB = 129280
MODES = {"greedy": SamplingParams(temperature=0), "seeded t=0.7": SamplingParams(temperature=0.7, seed=1),
         "top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
         "logprobs 5": SamplingParams(temperature=0, logprobs=5)}


def _ms(fn, repeat: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e3


def measure(batches: list[int], repeat: int) -> list[dict]:
    """One row per (batch, mode): ``ms``, ``host_bytes`` (the result) and ``logits_bytes``."""
    out = []
    for B in batches:
        logits = torch.randn(B, VOCAB, generator=torch.Generator().manual_seed(B)) * 3
        for name, p in MODES.items():
            rows = [SampleRow(p, 100 + i, [], []) for i in range(B)]
            res = sample_device(logits, rows)
            out.append(dict(batch=B, mode=name, ms=round(_ms(lambda: sample(logits, rows), repeat), 3),
                            host_bytes=res.numel() * res.element_size(), logits_bytes=B * VOCAB * 4))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_sampler", description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--repeat", type=int, default=20, help="timed calls per row")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batch.split(",")]
        if not batches or min(batches) < 1 or a.repeat < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--batch {a.batch!r} / --repeat {a.repeat}: positive integers")
    rows = measure(batches, a.repeat)
    print(f"{'batch':>5} {'mode':<14} {'ms/step':>9} {'to host (B)':>12} {'logits (B)':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:<14} {r['ms']:>9.2f} {r['host_bytes']:>12,} {r['logits_bytes']:>12,}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
