"""``python -m bench.bench_sampler``: the figures it prints are what the step copies to the host."""
from __future__ import annotations

import json

import pytest

from bench.bench_sampler import VOCAB, main


def test_rows_hold_the_result_size_not_the_logits(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["--batch", "2", "--repeat", "1", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"greedy", "seeded t=0.7", "top_p 0.9", "logprobs 5"}
    assert rows["greedy"]["host_bytes"] == 2 * 3 * 4                  # id, logprob slot, finite flag
    assert rows["logprobs 5"]["host_bytes"] == 2 * (3 + 2 * 5) * 4
    assert all(r["logits_bytes"] == 2 * VOCAB * 4 and r["ms"] > 0 for r in rows.values())
    assert "ms/step" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--batch", "a,2"], ["--repeat", "0"]])
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
