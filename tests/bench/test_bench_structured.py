"""``python -m bench.bench_structured`` runs end to end on a tiny case and reports what it says."""
from __future__ import annotations

import json

from bench.bench_structured import main


def test_bench_structured_reports_compiles_and_steps(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--ckpt", str(tiny_ckpt("flash", 1)), "--batch", "4", "--constrained", "0,2,4", "--steps", "2",
                 "--schemas", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    # 3 schemas + the tool call + the load's probe compile once each: the second compile of each is cached
    assert r["compile"]["compiles"] == 5 and r["compile"]["schemas"] == 3
    assert [s["constrained"] for s in r["steps"]] == [0, 2, 4] and r["steps"][0]["vs_unconstrained"] == 1.0
    assert all(s["step_ms"] > 0 and 0 < s["sample_ms"] < s["step_ms"] for s in r["steps"])
    assert "DSML tools" in capsys.readouterr().out
