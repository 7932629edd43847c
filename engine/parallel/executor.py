"""Multi-rank execution of one instance: the leader schedules, the followers replay.

The leader (rank 0) runs the whole ``LLMEngine``: scheduler, sampler, block manager. Its state
pools are replicated on every rank (attention runs on the same rows everywhere; experts, the
embedding, the LM head and o_proj are sharded, ``engine.parallel.shard``), so the followers only
need, in order, the executor calls that change the pools (allocate, free, a loaded state, an MTP
rollback) and the model calls that carry collectives (forward, logits, MTP drafts,
context-parallel prefill). Every rank runs them through a ``RankExecutor``; the leader's is a
``LeaderExecutor``, which sends each call as one step message (``link.LeaderLink``) before running
it, and ``engine.parallel.follower.follow`` replays the messages on a follower's. The block
manager is deterministic, so replaying the same allocate / free sequence gives every rank the
same block tables (vLLM's multiproc executor broadcasts its scheduler output the same way).
``server.launch.rank_worker`` builds each rank's engine with its executor.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
from itertools import accumulate

import torch

from engine.core.executor import Executor, load_split
from engine.core.pd_state import load_state_tensors, sequence_state_tensors
from engine.core.spec_decode import DraftRow
from engine.parallel.comm import gather_rows
from engine.parallel.dp_cache import DPCache
from engine.parallel.link import LeaderLink, encode

log = logging.getLogger(__name__)


def cache_layout(engine) -> dict:
    """What every rank must agree on (exchanged in the hello): the state pools, and a digest of
    weights no layout shards (final norm, layer 0's attention query-down projection and the last
    layer's router), so a rank loaded from another checkpoint is refused."""
    c, m = engine.cache.config, engine.model
    h = hashlib.sha256()
    for t in (m.norm.weight, m.layers[0].attn.wq_a.weight, m.layers[-1].ffn.gate.weight):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return {"block_size": c.block_size, "max_seqs": c.max_seqs, "num_blocks": dict(sorted(c.num_blocks.items())),
            "next_n": c.next_n, "prefix_slots": c.prefix_slots, "dtype": str(m.dtype), "cache_dtype": c.cache_dtype.describe(),
            "weights": h.hexdigest()[:16]}


class RankExecutor(Executor):
    """Any rank of a multi-rank instance: ``Executor`` plus the calls only several ranks make.

    ``cp_prefill``: a context-parallel prefill function (``engine.parallel.cp.cp_prefill``), or
    None where the instance runs none. ``rows_mode``: the row mode of the instance's graph decode
    steps ("dp" under attention DP, else "replicated"; every rank's must be the same).
    """

    def __init__(self, model, cache, cp_prefill=None, rows_mode: str = "replicated"):
        super().__init__(model, cache)
        self.cp_prefill, self.rows_mode = cp_prefill, rows_mode

    def decode_graph(self, runner, rows: list, B: int, C: int, spec: list | None = None) -> torch.Tensor:
        """Every rank: its graph decode rows at the buckets the leader chose (none: padding, still
        every collective) -> ``[B * span, H]`` (``DecodeRunner.step``'s flat rows); under attention
        DP every rank's in rank order ``[world * B * span, H]`` (one all_to_all of fixed counts,
        outside the captured step).

        ``spec``: an MTP step's ``[seq_id, spec_k]`` per row: first the ``SpanRollback`` of the
        rows verifying drafts, then this rank's output streams kept for ``draft`` (as
        ``Executor.forward_spec`` does for an eager step)."""
        if spec is not None:
            self.begin_spans(rows, [sid for sid, _ in spec], dict(spec))
        h = runner.step(rows, B, C)
        if spec is not None:
            h, streams = h
            T = runner.span
            self.streams = streams[torch.tensor([b * T + j for b, r in enumerate(rows) for j in range(len(r[0]))],
                                                dtype=torch.long, device=streams.device)]
            self.offsets = dict(zip((sid for sid, _ in spec), accumulate((len(r[0]) for r in rows), initial=0)))
            self.last_rows = {sid: self.offsets[sid] + len(r[0]) - 1 for (sid, _), r in zip(spec, rows)}
        if self.rows_mode != "dp":
            return h
        g = self.model.parallel.groups["moe"]
        return gather_rows(h, g, [h.shape[0]] * g.size)[0]            # B * span rows on every rank

    def forward_dp(self, tokens: torch.Tensor, states: list, lengths: list[int], seq_ids: list | None = None,
                   spec_ks: list[int] | None = None) -> torch.Tensor:
        """Attention DP, every rank: its own sequences (none: zero rows, still every collective),
        then every rank's last rows, all ranks' in rank order ``[sum over ranks of sequences, H]``.
        With ``spec_ks`` (an MTP step, ``forward_spec`` here with ``seq_ids``) a sequence's last
        ``1 + spec_ks[i]`` rows: its pending token's and each draft's."""
        m = self.model
        with m.parallel.rows("dp"):
            if spec_ks is None:
                h = m.forward_batch(tokens, states, lengths)
            else:
                h = Executor.forward_spec(self, tokens, states, lengths, seq_ids, spec_ks)   # this rank's only
        tails = [1] * len(lengths) if spec_ks is None else [1 + k for k in spec_ks]
        ends = torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()
        idx = [e - t + j for e, t in zip(ends, tails) for j in range(t)]
        return gather_rows(h[torch.tensor(idx, dtype=torch.long, device=h.device)], m.parallel.groups["moe"])[0]

    def draft_dp(self, plan: list, steps: int) -> torch.Tensor:
        """Attention DP, every rank: ``draft`` of its own requests' ``plan`` rows in "dp" row mode,
        then every rank's drafts in rank order: ``[sum over ranks of rows, steps]`` int64, -1 past
        a row's ``want``."""
        m = self.model
        with m.parallel.rows("dp"):
            got = Executor.draft(self, [DraftRow(*r) for r in plan], steps)                # this rank's only
        out = torch.full((len(got), steps), -1, dtype=torch.long, device=self.streams.device)
        for i, d in enumerate(got):
            out[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        return gather_rows(out, m.parallel.groups["moe"])[0]

    def prefill_cp(self, seq_id, tokens: torch.Tensor) -> torch.Tensor:
        """Every rank: CP prefill of ``tokens`` ``[L]`` (a whole prompt), then the full state into
        this rank's pools for ``seq_id`` (already allocated). Returns the last hidden row ``[1, H]``."""
        last, state = self.cp_prefill(self.model, tokens, gather_hidden=False, cache=self.cache.cache_dtype)
        n = tokens.shape[0]
        load_state_tensors(self.cache, seq_id, n, sequence_state_tensors(state, n))
        return last


class LeaderExecutor(RankExecutor):
    """Rank 0: each call reaches the followers (``link``) first, then runs here.

    ``cp_prefill`` runs a prefill chunk that starts a prompt and has at least ``cp_min_tokens``
    tokens. ``dp`` > 1: attention data parallel (decode): ``cache`` (rank 0's pools) is scheduled
    as a ``DPCache`` whose requests each live on one rank, every rank runs its own requests' rows
    (the model in "dp" row mode) and the leader gathers their last hidden rows; the engine's
    batch limit becomes ``dp`` x its own. A pool change carries its owner rank (None: every rank).
    """

    on_failure = None                     # (reason) -> None: a step failed on some rank

    def __init__(self, model, cache, link: LeaderLink, cp_prefill=None, cp_min_tokens: int = 1024, dp: int = 1):
        super().__init__(model, DPCache(cache, dp) if dp > 1 else cache, cp_prefill, "dp" if dp > 1 else "replicated")
        self.link, self.dp_size, self.cp_min_tokens = link, dp, cp_min_tokens
        self.pools = cache
        self.pending: list = []             # pool changes not yet sent: [op, args..., owner rank]
        self.frames: list[bytes] = []
        self.cp_runs = 0
        self.dp_placed = [0] * dp           # requests placed on each DP rank so far

    def _owner(self, seq_id) -> int | None:
        return self.cache.rank_of(seq_id) if self.dp_size > 1 else None

    def allocate(self, seq_id, num_tokens: int, prefix: bytes | None = None):
        """As ``Executor.allocate``; every rank repeats it, a prefix hit's copies included (each
        rank's block manager holds the same entries: they replay ``cache_prefix`` and evictions
        happen inside the calls they replay, in the same order; attention DP's ``DPCache`` keeps
        none, so its scheduler never passes a prefix)."""
        new = self.dp_size > 1 and seq_id not in self.cache.owner
        held = super().allocate(seq_id, num_tokens, prefix)
        if new:
            self.dp_placed[self.cache.rank_of(seq_id)] += 1
        self.pending.append(["alloc", seq_id, num_tokens, prefix, self._owner(seq_id)])
        return held

    def cache_prefix(self, seq_id, key: bytes, num_tokens: int, chain: tuple[bytes, ...]) -> bool:
        """As ``Executor.cache_prefix`` on every rank (sent with the next step, before its
        forward: a follower's carried streams are still the step's that made the entry)."""
        self.pending.append(["cache_prefix", seq_id, key, num_tokens, list(chain), None])
        return super().cache_prefix(seq_id, key, num_tokens, chain)

    def reset_prefix_cache(self) -> int:
        """As ``Executor.reset_prefix_cache`` on every rank (the others with the next step: until
        then they hold the entries' blocks, which no call of theirs can need first)."""
        self.pending.append(["reset_prefix", None])
        return super().reset_prefix_cache()

    def cp_first_chunk(self) -> int:
        return self.cp_min_tokens if self.cp_prefill is not None else 0

    def free(self, seq_id) -> None:
        r = self._owner(seq_id) if seq_id in self.cache.seqs else None
        super().free(seq_id)
        self.pending.append(["free", seq_id, r])

    def load_state(self, seq_id, num_tokens: int, tensors: dict[str, torch.Tensor],
                   layers: list[int] | None = None) -> None:
        """As ``Executor.load_state``; under attention DP the bytes go to the owner rank only
        (rank 0 writes its own; another rank's are checked here first). Raises ValueError."""
        r = self._owner(seq_id)
        if r is None:
            super().load_state(seq_id, num_tokens, tensors, layers)
        elif r == 0:
            load_split(self.pools, seq_id, num_tokens, tensors, layers)
            return
        else:
            load_split(self.pools, seq_id, num_tokens, tensors, layers, check_only=True)
        metas, frames = [], []
        for name, t in tensors.items():
            meta, buf = encode(t)
            metas.append([name, *meta])
            frames.append(buf)
        op = ["load", seq_id, num_tokens, metas, layers, r]
        if r is None:
            self.pending.append(op)
            self.frames += frames
        else:                             # after the calls before it, to the owner only
            self._send({"op": "cache"}, [])
            self.link.send({"op": "cache", "cache": [op]}, frames, to=r)

    def forward_batch(self, tokens, states, lengths, layer_hook=None) -> torch.Tensor:
        """As ``Executor.forward_batch``; a sequence that ``_use_cp`` runs context parallel."""
        cp = [i for i, (st, n) in enumerate(zip(states, lengths)) if self._use_cp(st, n)]
        with self._failing("forward"):
            if not cp:
                return self._forward(tokens, states, lengths, layer_hook)
            return self._with_cp(cp, tokens, states, lengths, layer_hook)

    def forward_spec(self, tokens, states, lengths, seq_ids, spec_ks, layer_hook=None, graph=None) -> torch.Tensor:
        """As ``Executor.forward_spec`` on every rank (under attention DP, each request's rows on
        its owner rank; the hidden rows other than each request's last ``1 + spec_ks[i]`` are zero).
        ``graph``: the engine's graph step (``forward_packed``; every row a verify span, as
        ``LLMEngine`` arranges on several ranks), whose ``decode_rows`` sends the spans with their
        ``spec_ks``, so every rank makes its own rollbacks and keeps its own streams."""
        if graph is not None:
            self.spans, self._spec = None, dict(zip(seq_ids, spec_ks))
            try:
                return graph()[0]
            finally:
                self._spec = None
        with self._failing("forward"):
            if self.dp_size > 1:
                return self._forward_dp(tokens, states, lengths, layer_hook, spec_ks)
            meta, buf = encode(tokens)
            self._send({"op": "forward", "seqs": list(seq_ids), "nums": [st.num_tokens for st in states],
                        "lengths": list(lengths), "tokens": meta, "spec": list(spec_ks)}, [buf])
            return super().forward_spec(tokens, states, lengths, seq_ids, spec_ks, layer_hook)

    def settle(self, seq_id, kept: int) -> None:
        """As ``Executor.settle`` on the ranks holding ``seq_id`` (sent with the next step)."""
        r = self._owner(seq_id)
        if r in (None, 0):
            super().settle(seq_id, kept)
        if r != 0:
            self.pending.append(["settle", seq_id, kept, r])

    def draft(self, plan: list, steps: int) -> list[list[int]]:
        """As ``Executor.draft`` on every rank: under attention DP each plan row on its owner rank,
        every rank chaining ``steps`` drafts (their collectives matched), the drafts gathered here."""
        with self._failing("draft"):
            if self.dp_size == 1:
                self._send({"op": "draft", "plan": [list(r) for r in plan], "steps": steps}, [])
                return super().draft(plan, steps)
            mine = [[i for i, r in enumerate(plan) if self.cache.rank_of(r.seq_id) == k] for k in range(self.dp_size)]
            parts = [[list(plan[i]) for i in m] for m in mine]
            self._send({"op": "draft", "parts": parts[1:], "steps": steps}, [])
            got = self.draft_dp(parts[0], steps).tolist()
            out: list[list[int]] = [[] for _ in plan]
            for i, row in zip((i for m in mine for i in m), got):
                out[i] = row[:plan[i].want]
            return out

    def decode_rows(self, runner, rows: list, seq_ids: list):
        """As ``Executor.decode_rows`` over the ranks: under attention DP each row on its owner
        rank, else every row on every rank; every rank at the same (batch, context) buckets, the
        largest any rank needs. In an MTP step (``forward_spec`` with ``graph``) the rows are
        verify spans and each rank gets its rows' ``spec_k``: returns (hidden, None), the streams
        staying on each rank (``decode_graph``)."""
        with self._failing("decode"):
            mine = ([[i for i, sid in enumerate(seq_ids) if self.cache.rank_of(sid) == r] for r in range(self.dp_size)]
                    if self.dp_size > 1 else [list(range(len(rows)))])
            parts = [[list(rows[i]) for i in m] for m in mine]
            spec = None if self._spec is None else [[[seq_ids[i], self._spec[seq_ids[i]]] for i in m] for m in mine]
            B = runner.bucket(max(len(p) for p in parts))
            C = runner.context_bucket(max(r[1] + len(r[0]) for r in rows))
            head = {"op": "decode", "parts": parts[1:] if self.dp_size > 1 else parts, "B": B, "C": C}
            if spec is not None:
                head["spec"] = spec[1:] if self.dp_size > 1 else spec
            self._send(head, [])
            h = self.decode_graph(runner, parts[0], B, C, None if spec is None else spec[0])
            # rank r's row b holds flat rows (r * B + b) * span ..; the caller wants the rows' tokens in order
            T, offs, src, dst = runner.span, [0, *accumulate(len(r[0]) for r in rows)], [], []
            for r, m in enumerate(mine):
                for b, i in enumerate(m):
                    src += range((r * B + b) * T, (r * B + b) * T + len(rows[i][0]))
                    dst += range(offs[i], offs[i + 1])
            out = h.new_empty(offs[-1], h.shape[1])
            out[torch.tensor(dst, device=h.device)] = h[torch.tensor(src, device=h.device)]
            return out if spec is None else (out, None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._failing("logits"):
            meta, buf = encode(hidden)
            self._send({"op": "logits", "hidden": meta}, [buf])
            return super().logits(hidden)

    def prefill_cp(self, seq_id, tokens: torch.Tensor) -> torch.Tensor:
        meta, buf = encode(tokens)
        self._send({"op": "cp", "seq": seq_id, "tokens": meta}, [buf])
        last = super().prefill_cp(seq_id, tokens)
        self.cp_runs += 1
        return last

    def _forward(self, tokens, states, lengths, layer_hook) -> torch.Tensor:
        if self.dp_size > 1:
            return self._forward_dp(tokens, states, lengths, layer_hook)
        meta, buf = encode(tokens)
        self._send({"op": "forward", "seqs": self._seq_ids(states), "nums": [st.num_tokens for st in states],
                    "lengths": list(lengths), "tokens": meta}, [buf])
        return super().forward_batch(tokens, states, lengths, layer_hook)

    @contextlib.contextmanager
    def _failing(self, what: str):
        """A step that raises other than ValueError (a collective with a lost rank, a gone
        follower) fails the instance before the engine sees it, so its samples are not reported
        as finished (``on_failure``: the worker stops answering and exits)."""
        try:
            yield
        except ValueError:
            raise
        except Exception as e:
            if self.on_failure is not None:
                self.on_failure(f"{what} failed: {type(e).__name__}: {str(e)[:200]}")
            raise

    def _seq_ids(self, states) -> list:
        by_held = {id(h): sid for sid, h in self.cache.seqs.items()}
        return [by_held[id(st.held)] for st in states]

    def _send(self, header: dict, frames: list[bytes]) -> None:
        header["cache"], frames = self.pending, self.frames + frames
        self.pending, self.frames = [], []
        self.link.send(header, frames)

    def _forward_dp(self, tokens, states, lengths, layer_hook, spec_ks=None) -> torch.Tensor:
        """Each rank runs its own requests' rows; returns ``[T, H]`` with each sequence's last row
        (with ``spec_ks``, its last ``1 + spec_ks[i]``; the others zero: the engine reads no other)."""
        if layer_hook is not None:
            raise ValueError("attention DP serves decode: no layer hook")
        m, cache = self.model, self.cache
        seqs = self._seq_ids(states)
        offs = _offsets(lengths)
        mine = [[i for i, sid in enumerate(seqs) if cache.rank_of(sid) == r] for r in range(self.dp_size)]
        parts, frames = [], []
        for r in range(1, self.dp_size):
            meta, buf = encode(tokens[_rows(mine[r], offs)])
            part = {"seqs": [seqs[i] for i in mine[r]], "nums": [states[i].num_tokens for i in mine[r]],
                    "lengths": [lengths[i] for i in mine[r]], "tokens": meta}
            if spec_ks is not None:
                part["spec"] = [spec_ks[i] for i in mine[r]]
            parts.append(part)
            frames.append(buf)
        self._send({"op": "forward_dp", "parts": parts}, frames)
        own = mine[0]
        last = self.forward_dp(tokens[_rows(own, offs)], [states[i] for i in own], [lengths[i] for i in own],
                               [seqs[i] for i in own], None if spec_ks is None else [spec_ks[i] for i in own])
        hidden = torch.zeros(tokens.shape[0], m.args.hidden_size, dtype=m.dtype, device=tokens.device)
        tail = [0] * len(lengths) if spec_ks is None else spec_ks
        order = [j for r in range(self.dp_size) for i in mine[r] for j in range(offs[i + 1] - 1 - tail[i], offs[i + 1])]
        hidden[torch.tensor(order, dtype=torch.long)] = last
        return hidden

    def _use_cp(self, state, n: int) -> bool:
        """A prefill chunk that starts the prompt and is long enough to split over the CP ranks."""
        return self.cp_prefill is not None and state.num_tokens == 0 and n >= self.cp_min_tokens

    def _with_cp(self, cp: list[int], tokens, states, lengths, layer_hook) -> torch.Tensor:
        """The batch's sequences ``cp`` through context-parallel prefill one by one (upstream's
        cp_mini_batch 1), then the others in one forward. A CP sequence's hidden rows are zero but
        its last (the engine reads only that one for a finished prompt)."""
        m = self.model
        offs = _offsets(lengths)
        hidden = torch.zeros(tokens.shape[0], m.args.hidden_size, dtype=m.dtype, device=tokens.device)
        seqs = self._seq_ids(states)
        for i in cp:
            hidden[offs[i + 1] - 1] = self.prefill_cp(seqs[i], tokens[offs[i]:offs[i + 1]])[-1]
        rest = [i for i in range(len(states)) if i not in cp]
        if rest:          # the CP states are final now: a layer hook may read them with the others'
            idx = torch.cat([torch.arange(offs[i], offs[i + 1], device=tokens.device) for i in rest])
            hidden[idx] = self._forward(tokens[idx], [states[i] for i in rest], [lengths[i] for i in rest],
                                        layer_hook)
        elif layer_hook is not None:
            for layer in range(len(m.layers)):
                layer_hook(layer)
        return hidden

    def stop(self) -> None:
        """Tell the followers to exit (best effort)."""
        try:
            self._send({"op": "stop"}, [])
        except Exception:                 # noqa: BLE001 - they may be gone already
            pass


def _rows(seqs: list[int], offs: list[int]) -> torch.Tensor:
    """Packed row indices of sequences ``seqs`` (``offs``: sequence start offsets + the end)."""
    if not seqs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(offs[i], offs[i + 1]) for i in seqs])


def _offsets(lengths: list[int]) -> list[int]:
    """Start offsets of the packed sequences, then the end."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return offs
