"""The MTP part of the wire format: a commit (or whole-state message) carries the MTP window rows
(``mtp.*``) and the drafts after token #1; without MTP a commit is byte for byte a next_n 0 build's,
and the decode side classifies what arrives (``kvtransfer.receiver``) before anything is written."""
from __future__ import annotations

import msgpack
import pytest
import torch

from kvtransfer.interfaces import Delivered
from kvtransfer.receiver import TransferReceiver
from kvtransfer.wire import (MAX_DRAFTS, TransferError, decode_header, decode_state, encode_commit, encode_layer,
                             encode_state)

FP = "f" * 64
MTP = {"mtp.0.win_kv": torch.arange(12, dtype=torch.float32).reshape(3, 4)}


def _bytes(frames):
    return [bytes(f) for f in frames]


def test_a_commit_without_mtp_is_the_next_n_0_message():
    frames = _bytes(encode_commit("t", FP, 7, 42, 3))
    assert len(frames) == 1
    h = msgpack.unpackb(frames[0])
    assert h == {"v": 1, "kind": "commit", "transfer_id": "t", "fingerprint": FP, "num_tokens": 7, "first_token": 42,
                 "num_layers": 3, "tensors": []}
    assert "draft_ids" not in msgpack.unpackb(_bytes(encode_state("t", FP, 7, 42, {}))[0])


def test_a_commit_carries_the_mtp_rows_and_drafts_exactly():
    frames = _bytes(encode_commit("t", FP, 7, 42, 3, MTP, [5, 6, 7]))
    h, got = decode_state(frames, FP)
    assert h["draft_ids"] == [5, 6, 7] and h["first_token"] == 42
    assert list(got) == ["mtp.0.win_kv"] and torch.equal(got["mtp.0.win_kv"], MTP["mtp.0.win_kv"])
    assert sum(len(f) for f in frames[1:]) == 12 * 4                       # the rows' bytes, nothing else
    assert decode_header(_bytes(encode_commit("t", FP, 7, 42, 3, MTP, []))[0])["draft_ids"] == []
    assert decode_header(_bytes(encode_state("t", FP, 7, 42, MTP, [9]))[0])["draft_ids"] == [9]


def test_bad_mtp_commits_are_refused_on_both_sides():
    with pytest.raises(ValueError, match="only the MTP state.*'layers.0.win_kv'"):
        encode_commit("t", FP, 7, 42, 3, {"layers.0.win_kv": torch.zeros(1)}, [1])
    with pytest.raises(ValueError, match=f"exceed {MAX_DRAFTS}"):
        encode_commit("t", FP, 7, 42, 3, MTP, list(range(MAX_DRAFTS + 1)))
    good = msgpack.unpackb(_bytes(encode_commit("t", FP, 7, 42, 3, MTP, [1]))[0])
    for bad in ([-1], [True], ["1"], 3, list(range(MAX_DRAFTS + 1))):
        with pytest.raises(TransferError, match="header.draft_ids: expected up to"):
            decode_header(msgpack.packb({**good, "draft_ids": bad}))
    layer = msgpack.unpackb(_bytes(encode_layer("t", FP, 7, 0, {}))[0])
    with pytest.raises(TransferError, match="on a state / commit"):
        decode_header(msgpack.packb({**layer, "draft_ids": [1]}))


class _NoTransport:
    def reply(self, peer, msg):
        self.last = msg


def _take(table, frames):
    frames = _bytes(frames)
    return table.take(Delivered("p", decode_header(frames[0]), frames, sum(len(f) for f in frames)))


def test_the_receiver_hands_the_mtp_state_and_drafts_to_the_commit():
    table = TransferReceiver(_NoTransport(), FP, num_layers=1)
    table.expect("a", 7, 60)
    assert _take(table, encode_layer("a", FP, 7, 0, {"layers.0.win_kv": torch.ones(2, 4)})).kind == "load"
    act = _take(table, encode_commit("a", FP, 7, 42, 1, MTP, [5, 6]))
    assert (act.kind, act.first_token, act.draft_ids) == ("commit", 42, [5, 6])
    assert torch.equal(act.tensors["mtp.0.win_kv"], MTP["mtp.0.win_kv"])
    assert act.pending.payload_bytes == 2 * 4 * 4 + 12 * 4                 # the MTP rows count as state bytes
    table.expect("b", 7, 60)
    _take(table, encode_layer("b", FP, 7, 0, {}))
    act = _take(table, encode_commit("b", FP, 7, 42, 1))
    assert (act.kind, act.tensors, act.draft_ids) == ("commit", None, [])   # next_n 0: nothing more
    table.expect("c", 7, 60)
    act = _take(table, encode_state("c", FP, 7, 42, {"layers.0.win_kv": torch.ones(2, 4), **MTP}, [8]))
    assert (act.kind, act.first_token, act.draft_ids, sorted(act.tensors)) == (
        "load", 42, [8], ["layers.0.win_kv", "mtp.0.win_kv"])


def test_the_receiver_fails_a_commit_carrying_trunk_state():
    table = TransferReceiver(_NoTransport(), FP, num_layers=1)
    table.expect("a", 7, 60)
    _take(table, encode_layer("a", FP, 7, 0, {}))
    frames = _bytes(encode_commit("a", FP, 7, 42, 1, MTP, [1]))
    h = msgpack.unpackb(frames[0])
    h["tensors"][0]["name"] = "layers.0.win_kv"            # a sender that is not ours
    act = _take(table, [msgpack.packb(h), *frames[1:]])
    assert (act.kind, act.cause) == ("fail", "malformed")
    assert act.message == "commit carries layers.0.win_kv (only mtp.* may)"
    assert not table.pending and table.is_known("a")       # retired: fenced from now on
