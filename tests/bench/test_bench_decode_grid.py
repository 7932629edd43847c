"""``python -m bench.bench_decode_grid``: a grid cell times the eager step and the graph step on the
same synthetic state of B requests, and their logits agree within the graph step's bound."""
from __future__ import annotations

import json

import pytest

from bench.bench_decode_grid import main


def test_a_cell_runs_both_steps_on_the_same_state(tiny_ckpt, capsys):
    ckpt = tiny_ckpt("flash", 1)                  # a fresh clone has no models/tiny-flash
    argv = ["--ckpt", str(ckpt), "--batch-sizes", "2", "--contexts", "130", "--steps", "1", "--threads", "1",
            "--max-model-len", "4096", "--no-compile", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 130)]
    r = rows[0]
    assert r["eager_ms"] > 0 and r["captured_ms"] > 0 and r["limit_ms"] > 0
    assert r["bound"] in ("memory", "compute")
    # the same tokens on the same state: the graph step differs from eager by summation order only
    assert 0 <= r["max_dlogit"] < 1e-4


@pytest.mark.parametrize("argv", [["--batch-sizes", "0"], ["--batch-sizes", "a"], ["--contexts", "1"],
                                  ["--steps", "0"], ["--threads", "0"],
                                  ["--contexts", "4090", "--max-model-len", "4096", "--steps", "8"]])
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_a_missing_checkpoint_is_named(tmp_path, capsys):
    assert main(["--ckpt", str(tmp_path / "none"), "--no-compile"]) == 2
    assert "is not a checkpoint directory" in capsys.readouterr().err
