"""Who this rank is in a multi-rank instance: its groups and the row mode of the next forward.

Rank layout (reference/upstream-parallel-and-mtp.md "Parallel strategy"; upstream ParallelConfig):
consecutive ranks form each TP group, so the group of kind ``k`` (size ``t``) holding rank ``r``
is ranks ``[r - r % t, r - r % t + t)``. MoE: ``moe_ep_size = world / moe_tp_size``; rank ``r`` has
EP index ``r // moe_tp_size`` and MoE-TP index ``r % moe_tp_size``; EP shard ``e`` owns routed
experts ``[e*E/ep, (e+1)*E/ep)`` and its ``moe_tp_size`` ranks split each expert's width ``I``.

Row modes: ``"replicated"`` (default): every rank runs the SAME token rows (attention replicated,
as in serving, where the leader's batch is mirrored to every rank); ``"dp"``: every rank runs ITS
OWN rows (attention data parallel, context-parallel prefill chunks); ranks with no rows still call
the forward (with zero rows) so that every collective is matched. ``fixed``: every rank runs the
same number of rows (a decode bucket, padding rows included), so row counts are known without
asking and every collective has a fixed shape: what a captured decode step needs (no host sync).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from engine.run_config import ParallelConfig

MODES = ("replicated", "dp")
GROUP_KINDS = ("moe", "embed", "lmhead", "o_proj", "shared")


@dataclass(frozen=True)
class GroupInfo:
    """One process group seen from this rank: its global ``ranks`` (ascending), this rank's
    ``index`` in them, and the ``torch.distributed`` ProcessGroup (None when the size is 1)."""

    ranks: tuple[int, ...]
    index: int
    group: object = None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass
class ParallelContext:
    """The parallel layout of one model (``model.parallel``), set by ``shard.apply_parallel``.

    groups: ``"moe"`` (every rank: routed-expert dispatch / combine), ``"embed"``, ``"lmhead"``,
    ``"o_proj"``, ``"shared"`` (the TP groups of those sizes). ``mode``: see the module docstring.
    """

    rank: int
    world_size: int
    config: ParallelConfig
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    mode: str = "replicated"
    fixed: bool = False

    @property
    def ep_rank(self) -> int:
        """This rank's EP shard index ``rank // moe_tp_size``."""
        return self.rank // self.config.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        """This rank's index inside its EP shard (which slice of ``I`` it holds)."""
        return self.rank % self.config.moe_tp_size

    @property
    def dp(self) -> bool:
        return self.mode == "dp"

    def counts(self, n: int, g: GroupInfo) -> list[int] | None:
        """Every rank's row count in group ``g`` when ``fixed`` (``[n] * size``, no communication);
        None otherwise (the caller asks the group)."""
        return [n] * g.size if self.fixed else None

    @contextlib.contextmanager
    def rows(self, mode: str, fixed: bool = False):
        """Run the enclosed forwards in row ``mode`` ("replicated" or "dp"), then restore.
        ``fixed``: every rank has this rank's row count (module docstring).

        Raises ValueError for another mode. Every rank must use the same mode for a forward.
        """
        if mode not in MODES:
            raise ValueError(f"ParallelContext.rows: mode must be one of {MODES}, got {mode!r}")
        old, self.mode, old_fixed, self.fixed = self.mode, mode, self.fixed, fixed
        try:
            yield self
        finally:
            self.mode, self.fixed = old, old_fixed


def trivial_context(config: ParallelConfig | None = None) -> ParallelContext:
    """The world-size-1 context: every group is this rank alone."""
    groups = {k: GroupInfo((0,), 0, None) for k in GROUP_KINDS}
    return ParallelContext(0, 1, config or ParallelConfig(), groups)
