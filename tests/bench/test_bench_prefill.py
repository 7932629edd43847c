"""``python -m bench.bench_prefill``: the per-op breakdown counts each op of a real prefill of the
bundled tiny flash checkpoint once per layer (or per mHC site), outermost calls only."""
from __future__ import annotations

import re

import pytest

from bench.bench_prefill import main


def test_the_breakdown_counts_each_op_once_per_layer(tiny_ckpt, capsys):
    ckpt = tiny_ckpt("flash", 1)                  # a fresh clone has no models/tiny-flash
    assert main(["--checkpoint", str(ckpt), "--tokens", "40", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = {m[1]: (float(m[2]), int(m[3])) for m in re.finditer(r"^\| (\w+) \| ([\d.]+) \| (\d+) \|", out, re.M)}
    # 6 layers: one attention and one MoE each, mHC around both, one head for the last token
    assert {k: rows[k][1] for k in ("sparse_attn", "moe_experts", "hc_pre", "hc_post", "lm_head", "hc_head")} == \
        {"sparse_attn": 6, "moe_experts": 6, "hc_pre": 12, "hc_post": 12, "lm_head": 1, "hc_head": 1}
    assert rows["cache_indexer_topk"][1] == 2                         # the two CSA layers
    total = float(re.search(r"^\| 40 \| ([\d.]+) \|", out, re.M)[1])
    assert 0 < sum(ms for ms, _ in rows.values()) <= total


@pytest.mark.parametrize("argv", [["--tokens", "a"], ["--tokens", "0"], ["--repeats", "0"]])
def test_bad_flags_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
