"""Continuous batching with chunked prefill, admission by free state, and preemption by recompute.

Each step (vLLM v1 / nano-vllm style; fixes upstream-baseline.md §4.3's livelock and dropped
retractions):
  1. every running request with one pending token decodes (with its MTP drafts after it, when
     their room fits: ``engine.core.spec_decode``); if its state cannot grow, the latest
     arrived running request in the same pools (under attention DP: on the same rank) is
     preempted (state freed, re-queued to recompute), possibly itself;
  2. running requests still prefilling get chunks, FIFO, within ``max_prefill_tokens``;
  3. queued requests are admitted FIFO while fewer than ``batch_size`` run, prefill budget
     remains, and their whole pending prompt plus ``num_reserved_decode_tokens`` fits; the head
     that does not fit waits for the next step (no skipping, no spinning); a step that preempted
     admits none (vLLM v1).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.core.prefix_cache import CHUNK
from engine.core.request import FinishReason, Sequence, SeqStatus
from engine.core.sampling_params import SampleRow
from engine.core.step import ScheduledRow, StepPlan


@dataclass(frozen=True)
class SchedulerLimits:
    """batch_size: requests holding state (prefilling + decoding); max_prefill_tokens: prefill
    tokens per step; max_model_len: tokens per request; num_reserved_decode_tokens: decode room
    taken at admission so a new request does not preempt at its first steps."""

    batch_size: int
    max_prefill_tokens: int
    max_model_len: int
    num_reserved_decode_tokens: int = 64

    def __post_init__(self):
        for k in ("batch_size", "max_prefill_tokens", "max_model_len"):
            if getattr(self, k) < 1:
                raise ValueError(f"scheduler: {k} must be >= 1, got {getattr(self, k)}")


@dataclass
class ScheduledBatch:
    """One step's work as the engine keeps it: ``num_tokens[i]`` pending tokens of ``seqs[i]``
    (then its ``spec_k`` drafts); who was preempted."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Owns the waiting queue (arrival order) and the running set, and their cache holdings.

    ``cache`` is the accounting (``BlockManager``, or attention DP's ``DPCache``): what fits, who
    holds what; the pool changes it records travel in the step's plan (``StepPlan.pool_ops``).
    ``cp_first_chunk``: the fewest tokens a prompt's first chunk runs context parallel with (0:
    never); no prefix-cache boundary is kept that would cut such a chunk shorter.
    """

    def __init__(self, cache: BlockManager, limits: SchedulerLimits, cp_first_chunk: int = 0):
        self.cache, self.limits, self.cp_first_chunk = cache, limits, cp_first_chunk
        self.blocks = cache
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_reserved = 0      # P/D decode: batch places held by reservations awaiting state
        self._order = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        seq.order, self._order = self._order, self._order + 1
        self._enqueue(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a request whose state is already in the cache (P/D: imported from prefill)."""
        seq.order, self._order = self._order, self._order + 1
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _target(self, seq: Sequence) -> int:
        """Tokens to hold at admission: the pending sequence plus the decode reserve."""
        return min(seq.num_tokens + self.limits.num_reserved_decode_tokens, self.limits.max_model_len)

    def schedule(self) -> tuple[StepPlan, ScheduledBatch]:
        """One step: the plan for the model runner (rows with their holdings, the pool changes
        recorded since the last step) and the same work as the engine's ``Sequence`` s."""
        batch = self._pick()
        plan = StepPlan([self.row(s, n) for s, n in zip(batch.seqs, batch.num_tokens)],
                        self.cache.take_ops(), [s.seq_id for s in batch.preempted])
        return plan, batch

    def row(self, seq: Sequence, n: int) -> ScheduledRow:
        """``seq``'s part of the step: ``n`` tokens from ``num_computed``, its ``spec_k`` drafts
        last; a row whose pending tokens all run samples its last ``1 + spec_k`` positions."""
        k = seq.spec_k
        held = self.cache.seqs[seq.seq_id]
        samples = seq.num_computed + n - k == seq.num_tokens
        sampling = [SampleRow(seq.params, seq.num_tokens + j, seq.prompt_ids, seq.output_ids + seq.draft_ids[:j])
                    for j in range(1 + k)] if samples else []
        return ScheduledRow(seq.seq_id, seq.num_computed, seq.pending_ids(n), k, samples, held.state_slot,
                            held.tables, self.cache.rank_of(seq.seq_id), sampling)

    def _pick(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        # 1. decodes (and single-token remainders), oldest first; preempt the newest on a full cache
        for seq in sorted(self.running, key=lambda s: s.order):
            if seq.status is not SeqStatus.RUNNING or seq.num_pending != 1:
                continue
            k = len(seq.draft_ids)
            if k and not self.cache.can_allocate(seq.seq_id, seq.num_tokens + k):
                seq.draft_ids, k = [], 0           # no room to verify drafts: decode plainly
            while not self.cache.can_allocate(seq.seq_id, seq.num_tokens):
                rank = self.cache.rank_of(seq.seq_id)        # only a request on its rank frees its room
                victim = max((s for s in self.running if self.cache.rank_of(s.seq_id) == rank),
                             key=lambda s: s.order)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                self.blocks.allocate(seq.seq_id, seq.num_tokens + k)
                seq.spec_k = k
                batch.seqs.append(seq)
                batch.num_tokens.append(1 + k)
        # 2. prefill chunks of running requests
        budget = self.limits.max_prefill_tokens
        for seq in sorted(self.running, key=lambda s: s.order):
            if budget == 0:
                break
            if seq.num_pending > 1:
                n = self._chunk(seq, budget)
                budget -= n
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
        # 3. admission; none on a step that preempted (vLLM v1): the room is short, and under
        # attention DP a victim would otherwise be readmitted at once on another rank
        while not batch.preempted and self.waiting and budget > 0 \
                and len(self.running) + self.num_reserved < self.limits.batch_size:
            seq = self.waiting[0]
            if not self.cache.can_allocate(seq.seq_id, self._target(seq)):
                break
            self._admit(seq)
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.running.append(seq)
            n = self._chunk(seq, budget)
            budget -= n
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
        return batch

    def _admit(self, seq: Sequence) -> None:
        """Take ``seq``'s state; with prefix caching, from the longest cached prefix of its
        tokens (``engine.core.prefix_cache``), noting the boundaries to keep on the way."""
        prefix = getattr(self.cache, "prefix", None)
        if prefix is None:
            self.blocks.allocate(seq.seq_id, self._target(seq))
            return
        plan = prefix.plan(seq.prompt_ids + seq.output_ids, seq.num_tokens)
        held = self.blocks.allocate(seq.seq_id, self._target(seq), plan.hit)
        seq.num_computed = seq.num_cached = held.num_cached
        # a context-parallel first chunk is worth more than an entry at a short shared prefix
        cp_min = self.cp_first_chunk
        low = cp_min if cp_min and not seq.num_computed and seq.num_tokens >= cp_min else seq.num_computed + 1
        seq.snapshots = [(n, key, plan.chain[:n // CHUNK]) for n, key in plan.snapshots if n >= low]
        prefix.count(seq.num_tokens, seq.num_cached)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill tokens of ``seq`` this step: up to ``budget``, ending at its next boundary to
        keep in the prefix cache (its state is copied there after the step)."""
        n = min(seq.num_pending, budget)
        if seq.snapshots:
            n = min(n, seq.snapshots[0][0] - seq.num_computed)
        return n

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s state and re-queue it; it recomputes prompt + output on readmission."""
        self.blocks.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.draft_ids, seq.spec_k, seq.snapshots = [], 0, []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def finish(self, seq: Sequence, reason: FinishReason | None, keep_state: bool = False) -> None:
        """Mark ``seq`` finished (``reason`` None: handed off, P/D) and free all it holds, wherever
        it is (``keep_state``: leave its cache holdings for the caller to export and free)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_state:
            self.blocks.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
