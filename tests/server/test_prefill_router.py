"""The gateway's prefill routing policies (server.backends.prefill_router), on Instance records."""
from __future__ import annotations

import pytest

from server.backends.instances import Instance
from server.backends.prefill_router import PrefillRouter


def _inst(addr: str, waiting: int = 0, caching: bool = True) -> Instance:
    return Instance("prefill", addr, None, load={"ready": True, "waiting": waiting, "prefix_caching": caching})


def _prompt(head: int, n: int, conv: int = 0) -> list[int]:
    return [head] * 256 + list(range(conv * 10_000, conv * 10_000 + n))


def test_cache_aware_keeps_a_conversation_and_spreads_new_ones():
    r = PrefillRouter("cache_aware")
    a, b = _inst("a"), _inst("b")
    # new conversations sharing only a 256-token system prompt (half their chunks): spread out
    first = [r.choose([a, b], _prompt(7, 300, i)).addr for i in range(4)]
    assert sorted(first) == ["a", "a", "b", "b"]
    # each follow-up turn goes where its conversation went
    for i, where in enumerate(first):
        assert r.choose([a, b], _prompt(7, 400, i)).addr == where
    assert r.by_prefix == 4 and r.routed == 8


def test_cache_aware_gives_way_to_load_and_to_instances_without_caching():
    r = PrefillRouter("cache_aware", balance_abs=2)
    a, b = _inst("a"), _inst("b")
    p = _prompt(1, 600)
    assert r.choose([a, b], p).addr == "a"
    a.load["waiting"] = 3                  # 3 more than b: over balance_abs
    assert r.choose([a, b], p + [1]).addr == "b"
    off = [_inst("c", waiting=1, caching=False), _inst("d", caching=False)]
    assert r.choose(off, p).addr == "d"


def test_round_robin_and_least_load():
    a, b = _inst("a", waiting=5), _inst("b")
    rr = PrefillRouter("round_robin")
    assert [rr.choose([b, a], [1] * 300).addr for _ in range(4)] == ["a", "b", "a", "b"]
    assert PrefillRouter("least_load").choose([a, b], [1] * 300).addr == "b"
    with pytest.raises(ValueError, match="prefill routing"):
        PrefillRouter("random")


def test_the_index_forgets_the_least_recently_sent_chunks():
    r = PrefillRouter("cache_aware", max_hashes=4)
    a = _inst("a")
    r.choose([a], list(range(1000)))                  # 7 chunks sent: the first 3 forgotten
    from engine.core.prefix_cache import chain_hashes
    chain = chain_hashes(list(range(1000)), 7)
    assert r.expected_hit("a", chain) == 0 and r.expected_hit("b", chain) == 0
    r.choose([a], list(range(300)))
    assert r.expected_hit("a", chain) == 2
    r.forget("a")
    assert r.expected_hit("a", chain) == 0
