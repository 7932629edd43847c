"""Metrics of ``dsv4-bench serve``: per-request records -> vLLM's serving summary, table, plot.

Definitions follow vLLM ``benchmarks/serve.py`` (``calculate_metrics``):

* TTFT (ms): request sent -> first chunk carrying a token.
* ITL (ms): gaps between consecutive chunks carrying tokens, all requests pooled; a chunk with
  n > 1 tokens is one gap, as in vLLM.
* TPOT (ms): per request with > 1 output token, (E2E - TTFT) / (output tokens - 1).
* E2EL (ms): request sent -> last byte of the stream.
* Statistics: mean, median, std (population, numpy's default) and percentiles (numpy linear
  interpolation) over completed requests; 0 when there is no value.
* Throughput over the benchmark duration (s, first request sent -> last one done): requests/s
  (completed), output tokens/s, total (prompt + output) tokens/s, completed requests only.
* Goodput (req/s): completed requests meeting every given SLO (``ttft``, ``tpot``, ``e2el`` in ms,
  a value <= the SLO meets it) per second of duration.
* Max concurrency: most requests in flight at once (sent, not yet done), from the records.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request's outcome. Times in seconds; ``start_s`` from the benchmark start."""

    index: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    start_s: float = 0.0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    success: bool = False
    error: str = ""
    cached_tokens: int = 0          # usage.prompt_tokens_details.cached_tokens (the prefix cache)
    output_ids: list[int] = field(default_factory=list)   # streamed token_ids (when sent)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with <= 1 output token (vLLM)."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (ms). Raises ValueError."""
    out: dict[str, float] = {}
    for s in specs:
        key, sep, val = s.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"{s!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"{s!r}: {val!r} is not a number of milliseconds") from None
        if not ms > 0 or ms == float("inf"):
            raise ValueError(f"{s!r}: the SLO must be a positive finite number of ms")
        out[key] = ms
    return out


def parse_percentiles(spec: str) -> list[float]:
    """``"50,90,99"`` -> [50.0, 90.0, 99.0]; each in (0, 100]. Raises ValueError."""
    try:
        ps = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"{spec!r}: expected comma-separated numbers, e.g. 50,90,99") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"{spec!r}: percentiles must be in (0, 100]")
    return ps


def max_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once; a request ending when another starts does not overlap it."""
    events = sorted([(r.start_s, 1) for r in records] + [(r.start_s + r.e2el_s, -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _pct_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def _stats(name: str, values_ms: list[float], percentiles: list[float]) -> dict[str, float]:
    a = np.asarray(values_ms, dtype=float)
    empty = a.size == 0
    out = {f"mean_{name}_ms": 0.0 if empty else float(a.mean()),
           f"median_{name}_ms": 0.0 if empty else float(np.median(a)),
           f"std_{name}_ms": 0.0 if empty else float(a.std())}
    for p in percentiles:
        out[f"{_pct_key(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(a, p))
    return out


def is_good(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """A completed request meets every SLO given (TPOT of a 1-token request counts as 0, as vLLM)."""
    got = {"ttft": r.ttft_s * 1e3, "tpot": (r.tpot_s or 0.0) * 1e3, "e2el": r.e2el_s * 1e3}
    return r.success and all(got[k] <= v for k, v in slos_ms.items())


def summarize(records: list[RequestRecord], duration_s: float, percentiles: list[float] = (99.0,),
              slos_ms: dict[str, float] | None = None) -> dict:
    """The run's summary (vLLM's fields; times in ms, throughputs per second of ``duration_s``)."""
    ok = [r for r in records if r.success]
    dur = max(duration_s, 1e-9)
    total_in, total_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    s = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "total_cached_input_tokens": sum(r.cached_tokens for r in ok),
         "request_throughput": len(ok) / dur, "output_throughput": total_out / dur,
         "total_token_throughput": (total_in + total_out) / dur,
         "max_concurrent_requests": max_concurrency(records)}
    if slos_ms:
        s["request_goodput"] = sum(is_good(r, slos_ms) for r in ok) / dur
    per = {"ttft": [r.ttft_s * 1e3 for r in ok], "tpot": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
           "itl": [x * 1e3 for r in ok for x in r.itl_s], "e2el": [r.e2el_s * 1e3 for r in ok]}
    for name, vals in per.items():
        s.update(_stats(name, vals, list(percentiles)))
    return s


def format_summary(s: dict, percentiles: list[float] = (99.0,), slos_ms: dict[str, float] | None = None) -> str:
    """vLLM's "Serving Benchmark Result" block, then the latency metrics side by side (ms)."""
    w = 50
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
            ("Max concurrent requests:", s["max_concurrent_requests"])]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
        if slos_ms:
            rows.append(("Goodput SLOs (ms):", " ".join(f"{k}<={v:g}" for k, v in slos_ms.items())))
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]
    lines += [f"{k}{v:>{w - len(k)}}" if len(k) + len(str(v)) < w else f"{k} {v}" for k, v in rows]
    cols = ["mean", "median", "std"] + [_pct_key(p) for p in percentiles]
    lines.append("{s:{c}^{n}}".format(s=" Latency (ms) ", n=w, c="-"))
    lines.append(f"{'metric':<6}" + "".join(f"{c:>10}" for c in cols))
    for name in METRICS:
        lines.append(f"{name.upper():<6}" + "".join(f"{s[f'{c}_{name}_ms']:>10.2f}" for c in cols))
    lines.append("=" * w)
    return "\n".join(lines)


def plot(records: list[RequestRecord], path: str, title: str = "") -> None:
    """PNG: CDFs of TTFT / TPOT / ITL / E2EL (ms), requests in flight over time, and a per-request
    timeline (sent -> first token -> done). Needs matplotlib (ImportError otherwise)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ok = [r for r in records if r.success]
    data = {"ttft": [r.ttft_s * 1e3 for r in ok], "tpot": [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None],
            "itl": [x * 1e3 for r in ok for x in r.itl_s], "e2el": [r.e2el_s * 1e3 for r in ok]}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, vals) in zip(axes.flat, data.items()):
        v = np.sort(np.asarray(vals, dtype=float))
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
        ax.set(title=f"{name.upper()} CDF ({v.size} values)", xlabel="ms", ylabel="fraction <= x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    ax = axes.flat[4]
    ev = sorted([(r.start_s, 1) for r in records] + [(r.start_s + r.e2el_s, -1) for r in records])
    if ev:
        t, n = zip(*ev)
        ax.step(t, np.cumsum(n), where="post")
    ax.set(title="requests in flight", xlabel="s since start", ylabel="requests")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax = axes.flat[5]
    good = [(k, r) for k, r in enumerate(records) if r.success]
    bad = [(k, r) for k, r in enumerate(records) if not r.success]
    lw = max(0.5, min(2.0, 200 / max(1, len(records))))
    if good:
        ax.hlines([k for k, _ in good], [r.start_s for _, r in good], [r.start_s + r.ttft_s for _, r in good],
                  colors="tab:orange", lw=lw)
        ax.hlines([k for k, _ in good], [r.start_s + r.ttft_s for _, r in good],
                  [r.start_s + r.e2el_s for _, r in good], colors="tab:blue", lw=lw)
    if bad:
        ax.hlines([k for k, _ in bad], [r.start_s for _, r in bad], [r.start_s + r.e2el_s for _, r in bad],
                  colors="tab:red", lw=lw)
    ax.set(title="per request: to 1st token / decode / failed", xlabel="s since start", ylabel="request")
    ax.legend(handles=[Line2D([], [], color=c, lw=2, label=n) for c, n in
                       (("tab:orange", "to first token"), ("tab:blue", "decode"), ("tab:red", "failed"))],
              fontsize="small", loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
