"""Serving an ASGI app on a real socket for the gateway tests: uvicorn on a free loopback port."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serve_app(app, start_timeout_s: float = 30) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread; yields its base URL ``http://127.0.0.1:PORT`` and
    stops it on exit. Fails (AssertionError) if it does not start within ``start_timeout_s``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        th.join(15)
        sock.close()
