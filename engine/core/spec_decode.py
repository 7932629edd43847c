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

What a rejected draft wrote is never read or is undone (``Rollback``): window ring rows past
the accepted length lie in slots the ring (``ring_len >= sliding_window + next_n``) does not
read again before they are rewritten; compressed entries and indexer keys past the accepted
length lie past the entry counts (derived from the token count) and past every later query's
position until rewritten; compressor remainders are restored and, after an eager forward, the
accepted rows replayed (``Rollback``; after a graph step restoring is enough: ``SpanRollback``)
when a rejected token closed a window.

The MTP layer keeps its own window ring (``PagedCache.mtp_win``). After each step it runs over
the positions the trunk just computed (prefill: the prompt's last ``sliding_window`` only),
pairing position q's trunk streams with token q+1; its output at the last position drafts
``d_1``, and further drafts chain on its own output streams (vLLM's DeepSeek-V4 MTP chaining).
Chained rows are written to the MTP ring but not committed: the next step rewrites them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.config import CSA_RATIO

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine
    from engine.core.request import Sequence


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


class Rollback:
    """Undo what the rejected tail of a verify span did to one request's compressor remainders.

    Made before the span runs over ``state`` (a ``PagedSequenceState`` at L = its ``num_tokens``;
    ``span`` tokens). A compressor whose window does not close inside the span needs nothing: its
    kept rows are exact and the rest lie past the remainder. One whose window closes gets its
    rows ``(L + j) % m`` and previous-window ``Ca / Za`` saved (``span`` rows, not the whole ring)
    and its inputs journalled; ``apply(keep)`` restores them and replays the first ``keep``.
    """

    def __init__(self, state, span: int):
        self.L, self.span, self.saved = state.num_tokens, span, []
        L = self.L
        for layer in state.layers:
            for comp in (layer.comp, layer.idx_comp):
                if comp is None:
                    continue
                m = comp.kv.shape[0]
                if (L + span) // m == L // m:
                    continue
                idx = torch.arange(L, L + span, device=comp.kv.device) % m
                prev = None if comp.prev_kv is None else (comp.prev_kv.clone(), comp.prev_score.clone())
                comp.journal = []
                self.saved.append((comp, idx, comp.kv[idx].clone(), comp.score[idx].clone(), prev))

    def apply(self, keep: int) -> None:
        """``keep`` (1 .. span) tokens of the span were accepted: make every remainder what
        running only those would have left. Ends the journalling either way."""
        for comp, idx, kv, score, prev in self.saved:
            journal, comp.journal = comp.journal, None
            m = comp.kv.shape[0]
            if keep == self.span or (self.L + self.span) // m == (self.L + keep) // m:
                continue                     # no window closed in the rejected tail
            comp.kv[idx], comp.score[idx] = kv, score
            if prev is not None:
                comp.prev_kv.copy_(prev[0])
                comp.prev_score.copy_(prev[1])
            for compressor, x, start_pos, out_dtype in journal:   # a span's input, or one row's
                n = min(x.shape[0], self.L + keep - start_pos)
                if n > 0:
                    compressor(x[:n], start_pos, comp, out_dtype)     # its entries are already stored


class SpanRollback:
    """``Rollback`` for every verify span of one graph step (``StaticDecoder``), batched: each
    compressor-state tensor of ``PagedCache.comp_stacks`` (all layers of a kind) is read once
    when the step is made and written once when its spans are settled, whatever the batch and
    layer count (per-request ``Rollback`` costs ~0.1 ms of host time per request and layer).

    Restoring is enough, with no replay: a span of at most m tokens (``MAX_NEXT_N + 1 <=
    CSA_RATIO``) closes at most one window per compressor, at position c. If c is accepted nothing
    needs undoing. If c was rejected, every accepted token lies before c in its window and the
    graph step wrote its row (it stores every token's row), which no later span token shares (rows
    repeat every m positions). What the rejected tokens wrote is then their own rows and, at c,
    CSA's previous-window ``Ca / Za``: restoring those to the saved values is what running only
    the accepted tokens leaves. A rejected row after c, once restored, holds the position m
    before it, older than L and so already stored.

    Args:
        cache: the pools (``PagedCache``). spans: ``(seq_id, state slot, L, span)`` of each request
            verifying drafts (L its tokens before the step).
    """

    def __init__(self, cache, spans: list[tuple[object, int, int, int]]):
        self.spans = {sid: (slot, L, n) for sid, slot, L, n in spans}
        self.kept: dict = {}
        self.done: set = set()
        self.saved = []                      # (tensors, ratio, [seq_id], slots [n], rows [n, span], values)
        dev = cache.device
        for m, tensors in cache.comp_stacks.values():
            close = [(sid, slot, L, n) for sid, slot, L, n in spans if (L + n) // m != L // m]
            if not close:
                continue
            T = max(n for *_, n in close)
            slots = torch.tensor([slot for _, slot, _, _ in close], dtype=torch.long, device=dev)
            rows = torch.tensor([[(L + min(j, n - 1)) % m for j in range(T)] for _, _, L, n in close],
                                dtype=torch.long, device=dev)
            vals = [t[:, slots[:, None], rows] for t in tensors]                  # [layers, n, T, width]
            if m == CSA_RATIO:                  # previous window's Ca / Za (rows m .. 2m, first half)
                vals += [t[:, slots, m:2 * m] for t in tensors]
            self.saved.append((tensors, m, [c[0] for c in close], slots, rows, vals))

    def settle(self, seq_id, kept: int) -> bool:
        """Record that ``kept`` tokens of ``seq_id``'s span were accepted (False: not one of these
        spans). Once every span is settled, ``apply``."""
        if seq_id not in self.spans:
            return False
        self.kept[seq_id] = kept
        if self.kept.keys() >= self.spans.keys():
            self.apply()
        return True

    def drop(self, seq_id) -> None:
        """``seq_id`` ended (its state is freed): nothing of its span is restored."""
        self.spans.pop(seq_id, None)
        self.kept.pop(seq_id, None)

    def apply(self) -> None:
        """Restore what the rejected tails of the spans settled so far wrote (each once); the
        others wait for their ``settle``."""
        todo = {sid: k for sid, k in self.kept.items() if sid not in self.done}
        if not todo:
            return
        for tensors, m, sids, slots, rows, vals in self.saved:
            pick, j_idx = [], []
            for i, sid in enumerate(sids):
                k = todo.get(sid)
                if k is None or sid not in self.spans:
                    continue
                _, L, n = self.spans[sid]
                if (L + k) // m != L // m:
                    continue                 # the closing token was accepted
                pick += [i] * (n - k)
                j_idx += range(k, n)
            if not pick:
                continue
            dev = slots.device
            i_t, j_t = torch.tensor(pick, device=dev), torch.tensor(j_idx, device=dev)
            for t, v in zip(tensors, vals):
                t[:, slots[i_t], rows[i_t, j_t]] = v[:, i_t, j_t]
            if m == CSA_RATIO:
                p_t = torch.tensor(sorted(set(pick)), device=dev)
                for t, v in zip(tensors, vals[2:]):
                    t[:, slots[p_t], m:2 * m] = v[:, p_t]
        self.done |= todo.keys()


class SpecDecoder:
    """The engine's MTP drafting and verification (``LLMEngine.spec`` when next_n > 0).

    Per step: ``begin`` (before the trunk forward, ``Executor.forward_spec``: the states),
    ``accept`` and ``settle`` (per request, around appending the tokens it keeps), ``draft``
    (after: the MTP catch-up over the step's positions and the next drafts). What changes the
    state pools goes through the engine's executor, so every rank holding a request repeats it.
    """

    def __init__(self, engine: "LLMEngine", next_n: int):
        if not len(engine.model.mtp):
            raise ValueError("next_n > 0 needs the model's MTP layer (load it with mtp=True)")
        self.engine, self.next_n = engine, next_n
        self.stats = SpecStats(num_accepted_tokens_per_pos=[0] * next_n)
        self._rows: list[tuple["Sequence", int, int]] = []     # (seq, first hidden row, first position)

    def max_drafts(self, seq: "Sequence") -> int:
        """Drafts worth verifying for ``seq``: all its emitted tokens must fit max_new_tokens and
        the context limit (a verify step emits up to drafts + 1); a request held for export
        (prefill role) drafts for the decode side, whose commit cuts them to its own limits."""
        p, lim = seq.params, self.engine.limits
        room = lim.max_model_len - seq.num_tokens - 1
        if seq.hold_state:           # prefill role: the decode side applies max_new_tokens (``commit``)
            return max(0, min(self.next_n, room))
        return max(0, min(self.next_n, p.max_new_tokens - len(seq.output_ids) - 1, room))

    def begin(self, batch, states: bool = True) -> list | None:
        """Note the batch's rows for ``draft``; with ``states``, return the batch's states for an
        eager trunk forward (``Executor.forward_spec``, which makes the ``Rollback`` of each
        request verifying drafts; a graph step needs none: ~0.03 ms of host time per request and
        layer)."""
        cache = self.engine.cache
        self._rows, off = [], 0
        for s, n in zip(batch.seqs, batch.num_tokens):
            self._rows.append((s, off, s.num_computed))
            off += n
        return [cache.sequence_state(s.seq_id, s.num_computed) for s in batch.seqs] if states else None

    def accept(self, seq: "Sequence", sampled: list[int]) -> int:
        """Drafts of ``seq`` its rows' samples (``spec_k + 1`` of them) accept: the longest
        matching prefix (``settle`` then records what was kept)."""
        return num_accepted(sampled, seq.draft_ids[: seq.spec_k])

    def settle(self, seq: "Sequence", kept: int) -> None:
        """``kept`` (>= 1) tokens of ``seq``'s verify span were appended (fewer than accepted + 1
        when one finished the request): the state counts the span's first ``kept`` tokens, is
        rolled back past them (``Executor.settle``, on the ranks holding it; not when the request
        finished inside the span and its state is already freed: under attention DP no rank holds
        it any more), and the drafts kept are counted."""
        drafts = seq.draft_ids[: seq.spec_k]
        if seq.spec_k and seq.seq_id in self.engine.cache.seqs:
            self.engine.executor.settle(seq.seq_id, kept)
        seq.num_computed += kept - 1
        if drafts:
            self.stats.record(len(drafts), kept - 1)
        seq.draft_ids, seq.spec_k = [], 0

    def draft(self) -> None:
        """MTP catch-up over this step's computed positions, then the next drafts
        (``Executor.draft`` over the streams its ``forward_spec`` kept; ``begin``'s rows).

        A request takes part while it holds state (running, or held for export) and the step
        computed positions of its last ``sliding_window``; it drafts when its next step decodes.
        The first step after a prefix-cache hit at B also redoes the MTP row of B - 1 from the
        entry's carried streams (``PrefixEntry.carry``): the entry's row paired B - 1 with the
        token its maker had at B, this request's token there may differ.
        """
        eng = self.engine
        cache, W = eng.cache, eng.model.args.sliding_window
        plan, seqs = [], []
        for s, off, p0 in self._rows:
            if s.seq_id not in cache.seqs or not (s.seq_id in eng.seqs or s.seq_id in eng.held):
                continue
            L1 = s.num_computed
            q0 = max(p0, L1 - W)
            if q0 >= L1:
                continue
            carry = q0 == p0 == s.num_cached > 0 and cache.seqs[s.seq_id].carry is not None
            q0 -= carry
            want = self.max_drafts(s) if s.num_pending == 1 else 0
            plan.append(DraftRow(s.seq_id, q0 + carry - p0, q0, [s.token(q + 1) for q in range(q0, L1)], want,
                                 carry))
            seqs.append(s)
        self._rows = []
        if not plan:
            return
        drafts = eng.executor.draft(plan, max(r.want for r in plan))
        for s, r, d in zip(seqs, plan, drafts):
            if r.want:
                s.draft_ids = d


class DraftRow(NamedTuple):
    """One request's part of an MTP draft step (``SpecDecoder.draft`` -> ``Executor.draft``).

    ``row0``: its first catch-up row within its rows of the last ``forward_spec``; ``q0``: that
    row's position; ``tokens``: each catch-up row's next token (``len`` rows); ``want``: drafts
    to make after the catch-up (0: catch-up only). ``carry``: the row of ``q0`` is instead the
    request's ``SeqBlocks.carry`` (a prefix-cache hit's boundary, which its last forward did not
    compute), and ``row0`` is the row of ``q0 + 1``."""

    seq_id: object
    row0: int
    q0: int
    tokens: list[int]
    want: int
    carry: bool = False


@torch.no_grad()
def run_drafts(model, pools, streams: torch.Tensor, offsets: dict, plan: list[DraftRow], steps: int
               ) -> list[list[int]]:
    """This rank's part of a draft step: the MTP layer over ``plan``'s catch-up rows of
    ``streams`` (``[T, n, H]``, the last trunk forward's output streams; ``offsets``: each request's
    first row there), then ``steps`` greedy drafts chained on the MTP layer's own output streams
    (vLLM's DeepSeek-V4 MTP chaining; chained rows are written to the MTP ring but not committed:
    the next step rewrites them). Every rank of an instance runs the same ``steps`` (zero rows
    still run every collective). Returns each row's drafts (``want`` of them; first max on ties).
    Raises ValueError as ``Transformer.forward_mtp``."""
    dev = streams.device
    idx = [torch.arange(offsets[r.seq_id] + r.row0, offsets[r.seq_id] + r.row0 + len(r.tokens) - r.carry)
           for r in plan]
    rows = torch.cat(idx).to(dev) if idx else torch.zeros(0, dtype=torch.long, device=dev)
    if not any(r.carry for r in plan):
        X_in = streams[rows]
    else:                                   # rare (a prefix hit's first step): with the carried rows
        parts = []
        for r, i in zip(plan, idx):
            if r.carry:
                held = pools.seqs[r.seq_id]
                parts.append(held.carry[None].to(dev, streams.dtype))
                held.carry = None
            parts.append(streams[i.to(dev)])
        X_in = torch.cat(parts)
    toks = torch.tensor([t for r in plan for t in r.tokens], dtype=torch.long, device=dev)
    states = [pools.mtp_state(r.seq_id, r.q0) for r in plan]
    lengths = [len(r.tokens) for r in plan]
    X, hid = model.forward_mtp(X_in, toks, states, lengths)
    pick = [i for i, r in enumerate(plan) if r.want]
    last = (torch.tensor(lengths, dtype=torch.long).cumsum(0) - 1)[pick].to(dev)
    X, hid = X[last], hid[last]
    mtp, chain = [states[i] for i in pick], []
    for k in range(steps):
        tok = torch.argmax(model.logits(hid), dim=-1)                     # greedy drafts (first max)
        chain.append(tok)
        if k + 1 == steps:
            break
        X, hid = model.forward_mtp(X, tok, mtp, [1] * len(mtp))
    # the chain stays on the device: one host copy for all steps, not one per step
    drafted = torch.stack(chain, dim=1).tolist() if chain else [[] for _ in pick]   # [len(pick), steps]
    out: list[list[int]] = [[] for _ in plan]
    for i, ids in zip(pick, drafted):
        out[i] = ids[:plan[i].want]
    return out
