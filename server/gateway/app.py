"""The HTTP gateway: OpenAI and Anthropic APIs, SSE streaming, metrics, disconnects.

    app = create_app(backend, tokenizer, "deepseek_v4")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: POST /v1/chat/completions, /v1/completions, /v1/responses (OpenAI), /v1/messages,
/v1/messages/count_tokens (Anthropic); GET /v1/models, /v1/models/{id}, /health, /metrics. Each
API's module (``completions``, ``chat_completions``, ``responses``, ``messages``) turns a request
into a ``server.gateway.jobs.Job`` of samples; ``Gateway`` runs every job the same way (one backend
stream per sample, run concurrently) and the job shapes their pieces as a JSON body or SSE
messages. The chat format (rendering, encoding, output parsing) is DeepSeek's own library, through
``server.gateway.dsformat``. Errors use the API's shape (``server.gateway.errors``): 400 for bad
input, 404 for an unknown model, ``BackendError.status`` for the backend, 500 only for a server
fault. A streamed request answers with HTTP headers once the first token (or a refusal) arrives, so
a backend refusal keeps its status; an error after that is a final error event in the API's form.

A client that disconnects (streamed or not) has its samples' backend iterators closed, which
aborts them and frees their state (``server.gateway.generation`` runs the samples and records the
metrics).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server.backends.base import Backend, BackendError
from server.gateway.body_limit import BodyLimit
from server.gateway.chat_completions import prepare_chat
from server.gateway.completions import TokenStrings, prepare_completion
from server.gateway.dsformat import DeepSeekFormat
from server.gateway.errors import install_error_handlers
from server.gateway.generation import ClientGone, Generation
from server.gateway.jobs import Job, Piece, Sample
from server.gateway.messages import count_message_tokens, prepare_messages
from server.gateway.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, MessagesCountRequest,
                                     MessagesRequest, ResponsesRequest)
from server.gateway.responses import prepare_responses
from server.metrics import CONTENT_TYPE, GatewayMetrics

log = logging.getLogger(__name__)


async def _watch_disconnect(request: Request, gen: Generation) -> None:
    """Wait for ``http.disconnect`` (the body is already read) and abort ``gen``."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:      # the connection is gone in some other way
        pass
    gen.client_left()


def _token_ids(v) -> bool:
    """A completions prompt given as token ids (a list of ints, or a batch of them): no text in it."""
    return isinstance(v, list) and bool(v) and (set(map(type, v)) <= {int} or all(
        isinstance(x, list) and set(map(type, x)) <= {int} for x in v))


async def _stream(job: Job, gen: Generation, first: tuple[Sample, Piece], watcher: asyncio.Task):
    """SSE body: the job's head, its events per piece, its tail (usage, ``[DONE]``); a failure
    after the headers is the job's error event."""
    try:
        text = "".join(job.head())
        item = first
        while item is not None:
            text += "".join(job.events(*item))
            if text:
                yield text
                text = ""
            item = await gen.next()
        yield text + "".join(job.tail(gen.asms))
    except ClientGone:
        return
    except (ApiError, BackendError) as e:
        yield "".join(job.error_events(getattr(e, "status", 500), str(e), getattr(e, "param", None)))
    except Exception as e:
        log.exception("stream of %s failed", job.id)
        yield "".join(job.error_events(500, f"internal error: {type(e).__name__}"))
    finally:
        watcher.cancel()
        gen.cancel()


class Gateway:
    """What the routes share: the backend, the chat format and tokenizer, the metrics, and the
    request path every generation endpoint takes (admission, the in-flight bound, deadlines, serving
    a job as JSON or SSE). Arguments as ``create_app``'s."""

    def __init__(self, backend: Backend, tokenizer, model_name: str, *, default_thinking: bool,
                 fmt: DeepSeekFormat | None, max_n: int, api_keys: Sequence[str] | None,
                 metrics: GatewayMetrics | None, max_pending: int, request_timeout_s: float | None):
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.metrics = metrics or GatewayMetrics(model_name)
        if hasattr(backend, "incompatible_pairs"):          # the P/D backend: pairs it will not route to
            self.metrics.track_pairs(backend.incompatible_pairs)
        self.strings = TokenStrings(tokenizer)
        self.fmt = fmt or DeepSeekFormat(tokenizer.model_dir, model_name, default_thinking, tokenizer.max_token_chars)
        self.max_n, self.max_pending, self.request_timeout_s = max_n, max_pending, request_timeout_s
        self.created = int(time.time())
        self.keys = frozenset(api_keys or ())
        self.draining = False
        self.live: set[Generation] = set()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503), give the live ones ``timeout_s`` seconds, then fail the rest."""
        self.draining = True
        end = time.monotonic() + timeout_s
        while self.live and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for g in list(self.live):
            g.fail(BackendError("the gateway is shutting down (drain deadline)", 503))
        end = time.monotonic() + 2.0                 # let the error events go out
        while self.live and time.monotonic() < end:
            await asyncio.sleep(0.02)

    async def auth(self, request: Request) -> None:
        """Raises ApiError 401 unless the request carries one of the API keys (when there are any)."""
        if self.keys:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token.strip().encode() if scheme.lower() == "bearer" else b""
            if not given:
                given = request.headers.get("x-api-key", "").strip().encode()
            # compare with every key, constant time each: no timing hint of which prefix matched
            if not sum(hmac.compare_digest(given, k.encode()) for k in self.keys):
                raise ApiError("invalid or missing API key", 401)

    def check_model(self, name: str | None) -> None:
        """Raises ApiError 404 when ``name`` is given and is not the served model."""
        if name is not None and name != self.model_name:
            raise ApiError(f"model: the model `{name}` does not exist (served: `{self.model_name}`)", 404, "model")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dsv4-pd",
                "root": self.model_name, "parent": None, "max_model_len": self.backend.max_model_len}

    def admit(self, request: Request, arrival: float) -> float | None:
        """The request's deadline (monotonic s; None: none). Raises ApiError 503 (draining) or 400
        (a bad X-Request-Timeout)."""
        if self.draining:
            raise ApiError("the gateway is shutting down; retry on another replica", 503)
        h = request.headers.get("x-request-timeout")
        if h is None:
            return None if self.request_timeout_s is None else arrival + self.request_timeout_s
        try:
            v = float(h)
        except ValueError:
            v = -1.0
        if not 0 < v <= 1e7:
            raise ApiError("X-Request-Timeout: expected seconds in (0, 1e7]", 400, "X-Request-Timeout")
        return arrival + v

    async def handle(self, req, request: Request, texts: tuple[str, ...], prepare) -> Response:
        """Admit, check the model and the text fields, build the job off the event loop, serve it."""
        arrival = time.monotonic()
        deadline = self.admit(request, arrival)
        self.check_model(req.model)
        for f in texts:
            _check_utf8(getattr(req, f), f)
        job = await asyncio.to_thread(prepare, req)
        return await self.serve(job, request, arrival, deadline)

    async def serve(self, job: Job, request: Request, arrival: float, deadline: float | None) -> Response:
        """Run ``job``'s samples: a JSON body, or SSE whose headers wait for token #1 (so a refusal
        keeps its status). Raises ApiError 400 / 429 over the in-flight bound."""
        read_timeout = request.headers.get("x-stainless-read-timeout")    # the openai SDKs' own timeout
        if deadline is None and not job.stream and read_timeout:
            with contextlib.suppress(ValueError):           # the client gives up then: free the state then
                if 0 < float(read_timeout) <= 1e7:
                    deadline = arrival + float(read_timeout)
        pending = sum(len(g.job.samples) for g in self.live)
        if len(job.samples) > self.max_pending:
            raise ApiError(f"n: {len(job.samples)} choices exceed this gateway's limit of {self.max_pending} "
                           "samples in flight", 400, "n")
        if pending + len(job.samples) > self.max_pending:
            raise ApiError(f"too many requests in flight ({pending} samples, limit {self.max_pending}); retry later",
                           429)
        gen = Generation(self.backend, job, self.metrics, arrival, deadline, on_done=self.live.discard)
        self.live.add(gen)
        watcher = asyncio.create_task(_watch_disconnect(request, gen))
        handed_over = False
        try:
            if job.stream:
                first = await gen.next()      # headers wait for token #1 or a refusal (keeps its status)
                handed_over = True
                return StreamingResponse(_stream(job, gen, first, watcher), media_type=job.media_type,
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            while await gen.next() is not None:       # the assemblers keep the whole response
                pass
            return JSONResponse(job.body(gen.asms))
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_over:
                watcher.cancel()
                gen.cancel()

    async def health(self) -> JSONResponse:
        if self.draining:
            return JSONResponse({"healthy": False, "draining": True}, status_code=503)
        try:
            h = await self.backend.health()
        except Exception as e:
            return JSONResponse({"healthy": False, "error": f"{type(e).__name__}: {e}"}, status_code=503)
        return JSONResponse(h, status_code=200 if h.get("healthy") else 503)


def _check_utf8(value, field: str) -> None:
    """Raises ApiError 400 when a text field holds a lone surrogate (not encodable as UTF-8)."""
    if _token_ids(value):            # no text to check (and dumping 100k ids would cost ~10 ms)
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(f"{field}: text is not valid Unicode (a lone surrogate?)", 400, field) from None


# ---- the app ------------------------------------------------------------------------------------------
def create_app(backend: Backend, tokenizer, model_name: str, *, default_thinking: bool = True,
               fmt: DeepSeekFormat | None = None, max_n: int = 128,
               api_keys: Sequence[str] | None = None, metrics: GatewayMetrics | None = None,
               manage_backend: bool = True, max_pending: int = 4096,
               request_timeout_s: float | None = None, max_body_bytes: int = 32 << 20) -> FastAPI:
    """The gateway app.

    Args:
        backend: serves samples (``server.backends.base.Backend``).
        tokenizer: ``engine.tokenizer.Tokenizer`` of the served model (completions, logprob strings).
        model_name: the served model name; a request's ``model`` must equal it (else 404).
        default_thinking: thinking mode of a chat / Responses / Messages request that does not
            choose (``thinking``, ``reasoning_effort``, ``chat_template_kwargs.thinking``).
        fmt: the chat format (``server.gateway.dsformat.DeepSeekFormat``); built from the tokenizer's
            checkpoint directory by default.
        max_n: most choices per request (``n`` x prompts).
        api_keys: if given, /v1/* need ``Authorization: Bearer <key>`` or ``x-api-key: <key>``
            (Anthropic's header) (else 401).
        metrics: the ``GatewayMetrics`` to record into (a new one by default; ``app.state.metrics``).
        manage_backend: start the backend on startup and close it on shutdown.
        max_pending: most samples in flight in this gateway; a request that would exceed it gets
            429 with Retry-After (a bounded queue: the workers' queues are bounded too).
        request_timeout_s: default deadline of a request (s; None: none). A request may ask for a
            shorter or longer one with the ``X-Request-Timeout`` header (seconds); past it the
            request ends with 504 and both workers free its state. A non-streamed request from an
            openai SDK without either gets its client timeout (``X-Stainless-Read-Timeout``).
        max_body_bytes: the largest request body (bytes; 32 MiB by default, room for a 1M-token
            context of text); a larger one gets 413 before it is read (``server.gateway.body_limit``).

    ``app.state.drain(timeout_s)`` (SIGTERM, see ``server.gateway.uvicorn_server``): /health answers 503
    and new requests 503 at once; in-flight requests get ``timeout_s`` to finish, then end with a
    503 error event.
    """
    gw = Gateway(backend, tokenizer, model_name, default_thinking=default_thinking, fmt=fmt, max_n=max_n,
                 api_keys=api_keys, metrics=metrics, max_pending=max_pending, request_timeout_s=request_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_backend:
            await backend.start()
        try:
            yield
        finally:
            if manage_backend:
                await backend.close()

    app = FastAPI(title="dsv4-pd gateway", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    app.state.metrics, app.state.drain = gw.metrics, gw.drain
    install_error_handlers(app)
    _generation_routes(app, gw)
    _other_routes(app, gw)
    return app


def _generation_routes(app: FastAPI, gw: Gateway) -> None:
    """One route per API; each names its text fields (checked for lone surrogates) and its module's
    ``prepare_*`` (request -> Job, run off the event loop)."""
    auth, fmt, tok = [Depends(gw.auth)], gw.fmt, gw.tokenizer

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await gw.handle(req, request, ("messages", "tools", "stop"),
                               lambda r: prepare_chat(r, fmt, tok, gw.backend.max_model_len, gw.max_n))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, request: Request):
        return await gw.handle(req, request, ("prompt", "stop"), lambda r: prepare_completion(
            r, tok, gw.strings, gw.model_name, gw.backend.max_model_len, gw.max_n))

    @app.post("/v1/responses", dependencies=auth)
    async def responses(req: ResponsesRequest, request: Request):
        return await gw.handle(req, request, ("input", "tools"),
                               lambda r: prepare_responses(r, fmt, tok, gw.backend.max_model_len))

    @app.post("/v1/messages", dependencies=auth)
    async def messages(req: MessagesRequest, request: Request):
        return await gw.handle(req, request, ("messages", "system", "tools"),
                               lambda r: prepare_messages(r, fmt, tok, gw.backend.max_model_len))

    @app.post("/v1/messages/count_tokens", dependencies=auth)
    async def messages_count_tokens(req: MessagesCountRequest):
        gw.check_model(req.model)
        return await asyncio.to_thread(count_message_tokens, req, fmt, gw.backend.max_model_len)


def _other_routes(app: FastAPI, gw: Gateway) -> None:
    """/v1/models (the served model's card), /health (the backend's, 503 while draining), /metrics."""

    @app.get("/v1/models", dependencies=[Depends(gw.auth)])
    async def models():
        return {"object": "list", "data": [gw.model_card()]}

    @app.get("/v1/models/{model}", dependencies=[Depends(gw.auth)])
    async def model(model: str):
        gw.check_model(model)
        return gw.model_card()

    @app.get("/health")
    async def health():
        return await gw.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE)
