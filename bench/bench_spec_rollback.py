"""Host cost of an MTP verify step's rollback, per step:

    .venv/bin/python -m bench.bench_spec_rollback [--batches 1,8,32,64] [--next-n 3] [--layers 43] [--json]

Every verify span runs through the decode step (``StaticDecoder``: eager with host positions, or
the captured step), and both make the same rollback (``ModelRunner.run_rows``): one
``engine.core.mtp_runner.SpanRollback`` over the step's spans, every layer of a kind in one op per
compressor-state tensor. (The eager journal ``Rollback``, per request and layer, is gone: this
measures what exists.) Its two halves, each per step:

* make: the saved rows, read before the decode step writes (``SpanRollback(...)``);
* settle: the restore once the step's tokens are sampled (``settle`` of every span, then
  ``apply``: what ``ModelRunner.draft`` does).

The pools are a ``PagedCache`` at Flash's real widths (reference §2.2: head_dim 512, index head
dim 128) with ``--layers`` layers in Flash's pattern (2 window layers, then CSA / HCA
alternating); every request is at a length whose span closes a CSA window and keeps only the
pending token (the rejected tail is restored: the most work). No model runs. Per step: the aten
ops each half dispatches (on an accelerator each is a kernel launch or a view the host builds,
outside the captured step, so the count is what the host pays: it does not grow with the batch or
the layers) and its CPU milliseconds (on the CPU the time is the data: every layer's saved rows,
~100 MB at batch 64, which an accelerator's memory moves in well under a millisecond). Medians of
``--repeat`` runs, one thread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.checkpoint.make_tiny import PRESETS  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.core.block_manager import CacheConfig  # noqa: E402
from engine.core.kv_cache import LocalCache  # noqa: E402
from engine.core.mtp_runner import SpanRollback  # noqa: E402

CONTEXT = 126                         # L: positions 126 .. 126 + next_n close the CSA window at 127


def flash_args(layers: int) -> ModelArgs:
    """Flash's real widths with ``layers`` layers: [0, 0] + [4, 128] * k (+ the MTP layer's 0)."""
    ratios = ([0, 0] + [4, 128] * layers)[:layers] + [0]
    return ModelArgs.from_dict(dict(PRESETS["flash-real-width"], num_hidden_layers=layers, compress_ratios=ratios))


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched (each a kernel launch on an accelerator)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def measure(batch: int, next_n: int, layers: int, repeat: int) -> dict:
    """One batch size: aten ops and CPU ms per step of each half (``make_*``, ``settle_*``)."""
    args = flash_args(layers)
    cache = LocalCache(args, CacheConfig(128, batch, {"c4": batch, "c128": batch}, next_n=next_n), torch.bfloat16)
    ids = [f"r{i}" for i in range(batch)]
    for sid in ids:
        cache.allocate(sid, CONTEXT + 1 + next_n)
    span = 1 + next_n
    # (req_id, state slot, L, tokens in the step): what ``ModelRunner.run_rows`` passes
    spans = [(sid, cache.seqs[sid].state_slot, CONTEXT, span) for sid in ids]

    def make() -> SpanRollback:
        return SpanRollback(cache.paged, spans)

    def settle(rb: SpanRollback) -> None:
        for sid in ids:                      # ``ModelRunner.draft``: settle each, then apply
            rb.settle(sid, 1)
        rb.apply()

    out = {"batch": batch, "next_n": next_n, "layers": layers}
    with _OpCount() as c:
        rb = make()
    out["make_ops"], out["make_ms"] = c.n, _median_ms(make, repeat)
    with _OpCount() as c:
        settle(rb)
    out["settle_ops"] = c.n
    made = [make() for _ in range(repeat)]   # a fresh rollback per timed settle (each applies once)
    out["settle_ms"] = _median_ms(lambda: settle(made.pop()), repeat)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_spec_rollback", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,64", help="requests per step (comma-separated)")
    p.add_argument("--next-n", type=int, default=3, choices=(1, 2, 3), help="drafts per request")
    p.add_argument("--layers", type=int, default=43, help="trunk layers (Flash: 43)")
    p.add_argument("--repeat", type=int, default=5, help="runs per cell (median)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(int(b), a.next_n, a.layers, a.repeat) for b in a.batches.split(",")]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"MTP verify rollback per step (SpanRollback: the eager and the captured decode step alike): "
          f"{a.layers} layers at Flash widths, next_n {a.next_n}, every span's CSA close rejected; aten ops "
          "(kernel launches on an accelerator) and CPU ms")
    print(f"{'batch':>6}{'make ops':>10}{'settle ops':>12}{'make ms':>10}{'settle ms':>11}")
    for r in rows:
        print(f"{r['batch']:>6}{r['make_ops']:>10}{r['settle_ops']:>12}{r['make_ms']:>10.2f}{r['settle_ms']:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
