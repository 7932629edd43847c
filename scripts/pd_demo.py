"""The main job, end to end: start a prefill worker, a decode worker and the gateway on this
machine (tiny checkpoint, loopback), stream one chat completion through them with the ``openai``
client (thinking mode, DeepSeek's default: the reasoning streams first, then the answer), and print
them with the Prometheus metrics the request moved.

    .venv/bin/python scripts/pd_demo.py [--model models/tiny-flash] [--config configs/tiny-flash.yaml]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.launch.local import LocalPD, log_tail  # noqa: E402

WATCH = ("dsv4:prompt_tokens_total", "dsv4:generation_tokens_total", "dsv4:request_success_total",
         "dsv4:time_to_first_token_seconds_count", "dsv4:time_to_first_token_seconds_sum",
         "dsv4:inter_token_latency_seconds_count", "dsv4:e2e_request_latency_seconds_sum",
         "dsv4:kv_transfer_bytes_total", "dsv4:kv_transfer_latency_seconds_sum", "dsv4:kv_transfer_failures_total")


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value for the watched series (0 where absent)."""
    out = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = re.match(r"^([a-z0-9_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in WATCH:
            labels = re.sub(r'(model_name|role)="[^"]*",?', "", m.group(2) or "").replace(",}", "}").replace("{}", "")
            out[m.group(1) + labels] = float(m.group(3))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/tiny-flash")
    ap.add_argument("--config", default="configs/tiny-flash.yaml")
    ap.add_argument("--prompt", default="Write one sentence about the sea.")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--log", default="out/pd-demo.log")
    a = ap.parse_args()
    if not Path(a.model, "config.json").is_file():
        print(f"pd_demo: --model {a.model}: no checkpoint (run dsv4-make-tiny first)", file=sys.stderr)
        return 2
    Path(a.log).parent.mkdir(parents=True, exist_ok=True)
    pd = LocalPD(a.config, a.model, log_path=a.log)
    print(f"starting a prefill worker, a decode worker and the gateway (log: {a.log}) ...", flush=True)
    t0 = time.monotonic()
    try:
        pd.start(timeout_s=600)
    except RuntimeError as e:
        print(f"pd_demo: {e}\n{log_tail(a.log)}", file=sys.stderr)
        return 1
    base, metrics_urls = pd.base_url, pd.metrics_urls
    try:
        print(f"ready in {time.monotonic() - t0:.1f} s: OpenAI API at {base}/v1\n", flush=True)
        before = {n: scrape(u) for n, u in metrics_urls.items()}
        client = OpenAI(base_url=base + "/v1", api_key="none")
        model = client.models.list().data[0].id
        print(f"> {a.prompt}\n< ", end="", flush=True)
        t1, first, usage, part = time.monotonic(), None, None, None
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": a.prompt}], max_tokens=a.max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                reasoning = getattr(ch.delta, "reasoning_content", None)
                for kind, text in (("reasoning", reasoning), ("answer", ch.delta.content)):
                    if text:
                        first = first or time.monotonic()
                        if kind != part:
                            print(f"\n[{kind}] ", end="")
                            part = kind
                        print(text, end="", flush=True)
        e2e = time.monotonic() - t1
        reasoning = getattr(getattr(usage, "completion_tokens_details", None), "reasoning_tokens", None)
        print(f"\n\n(random tiny weights: the text is noise; the path is real)\nTTFT {1000 * ((first or t1) - t1):.0f} ms, "
              f"E2E {e2e:.2f} s; prompt {usage.prompt_tokens} tokens (DeepSeek's chat format: the reasoning-effort "
              f"preamble, the turn markers, <think>), completion {usage.completion_tokens} tokens"
              + (f", {reasoning} of them reasoning" if reasoning is not None else ""))
        time.sleep(0.3)
        after = {n: scrape(u) for n, u in metrics_urls.items()}
        print("\nmetrics moved by this request (before -> after):")
        for n in metrics_urls:
            for k in sorted(after[n]):
                if after[n][k] != before[n].get(k, 0.0):
                    print(f"  {n:8s} {k:75s} {before[n].get(k, 0.0):>10.4g} -> {after[n][k]:.4g}")
        return 0
    finally:
        pd.stop()


if __name__ == "__main__":
    sys.exit(main())
