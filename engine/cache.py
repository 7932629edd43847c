"""Paged decode-state pools: the per-request state of reference/dsv4-architecture.md §4.

Pools (manager keys after the NPU port, §4):
  * ``win``   window ring, every layer: ``ring_len`` token slots per request (position p at ring
    slot ``p % ring_len``), in blocks of ``block_size`` token slots (fixed per request);
  * ``c4``    CSA compressed KV + indexer keys: blocks of ``block_size`` entries (grow with L/4);
  * ``c128``  HCA compressed KV: blocks of ``block_size`` entries (grow with L/128);
  * ``state`` compressor remainders (fp32), one slot per request: ``num_ratio_group * m`` rows of
    width ``c * d`` per compressor, ``num_ratio_group = (1 if next_n == 0 else 2) + overlap``
    (reference/upstream-parallel-and-mtp.md, MTP section: the extra group lets rejected draft
    tokens be recompressed; MTP itself is not run yet).

A request's block table per pool lists its blocks in order; a slot mapping turns positions (or
entry ids) into flat rows of the pool tensors. Allocation is two-phase (check all pools, then
take), so a refused request holds nothing; ``free`` returns everything at once.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.config import CSA_RATIO, HCA_RATIO, ModelArgs
from engine.state import CompressorState

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

    @classmethod
    def of(cls, args: ModelArgs, block_size: int, next_n: int = 0) -> "Geometry":
        ring = math.ceil((args.sliding_window + next_n) / block_size) * block_size
        groups = 1 if next_n == 0 else 2
        return cls(block_size, ring,
                   tuple(i for i in range(args.num_hidden_layers) if args.compress_ratios[i] == CSA_RATIO),
                   tuple(i for i in range(args.num_hidden_layers) if args.compress_ratios[i] == HCA_RATIO),
                   args.num_hidden_layers, args.head_dim, args.index_head_dim,
                   {CSA_RATIO: (groups + 1) * CSA_RATIO, HCA_RATIO: groups * HCA_RATIO})

    def blocks_needed(self, pool: str, num_tokens: int) -> int:
        """Blocks of ``pool`` a request with ``num_tokens`` processed tokens holds."""
        if pool == "win":
            return self.ring_len // self.block_size
        m = CSA_RATIO if pool == "c4" else HCA_RATIO
        if not (self.csa_layers if pool == "c4" else self.hca_layers):
            return 0
        return math.ceil((num_tokens // m) / self.block_size)

    def bytes_per_block(self, pool: str, kv_bytes: int) -> int:
        """Bytes of one block of ``pool`` across all its layers (kv_bytes: element size of KV)."""
        bs, d = self.block_size, self.head_dim
        if pool == "win":
            return self.num_layers * bs * d * kv_bytes
        if pool == "c4":
            return len(self.csa_layers) * bs * (d + self.index_head_dim) * kv_bytes
        return len(self.hca_layers) * bs * d * kv_bytes

    def state_bytes(self) -> int:
        """fp32 compressor-remainder bytes of one request (kv + score rows, all compressors)."""
        csa = self.state_rows[CSA_RATIO] * 2 * (2 * self.head_dim + 2 * self.index_head_dim) * 4
        hca = self.state_rows[HCA_RATIO] * 2 * self.head_dim * 4
        return len(self.csa_layers) * csa + len(self.hca_layers) * hca


def plan_cache(args: ModelArgs, dtype: torch.dtype, block_size: int, max_seqs: int, budget_bytes: int,
               next_n: int = 0) -> CacheConfig:
    """Size the pools from a byte budget (``mem_fraction_static`` x memory - weights).

    Fixed parts (window ring, compressor state and a first block of each growing pool for
    ``max_seqs`` requests: a request holds whole blocks, so short ones would otherwise starve
    the HCA pool) come first; the rest is split between the CSA and HCA pools so both fill at the
    same token count.

    Raises:
        ValueError: the budget does not hold the fixed parts plus one block of each growing pool.
    """
    g = Geometry.of(args, block_size, next_n)
    esize = torch.empty(0, dtype=dtype).element_size()
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
    return CacheConfig(block_size, max_seqs, blocks, next_n)


def pool_bytes(args: ModelArgs, dtype: torch.dtype, config: CacheConfig) -> int:
    """Bytes ``PagedCache`` allocates for ``config`` (all pools, all layers; the scratch part for
    padding rows counts as one more request plus one trash row per entry pool)."""
    g = Geometry.of(args, config.block_size, config.next_n)
    esize = torch.empty(0, dtype=dtype).element_size()
    fixed = (config.max_seqs + 1) * (g.blocks_needed("win", 0) * g.bytes_per_block("win", esize) + g.state_bytes())
    trash = sum(g.bytes_per_block(p, esize) // config.block_size for p in GROWING)
    return fixed + trash + sum(config.num_blocks.get(p, 0) * g.bytes_per_block(p, esize) for p in GROWING)


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


class PagedCache:
    """The preallocated pools of one worker and their block manager.

    Tensors (``d`` head_dim, ``dI`` index_head_dim; flat rows = block * block_size + offset):
      win[l] ``[(n_win + ring/bs) * bs, d]``; c4_kv[l] ``[n_c4 * bs + 1, d]``, c4_idx[l]
      ``[n_c4 * bs + 1, dI]``; c128_kv[l] ``[n_c128 * bs + 1, d]``; comp_kv / comp_score[l]
      ``[max_seqs + 1, rows, c*d]`` fp32, idx_comp_kv / idx_comp_score[l] ``[max_seqs + 1, rows,
      2*dI]`` fp32 (CSA layers).

    Past the managed blocks each pool has a scratch part no request ever holds, for fixed-shape
    (graph) decode: ``pad_slot`` (a state slot) and ``pad_win_blocks`` (a window ring) for the
    padding rows of a batch bucket, and ``trash_row`` (the last row of an entry pool), where a
    compressor whose window does not close this step writes its unused entry.
    """

    def __init__(self, args: ModelArgs, config: CacheConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.args, self.config, self.dtype, self.device = args, config, dtype, device
        g = self.geometry = Geometry.of(args, config.block_size, config.next_n)
        bs, d, dI = config.block_size, args.head_dim, args.index_head_dim
        n_win = config.max_seqs * g.blocks_needed("win", 0)
        self.pools = {"win": BlockPool(n_win), "state": BlockPool(config.max_seqs)}
        for p in GROWING:
            self.pools[p] = BlockPool(config.num_blocks.get(p, 0) if g.blocks_needed(p, 1 << 30) else 0)
        kv = dict(dtype=dtype, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        S = config.max_seqs
        ring_blocks = g.blocks_needed("win", 0)
        self.pad_slot, self.pad_win_blocks = S, list(range(n_win, n_win + ring_blocks))
        self.win = [torch.zeros((n_win + ring_blocks) * bs, d, **kv) for _ in range(g.num_layers)]
        self.cmp_kv, self.idx_kv, self.comp, self.idx_comp = {}, {}, {}, {}
        for l in g.csa_layers:
            n = self.pools["c4"].num_blocks * bs + 1
            self.cmp_kv[l], self.idx_kv[l] = torch.zeros(n, d, **kv), torch.zeros(n, dI, **kv)
            rows = g.state_rows[CSA_RATIO]
            self.comp[l] = (torch.zeros(S + 1, rows, 2 * d, **f32), torch.zeros(S + 1, rows, 2 * d, **f32))
            self.idx_comp[l] = (torch.zeros(S + 1, rows, 2 * dI, **f32), torch.zeros(S + 1, rows, 2 * dI, **f32))
        for l in g.hca_layers:
            self.cmp_kv[l] = torch.zeros(self.pools["c128"].num_blocks * bs + 1, d, **kv)
            rows = g.state_rows[HCA_RATIO]
            self.comp[l] = (torch.zeros(S + 1, rows, d, **f32), torch.zeros(S + 1, rows, d, **f32))
        self.trash_row = {p: self.pools[p].num_blocks * bs for p in GROWING}
        self.seqs: dict[object, SeqBlocks] = {}

    # ---- accounting ------------------------------------------------------------------------
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

        A new request gets its state slot zeroed (CSA previous-window scores at -inf, §3.4).
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
            self._reset_state(held.state_slot)
            self.seqs[seq_id] = held
        for p in GROWING:
            held.tables.setdefault(p, []).extend(self.pools[p].take(need[p]))
        return held

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

    def _reset_state(self, slot: int) -> None:
        for l, (kv, score) in self.comp.items():
            _reset_comp(kv[slot], score[slot], l in self.idx_comp)
        for kv, score in self.idx_comp.values():
            _reset_comp(kv[slot], score[slot], True)

    # ---- per-sequence views for the model ---------------------------------------------------
    def sequence_state(self, seq_id, num_tokens: int) -> "PagedSequenceState":
        """The model-facing state of ``seq_id`` with ``num_tokens`` tokens already processed."""
        return PagedSequenceState(self, self.seqs[seq_id], num_tokens)


def _reset_comp(kv: torch.Tensor, score: torch.Tensor, overlap: bool) -> None:
    """Empty compressor remainder; CSA's previous-window scores start at -inf (weight 0, §3.4)."""
    kv.zero_()
    score.zero_()
    if overlap:
        score[CSA_RATIO:2 * CSA_RATIO, : score.shape[1] // 2] = float("-inf")


def _slots(table: torch.Tensor, bs: int, idx: torch.Tensor) -> torch.Tensor:
    """Slot mapping: flat pool rows of logical slots ``idx`` through a block table ``[n_blocks]``."""
    return table[idx // bs] * bs + idx % bs


class PagedEntries:
    """Compressed entries of one request in one pool tensor: the ``GrowBuffer`` interface."""

    def __init__(self, pool: torch.Tensor, table: torch.Tensor, bs: int, num_entries: int):
        self.pool, self.table, self.bs, self.num_entries = pool, table, bs, num_entries

    def append(self, rows: torch.Tensor) -> None:
        """Write ``rows [n, D]`` as entries ``num_entries ..``."""
        n = rows.shape[0]
        if n:
            idx = torch.arange(self.num_entries, self.num_entries + n, device=self.pool.device)
            self.pool[_slots(self.table, self.bs, idx)] = rows
            self.num_entries += n

    def view(self) -> torch.Tensor:
        """All entries ``[N, D]`` gathered in order (a copy)."""
        idx = torch.arange(self.num_entries, device=self.pool.device)
        return self.pool[_slots(self.table, self.bs, idx)]


class PagedLayerState:
    """One layer of one request over the pools: the ``engine.state.LayerState`` interface."""

    def __init__(self, cache: PagedCache, layer: int, held: SeqBlocks, tables: dict[str, torch.Tensor],
                 num_tokens: int):
        g, bs = cache.geometry, cache.config.block_size
        self.bs, self.ring, self.window = bs, g.ring_len, cache.args.sliding_window
        self.win_pool, self.win_table = cache.win[layer], tables["win"]
        self.cmp_kv = self.comp = self.idx_kv = self.idx_comp = None
        # the whole state pools of this layer, for decode rows batched across requests
        self.comp_pool, self.idx_comp_pool = cache.comp.get(layer), cache.idx_comp.get(layer)
        ratio = cache.args.compress_ratios[layer]
        if ratio:
            table = tables["c4" if ratio == CSA_RATIO else "c128"]
            self.cmp_kv = PagedEntries(cache.cmp_kv[layer], table, bs, num_tokens // ratio)
            self.comp = _comp_view(cache.comp[layer], held.state_slot, ratio)
        if ratio == CSA_RATIO:
            self.idx_kv = PagedEntries(cache.idx_kv[layer], tables["c4"], bs, num_tokens // ratio)
            self.idx_comp = _comp_view(cache.idx_comp[layer], held.state_slot, ratio)

    def _ring_rows(self, positions: torch.Tensor) -> torch.Tensor:
        return _slots(self.win_table, self.bs, positions % self.ring)

    def window_keys(self, new_kv: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, int]:
        """As ``LayerState.window_keys``: ring history + ``new_kv``, and the first row's position."""
        n_hist = min(start_pos, self.window - 1)
        if n_hist == 0:
            return new_kv, start_pos
        pos = torch.arange(start_pos - n_hist, start_pos, device=new_kv.device)
        return torch.cat([self.win_pool[self._ring_rows(pos)], new_kv]), start_pos - n_hist

    def write_window(self, new_kv: torch.Tensor, start_pos: int) -> None:
        """Store the last ``min(T, ring)`` rows of ``new_kv`` at their ring slots."""
        T = new_kv.shape[0]
        keep = min(T, self.ring)
        pos = torch.arange(start_pos + T - keep, start_pos + T, device=new_kv.device)
        self.win_pool[self._ring_rows(pos)] = new_kv[T - keep:]


def _comp_view(tensors: tuple[torch.Tensor, torch.Tensor], slot: int, ratio: int) -> CompressorState:
    """``CompressorState`` whose tensors are views into the state pool (updated in place)."""
    kv, score = tensors[0][slot], tensors[1][slot]
    if ratio != CSA_RATIO:
        return CompressorState(kv[:ratio], score[:ratio])
    d = kv.shape[1] // 2
    return CompressorState(kv[:ratio], score[:ratio], kv[ratio:2 * ratio, :d], score[ratio:2 * ratio, :d])


class PagedSequenceState:
    """A request's decode state over the pools: the ``engine.state.SequenceState`` interface."""

    def __init__(self, cache: PagedCache, held: SeqBlocks, num_tokens: int, layers: Iterable[int] | None = None):
        # block tables as tensors once per step, shared by all layers; ``layers``: build only these
        # (the others are None), e.g. when P/D extracts one finished layer
        tables = {p: torch.tensor(b, dtype=torch.long, device=cache.device) for p, b in held.tables.items()}
        self.cache, self.held = cache, held
        keep = None if layers is None else set(layers)
        self.layers = [PagedLayerState(cache, l, held, tables, num_tokens) if keep is None or l in keep else None
                       for l in range(cache.geometry.num_layers)]
        self.num_tokens = num_tokens


# ---- a request's state as named tensors (what P ships to D, reference §4) ----------------------
def state_tensors(cache: PagedCache, seq_id, num_tokens: int, layers: Iterable[int] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The live decode state of ``seq_id`` after ``num_tokens`` (= L) tokens, no padding.

    Per layer l: ``layers.l.win_kv`` ``[min(L, W-1), d]`` (positions L-W+1 .. L-1: what step L
    reads); CSA / HCA ``layers.l.cmp_kv`` ``[floor(L/m), d]``; CSA ``layers.l.idx_kv``
    ``[floor(L/4), dI]``; compressor remainders ``layers.l.{comp,idx_comp}.{kv,score}``
    ``[L mod m, c*d]`` fp32 (score with ape added) and, once a CSA window has closed,
    ``...prev_kv`` / ``...prev_score`` ``[m, d]``. Returns copies (contiguous). ``layers``: only
    these layers (P/D pushes each layer as soon as its state is final).
    """
    st = PagedSequenceState(cache, cache.seqs[seq_id], num_tokens, layers)
    out: dict[str, torch.Tensor] = {}
    for l, layer in enumerate(st.layers):
        if layer is None:
            continue
        n = min(num_tokens, layer.window - 1)
        pos = torch.arange(num_tokens - n, num_tokens, device=layer.win_pool.device)
        out.update(layer_state_tensors(l, layer, layer.win_pool[layer._ring_rows(pos)], num_tokens))
    return out


def layer_state_tensors(l: int, layer, win_kv: torch.Tensor, num_tokens: int) -> dict[str, torch.Tensor]:
    """Layer ``l``'s ``state_tensors`` entries from a ``PagedLayerState`` or a contiguous
    ``engine.state.LayerState`` (same attributes) after ``num_tokens`` tokens; ``win_kv``: its
    window rows, positions L-n .. L-1. Entries are ``view()`` results, remainders copies."""
    out = {f"layers.{l}.win_kv": win_kv}
    for name in ("cmp_kv", "idx_kv"):
        ent = getattr(layer, name)
        if ent is not None:
            out[f"layers.{l}.{name}"] = ent.view()
    for name in ("comp", "idx_comp"):
        comp = getattr(layer, name)
        if comp is None:
            continue
        m = comp.kv.shape[0]
        out[f"layers.{l}.{name}.kv"] = comp.kv[: num_tokens % m].clone()
        out[f"layers.{l}.{name}.score"] = comp.score[: num_tokens % m].clone()
        if comp.prev_kv is not None and num_tokens >= m:
            out[f"layers.{l}.{name}.prev_kv"] = comp.prev_kv.clone()
            out[f"layers.{l}.{name}.prev_score"] = comp.prev_score.clone()
    return out


def expected_shapes(cache: PagedCache, num_tokens: int, layers: Iterable[int] | None = None
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) that ``state_tensors`` gives for L = ``num_tokens`` on this model."""
    a, L = cache.args, num_tokens
    d, dI, kv = a.head_dim, a.index_head_dim, cache.dtype
    out = {}
    for l in (range(cache.geometry.num_layers) if layers is None else layers):
        out[f"layers.{l}.win_kv"] = ((min(L, a.sliding_window - 1), d), kv)
        m = a.compress_ratios[l]
        if not m:
            continue
        out[f"layers.{l}.cmp_kv"] = ((L // m, d), kv)
        comps = [("comp", d)] + ([("idx_comp", dI)] if m == CSA_RATIO else [])
        if m == CSA_RATIO:
            out[f"layers.{l}.idx_kv"] = ((L // m, dI), kv)
        for name, w in comps:
            width = 2 * w if m == CSA_RATIO else w
            out[f"layers.{l}.{name}.kv"] = ((L % m, width), torch.float32)
            out[f"layers.{l}.{name}.score"] = ((L % m, width), torch.float32)
            if m == CSA_RATIO and L >= m:
                out[f"layers.{l}.{name}.prev_kv"] = ((m, w), torch.float32)
                out[f"layers.{l}.{name}.prev_score"] = ((m, w), torch.float32)
    return out


def load_state_tensors(cache: PagedCache, seq_id, num_tokens: int, tensors: dict[str, torch.Tensor],
                       layers: Iterable[int] | None = None) -> None:
    """Write ``state_tensors`` output into ``seq_id``'s (already allocated, freshly reset) state;
    ``layers``: only these layers (each written once).

    Raises:
        ValueError: a missing / extra tensor, or a shape / dtype other than ``expected_shapes``
            (nothing is half-written: everything is checked before the first write).
    """
    if layers is not None:
        layers = sorted(set(layers))
        if any(not 0 <= l < cache.geometry.num_layers for l in layers):
            raise ValueError(f"layers {layers}: the model has {cache.geometry.num_layers}")
    want = expected_shapes(cache, num_tokens, layers)
    if set(tensors) != set(want):
        missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
        raise ValueError(f"state for L={num_tokens}: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, (shape, dtype) in want.items():
        t = tensors[k]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"state tensor {k}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    st = PagedSequenceState(cache, cache.seqs[seq_id], 0, layers)
    for l, layer in enumerate(st.layers):
        if layer is None:
            continue
        win = tensors[f"layers.{l}.win_kv"]
        pos = torch.arange(num_tokens - win.shape[0], num_tokens, device=layer.win_pool.device)
        layer.win_pool[layer._ring_rows(pos)] = win.to(layer.win_pool.device)
        for name in ("cmp_kv", "idx_kv"):
            ent = getattr(layer, name)
            if ent is not None:
                ent.append(tensors[f"layers.{l}.{name}"].to(ent.pool.device))
        for name in ("comp", "idx_comp"):
            comp = getattr(layer, name)
            if comp is None:
                continue
            r = num_tokens % comp.kv.shape[0]
            comp.kv[:r] = tensors[f"layers.{l}.{name}.kv"]
            comp.score[:r] = tensors[f"layers.{l}.{name}.score"]
            if f"layers.{l}.{name}.prev_kv" in tensors:
                comp.prev_kv.copy_(tensors[f"layers.{l}.{name}.prev_kv"])
                comp.prev_score.copy_(tensors[f"layers.{l}.{name}.prev_score"])

