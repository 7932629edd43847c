"""A follower rank's loop: run the leader's steps on this rank (``engine.parallel.leader``)."""
from __future__ import annotations

import logging
import os

from engine.core.block_manager import SeqBlocks
from engine.core.step import DraftPlan, StepPlan, wire_ops
from engine.parallel.link import FollowerLink, decode
from engine.parallel.rank_runner import RankRunner

log = logging.getLogger(__name__)


def follow(runner: RankRunner, link: FollowerLink) -> None:
    """A follower's loop until ``stop``: each message is one call of this rank's ``runner``:
    "step" ``execute(plan)``, "draft" ``draft(plan)``, "ops" ``apply_ops``, "load" ``load_state``.

    A ValueError from the model is the leader's too (same inputs, raised before any collective):
    logged and skipped. Any other failure leaves this rank out of step: the process exits (1),
    which takes the instance out of routing (the leader sees the connection close).
    """
    while True:
        head, frames = link.recv()
        try:
            kind = head["op"]
            if kind == "step":
                result = runner.execute(StepPlan.from_wire(head["plan"]))
                if isinstance(result.error, ValueError):
                    log.warning("step refused on every rank: %s", result.error)
                elif result.error is not None:
                    raise result.error
            elif kind == "draft":
                runner.draft(DraftPlan.from_wire(head["draft"]))
            elif kind == "ops":
                runner.apply_ops(wire_ops(head["ops"]))
            elif kind == "load":
                tensors = {name: decode(meta, buf) for (name, *meta), buf in zip(head["metas"], frames)}
                slot, tables = head["held"]
                runner.load_state(SeqBlocks(slot, tables), head["n"], tensors, head["layers"], wire_ops(head["ops"]))
            elif kind == "stop":
                return
        except Exception:                 # noqa: BLE001 - out of step with the leader: leave
            log.exception("follower out of step with the leader; exiting")
            os._exit(1)
