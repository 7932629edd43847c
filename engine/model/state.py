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

from engine.config import CSA_RATIO, ModelArgs


class GrowBuffer:
    """Append-only ``[N, D]`` tensor with amortised O(1) appends (capacity doubles)."""

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 16):
        self._data = torch.empty(capacity, dim, dtype=dtype, device=device)
        self.num_entries = 0

    def append(self, rows: torch.Tensor) -> None:
        """Append ``rows [n, D]``."""
        n = rows.shape[0]
        need = self.num_entries + n
        if need > self._data.shape[0]:
            cap = max(need, 2 * self._data.shape[0])
            grown = torch.empty(cap, self._data.shape[1], dtype=self._data.dtype, device=self._data.device)
            grown[: self.num_entries] = self._data[: self.num_entries]
            self._data = grown
        self._data[self.num_entries:need] = rows
        self.num_entries = need

    def view(self) -> torch.Tensor:
        """The live entries ``[N, D]`` (a view, valid until the next append)."""
        return self._data[: self.num_entries]


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

    win_kv: torch.Tensor                      # [W, d] ring
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
        W = self.win_kv.shape[0]
        n_hist = min(start_pos, W - 1)
        if n_hist == 0:
            return new_kv, start_pos
        slots = torch.arange(start_pos - n_hist, start_pos, device=new_kv.device) % W
        return torch.cat([self.win_kv[slots], new_kv]), start_pos - n_hist

    def write_window(self, new_kv: torch.Tensor, start_pos: int) -> None:
        """Store the last ``min(T, W)`` rows of ``new_kv`` at slots ``p % W``."""
        W = self.win_kv.shape[0]
        T = new_kv.shape[0]
        keep = min(T, W)
        pos = torch.arange(start_pos + T - keep, start_pos + T, device=new_kv.device)
        self.win_kv[pos % W] = new_kv[T - keep:]


@dataclass
class SequenceState:
    """Decode state of one sequence across all layers (backbone, then MTP)."""

    layers: list[LayerState]
    num_tokens: int = 0
    mtp_layers: list[LayerState] = field(default_factory=list)

    @classmethod
    def new(cls, args: ModelArgs, dtype: torch.dtype, device: torch.device | str = "cpu",
            with_mtp: bool = False) -> "SequenceState":
        """Empty state for ``args``; KV in ``dtype``, compressor remainders in fp32."""
        layers = [_layer_state(args, args.compress_ratios[i], dtype, device) for i in range(args.num_hidden_layers)]
        mtp = [_layer_state(args, 0, dtype, device) for _ in range(args.num_mtp_layers)] if with_mtp else []
        return cls(layers=layers, mtp_layers=mtp)


def _layer_state(args: ModelArgs, ratio: int, dtype, device) -> LayerState:
    d = args.head_dim
    st = LayerState(win_kv=torch.zeros(args.sliding_window, d, dtype=dtype, device=device))
    if ratio:
        st.cmp_kv = GrowBuffer(d, dtype, device)
        st.comp = CompressorState.new(ratio, d, overlap=ratio == CSA_RATIO, device=device)
    if ratio == CSA_RATIO:
        st.idx_kv = GrowBuffer(args.index_head_dim, dtype, device)
        st.idx_comp = CompressorState.new(4, args.index_head_dim, overlap=True, device=device)
    return st
