"""``bench.bench_graph_context``: the graph-mode step with context-bucket tables gives the hidden
state of the full-width step, and the CLI refuses bad flags."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_graph_context import measure, table
from engine.checkpoint.loader import load_model

ROOT = Path(__file__).resolve().parents[2]


def test_bucketed_step_equals_the_full_width_step(tiny_ckpt):
    model = load_model(tiny_ckpt("flash", 1), progress=False)
    rows = measure(model, [256, 1000], 4096, steps=1)
    assert [(r["context"], r["bucket"]) for r in rows] == [(256, 256), (1000, 1024)]
    assert all(r["max_abs_diff"] == 0.0 for r in rows)        # the wide tables add masked entries only
    assert rows[0]["bucketed_ratio"] == rows[0]["full_width_ratio"] == 1.0
    assert "full width" in table(rows, 4096)


@pytest.mark.parametrize("args, msg", [(["--contexts", "1,x"], "comma-separated"),
                                       (["--contexts", "4096", "--max-model-len", "1024"], "at most --max-model-len"),
                                       (["--ckpt", "/nonexistent"], "is not a checkpoint directory")])
def test_cli_bad_flags_exit_2(args, msg):
    r = subprocess.run([sys.executable, "-m", "bench.bench_graph_context", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
