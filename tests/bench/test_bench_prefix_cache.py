"""bench.bench_prefix_cache at a small size: real launch-pd clusters, cache off vs on; with the
cache on, follow-up turns are served from it and the workers compute fewer prompt tokens."""
from __future__ import annotations

import json

from bench.bench_prefix_cache import main


def test_multi_turn_bench_reports_cache_off_and_on(ckpt, tmp_path, capsys):
    out = tmp_path / "pc.json"
    assert main(["--model", ckpt, "--conversations", "2", "--turns", "2", "--system-len", "256", "--user-len", "16",
                 "--output-len", "2", "--setups", "off-round_robin", "on-cache_aware", "--out", str(out)]) == 0
    off, on = json.loads(out.read_text())["rows"]
    assert off["prompt_tokens"] == on["prompt_tokens"] == off["prefill_tokens_computed"]
    assert off["cache_hit_rate"] == 0 and on["cache_hit_rate"] > 0.4
    assert on["prefill_tokens_computed"] == round(on["prompt_tokens"] * (1 - on["cache_hit_rate"]))
    assert "hit rate" in capsys.readouterr().out
