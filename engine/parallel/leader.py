"""The leader (rank 0) of a multi-rank instance: its model runner sends each step first.

The leader runs the whole ``LLMEngine``: scheduler, block accounting, sampler. Its runner is a
``RankRunner`` that, before running a step itself, sends the step's plan to the followers (one
msgpack message per step, as vLLM broadcasts its ``SchedulerOutput``; ``StepPlan.to_wire``), and
after sampling an MTP step its ``DraftPlan``; each follower runs the same ``execute`` / ``draft``
(``engine.parallel.follower``). An imported state (P/D) goes with the pool changes recorded
before it, to every rank or, under attention DP, to its owner only. ``server.launch.rank_worker``
builds each rank's engine with its runner.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.core.block_manager import SeqBlocks
from engine.core.pd_state import load_split
from engine.core.step import DraftPlan, PoolOp, StepPlan, StepResult
from engine.parallel.link import LeaderLink, encode
from engine.parallel.rank_runner import RankRunner

log = logging.getLogger(__name__)


class LeaderRunner(RankRunner):
    """Rank 0's runner: each step reaches the followers (``link``) first, then runs here.

    Args (beyond ``RankRunner``'s, whose rank is 0): link: the step channel to the followers.
        on_failure: (reason) -> None, called when a step fails other than by refusing its input
            (a collective with a lost rank, a gone follower): the instance is out of step, its
            samples must not be reported as finished (the worker stops answering and exits).
    """

    def __init__(self, model, pools, max_model_len: int, max_batch: int, platform=None, graph=None,
                 link: LeaderLink | None = None, dp: int = 1, cp_prefill=None, cp_min_tokens: int = 1024,
                 on_failure: Callable[[str], None] | None = None):
        super().__init__(model, pools, max_model_len, max_batch, platform, graph, 0, dp, cp_prefill, cp_min_tokens)
        self.link, self.on_failure = link, on_failure

    def _failed(self, what: str, e: BaseException) -> None:
        if not isinstance(e, ValueError) and self.on_failure is not None:
            self.on_failure(f"{what} failed: {type(e).__name__}: {str(e)[:200]}")

    def execute(self, plan: StepPlan, layer_hook=None) -> StepResult:
        try:
            self.link.send({"op": "step", "plan": plan.to_wire()})
        except Exception as e:            # noqa: BLE001 - a gone follower: the instance fails
            self._failed("step", e)
            return StepResult(failed="forward", error=e)
        result = super().execute(plan, layer_hook)
        if result.error is not None:
            self._failed("step", result.error)
        return result

    def draft(self, plan: DraftPlan) -> list[list[int]]:
        try:
            self.link.send({"op": "draft", "draft": plan.to_wire()})
            return super().draft(plan)
        except Exception as e:
            self._failed("draft", e)
            raise

    def load_state(self, held: SeqBlocks, num_tokens: int, tensors: dict[str, torch.Tensor],
                   layers: list[int] | None = None, ops: list[PoolOp] = (), rank: int | None = None) -> None:
        """As ``ModelRunner.load_state`` on every rank (under attention DP the bytes go to the
        owner ``rank`` only; rank 0 writes its own). Checked here before anything is sent.
        Raises ValueError (nothing written, nothing sent but the pool changes)."""
        ops = [list(op) for op in ops]
        owner = rank if self.dp_size > 1 else None
        try:
            if owner is None or owner != 0:
                load_split(self.pools, held, num_tokens, tensors, layers, check_only=True)
        except Exception:                 # noqa: BLE001 - whatever the check raised, re-raised below
            if ops:                       # the recorded changes still happen everywhere, in order
                self.link.send({"op": "ops", "ops": ops})
                self.apply_ops([PoolOp(*op) for op in ops])
            raise
        metas, frames = [], []
        for name, t in tensors.items():
            meta, buf = encode(t)
            metas.append([name, *meta])
            frames.append(buf)
        load = {"op": "load", "held": [held.state_slot, {p: list(b) for p, b in held.tables.items()}],
                "n": num_tokens, "metas": metas, "layers": layers}
        if owner is None:
            self.link.send({**load, "ops": ops}, frames)
            super().load_state(held, num_tokens, tensors, layers, [PoolOp(*op) for op in ops])
            return
        if ops:
            self.link.send({"op": "ops", "ops": ops})
        self.apply_ops([PoolOp(*op) for op in ops])
        if owner == 0:
            load_split(self.pools, held, num_tokens, tensors, layers)
        else:
            self.link.send({**load, "ops": []}, frames, to=owner)

    def stop(self) -> None:
        """Tell the followers to exit (best effort)."""
        try:
            self.link.send({"op": "stop"})
        except Exception:                 # noqa: BLE001 - they may be gone already
            pass
