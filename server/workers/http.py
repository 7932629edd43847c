"""A worker's HTTP side: ``/health``, ``/ready`` (the load report, 503 while not ready),
``/metrics`` (Prometheus) and vLLM's ``/reset_prefix_cache``, served by uvicorn on a daemon thread.

The app knows no worker: it calls what ``WorkerHttp`` hands it, from uvicorn's thread. Those
callables only read engine state, except ``reset_prefix_cache``, which the worker runs on its loop
(``LoopCalls``). With a cluster secret every endpoint needs ``Authorization: Bearer <secret>``.
"""
from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from server.gateway.protocol import error_body
from server.metrics import CONTENT_TYPE


@dataclass(frozen=True)
class WorkerHttp:
    """What the endpoints serve.

    role: "prefill" | "decode" (the app's title). secret: the cluster secret (None: no auth).
    health: ``() -> dict``, the ``/health`` body. load: ``() -> dict``, the ``/ready`` body (the
    load report). ready: ``() -> bool``, whether ``/ready`` says 200 (else 503).
    reset_prefix_cache: ``() -> int``, prefix-cache entries evicted (None: prefix caching is
    off, the endpoint answers 400). metrics: ``() -> bytes``, the Prometheus text.
    """

    role: str
    secret: str | None
    health: Callable[[], dict]
    load: Callable[[], dict]
    ready: Callable[[], bool]
    reset_prefix_cache: Callable[[], int] | None
    metrics: Callable[[], bytes]


def worker_app(w: WorkerHttp) -> FastAPI:
    """The FastAPI app serving ``w`` (errors in the API's error shape)."""
    secret = w.secret

    async def auth(request: Request) -> None:
        if secret is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), secret.encode())):
                raise HTTPException(401, "missing or wrong cluster secret (Authorization: Bearer ...)")

    app = FastAPI(title=f"dsv4-pd {w.role} worker", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(auth)])

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code)

    @app.get("/health")
    def health():
        return w.health()

    @app.get("/ready")
    def ready():
        return JSONResponse(w.load(), status_code=200 if w.ready() else 503)

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        """vLLM's endpoint: evict every prefix-cache entry (blocks running requests hold stay)."""
        if w.reset_prefix_cache is None:
            raise HTTPException(400, "prefix caching is off (scheduler_config.enable_prefix_caching)")
        return {"evicted": w.reset_prefix_cache()}

    @app.get("/metrics")
    def metrics():
        return Response(w.metrics(), media_type=CONTENT_TYPE)

    return app


def serve_http(host: str, port: int, w: WorkerHttp) -> uvicorn.Server:
    """Bind ``host:port`` now (raises OSError here, not in the thread) and serve ``worker_app(w)``
    from a daemon thread. Returns the server (``should_exit`` stops it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)        # connections queue from now on, not only once the thread's server runs
    server = uvicorn.Server(uvicorn.Config(worker_app(w), log_level="warning", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True).start()
    return server
