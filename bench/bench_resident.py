"""Weights as stored, per checkpoint type: resident bytes next to stored bytes, and the logits of
the packed model next to the dequantised reference path (``load_model(packed=False)``).

    .venv/bin/python -m bench.bench_resident --model DIR [--types original,w8a8-int,...] [--tokens N]
        [--work DIR] [--json]

``--model`` is an original FP8-MXFP4 checkpoint (e.g. ``dsv4-make-tiny --preset flash-real-width``);
each converted type is written once by ``dsv4-convert-model`` under ``--work`` (default
``bench/out/resident``) and reused. Per type: stored = the tensor bytes of the shards the model
reads (no MTP: next_n 0), resident = the loaded model's parameters + buffers, and for a prompt of
``--tokens`` random ids (fp32 compute, one prefill + the last token's logits) the largest
|packed - dense| logit difference, relative to the largest |logit|, and whether they are bit-equal.
Writes ``bench/out/resident.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.checkpoint.convert_model import convert_model  # noqa: E402
from engine.checkpoint.loader import load_model  # noqa: E402
from engine.checkpoint.qscheme import QUANT_TYPES  # noqa: E402
from engine.checkpoint.shards import scan_checkpoint  # noqa: E402


def _held(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model.logits(model(tokens, model.new_state())[-1:])[0]


def measure(ckpt: Path, tokens: torch.Tensor) -> dict:
    """Stored / resident bytes and packed-vs-dense logits of one checkpoint."""
    stored = sum(t.nbytes for n, t in scan_checkpoint(ckpt).items() if not n.startswith("mtp."))
    t0 = time.perf_counter()
    packed = load_model(ckpt, progress=False)
    load_s = time.perf_counter() - t0
    resident = _held(packed)
    lp = _logits(packed, tokens)
    del packed
    gc.collect()
    dense = load_model(ckpt, progress=False, packed=False)
    dense_bytes = _held(dense)
    ld = _logits(dense, tokens)
    del dense
    gc.collect()
    diff = (lp - ld).abs().max().item()
    return {"stored_bytes": stored, "resident_bytes": resident, "dense_bytes": dense_bytes,
            "resident_over_stored": resident / stored, "load_s": load_s, "max_abs_logit_diff": diff,
            "rel_logit_diff": diff / ld.abs().max().item(), "bit_equal": bool(torch.equal(lp, ld)),
            "same_argmax": bool(lp.argmax() == ld.argmax())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_resident", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="original FP8-MXFP4 checkpoint directory")
    p.add_argument("--types", default=",".join(("original",) + QUANT_TYPES))
    p.add_argument("--tokens", type=int, default=16, help="prompt length (default 16)")
    p.add_argument("--work", default=str(ROOT / "bench" / "out" / "resident"), help="converted checkpoints go here")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    tokens = torch.randint(2, 129000, (a.tokens,))
    rows = {}
    for qt in a.types.split(","):
        ckpt = Path(a.model)
        if qt != "original":
            ckpt = Path(a.work) / qt
            if not (ckpt / "config.json").is_file():
                convert_model(a.model, ckpt, qt, progress=False)
        rows[qt] = measure(ckpt, tokens)
        print(f"{qt}: {rows[qt]}", file=sys.stderr)
    out = ROOT / "bench" / "out" / "resident.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| type | stored GB | resident GB | resident / stored | dense GB | load s | max abs logit diff | "
          "relative | bit-equal | same argmax |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qt, r in rows.items():
        print(f"| {qt} | {r['stored_bytes'] / 1e9:.3f} | {r['resident_bytes'] / 1e9:.3f} | "
              f"{r['resident_over_stored']:.4f} | {r['dense_bytes'] / 1e9:.3f} | {r['load_s']:.1f} | "
              f"{r['max_abs_logit_diff']:.2e} | {r['rel_logit_diff']:.2e} | {r['bit_equal']} | {r['same_argmax']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
