"""The leader's block accounting over its attention-DP ranks (serving attention DP, decode); no torch.

Each DP rank holds the state of the requests it owns in its own pools, sized for
``batch_size / attn_dp_size`` requests, so state memory splits over the ranks. The leader's engine
schedules all of them through ``DPCache``: one ``BlockManager`` per rank, whose ``PoolOp`` s carry
that rank (one list, in order). A request gets an owner at its first allocation (the rank with the
most free request slots that fits it, lowest rank on ties) and keeps it until freed; the step's
plan names each row's rank and block tables, so every rank runs its own rows over its own pools
(``engine.parallel.rank_runner``).
"""
from __future__ import annotations

from engine.config import ModelArgs
from engine.core.block_manager import BlockManager, CacheConfig, SeqBlocks
from engine.core.step import PoolOp


class DPCache:
    """``BlockManager``'s interface (what the scheduler and the engine use) over ``dp`` ranks.

    Args:
        args, config: the model and one rank's pool geometry. dp: attention-DP ranks (>= 1).
    """

    prefix = None        # no prefix cache: an entry would live on one rank, a hit must be placed there

    def __init__(self, args: ModelArgs, config: CacheConfig, dp: int):
        self.ops: list[PoolOp] = []
        self.ranks = [BlockManager(args, config, rank=r, ops=self.ops) for r in range(dp)]
        self.args, self.config, self.geometry = args, config, self.ranks[0].geometry
        self.owner: dict[object, int] = {}
        self.placed = [0] * dp           # requests placed on each rank so far (/health)

    def take_ops(self) -> list[PoolOp]:
        out = self.ops[:]
        self.ops.clear()
        return out

    def reset_prefix_cache(self) -> int:
        """No entries to evict: 0."""
        return 0

    @property
    def seqs(self) -> dict[object, SeqBlocks]:
        return {sid: self.ranks[r].seqs[sid] for sid, r in self.owner.items()}

    def _place(self, seq_id, num_tokens: int, reserve: dict[str, int] | None = None) -> int | None:
        """The owner of ``seq_id``, or the rank a new one would go to; None: no rank has room."""
        if seq_id in self.owner:
            r = self.owner[seq_id]
            return r if self.ranks[r].can_allocate(seq_id, num_tokens, reserve) else None
        fits = [r for r, c in enumerate(self.ranks) if c.can_allocate(seq_id, num_tokens, reserve)]
        return max(fits, key=lambda r: (self.ranks[r].pools["state"].num_free, -r)) if fits else None

    def can_allocate(self, seq_id, num_tokens: int, reserve: dict[str, int] | None = None) -> bool:
        return self._place(seq_id, num_tokens, reserve) is not None

    def allocate(self, seq_id, num_tokens: int, prefix: bytes | None = None) -> SeqBlocks:
        """As ``BlockManager.allocate`` on the owner (chosen now for a new request; ``prefix``:
        None, there is no prefix cache under attention DP). Raises CacheFullError (from the
        owner, or rank 0's when no rank fits) with nothing taken."""
        r = self.owner.get(seq_id)
        new = r is None
        if new:
            r = self._place(seq_id, num_tokens)
            r = 0 if r is None else r
        held = self.ranks[r].allocate(seq_id, num_tokens)
        self.owner[seq_id] = r
        self.placed[r] += new
        return held

    def free(self, seq_id) -> None:
        r = self.owner.pop(seq_id, None)
        if r is not None:
            self.ranks[r].free(seq_id)

    def rank_of(self, seq_id) -> int:
        """The DP rank that holds ``seq_id``'s state. Raises KeyError."""
        return self.owner[seq_id]

    def num_free(self) -> dict[str, int]:
        """Free blocks per pool, summed over the ranks."""
        return _sum(c.num_free() for c in self.ranks)

    def num_total(self) -> dict[str, int]:
        return _sum(c.num_total() for c in self.ranks)


def _sum(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in counts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
