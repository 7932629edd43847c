"""The gateway's uvicorn server, with a draining shutdown.

SIGTERM (or SIGINT): ``app.state.drain`` runs first (/health 503 and new requests 503 at once,
in-flight requests get ``drain_timeout_s`` to finish, then end with an error event), then uvicorn
shuts down as usual and the process exits 0. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

log = logging.getLogger(__name__)


class GatewayServer(uvicorn.Server):
    """``uvicorn.Server`` for ``app`` (from ``server.gateway.app.create_app``) whose first exit signal
    drains it."""

    def __init__(self, app, config: uvicorn.Config, drain_timeout_s: float = 30.0):
        super().__init__(config)
        self.app, self.drain_timeout_s = app, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it after shutdown (exit status -15)
        if self._drain_task is not None or self._loop is None or not self.started:
            self.force_exit = self._drain_task is not None
            self.should_exit = True
            return
        log.info("gateway: %s: draining (up to %g s)", signal.Signals(sig).name, self.drain_timeout_s)
        self._loop.call_soon_threadsafe(self._start_drain)
        self._drain_task = True          # set at once: a second signal forces the exit

    def _start_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.app.state.drain(self.drain_timeout_s)
        except Exception:
            log.exception("gateway: drain failed")
        self.should_exit = True
