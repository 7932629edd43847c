"""A request body size limit: a pure-ASGI middleware answering 413 in OpenAI's error shape.

    app.add_middleware(BodyLimit, max_body_bytes=32 << 20)

A request whose ``Content-Length`` exceeds the limit is answered at once, without calling the app
or reading the body (the server discards what the client still sends). A chunked body is counted
as it arrives: at the first byte over the limit, ``receive`` raises ``BodyTooLarge`` inside the app
and whatever response the app then makes is replaced by the 413, so at most ``max_body_bytes`` (plus
one chunk) is ever buffered.
"""
from __future__ import annotations

import json

from server.gateway.protocol import error_body_for


class BodyTooLarge(Exception):
    """Raised by the wrapped ``receive`` once a request body passes the limit."""


class BodyLimit:
    """ASGI middleware: HTTP request bodies over ``max_body_bytes`` get 413.

    Args:
        app: the ASGI app to wrap.
        max_body_bytes: the largest body accepted, in bytes.

    Raises:
        ValueError: ``max_body_bytes`` is not a positive integer.
    """

    def __init__(self, app, max_body_bytes: int):
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be a positive integer, got {max_body_bytes!r}")
        self.app, self.limit = app, max_body_bytes

    async def _reject(self, scope, send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "the body"
        body = json.dumps(error_body_for(scope.get("path", ""), f"request body: {size} exceeds the limit of "
                                         f"{self.limit} bytes", 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    break             # the server rejects a malformed Content-Length itself
                if declared > self.limit:
                    await self._reject(scope, send, declared)
                    return
                break
        seen = 0
        over = False
        started = False

        async def counted_receive():
            nonlocal seen, over
            if over:
                raise BodyTooLarge()
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message):
            nonlocal started
            if over:
                return                # the app's answer to the exception; the 413 replaces it
            started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not over or started:      # not caused by the limit (any error after it is)
                raise
        if over and not started:
            await self._reject(scope, send, None)
