"""The model runner: the device side of an engine step (``engine.core.step``'s contract).

``execute(plan)`` applies the plan's pool changes, runs its rows and samples the rows whose
pending tokens all ran; ``draft(plan)`` (MTP) rolls back the rejected drafts and makes the next
ones. The rows run two ways, the same values either way:

    prefill chunks (longer than ``span`` tokens)   ``Transformer.forward_batch``, eager
    decode rows (1 .. ``span`` tokens: the pending  the decode step (``StaticDecoder``): eager and
    token, then an MTP request's drafts)           exact per row, or in graph mode the captured
                                                   step (``engine.core.graph_runner``)

A step with a layer hook (a prefill instance pushing each finished layer to decode) runs every
row through ``forward_batch``, whose layer loop calls it. The runner keeps only what a step needs
of the last one: the trunk's output streams (MTP drafting, prefix-cache carries) and the holdings
of its rows; it holds no request, queue or block accounting (``LLMEngine``, ``Scheduler``).
A multi-rank instance runs one on every rank (``engine.parallel.rank_runner``).
"""
from __future__ import annotations

import logging
import time
from itertools import accumulate

import torch

from engine.core.block_manager import BlockManager, SeqBlocks
from engine.core.graph_runner import DecodeRunner, ExecConfig
from engine.core.kv_cache import PagedCache
from engine.core.mtp_runner import SpanRollback, run_drafts
from engine.core.pd_state import load_split, mtp_state_tensors, state_tensors
from engine.core.sampler import sample_device, unpack
from engine.core.spec_decode import num_accepted
from engine.core.static_decode import StaticDecoder
from engine.core.step import DraftPlan, DraftRow, PoolOp, RowResult, ScheduledRow, StepPlan, StepResult
from engine.model.transformer import Transformer
from engine.platform import Platform, detect

log = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model, state pools and decode step.

    Args:
        model: the loaded ``Transformer``. pools: its ``PagedCache`` (MTP depth: ``config.next_n``).
        max_model_len: tokens per request. max_batch: requests per step on this rank.
        platform: the device (None: CPU). graph: an ``ExecConfig`` with a graph ``exe_mode`` (the
            decode rows through the captured step) or None / eager.
        rows_mode: a multi-rank model's row mode for the captured step (``DecodeRunner``).
        samples: whether this rank samples (a follower rank runs the logits' collectives only).
    """

    dp_size = 1                  # attention-DP ranks whose requests this runner's plans hold
    rank = 0
    cp_first_chunk = 0           # fewest tokens a first prompt chunk runs context parallel with (0: never)

    def __init__(self, model: Transformer, pools: PagedCache, max_model_len: int, max_batch: int,
                 platform: Platform | None = None, graph: ExecConfig | None = None, rows_mode: str | None = None,
                 samples: bool = True):
        self.next_n = pools.config.next_n
        if self.next_n and not len(model.mtp):
            raise ValueError("next_n > 0 needs the model's MTP layer (load it with mtp=True)")
        self.model, self.pools, self.samples, self.device = model, pools, samples, pools.device
        self.platform = platform or detect("cpu")
        self.span = 1 + self.next_n
        self.cfg = graph or ExecConfig()
        self.graph = (DecodeRunner(model, pools, max_model_len, max_batch, self.platform, self.cfg, rows_mode,
                                   span=self.span) if self.cfg.graph else None)
        self.decoder = self.graph.static if self.graph is not None else StaticDecoder(
            model, pools, max_model_len, self.platform, span=self.span)
        # of the last step (MTP): this rank's trunk output streams, each request's first row in
        # them and its last, its holdings; the rollback of its verify spans until ``draft``
        self.streams: torch.Tensor | None = None
        self.offsets: dict[str, int] = {}
        self.last_rows: dict[str, int] = {}
        self.holdings: dict[str, SeqBlocks] = {}
        self.spans: SpanRollback | None = None
        self.carries: dict[bytes, torch.Tensor] = {}     # prefix entry key -> carried streams [n, H]
        self.bound: dict[str, torch.Tensor] = {}         # req_id -> the carry its first draft takes

    @property
    def args(self):
        return self.model.args

    @property
    def cache_config(self):
        return self.pools.config

    def new_accounting(self) -> BlockManager:
        """The block accounting that schedules these pools (``LLMEngine.cache``)."""
        return BlockManager(self.model.args, self.pools.config)

    def warmup(self) -> None:
        """Compile / capture the graph step's buckets now (nothing without one)."""
        if self.graph is not None:
            self.graph.warmup()

    def describe(self) -> dict:
        """How decode runs, for /health: ``exe_mode`` and the graph step's backend / buckets."""
        g = self.graph
        return {"exe_mode": self.cfg.exe_mode if g is not None else "eager",
                "graph": None if g is None else {"backend": g.backend, "buckets": g.buckets,
                                                 "warmup_s": round(g.warmup_s, 3)}}

    # ---- pool changes -------------------------------------------------------------------------
    def apply_ops(self, ops: list[PoolOp]) -> None:
        """The accounting's pool changes, in order (``PoolOp``; another DP rank's are skipped)."""
        for op in ops:
            if op.rank not in (None, self.rank):
                continue
            k, a = op.kind, op.args
            if k in ("reset", "copy"):
                self.pools.apply(op)
            elif k == "carry_save":
                if self.next_n and self.streams is not None and a[1] in self.last_rows:
                    self.carries[a[0]] = self.streams[self.last_rows[a[1]]].clone()
            elif k == "carry_bind":
                if a[0] in self.carries:
                    self.bound[a[1]] = self.carries[a[0]]
            elif k == "carry_drop":
                self.carries.pop(a[0], None)
            elif k == "free":
                self.bound.pop(a[0], None)
                self.holdings.pop(a[0], None)

    # ---- a request's state as named tensors (P/D) --------------------------------------------
    def load_state(self, held: SeqBlocks, num_tokens: int, tensors: dict[str, torch.Tensor],
                   layers: list[int] | None = None, ops: list[PoolOp] = (), rank: int | None = None) -> None:
        """Apply ``ops`` (what the accounting recorded since the last step: the reservation's
        slot reset first), then write an imported state (``state_tensors`` / ``mtp_state_tensors``
        names after ``num_tokens`` tokens) into ``held`` (on attention-DP rank ``rank``). Raises
        ValueError (tensors that do not match; nothing written)."""
        self.apply_ops(list(ops))
        load_split(self.pools, held, num_tokens, tensors, layers)

    def state_tensors(self, held: SeqBlocks, num_tokens: int, layers: list[int] | None = None
                      ) -> dict[str, torch.Tensor]:
        """``pd_state.state_tensors`` of ``held`` (copies)."""
        return state_tensors(self.pools, held, num_tokens, layers)

    def mtp_state_tensors(self, held: SeqBlocks, num_tokens: int) -> dict[str, torch.Tensor]:
        """``pd_state.mtp_state_tensors`` of ``held`` ({} without MTP)."""
        return mtp_state_tensors(self.pools, held, num_tokens) if self.next_n else {}

    # ---- the step -----------------------------------------------------------------------------
    def execute(self, plan: StepPlan, layer_hook=None) -> StepResult:
        """Apply ``plan.pool_ops``, run its rows (``layer_hook(i)`` after layer i, all rows then
        eager) and sample its sampling rows (on a rank that ``samples``). A failure is returned,
        not raised (``StepResult.failed``), its exception in ``error``."""
        self.apply_ops(plan.pool_ops)
        if not plan.rows:
            return StepResult()
        try:
            hidden = self.forward(plan.rows, layer_hook, plan.eager)
        except Exception as e:            # noqa: BLE001 - the engine fails the batch's requests
            log.exception("forward failed; failing %d requests", len(plan.rows))
            return StepResult(failed="forward", error=e)
        rows = [r for r in plan.rows if r.samples]
        if not rows:
            return StepResult()
        try:
            logits = self.model.logits(hidden)
            if not self.samples:
                return StepResult()
            t = time.perf_counter()
            want = [s for r in rows for s in r.sampling]
            # the step's one copy to the host: ids, requested logprobs and finite flags
            sampled, finite = unpack(sample_device(logits, want, plan.grammar).tolist(), want)
            sample_s = time.perf_counter() - t
        except Exception as e:            # noqa: BLE001
            log.exception("logits / sampling failed; failing %d requests", len(rows))
            return StepResult(failed="sample", error=e)
        out, i = [], 0
        for r in rows:
            n, i = 1 + r.num_drafts, i + 1 + r.num_drafts
            got = sampled[i - n:i]
            drafts = r.token_ids[r.num_tokens - r.num_drafts:]
            out.append(RowResult(r.req_id, got, num_accepted([g.token_id for g in got], drafts),
                                 all(finite[i - n:i])))
        return StepResult(out, sample_s=sample_s)

    def forward(self, rows: list[ScheduledRow], layer_hook=None, eager: bool = False) -> torch.Tensor:
        """Run ``rows`` (``eager``: all through ``forward_batch``) -> hidden ``[R, H]`` of the
        sampling rows' last ``1 + num_drafts`` positions, in row order; with MTP the output
        streams are kept for ``draft``."""
        hidden = self.run_rows(rows, layer_hook, eager=eager or layer_hook is not None)
        return hidden[self.sample_index(rows, hidden.device)]

    def run_rows(self, rows: list[ScheduledRow], layer_hook=None, every: list[ScheduledRow] | None = None,
                 eager: bool = False) -> torch.Tensor:
        """Hidden ``[sum(num_tokens), H]`` of ``rows`` (this rank's), prefill chunks eager and
        decode rows through the decode step; with MTP the streams, offsets and holdings kept and
        the verify spans' ``SpanRollback`` made before the decode step writes. ``every``: all
        ranks' rows (attention DP; None: ``rows``): a part runs here, with no rows if need be,
        when any rank has rows of it, so every rank makes the same collective calls. ``eager``:
        no row through the decode step."""
        m, dev = self.model, self.pools.device
        nums = [r.num_tokens for r in rows]
        offs = [0, *accumulate(nums)]

        def fast_row(r: ScheduledRow) -> bool:
            return not eager and r.num_tokens <= self.span
        fast = [i for i, r in enumerate(rows) if fast_row(r)]
        rest = [i for i, r in enumerate(rows) if not fast_row(r)]
        every = rows if every is None else every
        mtp = self.next_n > 0
        hidden = torch.empty(offs[-1], m.args.hidden_size, dtype=m.dtype, device=dev)
        streams = torch.empty(offs[-1], m.args.hc_mult, m.args.hidden_size, dtype=m.residual_dtype,
                              device=dev) if mtp else None

        def put(sel: list[int], got) -> None:
            idx = torch.tensor([j for i in sel for j in range(offs[i], offs[i + 1])], dtype=torch.long, device=dev)
            if mtp:
                hidden[idx], streams[idx] = got
            else:
                hidden[idx] = got

        if mtp:
            spans = [(rows[i].req_id, rows[i].state_slot, rows[i].start, nums[i]) for i in fast if rows[i].num_drafts]
            self.spans = SpanRollback(self.pools, spans) if spans else None
        if any(not fast_row(r) for r in every):
            put(rest, self.eager(rows, rest, layer_hook))
        if any(fast_row(r) for r in every):
            put(fast, self.decode(rows, fast, every))
        if mtp:
            self.streams = streams
            self.offsets = {r.req_id: o for r, o in zip(rows, offs)}
            self.last_rows = {r.req_id: o - 1 for r, o in zip(rows, offs[1:])}
            self.holdings = {r.req_id: SeqBlocks(r.state_slot, r.block_tables) for r in rows}
        return hidden

    def eager(self, rows: list[ScheduledRow], sel: list[int], layer_hook=None):
        """Rows ``sel`` through ``Transformer.forward_batch`` -> hidden (with MTP: and streams)."""
        dev = self.pools.device
        toks = torch.tensor([t for i in sel for t in rows[i].token_ids], dtype=torch.long, device=dev)
        states = [self.pools.sequence_state(SeqBlocks(rows[i].state_slot, rows[i].block_tables), rows[i].start)
                  for i in sel]
        return self.model.forward_batch(toks, states, [rows[i].num_tokens for i in sel], layer_hook=layer_hook,
                                        streams=self.next_n > 0)

    def decode(self, rows: list[ScheduledRow], sel: list[int], every: list[ScheduledRow] | None = None):
        """Rows ``sel`` through the decode step (the captured one in graph mode); ``every``:
        ``run_rows``'."""
        step = [(rows[i].token_ids, rows[i].start, rows[i].state_slot, rows[i].block_tables) for i in sel]
        return self.graph.run(step) if self.graph is not None else self.decoder.run(step)

    @staticmethod
    def sample_index(rows: list[ScheduledRow], device) -> torch.Tensor:
        """Packed rows of each sampling row's last ``1 + num_drafts`` positions, in row order."""
        idx, off = [], 0
        for r in rows:
            off += r.num_tokens
            if r.samples:
                idx += range(off - 1 - r.num_drafts, off)
        return torch.tensor(idx, dtype=torch.long, device=device)

    # ---- MTP ----------------------------------------------------------------------------------
    def draft(self, plan: DraftPlan) -> list[list[int]]:
        """Roll back the rejected tails of the last step's verify spans (``plan.settle``; spans
        not settled belong to requests that ended), then the MTP catch-up and drafts
        (``run_drafts``) -> each plan row's drafts."""
        if self.spans is not None:
            for rid, kept in plan.settle:
                self.spans.settle(rid, kept)
            self.spans.apply()
            self.spans = None
        if not plan.rows:
            return []
        rows, carries = self.carried(plan.rows)
        return run_drafts(self.model, self.pools, self.decoder, self.streams, self.offsets, self.holdings, carries,
                          rows, plan.steps)

    def carried(self, rows: list[DraftRow]) -> tuple[list[DraftRow], dict]:
        """``rows`` with each carry taken from the request's bound entry; a row whose entry
        left none (it was made without MTP streams) starts one position later instead."""
        carries, out = {}, []
        for r in rows:
            if r.carry and r.req_id in self.bound:
                carries[r.req_id] = self.bound.pop(r.req_id)
                out.append(r)
            elif r.carry:
                out.append(DraftRow(r.req_id, r.row0, r.q0 + 1, r.tokens[1:], r.want))
            else:
                out.append(r)
        return out, carries
