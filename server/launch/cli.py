"""``launch-pd``: start a prefill worker, a decode worker, the gateway, or all three locally.

    launch-pd --role prefill --config configs/X.yaml [--port 5555] [--http-port 8001]
    launch-pd --role decode  --config configs/X.yaml [--port 5557] [--state-port 5558] [--http-port 8100]
    launch-pd --role gateway --model DIR [--port 8000] [--prefill-addrs h:p,..] [--decode-addrs h:p,..]
    launch-pd --role unified --config configs/X.yaml [--port 5557] [--http-port 8100]
    launch-pd --role local   --config configs/X.yaml [--port 8000] [--pd-split]

Addresses and ports default to the environment of deploy/set_env.sh (PREFILL_IPS, DECODE_IPS,
*_PORT, DSV4_BIND_HOST) and then to loopback. Bad flags or config values exit with status 2 and
a message naming the flag or key.
"""
from __future__ import annotations

import logging
import signal
import sys
from typing import NoReturn

from server.launch.flags import TRANSPORTS, die, parser
from server.launch.roles import run_gateway, run_local, run_worker


def _exit_now(*_) -> NoReturn:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # what a spawned rank runs again
    if args.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        die(f"launch-pd: --log-level / DSV4_LOG_LEVEL: {args.log_level!r} is not one of "
            "debug, info, warning, error, critical")
    for sig in (signal.SIGTERM, signal.SIGINT):     # while starting up: stop at once, status 0
        signal.signal(sig, _exit_now)
    if args.transport not in TRANSPORTS:        # argparse does not check an env default against choices
        die(f"launch-pd: --transport / DSV4_TRANSPORT: {args.transport!r} is not one of {', '.join(TRANSPORTS)}")
    if not 0 < args.lease_s <= 3600:
        die(f"launch-pd: --lease-s: {args.lease_s} must be in (0, 3600] seconds")
    for name, lo, hi in (("worker_timeout_s", 0.1, 3600), ("drain_timeout_s", 0, 86400),
                         ("request_timeout_s", 0, 1e7), ("transfer_timeout_s", 0.1, 3600),
                         ("reconnect_grace_s", 0, 3600)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            die(f"launch-pd: --{name.replace('_', '-')}: {v} must be in [{lo:g}, {hi:g}] seconds")
    if args.device_memory_gib is not None and not 0 < args.device_memory_gib < 1 << 20:
        die(f"launch-pd: --device-memory-gib: {args.device_memory_gib} must be in (0, 2^20) GiB")
    for name, lo in (("max_pending", 1), ("max_queued", 0), ("max_retries", 0), ("max_migrations", 0)):
        if getattr(args, name) < lo:
            die(f"launch-pd: --{name.replace('_', '-')}: {getattr(args, name)} must be >= {lo}")
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {args.role} %(levelname)s %(message)s")
    for name in ("port", "http_port", "state_port"):
        v = getattr(args, name)
        if v is not None and not 0 <= v < 65536:
            die(f"launch-pd: --{name.replace('_', '-')}: {v} is not a port number")
    if args.role in ("prefill", "decode", "unified"):
        return run_worker(args)
    if args.role == "gateway":
        return run_gateway(args)
    return run_local(args)


if __name__ == "__main__":
    sys.exit(main())
