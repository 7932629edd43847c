"""What each ``launch-pd --role`` runs: a prefill or decode worker (with its ranks when the config
asks for more than one), the gateway, or all three as local child processes.

The gateway's imports stay inside ``run_gateway`` and are torch-free: the gateway process never
loads torch (tests/server/test_gateway_no_torch.py checks the live process).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from server.launch.flags import (advertised, cluster_secret, die, env_int, load_config, model_name,
                                 select_platform)

log = logging.getLogger("launch-pd")


def run_worker(args) -> int:
    cfg = load_config(args)
    check_memory(args, cfg)             # before any rank starts or weight is read (or torch imported)
    from engine.build import build_engine
    from engine.config import ConfigError
    from engine.checkpoint.shards import CheckpointError
    from server.workers.base import WorkerOptions
    prefill = args.role == "prefill"
    if args.role == "unified" and cfg.parallel_config.world_size > 1:
        die(f"launch-pd --role unified: parallel_config.world_size {cfg.parallel_config.world_size}: a unified "
            "worker runs one rank (multi-rank instances run the P/D split)")
    opts = WorkerOptions(
        host=args.host, transport=args.transport, lease_s=args.lease_s, model_name=model_name(args, cfg),
        port=args.port if args.port is not None else
        env_int("PREFILL_ZMQ_PORT" if prefill else "DECODE_ZMQ_PORT", 5555 if prefill else 5557),
        advertise_host=args.advertise_host or advertised(args.host),
        http_port=args.http_port if args.http_port is not None else
        env_int("PREFILL_HTTP_PORT" if prefill else "DECODE_HTTP_PORT", 8001 if prefill else 8100),
        state_port=args.state_port if args.state_port is not None else env_int("DECODE_STATE_PORT", 5558),
        heartbeat_timeout_s=args.worker_timeout_s, drain_timeout_s=args.drain_timeout_s,
        max_queued=args.max_queued, transfer_timeout_s=args.transfer_timeout_s, cluster_secret=cluster_secret(args))
    args.cluster_secret_value = opts.cluster_secret        # the rank step channel uses it too
    if args.cpu_threads is not None:
        if args.cpu_threads < 1:
            die(f"launch-pd: --cpu-threads: {args.cpu_threads} must be >= 1")
        import torch
        torch.set_num_threads(args.cpu_threads)
    renv = _ranks(args, cfg) if cfg.parallel_config.world_size > 1 else None
    platform = select_platform(args.device)
    spec = args.device if args.device is not None else os.environ.get("DSV4_DEVICE", "auto")
    if renv is not None and platform.kind != "cpu" and ":" not in spec:
        platform = select_platform(f"{platform.kind}:{renv.local_rank}")     # one device per local rank
    platform.activate()
    ranks, runner = None, None
    if renv is not None:
        _meet(args, cfg, renv, platform)
        from server.launch.rank_worker import start_ranks          # rank 0 listens while the ranks load
        ranks, runner = start_ranks(renv, args, cfg, prefill)
    digest = _start_digest(args.model or cfg.model_config.model_path) if renv is None or renv.leader else None
    try:
        # prefill runs eager (reference §8.4); a decode or unified worker compiles / captures its step here
        engine = build_engine(cfg, args.model, device=str(platform.device), progress=False, graph=not prefill,
                              rank=renv.rank if renv else 0, runner=runner, warmup=renv is None)
        if digest is not None:
            opts.weights_digest = digest.result().value
    except (ConfigError, CheckpointError) as e:
        die(f"launch-pd: {e}")
    if renv is not None and not renv.leader:
        from server.launch.rank_worker import run_follower
        return run_follower(engine, renv, args, cfg)
    if ranks is not None:
        ranks.wait_followers(engine)
    try:
        worker = _worker_class(args.role)(engine, opts)
    except Exception as e:     # zmq bind errors: address in use / not available
        die(f"launch-pd: cannot start the {args.role} worker on {args.host}: {e}")
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
        die(f"launch-pd: --http-port {opts.http_port}: cannot serve HTTP on {args.host}: {e}")
    extra = f", state {worker.receiver.address}" if args.role == "decode" else ""
    log.info("%s worker %s ready: requests tcp://%s:%d, http %d%s", args.role, worker.instance_id, args.host,
             opts.port, opts.http_port, extra)
    try:
        worker.run()
    finally:
        worker.close()
        if ranks is not None:
            ranks.close()
    return 1 if worker.rank_failure else 0


def _worker_class(role: str):
    """The ``server.workers`` class of a worker role (prefill, decode, unified)."""
    if role == "prefill":
        from server.workers.prefill import PrefillWorker
        return PrefillWorker
    if role == "unified":
        from server.workers.unified import UnifiedWorker
        return UnifiedWorker
    from server.workers.decode import DecodeWorker
    return DecodeWorker


def check_memory(args, cfg) -> None:
    """The memory plan (``engine.memory_plan``, as ``dsv4-plan`` prints it) of this instance's
    layout, from the checkpoint's config.json; exits 2 with its message when it does not fit.
    Device memory: ``--device-memory-gib`` (with the runtime reserve when the run config names an
    Ascend platform), else the device's own total (npu / cuda). On CPU the plan runs only with
    ``--device-memory-gib``: the host's memory is shared by every rank, and the engine sizes its
    pools from ``cpu_memory_gb`` itself. Run once per node (LOCAL_RANK 0, the process that starts
    the others); a checkpoint without config.json is left to the load to report."""
    from engine.config import ConfigError
    from engine.memory_plan import MemoryPlanError, require_fit
    from engine.memory_sizes import GIB
    from engine.tools.plan import device_memory, plan_run
    model = args.model or cfg.model_config.model_path
    if os.environ.get("LOCAL_RANK", "0") != "0" or not model or not (Path(model) / "config.json").is_file():
        return
    if args.device_memory_gib is not None:
        dev = device_memory(cfg, args.device_memory_gib)
    else:
        platform = select_platform(args.device)
        total = platform.total_memory()
        if total is None:
            return
        dev = (total, f"{platform.device} total memory", True)
    try:
        plan, _ = plan_run(cfg, args.model, None, *dev)
        require_fit(plan)
    except (ConfigError, MemoryPlanError) as e:
        die(f"launch-pd: {e}")
    log.info("memory plan: %s (%s) fits: %.2f GiB weights, %.2f GiB workspace, %.2f GiB per rank for decode state",
             plan.model, plan.quant_type, plan.resident / GIB, sum(plan.workspace.values()) / GIB, plan.left / GIB)


def _start_digest(model_dir):
    """The checkpoint's weights digest (``engine.checkpoint.digest``), hashed on a thread while the
    weights load (the first start reads the checkpoint once more; later starts use the cache).
    The instance's leader only: a rank reads just its slices, and only the leader pairs."""
    import threading
    from concurrent.futures import Future

    from engine.checkpoint.digest import weights_digest
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(weights_digest(model_dir))
        except BaseException as e:       # CheckpointError, or a bug: raised by fut.result()
            fut.set_exception(e)
    # a daemon: a start that fails (bad config) exits at once, not after hashing the checkpoint
    threading.Thread(target=run, name="weights-digest", daemon=True).start()
    return fut


def _meet(args, cfg, renv, platform) -> None:
    """Rendezvous with the instance's other ranks and check they run the same config; exits 2
    naming the flag or the ranks that differ (then at once: the others may be blocked)."""
    from server.launch.ranks import RankError, check_same_config, init_distributed
    try:
        init_distributed(renv, platform.kind, args.dist_timeout_s)
    except RuntimeError as e:
        die(f"launch-pd: --master-port / MASTER_PORT: the torch.distributed rendezvous at {renv.master_addr}:"
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
    """This process's rank (``server.launch.ranks``); rank 0 of a node starts the node's others. Exits 2
    on a bad flag / variable."""
    from server.launch.ranks import RankError, rank_env, spawn_ranks, watch_children
    if not 0.1 <= args.rank_timeout_s <= 3600:
        die(f"launch-pd: --rank-timeout-s: {args.rank_timeout_s} must be in [0.1, 3600] seconds")
    if not 1 <= args.dist_timeout_s <= 86400:
        die(f"launch-pd: --dist-timeout-s: {args.dist_timeout_s} must be in [1, 86400] seconds")
    try:
        renv = rank_env(cfg.parallel_config.world_size, args.nnodes, args.node_rank, args.nproc_per_node,
                        args.master_addr, args.master_port, args.rank_port)
    except RankError as e:
        die(f"launch-pd: {e}")
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
    from server.backends.instances import parse_addrs
    from server.backends.pd import PDBackend
    from server.gateway.app import create_app
    cfg = load_config(args) if args.config else None
    model_dir = args.model or (cfg.model_config.model_path if cfg else None)
    if not model_dir or not Path(model_dir).is_dir():
        die("launch-pd: --model: the gateway needs the checkpoint directory (tokenizer, config)")
    try:
        pre = parse_addrs(args.prefill_addrs or os.environ.get("PREFILL_IPS") or "127.0.0.1",
                          env_int("PREFILL_ZMQ_PORT", 5555))
        dec = parse_addrs(args.decode_addrs or os.environ.get("DECODE_IPS") or "127.0.0.1",
                          env_int("DECODE_ZMQ_PORT", 5557))
    except ValueError as e:
        die(f"launch-pd: --prefill-addrs / --decode-addrs: {e}")
    tokenizer = Tokenizer(model_dir)
    backend = PDBackend(pre, dec, lease_s=args.lease_s, worker_timeout_s=args.worker_timeout_s,
                        max_retries=args.max_retries, max_migrations=args.max_migrations,
                        prefill_routing=args.prefill_routing,
                        reconnect_grace_s=args.reconnect_grace_s,
                        cluster_secret=cluster_secret(args))
    keys = args.api_key or [k for k in os.environ.get("DSV4_API_KEY", "").split(",") if k]
    if any(not k.strip() or k != k.strip() for k in keys):
        die("launch-pd: --api-key / DSV4_API_KEY: a key must be non-empty, without surrounding spaces")
    app = create_app(backend, tokenizer, model_name(args, cfg), default_thinking=args.default_thinking == "enabled",
                     api_keys=keys or None, max_pending=args.max_pending,
                     request_timeout_s=args.request_timeout_s or None)
    port = args.port or env_int("ROUTER_HTTP_PORT", 8000)
    log.info("gateway on http://%s:%d: prefill %s, decode %s", args.host, port, pre, dec)
    from server.gateway.uvicorn_server import GatewayServer
    server = GatewayServer(app, uvicorn.Config(app, host=args.host, port=port, log_level="warning", access_log=False,
                                               timeout_graceful_shutdown=5), args.drain_timeout_s)
    server.run()
    return 0 if server.started else 1


def _local_flags(args) -> tuple[list[str], list[str]]:
    """The flags ``--role local`` hands its workers and its gateway (exits 2 on a bad --device)."""
    from engine.platform import PlatformError, parse_spec
    env = os.environ.get("DSV4_DEVICE", "").strip()
    device, key = (args.device, "--device") if args.device is not None else (env or "auto", "DSV4_DEVICE")
    try:
        parse_spec(device, key)    # the form only: the children probe the hardware
    except PlatformError as e:
        die(f"launch-pd: {e}")
    extra = ["--device", device, "--log-level", args.log_level]
    for name in ("worker_timeout_s", "drain_timeout_s", "request_timeout_s", "max_pending", "max_queued",
                 "transfer_timeout_s", "max_retries", "max_migrations"):
        extra += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    workers = extra + (["--cpu-threads", str(args.cpu_threads)] if args.cpu_threads is not None else [])
    if args.device_memory_gib is not None:
        workers += ["--device-memory-gib", str(args.device_memory_gib)]
    if args.enable_prefix_caching is not None:
        workers += ["--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"]
    workers += ["--lease-s", str(args.lease_s)]
    gw = extra + ["--lease-s", str(args.lease_s), "--reconnect-grace-s", str(args.reconnect_grace_s),
                  "--default-thinking", args.default_thinking] + (
        ["--served-model-name", args.served_model_name] if args.served_model_name else [])
    return workers, gw


def run_local(args) -> int:
    """One unified worker (prefill and decode in one engine, vLLM's layout) and the gateway as
    child processes on loopback; with ``--pd-split`` (or a multi-rank config) a prefill and a
    decode worker instead. Ctrl-C stops them all."""
    from server.launch.local import LocalPD
    cfg = load_config(args)
    model = args.model or cfg.model_config.model_path
    workers, gw = _local_flags(args)
    if args.api_key:                           # to the gateway child by environment (argv is public)
        os.environ["DSV4_API_KEY"] = ",".join(args.api_key)
    gateway_port = args.port or env_int("ROUTER_HTTP_PORT", 8000)
    split = args.pd_split or cfg.parallel_config.world_size > 1     # a unified worker runs one rank
    pd = LocalPD(args.config, model, num_prefill=int(split), num_decode=int(split), num_unified=int(not split),
                 transport=args.transport, host=args.host, gateway_port=gateway_port,
                 cluster_secret=cluster_secret(args),
                 extra_args={"prefill": workers, "decode": workers, "unified": workers, "gateway": gw})
    import socket
    with socket.socket() as s:                 # a gateway already there would answer our health check
        # uvicorn binds with SO_REUSEADDR: a port a finished run left in TIME_WAIT is free to it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((args.host, gateway_port))
        except OSError as e:
            die(f"launch-pd: --port: {gateway_port} on {args.host} is not free ({e})")
    stop = {"now": False}

    def interrupt(*_):
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupt)          # while starting: stop at once (pd.stop below)
    try:
        pd.start()
    except RuntimeError as e:
        die(f"launch-pd --role local: {e}")
    except KeyboardInterrupt:
        pd.stop()
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.update(now=True))
    log.info("local %s ready: OpenAI API at %s/v1, metrics %s; Ctrl-C stops", "P/D" if split else "engine",
             pd.base_url, ", ".join(pd.metrics_urls.values()))
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
        pd.stop(args.drain_timeout_s + 5)      # in-flight streams finish (the children drain)
    return rc
