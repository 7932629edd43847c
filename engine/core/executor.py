"""The executor seam: every call of the engine that changes the state pools or runs the model.

``LLMEngine`` and its scheduler never call the model's ``forward_batch`` / ``logits`` or the
pools' ``allocate`` / ``free`` themselves: they call an executor, which one process runs
straight through (``Executor``, the default) and a multi-rank instance sends to its other ranks
first (``engine.parallel.executor.LeaderExecutor``), as vLLM's executor stands between its
engine core and the workers. Queries (``can_allocate``, ``num_free``, ``sequence_state``, the
exported state) read ``executor.cache`` directly: they change nothing any rank must repeat.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.block_manager import SeqBlocks
from engine.core.kv_cache import PagedCache
from engine.core.pd_state import load_state_tensors
from engine.model.transformer import Transformer


class Executor:
    """One process: the calls go to ``model`` and ``cache`` as they are.

    ``cache``: the pools the engine and its scheduler account with (``PagedCache``; a subclass's
    may be another block manager over them, e.g. attention DP's ``DPCache``). ``dp_size``: the
    attention-DP ranks whose pools ``cache`` schedules; the engine's batch limit is ``dp_size``
    times the per-rank one. ``pools``: the ``PagedCache`` this process holds.
    """

    dp_size = 1
    rows_mode = None            # a multi-rank model's row mode for graph decode (``RankExecutor``)

    def __init__(self, model: Transformer, cache: PagedCache):
        self.model, self.cache = model, cache
        self.pools = cache          # this process's PagedCache (what a graph step writes)

    # ---- state pools --------------------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int) -> SeqBlocks:
        """Hold blocks for ``num_tokens`` tokens of ``seq_id`` (``BlockManager.allocate``).
        Raises CacheFullError with nothing taken."""
        return self.cache.allocate(seq_id, num_tokens)

    def free(self, seq_id) -> None:
        """Return everything ``seq_id`` holds (none: nothing happens)."""
        self.cache.free(seq_id)

    def load_state(self, seq_id, num_tokens: int, tensors: dict[str, torch.Tensor],
                   layers: list[int] | None = None) -> None:
        """Write an imported state (``state_tensors`` names, after ``num_tokens`` tokens) into the
        slots ``seq_id`` holds. Raises ValueError (tensors that do not match; nothing written)."""
        load_state_tensors(self.cache, seq_id, num_tokens, tensors, layers)

    # ---- the model ----------------------------------------------------------------------------
    def forward_batch(self, tokens: torch.Tensor, states: list, lengths: list[int],
                      layer_hook: Callable[[int], None] | None = None, streams: bool = False):
        """``Transformer.forward_batch``: packed tokens ``[sum(lengths)]`` -> hidden
        ``[sum(lengths), H]`` (compute dtype; with ``streams`` also the ``[sum(lengths), n, H]``
        fp32 streams the MTP layer takes); the states advance. Raises ValueError as it does."""
        return self.model.forward_batch(tokens, states, lengths, layer_hook=layer_hook, streams=streams)

    def forward_mtp(self, streams: torch.Tensor, tokens_next: torch.Tensor, states: list, lengths: list[int]):
        """``Transformer.forward_mtp``: the MTP layer over packed rows -> (streams, hidden)."""
        return self.model.forward_mtp(streams, tokens_next, states, lengths)

    def decode_rows(self, runner, rows: list[tuple[int, int, int, dict]], seq_ids: list) -> torch.Tensor:
        """Single-token rows through a graph ``runner`` (``DecodeRunner.run``'s rows; ``seq_ids``:
        whose they are) -> hidden ``[len(rows), H]``; the states advance."""
        return runner.run(rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``Transformer.logits``: hidden ``[T, H]`` -> ``[T, V]`` fp32."""
        return self.model.logits(hidden)


# (model, the engine's pools) -> the executor the engine runs through (``LLMEngine``'s ``executor``)
ExecutorFactory = Callable[[Transformer, PagedCache], Executor]
