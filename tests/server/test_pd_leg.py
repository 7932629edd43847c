"""The P/D backend's per-attempt record (server/backends/leg.py): each state says which instances
count the attempt (routing load, loss detection), whether a loss may be retried, and what an
early end must abort."""
from __future__ import annotations

import pytest

from server.backends.base import BackendError
from server.backends.instances import Instance
from server.backends.leg import Leg, LegLost, LegState

LOSS = {"role": "decode", "addr": "d:1", "why": "disconnected"}


def _pair():
    return Instance("decode", "d:1", sock=None), Instance("prefill", "p:1", sock=None)


def test_a_leg_counts_itself_on_the_instances_working_for_it():
    dec, pre = _pair()
    leg = Leg("r1", dec)
    assert leg.state is LegState.RESERVING and (dec.inflight, dec.legs) == (1, {"r1"})
    leg.prefill_on(pre)
    assert leg.state is LegState.PREFILLING and (pre.inflight, pre.legs) == (1, {"r1"})
    leg.first_token()                    # prefill's compute is done; it still holds the transfer
    assert leg.state is LegState.TRANSFERRING and (pre.inflight, pre.legs) == (0, {"r1"})
    leg.committed()
    assert leg.state is LegState.DECODING and pre.legs == set()
    leg.finished()
    assert leg.release() == [] and (dec.inflight, dec.legs, pre.inflight) == (0, set(), 0)


@pytest.mark.parametrize("stop_in", ["reserving", "prefilling", "transferring"])
def test_an_attempt_that_ends_early_aborts_every_instance_it_used(stop_in):
    dec, pre = _pair()
    leg = Leg("r1", dec)
    if stop_in != "reserving":
        leg.prefill_on(pre)
    if stop_in == "transferring":
        leg.first_token()
    assert leg.release() == ([dec] if stop_in == "reserving" else [dec, pre])
    assert (dec.inflight, pre.inflight, dec.legs, pre.legs) == (0, 0, set(), set())


def test_a_loss_before_token_one_is_retried_after_it_is_an_error():
    dec, pre = _pair()
    leg = Leg("r1", dec)
    leg.prefill_on(pre)
    assert isinstance(leg.lost(LOSS), LegLost)
    leg.first_token()
    err = leg.lost(LOSS)
    assert isinstance(err, BackendError) and err.status == 502 and "mid-stream" in str(err)
