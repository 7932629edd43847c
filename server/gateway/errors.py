"""The gateway's error answers: every failure becomes a JSON body in the API's shape (Anthropic's
under /v1/messages, OpenAI's elsewhere) with the right status: 400 for bad input (pydantic's 422
included, naming the field), 404 for an unknown model, ``BackendError.status`` for the backend,
500 only for a server fault. 429 and 503 carry ``Retry-After``.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.backends.base import BackendError
from server.gateway.protocol import ApiError, error_body_for

log = logging.getLogger(__name__)
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def error_response(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
    """The error body for ``request``'s API with HTTP ``status``; a refused request (< 500) is logged."""
    if status < 500:             # an operator sees refused requests (server faults are logged where they happen)
        log.info("%s %s -> %d %s", request.method, request.url.path, status, message[:200])
    retry = {"Retry-After": "1"} if status in (429, 503) else None      # overloaded / draining: come back
    return JSONResponse(error_body_for(request.url.path, message, status, param), status_code=status,
                        headers=retry)


def _param_of(loc: Sequence) -> str | None:
    """pydantic ``loc`` -> field name (``messages[0].role``), skipping union member tags."""
    parts = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    out = ""
    for x in parts:
        if isinstance(x, int):
            out += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier() and x.lower() not in _TYPE_TAGS:
            out += f".{x}" if out else x
        else:
            break
    return out or None


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    e = errs[0] if errs else {"msg": "invalid request", "loc": ()}
    if e.get("type") == "json_invalid":
        return error_response(request, 400, f"request body: invalid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
    param = _param_of(e.get("loc", ()))
    return error_response(request, 400, f"{param or 'request body'}: {e['msg']}", param)


def install_error_handlers(app: FastAPI) -> None:
    """Answer ApiError, BackendError, pydantic's validation errors, Starlette's HTTP errors and any
    other exception (500, logged) with ``error_response``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(request, e.status, e.message, e.param)

    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, e: BackendError):
        return error_response(request, e.status, str(e))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return _validation_error(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return error_response(request, e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(request, 500, f"internal error: {type(e).__name__}")
