"""Running one request's samples against the backend: ``Generation`` (used by ``server.gateway.app``).

Every sample of a ``server.gateway.jobs.Job`` runs as its own task, feeding its assembler with the backend's
token events; ``Generation.next`` hands the pieces out in arrival order. It records the per-sample
metrics (vLLM's definitions: TTFT from arrival to the first token, ITL between token events,
TPOT = (e2e - TTFT) / (tokens - 1), request_success by reason) and aborts the samples of a client
that left, a failed sibling or a stop string by closing their backend streams.
"""
from __future__ import annotations

import asyncio
import logging
import time

from server.backends.base import Backend, BackendError, GenRequest
from server.gateway.jobs import Job, Piece, Sample
from server.gateway.protocol import ApiError
from server.metrics import GatewayMetrics

log = logging.getLogger(__name__)
_DONE, _GONE = object(), object()


class ClientGone(Exception):
    """The client disconnected; nothing more is sent."""


# ---- running a job's samples ---------------------------------------------------------------------------
class Generation:
    """Runs every sample of ``job`` concurrently on ``backend``; ``next()`` yields their pieces.

    Each sample task feeds its assembler (``job.assembler``) and closes its backend iterator when
    done (a stop string or ``cancel`` aborts the sample there). Records the per-sample metrics; a prompt's
    tokens count in prompt_tokens once its first sample has a token (a refused request adds none).
    """

    def __init__(self, backend: Backend, job: Job, metrics: GatewayMetrics, arrival: float,
                 deadline: float | None = None, on_done=None):
        self.job, self._backend, self._m, self._arrival = job, backend, metrics, arrival
        self._deadline, self._on_done = deadline, on_done
        self._q: asyncio.Queue = asyncio.Queue()
        self.asms = {s.index: job.assembler(s) for s in job.samples}
        self._left = len(job.samples)     # tasks still running
        self._open = len(job.samples)     # samples whose _DONE next() has not seen
        self._cancelled = False
        self._prefilled: set[int] = set()     # prompt indexes counted in prompt_tokens
        self.client_gone = False
        metrics.running.inc()
        self._tasks = [asyncio.create_task(self._run(s)) for s in job.samples]
        for t in self._tasks:                 # a callback: also runs for a task cancelled before it started
            t.add_done_callback(self._task_done)

    def _task_done(self, _task) -> None:
        self._left -= 1
        if self._left == 0:
            self._m.running.dec()
            if self._on_done is not None:
                self._on_done(self)

    @property
    def completion_tokens(self) -> int:
        return sum(a.num_tokens for a in self.asms.values())

    def cancel(self) -> None:
        """Abort every unfinished sample (idempotent, synchronous: safe in a cancelled scope)."""
        if not self._cancelled:
            self._cancelled = True
            for t in self._tasks:
                t.cancel()

    def fail(self, e: Exception) -> None:
        """End the job with ``e`` (the gateway shuts down): ``next`` raises it, samples are aborted."""
        self._q.put_nowait((None, e))

    def client_left(self) -> None:
        self.client_gone = True
        self.cancel()
        self._q.put_nowait((None, _GONE))

    async def next(self) -> tuple[Sample, Piece] | None:
        """The next piece of any sample; None when all finished.

        Raises: BackendError / ApiError of a failed sample (the others are then cancelled);
        ClientGone after a disconnect.
        """
        while self._open:
            if self.client_gone:
                raise ClientGone()
            s, item = await self._q.get()
            if item is _GONE:
                continue
            if item is _DONE:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                self.cancel()
                raise item
            return s, item
        if self.client_gone:
            raise ClientGone()
        return None

    async def _run(self, s: Sample) -> None:
        asm, m = self.asms[s.index], self._m
        it = self._backend.generate(GenRequest(s.request_id, self.job.prompts[s.prompt_index], s.params,
                                               self._deadline))
        first = last = None
        reason = "abort"
        try:
            async for ev in it:
                now = time.monotonic()
                if first is None:
                    first = now
                    m.ttft.observe(now - self._arrival)
                    if s.prompt_index not in self._prefilled:      # counted once it is prefilled
                        self._prefilled.add(s.prompt_index)
                        self.job.cached[s.prompt_index] = ev.num_cached_tokens
                        m.prompt_tokens.inc(len(self.job.prompts[s.prompt_index]))
                    if ev.queue_time_s is not None:
                        m.queue.observe(ev.queue_time_s)
                else:
                    m.itl.observe(now - last)
                last = now
                p = asm.feed(ev)
                m.generation_tokens.inc(p.num_tokens)
                self._q.put_nowait((s, p))
                if asm.finished:
                    break
            if not asm.finished:                 # the stream ended without a final event
                self._q.put_nowait((s, asm.abort()))
            reason = asm.finish_reason
            if first is not None:
                e2e = time.monotonic() - self._arrival
                m.e2e.observe(e2e)
                if asm.num_tokens > 1:
                    m.tpot.observe((e2e - (first - self._arrival)) / (asm.num_tokens - 1))
        except BackendError as e:
            reason = "error"
            self._q.put_nowait((s, self.job.backend_error(e)))
        except asyncio.CancelledError:
            raise
        except Exception as e:          # a gateway bug: report it, keep serving
            log.exception("sample %s failed", s.request_id)
            reason = "error"
            self._q.put_nowait((s, ApiError(f"internal error: {type(e).__name__}", 500)))
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()              # aborts the sample if it is unfinished
                except Exception:
                    log.exception("closing the stream of %s failed", s.request_id)
            m.success(reason)
            self._q.put_nowait((s, _DONE))
