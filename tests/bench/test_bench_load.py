"""``bench.bench_load``: a tiny real run (read, load, read again, each in a subprocess) whose figures
add up: the read moves every shard byte, MB/s is those bytes over the seconds, resident bytes are the
loaded model's; bad flags exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import bench_load as bl
from engine.checkpoint.loader import load_model

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_adds_up(ckpt, tmp_path):
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, "-m", "bench.bench_load", "--model", ckpt, "--cache", "warm", "--dtypes",
                        "bf16", "--load-args", '{"packed": false}', "--forward-tokens", "3", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [x["what"] for x in rows] == ["sequential read (before)", "load_model bf16 packed=false",
                                         "sequential read (after)"]
    stored = sum(f.stat().st_size for f in Path(ckpt).glob("*.safetensors"))
    assert all(x["stored_bytes"] == stored and x["cache"] == "warm" for x in rows)
    assert rows[0]["bytes"] == rows[2]["bytes"] == stored
    assert all(abs(x["mb_s"] - stored / 1e6 / x["seconds"]) < 1e-6 * x["mb_s"] for x in rows)
    m = load_model(ckpt, dtype=torch.bfloat16, progress=False, packed=False)
    load = rows[1]
    assert load["param_bytes"] == sum(p.numel() * p.element_size() for p in m.parameters())
    assert load["buffer_bytes"] == sum(b.numel() * b.element_size() for b in m.buffers())
    assert load["peak_rss_kib"] > load["base_rss_kib"] and load["forward_s"] > 0 and 0 < load["construct_s"] < load["seconds"]
    lines = r.stdout.splitlines()                                      # the markdown table, a row per run
    assert lines[2].startswith("| cache | what | seconds | MB/s | x disk read |") and len(lines) == 2 + 2 + 3
    assert "| warm | load_model bf16 packed=false |" in lines[5]


def test_bad_flags_exit_2(ckpt, tmp_path):
    for flags in (["--load-args", '{"bogus": 1}'], ["--load-args", "[1]"], ["--dtypes", "fp8"], ["--cache", "hot"]):
        r = subprocess.run([sys.executable, "-m", "bench.bench_load", "--model", ckpt, "--out", str(tmp_path / "x"),
                            *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "bench_load: error: --" in r.stderr, (flags, r.stderr)
    r = subprocess.run([sys.executable, "-m", "bench.bench_load", "--model", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a directory with *.safetensors files" in r.stderr


def test_read_all_and_evict(tmp_path):
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    files[0].write_bytes(b"x" * (bl.CHUNK + 5))
    files[1].write_bytes(b"")
    bl.evict(files)                                                    # no root needed; the bytes stay
    assert bl.read_all(files) == bl.CHUNK + 5 and bl.shard_files(tmp_path) == files
