"""deploy/ and configs/: shipped YAMLs validate, infer.sh maps upstream flags onto launch-pd /
dsv4-offline (checked with --dry-run and a stand-in launch-pd), Prometheus / Grafana files parse and
name only metrics that server/metrics.py exports."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from engine.config import ConfigError
from engine.run_config import RunConfig
from server.metrics import GatewayMetrics, WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
INFER = DEPLOY / "infer.sh"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# variables set_env.sh / infer.sh read: cleared so the defaults apply
_OURS = re.compile(r"^(PREFILL_|DECODE_|ROUTER_|DSV4_|IPs$|MASTER_|HCCL_|GLOO_|DEVICES_PER_NODE$|CANN_PATH$)")


# ---- configs/ ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads(path):
    cfg = RunConfig.from_yaml(path)                  # model_path need not exist to load
    assert cfg.model_config.model_name == "deepseek_v4"
    assert cfg.scheduler_config.batch_size % cfg.parallel_config.attn_dp_size == 0


def test_platform_configs():
    a3 = RunConfig.from_yaml(ROOT / "configs/deepseek-v4-flash-a3-w8a8-16rank.yaml")
    pro = RunConfig.from_yaml(ROOT / "configs/deepseek-v4-pro-950-16rank.yaml")
    for cfg, plat in ((a3, "A3"), (pro, "950")):
        m, p = cfg.model_config, cfg.parallel_config
        assert (m.platform_version, m.exe_mode, p.world_size, p.attn_dp_size, p.moe_ep_size) == (
            plat, "npugraph_ex", 16, 16, 16)
        assert m.custom_params.enable_multi_streams and not m.custom_params.enable_limit_core
        assert m.model_path.startswith("/data/models/")
    assert a3.model_config.next_n == 1 and a3.parallel_config.lmhead_tp_size == 4 and a3.batch_size_per_dp_rank == 16
    assert pro.model_config.next_n == 3 and not pro.model_config.enable_weight_nz
    assert pro.model_config.custom_params.moe_chunk_max_len == 4096


@pytest.mark.parametrize("key, value, message", [
    ("scheduler_config.blok_size", 128, "scheduler_config.blok_size: unknown key"),
    ("model_config.exe_mode", 1, "model_config.exe_mode: must be a string"),
    ("scheduler_config.batch_size", "16", "scheduler_config.batch_size: must be an integer"),
    ("model_config.custom_params.enable_multi_streams", False,
     "model_config.custom_params.enable_limit_core: needs model_config.custom_params.enable_multi_streams"),
    ("model_config.platform_version", "950", "model_config.custom_params.enable_limit_core: A3 only"),
    ("parallel_config.cp_size", 16, "scheduler_config.cp_mini_batch: must be 1 with context parallelism"),
    ("model_config.exe_mode", "eager", "model_config.enable_static_kernel: needs exe_mode 'npugraph_ex'"),
])
def test_bad_yaml_names_the_key(tmp_path, key, value, message):
    raw = yaml.safe_load((ROOT / "configs/deepseek-v4-flash-a3-decode.yaml").read_text())
    *parents, leaf = key.split(".")
    node = raw
    for k in parents:
        node = node[k]
    node[leaf] = value
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        RunConfig.from_yaml(f)
    assert str(e.value).startswith(f"{f}: ") and message in str(e.value)


# ---- shell scripts ----------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["set_env.sh", "infer.sh", "device-check"])
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", str(DEPLOY / script)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", "-x", f"deploy/{script}"], cwd=ROOT, check=True, timeout=60)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _OURS.match(k)}
    env.update({"DSV4_PYTHON": sys.executable, "DSV4_LOCAL_IP": "192.0.2.10", **extra})
    return env


def _infer(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INFER), *args], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=60)


def _dry(*args: str, **env: str) -> list[tuple[list[str], bool]]:
    """The commands --dry-run prints: (argv, in the background)."""
    r = _infer(*args, "--dry-run", **env)
    assert r.returncode == 0, r.stderr
    out = []
    for line in r.stdout.splitlines():
        assert line.startswith("[dry-run] "), line
        line = line[len("[dry-run] "):]
        if not line.startswith("env "):
            out.append((shlex.split(line.removesuffix(" &")), line.endswith(" &")))
    return out


def _flags(argv: list[str], tool: str = "launch-pd") -> dict[str, str]:
    assert Path(argv[0]).name == tool
    assert len(argv) % 2 == 1 and all(a.startswith("--") for a in argv[1::2]), argv
    return dict(zip(argv[1::2], argv[2::2]))


def _config(name: str) -> str:
    return str(ROOT / "configs" / name)


def test_dry_run_prefill_starts_gateway_on_first_prefill_node():
    (gw, bg), (pf, fg) = _dry("--mode", "online", "--pd-role", "prefill")
    assert bg and not fg
    assert _flags(gw) == {"--role": "gateway", "--config": _config("deepseek-v4-flash-a3-decode.yaml"),
                          "--host": "127.0.0.1", "--port": "8000", "--prefill-addrs": "127.0.0.1:5555",
                          "--decode-addrs": "127.0.0.1:5557"}
    assert _flags(pf) == {"--role": "prefill", "--config": _config("deepseek-v4-flash-a3-prefill.yaml"),
                          "--port": "5555", "--http-port": "8001", "--transport": "zmq-tcp", "--host": "127.0.0.1"}


def test_dry_run_decode_gateway_local_offline(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    [(dec, _)] = _dry("--mode", "online", "--pd-role", "decode", "--model", str(ckpt), "--d-yaml-name",
                      "tiny-flash.yaml", DECODE_STATE_PORT="6000", DSV4_TRANSPORT="dist")
    assert _flags(dec) == {"--role": "decode", "--config": _config("tiny-flash.yaml"), "--model": str(ckpt),
                           "--port": "5557", "--state-port": "6000", "--http-port": "8100", "--transport": "dist",
                           "--host": "127.0.0.1"}
    [(gw, bg)] = _dry("--mode", "online", "--pd-role", "gateway", "--engine-backend", "mooncake",
                      DSV4_SERVED_MODEL_NAME="dsv4 flash", ROUTER_HTTP_PORT="9000")
    assert not bg and _flags(gw)["--served-model-name"] == "dsv4 flash" and _flags(gw)["--port"] == "9000"
    [(loc, _)] = _dry("--mode=online", "--pd-role=local", "--yaml", "tiny-flash")
    assert _flags(loc) == {"--role": "local", "--config": _config("tiny-flash.yaml"), "--port": "8000"}
    out = tmp_path / "new" / "o.jsonl"                               # directory made at launch, not by a dry run
    [(off, _)] = _dry("--mode", "offline", "--yaml", _config("tiny-flash.yaml"), "--out", str(out))
    assert _flags(off, "dsv4-offline") == {"--config": _config("tiny-flash.yaml"), "--out": str(out)}
    assert not out.parent.exists()


def test_dry_run_multi_node_role_inference_and_leaders(tmp_path):
    env_file = tmp_path / "env.sh"
    env_file.write_text("PREFILL_IPS=('10.0.0.1' '10.0.0.2')\nDECODE_IPS=('10.0.0.3' '10.0.0.4' '10.0.0.5' '10.0.0.6')\n"
                        f"source {DEPLOY / 'set_env.sh'}\n")
    e = dict(DSV4_ENV_FILE=str(env_file), DEVICES_PER_NODE="8")      # ws 16 / 8 = 2 nodes per instance
    (gw, bg), (pf, _) = _dry("--mode", "online", DSV4_LOCAL_IP="10.0.0.1", **e)
    assert bg and _flags(gw)["--prefill-addrs"] == "10.0.0.1:5555"
    assert _flags(gw)["--decode-addrs"] == "10.0.0.3:5557,10.0.0.5:5557"
    assert _flags(pf)["--role"] == "prefill" and _flags(pf)["--host"] == "10.0.0.1"
    r = _infer("--mode", "online", "--dry-run", DSV4_LOCAL_IP="10.0.0.4", **e)
    assert "inferred --pd-role decode" in r.stderr
    assert "[dry-run] env MASTER_ADDR=10.0.0.3 MASTER_PORT=6239 NODE_RANK=1 NNODES=2 HCCL_IF_BASE_PORT=23556" in r.stdout
    [(dec, _)] = _dry("--mode", "online", DSV4_LOCAL_IP="10.0.0.4", **e)
    assert _flags(dec)["--role"] == "decode" and _flags(dec)["--host"] == "10.0.0.4"
    r = _infer("--mode", "online", "--dry-run", DSV4_LOCAL_IP="10.9.9.9", **e)
    assert r.returncode == 2 and "--pd-role: this host (10.9.9.9) is in neither PREFILL_IPS" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--mode", "bogus"], "--mode: must be 'online' or 'offline', got 'bogus'"),
    (["--mode", "online", "--pd-role", "router"], "--pd-role: must be"),
    (["--mode", "online"], "--pd-role: this host"),                  # loopback in both lists: ambiguous
    (["--mode", "offline", "--pd-role", "prefill"], "--pd-role: only with --mode online"),
    (["--mode", "offline", "--yaml", "nope.yaml"], "--yaml: YAML file not found: 'nope.yaml'"),
    (["--mode", "online", "--pd-role", "decode", "--d-yaml-name", "nope.yaml"], "--d-yaml-name: YAML file not found"),
    (["--mode", "offline", "--model", "no/such/dir"], "--model: checkpoint directory not found"),
    (["--mode"], "--mode: missing value"),
    (["--frobnicate"], "unknown option: --frobnicate"),
])
def test_bad_flags_exit_nonzero_naming_the_flag(args, message):
    r = _infer(*args, "--dry-run")
    assert r.returncode != 0 and message in r.stderr and r.stdout == ""


def test_bad_yaml_content_is_refused_before_launch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler_config:\n  block_size: 96\n")
    r = _infer("--mode", "online", "--pd-role", "decode", "--d-yaml-name", str(bad), "--dry-run")
    assert r.returncode == 2 and "--d-yaml-name:" in r.stderr and "scheduler_config.block_size" in r.stderr


def test_help():
    r = _infer("--help")
    assert r.returncode == 0 and "--pd-role" in r.stdout and "--dry-run" in r.stdout


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_prefill_runs_gateway_in_background_and_stops_it(tmp_path):
    """Not a dry run: a stand-in launch-pd records its calls; the gateway dies with the worker."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    fake = bin_dir / "launch-pd"
    fake.write_text('#!/bin/bash\necho "$$ MASTER_PORT=${MASTER_PORT:-} $*" >> "$FAKE_LOG"\n'
                    '[[ $2 != gateway ]] || exec sleep 60\n'
                    'for _ in $(seq 50); do grep -q " --role gateway " "$FAKE_LOG" && exit 0; sleep 0.1; done\n'
                    'exit 3\n')
    fake.chmod(0o755)
    r = _infer("--mode", "online", "--pd-role", "prefill", "--p-yaml-name", "tiny-flash.yaml",
               "--d-yaml-name", "tiny-flash.yaml", PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log),
               DSV4_LOG_DIR=str(tmp_path / "logs"))
    calls = {line.split()[3]: line.split() for line in log.read_text().splitlines()}
    gw_pid = int(calls["gateway"][0])
    try:
        assert r.returncode == 0, r.stderr
        assert calls["prefill"][1] == "MASTER_PORT=6038"
        assert "gateway started in the background" in r.stderr and (tmp_path / "logs/gateway.log").exists()
        deadline = time.monotonic() + 5
        while _alive(gw_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(gw_pid)
    finally:
        if _alive(gw_pid):
            os.kill(gw_pid, 9)


# ---- Prometheus / Grafana ---------------------------------------------------------------------
def test_prometheus_config():
    cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    ports = {}
    for name, job in jobs.items():
        [target] = [t for sc in job["static_configs"] for t in sc["targets"]]
        role = [r["replacement"] for r in job["relabel_configs"] if r.get("target_label") == "role"]
        ports[role[0]] = int(target.rsplit(":", 1)[1])
        assert job.get("metrics_path", "/metrics") == "/metrics" and job["honor_labels"] is True
    assert ports == {"gateway": 8000, "prefill": 8001, "decode": 8100}


def _exposed_names() -> set[str]:
    """Series names server/metrics.py exposes (counters get _total, histograms _bucket/_sum/_count)."""
    names = set()
    for m in (GatewayMetrics("m"), WorkerMetrics("m", "decode")):
        for fam in m.registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(fam.type, [""])
            names |= {fam.name + s for s in suffixes}
    return names


def test_grafana_dashboard_uses_only_exported_metrics():
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(variables["model_name"]["definition"])
    used = {n for e in exprs for n in re.findall(r"dsv4:[A-Za-z0-9_:]+", e)}
    exposed = _exposed_names()
    assert used <= exposed, used - exposed
    wanted = {"dsv4:time_to_first_token_seconds_bucket", "dsv4:inter_token_latency_seconds_bucket",
              "dsv4:request_time_per_output_token_seconds_bucket", "dsv4:e2e_request_latency_seconds_bucket",
              "dsv4:request_success_total", "dsv4:prompt_tokens_total", "dsv4:generation_tokens_total",
              "dsv4:num_requests_running", "dsv4:num_requests_waiting", "dsv4:kv_cache_usage_perc",
              "dsv4:kv_transfer_bytes_total", "dsv4:kv_transfer_latency_seconds_bucket",
              "dsv4:kv_transfer_failures_total"}
    assert wanted <= used, wanted - used
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        for t in p["targets"]:
            if "histogram_quantile" in t["expr"]:
                assert re.search(r"rate\(dsv4:\w+_bucket\{[^}]*\}\[1m\]\)", t["expr"]), t["expr"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


@pytest.mark.parametrize("next_n", ["0", "3"])
def test_device_check_runs_on_cpu(next_n):
    """deploy/device-check (written for CUDA / Ascend) on CPU with the uncompiled graph math: it
    prints a row per mode and batch and reports equal tokens, also with MTP verify spans."""
    r = subprocess.run([str(DEPLOY / "device-check"), "--device", "cpu", "--modes", "eager,static", "--batches", "2",
                        "--steps", "4", "--prompt-len", "130", "--next-n", next_n], cwd=ROOT, env=_env(PYTHON=sys.executable),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(("eager ", "static "))]
    assert [(row[0], row[1], row[-1]) for row in rows] == [("eager", "2", "True"), ("static", "2", "True")]
    assert float(rows[1][4]) < 1e-4 and "device-check: OK" in r.stdout
