"""``bench.bench_mtp --quick``: the printed table's figures are consistent with each other and with
the engine's counters (no timings asserted): next_n 0 runs one target forward per token, every
decoded token is a forward or an accepted draft, the agreeing model's drafts are accepted and the
random one's are not, and every run's tokens are next_n 0's."""
from __future__ import annotations

import json

import pytest

from bench import bench_mtp as bm


def test_quick_table_is_consistent(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "mtp.json"
    assert bm.main(["--quick", "--agree", str(tiny_ckpt("flash", 1, mtp_agree=True)),
                    "--random", str(tiny_ckpt("flash", 1)), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows, new = doc["rows"], doc["new_tokens"]
    assert [(r["model"], r["batch"], r["next_n"]) for r in rows] == [
        (m, b, n) for m in ("agree", "random") for b in bm.QUICK_BATCHES for n in (0, 1, 3)]
    for r in rows:
        assert r["same_tokens"] is True                                  # exact acceptance
        assert r["decoded_tokens"] == r["batch"] * (new - 1)
        assert r["forwards"] + r["num_accepted_tokens"] == r["decoded_tokens"]
        assert r["fwd_per_token"] == r["forwards"] / r["decoded_tokens"]
        assert r["forwards"] <= r["batch"] * r["decode_steps"] and r["decode_steps"] <= new - 1
        if r["next_n"] == 0:
            assert (r["decode_steps"], r["fwd_per_token"], r["acceptance_rate"]) == (new - 1, 1.0, None)
            continue
        assert sum(r["num_accepted_tokens_per_pos"]) == r["num_accepted_tokens"]
        assert len(r["num_accepted_tokens_per_pos"]) == r["next_n"]
        assert r["num_draft_tokens"] <= r["next_n"] * r["num_drafts"] and r["num_drafts"] <= r["forwards"]
        assert r["acceptance_rate"] == r["num_accepted_tokens"] / r["num_draft_tokens"]
        assert r["mean_acceptance_length"] == 1 + r["num_accepted_tokens"] / r["num_drafts"]
        if r["model"] == "agree":
            assert r["acceptance_rate"] >= 0.9 and r["decode_steps"] < new - 1
        else:
            assert r["acceptance_rate"] <= 0.2
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| model | batch | next_n | decode steps | fwd / token |") and len(lines) == 2 + len(rows)
    for line, r in zip(lines[2:], rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:5] == [r["model"], str(r["batch"]), str(r["next_n"]), str(r["decode_steps"]),
                             f"{r['fwd_per_token']:.3f}"]
        up = bm.UPSTREAM.get(r["next_n"])
        assert cells[10] == (f"{up[0]:.2f} / {up[1]:.2f}" if up else "-") and cells[11] == "yes"
        assert cells[7] == ("-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}")
    assert bm.UPSTREAM[1] == (0.7, 1.7) and bm.UPSTREAM[3] == pytest.approx((0.48, 2.44))   # 0.7 of 1, 1.44 of 3
