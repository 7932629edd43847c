"""The leader's block manager over its attention-DP ranks (serving attention DP, decode).

Each DP rank holds the state of the requests it owns in its own pools, sized for
``batch_size / attn_dp_size`` requests, so state memory splits over the ranks. The leader's engine
schedules all of them through ``DPCache``: rank 0's real ``PagedCache`` plus, for every other rank,
a ``BlockManager`` (the same accounting, no tensors). A request gets an
owner at its first allocation (the rank with the most free request slots that fits it, lowest rank
on ties) and keeps it until freed. The followers replay only their own ranks' calls
(``engine.parallel.executor``), so each rank's block tables equal the leader's accounting of it.
"""
from __future__ import annotations

from engine.core.block_manager import BlockManager, SeqBlocks
from engine.core.kv_cache import PagedCache
from engine.core.paged_state import PagedSequenceState


class DPCache:
    """``PagedCache``'s interface (what the scheduler and the engine use) over ``dp`` ranks.

    Args:
        local: rank 0's pools (a real ``PagedCache``). dp: attention-DP ranks (>= 1).
    """

    prefix = None        # no prefix cache: an entry would live on one rank, a hit must be placed there

    def __init__(self, local: PagedCache, dp: int):
        self.ranks: list[BlockManager] = [local] + [BlockManager(local.args, local.config) for _ in range(dp - 1)]
        self.args, self.config, self.dtype, self.device = local.args, local.config, local.dtype, local.device
        self.cache_dtype, self.kv_codec, self.idx_codec = local.cache_dtype, local.kv_codec, local.idx_codec
        self.geometry = local.geometry
        self.owner: dict[object, int] = {}

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
        """As ``PagedCache.allocate`` on the owner (chosen now for a new request; ``prefix``: None,
        there is no prefix cache under attention DP). Raises CacheFullError (from the owner, or
        rank 0's when no rank fits) with nothing taken."""
        r = self.owner.get(seq_id)
        if r is None:
            r = self._place(seq_id, num_tokens)
            r = 0 if r is None else r
        held = self.ranks[r].allocate(seq_id, num_tokens)
        self.owner[seq_id] = r
        return held

    def free(self, seq_id) -> None:
        r = self.owner.pop(seq_id, None)
        if r is not None:
            self.ranks[r].free(seq_id)

    def rank_of(self, seq_id) -> int:
        """The DP rank that holds ``seq_id``'s state. Raises KeyError."""
        return self.owner[seq_id]

    def sequence_state(self, seq_id, num_tokens: int) -> PagedSequenceState:
        """The owner's holdings over rank 0's pools: for another rank's request only the block
        tables and ``num_tokens`` mean anything (its rows live on that rank). Raises KeyError."""
        return PagedSequenceState(self.ranks[0], self.ranks[self.owner[seq_id]].seqs[seq_id], num_tokens)

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
