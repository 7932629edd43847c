"""Quantised checkpoints: conversion cost and accuracy per quant type, side by side with the original.

    .venv/bin/python bench/bench_quant.py [--ckpt DIR] [--prompt-len 200]

For the original FP8-MXFP4 tiny flash checkpoint and each ``dsv4-convert-model`` type: conversion
time and peak RSS growth (a subprocess per type), checkpoint size on disk, weight bytes the loaded
fp32 model holds, per-format relative weight error (what each format loses on its own), mean / max
relative logit error and top-1 agreement against the original over a ``--prompt-len`` prompt,
and prefill time of that prompt on this CPU (emulated quantisation: slower than dense here; the
fused kernels are the device's job). Writes ``bench/out/quant.json``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.checkpoint.layout import model_linears  # noqa: E402
from engine.checkpoint.formats import dequant_linear
from engine.checkpoint.loader import load_model  # noqa: E402
from engine.checkpoint.make_tiny import make_tiny  # noqa: E402
from engine.checkpoint.qscheme import QUANT_TYPES  # noqa: E402
from engine.checkpoint.shards import ShardReader, scan_checkpoint  # noqa: E402

_CONVERT = r"""
import json, sys, time
from pathlib import Path
from engine.checkpoint import convert_model as cm
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
open("/proc/self/clear_refs", "w").write("5")
base, t0 = status("VmRSS:"), time.perf_counter()
cm.convert_model(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], progress=False)
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_growth_mib": (status("VmHWM:") - base) / 1024}))
"""


def _weight_errors(orig: Path, conv: Path) -> dict[str, float]:
    """Relative Frobenius error of each stored format vs the original weights, over all linears."""
    from engine.config import ModelArgs
    a0, a1 = ModelArgs.from_json(orig), ModelArgs.from_json(conv)
    l0, l1 = model_linears(a0), model_linears(a1)
    err: dict[str, list[float]] = {}
    with ShardReader(orig, scan_checkpoint(orig)) as r0, ShardReader(conv, scan_checkpoint(conv)) as r1:
        for name, lin in l1.items():
            if lin.kind in ("bf16", "fp8", "fp4") or l0[name].kind == lin.kind:
                continue
            w0 = dequant_linear(name, l0[name].kind, r0.get)
            w1 = dequant_linear(name, lin.kind, r1.get)
            e = err.setdefault(lin.kind, [0.0, 0.0])
            e[0] += (w1 - w0).pow(2).sum().item()
            e[1] += w0.pow(2).sum().item()
    return {k: (v[0] / v[1]) ** 0.5 for k, v in err.items()}


def _accuracy(path: Path, prompt: torch.Tensor, ref: torch.Tensor | None):
    m = load_model(path, progress=False)
    weight_mib = sum(p.numel() * p.element_size() for p in m.parameters()) / 2 ** 20
    t0 = time.perf_counter()
    logits = m.logits(m(prompt, m.new_state()))
    ms = (time.perf_counter() - t0) * 1e3
    if ref is None:
        return logits, weight_mib, ms, None
    rel = (logits - ref).norm(dim=-1) / ref.norm(dim=-1)
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return logits, weight_mib, ms, (rel.mean().item(), rel.max().item(), agree)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default=None, help="original FP8-MXFP4 checkpoint (default: a tiny flash, seed 1)")
    p.add_argument("--prompt-len", type=int, default=200)
    a = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        orig = Path(a.ckpt) if a.ckpt else make_tiny("flash", 1, Path(tmp) / "orig")
        prompt = torch.randint(2, 129280, (a.prompt_len,), generator=torch.Generator().manual_seed(7))
        ref, wmib, ms, _ = _accuracy(orig, prompt, None)
        size = sum(f.stat().st_size for f in orig.glob("*.safetensors")) / 2 ** 20
        rows = [{"type": "original fp8-mxfp4", "disk_mib": size, "weight_mib": wmib, "prefill_ms": ms}]
        for qt in QUANT_TYPES:
            out = Path(tmp) / qt
            r = subprocess.run([sys.executable, "-c", _CONVERT, str(orig), str(out), qt], capture_output=True,
                               text=True, cwd=ROOT, check=True)
            conv = json.loads(r.stdout.strip().splitlines()[-1])
            _, wmib, ms, (mean, mx, agree) = _accuracy(out, prompt, ref)
            rows.append({"type": qt, "convert_s": conv["seconds"], "convert_peak_mib": conv["peak_growth_mib"],
                         "disk_mib": sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2 ** 20,
                         "weight_mib": wmib, "prefill_ms": ms, "logit_rel_mean": mean, "logit_rel_max": mx,
                         "top1_agree": agree, "weight_rel_err": _weight_errors(orig, out)})
    hdr = (f"{'type':20s} {'convert s':>9s} {'peak MiB':>8s} {'disk MiB':>8s} {'weights MiB':>11s} "
           f"{'prefill ms':>10s} {'logit err mean':>14s} {'max':>6s} {'top-1':>6s}  weight error per format")
    print(hdr)
    for r in rows:
        fmt = ", ".join(f"{k} {v:.3f}" for k, v in sorted(r.get("weight_rel_err", {}).items()))
        print(f"{r['type']:20s} {r.get('convert_s', 0):9.1f} {r.get('convert_peak_mib', 0):8.1f} "
              f"{r['disk_mib']:8.1f} {r['weight_mib']:11.1f} {r['prefill_ms']:10.0f} "
              f"{r.get('logit_rel_mean', 0):14.4f} {r.get('logit_rel_max', 0):6.3f} {r.get('top1_agree', 1):6.3f}  {fmt}")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "quant.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
