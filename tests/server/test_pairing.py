"""The gateway pairs only instances the transfer handshake would accept (``server.backends.instances``):
the decode of a sample is one some healthy prefill pairs with, whatever the load; with none, 503
naming the difference; /health and ``dsv4:incompatible_pairs`` say which pairs and why."""
from __future__ import annotations

import asyncio

import pytest

from server.backends.base import BackendError
from server.backends.instances import Instance, incompatible_pairs, pair_mismatch, pick_pair
from server.backends.pd import PDBackend
from server.metrics import GatewayMetrics

W1, W2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def _inst(role: str, addr: str, weights: str = W1, kv_dtype: str = "bfloat16", running: int = 0) -> Instance:
    hs = {"transport": "zmq", "fingerprint": f"fp-{weights[-1]}-{kv_dtype}",
          "layout": {"state_format": 1, "kv_dtype": kv_dtype, "config": "c0", "weights": weights}}
    load = {"ready": True, "running": running, "batch_size": 4, "handshake": hs}
    return Instance(role, addr, sock=None, load=load, unanswered=0, connected=True)


def test_the_decode_chosen_has_a_compatible_prefill_whatever_its_load():
    pre = _inst("prefill", "p:1")
    bad, good = _inst("decode", "d:1", weights=W2), _inst("decode", "d:2", running=3)
    assert bad.score() < good.score()
    for _ in range(5):
        assert pick_pair([pre, bad, good], 4) is good
    assert pair_mismatch(pre, good) is None and "layout.weights differs" in pair_mismatch(pre, bad)
    assert incompatible_pairs([pre, bad, good], 4) == [
        {"prefill": "p:1", "decode": "d:1", "cause": "weights", "reason": pair_mismatch(pre, bad)}]


def test_no_compatible_pair_is_a_503_naming_the_difference():
    pre, dec = _inst("prefill", "p:1", kv_dtype="float32"), _inst("decode", "d:1")
    with pytest.raises(BackendError) as e:
        pick_pair([pre, dec], 4)
    assert e.value.status == 503
    assert str(e.value).startswith("no compatible prefill/decode pair: prefill p:1 -> decode d:1: "
                                   "layout.kv_dtype differs: prefill has 'float32', decode has 'bfloat16'")
    with pytest.raises(BackendError, match="no healthy prefill instance"):
        pick_pair([dec], 4)
    legacy = Instance("decode", "d:2", sock=None, load={"ready": True}, unanswered=0, connected=True)
    assert pick_pair([pre, dec, legacy], 4) is legacy       # fields unknown: the handshake still judges


def test_health_and_metric_name_the_incompatible_pairs():
    backend = PDBackend(["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"])
    try:
        pre, d1, d2 = backend.instances
        for inst, w in ((pre, W1), (d1, W2), (d2, W1)):
            fresh = _inst(inst.role, inst.addr, weights=w)
            inst.load, inst.unanswered, inst.connected = fresh.load, 0, True
        h = asyncio.run(backend.health())
        assert h["healthy"] and h["compatible_pairs"] == 1
        assert [(p["decode"], p["cause"]) for p in h["incompatible_pairs"]] == [("127.0.0.1:2", "weights")]
        m = GatewayMetrics("tiny")
        m.track_pairs(backend.incompatible_pairs)
        m.track_pairs(backend.incompatible_pairs)          # once per registry, whoever calls again
        text = m.render().decode()
        assert 'dsv4:incompatible_pairs{cause="weights",model_name="tiny"} 1.0' in text
        assert 'dsv4:incompatible_pairs{cause="kv_dtype",model_name="tiny"} 0.0' in text
        d2.load["handshake"] = d1.load["handshake"]
        h = asyncio.run(backend.health())
        assert not h["healthy"] and h["compatible_pairs"] == 0 and len(h["incompatible_pairs"]) == 2
    finally:
        asyncio.run(backend.close())


def test_a_unified_worker_pairs_with_itself_only():
    """A unified worker (one engine, listed under both roles) takes its own samples' prefill and
    nobody else's state; a split prefill never pushes to it."""
    def unified(role, addr, running=0):
        inst = _inst(role, addr, running=running)
        inst.load["role"] = "unified"
        return inst
    u1p, u1d, u2p, u2d = unified("prefill", "u:1"), unified("decode", "u:1", 3), unified("prefill", "u:2"), \
        unified("decode", "u:2")
    pre = _inst("prefill", "p:1")
    assert pair_mismatch(u1p, u1d) is None
    assert "pairs only with itself" in pair_mismatch(u2p, u1d) and "pairs only with itself" in pair_mismatch(pre, u1d)
    assert "pairs only with itself" in pair_mismatch(u1p, _inst("decode", "d:1"))
    assert pick_pair([u1p, u1d, u2p, u2d], 4) is u2d           # the less loaded; it has its own prefill
    assert pick_pair([u1p, u1d, u2d], 4) is u1d                # u:2's prefill side is not up yet
    bad = incompatible_pairs([u1p, u1d, u2p, u2d], 4)
    assert {(b["prefill"], b["decode"]) for b in bad} == {("u:1", "u:2"), ("u:2", "u:1")}
