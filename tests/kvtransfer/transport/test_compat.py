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
    assert set(CAUSES) == {"transport", "kv_dtype", "weights", "config", "layout"}


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
