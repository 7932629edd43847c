"""MTP speculative decoding: draft next_n tokens with the MTP layer, verify them in one target step.

reference/dsv4-architecture.md §3.8 (the MTP layer), reference/upstream-parallel-and-mtp.md (MTP
section). One decode step of a request with drafts ``d_1 .. d_k`` runs the trunk over the span
``[t_L, d_1 .. d_k]`` at positions ``L .. L+k`` (the chunked-prefill path: an entry compressed
from a window is visible only to positions past its last token, the staircase mask), samples
every row, and keeps the longest prefix whose drafts equal the samples plus the first sample
past it. Each row is sampled exactly as a plain decode step samples that position (same
params, history and per-(seed, position) draw: ``engine.core.sampler``), so greedy and seeded
outputs are token-for-token those of next_n 0, and the output distribution is the target
model's. For the greedy (one-hot) drafts used here this is speculative rejection sampling with
the draws shared: a draft is accepted with probability ``p(d)`` and, when rejected, the token
comes from ``p`` without ``d``, renormalised (Leviathan et al. 2023, with ``q`` one-hot).

What a rejected draft wrote is never read or is undone: window ring rows past the accepted
length lie in slots the ring (``ring_len >= sliding_window + next_n``) does not read again
before they are rewritten; compressed entries and indexer keys past the accepted length lie past
the entry counts (derived from the token count) and past every later query's position until
rewritten; compressor remainders are restored when a rejected token closed a window (the model
runner's ``engine.core.mtp_runner.SpanRollback``: verify spans always run through the decode
step, which writes every token's row, so restoring is enough).

This module is the policy, torch-free: how many drafts a request may verify, what they accept,
and which rows the MTP layer runs after a step (``SpecDecoder.plan``); the tensors (rollback,
the MTP layer's rows, the carried streams) are the model runner's (``engine.core.mtp_runner``).

The MTP layer keeps its own window ring (``PagedCache.mtp_win``). After each step it runs over
the positions the trunk just computed (prefill: the prompt's last ``sliding_window`` only),
pairing position q's trunk streams with token q+1; its output at the last position drafts
``d_1``, and further drafts chain on its own output streams (vLLM's DeepSeek-V4 MTP chaining).
Chained rows are written to the MTP ring but not committed: the next step rewrites them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Sequence
from engine.core.scheduler import ScheduledBatch
from engine.core.step import DraftPlan, DraftRow


@dataclass
class SpecStats:
    """Cumulative counts, as vLLM names them (``spec_decode_*``): verify steps that carried
    drafts, drafts proposed, drafts accepted, and accepted per draft position (1-based order)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 + accepted drafts per step (1 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """Length of the longest prefix of ``drafts`` equal to ``sampled`` (the target's tokens)."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


class SpecDecoder:
    """The engine's MTP policy (``LLMEngine.spec`` when next_n > 0): the draft room of a request,
    what a verify step keeps (``settle``), and the MTP rows after a step (``plan``).

    Args:
        next_n: drafts per step at most. max_model_len: the context limit (tokens).
        sliding_window: the MTP layer's window (its catch-up covers at most that many positions).
    """

    def __init__(self, next_n: int, max_model_len: int, sliding_window: int):
        self.next_n, self.max_model_len, self.window = next_n, max_model_len, sliding_window
        self.stats = SpecStats(num_accepted_tokens_per_pos=[0] * next_n)

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts worth verifying for ``seq``: all its emitted tokens must fit max_new_tokens and
        the context limit (a verify step emits up to drafts + 1); a request held for export
        (prefill role) drafts for the decode side, whose commit cuts them to its own limits."""
        room = self.max_model_len - seq.num_tokens - 1
        if seq.hold_state:           # prefill role: the decode side applies max_new_tokens (``commit``)
            return max(0, min(self.next_n, room))
        return max(0, min(self.next_n, seq.params.max_new_tokens - len(seq.output_ids) - 1, room))

    def settle(self, seq: Sequence, kept: int) -> None:
        """``kept`` (>= 1) tokens of ``seq``'s verify span were appended (fewer than accepted + 1
        when one finished the request): the state counts the span's first ``kept`` tokens and
        the drafts kept are counted; its drafts are spent."""
        drafts = seq.draft_ids[: seq.spec_k]
        seq.num_computed += kept - 1
        if drafts:
            self.stats.record(len(drafts), kept - 1)
        seq.draft_ids, seq.spec_k = [], 0

    def plan(self, batch: ScheduledBatch, starts: list[int], holding, settle: list[tuple[str, int]]) -> DraftPlan:
        """The MTP rows after a step: a catch-up over this step's computed positions, then the
        next drafts (``DraftPlan``; ``starts``: each batch row's first position; ``holding``:
        whether a request still holds state, running or held for export; ``settle``: the verify
        spans kept, ``settle``'s).

        A request takes part while it holds state and the step computed positions of its last
        ``sliding_window``; it drafts when its next step decodes. The first step after a
        prefix-cache hit at B also redoes the MTP row of B - 1 from the entry's carried streams:
        the entry's row paired B - 1 with the token its maker had at B, this request's token
        there may differ.
        """
        rows = []
        for s, p0 in zip(batch.seqs, starts):
            if not holding(s.seq_id):
                continue
            L1 = s.num_computed
            q0 = max(p0, L1 - self.window)
            if q0 >= L1:
                continue
            carry = q0 == p0 == s.num_cached > 0
            q0 -= carry
            want = self.max_drafts(s) if s.num_pending == 1 else 0
            rows.append(DraftRow(s.seq_id, q0 + carry - p0, q0, [s.token(q + 1) for q in range(q0, L1)], want, carry))
        return DraftPlan(settle, rows)
