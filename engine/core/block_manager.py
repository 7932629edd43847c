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
tensors live in ``engine.core.kv_cache``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.cache_dtype import CacheDtype, indexer_row_bytes, kv_row_bytes
from engine.config import CSA_RATIO, HCA_RATIO, ModelArgs

GROWING = ("c4", "c128")


class CacheFullError(RuntimeError):
    """A pool has too few free blocks for the request (the scheduler queues or preempts)."""


@dataclass(frozen=True)
class CacheConfig:
    """Pool geometry. ``num_blocks``: blocks per growing pool; ``max_seqs``: requests holding state."""

    block_size: int
    max_seqs: int
    num_blocks: dict[str, int]
    next_n: int = 0
    cache_dtype: CacheDtype = CacheDtype()     # storage of the KV / indexer caches (engine.cache_dtype)

    def __post_init__(self):
        if self.block_size < 1 or self.max_seqs < 1:
            raise ValueError(f"cache: block_size {self.block_size} and max_seqs {self.max_seqs} must be >= 1")
        for k in GROWING:
            if self.num_blocks.get(k, 0) < 0:
                raise ValueError(f"cache: num_blocks[{k!r}] must be >= 0")


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

    def blocks_needed(self, pool: str, num_tokens: int) -> int:
        """Blocks of ``pool`` a request with ``num_tokens`` processed tokens holds."""
        if pool == "win":
            return self.ring_len // self.block_size
        m = CSA_RATIO if pool == "c4" else HCA_RATIO
        if not (self.csa_layers if pool == "c4" else self.hca_layers):
            return 0
        return math.ceil((num_tokens // m) / self.block_size)

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
               next_n: int = 0, cache_dtype: CacheDtype | None = None) -> CacheConfig:
    """Size the pools from a byte budget (``mem_fraction_static`` x memory - weights).

    ``dtype``: the compute dtype (anything with ``itemsize`` bytes, e.g. a ``torch.dtype``);
    ``cache_dtype``: the caches' storage (None: unquantised, rows of ``dtype``).
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
             + g.blocks_needed("win", 0) * g.bytes_per_block("win", esize) + g.state_bytes()
             + sum(b // block_size for b in growing.values()))
    if budget_bytes < fixed:
        raise ValueError(f"cache: a budget of {budget_bytes} bytes is below the minimum {fixed} bytes "
                         f"(window ring, compressor state and one block per pool for {max_seqs} requests); "
                         f"raise mem_fraction_static / cpu_memory_gb or lower batch_size")
    ratio = {"c4": CSA_RATIO, "c128": HCA_RATIO}
    per_token = sum(b / (ratio[p] * block_size) for p, b in growing.items())
    tokens = (budget_bytes - fixed) / per_token if per_token else 0
    blocks = {p: max_seqs + int(tokens // (ratio[p] * block_size)) for p in growing}
    return CacheConfig(block_size, max_seqs, blocks, next_n, cache_dtype)


def pool_bytes(args: ModelArgs, dtype, config: CacheConfig) -> int:
    """Bytes ``PagedCache`` allocates for ``config`` (all pools, all layers; the scratch part for
    padding rows counts as one more request plus one trash row per entry pool). ``dtype``: the KV
    element type (has ``itemsize``)."""
    g = Geometry.of(args, config.block_size, config.next_n, config.cache_dtype)
    esize = dtype.itemsize
    fixed = (config.max_seqs + 1) * (g.blocks_needed("win", 0) * g.bytes_per_block("win", esize) + g.state_bytes())
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


class BlockPool:
    """Free list of block ids ``0 .. n-1`` (FIFO reuse) with an exact free count."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free block ids. Raises CacheFullError if fewer are free."""
        if n == 0:
            return []
        if n > len(self._free):
            raise CacheFullError(f"need {n} blocks, {len(self._free)} free")
        got, self._free = self._free[:n], self._free[n:]
        for b in got:
            self._used[b] = True
        return got

    def give(self, blocks: list[int]) -> None:
        """Return blocks. Raises RuntimeError on a double free (a bookkeeping bug, never silent)."""
        for b in blocks:
            if not self._used[b]:
                raise RuntimeError(f"block {b} freed twice")
            self._used[b] = False
        self._free.extend(blocks)


@dataclass
class SeqBlocks:
    """One request's holdings: its state slot and block table per pool."""

    state_slot: int
    tables: dict[str, list[int]] = field(default_factory=dict)


class BlockManager:
    """The free lists of one set of pools and what each request holds (accounting only).

    Args:
        args: the model's sizes. config: pool geometry (``plan_cache`` or explicit).
    """

    def __init__(self, args: ModelArgs, config: CacheConfig):
        self.args, self.config = args, config
        g = self.geometry = Geometry.of(args, config.block_size, config.next_n, config.cache_dtype)
        self.pools = {"win": BlockPool(config.max_seqs * g.blocks_needed("win", 0)),
                      "state": BlockPool(config.max_seqs)}
        for p in GROWING:
            self.pools[p] = BlockPool(config.num_blocks.get(p, 0) if g.blocks_needed(p, 1 << 30) else 0)
        self.seqs: dict[object, SeqBlocks] = {}

    def num_free(self) -> dict[str, int]:
        """Free blocks per pool (``state`` counts request slots)."""
        return {k: p.num_free for k, p in self.pools.items()}

    def num_total(self) -> dict[str, int]:
        return {k: p.num_blocks for k, p in self.pools.items()}

    def _needs(self, seq_id, num_tokens: int) -> dict[str, int]:
        g = self.geometry
        held = self.seqs.get(seq_id)
        need = {p: g.blocks_needed(p, num_tokens) - (len(held.tables.get(p, [])) if held else 0) for p in GROWING}
        if held is None:
            need["win"] = g.blocks_needed("win", 0)
            need["state"] = 1
        return {k: max(0, v) for k, v in need.items()}

    def can_allocate(self, seq_id, num_tokens: int, reserve: dict[str, int] | None = None) -> bool:
        """Whether ``seq_id`` can hold ``num_tokens`` tokens, keeping ``reserve`` blocks spare."""
        reserve = reserve or {}
        return all(self.pools[p].num_free - reserve.get(p, 0) >= n for p, n in self._needs(seq_id, num_tokens).items())

    def allocate(self, seq_id, num_tokens: int) -> SeqBlocks:
        """Grow (or create) ``seq_id``'s holdings to cover ``num_tokens`` tokens.

        A new request's state slot goes through ``reset_slot`` (the pools clear it there).
        Raises:
            CacheFullError: some pool is short; nothing was taken.
        """
        need = self._needs(seq_id, num_tokens)
        short = {p: (n, self.pools[p].num_free) for p, n in need.items() if n > self.pools[p].num_free}
        if short:
            raise CacheFullError(f"cache full for {seq_id!r}: " + ", ".join(
                f"{p} needs {n} blocks, {f} free" for p, (n, f) in short.items()))
        held = self.seqs.get(seq_id)
        if held is None:
            held = SeqBlocks(self.pools["state"].take(1)[0])
            held.tables["win"] = self.pools["win"].take(need["win"])
            self.reset_slot(held.state_slot)
            self.seqs[seq_id] = held
        for p in GROWING:
            held.tables.setdefault(p, []).extend(self.pools[p].take(need[p]))
        return held

    def reset_slot(self, slot: int) -> None:
        """Called with a new request's state slot (accounting only: nothing to reset)."""

    def rank_of(self, seq_id) -> int:
        """The attention-DP rank whose pools hold ``seq_id``: 0 (one set of pools; ``DPCache`` has more)."""
        return 0

    def free(self, seq_id) -> None:
        """Return everything ``seq_id`` holds (no-op if it holds nothing)."""
        held = self.seqs.pop(seq_id, None)
        if held is None:
            return
        self.pools["state"].give([held.state_slot])
        for p, blocks in held.tables.items():
            self.pools[p].give(blocks)
