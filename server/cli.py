"""``launch-pd``: start a prefill worker, a decode worker, the gateway, or all three locally.

    launch-pd --role prefill --config configs/X.yaml [--port 5555] [--http-port 8001]
    launch-pd --role decode  --config configs/X.yaml [--port 5557] [--state-port 5558] [--http-port 8100]
    launch-pd --role gateway --model DIR [--port 8000] [--prefill-addrs h:p,..] [--decode-addrs h:p,..]
    launch-pd --role local   --config configs/X.yaml [--port 8000]

Addresses and ports default to the environment of deploy/set_env.sh (PREFILL_IPS, DECODE_IPS,
*_PORT, DSV4_BIND_HOST) and then to loopback. Bad flags or config values exit with status 2 and
a message naming the flag or key.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn



log = logging.getLogger("launch-pd")
ROLES = ("prefill", "decode", "gateway", "local")
TRANSPORTS = ("zmq-tcp", "zmq-ipc", "dist")


def _exit_now(*_) -> NoReturn:
    raise SystemExit(0)


def _die(message: str) -> NoReturn:
    """A usage error: the message names the flag / key / variable; exit status 2 (as argparse)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if not v.isdigit():
        _die(f"launch-pd: environment {name}={v!r} is not a port number")
    return int(v)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch-pd", description="dsv4-pd: P/D-disaggregated DeepSeek-V4 serving")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--config", help="YAML run config (configs/*.yaml); required for prefill / decode / local")
    p.add_argument("--model", help="checkpoint directory (overrides model_config.model_path)")
    p.add_argument("--host", default=os.environ.get("DSV4_BIND_HOST", "127.0.0.1"), help="bind address")
    p.add_argument("--port", type=int, help="ZMQ request port (workers) or HTTP port (gateway, local)")
    p.add_argument("--http-port", type=int, help="worker /health /ready /metrics port (0: none)")
    p.add_argument("--state-port", type=int, help="decode: state receiver port")
    p.add_argument("--transport", default=os.environ.get("DSV4_TRANSPORT", "zmq-tcp"), choices=TRANSPORTS)
    p.add_argument("--device", default=None,
                   help="auto | cpu | cuda[:i] | npu[:i] (env DSV4_DEVICE; auto: npu, then cuda, then cpu)")
    p.add_argument("--cpu-threads", type=int, help="torch intra-op threads of a worker (default: torch's; "
                   "several workers on one machine should share the cores, as upstream pins them)")
    p.add_argument("--prefill-addrs", help="gateway: prefill instances host[:port],... (default: PREFILL_IPS)")
    p.add_argument("--decode-addrs", help="gateway: decode instances host[:port],... (default: DECODE_IPS)")
    p.add_argument("--api-key", action="append",
                   help="gateway: require 'Authorization: Bearer KEY' on /v1/* (repeatable; env DSV4_API_KEY, "
                        "comma-separated)")
    p.add_argument("--served-model-name", help="model name clients send (default: model_config.model_name, "
                   "else deepseek_v4)")
    p.add_argument("--default-thinking", choices=("enabled", "disabled"),
                   default=os.environ.get("DSV4_DEFAULT_THINKING", "enabled"),
                   help="gateway: thinking mode of a chat / Responses / Messages request that does not choose "
                        "(DeepSeek's API default: enabled; env DSV4_DEFAULT_THINKING)")
    p.add_argument("--lease-s", type=float, default=60.0, help="decode reservation lease (s), in (0, 3600]")
    p.add_argument("--advertise-host", default=os.environ.get("DSV4_ADVERTISE_HOST"),
                   help="decode: host prefill workers reach the state port at (default: --host, or this "
                        "machine's address when --host is a wildcard)")
    p.add_argument("--worker-timeout-s", type=float, default=5.0,
                   help="a gateway <-> worker connection silent for this long (worker killed, stopped or "
                        "unreachable) is dropped; the gateway then fails or retries its samples (s)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="SIGTERM: stop admitting, give in-flight requests this long, abort the rest, exit 0 (s)")
    p.add_argument("--request-timeout-s", type=float, default=0.0,
                   help="gateway: default deadline of a request (s; 0: none; a request's X-Request-Timeout "
                        "header overrides it)")
    p.add_argument("--max-pending", type=int, default=4096,
                   help="gateway: most samples in flight; more get 429 with Retry-After")
    p.add_argument("--max-queued", type=int, default=1024,
                   help="decode: samples waiting for a reservation; more get 429 with Retry-After")
    p.add_argument("--transfer-timeout-s", type=float, default=60.0,
                   help="prefill: commit sent -> decode's acknowledgement (s)")
    p.add_argument("--max-retries", type=int, default=2,
                   help="gateway: retries of a sample whose prefill / decode instance is lost before token #1")
    p.add_argument("--cluster-secret-file",
                   help="file holding the cluster's shared secret (>= 16 characters; surrounding whitespace "
                        "ignored; env DSV4_CLUSTER_SECRET instead): every ZMQ connection between gateway, "
                        "prefill and decode then uses CURVE and refuses peers without it, and worker HTTP "
                        "endpoints need 'Authorization: Bearer <secret>'")
    p.add_argument("--log-level", default=os.environ.get("DSV4_LOG_LEVEL", "INFO"))
    r = p.add_argument_group("multi-rank instances (parallel_config.world_size > 1; torchrun's RANK / "
                             "WORLD_SIZE / MASTER_ADDR / MASTER_PORT environment wins over these)")
    r.add_argument("--nnodes", default=os.environ.get("NNODES", 1), help="nodes of this instance (env NNODES)")
    r.add_argument("--node-rank", default=os.environ.get("NODE_RANK", 0),
                   help="this node's index; node 0 holds the leader (env NODE_RANK)")
    r.add_argument("--nproc-per-node", type=int, help="ranks started on this node (default world_size / nnodes)")
    r.add_argument("--master-addr", help="leader node address (default MASTER_ADDR, else 127.0.0.1)")
    r.add_argument("--master-port", type=int, help="torch.distributed rendezvous port (default MASTER_PORT, else 29500)")
    r.add_argument("--rank-port", type=int, help="leader's step channel port (default master port + 1)")
    r.add_argument("--rank-timeout-s", type=float, default=5.0,
                   help="a rank silent this long (heartbeats) is lost: the instance leaves routing and exits")
    r.add_argument("--dist-timeout-s", type=float, default=300.0,
                   help="longest wait (s) in one collective, and for the ranks to start")
    return p


def _cluster_secret(args) -> str | None:
    """The secret from --cluster-secret-file or DSV4_CLUSTER_SECRET (None: none); exits 2 if bad."""
    from kvtransfer.secure import MIN_SECRET_CHARS
    if args.cluster_secret_file:
        try:
            secret, where = Path(args.cluster_secret_file).read_text().strip(), "--cluster-secret-file"
        except (OSError, UnicodeDecodeError) as e:
            _die(f"launch-pd: --cluster-secret-file: cannot read {args.cluster_secret_file}: {e}")
    else:
        secret, where = os.environ.get("DSV4_CLUSTER_SECRET", "").strip(), "DSV4_CLUSTER_SECRET"
        if not secret:
            return None
    if len(secret) < MIN_SECRET_CHARS:
        _die(f"launch-pd: {where}: the cluster secret has {len(secret)} characters; at least {MIN_SECRET_CHARS}")
    return secret


def _load_config(args):
    from engine.config import ConfigError
    from engine.run_config import RunConfig
    if not args.config:
        _die(f"launch-pd: --config is required for --role {args.role}")
    try:
        return RunConfig.from_yaml(args.config)
    except ConfigError as e:
        _die(f"launch-pd: {e}")            # the message starts with the file path


def _platform(name: str | None):
    """``--device`` (None: $DSV4_DEVICE, else auto) -> engine.platform.Platform; exits 2 naming the
    flag or variable when the device is unavailable or malformed."""
    from engine.platform import PlatformError, detect
    try:
        return detect(name, key="--device" if name is not None else None)
    except PlatformError as e:
        _die(f"launch-pd: {e}")


def _advertised(host: str) -> str:
    """The address peers use for a socket bound to ``host`` (a wildcard is not reachable)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))      # no packet is sent: picks the outbound interface
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _model_name(args, cfg) -> str:
    from engine.run_config import DEFAULT_MODEL_NAME
    return args.served_model_name or (cfg.model_config.model_name if cfg is not None else DEFAULT_MODEL_NAME)


def run_worker(args) -> int:
    from engine.build import build_engine
    from engine.config import ConfigError
    from engine.weights import CheckpointError
    from server.worker import WorkerOptions
    cfg = _load_config(args)
    prefill = args.role == "prefill"
    opts = WorkerOptions(
        host=args.host, transport=args.transport, lease_s=args.lease_s, model_name=_model_name(args, cfg),
        port=args.port if args.port is not None else
        _env_int("PREFILL_ZMQ_PORT" if prefill else "DECODE_ZMQ_PORT", 5555 if prefill else 5557),
        advertise_host=args.advertise_host or _advertised(args.host),
        http_port=args.http_port if args.http_port is not None else
        _env_int("PREFILL_HTTP_PORT" if prefill else "DECODE_HTTP_PORT", 8001 if prefill else 8100),
        state_port=args.state_port if args.state_port is not None else _env_int("DECODE_STATE_PORT", 5558),
        heartbeat_timeout_s=args.worker_timeout_s, drain_timeout_s=args.drain_timeout_s,
        max_queued=args.max_queued, transfer_timeout_s=args.transfer_timeout_s, cluster_secret=_cluster_secret(args))
    args.cluster_secret_value = opts.cluster_secret        # the rank step channel uses it too
    if args.cpu_threads is not None:
        if args.cpu_threads < 1:
            _die(f"launch-pd: --cpu-threads: {args.cpu_threads} must be >= 1")
        import torch
        torch.set_num_threads(args.cpu_threads)
    renv = _ranks(args, cfg) if cfg.parallel_config.world_size > 1 else None
    platform = _platform(args.device)
    spec = args.device if args.device is not None else os.environ.get("DSV4_DEVICE", "auto")
    if renv is not None and platform.kind != "cpu" and ":" not in spec:
        platform = _platform(f"{platform.kind}:{renv.local_rank}")     # one device per local rank
    platform.activate()
    ranks, executor = None, None
    if renv is not None:
        _meet(args, cfg, renv, platform)
        from server.rank_worker import start_ranks          # rank 0 listens while the ranks load
        ranks, executor = start_ranks(renv, args, cfg, prefill)
    try:
        # prefill runs eager (reference §8.4); a decode worker compiles / captures its step here
        engine = build_engine(cfg, args.model, device=str(platform.device), progress=False, graph=not prefill,
                              rank=renv.rank if renv else 0, executor=executor)
    except (ConfigError, CheckpointError) as e:
        _die(f"launch-pd: {e}")
    if renv is not None and not renv.leader:
        from server.rank_worker import run_follower
        return run_follower(engine, renv, args, cfg)
    if ranks is not None:
        ranks.wait_followers(engine)
    if prefill:
        from server.prefill import PrefillWorker as W
    else:
        from server.decode import DecodeWorker as W
    try:
        worker = W(engine, opts)
    except Exception as e:     # zmq bind errors: address in use / not available
        _die(f"launch-pd: cannot start the {args.role} worker on {args.host}: {e}")
    if ranks is not None:
        ranks.attach(worker)
    def on_signal(*_):             # the first drains, a second stops at once
        if worker.draining:
            worker.stop.set()
        worker.begin_drain()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        worker.start_http()
    except OSError as e:
        worker.close()
        _die(f"launch-pd: --http-port {opts.http_port}: cannot serve HTTP on {args.host}: {e}")
    extra = f", state {worker.receiver.address}" if not prefill else ""
    log.info("%s worker %s ready: requests tcp://%s:%d, http %d%s", args.role, worker.instance_id, args.host,
             opts.port, opts.http_port, extra)
    try:
        worker.run()
    finally:
        worker.close()
        if ranks is not None:
            ranks.close()
    return 1 if worker.rank_failure else 0


def _meet(args, cfg, renv, platform) -> None:
    """Rendezvous with the instance's other ranks and check they run the same config; exits 2
    naming the flag or the ranks that differ (then at once: the others may be blocked)."""
    from server.ranks import RankError, check_same_config, init_distributed
    try:
        init_distributed(renv, platform.kind, args.dist_timeout_s)
    except RuntimeError as e:
        _die(f"launch-pd: --master-port / MASTER_PORT: the torch.distributed rendezvous at {renv.master_addr}:"
             f"{renv.master_port} failed ({str(e).splitlines()[0][:200]}); each instance on a node needs its own "
             f"--master-port (and --rank-port)")
    run = cfg.to_dict()
    run["model_config"].pop("model_path", None)
    config_json = Path(args.model or cfg.model_config.model_path) / "config.json"
    try:
        check_same_config(run, config_json.read_bytes() if config_json.is_file() else b"")
    except RankError as e:
        print(f"launch-pd: rank {renv.rank}: {e}", file=sys.stderr, flush=True)
        os._exit(2)


def _ranks(args, cfg):
    """This process's rank (``server.ranks``); rank 0 of a node starts the node's others. Exits 2
    on a bad flag / variable."""
    from server.ranks import RankError, rank_env, spawn_ranks, watch_children
    if not 0.1 <= args.rank_timeout_s <= 3600:
        _die(f"launch-pd: --rank-timeout-s: {args.rank_timeout_s} must be in [0.1, 3600] seconds")
    if not 1 <= args.dist_timeout_s <= 86400:
        _die(f"launch-pd: --dist-timeout-s: {args.dist_timeout_s} must be in [1, 86400] seconds")
    try:
        renv = rank_env(cfg.parallel_config.world_size, args.nnodes, args.node_rank, args.nproc_per_node,
                        args.master_addr, args.master_port, args.rank_port)
    except RankError as e:
        _die(f"launch-pd: {e}")
    # SIGTERM / SIGINT while the ranks meet and load: a process blocked in a rendezvous cannot run
    # a Python handler, so the default action (end now); the worker installs its drain later
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    args.rank_handler = {}
    if renv.spawn:
        args.children = spawn_ranks(renv, args.argv)
        watch_children(args.children, args.rank_handler)
    log.info("rank %d of %d (leader %s:%d)", renv.rank, renv.world_size, renv.master_addr, renv.master_port)
    return renv


def run_gateway(args) -> int:
    import uvicorn

    from engine.tokenizer import Tokenizer
    from server.gateway import create_app
    from server.router import PDBackend, parse_addrs
    cfg = _load_config(args) if args.config else None
    model_dir = args.model or (cfg.model_config.model_path if cfg else None)
    if not model_dir or not Path(model_dir).is_dir():
        _die("launch-pd: --model: the gateway needs the checkpoint directory (tokenizer, config)")
    try:
        pre = parse_addrs(args.prefill_addrs or os.environ.get("PREFILL_IPS") or "127.0.0.1",
                          _env_int("PREFILL_ZMQ_PORT", 5555))
        dec = parse_addrs(args.decode_addrs or os.environ.get("DECODE_IPS") or "127.0.0.1",
                          _env_int("DECODE_ZMQ_PORT", 5557))
    except ValueError as e:
        _die(f"launch-pd: --prefill-addrs / --decode-addrs: {e}")
    tokenizer = Tokenizer(model_dir)
    backend = PDBackend(pre, dec, lease_s=args.lease_s, worker_timeout_s=args.worker_timeout_s,
                        max_retries=args.max_retries, cluster_secret=_cluster_secret(args))
    keys = args.api_key or [k for k in os.environ.get("DSV4_API_KEY", "").split(",") if k]
    if any(not k.strip() or k != k.strip() for k in keys):
        _die("launch-pd: --api-key / DSV4_API_KEY: a key must be non-empty, without surrounding spaces")
    app = create_app(backend, tokenizer, _model_name(args, cfg), default_thinking=args.default_thinking == "enabled",
                     api_keys=keys or None, max_pending=args.max_pending,
                     request_timeout_s=args.request_timeout_s or None)
    port = args.port or _env_int("ROUTER_HTTP_PORT", 8000)
    log.info("gateway on http://%s:%d: prefill %s, decode %s", args.host, port, pre, dec)
    from server.gateway_server import GatewayServer
    server = GatewayServer(app, uvicorn.Config(app, host=args.host, port=port, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=5), args.drain_timeout_s)
    server.run()
    return 0 if server.started else 1


def run_local(args) -> int:
    """Prefill + decode + gateway as three child processes on loopback; Ctrl-C stops all three."""
    from server.launcher import LocalPD
    cfg = _load_config(args)
    model = args.model or cfg.model_config.model_path
    from engine.platform import PlatformError, parse_spec
    env = os.environ.get("DSV4_DEVICE", "").strip()
    device, key = (args.device, "--device") if args.device is not None else (env or "auto", "DSV4_DEVICE")
    try:
        parse_spec(device, key)    # the form only: the children probe the hardware
    except PlatformError as e:
        _die(f"launch-pd: {e}")
    extra = ["--device", device, "--log-level", args.log_level]
    for name in ("worker_timeout_s", "drain_timeout_s", "request_timeout_s", "max_pending", "max_queued",
                 "transfer_timeout_s", "max_retries"):
        extra += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    workers = extra + (["--cpu-threads", str(args.cpu_threads)] if args.cpu_threads is not None else [])
    gw = extra + ["--lease-s", str(args.lease_s), "--default-thinking", args.default_thinking] + (
        ["--served-model-name", args.served_model_name] if args.served_model_name else [])
    if args.api_key:                           # to the gateway child by environment (argv is public)
        os.environ["DSV4_API_KEY"] = ",".join(args.api_key)
    gateway_port = args.port or _env_int("ROUTER_HTTP_PORT", 8000)
    pd = LocalPD(args.config, model, transport=args.transport, host=args.host, gateway_port=gateway_port,
                 cluster_secret=_cluster_secret(args),
                 extra_args={"prefill": workers, "decode": workers, "gateway": gw})
    import socket
    with socket.socket() as s:                 # a gateway already there would answer our health check
        try:
            s.bind((args.host, gateway_port))
        except OSError as e:
            _die(f"launch-pd: --port: {gateway_port} on {args.host} is not free ({e})")
    stop = {"now": False}

    def interrupt(*_):
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupt)          # while starting: stop at once (pd.stop below)
    try:
        pd.start()
    except RuntimeError as e:
        _die(f"launch-pd --role local: {e}")
    except KeyboardInterrupt:
        pd.stop()
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.update(now=True))
    log.info("local P/D ready: OpenAI API at %s/v1, metrics %s; Ctrl-C stops", pd.base_url,
             ", ".join(pd.metrics_urls.values()))
    rc = 0
    try:
        while not stop["now"]:
            if not pd.alive():
                dead = [n for n, p in pd.procs.items() if p.poll() is not None]
                log.error("the %s process exited (status %s); stopping the others", dead[0],
                          pd.procs[dead[0]].returncode)
                rc = 1
                break
            time.sleep(0.2)
    finally:
        pd.stop()
    return rc


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # what a spawned rank runs again
    if args.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        _die(f"launch-pd: --log-level / DSV4_LOG_LEVEL: {args.log_level!r} is not one of "
             "debug, info, warning, error, critical")
    for sig in (signal.SIGTERM, signal.SIGINT):     # while starting up: stop at once, status 0
        signal.signal(sig, _exit_now)
    if args.transport not in TRANSPORTS:        # argparse does not check an env default against choices
        _die(f"launch-pd: --transport / DSV4_TRANSPORT: {args.transport!r} is not one of {', '.join(TRANSPORTS)}")
    if not 0 < args.lease_s <= 3600:
        _die(f"launch-pd: --lease-s: {args.lease_s} must be in (0, 3600] seconds")
    for name, lo, hi in (("worker_timeout_s", 0.1, 3600), ("drain_timeout_s", 0, 86400),
                         ("request_timeout_s", 0, 1e7), ("transfer_timeout_s", 0.1, 3600)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            _die(f"launch-pd: --{name.replace('_', '-')}: {v} must be in [{lo:g}, {hi:g}] seconds")
    for name, lo in (("max_pending", 1), ("max_queued", 0), ("max_retries", 0)):
        if getattr(args, name) < lo:
            _die(f"launch-pd: --{name.replace('_', '-')}: {getattr(args, name)} must be >= {lo}")
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {args.role} %(levelname)s %(message)s")
    for name in ("port", "http_port", "state_port"):
        v = getattr(args, name)
        if v is not None and not 0 <= v < 65536:
            _die(f"launch-pd: --{name.replace('_', '-')}: {v} is not a port number")
    if args.role in ("prefill", "decode"):
        return run_worker(args)
    if args.role == "gateway":
        return run_gateway(args)
    return run_local(args)


if __name__ == "__main__":
    sys.exit(main())
