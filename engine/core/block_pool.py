"""The free list of one state pool, with reference counts (a block held by several requests and
prefix-cache entries: ``engine.core.prefix_cache``); no torch."""
from __future__ import annotations


class CacheFullError(RuntimeError):
    """A pool has too few free blocks for the request (the scheduler queues or preempts)."""


class BlockPool:
    """Free list of block ids ``0 .. n-1`` (FIFO reuse) with reference counts.

    A block is held by one or more requests and prefix-cache entries (``engine.core.prefix_cache``);
    it is free again once the last of them gives it back. ``num_evictable`` counts the blocks only
    entries hold: what evicting every entry would free.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
        self._ref = [0] * num_blocks        # holders
        self._cached = [0] * num_blocks     # of which prefix-cache entries
        self.num_evictable = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int, cached: bool = False) -> list[int]:
        """``n`` free block ids, held once (by an entry: ``cached``). Raises CacheFullError if
        fewer are free."""
        if n == 0:
            return []
        if n > len(self._free):
            raise CacheFullError(f"need {n} blocks, {len(self._free)} free")
        got, self._free = self._free[:n], self._free[n:]
        self._count(got, 1, cached)
        return got

    def share(self, blocks: list[int], cached: bool = False) -> list[int]:
        """Hold blocks already held once more (by an entry: ``cached``); returns them."""
        if any(not self._ref[b] for b in blocks):
            raise RuntimeError(f"sharing a free block among {blocks[:8]}")
        self._count(blocks, 1, cached)
        return blocks

    def give(self, blocks: list[int], cached: bool = False) -> None:
        """Drop one hold of each block (an entry's: ``cached``); the last one frees it.
        Raises RuntimeError on a double free (a bookkeeping bug, never silent)."""
        for b in blocks:
            if not (self._cached[b] if cached else self._ref[b] - self._cached[b]):
                raise RuntimeError(f"block {b} freed twice")
        self._count(blocks, -1, cached)
        self._free.extend(b for b in blocks if not self._ref[b])

    def _count(self, blocks: list[int], d: int, cached: bool) -> None:
        for b in blocks:
            was = self._ref[b] > 0 and self._ref[b] == self._cached[b]
            self._ref[b] += d
            self._cached[b] += d if cached else 0
            now = self._ref[b] > 0 and self._ref[b] == self._cached[b]
            self.num_evictable += now - was
