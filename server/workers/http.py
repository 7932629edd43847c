"""A worker's HTTP side: ``/health``, ``/ready`` (the load report, 503 while not ready),
``/metrics`` (Prometheus) and vLLM's ``/reset_prefix_cache``, served by uvicorn on a daemon thread.

The handlers only read engine state, except ``/reset_prefix_cache``, which runs on the worker's
loop (``LoopCalls``). With a cluster secret every endpoint needs ``Authorization: Bearer <secret>``.
"""
from __future__ import annotations

import hmac
import socket
import threading
from dataclasses import asdict
from typing import TYPE_CHECKING

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from server.gateway.protocol import error_body
from server.metrics import CONTENT_TYPE
from server.workers.layout import quantization_label

if TYPE_CHECKING:
    from server.workers.base import Worker


def worker_app(w: Worker) -> FastAPI:
    """The FastAPI app of worker ``w`` (errors in the API's error shape)."""
    secret = w.opts.cluster_secret

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
        r, q, spec = w.engine.runner, w.engine.model.args.quant, w.engine.spec
        return {"status": "ok", "role": w.role, "instance_id": w.instance_id,
                "device": str(w.engine.model.embed.weight.device),
                "quantization": quantization_label(q),
                "cache_dtype": w.engine.cache.cache_dtype.describe(),
                # MTP: the draft depth, and (decode) the drafts verified so far (spec_decode.SpecStats)
                "next_n": spec.next_n if spec else 0, "spec_decode": asdict(spec.stats) if spec else None,
                "prefix_cache": None if (pc := w.prefix_cache) is None else
                {"entries": len(pc.entries), "queries": pc.queries, "hits": pc.hits, "evictions": pc.evictions},
                "exe_mode": r.cfg.exe_mode if r is not None else "eager",
                "graph": None if r is None else {"backend": r.backend, "buckets": r.buckets,
                                                 "warmup_s": round(r.warmup_s, 3)},
                "parallel": w.parallel_info() if w.parallel_info else {"world_size": 1}}

    @app.get("/ready")
    def ready():
        body = w.load().report()
        return JSONResponse(body, status_code=200 if w.ready else 503)

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        """vLLM's endpoint: evict every prefix-cache entry (blocks running requests hold stay)."""
        if w.prefix_cache is None:
            raise HTTPException(400, "prefix caching is off (scheduler_config.enable_prefix_caching)")
        return {"evicted": w.calls.call(w.engine.executor.reset_prefix_cache)}

    @app.get("/metrics")
    def metrics():
        w.update_gauges()
        return Response(w.metrics.render(), media_type=CONTENT_TYPE)

    return app


def serve_http(w: Worker) -> uvicorn.Server:
    """Bind ``w.opts.host:w.opts.http_port`` now (raises OSError here, not in the thread) and
    serve ``worker_app(w)`` from a daemon thread. Returns the server (``should_exit`` stops it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in w.opts.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((w.opts.host, w.opts.http_port))
    sock.listen(128)        # connections queue from now on, not only once the thread's server runs
    server = uvicorn.Server(uvicorn.Config(worker_app(w), log_level="warning", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True).start()
    return server
