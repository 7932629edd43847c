"""Model benchmark: dsv4-pd vs the HF transformers reference on the same tiny checkpoint, one run.

    .venv/bin/python bench/bench_model.py [--ckpt DIR] [--lengths 1024,8192,32768,131072]

Prints prefill tokens/s per prompt length, decode ms/token at batch 1, and each run's peak RSS,
side by side. Every measurement runs in its own subprocess under an address-space cap
(``--mem-limit-gb``), so an out-of-memory run is reported as OOM instead of taking the machine
down. Prefill = logits of the last prompt token (HF gets ``logits_to_keep=1``); ours runs chunked
prefill of ``--prefill-chunk`` tokens per forward, as the serving engine does.
Writes the figures as JSON to ``bench/out/model.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(impl: str, kind: str, ckpt: str, length: int, steps: int, chunk: int) -> dict:
    """One measurement in this process; returns figures (seconds, tokens/s, MiB)."""
    import torch

    ids = torch.randint(2, 129280, (length,), generator=torch.Generator().manual_seed(0))
    if impl == "ours":
        from engine.checkpoint.loader import load_model

        model = load_model(ckpt, progress=False)
        state = model.new_state()
        t0 = time.perf_counter()
        for s in range(0, length, chunk):
            hidden = model(ids[s:s + chunk], state)
        nxt = model.logits(hidden[-1:]).argmax(-1)
        t_prefill = time.perf_counter() - t0
        step = lambda tok: model.logits(model(tok, state)).argmax(-1)  # noqa: E731
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from hf_oracle import load_hf
        from transformers.cache_utils import DynamicCache

        model = load_hf(ckpt)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            t_prefill = time.perf_counter() - t0

        def step(tok):
            with torch.no_grad():
                return model(input_ids=tok.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1:].argmax(-1)
    res = {"prefill_s": t_prefill, "prefill_tok_s": length / t_prefill}
    if kind == "decode":
        nxt = step(nxt.view(-1))                                     # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = step(nxt.view(-1))
        res["decode_ms"] = (time.perf_counter() - t0) / steps * 1000
    res["peak_rss_mb"] = _peak_rss_mb()
    return res


def run_one(impl, kind, ckpt, length, steps, chunk, mem_gb, timeout) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, kind, str(ckpt), str(length), str(steps), str(chunk)]
    limit = int(mem_gb * (1 << 30))

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=cap,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout>{timeout}s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = r.stderr.lower()
    oom = any(s in err for s in ("memoryerror", "can't allocate", "cannot allocate", "out of memory", "bad_alloc"))
    return {"error": "OOM" if oom or r.returncode == -9 else f"rc={r.returncode}: {r.stderr.strip()[-200:]}"}


def fmt(res: dict, key: str, spec: str) -> str:
    return res["error"][:12] if "error" in res else format(res[key], spec)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        impl, kind, ckpt, length, steps, chunk = sys.argv[2:8]
        print(json.dumps(worker(impl, kind, ckpt, int(length), int(steps), int(chunk))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="checkpoint dir (default: a fresh tiny flash, seed 0)")
    p.add_argument("--lengths", default="1024,8192,32768,131072")
    p.add_argument("--decode-prompt", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--mem-limit-gb", type=float, default=20.0)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement")
    p.add_argument("--skip-hf-above", type=int, default=32768, help="do not start HF above this length "
                   "(it needs O(L^2) memory: already out of memory at 32K under the default cap)")
    a = p.parse_args(argv)
    ckpt = a.ckpt
    if ckpt is None:
        from engine.checkpoint.make_tiny import make_tiny

        ckpt = str(make_tiny("flash", 0, Path(tempfile.mkdtemp()) / "tiny-flash"))
    lengths = [int(x) for x in a.lengths.split(",")]
    rows = []
    for L in lengths:
        row = {"length": L, "ours": run_one("ours", "prefill", ckpt, L, 0, a.prefill_chunk, a.mem_limit_gb, a.timeout)}
        row["hf"] = (run_one("hf", "prefill", ckpt, L, 0, a.prefill_chunk, a.mem_limit_gb, a.timeout)
                     if L <= a.skip_hf_above else {"error": "not run"})
        rows.append(row)
        print(f"prefill {L:>7}: ours {fmt(row['ours'], 'prefill_tok_s', '.0f')}, HF {fmt(row['hf'], 'prefill_tok_s', '.0f')}"
              " tok/s", flush=True)
    dec = {impl: run_one(impl, "decode", ckpt, a.decode_prompt, a.decode_steps, a.prefill_chunk, a.mem_limit_gb,
                         a.timeout) for impl in ("ours", "hf")}
    print("\nDeepSeek-V4 tiny flash, CPU, fp32 — dsv4-pd vs HF transformers 5.23.0 (same checkpoint, same run)")
    print(f"{'prefill tokens':>15} | {'ours tok/s':>10} | {'HF tok/s':>10} | {'speed-up':>8} | "
          f"{'ours peak RSS MiB':>17} | {'HF peak RSS MiB':>15}")
    for r in rows:
        o, h = r["ours"], r["hf"]
        sp = f"{o['prefill_tok_s'] / h['prefill_tok_s']:.1f}x" if "error" not in o and "error" not in h else "-"
        print(f"{r['length']:>15} | {fmt(o, 'prefill_tok_s', '.0f'):>10} | {fmt(h, 'prefill_tok_s', '.0f'):>10} | "
              f"{sp:>8} | {fmt(o, 'peak_rss_mb', '.0f'):>17} | {fmt(h, 'peak_rss_mb', '.0f'):>15}")
    o, h = dec["ours"], dec["hf"]
    print(f"\ndecode batch 1 after {a.decode_prompt} tokens: ours {fmt(o, 'decode_ms', '.1f')} ms/token "
          f"({fmt(o, 'peak_rss_mb', '.0f')} MiB) | HF {fmt(h, 'decode_ms', '.1f')} ms/token "
          f"({fmt(h, 'peak_rss_mb', '.0f')} MiB)")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.json").write_text(json.dumps({"prefill": rows, "decode": dec, "ckpt": ckpt}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
