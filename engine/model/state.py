"""Per-request decode state of one sequence (reference/dsv4-architecture.md §4).

For a sequence with ``L`` processed tokens every layer keeps:
  * the window ring: KV of the last ``sliding_window`` positions, position p at slot ``p % W``;
  * CSA / HCA: compressed KV entries ``[floor(L/m), d]``;
  * CSA: indexer keys ``[floor(L/4), dI]``;
  * compressor remainders (fp32): raw projections of the ``L mod m`` tokens of the open window,
    with ape already added to the score, plus for CSA the Ca/Za of the last closed window.

This is the contiguous single-sequence form the model runs on; the paged pools of the serving
engine hold the same tensors in blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cache_dtype import CacheDtype
from engine.config import CSA_RATIO, ModelArgs
from engine.ops.cache_codec import CacheCodec, CacheRows, codecs_for


class GrowBuffer:
    """Append-only rows ``[N, dim]`` kept in a cache's stored format (``codec``; None: the rows
    as given, in ``dtype``), with amortised O(1) appends (capacity doubles)."""

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 16,
                 codec: CacheCodec | None = None):
        self.codec = codec or CacheCodec("none", dim, dtype)
        self._rows = CacheRows.zeros(self.codec, capacity, device)
        self.num_entries = 0

    def append(self, rows: torch.Tensor) -> None:
        """Append ``rows [n, dim]`` (encoded by the codec)."""
        self._grow(rows.shape[0])
        self._rows.write(slice(self.num_entries, self.num_entries + rows.shape[0]), rows)
        self.num_entries += rows.shape[0]

    def append_stored(self, parts) -> None:
        """Append rows already in the stored format (the codec's parts ``[n, w_i]``)."""
        n = parts[0].shape[0]
        self._grow(n)
        self._rows.scatter(slice(self.num_entries, self.num_entries + n), parts)
        self.num_entries += n

    def _grow(self, n: int) -> None:
        need = self.num_entries + n
        if need > self._rows.num_rows:
            grown = CacheRows.zeros(self.codec, max(need, 2 * self._rows.num_rows), self._rows.device)
            grown.scatter(slice(0, self.num_entries), self._rows.gather(slice(0, self.num_entries)))
            self._rows = grown

    def view(self) -> torch.Tensor:
        """The live entries ``[N, dim]`` in the compute dtype (unquantised: a view, valid until
        the next append; quantised: decoded)."""
        return self._rows.read(slice(0, self.num_entries))

    def stored(self) -> tuple[torch.Tensor, ...]:
        """The live entries as stored (the codec's parts, views)."""
        return self._rows.gather(slice(0, self.num_entries))

    def paged(self) -> tuple[CacheRows, torch.Tensor, int]:
        """(pool, block table, block size) as the cache ops take a sequence's entries: the buffer
        is one block as long as its capacity."""
        return self._rows, torch.zeros(1, dtype=torch.long, device=self._rows.device), self._rows.num_rows


@dataclass
class CompressorState:
    """Remainder of a streaming compressor (§3.4): fp32, updated in place by ``ops.compressor``.

    kv, score: ``[m, c*d]`` rows ``0 .. L%m - 1`` hold the open window's projections (score + ape).
    prev_kv, prev_score: ``[m, d]`` Ca / Za+ape of the last closed window (CSA only; score -inf
    and kv 0 before the first window closes).
    """

    kv: torch.Tensor
    score: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None

    @classmethod
    def new(cls, ratio: int, dim: int, overlap: bool, device) -> "CompressorState":
        width = 2 * dim if overlap else dim
        f32 = dict(dtype=torch.float32, device=device)
        st = cls(torch.zeros(ratio, width, **f32), torch.zeros(ratio, width, **f32))
        if overlap:
            st.prev_kv = torch.zeros(ratio, dim, **f32)
            st.prev_score = torch.full((ratio, dim), float("-inf"), **f32)
        return st


@dataclass
class LayerState:
    """One layer's decode state; ``cmp_kv`` / ``idx_kv`` / compressor states per layer kind."""

    win_kv: CacheRows                         # [W] ring rows, read as [W, d]
    cmp_kv: GrowBuffer | None = None          # CSA / HCA
    comp: CompressorState | None = None
    idx_kv: GrowBuffer | None = None          # CSA
    idx_comp: CompressorState | None = None

    def window_keys(self, new_kv: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, int]:
        """History from the ring + the chunk's new KV, and the position of its first row.

        Args:
            new_kv: ``[T, d]`` KV of positions ``start_pos .. start_pos+T-1``.
        Returns:
            (``[n_hist + T, d]``, first position) with ``n_hist = min(start_pos, W-1)``.
        """
        W = self.win_kv.num_rows
        n_hist = min(start_pos, W - 1)
        new_kv = self.win_kv.codec.round_trip(new_kv)       # what the ring will hold: read as stored
        if n_hist == 0:
            return new_kv, start_pos
        slots = torch.arange(start_pos - n_hist, start_pos, device=new_kv.device) % W
        return torch.cat([self.win_kv.read(slots), new_kv]), start_pos - n_hist

    def write_window(self, new_kv: torch.Tensor, start_pos: int) -> None:
        """Store the last ``min(T, W)`` rows of ``new_kv`` at slots ``p % W``."""
        W = self.win_kv.num_rows
        T = new_kv.shape[0]
        keep = min(T, W)
        pos = torch.arange(start_pos + T - keep, start_pos + T, device=new_kv.device)
        self.win_kv.write(pos % W, new_kv[T - keep:])


@dataclass
class SequenceState:
    """Decode state of one sequence across all layers (backbone, then MTP)."""

    layers: list[LayerState]
    num_tokens: int = 0
    mtp_layers: list[LayerState] = field(default_factory=list)

    @classmethod
    def new(cls, args: ModelArgs, dtype: torch.dtype, device: torch.device | str = "cpu",
            with_mtp: bool = False, cache: CacheDtype | None = None) -> "SequenceState":
        """Empty state for ``args``: KV and indexer keys in ``cache``'s formats (None: unquantised,
        ``dtype``), read in ``dtype``; compressor remainders in fp32."""
        codecs = codecs_for(cache or CacheDtype(), args.head_dim, args.qk_rope_head_dim, args.index_head_dim, dtype)
        layers = [_layer_state(args, args.compress_ratios[i], codecs, device) for i in range(args.num_hidden_layers)]
        mtp = [_layer_state(args, 0, codecs, device) for _ in range(args.num_mtp_layers)] if with_mtp else []
        return cls(layers=layers, mtp_layers=mtp)


def _layer_state(args: ModelArgs, ratio: int, codecs: tuple[CacheCodec, CacheCodec], device) -> LayerState:
    d, (kv, idx) = args.head_dim, codecs
    st = LayerState(win_kv=CacheRows.zeros(kv, args.sliding_window, device))
    if ratio:
        st.cmp_kv = GrowBuffer(d, kv.dtype, device, codec=kv)
        st.comp = CompressorState.new(ratio, d, overlap=ratio == CSA_RATIO, device=device)
    if ratio == CSA_RATIO:
        st.idx_kv = GrowBuffer(args.index_head_dim, idx.dtype, device, codec=idx)
        st.idx_comp = CompressorState.new(4, args.index_head_dim, overlap=True, device=device)
    return st
