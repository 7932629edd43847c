"""The gateway process never loads torch (DESIGN: the gateway does text work only; workers own the
accelerator). Checked twice: a fresh interpreter that imports every module the gateway process runs,
and a live ``launch-pd --role gateway`` (started with ``--model`` only, and with ``--config`` only)
whose memory maps must hold no torch library after it has served requests."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from server.launch.local import free_port

LAUNCH = [sys.executable, "-m", "server.launch.cli"]
# what ``launch-pd --role gateway`` imports: the launcher, every gateway module, the P/D backend and
# the worker protocol it speaks (server/backends/local.py runs an engine in-process: not here)
GATEWAY_MODULES = ["server.launch.cli", "server.launch.flags", "server.launch.roles", "server.backends.base",
                   "server.backends.instances", "server.backends.leg", "server.backends.links",
                   "server.backends.pd", "server.protocol", "server.heartbeat", "server.metrics",
                   "kvtransfer.compat", "engine.tokenizer", "engine.run_config"] + sorted(
    f"server.gateway.{p.stem}" for p in Path("server/gateway").glob("*.py") if p.stem != "__init__")


def _torch_maps(pid: int) -> list[str]:
    """Paths of torch's shared libraries mapped into process ``pid`` (libtorch*, torch/_C*)."""
    paths = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in line}
    return sorted(p for p in paths if "libtorch" in p or "/torch/" in p)


def test_importing_the_gateway_modules_imports_no_torch():
    code = ("import importlib, sys\n"
            f"for m in {GATEWAY_MODULES!r}:\n"
            "    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, m + ' imported torch'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("how", ["model", "config"])
def test_a_live_gateway_process_has_no_torch_loaded(how, ckpt, tmp_path):
    if how == "model":
        args = ["--model", ckpt]
    else:
        run = yaml.safe_load(Path("configs/tiny-flash.yaml").read_text())
        run["model_config"]["model_path"] = ckpt
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(run))
        args = ["--config", str(config)]
    port = free_port()
    # workers that are not there: the gateway serves HTTP anyway (503 for generation, after a
    # short grace for an instance to come up)
    cmd = LAUNCH + ["--role", "gateway", *args, "--port", str(port), "--prefill-addrs", f"127.0.0.1:{free_port()}",
                    "--decode-addrs", f"127.0.0.1:{free_port()}", "--reconnect-grace-s", "0.5"]
    with open(tmp_path / "gateway.log", "w") as log:
        gw = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            assert gw.poll() is None, f"the gateway exited with status {gw.returncode}"
            try:
                httpx.get(base + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < end, "the gateway did not answer /health within 60 s"
                time.sleep(0.2)
        # the request path as far as it goes without workers: parse, render through DeepSeek's
        # format library, tokenise, route (no healthy instance: 503)
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 200
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
        chat = {"model": "deepseek_v4", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(base + "/v1/messages/count_tokens", json=chat, timeout=30)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
        r = httpx.post(base + "/v1/completions", json={"model": "deepseek_v4", "prompt": "hi", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 503, r.text
        # no worker answered yet, so the context length is unknown: still 503, never a 500
        for path, body in (("/v1/chat/completions", chat), ("/v1/messages", {**chat, "max_tokens": 8}),
                           ("/v1/responses", {"model": "deepseek_v4", "input": "hi"})):
            r = httpx.post(base + path, json=body, timeout=30)
            assert r.status_code == 503, (path, r.text)
        assert gw.poll() is None
        assert _torch_maps(gw.pid) == []
    finally:
        gw.terminate()
        gw.wait(30)
