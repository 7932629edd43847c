"""bench.bench_spec_rollback: the rollback every MTP verify step makes (``SpanRollback``, eager
and captured decode step alike) dispatches a fixed number of ops whatever the batch and layer
count, both when it is made and when its spans are settled."""
from __future__ import annotations

from bench.bench_spec_rollback import main, measure


def test_span_rollback_ops_do_not_grow_with_batch_or_layers(capsys):
    small, large, deep = measure(1, 3, 6, 1), measure(4, 3, 6, 1), measure(4, 3, 12, 1)
    for half in ("make_ops", "settle_ops"):
        assert small[half] == large[half] == deep[half] > 0, half
    for r in (small, large, deep):
        assert r["make_ms"] >= 0 and r["settle_ms"] >= 0
    assert main(["--batches", "2", "--layers", "4", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "make ops" in out and "settle ops" in out and "SpanRollback" in out
