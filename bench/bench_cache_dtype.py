"""Decode-state caches per cache dtype, side by side: state per request, requests per rank, P/D bytes.

    .venv/bin/python -m bench.bench_cache_dtype [--json] [--out FILE] [--no-accuracy]

For each ``scheduler_config.kv_cache_dtype`` (``engine.cache_dtype``: bfloat16 = nothing
quantised, int8 = A3's default bf16 KV + int8 indexer keys, fp8 = 950 C8, hif8 = 950 HiF8):

* state per request, MiB (2^20 B), at 8K / 128K / 1M tokens of DeepSeek-V4-Flash and -Pro
  (configs/models/deepseek-v4-{flash,pro}/config.json), from the memory plan
  (``engine.memory_sizes.state_per_request``: whole 128-token blocks, next_n 0, bf16 compute;
  reference/dsv4-architecture.md §4);
* requests of 8K / 128K / 1M tokens that fit per rank (``engine.memory_plan``): the layout of
  configs/deepseek-v4-flash-a3-decode.yaml on an A3 die (64 GiB, w8a8-int weights) for bfloat16
  and int8; A3 lacks FP8 / HiF8, so fp8 / hif8 are planned on a 950 rank (the same layout,
  128 GiB, the 950 weight types w4a8-mx / w4a8-mx-hif whose cache schemes they are);
* P/D transfer bytes, MiB, of a 4K-token prompt's state (``engine.core.pd_state.expected_shapes``
  with the cache codecs: what the wire format's frames carry, header aside) for Flash and Pro,
  and the share of the bfloat16 bytes;
* accuracy (``engine.tools.cache_accuracy``): teacher-forced over 320 positions of the tiny flash
  and pro models, top-1 agreement and mean / max relative logit error against unquantised caches.

The sizes take ~5 s on 2 cores; the accuracy a few minutes (``--no-accuracy`` skips it). Writes ``--out`` (default
``bench/out/cache_dtype.json``); ``--json`` prints it instead of the tables. Time a transfer of the
quantised state with ``bench/bench_transfer.py --kv-cache-dtype fp8 --kinds zmq-tcp``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_transfer import state_bytes, state_shapes  # noqa: E402
from engine.cache_dtype import SETTINGS, CacheDtype  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.memory_plan import DEVICE_GIB, STATE_LENGTHS, plan_memory, with_quant_type  # noqa: E402
from engine.memory_sizes import GIB, MIB, Layout, state_per_request  # noqa: E402
from engine.tools.cache_accuracy import cache_accuracy  # noqa: E402

MODELS = {"Flash": ROOT / "configs/models/deepseek-v4-flash", "Pro": ROOT / "configs/models/deepseek-v4-pro"}
RANK_YAML = ROOT / "configs/deepseek-v4-flash-a3-decode.yaml"
WEIGHTS_950 = {"fp8": "w4a8-mx", "hif8": "w4a8-mx-hif"}      # the 950 types whose cache schemes these are
PROMPT = 4096
ACCURACY_HINT = "accuracy: skipped (--no-accuracy); tests/engine/test_cache_quant.py bounds it"


def state_mib(args: ModelArgs, cache: CacheDtype) -> dict[int, float]:
    """Tokens -> MiB of one request's decode state (``state_per_request``, default ``Layout``)."""
    return {t: sum(state_per_request(args, Layout(cache_dtype=cache), t).values()) / MIB for t in STATE_LENGTHS}


def rank_plan(setting: str, cache: CacheDtype) -> dict:
    """Requests that fit per Flash rank: the A3 decode layout, or a 950 rank for FP8 / HiF8 caches."""
    from engine.run_config import RunConfig
    from engine.tools.plan import plan_args
    cfg = RunConfig.from_yaml(RANK_YAML)
    args, _ = plan_args(cfg)
    lay = Layout.of(cfg, cache)
    if setting in WEIGHTS_950:
        args, lay = with_quant_type(ModelArgs.from_json(MODELS["Flash"]), WEIGHTS_950[setting]), \
            dataclasses.replace(lay, platform="950")
    plan = plan_memory(args, lay, DEVICE_GIB[lay.platform] * GIB, advise=False)
    return {"platform": lay.platform, "weights": plan.quant_type, "device_gib": DEVICE_GIB[lay.platform],
            "left_gib": plan.left / GIB, "fits": plan.fits, "requests": {t: plan.requests(t) for t in plan.state}}


def transfer_mib(args: ModelArgs, cache: CacheDtype) -> float:
    """MiB of a ``PROMPT``-token request's P/D state tensors, caches stored as ``cache``."""
    return state_bytes(state_shapes(args, cache, PROMPT)) / MIB


def measure() -> dict:
    """Every figure, per setting (bytes as MiB / GiB floats, request counts as ints)."""
    args = {m: ModelArgs.from_json(p) for m, p in MODELS.items()}
    rows = {}
    for setting, kinds in SETTINGS.items():
        cache = CacheDtype(*kinds)
        rows[setting] = {"kv": cache.kv, "indexer": cache.indexer,
                         "state_mib": {m: state_mib(a, cache) for m, a in args.items()},
                         "rank": rank_plan(setting, cache),
                         "transfer_mib": {m: transfer_mib(a, cache) for m, a in args.items()}}
    return rows


def accuracy(settings: list[str]) -> tuple[dict | None, list[str]]:
    """(the accuracy figures or None, the lines to print)."""
    res = cache_accuracy(settings)
    metrics = sorted({k for r in res.values() for k in r})
    lines = ["| kv_cache_dtype | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(_num(res[s].get(k)) for k in metrics) + " |" for s in settings if s in res]
    return res, lines


def _num(v) -> str:
    return "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))


def _tok(t: int) -> str:
    return f"{t >> 20}M" if t >= 1 << 20 else f"{t >> 10}K"


def tables(rows: dict) -> list[str]:
    """The markdown tables ``main`` prints."""
    lens = STATE_LENGTHS
    out = ["State per request, MiB (memory plan: whole 128-token blocks, next_n 0; reference §4)", "",
           "| kv_cache_dtype | KV / indexer | " + " | ".join(f"{m} {_tok(t)}" for m in MODELS for t in lens) + " |",
           "|---|---|" + "---:|" * (len(MODELS) * len(lens))]
    for s, r in rows.items():
        out.append(f"| {s} | {r['kv']} / {r['indexer']} | "
                   + " | ".join(f"{r['state_mib'][m][t]:.1f}" for m in MODELS for t in lens) + " |")
    out += ["", f"Requests that fit per Flash rank ({RANK_YAML.relative_to(ROOT)} layout; A3 lacks FP8 / HiF8, "
                "so fp8 / hif8 are planned on a 950 rank with the 950 weight type)", "",
            "| kv_cache_dtype | rank | weights | GiB left for state | " + " | ".join(_tok(t) for t in lens) + " |",
            "|---|---|---|---:|" + "---:|" * len(lens)]
    for s, r in rows.items():
        k = r["rank"]
        out.append(f"| {s} | {k['platform']} ({k['device_gib']} GiB) | {k['weights']} | {k['left_gib']:.2f} | "
                   + " | ".join(str(k["requests"][t]) for t in lens) + " |")
    base = rows["bfloat16"]["transfer_mib"]
    out += ["", f"P/D transfer of a {PROMPT // 1024}K-token prompt's state, MiB (pd_state.expected_shapes; "
                "share of bfloat16)", "", "| kv_cache_dtype | " + " | ".join(MODELS) + " |",
            "|---|" + "---:|" * len(MODELS)]
    for s, r in rows.items():
        out.append(f"| {s} | " + " | ".join(f"{r['transfer_mib'][m]:.2f} ({r['transfer_mib'][m] / base[m]:.0%})"
                                           for m in MODELS) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_cache_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the JSON instead of the tables")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "cache_dtype.json"), help="JSON file to write")
    p.add_argument("--no-accuracy", action="store_true",
                   help="skip the accuracy figures (they run the tiny flash and pro models, a few minutes)")
    a = p.parse_args(argv)
    rows = measure()
    acc, acc_lines = (None, [ACCURACY_HINT]) if a.no_accuracy else accuracy(list(rows))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"prompt_tokens": PROMPT, "rows": rows, "accuracy": acc}
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1) if a.json else "\n".join(tables(rows) + [""] + acc_lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
