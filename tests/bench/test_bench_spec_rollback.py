"""bench.bench_spec_rollback: a graph MTP step's SpanRollback dispatches a fixed number of ops
whatever the batch and layer count, where per-request Rollbacks grow with both."""
from __future__ import annotations

from bench.bench_spec_rollback import main, measure


def test_span_rollback_ops_do_not_grow_with_batch_or_layers(capsys):
    small, large, deep = measure(1, 3, 6, 1), measure(4, 3, 6, 1), measure(4, 3, 12, 1)
    assert small["graph_ops"] == large["graph_ops"] == deep["graph_ops"]
    assert large["eager_ops"] == 4 * small["eager_ops"] and deep["eager_ops"] > large["eager_ops"]
    assert large["graph_ops"] < small["eager_ops"]
    assert main(["--batches", "2", "--layers", "4", "--repeat", "1"]) == 0
    assert "eager ops" in capsys.readouterr().out
