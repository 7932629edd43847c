"""Prometheus metrics, vLLM's names and meanings under the prefix ``dsv4:`` (reference/peers.md A.7).

Gateway (per request, as the client sees it): TTFT, ITL, TPOT, E2E latency, queue time, token and
request counters; and the prefill/decode pairs it will not route to (``incompatible_pairs``). Workers (per engine): running / waiting requests, state-pool usage, prefill time
(prefill worker), the KV-state transfer (bytes, latency, failures) and, with MTP (next_n > 0), the
speculative-decoding counters (``spec_decode_*``, read from the engine's ``SpecStats`` at each
scrape). Each process owns a
``CollectorRegistry`` so several apps in one process (tests) do not share counters.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtransfer.compat import CAUSES

disable_created_metrics()      # no *_created series (vLLM exports none)
PREFIX = "dsv4:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's buckets (vllm/v1/metrics/loggers.py), seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class GatewayMetrics:
    """Request-level metrics of the gateway. Labels: ``model_name`` (and ``finished_reason``)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        lbl = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (s)", lbl,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency (s), per token", lbl,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Per request: (e2e - ttft) / (output tokens - 1) (s)", lbl, buckets=ITL_BUCKETS,
                              registry=r).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency (s)", lbl,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Time waiting for admission (s)", lbl,
                               buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", lbl,
                                         registry=r).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                lbl + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self._model = model_name
        self.running = Gauge(PREFIX + "num_requests_running", "Requests being served by this gateway", lbl,
                             registry=r).labels(model_name)
        self._pairs: _PairsCollector | None = None

    def success(self, finished_reason: str) -> None:
        self._success.labels(self._model, finished_reason).inc()

    def track_pairs(self, report: Callable[[], list[dict]]) -> None:
        """Export ``dsv4:incompatible_pairs`` (gauge, labels model_name and cause): healthy
        (prefill, decode) pairs the gateway never chooses because the transfer handshake would refuse
        them, by the first difference (cause: transport | kv_dtype | weights | config | layout,
        ``kvtransfer.compat.CAUSES``). ``report``: () -> [{"cause": ...}, ...], read at each scrape
        (``PDBackend.incompatible_pairs``). A second call replaces the first's ``report``."""
        if self._pairs is None:
            self._pairs = _PairsCollector(self._model)
            self.registry.register(self._pairs)
        self._pairs.report = report

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PairsCollector:
    """``dsv4:incompatible_pairs`` computed at scrape time, one series per cause (0 included)."""

    def __init__(self, model_name: str):
        self.model, self.report = model_name, None

    def collect(self):
        g = GaugeMetricFamily(PREFIX + "incompatible_pairs", "Healthy prefill/decode pairs never chosen: the "
                              "transfer handshake would refuse them (by first difference)",
                              labels=["model_name", "cause"])
        counts = dict.fromkeys(CAUSES, 0)
        for pair in self.report() if self.report else ():
            counts[pair["cause"]] = counts.get(pair["cause"], 0) + 1
        for cause, n in counts.items():
            g.add_metric([self.model, cause], n)
        yield g


class WorkerMetrics:
    """Engine and transfer metrics of one prefill or decode worker. Labels: ``model_name``, ``role``."""

    def __init__(self, model_name: str, role: str, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        lbl, v = ["model_name", "role"], (model_name, role)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch", lbl,
                             registry=r).labels(*v)
        self.waiting = Gauge(PREFIX + "num_requests_waiting",
                             "Requests queued (decode: reserved, waiting for their state)", lbl,
                             registry=r).labels(*v)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of state-pool blocks in use (0..1)", lbl,
                              registry=r).labels(*v)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled here (prefill) "
                                     "or received as state (decode)", lbl, registry=r).labels(*v)
        self._by_source = Counter(PREFIX + "prompt_tokens_by_source", "Prompt tokens by where their state came "
                                  "from: local_compute (prefilled here), cache_hit (the prefix cache) or "
                                  "kv_transfer (received)", lbl + ["source"], registry=r)
        for source in ("local_compute", "cache_hit", "kv_transfer"):
            self._by_source.labels(*v, source)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens sampled here", lbl,
                                         registry=r).labels(*v)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                                lbl + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._success.labels(*v, reason)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Prefill: arrival to first scheduled; "
                               "decode: reserve received to state slots reserved (s)", lbl, buckets=E2E_BUCKETS,
                               registry=r).labels(*v)
        if role == "prefill":
            self.prefill_time = Histogram(PREFIX + "request_prefill_time_seconds",
                                          "Per request: first scheduled to token #1 sampled, the prefill (s)", lbl,
                                          buckets=TTFT_BUCKETS, registry=r).labels(*v)
        else:
            self.reservation_wait = Histogram(PREFIX + "request_reservation_wait_seconds",
                                              "Per sample: state slots reserved to the transferred state "
                                              "committed (prefill queue + compute + transfer) (s)", lbl,
                                              buckets=E2E_BUCKETS, registry=r).labels(*v)
        self.transfer_bytes = Counter(PREFIX + "kv_transfer_bytes", "KV-state bytes sent (prefill) / received "
                                      "(decode)", lbl, registry=r).labels(*v)
        self.transfer_time = Histogram(PREFIX + "kv_transfer_latency_seconds",
                                       "Per request: first state frame to acknowledged commit (s)", lbl,
                                       buckets=TRANSFER_BUCKETS, registry=r).labels(*v)
        self._transfer_failures = Counter(PREFIX + "kv_transfer_failures", "Failed or refused transfers by cause",
                                          lbl + ["cause"], registry=r)
        self._v = v

    def success(self, finished_reason: str) -> None:
        self._success.labels(*self._v, finished_reason).inc()

    def prompt(self, num_tokens: int, source: str) -> None:
        """Count ``num_tokens`` prompt tokens; source: local_compute | cache_hit | kv_transfer (vLLM's
        ``prompt_tokens_by_source``)."""
        self.prompt_tokens.inc(num_tokens)
        self._by_source.labels(*self._v, source).inc(num_tokens)

    def transfer_failure(self, cause: str) -> None:
        """cause: checksum | handshake | timeout | fenced | aborted | send | malformed."""
        self._transfer_failures.labels(*self._v, cause).inc()

    def track_spec(self, stats: Callable[[], object]) -> None:
        """Export vLLM's speculative-decoding counters, read at each scrape from ``stats()`` (the
        engine's ``SpecStats``, ``engine.core.spec_decode``): ``dsv4:spec_decode_num_drafts_total``
        (verify steps that carried drafts), ``_num_draft_tokens_total`` (drafts proposed),
        ``_num_accepted_tokens_total`` (drafts accepted) and ``_num_accepted_tokens_per_pos_total``
        (label ``position``, 0-based as vLLM's: drafts accepted at that draft position). Call once,
        only when the engine drafts (next_n > 0), as vLLM exports them only with a drafter."""
        self.registry.register(_SpecCollector(self._v, stats))

    def track_prefix_cache(self, stats: Callable[[], object]) -> None:
        """Export vLLM's prefix-cache counters, read at each scrape from ``stats()`` (the engine's
        ``engine.core.prefix_cache.PrefixCache``): ``dsv4:prefix_cache_queries_total`` (prompt
        tokens looked up) and ``dsv4:prefix_cache_hits_total`` (of those, tokens whose state came
        from the cache), plus ``dsv4:prefix_cache_evictions_total`` (entries). Call once, only
        with prefix caching on."""
        self.registry.register(_PrefixCollector(self._v, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCollector:
    """``dsv4:prefix_cache_*`` counters computed at scrape time from the engine's ``PrefixCache``."""

    def __init__(self, labels: tuple[str, str], stats: Callable[[], object]):
        self.labels, self.stats = list(labels), stats

    def collect(self):
        pc = self.stats()
        for name, doc, value in (("queries", "Prompt tokens looked up in the prefix cache", pc.queries),
                                 ("hits", "Prompt tokens whose state came from the prefix cache", pc.hits),
                                 ("evictions", "Prefix-cache entries evicted", pc.evictions)):
            c = CounterMetricFamily(PREFIX + "prefix_cache_" + name, doc, labels=["model_name", "role"])
            c.add_metric(self.labels, value)
            yield c


class _SpecCollector:
    """``dsv4:spec_decode_*`` counters computed at scrape time from the engine's cumulative
    ``SpecStats`` (the engine counts; the worker loop need not feed anything)."""

    def __init__(self, labels: tuple[str, str], stats: Callable[[], object]):
        self.labels, self.stats = list(labels), stats

    def collect(self):
        st, lbl = self.stats(), ["model_name", "role"]
        per_pos = list(st.num_accepted_tokens_per_pos)   # a copy: the engine thread may append meanwhile
        for name, doc, value in (
                ("num_drafts", "Verify steps that carried draft tokens (MTP)", st.num_drafts),
                ("num_draft_tokens", "Draft tokens proposed (MTP)", st.num_draft_tokens),
                ("num_accepted_tokens", "Draft tokens accepted", st.num_accepted_tokens)):
            c = CounterMetricFamily(PREFIX + "spec_decode_" + name, doc, labels=lbl)
            c.add_metric(self.labels, value)
            yield c
        c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by draft position (0-based)", labels=lbl + ["position"])
        for pos, n in enumerate(per_pos):
            c.add_metric(self.labels + [str(pos)], n)
        yield c
