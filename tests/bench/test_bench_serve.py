"""``dsv4-bench serve`` (bench.serve_bench / serve_data / serve_metrics): vLLM's metric definitions
on hand-made records, the datasets' lengths and filters, flag errors, and real runs against
``launch-pd`` processes (prefill + decode + gateway) on the tiny flash checkpoint."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import serve_bench, serve_data as sd
from bench.serve_metrics import (RequestRecord, format_summary, max_concurrency, parse_goodput, parse_percentiles,
                                 summarize)
from server.launch.local import free_port
from tests.pd_util import start_pd

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return sd.load_tokenizer()


# ---- metrics --------------------------------------------------------------------------------------
def _records() -> list[RequestRecord]:
    return [RequestRecord(0, prompt_tokens=10, output_tokens=5, start_s=0.0, ttft_s=0.1, itl_s=[0.05] * 4,
                          e2el_s=0.3, success=True),
            RequestRecord(1, prompt_tokens=20, output_tokens=3, start_s=0.5, ttft_s=0.3, itl_s=[0.1, 0.2],
                          e2el_s=0.6, success=True),
            RequestRecord(2, prompt_tokens=30, output_tokens=1, start_s=1.0, ttft_s=0.2, e2el_s=0.2, success=True),
            RequestRecord(3, prompt_tokens=40, start_s=0.25, e2el_s=0.05, error="HTTP 400: too long")]


def test_summary_values():
    s = summarize(_records(), 2.0, [50, 90, 99])
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (3, 1, 60, 9)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["max_concurrent_requests"] == 2
    # TTFT 100, 300, 200 ms; numpy linear percentiles, population std
    assert (s["mean_ttft_ms"], s["median_ttft_ms"]) == pytest.approx((200, 200))
    assert s["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)
    assert (s["p90_ttft_ms"], s["p99_ttft_ms"]) == pytest.approx((280, 298))
    # TPOT = (E2E - TTFT) / (out - 1): 200/4 = 50, 300/2 = 150; the 1-token request has none
    assert (s["mean_tpot_ms"], s["median_tpot_ms"], s["p99_tpot_ms"]) == pytest.approx((100, 100, 149))
    # ITLs pooled over requests: 50 x 4, 100, 200
    assert (s["mean_itl_ms"], s["median_itl_ms"], s["p99_itl_ms"]) == pytest.approx((500 / 6, 50, 195))
    assert (s["mean_e2el_ms"], s["median_e2el_ms"], s["p99_e2el_ms"]) == pytest.approx((1100 / 3, 300, 594))
    assert "request_goodput" not in s


@pytest.mark.parametrize("spec,good", [(["ttft:250"], 2), (["ttft:250", "tpot:100"], 2), (["tpot:40"], 1),
                                       (["ttft:250", "e2el:250"], 1), (["ttft:300", "tpot:150", "e2el:600"], 3),
                                       (["e2el:100"], 0)])
def test_goodput(spec, good):
    """Good = completed and every SLO met (<=); a 1-token request's TPOT counts as 0 (vLLM)."""
    slos = parse_goodput(spec)
    s = summarize(_records(), 2.0, [99], slos)
    assert s["request_goodput"] == pytest.approx(good / 2.0)
    assert "Goodput SLOs (ms):" in format_summary(s, [99], slos)


def test_empty_and_ties():
    s = summarize([RequestRecord(0, error="refused")], 1.0)
    assert (s["completed"], s["failed"], s["mean_ttft_ms"], s["p99_itl_ms"]) == (0, 1, 0.0, 0.0)
    back_to_back = [RequestRecord(0, start_s=0, e2el_s=1), RequestRecord(1, start_s=1, e2el_s=1)]
    assert max_concurrency(back_to_back) == 1
    assert max_concurrency(back_to_back + [RequestRecord(2, start_s=0.5, e2el_s=2)]) == 2


def test_format_summary_table():
    s = summarize(_records(), 2.0, [50, 99])
    out = format_summary(s, [50, 99])
    lines = out.splitlines()
    assert "Serving Benchmark Result" in lines[0]
    assert next(ln for ln in lines if ln.startswith("Successful requests:")).split()[-1] == "3"
    assert next(ln for ln in lines if ln.startswith("Failed requests:")).split()[-1] == "1"
    assert next(ln for ln in lines if ln.startswith("metric")).split() == ["metric", "mean", "median", "std", "p50",
                                                                          "p99"]
    assert next(ln for ln in lines if ln.startswith("TPOT")).split() == ["TPOT", "100.00", "100.00", "50.00",
                                                                        "100.00", "149.00"]


@pytest.mark.parametrize("bad", [["foo:1"], ["ttft"], ["ttft:-1"], ["ttft:abc"], ["tpot:inf"]])
def test_parse_goodput_errors(bad):
    with pytest.raises(ValueError):
        parse_goodput(bad)


def test_parse_percentiles():
    assert parse_percentiles("50,90,99.9") == [50, 90, 99.9]
    for bad in ("0", "101", "a", ""):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_arrival_gaps():
    assert serve_bench.arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    gaps = serve_bench.arrival_gaps(4000, 10.0, 1.0, 0)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.1, rel=0.1)                      # exponential: std = mean
    bursty = serve_bench.arrival_gaps(4000, 10.0, 0.25, 0)
    assert np.mean(bursty) == pytest.approx(0.1, rel=0.1)
    assert np.std(bursty) == pytest.approx(0.2, rel=0.15)                   # gamma: std = mean / sqrt(k)


# ---- datasets ------------------------------------------------------------------------------------
def test_random_lengths(tok):
    reqs = sd.random_requests(tok, 20, 64, 8, 0.0, seed=3)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(64, 8)] * 20
    assert all(1000 <= i < 60000 for r in reqs for i in r.prompt_ids)
    ranged = sd.random_requests(tok, 200, 100, 10, 0.5, seed=3)
    assert {r.prompt_len for r in ranged} <= set(range(50, 151)) and len({r.prompt_len for r in ranged}) > 20
    assert {r.output_len for r in ranged} <= set(range(5, 16))
    assert min(r.prompt_len for r in ranged) < 60 and max(r.prompt_len for r in ranged) > 140
    again = sd.random_requests(tok, 20, 64, 8, 0.0, seed=3)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]
    assert sd.random_requests(tok, 1, 64, 8, 0.0, seed=4)[0].prompt_ids != reqs[0].prompt_ids
    assert reqs[0].prompt == tok.decode(reqs[0].prompt_ids)


def _conv(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_file(tok, tmp_path):
    good_q, good_a = "Explain the theory of relativity in simple words, please.", \
        "Relativity says that the laws of physics are the same for every observer moving steadily."
    late_q, late_a = "What is the capital city of France and why?", "Paris is the capital of France since long ago."
    data = [_conv(("human", good_q), ("gpt", good_a)),
            _conv(("human", "Hi"), ("gpt", good_a)),                                 # prompt < 4 tokens
            _conv(("human", good_q), ("gpt", "OK.")),                                # output < 4 tokens
            _conv(("human", "word " * 1100), ("gpt", good_a)),                       # prompt > 1024
            _conv(("human", "word " * 600), ("gpt", "word " * 1500)),                # total > 2048
            _conv(("human", good_q)),                                                # no answer
            _conv(("gpt", "Hello, how can I help?"), ("human", late_q), ("gpt", late_a), ("human", "more"))]
    assert len(tok.encode("word " * 1100)) > 1024 and 600 <= len(tok.encode("word " * 600)) <= 1024
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sd.sharegpt_file_requests(tok, str(path), 2, seed=0)
    got = {r.prompt: (r.prompt_len, r.output_len) for r in reqs}
    assert got == {good_q: (len(tok.encode(good_q)) + 1, len(tok.encode(good_a))),
                   late_q: (len(tok.encode(late_q)) + 1, len(tok.encode(late_a)))}
    assert all(r.prompt_ids[0] == tok.bos_id for r in reqs)
    more = sd.sharegpt_file_requests(tok, str(path), 5, seed=0)                # oversampled, as vLLM
    assert len(more) == 5 and {r.prompt for r in more} == {good_q, late_q}
    fixed = sd.sharegpt_file_requests(tok, str(path), 10, seed=0, output_len=7)   # the "OK." one counts now
    assert {r.output_len for r in fixed} == {7} and len(fixed) == 10
    bad = tmp_path / "bad.json"
    bad.write_text('{"conversations": []}')
    with pytest.raises(sd.DataError, match="expected a JSON list"):
        sd.sharegpt_file_requests(tok, str(bad), 1)


def test_sharegpt_synthetic_lengths(tok):
    reqs = sd.sharegpt_synthetic_requests(tok, 400, seed=0)
    ins, outs = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    (mi, _), (mo, _) = sd.SHAREGPT_LOGNORMAL["input"], sd.SHAREGPT_LOGNORMAL["output"]
    assert 0.8 * mi <= statistics.median(ins) <= 1.2 * mi
    assert 0.8 * mo <= statistics.median(outs) <= 1.2 * mo
    assert all(4 <= i <= 1024 and o >= 4 and i + o <= 2048 for i, o in zip(ins, outs))
    assert max(ins) > 3 * mi                                           # heavy tail, not a constant
    assert [r.prompt_ids for r in sd.sharegpt_synthetic_requests(tok, 5, seed=0)] == [r.prompt_ids for r in reqs[:5]]


def test_infinitebench_synthetic(tok):
    reqs = sd.infinitebench_synthetic_requests(tok, 2, 32768, 16, seed=1)
    for r in reqs:
        assert r.prompt_len == 32768 and r.prompt_ids[0] == tok.bos_id and r.output_len == 16
        assert len(r.answer) == 5 and r.answer.isdigit()
        assert f"The pass key is {r.answer}. Remember it." in r.prompt
        assert r.prompt.endswith("What is the pass key? The pass key is")
        assert abs(len(tok.encode(r.prompt)) + 1 - 32768) <= 64          # the text re-tokenises alike
    assert reqs[0].answer != reqs[1].answer
    depth = [r.prompt.index("The pass key is") / len(r.prompt) for r in sd.infinitebench_synthetic_requests(
        tok, 8, 1024, 16, seed=2)]
    assert max(depth) - min(depth) > 0.2                               # the needle moves
    with pytest.raises(sd.DataError, match="input length 20"):
        sd.infinitebench_synthetic_requests(tok, 1, 20, 16)


def test_infinitebench_file(tok, tmp_path):
    path = tmp_path / "ib.jsonl"
    lines = [{"id": 0, "context": "The grass is green. " * 200 + "The pass key is 31337.",
              "input": "What is the pass key?", "answer": ["31337"], "options": []},
             {"context": "short", "input": "Q?", "answer": "A"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = sd.infinitebench_file_requests(tok, str(path), 3, 128, 16)
    assert [r.prompt_len for r in reqs[:2]] == [128, len(tok.encode("short\n\nQ?")) + 1]
    assert [r.answer for r in reqs] == ["31337", "A", "31337"]
    assert reqs[0].prompt.endswith("What is the pass key?")             # middle-truncated: the question stays
    assert reqs[0].prompt.startswith("The grass is green.")
    path.write_text('{"context": "x"}\n')
    with pytest.raises(sd.DataError, match=r"ib.jsonl:1: .*'input'"):
        sd.infinitebench_file_requests(tok, str(path), 1, 128, 16)


# ---- flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,flag", [(["--num-prompts", "0"], "--num-prompts"),
                                        (["--goodput", "ttft:1", "speed:2"], "--goodput"),
                                        (["--random-range-ratio", "1"], "--random-range-ratio"),
                                        (["--request-rate", "0"], "--request-rate"),
                                        (["--metric-percentiles", "0,50"], "--metric-percentiles"),
                                        (["--dataset", "sharegpt", "--dataset-path", "/nonexistent.json"],
                                         "--dataset-path"),
                                        (["--dataset", "infinitebench", "--infinitebench-input-len", "8"],
                                         "--infinitebench-input-len"),
                                        (["--endpoint", "embeddings"], "--endpoint")])
def test_bad_flags(extra, flag, capsys):
    with pytest.raises(SystemExit) as e:
        serve_bench.main(["--base-url", "http://127.0.0.1:1", "--num-prompts", "1"] + extra)
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_bad_dataset_file(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text("{not json")
    with pytest.raises(SystemExit):
        serve_bench.main(["--base-url", "http://127.0.0.1:1", "--dataset", "sharegpt", "--dataset-path", str(f)])
    assert "argument --dataset-path" in capsys.readouterr().err


def test_server_down(capsys):
    rc = serve_bench.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1",
                           "--random-input-len", "4", "--random-output-len", "2"])
    assert rc == 1
    assert "cannot reach the server" in capsys.readouterr().err


# ---- real processes ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pd(ckpt, tmp_path_factory):
    pd = start_pd(ckpt, tmp_path_factory.mktemp("bench") / "pd.log")
    yield pd
    pd.stop()


def _bench(pd, tmp_path, name, *flags) -> dict:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, "-m", "bench.cli", "serve", "--base-url", pd.base_url, "--result-file",
                        str(out), *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Serving Benchmark Result" in r.stdout
    return json.loads(out.read_text())


def test_completions_run(pd, tmp_path):
    png = tmp_path / "serve.png"
    d = _bench(pd, tmp_path, "completions", "--num-prompts", "6", "--random-input-len", "64",
               "--random-output-len", "8", "--max-concurrency", "2", "--goodput", "ttft:60000", "e2el:120000",
               "--metric-percentiles", "50,99", "--plot", str(png))
    s, reqs = d["summary"], d["requests"]
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (6, 0, 384, 48)
    assert s["max_concurrent_requests"] == 2                           # the semaphore held
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])    # generous SLOs: all good
    assert s["request_throughput"] == pytest.approx(6 / s["duration_s"])
    assert d["config"]["model"] == "deepseek_v4" and d["config"]["endpoint"] == "completions"
    for r in reqs:
        assert r["success"] and r["prompt_tokens"] == 64 and r["output_tokens"] == 8
        assert 0 < r["ttft_s"] <= r["e2el_s"]
        assert len(r["itl_s"]) == 7                                    # the gateway streams one token per chunk
        assert r["tpot_s"] == pytest.approx((r["e2el_s"] - r["ttft_s"]) / 7)
        assert r["start_s"] + r["e2el_s"] <= s["duration_s"] + 1e-6
    assert s["median_ttft_ms"] == pytest.approx(statistics.median(r["ttft_s"] * 1e3 for r in reqs))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_run_and_failures(pd, tmp_path, monkeypatch, capsys):
    d = _bench(pd, tmp_path, "chat", "--endpoint", "chat", "--num-prompts", "2", "--random-input-len", "64",
               "--random-output-len", "8")
    s = d["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 0, 16)
    for r in d["requests"]:
        assert r["output_tokens"] == 8 and len(r["itl_s"]) == 7 and r["ttft_s"] <= r["e2el_s"]
        assert r["prompt_tokens"] > 64 - 16                          # the server's count, chat template included
    # in-process, without matplotlib: a clear message, no plot, the run still succeeds
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png, out = tmp_path / "none.png", tmp_path / "one.json"
    assert serve_bench.main(["--base-url", pd.base_url, "--num-prompts", "1", "--random-input-len", "16",
                             "--random-output-len", "2", "--result-file", str(out), "--plot", str(png)]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err and not png.exists()
    assert json.loads(out.read_text())["summary"]["total_output_tokens"] == 2
    # prompt + max_tokens beyond the context (4096): every request refused, counted, the run still ends
    d = _bench(pd, tmp_path, "refused", "--num-prompts", "2", "--random-input-len", "4100", "--random-output-len", "8")
    assert (d["summary"]["completed"], d["summary"]["failed"]) == (0, 2)
    assert all(r["error"].startswith("HTTP 400") for r in d["requests"])
