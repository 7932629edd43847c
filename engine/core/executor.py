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
from itertools import accumulate

import torch

from engine.core.block_manager import SeqBlocks
from engine.core.kv_cache import PagedCache
from engine.core.pd_state import check_state_tensors, load_mtp_state_tensors, load_state_tensors
from engine.core.spec_decode import DraftRow, Rollback, SpanRollback, run_drafts
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
        # MTP: the last forward_spec's Rollbacks by seq_id (eager) or SpanRollback (graph), output
        # streams and each sequence's first row; a graph step's spec_k by seq_id while it runs
        self.rollbacks: dict = {}
        self.spans: SpanRollback | None = None
        self.streams, self.offsets, self.last_rows = None, {}, {}
        self._spec: dict | None = None

    # ---- state pools --------------------------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int, prefix: bytes | None = None) -> SeqBlocks:
        """Hold blocks for ``num_tokens`` tokens of ``seq_id``, from the cached prefix ``prefix``
        if it is still there (``BlockManager.allocate``). Raises CacheFullError with nothing taken."""
        self._restore()
        return self.cache.allocate(seq_id, num_tokens, prefix)

    def cache_prefix(self, seq_id, key: bytes, num_tokens: int, chain: tuple[bytes, ...]) -> bool:
        """Keep ``seq_id``'s state after ``num_tokens`` tokens as prefix-cache entry ``key``
        (``BlockManager.cache_prefix``). An MTP engine calls it after the step's ``draft``, whose
        streams give the entry its ``carry``: the row of position ``num_tokens - 1``, the last
        ``seq_id`` had in that step."""
        carry = None
        if self.streams is not None and seq_id in self.last_rows:
            carry = self.streams[self.last_rows[seq_id]].clone()
        return self.cache.cache_prefix(seq_id, key, num_tokens, chain, carry)

    def reset_prefix_cache(self) -> int:
        """Evict every prefix-cache entry; returns how many there were."""
        return self.cache.reset_prefix_cache()

    def cp_first_chunk(self) -> int:
        """The fewest tokens a prompt's first chunk runs context parallel with (0: never); the
        scheduler keeps no prefix-cache boundary that would cut such a chunk shorter."""
        return 0

    def free(self, seq_id) -> None:
        """Return everything ``seq_id`` holds (none: nothing happens)."""
        self._restore()
        self.rollbacks.pop(seq_id, None)            # a request that ended inside its span: nothing to undo
        if self.spans is not None:
            self.spans.drop(seq_id)
        self.cache.free(seq_id)

    def load_state(self, seq_id, num_tokens: int, tensors: dict[str, torch.Tensor],
                   layers: list[int] | None = None) -> None:
        """Write an imported state (``state_tensors`` names, after ``num_tokens`` tokens; the MTP
        rings' ``mtp.*`` names, ``mtp_state_tensors``) into the slots ``seq_id`` holds. Raises
        ValueError (tensors that do not match; nothing written)."""
        self._restore()
        load_split(self.pools, seq_id, num_tokens, tensors, layers)

    # ---- the model ----------------------------------------------------------------------------
    def forward_batch(self, tokens: torch.Tensor, states: list, lengths: list[int],
                      layer_hook: Callable[[int], None] | None = None, streams: bool = False):
        """``Transformer.forward_batch``: packed tokens ``[sum(lengths)]`` -> hidden
        ``[sum(lengths), H]`` (compute dtype; with ``streams`` also the ``[sum(lengths), n, H]``
        fp32 streams the MTP layer takes); the states advance. Raises ValueError as it does."""
        return self.model.forward_batch(tokens, states, lengths, layer_hook=layer_hook, streams=streams)

    # ---- MTP (engine.core.spec_decode) -------------------------------------------------------
    def forward_spec(self, tokens: torch.Tensor, states: list, lengths: list[int], seq_ids: list,
                     spec_ks: list[int], layer_hook: Callable[[int], None] | None = None,
                     graph: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """A step of an MTP engine: ``forward_batch`` with its output streams kept for ``draft``,
        and a ``Rollback`` made first for each sequence verifying drafts (``spec_ks[i]`` > 0) for
        ``settle``. ``graph``: the step run instead with a graph runner (``model_runner.spec_graph``:
        every verify span through the graph step, whose ``decode_rows`` makes the step's
        ``SpanRollback``) -> (hidden, streams). Returns hidden
        ``[sum(lengths), H]``. Raises ValueError as ``forward_batch``."""
        self.spans = None
        if graph is not None:
            self.rollbacks, self._spec = {}, dict(zip(seq_ids, spec_ks))
            try:
                hidden, streams = graph()
            finally:
                self._spec = None
        else:
            self.rollbacks = {sid: Rollback(st, n) for sid, st, n, k in zip(seq_ids, states, lengths, spec_ks) if k}
            hidden, streams = self.model.forward_batch(tokens, states, lengths, layer_hook=layer_hook, streams=True)
        ends = list(accumulate(lengths))
        self.streams = streams
        self.offsets = {sid: e - n for sid, e, n in zip(seq_ids, ends, lengths)}
        self.last_rows = {sid: e - 1 for sid, e in zip(seq_ids, ends)}
        return hidden

    def settle(self, seq_id, kept: int) -> None:
        """``kept`` tokens of ``seq_id``'s verify span were accepted: roll its state back past them
        (``Rollback.apply``; no rollback made: nothing happens)."""
        rb = self.rollbacks.pop(seq_id, None)
        if rb is not None:
            rb.apply(kept)
        elif self.spans is not None:
            self.spans.settle(seq_id, kept)

    def draft(self, plan: list[DraftRow], steps: int) -> list[list[int]]:
        """The MTP catch-up and ``steps`` chained drafts over the last ``forward_spec``'s streams
        (``spec_decode.run_drafts``). Returns each plan row's drafts."""
        return run_drafts(self.model, self.pools, self.streams, self.offsets, plan, steps)

    def decode_rows(self, runner, rows: list[tuple[list[int], int, int, dict]], seq_ids: list):
        """Rows through a graph ``runner`` (``DecodeRunner.run``'s rows; ``seq_ids``: whose they
        are) -> hidden ``[n, H]`` of their n tokens (an MTP step: and their streams); the states
        advance. In an MTP step (``forward_spec`` with ``graph``) a ``SpanRollback`` is made first."""
        if self._spec is not None:
            self.begin_spans(rows, seq_ids, self._spec)
        return runner.run(rows)

    def begin_spans(self, rows: list, seq_ids: list, spec_ks: dict) -> None:
        """An MTP graph step's ``SpanRollback`` of ``rows`` (``DecodeRunner`` rows of ``seq_ids``)
        verifying drafts (``spec_ks[seq_id]`` > 0), made before the step writes the pools."""
        self.rollbacks = {}
        self.spans = SpanRollback(self.pools, [(sid, r[2], r[1], len(r[0])) for sid, r in zip(seq_ids, rows)
                                               if spec_ks.get(sid)])

    def _restore(self) -> None:
        """Before the pools change hands (allocate, free, load): the settled spans' restores."""
        if self.spans is not None:
            self.spans.apply()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``Transformer.logits``: hidden ``[T, H]`` -> ``[T, V]`` fp32."""
        return self.model.logits(hidden)


# (model, the engine's pools) -> the executor the engine runs through (``LLMEngine``'s ``executor``)
ExecutorFactory = Callable[[Transformer, PagedCache], Executor]


def load_split(cache: PagedCache, seq_id, num_tokens: int, tensors: dict[str, torch.Tensor],
               layers: list[int] | None = None, check_only: bool = False) -> None:
    """``load_state_tensors`` for the trunk's names and ``load_mtp_state_tensors`` for ``mtp.*``
    (a call with only MTP rings writes no trunk layer), both checked before either writes.
    ``check_only``: raise what writing would (ValueError), write nothing."""
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    trunk = {k: v for k, v in tensors.items() if k not in mtp}
    if trunk or not mtp:
        check_state_tensors(cache, num_tokens, trunk, layers)
    if mtp:
        load_mtp_state_tensors(cache, seq_id, num_tokens, mtp, check_only=True)
    if check_only:
        return
    if trunk or not mtp:
        load_state_tensors(cache, seq_id, num_tokens, trunk, layers)
    if mtp:
        load_mtp_state_tensors(cache, seq_id, num_tokens, mtp)
