"""``LocalPD``: prefill, decode and gateway processes on this machine (loopback, free ports).

What ``launch-pd --role local``, the quickstart demo, the end-to-end tests and the serving
benchmark start: real ``launch-pd`` processes, each instance on its own ports.
"""
from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def term_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, so a killed launcher leaves
    no orphan workers (they drain and exit)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a process started later to bind. Chosen below the
    kernel's ephemeral range where it can be: an outgoing connection opened meanwhile (rank
    rendezvous, gloo, ZMQ) takes its local port from that range and would steal a port picked
    there, which the worker then fails to bind. Not handed out twice by this process."""
    hi = _ephemeral_low() - 1
    lo = max(1024, hi - 12000)
    for _ in range(200) if hi > lo else ():
        port = random.randint(lo, hi)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_processes(procs, timeout_s: float) -> None:
    """SIGTERM every process still running, wait up to ``timeout_s`` each, then SIGKILL."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _rank_ports() -> list[str]:
    return ["--master-port", str(free_port()), "--rank-port", str(free_port())]


class LocalPD:
    """``num_prefill`` prefill and ``num_decode`` decode workers, ``num_unified`` unified workers
    (``server.workers.unified``: prefill and decode in one engine; each listed to the gateway as
    both), plus one gateway.

    ``extra_args``: flags per role ("prefill", "decode", "gateway") and per instance ("decode1"),
    the latter last (so an instance's ``--config`` wins). Every worker gets its own free
    ``--master-port`` / ``--rank-port`` (a multi-rank instance's rendezvous and step channel).
    Attributes (after ``start``): ``base_url`` (gateway), ``metrics_urls`` {name: url} and
    ``ready_urls`` {name: url} of every process. Raises RuntimeError if a process exits or the
    gateway is not up (``start``'s ``up``) within ``timeout_s``.
    """

    def __init__(self, config: str, model: str, num_prefill: int = 1, num_decode: int = 1,
                 num_unified: int = 0, transport: str = "zmq-tcp", log_path: str | None = None,
                 gateway_port: int | None = None,
                 extra_args: dict[str, list[str]] | None = None, host: str = "127.0.0.1",
                 cluster_secret: str | None = None):
        self.host = host
        self.env = dict(os.environ)
        self.env.pop("DSV4_CLUSTER_SECRET", None)
        if cluster_secret is not None:                # children read it from the environment (not argv)
            self.env["DSV4_CLUSTER_SECRET"] = cluster_secret
        self.headers = {"Authorization": f"Bearer {cluster_secret}"} if cluster_secret else {}
        launch = [sys.executable, "-m", "server.launch.cli", "--config", config, "--model", model, "--host", host,
                  "--transport", transport]
        extra = {k: list(v) for k, v in (extra_args or {}).items()}
        # workers share this machine's cores (oversubscribed OpenMP threads spin and stall each other)
        threads = str(max(1, (os.cpu_count() or 1) // max(1, num_prefill + num_decode + num_unified)))
        for role in ("prefill", "decode", "unified"):
            if "--cpu-threads" not in extra.get(role, []):
                extra.setdefault(role, []).extend(["--cpu-threads", threads])
        self.cmds: dict[str, list[str]] = {}
        self.metrics_urls: dict[str, str] = {}
        self.ready_urls: dict[str, str] = {}
        pre, dec = [], []
        if gateway_port:                              # a port the caller chose is never handed to a worker
            _handed_out.add(int(gateway_port))
        for i in range(num_prefill):
            zp, hp = free_port(), free_port()
            self.cmds[f"prefill{i}"] = launch + ["--role", "prefill", "--port", str(zp), "--http-port", str(hp)] \
                + _rank_ports() + extra.get("prefill", []) + extra.get(f"prefill{i}", [])
            pre.append(f"{host}:{zp}")
            self._http(f"prefill{i}", hp)
        for i in range(num_decode):
            zp, sp, hp = free_port(), free_port(), free_port()
            self.cmds[f"decode{i}"] = launch + ["--role", "decode", "--port", str(zp), "--state-port", str(sp),
                                                "--http-port", str(hp)] + _rank_ports() + extra.get("decode", []) \
                + extra.get(f"decode{i}", [])
            dec.append(f"{host}:{zp}")
            self._http(f"decode{i}", hp)
        for i in range(num_unified):
            zp, hp = free_port(), free_port()
            self.cmds[f"unified{i}"] = launch + ["--role", "unified", "--port", str(zp), "--http-port", str(hp)] \
                + _rank_ports() + extra.get("unified", []) + extra.get(f"unified{i}", [])
            pre.append(f"{host}:{zp}")
            dec.append(f"{host}:{zp}")
            self._http(f"unified{i}", hp)
        gp = gateway_port or free_port()
        self.cmds["gateway"] = launch + ["--role", "gateway", "--port", str(gp), "--prefill-addrs", ",".join(pre),
                                         "--decode-addrs", ",".join(dec)] + extra.get("gateway", [])
        self.base_url = f"http://{host}:{gp}"
        self.metrics_urls["gateway"] = self.base_url + "/metrics"
        self.log_path = log_path
        self.procs: dict[str, subprocess.Popen] = {}

    def _http(self, name: str, port: int) -> None:
        self.metrics_urls[name] = f"http://{self.host}:{port}/metrics"
        self.ready_urls[name] = f"http://{self.host}:{port}/ready"

    def start(self, timeout_s: float = 600.0, up=None) -> "LocalPD":
        """Start every process; return once ``up(response of the gateway's /health)`` is true
        (default: status 200, i.e. some prefill pairs with some decode)."""
        up = up or (lambda r: r.status_code == 200)
        out = open(self.log_path, "w") if self.log_path else None
        self._log = out
        for name, cmd in self.cmds.items():
            # a process group of their own: a terminal's Ctrl-C reaches only the launcher, whose one
            # SIGTERM drains them (a SIGINT as well would be the "second signal": exit at once)
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                                env=self.env, preexec_fn=term_with_parent, process_group=0)
        end = time.monotonic() + timeout_s
        while True:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                self.stop()
                raise RuntimeError(f"the {dead[0]} process exited with {self.procs[dead[0]].returncode}"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                if up(httpx.get(self.base_url + "/health", timeout=2)):
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"the gateway was not up within {timeout_s:g} s")
            time.sleep(0.2)

    def signal(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a process (fault tests: SIGKILL, SIGSTOP, SIGCONT, SIGTERM); SIGKILL waits."""
        p = self.procs[name]
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait()

    def restart(self, name: str) -> None:
        """Start ``name`` again with the same command (same ports) after it exited."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self.procs[name] = subprocess.Popen(self.cmds[name], stdout=self._log,
                                            stderr=subprocess.STDOUT if self._log else None,
                                            env=self.env, preexec_fn=term_with_parent, process_group=0)

    def ready(self, name: str) -> dict:
        """A worker's /ready body (its load: running, reserved, free_blocks, ...)."""
        return httpx.get(self.ready_urls[name], timeout=5, headers=self.headers).json()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def wait(self) -> int:
        """Block until a process exits (returns its code) or KeyboardInterrupt."""
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    return p.returncode
            time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process (they drain), SIGKILL what still runs ``timeout_s`` later."""
        stop_processes(self.procs.values(), timeout_s)
        if getattr(self, "_log", None):
            self._log.close()
            self._log = None

    def __enter__(self) -> "LocalPD":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: str | Path, n: int = 20) -> str:
    try:
        return "".join(Path(path).read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""
