"""``launch-pd`` as a user runs it: bad flags and configs exit 2 naming them; ``--role local``
serves a request, and SIGTERM stops all three processes with status 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.launch.local import free_port

LAUNCH = [sys.executable, "-m", "server.launch.cli"]


def _children(pid: int) -> list[int]:
    """Live child pids of ``pid`` (from /proc: field 4 of /proc/N/stat is the parent)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _run(args, **kw):
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("args,needle", [
    (["--role", "prefill"], "--config is required"),
    (["--role", "decode", "--config", "configs/tiny-flash.yaml", "--port", "70000"], "--port"),
    (["--role", "prefill", "--config", "configs/nope.yaml"], "nope.yaml"),
    (["--role", "prefill", "--config", "configs/tiny-flash.yaml", "--model", "/nonexistent"], "model_path"),
    (["--role", "gateway", "--model", "/nonexistent"], "--model"),
    (["--role", "gateway", "--model", ".", "--prefill-addrs", "host:notaport"], "--prefill-addrs"),
    (["--role", "router"], "--role"),
    (["--role", "prefill", "--config", "configs/tiny-flash.yaml", "--transport", "rdma"], "--transport"),
    (["--role", "prefill", "--config", "configs/tiny-flash.yaml", "--log-level", "bogus"], "--log-level"),
    (["--role", "prefill", "--config", "configs/tiny-flash.yaml", "--device", "bogus"], "--device"),
    (["--role", "gateway", "--model", ".", "--worker-timeout-s", "0"], "--worker-timeout-s"),
    (["--role", "gateway", "--model", ".", "--max-pending", "0"], "--max-pending"),
])
def test_bad_flags_exit_2_naming_them(args, needle):
    r = _run(args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_bad_config_key_exits_2_naming_it(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(open("configs/tiny-flash.yaml").read().replace("block_size: 128", "block_sise: 128"))
    r = _run(["--role", "decode", "--config", str(bad)])
    assert r.returncode == 2 and "scheduler_config.block_sise" in r.stderr and "Traceback" not in r.stderr


def test_port_in_use_exits_2(tiny_ckpt):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run(["--role", "prefill", "--config", "configs/tiny-flash.yaml", "--model", str(tiny_ckpt("flash", 1)),
                  "--port", str(port), "--http-port", "0"])
    assert r.returncode == 2 and "cannot start the prefill worker" in r.stderr


def test_local_role_serves_and_a_terminal_ctrl_c_lets_streams_finish(tiny_ckpt):
    """Ctrl-C in a terminal is SIGINT to the launcher's whole process group: the children run in
    their own groups, so only the launcher gets it and drains them once (a stream in flight gets
    all its tokens); the launcher and its two children (one unified worker and the gateway) exit
    0. Also: --api-key reaches the gateway child (by environment, not argv)."""
    port = free_port()
    p = subprocess.Popen(LAUNCH + ["--role", "local", "--config", "configs/tiny-flash.yaml", "--model",
                                   str(tiny_ckpt("flash", 1)), "--port", str(port), "--api-key", "sk-local-123",
                                   # the drain outlasts 46 tokens on a loaded 2-core CI box, where two
                                   # OpenMP threads against other processes take up to ~1 s a token
                                   "--drain-timeout-s", "120"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 300
        while time.monotonic() < end:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.3)
        body = {"model": "deepseek_v4", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, timeout=120,
                       headers={"Authorization": "bearer sk-local-123"})        # the scheme is case-insensitive
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert not [c for c in _children(p.pid) if "sk-local-123" in Path(f"/proc/{c}/cmdline").read_text()]
        children = _children(p.pid)
        assert len(children) == 2                 # one unified worker (prefill + decode in one engine) + gateway
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["healthy_prefill"] == health["healthy_decode"] and len(health["healthy_decode"]) == 1
        body = {**body, "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True}}
        chunks, usage = 0, None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer sk-local-123"}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    chunks += 1
                    if chunks == 2:
                        os.killpg(p.pid, signal.SIGINT)
        assert usage is not None and usage["completion_tokens"] == 48      # the stream was not cut
        assert p.wait(60) == 0
        assert not [c for c in children if Path(f"/proc/{c}").exists()]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("args,env,needle", [
    (["--role", "decode", "--config", "configs/tiny-flash.yaml"], {"DSV4_TRANSPORT": "zmq"}, "DSV4_TRANSPORT"),
    (["--role", "decode", "--config", "configs/tiny-flash.yaml", "--lease-s", "-5"], {}, "--lease-s"),
])
def test_bad_environment_and_values_exit_2(args, env, needle):
    import os
    r = _run(args, env={**os.environ, **env})
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_http_port_and_local_port_in_use_exit_2(tiny_ckpt):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _run(["--role", "prefill", "--config", "configs/tiny-flash.yaml", "--model", str(tiny_ckpt("flash", 1)),
                  "--port", str(free_port()), "--http-port", str(port)])
        assert r.returncode == 2 and "--http-port" in r.stderr, r.stderr
        r = _run(["--role", "local", "--config", "configs/tiny-flash.yaml", "--model", str(tiny_ckpt("flash", 1)),
                  "--port", str(port)])
        assert r.returncode == 2 and "--port" in r.stderr and "not free" in r.stderr, r.stderr


def test_gateway_api_key(tiny_ckpt):
    """--api-key: /v1/* answer 401 in OpenAI's shape without the key, and serve with it."""
    port = free_port()
    p = subprocess.Popen(LAUNCH + ["--role", "gateway", "--model", str(tiny_ckpt("flash", 1)), "--port", str(port),
                                   "--prefill-addrs", f"127.0.0.1:{free_port()}",
                                   "--decode-addrs", f"127.0.0.1:{free_port()}", "--api-key", "s3cret"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1/models"
    try:
        end = time.monotonic() + 120
        while True:
            try:
                r = httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < end and p.poll() is None
                time.sleep(0.3)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(url, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503   # no workers: not healthy
    finally:
        p.terminate()
        p.wait(30)


def test_one_served_model_name_and_the_thinking_default(monkeypatch):
    """Without a config the gateway serves the name the shipped configs and the workers use; the
    default thinking mode comes from --default-thinking or DSV4_DEFAULT_THINKING."""
    from engine.run_config import DEFAULT_MODEL_NAME, ModelConfig, RunConfig
    from server.launch.flags import model_name as _model_name, parser
    args = parser().parse_args(["--role", "gateway"])
    assert _model_name(args, None) == DEFAULT_MODEL_NAME == ModelConfig().model_name == "deepseek_v4"
    assert _model_name(args, RunConfig.from_yaml("configs/tiny-flash.yaml")) == "deepseek_v4"
    assert _model_name(parser().parse_args(["--role", "gateway", "--served-model-name", "x"]), None) == "x"
    assert args.default_thinking == "enabled"
    monkeypatch.setenv("DSV4_DEFAULT_THINKING", "disabled")
    assert parser().parse_args(["--role", "gateway"]).default_thinking == "disabled"
    with pytest.raises(SystemExit):
        parser().parse_args(["--role", "gateway", "--default-thinking", "maybe"])
