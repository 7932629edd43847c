"""Block and slot accounting of the paged decode state (reference/dsv4-architecture.md §4); no torch.

Pools (manager keys after the NPU port, §4):
  * ``win``   window ring, every layer: ``ring_len`` token slots per request (position p at ring
    slot ``p % ring_len``), in blocks of ``block_size`` token slots (fixed per request);
  * ``c4``    CSA compressed KV + indexer keys: blocks of ``block_size`` entries (grow with L/4);
  * ``c128``  HCA compressed KV: blocks of ``block_size`` entries (grow with L/128);
  * ``state`` compressor remainders (fp32), one slot per request: ``num_ratio_group * m`` rows of
    width ``c * d`` per compressor, ``num_ratio_group = (1 if next_n == 0 else 2) + overlap``
    (reference/upstream-parallel-and-mtp.md, MTP section: the extra group lets rejected draft
    tokens be recompressed); with next_n > 0 the ``win`` blocks also hold the MTP layer's
    window ring (one more ring per request and MTP layer, the same block ids).

A request's block table per pool lists its blocks in order. Allocation is two-phase (check all
pools, then take), so a refused request holds nothing; ``free`` returns everything at once. The
scheduler and attention DP's placement need only this accounting, so it imports no torch; the
tensors live in ``engine.core.kv_cache``, and what the accounting decides for them (a new slot
cleared, a prefix state copied) is recorded as ``PoolOp`` s, which the model runner applies
before its next forward (``StepPlan.pool_ops``: on every rank, with no replay of the accounting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.cache_dtype import CacheDtype, indexer_row_bytes, kv_row_bytes
from engine.config import CSA_RATIO, HCA_RATIO, ModelArgs
from engine.core.block_pool import BlockPool, CacheFullError  # noqa: F401  (CacheFullError: re-exported)
from engine.core.prefix_cache import PrefixCache, PrefixEntry
from engine.core.step import PoolOp

GROWING = ("c4", "c128")


@dataclass(frozen=True)
class CacheConfig:
    """Pool geometry. ``num_blocks``: blocks per growing pool; ``max_seqs``: requests holding state;
    ``prefix_slots``: with prefix caching (``engine.core.prefix_cache``), window rings and state
    slots beyond ``max_seqs`` for cached boundary states (None: prefix caching off)."""

    block_size: int
    max_seqs: int
    num_blocks: dict[str, int]
    next_n: int = 0
    cache_dtype: CacheDtype = CacheDtype()     # storage of the KV / indexer caches (engine.cache_dtype)
    prefix_slots: int | None = None

    def __post_init__(self):
        if self.block_size < 1 or self.max_seqs < 1:
            raise ValueError(f"cache: block_size {self.block_size} and max_seqs {self.max_seqs} must be >= 1")
        if self.prefix_slots is not None and self.prefix_slots < 0:
            raise ValueError(f"cache: prefix_slots {self.prefix_slots} must be >= 0")
        for k in GROWING:
            if self.num_blocks.get(k, 0) < 0:
                raise ValueError(f"cache: num_blocks[{k!r}] must be >= 0")

    @property
    def num_slots(self) -> int:
        """State slots (and window rings): running requests' plus the prefix cache's."""
        return self.max_seqs + (self.prefix_slots or 0)


@dataclass(frozen=True)
class Geometry:
    """Per-model sizes the pools derive from (``ModelArgs`` + block size + MTP depth)."""

    block_size: int
    ring_len: int                 # window ring token slots per request, >= sliding_window + next_n
    csa_layers: tuple[int, ...]
    hca_layers: tuple[int, ...]
    num_layers: int
    head_dim: int
    index_head_dim: int
    state_rows: dict[int, int]    # ratio -> compressor state rows (num_ratio_group * m)
    rope_dim: int = 0
    cache_dtype: CacheDtype = CacheDtype()
    mtp_layers: int = 0           # MTP window rings per request (next_n > 0: the MTP layers)

    @classmethod
    def of(cls, args: ModelArgs, block_size: int, next_n: int = 0, cache_dtype: CacheDtype | None = None
           ) -> "Geometry":
        ring = math.ceil((args.sliding_window + next_n) / block_size) * block_size
        groups = 1 if next_n == 0 else 2
        return cls(block_size, ring,
                   tuple(i for i in range(args.num_hidden_layers) if args.compress_ratios[i] == CSA_RATIO),
                   tuple(i for i in range(args.num_hidden_layers) if args.compress_ratios[i] == HCA_RATIO),
                   args.num_hidden_layers, args.head_dim, args.index_head_dim,
                   {CSA_RATIO: (groups + 1) * CSA_RATIO, HCA_RATIO: groups * HCA_RATIO},
                   args.qk_rope_head_dim, cache_dtype or CacheDtype(), args.num_mtp_layers if next_n else 0)

    def entries(self, pool: str, num_tokens: int) -> int:
        """Entries of ``pool`` (``c4`` / ``c128``) a request with ``num_tokens`` tokens holds (0
        without such layers)."""
        if not (self.csa_layers if pool == "c4" else self.hca_layers):
            return 0
        return num_tokens // (CSA_RATIO if pool == "c4" else HCA_RATIO)

    def blocks_needed(self, pool: str, num_tokens: int) -> int:
        """Blocks of ``pool`` a request with ``num_tokens`` processed tokens holds."""
        if pool == "win":
            return self.ring_len // self.block_size
        return math.ceil(self.entries(pool, num_tokens) / self.block_size)

    def bytes_per_block(self, pool: str, kv_bytes: int) -> int:
        """Bytes of one block of ``pool`` across all its layers (kv_bytes: element size of the
        compute dtype; rows stored as ``cache_dtype`` says: ``engine.cache_dtype``)."""
        bs = self.block_size
        kv = kv_row_bytes(self.cache_dtype.kv, self.head_dim, self.rope_dim, kv_bytes)
        if pool == "win":
            return (self.num_layers + self.mtp_layers) * bs * kv
        if pool == "c4":
            return len(self.csa_layers) * bs * (kv + indexer_row_bytes(self.cache_dtype.indexer, self.index_head_dim,
                                                                       kv_bytes))
        return len(self.hca_layers) * bs * kv

    def state_bytes(self) -> int:
        """fp32 compressor-remainder bytes of one request (kv + score rows, all compressors)."""
        csa = self.state_rows[CSA_RATIO] * 2 * (2 * self.head_dim + 2 * self.index_head_dim) * 4
        hca = self.state_rows[HCA_RATIO] * 2 * self.head_dim * 4
        return len(self.csa_layers) * csa + len(self.hca_layers) * hca

    def capacity(self, config: CacheConfig) -> int:
        """Tokens one request can hold given ``config``'s growing-pool block counts."""
        cap = []
        for p, m in (("c4", CSA_RATIO), ("c128", HCA_RATIO)):
            if self.blocks_needed(p, 1 << 40):
                cap.append((config.num_blocks.get(p, 0) * self.block_size + 1) * m - 1)
        return min(cap) if cap else 1 << 40


def plan_cache(args: ModelArgs, dtype, block_size: int, max_seqs: int, budget_bytes: int,
               next_n: int = 0, cache_dtype: CacheDtype | None = None, prefix_slots: int | None = None
               ) -> CacheConfig:
    """Size the pools from a byte budget (``mem_fraction_static`` x memory - weights).

    ``dtype``: the compute dtype (anything with ``itemsize`` bytes, e.g. a ``torch.dtype``);
    ``cache_dtype``: the caches' storage (None: unquantised, rows of ``dtype``);
    ``prefix_slots``: the prefix cache's snapshot rings and slots (``CacheConfig``).
    Fixed parts (window ring, compressor state and a first block of each growing pool for
    ``max_seqs`` requests: a request holds whole blocks, so short ones would otherwise starve
    the HCA pool) come first; the rest is split between the CSA and HCA pools so both fill at the
    same token count.

    Raises:
        ValueError: the budget does not hold the fixed parts plus one block of each growing pool.
    """
    cache_dtype = cache_dtype or CacheDtype()
    g = Geometry.of(args, block_size, next_n, cache_dtype)
    esize = dtype.itemsize
    growing = {p: g.bytes_per_block(p, esize) for p in GROWING if g.bytes_per_block(p, esize)}
    # + the scratch part (one more window ring and state slot, one trash row per entry pool)
    fixed = (max_seqs * (g.blocks_needed("win", 0) * g.bytes_per_block("win", esize) + g.state_bytes()
                         + sum(growing.values()))
             + (1 + (prefix_slots or 0)) * (g.blocks_needed("win", 0) * g.bytes_per_block("win", esize)
                                            + g.state_bytes())
             + sum(b // block_size for b in growing.values()))
    if budget_bytes < fixed:
        raise ValueError(f"cache: a budget of {budget_bytes} bytes is below the minimum {fixed} bytes "
                         f"(window ring, compressor state and one block per pool for {max_seqs} requests); "
                         f"raise mem_fraction_static / cpu_memory_gb or lower batch_size")
    ratio = {"c4": CSA_RATIO, "c128": HCA_RATIO}
    per_token = sum(b / (ratio[p] * block_size) for p, b in growing.items())
    tokens = (budget_bytes - fixed) / per_token if per_token else 0
    blocks = {p: max_seqs + int(tokens // (ratio[p] * block_size)) for p in growing}
    return CacheConfig(block_size, max_seqs, blocks, next_n, cache_dtype, prefix_slots)


def pool_bytes(args: ModelArgs, dtype, config: CacheConfig) -> int:
    """Bytes ``PagedCache`` allocates for ``config`` (all pools, all layers; the scratch part for
    padding rows counts as one more request plus one trash row per entry pool). ``dtype``: the KV
    element type (has ``itemsize``)."""
    g = Geometry.of(args, config.block_size, config.next_n, config.cache_dtype)
    esize = dtype.itemsize
    fixed = (config.num_slots + 1) * (g.blocks_needed("win", 0) * g.bytes_per_block("win", esize) + g.state_bytes())
    trash = sum(g.bytes_per_block(p, esize) // config.block_size for p in GROWING)
    return fixed + trash + sum(config.num_blocks.get(p, 0) * g.bytes_per_block(p, esize) for p in GROWING)


def slot_mapping(table, bs: int, idx):
    """Flat pool rows of logical slots ``idx`` (a long tensor) through block tables (long tensors).

    ``table``: one block table ``[n_blocks]`` (``idx`` indexes it), or one per row ``[B, n_blocks]``
    with ``idx`` ``[B, k]`` (gathered row by row); ``bs``: block size (slots). Row of slot i is
    ``table[i // bs] * bs + i % bs``; same shape as ``idx``, long.
    """
    if table.dim() == 2:
        return table.gather(1, idx // bs) * bs + idx % bs
    return table[idx // bs] * bs + idx % bs


@dataclass
class SeqBlocks:
    """One request's (or prefix-cache entry's) holdings: its state slot and block table per pool."""

    state_slot: int
    tables: dict[str, list[int]] = field(default_factory=dict)
    num_cached: int = 0      # tokens whose state came from a prefix-cache entry


class BlockManager:
    """The free lists of one set of pools and what each request holds (accounting only).

    Args:
        args: the model's sizes. config: pool geometry (``plan_cache`` or explicit).
        rank: the attention-DP rank whose pools these are (None: every rank's, replicated).
        ops: the list the ``PoolOp`` s are recorded in (None: its own; attention DP's ranks
            share one, so their order is kept). ``take_ops`` drains it.
    """

    def __init__(self, args: ModelArgs, config: CacheConfig, rank: int | None = None, ops: list | None = None):
        self.args, self.config, self.rank = args, config, rank
        self.ops: list[PoolOp] = [] if ops is None else ops
        g = self.geometry = Geometry.of(args, config.block_size, config.next_n, config.cache_dtype)
        self.pools = {"win": BlockPool(config.num_slots * g.blocks_needed("win", 0)),
                      "state": BlockPool(config.num_slots)}
        for p in GROWING:
            self.pools[p] = BlockPool(config.num_blocks.get(p, 0) if g.blocks_needed(p, 1 << 30) else 0)
        self.seqs: dict[object, SeqBlocks] = {}
        self.prefix = PrefixCache() if config.prefix_slots is not None else None

    def take_ops(self) -> list[PoolOp]:
        """The ``PoolOp`` s recorded since the last call, in order (the list is emptied)."""
        out = self.ops[:]
        self.ops.clear()
        return out

    def num_free(self) -> dict[str, int]:
        """Free blocks per pool (``state`` counts request slots)."""
        return {k: p.num_free for k, p in self.pools.items()}

    def num_total(self) -> dict[str, int]:
        return {k: p.num_blocks for k, p in self.pools.items()}

    def _needs(self, seq_id, num_tokens: int, shared: dict[str, list[int]] | None = None) -> dict[str, int]:
        g = self.geometry
        held = self.seqs.get(seq_id)
        have = {p: len(held.tables.get(p, [])) if held else len((shared or {}).get(p, ())) for p in GROWING}
        need = {p: g.blocks_needed(p, num_tokens) - have[p] for p in GROWING}
        if held is None:
            need["win"] = g.blocks_needed("win", 0)
            need["state"] = 1
        return {k: max(0, v) for k, v in need.items()}

    def can_allocate(self, seq_id, num_tokens: int, reserve: dict[str, int] | None = None) -> bool:
        """Whether ``seq_id`` can hold ``num_tokens`` tokens, keeping ``reserve`` blocks spare
        (blocks only prefix-cache entries hold count as free: ``allocate`` evicts them)."""
        reserve = reserve or {}
        return all(self.pools[p].num_free + self.pools[p].num_evictable - reserve.get(p, 0) >= n
                   for p, n in self._needs(seq_id, num_tokens).items())

    def allocate(self, seq_id, num_tokens: int, prefix: bytes | None = None) -> SeqBlocks:
        """Grow (or create) ``seq_id``'s holdings to cover ``num_tokens`` tokens, evicting
        prefix-cache entries (least recently used first) while a pool is short.

        ``prefix`` (a new request): the key of a cached boundary state (``PrefixCache.plan``) to
        start from: its full entry blocks are shared, the rest copied (``copy_state``), and
        ``SeqBlocks.num_cached`` says how many tokens that covers (0: the entry is gone or the
        room for its copy is not there; the request then holds fresh state, as without it).
        A new request's state slot otherwise goes through ``reset_slot`` (the pools clear it).
        An MTP engine's hit also binds the entry's carry to the request ("carry_bind").
        Raises:
            CacheFullError: some pool is short even with every entry evicted; nothing was taken.
        """
        entry = self.prefix.touch(prefix) if prefix is not None and seq_id not in self.seqs else None
        shared = {}
        if entry is not None:   # its full entry blocks, held first: no eviction below frees them
            bs = self.config.block_size
            shared = {p: self.pools[p].share(entry.blocks.tables.get(p, [])[:self.geometry.entries(p, entry.num_tokens) // bs])
                      for p in GROWING}
        need = self._needs(seq_id, num_tokens, shared)
        short = self._make_room(need, keep=prefix if entry else None)
        if short and entry:     # no room for the copy: fresh state instead
            for p, blocks in shared.items():
                self.pools[p].give(blocks)
            return self.allocate(seq_id, num_tokens)
        if short:
            raise CacheFullError(f"cache full for {seq_id!r}: " + ", ".join(
                f"{p} needs {n} blocks, {f} free" for p, (n, f) in short.items()))
        held = self.seqs.get(seq_id)
        if held is None:
            held = self.seqs[seq_id] = SeqBlocks(self.pools["state"].take(1)[0])
            held.tables["win"] = self.pools["win"].take(need["win"])
            held.tables.update({p: list(blocks) for p, blocks in shared.items()})
            if entry is None:
                self.reset_slot(held.state_slot)
        for p in GROWING:
            held.tables.setdefault(p, []).extend(self.pools[p].take(need[p]))
        if entry is not None:
            held.num_cached = entry.num_tokens
            self.copy_state(entry.blocks, held, entry.num_tokens)
            self.ops.append(PoolOp("carry_bind", self.rank, (prefix, seq_id)))
        return held

    def _make_room(self, need: dict[str, int], keep: bytes | None = None) -> dict[str, tuple[int, int]]:
        """Evict entries (least recently used first, never ``keep``) until ``need`` fits; returns
        what is still short: pool -> (needed, free). Evicts nothing when evicting every entry
        would not be enough."""
        if any(n > self.pools[p].num_free + self.pools[p].num_evictable for p, n in need.items()):
            return {p: (n, self.pools[p].num_free) for p, n in need.items() if n > self.pools[p].num_free}
        while True:
            short = {p: (n, self.pools[p].num_free) for p, n in need.items() if n > self.pools[p].num_free}
            if not short or self.prefix is None or not self._evict(keep):
                return short

    def _evict(self, keep: bytes | None = None, evicted: bool = True) -> bool:
        key, entry = self.prefix.pop_lru(keep, evicted)
        if entry is None:
            return False
        self.ops.append(PoolOp("carry_drop", self.rank, (key,)))
        self.pools["state"].give([entry.blocks.state_slot], cached=True)
        for p, blocks in entry.blocks.tables.items():
            self.pools[p].give(blocks, cached=True)
        return True

    def cache_prefix(self, seq_id, key: bytes, num_tokens: int, chain: tuple[bytes, ...]) -> bool:
        """Keep ``seq_id``'s state after ``num_tokens`` tokens (a multiple of 128, what it holds
        now) as the prefix-cache entry ``key`` (``chain``: its chunk hashes): its entry blocks
        shared, its window ring(s) and state slot copied into the entry's own, and (MTP) the last
        step's streams row of the boundary kept as its carry ("carry_save"). False when caching
        is off, ``key`` is already cached, or no ring / slot can be freed for it."""
        if self.prefix is None or self.prefix.touch(key) is not None:
            return False
        ring = self.geometry.blocks_needed("win", 0)
        if self._make_room({"state": 1, "win": ring}):
            return False
        held = self.seqs[seq_id]
        snap = SeqBlocks(self.pools["state"].take(1, cached=True)[0])
        snap.tables["win"] = self.pools["win"].take(ring, cached=True)
        for p in GROWING:
            n = -(-self.geometry.entries(p, num_tokens) // self.config.block_size)
            snap.tables[p] = self.pools[p].share(held.tables.get(p, [])[:n], cached=True)
        self.copy_state(held, snap, num_tokens)
        self.ops.append(PoolOp("carry_save", self.rank, (key, seq_id, num_tokens)))
        self.prefix.add(key, PrefixEntry(num_tokens, snap, chain))
        return True

    def reset_prefix_cache(self) -> int:
        """Evict every entry; returns how many there were."""
        n = 0
        while self.prefix is not None and self._evict(evicted=False):
            n += 1
        return n

    def copy_state(self, src: SeqBlocks, dst: SeqBlocks, num_tokens: int) -> None:
        """Record that ``dst`` must hold ``src``'s state after ``num_tokens`` tokens (a 128
        multiple): window ring, state slot and the entry blocks the two do not share
        (``PagedCache.copy_state``)."""
        self.ops.append(PoolOp("copy", self.rank, (src.state_slot, _tables(src), dst.state_slot, _tables(dst),
                                                   num_tokens)))

    def reset_slot(self, slot: int) -> None:
        """Record that a new request's state slot must be cleared (``PagedCache.reset_slot``)."""
        self.ops.append(PoolOp("reset", self.rank, (slot,)))

    def rank_of(self, seq_id) -> int:
        """The attention-DP rank whose pools hold ``seq_id``: 0 (one set of pools; ``DPCache`` has more)."""
        return 0

    def free(self, seq_id) -> None:
        """Return everything ``seq_id`` holds (no-op if it holds nothing)."""
        held = self.seqs.pop(seq_id, None)
        if held is None:
            return
        self.ops.append(PoolOp("free", self.rank, (seq_id,)))
        self.pools["state"].give([held.state_slot])
        for p, blocks in held.tables.items():
            self.pools[p].give(blocks)


def _tables(held: SeqBlocks) -> dict[str, list[int]]:
    """A copy of ``held``'s block tables (they grow after an op is recorded)."""
    return {p: list(b) for p, b in held.tables.items()}
