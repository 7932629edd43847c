"""Shared checks of the MTP speculative-decoding tests: a request's state at every length."""
from __future__ import annotations

import torch


def states_by_length(eng, prompt: list[int], params) -> dict[int, dict[str, torch.Tensor]]:
    """Run one request ``"r"`` on ``eng`` to the end; its exported state after each step, by length L."""
    eng.add_request("r", prompt, params)
    out = {}
    while eng.has_unfinished():
        eng.step()
        seq = eng.seqs.get("r")
        if seq is not None:
            out[seq.num_computed] = eng.runner.state_tensors(eng.cache.seqs["r"], seq.num_computed)
    return out


def assert_same_states(plain: dict, spec: dict, min_common: int, past: int) -> None:
    """At every length both runs reached (at least ``min_common``, one past ``past``) the
    states are equal byte for byte."""
    common = sorted(set(plain) & set(spec))
    assert len(common) >= min_common and max(common) > past
    for L in common:
        assert plain[L].keys() == spec[L].keys()
        for k in plain[L]:
            assert torch.equal(plain[L][k], spec[L][k]), (L, k)
