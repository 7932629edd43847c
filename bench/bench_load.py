"""Checkpoint loading beside the disk: ``load_model`` seconds and MB/s next to a plain sequential
read of the same shard files, and its peak RSS next to the bytes the loaded model keeps.

    .venv/bin/python -m bench.bench_load --model DIR [--dtypes fp32,bf16] [--cache cold,warm]
        [--load-args JSON ...] [--forward-tokens N] [--repeat N] [--json] [--out FILE]

Every measurement runs in a fresh subprocess (its own peak RSS, nothing imported or cached in the
interpreter). Per page-cache mode, in this order: a sequential read of every ``*.safetensors``
file (16 MiB ``readinto``; the disk's limit), one ``load_model(DIR, dtype, progress=False,
**load_args)`` per dtype and ``--load-args`` variant, then the sequential read again.

* ``cold``: each shard file's cached pages are dropped with ``posix_fadvise(DONTNEED)`` before every
  measurement (no root needed; works for clean pages no other process has mapped, so compare the
  two reads: if the second is not also at disk speed, something kept the pages).
* ``warm``: the files are read once, unmeasured, before every measurement (all from the page cache:
  the ceiling for a loader that reads from memory).

Figures: MB/s = shard file bytes (what the read moves: tensors + headers) / seconds, 1 MB = 10^6 B;
peak RSS = the subprocess's VmHWM (includes the interpreter, torch and any mmapped checkpoint
pages it touched; ``base`` = VmRSS after the imports; not ``ru_maxrss``, which Linux carries over
from the forking parent); resident = the loaded model's
parameters + buffers (bytes of tensors held elsewhere are not counted); construct = the part of the
load spent building the ``Transformer`` (when the loader builds it through that name).
``--forward-tokens N`` also times one forward of N tokens (prefill from an empty state) + the
logits of the last one, after the load. ``--load-args`` passes keyword arguments through to
``load_model`` (JSON object; each occurrence is one variant, e.g. ``'{"packed": true}'``), so the
same command shows a loader before and after a change. Writes ``bench/out/load.json`` (``--out``);
``--json`` prints the JSON instead of the markdown table.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
CHUNK = 16 << 20


def shard_files(model: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files, sorted (the order the read goes)."""
    return sorted(model.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Ask the kernel to drop the files' clean cached pages (``posix_fadvise`` DONTNEED)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(files: list[Path]) -> int:
    """Read every file start to end through one 16 MiB buffer; returns the bytes read."""
    buf, n = bytearray(CHUNK), 0
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(view):
                n += k
    return n


def _status_kib(key: str) -> int:
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith(key)).split()[1])


def _child(spec: dict) -> dict:
    """One measurement in this (fresh) process: ``spec`` = {kind: read|load, model, dtype, load_args,
    forward_tokens}. Returns the figures (seconds, bytes, KiB)."""
    model = Path(spec["model"])
    if spec["kind"] == "read":
        t = time.perf_counter()
        n = read_all(shard_files(model))
        return {"seconds": time.perf_counter() - t, "bytes": n,
                "peak_rss_kib": _status_kib("VmHWM:")}
    import torch
    import engine.checkpoint.loader as loader
    built = {"s": None}
    if hasattr(loader, "Transformer"):           # time the model's construction inside the load
        cls = loader.Transformer

        def timed(*a, **k):
            t0 = time.perf_counter()
            m = cls(*a, **k)
            built["s"] = time.perf_counter() - t0
            return m
        loader.Transformer = timed
    base = _status_kib("VmRSS:")
    t = time.perf_counter()
    m = loader.load_model(model, dtype=getattr(torch, spec["dtype"]), progress=False, **spec["load_args"])
    seconds = time.perf_counter() - t
    out = {"seconds": seconds, "construct_s": built["s"], "base_rss_kib": base,
           "peak_rss_kib": _status_kib("VmHWM:"), "threads": torch.get_num_threads(),
           "param_bytes": sum(p.numel() * p.element_size() for p in m.parameters()),
           "buffer_bytes": sum(b.numel() * b.element_size() for b in m.buffers())}
    if spec["forward_tokens"]:
        tokens = torch.randint(1000, 60000, (spec["forward_tokens"],), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            t = time.perf_counter()
            m.logits(m.forward(tokens, m.new_state())[-1:])
            out["forward_s"] = time.perf_counter() - t
        out["peak_rss_after_forward_kib"] = _status_kib("VmHWM:")
    return out


def run_child(spec: dict, timeout: float) -> dict:
    """``_child(spec)`` in a fresh interpreter. Raises RuntimeError with its stderr tail if it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "bench.bench_load", "--child", json.dumps(spec)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{spec['kind']} {spec.get('dtype', '')} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(model: Path, caches: list[str], dtypes: list[str], variants: list[dict], forward_tokens: int,
            repeat: int, timeout: float) -> list[dict]:
    """Rows: per cache mode, read / each load / read again, each run ``repeat`` times in a fresh
    subprocess; a row is the run with the median seconds."""
    files = shard_files(model)
    stored = sum(f.stat().st_size for f in files)
    rows = []
    for cache in caches:
        plan = [{"kind": "read", "what": "sequential read (before)"}]
        plan += [{"kind": "load", "dtype": DTYPES[d], "load_args": v, "what": f"load_model {d}" +
                  (" " + json.dumps(v, separators=(",", "=")).strip("{}").replace('"', "") if v else "")}
                 for v in variants for d in dtypes]
        plan += [{"kind": "read", "what": "sequential read (after)"}]
        for step in plan:
            spec = {"model": str(model), "forward_tokens": forward_tokens, "load_args": {}, **step}
            runs = []
            for _ in range(repeat):
                if cache == "cold":
                    evict(files)
                else:
                    read_all(files)
                runs.append(run_child(spec, timeout))
                print(f"  {cache:4s} {step['what']}: {runs[-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
            r = dict(sorted(runs, key=lambda x: x["seconds"])[len(runs) // 2])       # the median run
            r["all_seconds"] = [x["seconds"] for x in runs]
            rows.append({"cache": cache, **step, **r, "stored_bytes": stored, "mb_s": stored / 1e6 / r["seconds"]})
    return rows


def table(rows: list[dict], forward_tokens: int) -> str:
    """The markdown table: each load beside its mode's first sequential read."""
    mib = 1 / 1024
    cols = ["cache", "what", "seconds", "MB/s", "x disk read", "construct s", "peak RSS MiB", "base RSS MiB",
            "resident MiB", "peak / resident"] + ([f"forward {forward_tokens} tok s"] if forward_tokens else [])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    disk = {r["cache"]: r["mb_s"] for r in reversed(rows) if r["kind"] == "read"}   # the "before" read
    for r in rows:
        res = (r["param_bytes"] + r["buffer_bytes"]) / 2 ** 20 if r["kind"] == "load" else None
        cells = [r["cache"], r["what"], f"{r['seconds']:.2f}", f"{r['mb_s']:,.0f}", f"{r['mb_s'] / disk[r['cache']]:.3f}",
                 f"{r['construct_s']:.2f}" if r.get("construct_s") is not None else "",
                 f"{r['peak_rss_kib'] * mib:,.0f}", f"{r['base_rss_kib'] * mib:,.0f}" if "base_rss_kib" in r else "",
                 f"{res:,.0f}" if res else "", f"{r['peak_rss_kib'] * mib / res:.2f}" if res else ""]
        if forward_tokens:
            cells.append(f"{r['forward_s']:.2f}" if "forward_s" in r else "")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _git_head() -> str | None:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or None


def _load_args(p: argparse.ArgumentParser, raw: list[str]) -> list[dict]:
    from engine.checkpoint.loader import load_model
    accepted = set(inspect.signature(load_model).parameters) - {"ckpt_dir", "dtype", "progress"}
    variants = []
    for s in raw or ["{}"]:
        try:
            v = json.loads(s)
        except json.JSONDecodeError as e:
            p.error(f"--load-args {s!r}: not JSON ({e})")
        if not isinstance(v, dict) or set(v) - accepted:
            p.error(f"--load-args {s!r}: must be a JSON object with keys among {sorted(accepted)}")
        variants.append(v)
    return variants


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_load", description=__doc__.splitlines()[0])
    p.add_argument("--model", "--ckpt", dest="model", help="checkpoint directory")
    p.add_argument("--dtypes", default="fp32,bf16", help="compute dtypes to load in: fp32, bf16 (comma-separated)")
    p.add_argument("--cache", default="cold,warm", help="page-cache modes: cold, warm (comma-separated)")
    p.add_argument("--load-args", action="append", metavar="JSON", help="keyword arguments for load_model; repeat "
                   "for several variants (default: none)")
    p.add_argument("--forward-tokens", type=int, default=0, help="also time one forward of N tokens after each load")
    p.add_argument("--repeat", type=int, default=1, help="runs per row (the median run is shown)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per subprocess")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "load.json"), help="JSON results file")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the markdown table")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return 0
    if not a.model or not shard_files(Path(a.model)):
        p.error(f"--model {a.model}: not a directory with *.safetensors files")
    dtypes, caches = a.dtypes.split(","), a.cache.split(",")
    if set(dtypes) - set(DTYPES) or set(caches) - {"cold", "warm"} or a.forward_tokens < 0 or a.repeat < 1:
        p.error("--dtypes takes fp32,bf16; --cache takes cold,warm; --forward-tokens >= 0; --repeat >= 1")
    model = Path(a.model).resolve()
    rows = measure(model, caches, dtypes, _load_args(p, a.load_args), a.forward_tokens, a.repeat, a.timeout)
    result = {"model": str(model), "git": _git_head(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30},
              "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        stored = rows[0]["stored_bytes"]
        print(f"{model} ({len(shard_files(model))} shard files, {stored / 1e9:.3f} GB), git {result['git']}, "
              f"{os.cpu_count()} CPUs, {result['machine']['ram_gib']:.0f} GiB RAM, {result['date']}\n")
        print(table(rows, a.forward_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
