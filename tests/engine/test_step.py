"""The step contract's wire form (``engine/core/step.py``): what a multi-rank leader sends its
followers comes back field for field, and anything else is a ValueError naming the field (a
follower then leaves, rather than run another step than the leader's)."""
from __future__ import annotations

import copy

import msgpack
import pytest

from engine.core.step import DraftPlan, DraftRow, PoolOp, ScheduledRow, StepPlan, wire_ops


def plan() -> StepPlan:
    rows = [ScheduledRow("a", 40, [7, 8, 9], 2, True, 3, {"win": [0, 1], "c4": [5]}, 1),
            ScheduledRow("b", 0, list(range(2, 66)), 0, False, 0, {"win": [2], "c4": [6, 7], "c128": []}, 0)]
    ops = [PoolOp("reset", None, (3,)), PoolOp("copy", 1, (0, {"c4": [1]}, 3, {"c4": [5]}, 128)),
           PoolOp("carry_save", 0, ("k", "a", 128)), PoolOp("carry_bind", 0, ("k", "b")),
           PoolOp("carry_drop", None, ("k",)), PoolOp("free", None, ("z",))]
    return StepPlan(rows, ops, eager=True)


def wire(p) -> dict:
    return msgpack.unpackb(msgpack.packb(p.to_wire()), strict_map_key=False)


def test_a_plan_and_a_draft_plan_come_back_field_for_field():
    p = plan()
    got = StepPlan.from_wire(wire(p))
    assert got.rows == p.rows and got.eager and got.pool_ops[0] == p.pool_ops[0]
    assert [(op.kind, op.rank) for op in got.pool_ops] == [(op.kind, op.rank) for op in p.pool_ops]
    assert got.pool_ops[1].args == (0, {"c4": [1]}, 3, {"c4": [5]}, 128)       # msgpack: tuples come back lists
    d = DraftPlan([("a", 2)], [DraftRow("a", 1, 41, [9], 3), DraftRow("b", 0, 63, [4, 5], 0, True)])
    assert DraftPlan.from_wire(wire(d)) == d


BAD_PLANS = {
    "not a dict": (lambda w: [w], "plan: expected a dict"),
    "extra key": (lambda w: {**w, "x": 1}, "plan: expected a dict"),
    "eager str": (lambda w: {**w, "eager": "no"}, "eager a bool"),
    "short row": (lambda w: {**w, "rows": [w["rows"][0][:7]]}, "expected a list of 8"),
    "a string row": (lambda w: {**w, "rows": ["abcdefgh"]}, "expected a list of 8"),
    "req_id int": (lambda w: _row(w, 0, 5), "req_id: 5 is not a string"),
    "negative start": (lambda w: _row(w, 1, -1), "'a' start: -1"),
    "start str": (lambda w: _row(w, 1, "40"), "'a' start: '40'"),
    "float token": (lambda w: _row(w, 2, [7, 8.0, 9]), "'a' token_ids"),
    "token str": (lambda w: _row(w, 2, "789"), "'a' token_ids"),
    "no tokens": (lambda w: _row(w, 2, []), "drafts in 0 tokens"),
    "drafts past tokens": (lambda w: _row(w, 3, 3), "3 drafts in 3 tokens"),
    "samples int": (lambda w: _row(w, 4, 1), "samples: 1 is not a bool"),
    "negative slot": (lambda w: _row(w, 5, -1), "state_slot: -1"),
    "tables list": (lambda w: _row(w, 6, [[0, 1]]), "block_tables: not a dict"),
    "negative block": (lambda w: _row(w, 6, {"win": [0, -1]}), "block_tables['win']"),
    "bool rank": (lambda w: _row(w, 7, True), "rank: True"),
    "unknown op": (lambda w: {**w, "ops": [["evict", None, [1]]]}, "not one of"),
    "op arity": (lambda w: {**w, "ops": [["free", None, "abc"]]}, "not one of"),
    "op rank": (lambda w: {**w, "ops": [["reset", -2, [1]]]}, "rank: -2"),
}


def _row(w: dict, field: int, value) -> dict:
    w = copy.deepcopy(w)
    w["rows"][0][field] = value
    return w


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_a_malformed_plan_is_a_value_error_naming_the_field(case):
    change, message = BAD_PLANS[case]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        StepPlan.from_wire(change(wire(plan())))


@pytest.mark.parametrize("bad, message", [
    ({"settle": [["a"]], "rows": []}, "expected \\[req_id, tokens kept\\]"),
    ({"settle": [["a", -1]], "rows": []}, "settle 'a': -1"),
    ({"settle": [], "rows": [["a", 0]]}, "expected \\[req_id, row0"),
    ({"settle": [], "rows": [["a", 0, 0, "12", 1]]}, "'a' tokens"),
    ({"settle": [], "rows": [["a", 0, 0, [1], 1, 1]]}, "carry: 1 is not a bool"),
    ({"rows": []}, "expected a dict of settle and rows"),
])
def test_a_malformed_draft_plan_is_a_value_error(bad, message):
    with pytest.raises(ValueError, match=message):
        DraftPlan.from_wire(bad)


def test_pool_ops_from_the_wire_keep_their_arity():
    assert wire_ops([["free", None, ["z"]]]) == [PoolOp("free", None, ("z",))]
    with pytest.raises(ValueError, match="expected a list"):
        wire_ops({"free": 1})
