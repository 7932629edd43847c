"""One rank's model runner in a multi-rank instance (the leader's is ``engine.parallel.leader``).

Every rank runs the same ``execute(plan)`` and ``draft(plan)`` on the plan the leader sends
(``engine.core.step``: rows with their block tables, the pool changes): the state pools are the
accounting's on every rank without replaying it, and every collective is matched because each
rank derives the same calls from the same plan. Replicated attention (prefill; decode without
attention DP) runs every row on every rank, the experts, embedding, LM head and o_proj sharded
(``engine.parallel.shard``); a prompt's first chunk of at least ``cp_min_tokens`` tokens runs
context parallel (``engine.parallel.cp``). Under attention DP (decode) a request lives on one
rank (``DPCache``): each rank runs its own rows in "dp" row mode (zero rows still join every
collective), then the sampled rows are gathered in rank order, so every rank has the logits'
input. Only the leader samples.
"""
from __future__ import annotations

import hashlib
from contextlib import nullcontext

import torch

from engine.core.block_manager import BlockManager, SeqBlocks
from engine.core.model_runner import ModelRunner
from engine.core.mtp_runner import run_drafts
from engine.core.pd_state import load_state_tensors, sequence_state_tensors
from engine.core.step import DraftPlan, ScheduledRow
from engine.parallel.comm import gather_rows
from engine.parallel.dp_cache import DPCache


def cache_layout(runner: ModelRunner) -> dict:
    """What every rank must agree on (exchanged in the hello): the state pools, and a digest of
    weights no layout shards (final norm, layer 0's attention query-down projection and the last
    layer's router), so a rank loaded from another checkpoint is refused."""
    c, m = runner.pools.config, runner.model
    h = hashlib.sha256()
    for t in (m.norm.weight, m.layers[0].attn.wq_a.weight, m.layers[-1].ffn.gate.weight):
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return {"block_size": c.block_size, "max_seqs": c.max_seqs, "num_blocks": dict(sorted(c.num_blocks.items())),
            "next_n": c.next_n, "prefix_slots": c.prefix_slots, "dtype": str(m.dtype),
            "cache_dtype": c.cache_dtype.describe(), "weights": h.hexdigest()[:16]}


class RankRunner(ModelRunner):
    """``ModelRunner`` on rank ``rank`` of an instance.

    Args (beyond ``ModelRunner``'s): rank: this process's rank (0: the leader, which samples).
        dp: attention-DP ranks (1: replicated attention). cp_prefill: the context-parallel
        prefill function (``engine.parallel.cp.cp_prefill``) or None; cp_min_tokens: the fewest
        tokens of a prompt's first chunk it takes.
    """

    def __init__(self, model, pools, max_model_len: int, max_batch: int, platform=None, graph=None,
                 rank: int = 0, dp: int = 1, cp_prefill=None, cp_min_tokens: int = 1024):
        # the captured step's row mode: only a sharded model has collectives to fix the shapes of
        mode = ("dp" if dp > 1 else "replicated") if getattr(model, "parallel", None) is not None else None
        super().__init__(model, pools, max_model_len, max_batch, platform, graph, rows_mode=mode, samples=rank == 0)
        self.rank, self.dp_size = rank, dp
        self.cp_prefill, self.cp_min_tokens = cp_prefill, cp_min_tokens
        self.cp_runs = 0
        self.row_rank: dict[str, int] = {}      # the last step's rows' owner ranks

    @property
    def cp_first_chunk(self) -> int:
        return self.cp_min_tokens if self.cp_prefill is not None else 0

    def new_accounting(self) -> BlockManager:
        """The leader's accounting: one ``BlockManager`` per attention-DP rank (``DPCache``)."""
        if self.dp_size == 1:
            return super().new_accounting()
        return DPCache(self.model.args, self.pools.config, self.dp_size)

    def _dp(self):
        return self.model.parallel.rows("dp") if self.dp_size > 1 else nullcontext()

    # ---- the step -----------------------------------------------------------------------------
    def forward(self, rows: list[ScheduledRow], layer_hook=None, eager: bool = False) -> torch.Tensor:
        self.row_rank = {r.req_id: r.rank for r in rows}
        if self.dp_size == 1:
            return super().forward(rows, layer_hook, eager)
        if layer_hook is not None or eager:
            raise ValueError("attention DP serves decode: no layer hook")
        mine = [r for r in rows if r.rank == self.rank]
        with self._dp():
            hidden = self.run_rows(mine, None, rows)
        own = hidden[self.sample_index(mine, hidden.device)]
        got, counts = gather_rows(own, self.model.parallel.groups["moe"])
        # rank order -> plan order
        order = [i for k in range(self.dp_size) for i, r in enumerate(rows) if r.rank == k and r.samples]
        tails = {i: 1 + rows[i].num_drafts for i in order}
        starts, off = {}, 0
        for i in order:
            starts[i], off = off, off + tails[i]
        idx = [j for i, r in enumerate(rows) if r.samples for j in range(starts[i], starts[i] + tails[i])]
        return got[torch.tensor(idx, dtype=torch.long, device=got.device)]

    def eager(self, rows: list[ScheduledRow], sel: list[int], layer_hook=None):
        cp = [i for i in sel if self._use_cp(rows[i])]
        if not cp:
            return super().eager(rows, sel, layer_hook)
        m, dev = self.model, self.pools.device
        offs, n = {}, 0
        for i in sel:
            offs[i], n = n, n + rows[i].num_tokens
        hidden = torch.zeros(n, m.args.hidden_size, dtype=m.dtype, device=dev)
        for i in cp:         # one by one (upstream's cp_mini_batch 1); only the last row is read
            r = rows[i]
            hidden[offs[i] + r.num_tokens - 1] = self._prefill_cp(r)[-1]
        rest = [i for i in sel if i not in cp]
        if rest:             # the CP states are final now: a layer hook may read them with the others'
            h = super().eager(rows, rest, layer_hook)
            idx = torch.tensor([j for i in rest for j in range(offs[i], offs[i] + rows[i].num_tokens)],
                               dtype=torch.long, device=dev)
            hidden[idx] = h
        elif layer_hook is not None:
            for layer in range(len(m.layers)):
                layer_hook(layer)
        return hidden

    def _use_cp(self, r: ScheduledRow) -> bool:
        """A first prompt chunk long enough to split over the CP ranks (not with MTP, whose
        drafting needs every position's streams)."""
        return (self.cp_prefill is not None and not self.next_n and r.start == 0
                and r.num_tokens >= self.cp_min_tokens)

    def _prefill_cp(self, r: ScheduledRow) -> torch.Tensor:
        """Every rank: CP prefill of the row's tokens (a whole prompt from position 0), then the
        full state into this rank's pools. Returns the last hidden row ``[1, H]``."""
        tokens = torch.tensor(r.token_ids, dtype=torch.long, device=self.pools.device)
        last, state = self.cp_prefill(self.model, tokens, gather_hidden=False, cache=self.pools.cache_dtype)
        load_state_tensors(self.pools, SeqBlocks(r.state_slot, r.block_tables), r.num_tokens,
                           sequence_state_tensors(state, r.num_tokens))
        self.cp_runs += 1
        return last

    def decode(self, rows: list[ScheduledRow], sel: list[int], every: list[ScheduledRow] | None = None):
        if self.dp_size == 1 or self.graph is None:
            return super().decode(rows, sel, every)
        # the captured step at the buckets of the largest rank's rows: every rank the same shapes
        g, T = self.graph, self.span
        B = g.bucket(max(sum(1 for r in every if r.rank == k and r.num_tokens <= T) for k in range(self.dp_size)))
        C = g.context_bucket(max(r.end for r in every if r.num_tokens <= T))
        step = [(rows[i].token_ids, rows[i].start, rows[i].state_slot, rows[i].block_tables) for i in sel]
        out = g.step(step, B, C)
        idx = torch.tensor([b * T + j for b, (ids, *_) in enumerate(step) for j in range(len(ids))],
                           dtype=torch.long, device=self.pools.device)
        return tuple(o[idx] for o in out) if isinstance(out, tuple) else out[idx]

    # ---- MTP ----------------------------------------------------------------------------------
    def draft(self, plan: DraftPlan) -> list[list[int]]:
        if self.dp_size == 1:
            return super().draft(plan)
        if self.spans is not None:
            for rid, kept in plan.settle:
                self.spans.settle(rid, kept)
            self.spans.apply()
            self.spans = None
        mine = [i for i, r in enumerate(plan.rows) if self.row_rank.get(r.req_id) == self.rank]
        rows, carries = self.carried([plan.rows[i] for i in mine])
        span = self.decoder.span
        parts = (any(len(r.tokens) <= span for r in plan.rows), any(len(r.tokens) > span for r in plan.rows))
        steps = plan.steps
        with self._dp():
            got = run_drafts(self.model, self.pools, self.decoder, self.streams, self.offsets, self.holdings,
                             carries, rows, steps, parts)
        out = torch.full((len(got), max(steps, 1)), -1, dtype=torch.long, device=self.pools.device)
        for i, d in enumerate(got):
            out[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        every, _ = gather_rows(out, self.model.parallel.groups["moe"])
        order = [i for k in range(self.dp_size) for i, r in enumerate(plan.rows) if self.row_rank.get(r.req_id) == k]
        drafts: list[list[int]] = [[] for _ in plan.rows]
        for i, row in zip(order, every.tolist()):
            drafts[i] = row[:plan.rows[i].want]
        return drafts
