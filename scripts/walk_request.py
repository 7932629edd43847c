"""Walk one streamed chat request through the house: which project files and functions it touches.

    .venv/bin/python scripts/walk_request.py [--repo DIR] [--json OUT]

Starts ``launch-pd --role local`` (prefill + decode + gateway as three processes) from ``--repo``
(default: this checkout) on the bundled tiny checkpoint with a call profiler in every process
(``sys.setprofile`` + ``threading.setprofile``, installed through a ``sitecustomize`` on
PYTHONPATH), sends one streamed chat request to warm up, then times a second one and keeps the
calls made while it ran (wall clock, all processes). Prints the files in the order the request
first reaches them, and counts:

* files / functions: distinct project files and (file, function) pairs called;
* hops: distinct (caller file, callee file) pairs with caller != callee;
* back-ups: hops from a lower layer to a higher one, layers ranked server (4) > kvtransfer (3) >
  the rest of engine (2) > engine/model (1) > engine/ops (0): a call that climbs back up the house.

Works on any checkout of this project (run it from today's tree with ``--repo`` at an old commit to
compare). Idle loops (health checks, polling) that ran during the request are counted too.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvtransfer", "server")

PROFILER = '''
import atexit, json, os, sys, threading, time
_ROOT = os.environ["DSV4_WALK_ROOT"].rstrip("/") + "/"
_PKGS = tuple(_ROOT + p + "/" for p in ("engine", "kvtransfer", "server"))
_OUT = os.path.join(os.environ["DSV4_WALK_OUT"], f"{os.getpid()}.jsonl")
_buf = []

def _rel(f):
    return f[len(_ROOT):] if f.startswith(_PKGS) else None

def _prof(frame, event, arg):
    if event != "call":
        return
    callee = _rel(frame.f_code.co_filename)
    if callee is None:
        return
    back = frame.f_back
    while back is not None and _rel(back.f_code.co_filename) is None:
        back = back.f_back
    caller = _rel(back.f_code.co_filename) if back is not None else None
    _buf.append((time.time(), callee, frame.f_code.co_qualname, caller))
    if len(_buf) >= 20000:
        _flush()

def _flush():
    global _buf
    rows, _buf = _buf, []
    with open(_OUT, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\\n")

def _ticker():
    while True:
        time.sleep(0.5)
        _flush()

atexit.register(_flush)
threading.Thread(target=_ticker, daemon=True).start()
sys.setprofile(_prof)
threading.setprofile(_prof)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(base: str, text: str) -> None:
    body = {"model": "deepseek_v4", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": text}]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass


def _wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"walk_request: launch-pd exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                _chat(base, "warm up")
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("walk_request: the gateway did not answer in time")


def _cli_module(repo: Path) -> str:
    for line in (repo / "pyproject.toml").read_text().splitlines():
        if line.strip().startswith("launch-pd"):
            return line.split("=", 1)[1].strip().strip('"').split(":")[0]
    raise SystemExit("walk_request: no launch-pd entry point in pyproject.toml")


def _layer(path: str) -> int:
    if path.startswith("server/"):
        return 4
    if path.startswith("kvtransfer/"):
        return 3
    if path.startswith("engine/ops/"):
        return 0
    if path.startswith("engine/model/"):
        return 1
    return 2


def record(repo: Path, out_dir: Path) -> tuple[float, float]:
    """Run the request under the profiler; returns its (start, end) wall-clock time."""
    (out_dir / "sitecustomize.py").write_text(PROFILER)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{out_dir}", "DSV4_WALK_ROOT": str(repo),
           "DSV4_WALK_OUT": str(out_dir)}
    cmd = [sys.executable, "-m", _cli_module(repo), "--role", "local", "--config", "configs/tiny-flash.yaml",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        time.sleep(1.0)
        t0 = time.time()
        _chat(base, "Walk this request through the house.")
        t1 = time.time()
        time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return t0, t1


def summarise(out_dir: Path, t0: float, t1: float) -> dict:
    rows = []
    for f in out_dir.glob("*.jsonl"):
        rows += [tuple(r) for r in map(json.loads, f.read_text().splitlines()) if t0 <= r[0] <= t1]
    rows.sort()
    files = list(dict.fromkeys(r[1] for r in rows))
    hops = sorted({(r[3], r[1]) for r in rows if r[3] and r[3] != r[1]})
    ups = [h for h in hops if _layer(h[0]) < _layer(h[1])]
    return {"calls": len(rows), "files": files, "functions": len({(r[1], r[2]) for r in rows}),
            "hops": len(hops), "back_ups": [f"{a} -> {b}" for a, b in ups]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(HERE), help="checkout to run (default: this one)")
    p.add_argument("--json", help="write the summary here too")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        t0, t1 = record(Path(a.repo).resolve(), Path(d))
        res = summarise(Path(d), t0, t1)
    print(f"{len(res['files'])} files, {res['functions']} functions, {res['hops']} file-to-file hops, "
          f"{len(res['back_ups'])} back-ups, {res['calls']} calls ({t1 - t0:.2f} s)")
    print("files in the order the request reaches them:")
    for i, f in enumerate(res["files"], 1):
        print(f"  {i:3d} {f}")
    print("back-ups (a lower layer calling a higher one):")
    for b in res["back_ups"]:
        print(f"      {b}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
