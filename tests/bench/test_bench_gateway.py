"""``dsv4-bench gateway`` (bench.bench_gateway; the replay: bench.gateway_replay): the replayed reply,
the fake backend, and a tiny real run (a gateway child process, 1 and 4 streams of 50 tokens) checked
stream by stream."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gateway_replay as bg
from engine.core.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.checkpoint.make_tiny import copy_tokenizer
from server.backends.base import GenRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A directory with the real DeepSeek-V4 tokenizer: all the gateway needs of a checkpoint."""
    d = tmp_path_factory.mktemp("tok")
    copy_tokenizer(d)
    return d


def test_reply_ids(model_dir):
    tok = Tokenizer(model_dir)
    end = tok.encode(bg.THINK_END)
    assert len(end) == 1
    for n in (50, 575, 800, 1000):
        ids = bg.reply_ids(tok, n)
        assert len(ids) == n and ids.count(end[0]) == 1
        text = tok.decode(ids)
        assert "\ufffd" not in text                      # no character cut in half, even when repeated
    full = tok.decode(bg.reply_ids(tok, 800))
    reasoning, answer = full.split(bg.THINK_END)
    assert "同步复制" in reasoning and "🙂" in reasoning and "🚀" in answer
    assert len(bg.reply_ids(tok, 0)) == len(tok.encode(bg.REASONING)) + 1 + len(tok.encode(bg.ANSWER))
    # a cut inside a multi-byte character is patched with "." tokens, the length kept
    emoji = bg._fit(tok, "🙂🙂🙂", 4)
    assert len(emoji) == 4 and not tok.decode(emoji).endswith("\ufffd")


def test_replay_backend_one_token_per_event():
    backend = bg.ReplayBackend([5, 6, 7, 8])

    async def events(max_new: int):
        req = GenRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=max_new))
        return [ev async for ev in backend.generate(req)]

    evs = asyncio.run(events(100))
    assert [e.token_ids for e in evs] == [[5], [6], [7], [8]]
    assert [(e.finished, e.finish_reason) for e in evs] == [(False, None)] * 3 + [(True, "length")]
    assert evs[0].num_prompt_tokens == 3 and evs[0].queue_time_s == 0.0
    assert [e.token_ids for e in asyncio.run(events(2))] == [[5], [6]]
    assert asyncio.run(backend.health()) == {"healthy": True}


def test_tiny_run_counts_every_chunk(model_dir, tmp_path):
    out, out2 = tmp_path / "a.json", tmp_path / "b.json"
    cmd = [sys.executable, "-m", "bench.cli", "gateway", "--model", str(model_dir), "--concurrency", "1,4",
           "--tokens-per-stream", "50", "--streams-per-level", "6", "--non-stream", "2", "--label", "tiny"]
    r = subprocess.run(cmd + ["--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["label"] == "tiny" and res["config"]["tokens_per_stream"] == 50
    assert [(lv["concurrency"], lv["stream"]) for lv in res["levels"]] == [(1, True), (4, True), (2, False)]
    for lv in res["levels"]:
        # failed counts any stream without [DONE] or whose usage chunk is not exactly 50 tokens
        assert (lv["streams"], lv["failed"], lv["errors"], lv["tokens"]) == (6, 0, [], 300)
        assert lv["wall_tok_s"] > 0 and lv["gateway_cpu_s"] >= 0 and lv["wall_s"] > 0
    # 50 ASCII tokens: one content / reasoning chunk each, except </think>, which carries no text;
    # around them the role chunk, (a finish-only chunk), the usage chunk and [DONE]
    assert [lv["chunks_per_stream"] for lv in res["levels"][:2]] == [[49], [49]]
    assert all(len(lv["events_per_stream"]) == 1 and lv["events_per_stream"][0] in (52, 53)
               for lv in res["levels"][:2])
    table = r.stdout.splitlines()
    assert "[tiny]" in table[0]
    assert [ln.split()[:4] for ln in table[2:5]] == [["1", "stream", "6", "0"], ["4", "stream", "6", "0"],
                                                     ["2", "plain", "6", "0"]]
    # --compare: the run against itself, ratio 1 wherever the CPU time was measurable
    res["label"] = "tiny2"
    out2.write_text(json.dumps(res))
    r = subprocess.run([sys.executable, "-m", "bench.cli", "gateway", "--compare", str(out), str(out2)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["streams", "mode", "tiny", "tiny2", "|", "tiny", "tiny2", "B/A", "|", "tiny",
                                 "tiny2"]
    assert [ln.split()[:2] for ln in lines[2:]] == [["1", "stream"], ["4", "stream"], ["2", "plain"]]
    assert all(ln.split()[7] in ("1.00", "0.00") for ln in lines[2:])
