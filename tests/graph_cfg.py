"""The graph-mode run config the compile tests share.

``configs/tiny-flash.yaml`` in exe_mode npugraph_ex (torch.compile on CPU), batch 2, cut to the first
4 layers (SWA, SWA, CSA, HCA: every layer kind at 2/3 of the compile time). One config is one
compiled graph: the in-process compile test (tests/engine/test_graph_decode.py) fills the inductor
cache that the graph decode worker (tests/server/test_pd_graph.py) reads when it starts after that
test has finished (whether it does depends on how pytest-xdist hands out files), so an empty cache (CI)
can compile it once. ``GRAPH_THREADS``: the torch intra-op threads both compile under,
so the two see the same kernels (a worker's default is the machine's cores over its workers).
``assert_close_outputs``: the graph tests' comparison of a graph engine's outputs with eager's.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
GRAPH_THREADS = 1
# logprob tolerance: the static step sums the same fp32 terms in another order (masked padding
# entries, experts by slot instead of by id); greedy tokens must still be identical
LOGPROB_ATOL = 1e-4


def assert_close_outputs(got, want, atol: float = LOGPROB_ATOL) -> float:
    """Two engines' ``Sequence`` outputs: the same token ids and top-logprob ids, every logprob
    (sampled and top) within ``atol``. Returns the largest difference."""
    worst = 0.0
    for x, y in zip(got, want):
        assert x.output_ids == y.output_ids
        for p, q in zip(x.logprobs, y.logprobs):
            worst = max(worst, abs(p.logprob - q.logprob))
            assert [t for t, _ in p.top_logprobs] == [t for t, _ in q.top_logprobs]
            for (_, u), (_, v) in zip(p.top_logprobs, q.top_logprobs):
                worst = max(worst, abs(u - v))
    assert worst <= atol, worst
    return worst


def graph_run_config(exe_mode: str = "npugraph_ex") -> dict:
    """The raw run config (``RunConfig.from_dict`` input) in ``exe_mode``."""
    raw = yaml.safe_load((ROOT / "configs/tiny-flash.yaml").read_text())
    raw["model_config"]["exe_mode"] = exe_mode
    raw["model_config"].setdefault("custom_params", {})["num_hidden_layers"] = 4
    raw["scheduler_config"]["batch_size"] = 2
    return raw


@contextmanager
def graph_threads():
    """torch's intra-op threads set to ``GRAPH_THREADS`` inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(GRAPH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)
