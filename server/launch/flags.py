"""``launch-pd``'s flags: the parser, and the checks that turn a flag (or the environment variable
behind it) into a value. A bad value exits with status 2 and a message naming the flag, key or
variable, as argparse does.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import NoReturn

ROLES = ("prefill", "decode", "unified", "gateway", "local")
TRANSPORTS = ("zmq-tcp", "zmq-ipc", "dist")


def die(message: str) -> NoReturn:
    """A usage error: the message names the flag / key / variable; exit status 2 (as argparse)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if not v.isdigit():
        die(f"launch-pd: environment {name}={v!r} is not a port number")
    return int(v)


def parser() -> argparse.ArgumentParser:
    """``launch-pd``'s argument parser.

    Length: one ``add_argument`` per flag, in the order ``--help`` prints them."""
    p = argparse.ArgumentParser(prog="launch-pd", description="dsv4-pd: P/D-disaggregated DeepSeek-V4 serving")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--config", help="YAML run config (configs/*.yaml); required for prefill / decode / unified / local")
    p.add_argument("--model", help="checkpoint directory (overrides model_config.model_path)")
    p.add_argument("--host", default=os.environ.get("DSV4_BIND_HOST", "127.0.0.1"), help="bind address")
    p.add_argument("--port", type=int, help="ZMQ request port (workers) or HTTP port (gateway, local)")
    p.add_argument("--http-port", type=int, help="worker /health /ready /metrics port (0: none)")
    p.add_argument("--state-port", type=int, help="decode: state receiver port")
    p.add_argument("--transport", default=os.environ.get("DSV4_TRANSPORT", "zmq-tcp"), choices=TRANSPORTS)
    p.add_argument("--device", default=None,
                   help="auto | cpu | cuda[:i] | npu[:i] (env DSV4_DEVICE; auto: npu, then cuda, then cpu)")
    p.add_argument("--device-memory-gib", type=float,
                   help="prefill / decode / local: memory of one rank's device (GiB) for the memory plan checked "
                        "before any weight is read (default: the npu / cuda device's total; on CPU the plan runs "
                        "only with this flag); a layout that does not fit exits 2 (dsv4-plan prints the plan)")
    p.add_argument("--cpu-threads", type=int, help="torch intra-op threads of a worker (default: torch's; "
                   "several workers on one machine should share the cores, as upstream pins them)")
    p.add_argument("--pd-split", action="store_true",
                   help="local: a prefill and a decode worker (the P/D split) instead of one unified worker "
                        "that prefills and decodes in one engine on all the cores")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill / unified: reuse cached prompt-prefix state (overrides scheduler_config.enable_prefix_caching; "
                        "decode never caches)")
    p.add_argument("--prefill-routing", choices=("cache_aware", "least_load", "round_robin"), default="cache_aware",
                   help="gateway: how a prefill instance is chosen (server/backends/prefill_router.py)")
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
    p.add_argument("--max-migrations", type=int, default=1,
                   help="gateway: times a stream whose decode is lost after token #1 continues on another "
                        "pair, exactly (0: it ends with an error event)")
    p.add_argument("--reconnect-grace-s", type=float, default=5.0,
                   help="gateway: how long a sample waits for a healthy prefill / decode instance (a "
                        "connection blip reconnecting) before 503 (s)")
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


def cluster_secret(args) -> str | None:
    """The secret from --cluster-secret-file or DSV4_CLUSTER_SECRET (None: none); exits 2 if bad."""
    from kvtransfer.secure import MIN_SECRET_CHARS
    if args.cluster_secret_file:
        try:
            secret, where = Path(args.cluster_secret_file).read_text().strip(), "--cluster-secret-file"
        except (OSError, UnicodeDecodeError) as e:
            die(f"launch-pd: --cluster-secret-file: cannot read {args.cluster_secret_file}: {e}")
    else:
        secret, where = os.environ.get("DSV4_CLUSTER_SECRET", "").strip(), "DSV4_CLUSTER_SECRET"
        if not secret:
            return None
    if len(secret) < MIN_SECRET_CHARS:
        die(f"launch-pd: {where}: the cluster secret has {len(secret)} characters; at least {MIN_SECRET_CHARS}")
    return secret


def load_config(args):
    from engine.config import ConfigError
    from engine.run_config import RunConfig
    if not args.config:
        die(f"launch-pd: --config is required for --role {args.role}")
    try:
        cfg = RunConfig.from_yaml(args.config)
    except ConfigError as e:
        die(f"launch-pd: {e}")            # the message starts with the file path
    want = getattr(args, "enable_prefix_caching", None)
    if args.role == "decode":       # decode receives a request's whole state: nothing to reuse there
        want = False if cfg.scheduler_config.enable_prefix_caching or want else None
    if want is not None:
        try:
            cfg = dataclasses.replace(cfg, scheduler_config=dataclasses.replace(
                cfg.scheduler_config, enable_prefix_caching=want))
        except ConfigError as e:
            die(f"launch-pd: --enable-prefix-caching: {e}")
    return cfg


def select_platform(name: str | None):
    """``--device`` (None: $DSV4_DEVICE, else auto) -> engine.platform.Platform; exits 2 naming the
    flag or variable when the device is unavailable or malformed."""
    from engine.platform import PlatformError, detect
    try:
        return detect(name, key="--device" if name is not None else None)
    except PlatformError as e:
        die(f"launch-pd: {e}")


def advertised(host: str) -> str:
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


def model_name(args, cfg) -> str:
    from engine.run_config import DEFAULT_MODEL_NAME
    return args.served_model_name or (cfg.model_config.model_name if cfg is not None else DEFAULT_MODEL_NAME)
