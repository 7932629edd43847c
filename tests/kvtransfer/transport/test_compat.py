"""One rule for whether a prefill and a decode pair (``kvtransfer.compat``): the handshake refuses
what the gateway's pairing refuses, with the same words; the fields a worker puts in its pong
(``kvtransfer.handshake_fields``) are what its sender / receiver states in the handshake."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvtransfer import handshake_fields
from kvtransfer.compat import CAUSES, handshake_mismatch, mismatch_cause, pair_mismatch
from kvtransfer.interfaces import TransportError

from .common import FP, KINDS, LAYOUT

W1, W2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def _fields(**layout) -> dict:
    return {"transport": "zmq", "fingerprint": FP, "layout": {**LAYOUT, "weights": W1, "config": "c0", **layout}}


def test_the_reason_names_the_part_that_differs():
    good = _fields()
    assert pair_mismatch(good, dict(good)) is None and mismatch_cause(good, dict(good)) is None
    other = _fields(weights=W2)
    reason = pair_mismatch(other, good)
    assert reason.startswith("layout.weights differs: prefill has 'sha256:2222") and "decode has 'sha256:1111" in reason
    assert mismatch_cause(good, other) == "weights"
    fp32 = _fields(kv_dtype="float32")
    assert "layout.kv_dtype differs: prefill has 'float32', decode has 'bfloat16'" in pair_mismatch(fp32, good)
    assert mismatch_cause(good, fp32) == "kv_dtype"
    assert mismatch_cause(good, _fields(config="c1")) == "config"
    assert mismatch_cause(good, _fields(block_size=32)) == "layout"
    assert mismatch_cause(good, {**good, "transport": "dist", "backend": "gloo"}) == "transport"
    assert set(CAUSES) == {"transport", "kv_dtype", "next_n", "weights", "config", "layout"}


def test_a_next_n_difference_is_refused_as_next_n_and_a_missing_one_reads_as_0():
    """A worker without MTP states no next_n (its layout and fingerprint are a next_n 0 build's):
    it pairs with another such worker or one stating 0, and with no MTP worker."""
    plain, zero, mtp3, mtp1 = _fields(), _fields(next_n=0), _fields(next_n=3), _fields(next_n=1)
    assert pair_mismatch(plain, zero) is None and mismatch_cause(plain, zero) is None
    assert pair_mismatch(mtp3, _fields(next_n=3)) is None
    reason = pair_mismatch(mtp3, plain)
    assert reason == ("layout.next_n differs: prefill has 3, decode has 0 (MTP draft tokens per step: a prefill "
                      "running MTP ships its MTP window and drafts with the commit; both sides must run the same "
                      "next_n)")
    assert pair_mismatch(mtp3, mtp1).startswith("layout.next_n differs: prefill has 3, decode has 1 (MTP")
    assert pair_mismatch(plain, mtp3).startswith("layout.next_n differs: prefill has 0, decode has 3 (MTP")
    assert mismatch_cause(plain, mtp3) == mismatch_cause(mtp1, mtp3) == "next_n"
    assert mismatch_cause(plain, _fields(next_n=3, weights=W2)) == "next_n"      # the first cause in CAUSES order


@pytest.mark.parametrize("kind", ["zmq-tcp", "dist"])
def test_the_handshake_refuses_another_next_n_in_the_gateways_words(net, kind):
    rx = net.rx(kind, layout={**LAYOUT, "weights": W1})
    tx = net.tx(kind, layout={**LAYOUT, "weights": W1, "next_n": 3})
    gateway = pair_mismatch(handshake_fields(kind, FP, {**LAYOUT, "weights": W1, "next_n": 3}, "cpu"),
                            handshake_fields(kind, FP, {**LAYOUT, "weights": W1}, "cpu"))
    with pytest.raises(TransportError) as e:
        tx.connect(rx.address, timeout_s=5)
    assert gateway.startswith("layout.next_n differs: prefill has 3, decode has 0") and gateway in str(e.value)


def test_the_fingerprint_is_named_only_when_nothing_else_explains_it():
    good = _fields()
    both = {**_fields(weights=W2), "fingerprint": "f" * 64}
    assert "fingerprint" not in handshake_mismatch(good, both, "decode", "prefill")
    only = {**good, "fingerprint": "f" * 64}
    assert handshake_mismatch(good, only, "decode", "prefill").startswith("fingerprint differs: prefill runs model ffff")
    assert mismatch_cause(good, only) == "config"


def test_an_instance_not_heard_from_is_not_judged():
    assert pair_mismatch(None, _fields()) is None and pair_mismatch(_fields(), None) is None


def test_compat_loads_no_torch():
    code = "import sys, kvtransfer.compat\nassert 'torch' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("kind", KINDS)
def test_a_workers_fields_are_what_its_receiver_and_sender_state(net, kind):
    layout = {**LAYOUT, "weights": W1, "compress_ratios": (0, 4)}      # a tuple: compared after msgpack
    rx = net.rx(kind, layout=layout)
    assert rx._mine() == handshake_fields(kind, FP, layout, "cpu")
    tx = net.tx(kind, layout=layout)
    assert tx._mine() == handshake_fields(kind, FP, layout, "cpu")
    tx.connect(rx.address, timeout_s=5)                     # equal fields: the handshake accepts


@pytest.mark.parametrize("kind", ["zmq-tcp", "dist"])
def test_the_handshake_refuses_other_weights_in_the_gateways_words(net, kind):
    rx = net.rx(kind, layout={**LAYOUT, "weights": W1})
    tx = net.tx(kind, layout={**LAYOUT, "weights": W2})
    gateway = pair_mismatch(handshake_fields(kind, FP, {**LAYOUT, "weights": W2}, "cpu"),
                            handshake_fields(kind, FP, {**LAYOUT, "weights": W1}, "cpu"))
    with pytest.raises(TransportError) as e:
        tx.connect(rx.address, timeout_s=5)
    assert gateway and gateway in str(e.value)
