"""A follower rank's loop: replay the leader's step messages (``engine.parallel.executor``)."""
from __future__ import annotations

import logging
import os

from engine.core.spec_decode import DraftRow
from engine.parallel.executor import RankExecutor
from engine.parallel.link import FollowerLink, decode

log = logging.getLogger(__name__)


def follow(executor: RankExecutor, link: FollowerLink, rank: int = 0, runner=None) -> None:
    """A follower's loop: replay the leader's step messages through this rank's ``executor``
    (graph decode steps through ``runner``, its engine's ``DecodeRunner``) until ``stop``.

    A ValueError from the model is the leader's too (same inputs, raised before any collective):
    logged and skipped. Any other failure leaves this rank out of step: the process exits (1),
    which takes the instance out of routing (the leader sees the connection close).
    """
    ex, cache = executor, executor.cache
    while True:
        head, frames = link.recv()
        try:
            k = 0
            for op in head.get("cache", ()):
                if op[-1] not in (None, rank):       # another DP rank's request
                    continue
                if op[0] == "alloc":
                    ex.allocate(op[1], op[2], op[3])
                elif op[0] == "cache_prefix":
                    ex.cache_prefix(op[1], op[2], op[3], tuple(op[4]))
                elif op[0] == "reset_prefix":
                    ex.reset_prefix_cache()
                elif op[0] == "settle":
                    ex.settle(op[1], op[2])
                elif op[0] == "free":
                    ex.free(op[1])
                elif op[0] == "load":
                    _, rid, n, metas, layers, _ = op
                    tensors = {}
                    for name, *meta in metas:
                        tensors[name] = decode(meta, frames[k])
                        k += 1
                    ex.load_state(rid, n, tensors, layers)
            kind = head["op"]
            if kind == "forward":
                tokens = decode(head["tokens"], frames[k])
                states = [cache.sequence_state(s, n) for s, n in zip(head["seqs"], head["nums"])]
                try:
                    if "spec" in head:
                        ex.forward_spec(tokens, states, head["lengths"], head["seqs"], head["spec"])
                    else:
                        ex.forward_batch(tokens, states, head["lengths"])
                except ValueError as e:
                    log.warning("forward refused on every rank: %s", e)
            elif kind == "forward_dp":
                p = head["parts"][rank - 1]
                states = [cache.sequence_state(s, n) for s, n in zip(p["seqs"], p["nums"])]
                ex.forward_dp(decode(p["tokens"], frames[k + rank - 1]), states, p["lengths"], p["seqs"], p.get("spec"))
            elif kind == "draft":
                if ex.rows_mode == "dp":
                    ex.draft_dp(head["parts"][rank - 1], head["steps"])
                else:
                    ex.draft([DraftRow(*r) for r in head["plan"]], head["steps"])
            elif kind == "decode":
                i = rank - 1 if ex.rows_mode == "dp" else 0
                spec = head["spec"][i] if "spec" in head else None
                ex.decode_graph(runner, head["parts"][i], head["B"], head["C"], spec)
            elif kind == "logits":
                ex.logits(decode(head["hidden"], frames[k]))
            elif kind == "cp":
                ex.prefill_cp(head["seq"], decode(head["tokens"], frames[k]))
            elif kind == "stop":
                return
        except Exception:                 # noqa: BLE001 - out of step with the leader: leave
            log.exception("follower out of step with the leader; exiting")
            os._exit(1)
