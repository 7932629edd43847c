"""``dsv4-bench engine``: model step times beside the hardware limit (roofline, ``bench.roofline``).

    dsv4-bench engine [--ckpt DIR] [--dtype float32|bfloat16] [--threads N] [--quick] [--no-hf]
                      [--batch-sizes 1,2,4,8,16,32,64] [--prompt-len 512] [--decode-steps 16]
                      [--contexts 1024,8192,32768,131072] [--prefill-lens 1024,8192,32768]
                      [--prefill-chunk 8192] [--out bench/out/engine_bench.json] [--plot PATH.png]

Probes the machine (read bandwidth GB/s, GEMM GFLOP/s), then measures, each beside its limit
``max(bytes / bandwidth, flops / peak)`` from the analytic cost model, the ratio measured / limit
and which term binds:

* decode step vs batch, through the serving engine (``LLMEngine``: paged state, continuous
  batching): B requests of ``--prompt-len`` random tokens prefilled, then ``--decode-steps``
  full decode steps timed (median; scheduler + model, sampling included);
* decode step vs context at batch 1 on a synthetic paged state (``synthetic_paged``: the pools
  of one request filled with random unit-scale values for ``context`` tokens; prefilling 128K
  tokens on a CPU takes minutes), the engine's eager decode step (``ModelRunner.decode``:
  ``StaticDecoder.run`` with host positions) + logits (median);
* prefill time vs prompt length: fresh state, chunks of ``--prefill-chunk`` tokens, then the
  logits of the last row; ``linearity`` = time / (time at the first length x length ratio);
* per-op breakdown of one engine decode step (batch 1 and the largest batch, after
  ``--prompt-len``-token prompts): every op of the ``engine.ops.Ops`` table under
  ``torch.profiler.record_function(name)``, the LM head (``model.logits``) as ``lm_head``; ms per
  step per op and "other (python / glue)" = step - ops, split into torch ops run outside the table
  (sampling, batching glue, the compressors' state updates) and Python; the decode step's
  attention, indexer and compressors are counted op by op (``decode_sparse_attn``, ...);
* unless ``--no-hf``: HF transformers' batch-1 decode ms/token beside ours and the limit
  (``bench.bench_model.run_one``, separate processes, fp32).

Times are seconds (s) or milliseconds (ms) of wall time; bandwidth GB/s = 1e9 B/s. Writes every
row, the hardware probe and the breakdown as JSON (``--out``), and with ``--plot`` a PNG of step
time vs batch and vs context with the limit lines.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from bench import roofline as R
from bench.engine_measure import (attribute, breakdown, decode_vs_batch, decode_vs_context, hf_reference,
                                  labelled_model, prefill, synthetic_paged)
from bench.engine_report import (batch_table, breakdown_table, context_table, hf_table, plot, prefill_table)

__all__ = ["main", "parse_args", "attribute", "synthetic_paged"]   # the last two: for tests/bench/test_bench_engine.py

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CKPT = ROOT / "models" / "tiny-flash"
DEFAULT_OUT = ROOT / "bench" / "out" / "engine_bench.json"

FULL = dict(batch_sizes=[1, 2, 4, 8, 16, 32, 64], contexts=[1024, 8192, 32768, 131072],
            prefill_lens=[1024, 8192, 32768], prompt_len=512, decode_steps=16, profile_steps=5,
            probe_seconds=2.0, probe_mib=512, hf_length=1024)
QUICK = dict(batch_sizes=[1, 2], contexts=[256, 512], prefill_lens=[128, 256], prompt_len=64, decode_steps=3,
             profile_steps=2, probe_seconds=0.5, probe_mib=128, hf_length=256)


# ---- CLI ---------------------------------------------------------------------------------------
def _sizes(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return vals


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsv4-bench engine", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT),
                   help="checkpoint dir (default models/tiny-flash, written with make_tiny('flash', 0) if missing)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--threads", type=_positive, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sweeps for tests: batch 1,2; contexts 256,512; prefill 128,256; prompt 64; 3 steps")
    p.add_argument("--batch-sizes", type=_sizes, help="decode vs batch (default 1,2,4,8,16,32,64)")
    p.add_argument("--prompt-len", type=_positive, help="prompt tokens per request in the batch sweep and the "
                   "context of the breakdown (default 512)")
    p.add_argument("--decode-steps", type=_positive, help="timed decode steps per row (default 16)")
    p.add_argument("--contexts", type=_sizes, help="decode vs context, batch 1 (default 1024,8192,32768,131072)")
    p.add_argument("--prefill-lens", type=_sizes, help="prefill vs length (default 1024,8192,32768)")
    p.add_argument("--prefill-chunk", type=_positive, default=8192, help="tokens per prefill forward (8192)")
    p.add_argument("--profile-steps", type=_positive, help="profiled decode steps per breakdown (default 5)")
    p.add_argument("--probe-seconds", type=_positive_float, help="hardware probe budget (default 2)")
    p.add_argument("--probe-mib", type=_positive, help="bandwidth probe buffer, MiB (default 512)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers reference")
    p.add_argument("--hf-length", type=_positive, help="prompt tokens before the HF / ours decode (default 1024)")
    p.add_argument("--hf-timeout", type=_positive, default=1200, help="seconds per HF / ours subprocess")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output (default bench/out/engine_bench.json)")
    p.add_argument("--plot", help="PNG: step time vs batch and vs context with the limit lines")
    a = p.parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    return a




class Laps:
    """Seconds each section took, in order (``res["section_seconds"]``)."""

    def __init__(self):
        self.took: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.took[name] = round(now - self._clock, 2)
        self._clock = now


def _load(a: argparse.Namespace):
    """(checkpoint dir, model), writing the default tiny checkpoint if missing; None if ``--ckpt`` is wrong."""
    from engine.checkpoint.make_tiny import make_tiny
    from engine.checkpoint.loader import load_model

    ckpt = Path(a.ckpt)
    if not (ckpt / "config.json").is_file():
        if ckpt != DEFAULT_CKPT:                               # a typo must not become a random model
            print(f"dsv4-bench engine: error: argument --ckpt: {ckpt} holds no config.json", file=sys.stderr)
            return None
        print(f"writing the tiny flash checkpoint to {ckpt}", flush=True)
        make_tiny("flash", 0, ckpt)
    torch.manual_seed(a.seed)
    return ckpt, load_model(ckpt, dtype=getattr(torch, a.dtype), progress=False)


def _header(a: argparse.Namespace, ckpt: Path, model, hw: dict) -> dict:
    """The result's config / hardware / model sections; prints the one-line summary."""
    args, dtype = model.args, getattr(torch, a.dtype)
    wb = R.weight_bytes(args, dtype)
    res = {"config": {"ckpt": str(ckpt), "ckpt_name": ckpt.name, "dtype": a.dtype, "threads": torch.get_num_threads(),
                      "batch_sizes": a.batch_sizes, "prompt_len": a.prompt_len, "decode_steps": a.decode_steps,
                      "contexts": a.contexts, "prefill_lens": a.prefill_lens, "prefill_chunk": a.prefill_chunk,
                      "quick": a.quick},
           "hardware": hw,
           "model": {"weight_bytes": wb, "weight_bytes_no_mtp": R.weight_bytes(args, dtype, mtp=False),
                     "param_bytes_loaded": sum(p.numel() * p.element_size() for p in model.parameters()),
                     "layers": args.num_hidden_layers, "compress_ratios": list(args.compress_ratios)}}
    print(f"{ckpt.name}, {a.dtype}, {hw['threads']} threads | read {hw['read_gbs']:.1f} GB/s ({hw['read_method']}), "
          f"copy {hw['copy_gbs']:.1f} GB/s, GEMM {hw['gemm_gflops']['float32']:.0f} GFLOP/s fp32, "
          f"{hw['gemm_gflops']['bfloat16']:.0f} bf16 | weights {wb / 1e6:.1f} MB (incl. MTP)", flush=True)
    return res


def _decode_batch(a, model, hw: dict, dtype) -> list[dict]:
    rows = [decode_vs_batch(model, b, a.prompt_len, a.decode_steps, hw, dtype, a.seed) for b in a.batch_sizes]
    base = next((r for r in rows if r["batch"] == 1), rows[0])
    for r in rows:
        r["speedup_vs_first"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
    batch_table(rows, a.prompt_len, a.decode_steps)
    return rows


def _decode_context(a, model, hw: dict, dtype) -> list[dict]:
    rows = [decode_vs_context(model, c, a.decode_steps, hw, dtype, a.seed) for c in a.contexts]
    for r in rows:
        r["vs_first"] = round(r["step_ms"] / rows[0]["step_ms"], 2)
    context_table(rows, a.decode_steps)
    return rows


def _prefill(a, model, hw: dict, dtype) -> list[dict]:
    rows = [prefill(model, L, a.prefill_chunk, hw, dtype, a.seed) for L in a.prefill_lens]
    for r in rows:
        r["linearity"] = round(r["seconds"] / (rows[0]["seconds"] * r["length"] / rows[0]["length"]), 2)
    prefill_table(rows, a.prefill_chunk)
    return rows


def _breakdown(a, ckpt: Path, dtype) -> list[dict]:
    wmodel = labelled_model(ckpt, dtype)
    bds = [breakdown(wmodel, b, a.prompt_len, a.profile_steps, a.seed) for b in sorted({1, max(a.batch_sizes)})]
    breakdown_table(bds, a.prompt_len, a.profile_steps)
    return bds


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)         # the HF / ours subprocesses too
    loaded = _load(a)
    if loaded is None:
        return 2
    ckpt, model = loaded
    dtype = getattr(torch, a.dtype)
    lap = Laps()
    hw = R.probe_hardware(a.probe_seconds, a.probe_mib)
    lap("probe")
    res = _header(a, ckpt, model, hw)
    res["decode_batch"] = _decode_batch(a, model, hw, dtype)
    lap("decode_batch")
    res["decode_context"] = _decode_context(a, model, hw, dtype)
    lap("decode_context")
    res["prefill"] = _prefill(a, model, hw, dtype)
    lap("prefill")
    res["breakdown"] = _breakdown(a, ckpt, dtype)
    lap("breakdown")
    if not a.no_hf:
        res["hf"] = hf_reference(str(ckpt), a.hf_length, a.decode_steps, a.prefill_chunk, model.args, hw,
                                 a.hf_timeout)
        lap("hf")
        hf_table(res["hf"], a.hf_length, a.decode_steps)

    res["section_seconds"] = lap.took
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out}")
    if a.plot:
        print(plot(Path(a.plot), res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
