"""One request's decode state over the paged pools, as the model reads and writes it.

``PagedSequenceState`` / ``PagedLayerState`` / ``PagedEntries`` have the interfaces of the
contiguous ``engine.model.state`` classes (``SequenceState`` / ``LayerState`` / ``GrowBuffer``),
their rows reached through block tables (``slot_mapping``). Their ``cache`` is the pools they
view (``engine.core.kv_cache.PagedCache``, which builds them: named here, not imported, so the
dependency points one way).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.config import CSA_RATIO
from engine.core.block_manager import SeqBlocks, slot_mapping
from engine.model.state import CompressorState
from engine.ops.cache_codec import CacheRows



class PagedEntries:
    """Compressed entries of one request in one pool (``CacheRows``): the ``GrowBuffer`` interface."""

    def __init__(self, pool: CacheRows, table: torch.Tensor, bs: int, num_entries: int):
        self.pool, self.table, self.bs, self.num_entries = pool, table, bs, num_entries
        self.codec = pool.codec

    def _rows(self, first: int, n: int) -> torch.Tensor:
        idx = torch.arange(first, first + n, device=self.pool.device)
        return slot_mapping(self.table, self.bs, idx)

    def append(self, rows: torch.Tensor) -> None:
        """Write ``rows [n, D]`` as entries ``num_entries ..`` (encoded by the pool's codec)."""
        n = rows.shape[0]
        if n:
            self.pool.write(self._rows(self.num_entries, n), rows)
            self.num_entries += n

    def append_stored(self, parts) -> None:
        """Write rows already in the stored format (the codec's parts ``[n, w_i]``)."""
        n = parts[0].shape[0]
        if n:
            self.pool.scatter(self._rows(self.num_entries, n), parts)
            self.num_entries += n

    def view(self) -> torch.Tensor:
        """All entries ``[N, D]`` gathered in order, in the compute dtype (a copy)."""
        return self.pool.read(self._rows(0, self.num_entries))

    def stored(self) -> tuple[torch.Tensor, ...]:
        """All entries as stored (the codec's parts, gathered in order)."""
        return self.pool.gather(self._rows(0, self.num_entries))

    def paged(self) -> tuple[CacheRows, torch.Tensor, int]:
        """(pool, block table, block size): what the cache ops take (``GrowBuffer.paged``)."""
        return self.pool, self.table, self.bs


class PagedLayerState:
    """One layer of one request over the pools: the ``engine.model.state.LayerState`` interface."""

    def __init__(self, cache, layer: int, held: SeqBlocks, tables: dict[str, torch.Tensor],
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

    @classmethod
    def window_only(cls, cache, pool: CacheRows, win_table: torch.Tensor, num_tokens: int
                    ) -> "PagedLayerState":
        """A window-only layer over ``pool`` (an MTP layer's ring), with its ``num_tokens``."""
        st = cls.__new__(cls)
        st.bs, st.ring, st.window = cache.config.block_size, cache.geometry.ring_len, cache.args.sliding_window
        st.win_pool, st.win_table = pool, win_table
        st.cmp_kv = st.comp = st.idx_kv = st.idx_comp = st.comp_pool = st.idx_comp_pool = None
        st.num_tokens, st.cache = num_tokens, cache
        return st

    def ring_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat window-pool rows of token ``positions`` (long) in this request's ring."""
        return slot_mapping(self.win_table, self.bs, positions % self.ring)

    def window_keys(self, new_kv: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, int]:
        """As ``LayerState.window_keys``: ring history + ``new_kv``, and the first row's position."""
        n_hist = min(start_pos, self.window - 1)
        new_kv = self.win_pool.codec.round_trip(new_kv)       # what the ring will hold: read as stored
        if n_hist == 0:
            return new_kv, start_pos
        pos = torch.arange(start_pos - n_hist, start_pos, device=new_kv.device)
        return torch.cat([self.win_pool.read(self.ring_rows(pos)), new_kv]), start_pos - n_hist

    def write_window(self, new_kv: torch.Tensor, start_pos: int) -> None:
        """Store the last ``min(T, ring)`` rows of ``new_kv`` at their ring slots."""
        T = new_kv.shape[0]
        keep = min(T, self.ring)
        pos = torch.arange(start_pos + T - keep, start_pos + T, device=new_kv.device)
        self.win_pool.write(self.ring_rows(pos), new_kv[T - keep:])


def _comp_view(tensors: tuple[torch.Tensor, torch.Tensor], slot: int, ratio: int) -> CompressorState:
    """``CompressorState`` whose tensors are views into the state pool (updated in place)."""
    kv, score = tensors[0][slot], tensors[1][slot]
    if ratio != CSA_RATIO:
        return CompressorState(kv[:ratio], score[:ratio])
    d = kv.shape[1] // 2
    return CompressorState(kv[:ratio], score[:ratio], kv[ratio:2 * ratio, :d], score[ratio:2 * ratio, :d])


class PagedSequenceState:
    """A request's decode state over the pools: the ``engine.model.state.SequenceState`` interface."""

    def __init__(self, cache, held: SeqBlocks, num_tokens: int, layers: Iterable[int] | None = None):
        # block tables as tensors once per step, shared by all layers; ``layers``: build only these
        # (the others are None), e.g. when P/D extracts one finished layer
        tables = {p: torch.tensor(b, dtype=torch.long, device=cache.device) for p, b in held.tables.items()}
        self.cache, self.held = cache, held
        keep = None if layers is None else set(layers)
        self.layers = [PagedLayerState(cache, l, held, tables, num_tokens) if keep is None or l in keep else None
                       for l in range(cache.geometry.num_layers)]
        self.num_tokens = num_tokens
