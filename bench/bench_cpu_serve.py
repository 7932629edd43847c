"""CPU serving as a user measures it: ``launch-pd --role local`` on the flash-cpu-bench checkpoint,
loaded by ``dsv4-bench serve``; TTFT, TPOT and output tok/s beside the roofline and the targets.

    python -m bench.bench_cpu_serve                         # this checkout, --role local's default layout
    python -m bench.bench_cpu_serve --layout split --label split
    python -m bench.bench_cpu_serve --repo ../old --config /tmp/old.yaml --label before
    python -m bench.bench_cpu_serve --compare bench/out/cpu_serve_before.json bench/out/cpu_serve_after.json

Writes the checkpoint (``dsv4-make-tiny --preset flash-cpu-bench --seed 0``) when it is missing,
starts ``launch-pd --role local`` from ``--repo`` (its code, this interpreter) on
``configs/tiny-cpu-bench.yaml``, sends one warm-up round per shape (the captured step compiles a
(batch, context) bucket on its first use), then the measured runs, all random prompts, 32 output
tokens, greedy, ``ignore_eos``: concurrency 1 at 256 and 1,000 prompt tokens (TTFT, TPOT), then
concurrency 8 and 32 at 256 (output tok/s). Prints the table and writes
``bench/out/cpu_serve_<label>.json``; ``--compare`` prints saved runs side by side. The limit
column is the roofline (``bench.roofline``: bytes and FLOPs of the step over this machine's probed
read bandwidth and fp32 GEMM peak): TTFT = prefill of the prompt, TPOT = one decode step at batch
1, tok/s = batch B / one decode step at batch B.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench import serve_bench

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "models/tiny-cpu-bench"
CONFIG = ROOT / "configs/tiny-cpu-bench.yaml"
OUT_LEN = 32
# (name, prompt tokens, concurrency, prompts): what each figure is measured on
RUNS = [("c1_256", 256, 1, 8), ("c1_1000", 1000, 1, 4), ("c8_256", 256, 8, 32), ("c32_256", 256, 32, 64)]
WARMUP = [(256, 1, 2), (1000, 1, 1), (256, 8, 8), (256, 32, 32)]
TARGETS = {"ttft_256": ("<=", 125.0), "tpot": ("<=", 17.8), "tok_s_c8": (">=", 156.0)}


def _serve(base: str, length: int, concurrency: int, prompts: int, out: Path) -> dict:
    argv = ["--base-url", base, "--dataset", "random", "--random-input-len", str(length),
            "--random-output-len", str(OUT_LEN), "--num-prompts", str(prompts), "--max-concurrency",
            str(concurrency), "--metric-percentiles", "50", "--result-file", str(out)]
    if serve_bench.main(argv) != 0:
        raise RuntimeError(f"dsv4-bench serve {' '.join(argv)} failed")
    s = json.loads(out.read_text())["summary"]
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed at concurrency {concurrency}")
    return s


def _start(a) -> tuple[subprocess.Popen, str]:
    port = 18000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "server.launch.cli", "--role", "local", "--config", str(a.config), "--model",
           str(a.checkpoint), "--port", str(port)] + (["--pd-split"] if a.layout == "split" else [])
    log = open(ROOT / f"bench/out/cpu_serve_{a.label}.log", "w")
    p = subprocess.Popen(cmd, cwd=a.repo, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base, end = f"http://127.0.0.1:{port}", time.monotonic() + a.startup_s
    while time.monotonic() < end:
        if p.poll() is not None:
            raise RuntimeError(f"launch-pd exited with {p.returncode}; see {log.name}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return p, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    p.terminate()
    raise RuntimeError(f"not up within {a.startup_s:g} s; see {log.name}")


def limits(checkpoint: Path) -> dict:
    """Roofline floors (ms; tok/s) of the measured figures on this machine."""
    import torch

    from bench import roofline
    from engine.config import ModelArgs
    args = ModelArgs.from_dict(json.loads((checkpoint / "config.json").read_text()))
    hw = roofline.probe_hardware(seconds=2.0)
    step = {b: roofline.limit(roofline.decode_cost(args, b, 256 + OUT_LEN // 2), hw)["limit_s"] for b in (1, 8, 32)}
    pre = {n: roofline.limit(roofline.prefill_cost(args, n, torch.float32), hw)["limit_s"] for n in (256, 1000)}
    return {"ttft_256": pre[256] * 1e3, "ttft_1000": pre[1000] * 1e3, "tpot": step[1] * 1e3,
            "tok_s_c8": 8 / step[8], "tok_s_c32": 32 / step[32],
            "probe": {"read_gbs": hw["read_gbs"], "fp32_gflops": hw["gemm_gflops"]["float32"]}}


def measure(a) -> dict:
    out = ROOT / "bench/out"
    out.mkdir(parents=True, exist_ok=True)
    p, base = _start(a)
    try:
        for length, conc, n in WARMUP:
            _serve(base, length, conc, n, out / "cpu_serve_warmup.json")
        s = {name: _serve(base, length, conc, n, out / f"cpu_serve_{a.label}_{name}.json")
             for name, length, conc, n in RUNS}
    finally:
        p.terminate()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
    return {"label": a.label, "layout": a.layout, "repo": str(a.repo), "config": str(a.config),
            "date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(),
            "ttft_256": s["c1_256"]["median_ttft_ms"], "ttft_1000": s["c1_1000"]["median_ttft_ms"],
            "tpot": s["c1_256"]["median_tpot_ms"], "tok_s_c8": s["c8_256"]["output_throughput"],
            "ttft_c8": s["c8_256"]["median_ttft_ms"], "tpot_c8": s["c8_256"]["median_tpot_ms"],
            "tok_s_c32": s["c32_256"]["output_throughput"], "ttft_c32": s["c32_256"]["median_ttft_ms"],
            "tpot_c32": s["c32_256"]["median_tpot_ms"]}


ROWS = [("TTFT p50, 256 tokens, concurrency 1 (ms)", "ttft_256"), ("TTFT p50, 1,000 tokens (ms)", "ttft_1000"),
        ("TPOT p50, concurrency 1 (ms)", "tpot"), ("output tok/s, concurrency 8", "tok_s_c8"),
        ("  TTFT / TPOT p50 at 8 (ms)", ("ttft_c8", "tpot_c8")), ("output tok/s, concurrency 32", "tok_s_c32"),
        ("  TTFT / TPOT p50 at 32 (ms)", ("ttft_c32", "tpot_c32"))]


def table(runs: list[dict], lim: dict | None) -> str:
    """The figures of ``runs`` side by side, then the target and the roofline limit."""
    def cell(r, key):
        if isinstance(key, tuple):
            return " / ".join(f"{r[k]:,.0f}" for k in key)
        return f"{r[key]:,.1f}"
    head = ["figure"] + [r["label"] for r in runs] + ["target", "limit"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for title, key in ROWS:
        tgt = TARGETS.get(key) if isinstance(key, str) else None
        if key == "tok_s_c32":
            tgt = (">=", 1.5 * runs[-1]["tok_s_c8"])
        lim_cell = f"{lim[key]:,.1f}" if lim and isinstance(key, str) and key in lim else ""
        lines.append("| " + " | ".join([title] + [cell(r, key) for r in runs]
                                       + [f"{tgt[0]} {tgt[1]:,.1f}" if tgt else "", lim_cell]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_cpu_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=ROOT, help="checkout whose launch-pd runs (its code, this Python)")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--checkpoint", type=Path, default=CKPT)
    p.add_argument("--layout", choices=("default", "split"), default="default",
                   help="default: what --role local starts; split: --pd-split (a prefill and a decode worker)")
    p.add_argument("--label", default="after")
    p.add_argument("--startup-s", type=float, default=1800.0, help="longest wait for the server (compiles)")
    p.add_argument("--compare", nargs="+", type=Path, help="saved runs to print side by side (no run)")
    a = p.parse_args(argv)
    if a.compare:
        runs = [json.loads(f.read_text()) for f in a.compare]
        print(table(runs, runs[-1].get("limits")))
        return 0
    if not (a.checkpoint / "config.json").is_file():
        from engine.checkpoint.make_tiny import make_tiny
        make_tiny("flash-cpu-bench", 0, a.checkpoint)
    res = measure(a)
    res["limits"] = limits(a.checkpoint)
    (ROOT / f"bench/out/cpu_serve_{a.label}.json").write_text(json.dumps(res, indent=1))
    print(table([res], res["limits"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
