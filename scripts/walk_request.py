"""Walk one streamed chat request through the real stack: the project files and hops it goes through.

    .venv/bin/python scripts/walk_request.py [--repo DIR] [--model DIR] [--max-tokens 4] [--json OUT]

Starts ``launch-pd --role local --pd-split`` (launcher, prefill, decode and gateway processes) from ``--repo``
(default: this checkout) on configs/tiny-flash.yaml and the bundled tiny checkpoint (``--model``,
else ``dsv4-make-tiny --preset flash --seed 0`` into a temp dir, about 10 s), with
``scripts/walk_tracer.py`` as every process's ``sitecustomize`` (the project needs no hook, so an
old checkout walks as it is). After a warm-up request it switches the recorders on (a marker file),
sends one chat request with the ``openai`` SDK (stream=True, temperature 0, seed 0), switches them
off ``GRACE_S`` after the stream ends, and prints per process (gateway, prefill, decode):

* calls: calls into project files (engine/, kvtransfer/, server/), resumed coroutines included;
* files: the distinct project files entered, listed in the order first entered;
* hops: calls whose caller (the nearest project frame) is in another project file; ``edges``:
  the distinct (caller file, callee file) pairs among them; ``entries``: calls with no project
  caller (a thread's first frame, a coroutine resumed by the event loop);
* back-ups: edges from a lower layer to a higher one, layers ranked server > kvtransfer > the
  rest of engine > engine/model > engine/ops;

and the same for one decode engine step (``--step``, default ``LLMEngine.step``): the middle one
of those the decode worker ran for the request. Step figures repeat exactly from run to run;
process totals also count the worker loops' idle turns and periodic probes while the request ran,
so they move by a few percent (files and edges by one or two, a probe that fell in the window or
not). ``--json`` also keeps every edge, to diff two walks. About 30 s on 2 cores (15 s of it
writing the tiny checkpoint, which ``--model`` skips).

Exits 1 if the stack does not come up (its log tail is printed) or a process's record is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parents[1]
STEP = "engine/core/llm_engine.py:LLMEngine.step"
GRACE_S = 0.1           # after the stream's end: the workers' last replies and frees are part of it
SETTLE_S = 0.05         # after the marker appears: ten poll periods of the recorders
PROMPT = "Walk this request through the house."
WARM_UP = "Warm up the house first."
LAYERS = (("server/", 4), ("kvtransfer/", 3), ("engine/ops/", 0), ("engine/model/", 1), ("engine/", 2))


class WalkError(RuntimeError):
    """The stack did not start, did not answer, or a process's record did not arrive."""


def _entry_module(repo: Path, script: str) -> str:
    for line in (repo / "pyproject.toml").read_text().splitlines():
        if line.strip().startswith(script + " ") or line.strip().startswith(script + "="):
            return line.split("=", 1)[1].strip().strip('"').split(":")[0]
    raise WalkError(f"no {script} entry point in {repo}/pyproject.toml")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layer(path: str) -> int:
    """The layer rank of a project file (server 4 ... engine/ops 0)."""
    return next(rank for prefix, rank in LAYERS if path.startswith(prefix))


def summarise(events: list[list]) -> dict:
    """Figures of one process (or one step) from its events ``[thread, callee, qualname, caller, step]``."""
    hops = [(e[3], e[1]) for e in events if e[3] is not None and e[3] != e[1]]
    edges = sorted(set(hops))
    return {"calls": len(events), "files": list(dict.fromkeys(e[1] for e in events)), "hops": len(hops),
            "edges": len(edges), "entries": sum(e[3] is None for e in events),
            "back_ups": [f"{a} -> {b}" for a, b in edges if layer(a) < layer(b)],
            "edge_list": [f"{a} -> {b}" for a, b in edges]}


def role_of(argv: list[str]) -> str:
    """``launch-pd``'s ``--role`` in a process's argv ("launcher" for ``--role local``)."""
    for i, a in enumerate(argv):
        if a == "--role" and i + 1 < len(argv):
            return "launcher" if argv[i + 1] == "local" else argv[i + 1]
        if a.startswith("--role="):
            return "launcher" if a == "--role=local" else a.split("=", 1)[1]
    return "other"


def report(records: list[dict]) -> dict:
    """Per role: ``summarise`` of its events; for decode also ``step`` (the middle engine step's
    figures, with ``index`` and ``of``) and ``step_hops`` (every step's hop count, in order). A
    second process of a role is ``<role>2`` (and so on), in pid order."""
    out: dict[str, dict] = {}
    for rec in records:
        role = name = role_of(rec["argv"])
        n = 1
        while name in out:
            n += 1
            name = f"{role}{n}"
        out[name] = res = summarise(rec["events"])
        steps = sorted({e[4] for e in rec["events"] if e[4] >= 0})
        if steps:
            per = [summarise([e for e in rec["events"] if e[4] == s]) for s in steps]
            mid = len(per) // 2
            res["step"] = {**per[mid], "index": mid + 1, "of": len(per)}
            res["step_hops"] = [p["hops"] for p in per]
    return out


def _chat(base: str, text: str, max_tokens: int) -> int:
    """One streamed chat completion; returns the chunks received."""
    from openai import OpenAI
    client = OpenAI(base_url=f"{base}/v1", api_key="walk", max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="deepseek_v4", messages=[{"role": "user", "content": text}],
                                            stream=True, max_tokens=max_tokens, temperature=0, seed=0)
    return sum(1 for _ in stream)


def _wait_up(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
    raise WalkError(f"the stack did not come up in {timeout_s:g} s (launcher status {proc.poll()}):\n{tail}")


def _collect(out: Path, timeout_s: float = 20.0) -> list[dict]:
    """The records of every process that registered and still runs (or wrote one)."""
    end = time.monotonic() + timeout_s
    while True:
        pids = [int(p.name.split(".")[0]) for p in out.glob("*.argv.json")]
        missing = [p for p in pids if not (out / f"{p}.json").exists() and Path(f"/proc/{p}").exists()]
        if not missing:
            return [json.loads((out / f"{p}.json").read_text()) for p in sorted(pids) if (out / f"{p}.json").exists()]
        if time.monotonic() > end:
            raise WalkError(f"no record from process(es) {missing} within {timeout_s:g} s")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    # the launcher drains its children on SIGTERM; they also get SIGTERM if it dies (PDEATHSIG)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def walk(repo: Path, model: Path | None, config: str, max_tokens: int, step: str, work: Path) -> dict:
    """Run the walk in ``work`` (a scratch dir); returns ``report``'s dict plus ``request``
    (seconds, chunks). Raises WalkError (see the module docstring)."""
    py = sys.executable
    if model is None:
        model = work / "tiny-flash"
        subprocess.run([py, "-m", _entry_module(repo, "dsv4-make-tiny"), "--preset", "flash", "--seed", "0",
                        "--out", str(model)], cwd=repo, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    site, out = work / "site", work / "records"
    site.mkdir()
    out.mkdir()
    shutil.copy(Path(__file__).with_name("walk_tracer.py"), site / "sitecustomize.py")
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{site}", "DSV4_WALK_ROOT": str(repo),
           "DSV4_WALK_OUT": str(out), "DSV4_WALK_STEP": step}
    port, log = _free_port(), work / "stack.log"
    cmd = [py, "-m", _entry_module(repo, "launch-pd"), "--role", "local", "--config", config,
           "--model", str(model), "--port", str(port)]
    flags = repo / "server/launch/flags.py"
    if flags.is_file() and "--pd-split" in flags.read_text():     # the P/D path (where one engine is the default)
        cmd.append("--pd-split")
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_up(base, proc, log, 120)
        _chat(base, WARM_UP, max_tokens)
        (out / "on").touch()
        time.sleep(SETTLE_S)
        t0 = time.monotonic()
        chunks = _chat(base, PROMPT, max_tokens)
        seconds = time.monotonic() - t0
        time.sleep(GRACE_S)
        (out / "on").unlink()
        res = report(_collect(out))
    finally:
        _stop(proc)
    res["request"] = {"seconds": round(seconds, 3), "chunks": chunks, "max_tokens": max_tokens}
    return res


def render(res: dict, step: str) -> str:
    """The printed report: a table per process and the decode step, then each one's files."""
    req = res["request"]
    rows = [f"one streamed chat request: max_tokens {req['max_tokens']}, temperature 0, seed 0; "
            f"{req['chunks']} chunks in {req['seconds']:.2f} s",
            f"{'':34} {'calls':>7} {'files':>5} {'hops':>6} {'edges':>5} {'entries':>7} {'back-ups':>8}"]
    shown = [(r, res[r]) for r in ("gateway", "prefill", "decode") if r in res]
    if "decode" in res and "step" in res["decode"]:
        s = res["decode"]["step"]
        shown.append((f"decode step {s['index']} of {s['of']} ({step.split(':')[-1]})", s))
    for name, s in shown:
        rows.append(f"{name:34} {s['calls']:7d} {len(s['files']):5d} {s['hops']:6d} {s['edges']:5d} "
                    f"{s['entries']:7d} {len(s['back_ups']):8d}")
    if "decode" in res and "step_hops" in res["decode"]:
        rows.append(f"hops of each decode step: {res['decode']['step_hops']}")
    for name, s in shown:
        rows.append(f"\n{name}: files in the order first entered")
        rows += [f"  {i:3d} {f}" for i, f in enumerate(s["files"], 1)]
        rows += [f"      back-up: {b}" for b in s["back_ups"]]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(HERE), help="checkout to run (default: this one)")
    p.add_argument("--model", help="tiny checkpoint dir (default: dsv4-make-tiny --preset flash --seed 0)")
    p.add_argument("--config", default="configs/tiny-flash.yaml", help="run config, relative to --repo")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--step", default=STEP, help="the engine step, file:qualname (default: %(default)s)")
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="walk-") as d:
        try:
            res = walk(Path(a.repo).resolve(), Path(a.model).resolve() if a.model else None, a.config,
                       a.max_tokens, a.step, Path(d))
        except WalkError as e:
            print(f"walk_request: {e}", file=sys.stderr)
            return 1
    print(render(res, a.step))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
