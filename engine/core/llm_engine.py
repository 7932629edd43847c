"""The serving engine of one worker: requests in, tokens out, many requests per forward.

``LLMEngine`` = block accounting (``engine.core.block_manager``) + scheduler
(``engine.core.scheduler``) + a model runner (``engine.core.model_runner``: the model, its state
pools and the decode step). ``step()`` is the step's contract (``engine.core.step``)::

    plan, batch = scheduler.schedule()     # which rows, which blocks, which pool changes
    result = runner.execute(plan)          # forward, logits, samples
    drafts = self.update(...)              # the only place tokens are appended and requests end
    runner.draft(drafts)                   # MTP: rollback and next drafts

Both P/D roles run it (``pd``: the held / reserved requests); the offline mode drives it directly.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from engine.cache_dtype import CacheDtype
from engine.core.block_manager import BlockManager, CacheConfig, Geometry
from engine.core.grammar import GrammarBackend, accept, token_bitmask
from engine.core.pd import PDState
from engine.core.request import (FinishReason, RequestError, RequestOutput, Sequence, SeqStatus, StepStats,
                                 check_request, finish_reason)
from engine.core.sampling_params import Sampled, SamplingParams
from engine.core.scheduler import ScheduledBatch, Scheduler, SchedulerLimits
from engine.core.spec_decode import SpecDecoder
from engine.core.step import RowResult, StepPlan, StepResult

log = logging.getLogger(__name__)

# (layer, [(request_id, L)]): a step's layer hook for the held prompts that complete in it
LayerFinal = Callable[[int, list[tuple[str, int]]], None]


class LLMEngine:
    """Continuous-batching engine over one model runner.

    Args:
        runner: the model runner (``ModelRunner``, or anything with its ``execute`` / ``draft`` /
            state calls and ``describe``, ``args``, ``cache_config``, ``device``, ``dp_size`` and
            ``cp_first_chunk``: a test's fake runner needs no model, tests/engine/test_scheduler.py). ``limits.batch_size`` is per attention-DP rank.
        limits: scheduler limits. ``max_model_len`` must fit one request in the pools.
        eos_ids: token ids that end a sample unless ``ignore_eos``.
        grammar: compiles constrained decoding's grammars against the tokenizer (None: a request
            with ``SamplingParams.structured`` is refused).
        cache: the block accounting (None: a ``BlockManager`` of the runner's pools; attention DP
            passes one over its ranks).
    Raises:
        ValueError: the pools cannot hold one ``max_model_len`` request.
    """

    def __init__(self, runner, limits: SchedulerLimits, eos_ids: tuple[int, ...] = (),
                 grammar: GrammarBackend | None = None, cache: BlockManager | None = None):
        self.runner, self.eos_ids, self.grammar = runner, frozenset(eos_ids), grammar
        self.model = getattr(runner, "model", None)
        self.args = a = runner.args
        self.cache = cache if cache is not None else BlockManager(a, runner.cache_config)
        self.limits = replace(limits, batch_size=limits.batch_size * runner.dp_size)
        cap = self.max_tokens_per_request()
        if limits.max_model_len > cap:
            raise ValueError(f"scheduler_config.max_model_len: {limits.max_model_len} tokens do not fit the state "
                             f"pools, which hold {cap} tokens per request; lower max_model_len or raise "
                             f"mem_fraction_static / cpu_memory_gb / num_kv_blocks")
        self.scheduler = Scheduler(self.cache, self.limits, runner.cp_first_chunk)
        self.seqs: dict[str, Sequence] = {}
        self.stats = StepStats()
        self._finished_out: list[RequestOutput] = []
        next_n = runner.cache_config.next_n
        # MTP speculative decoding (next_n > 0): draft room, acceptance, the MTP rows after a step
        self.spec = SpecDecoder(next_n, self.limits.max_model_len, a.sliding_window) if next_n else None
        self.pd = PDState(self.cache, self.scheduler, runner, self.limits, next_n, a.vocab_size, self._check_new,
                          self._matcher, self._join)

    @classmethod
    def of(cls, model, cache_config: CacheConfig, limits: SchedulerLimits, eos_ids: tuple[int, ...] = (),
           runner=None, grammar: GrammarBackend | None = None, **runner_kw) -> "LLMEngine":
        """An engine over ``model`` with pools of ``cache_config``: ``runner`` (model, pools,
        limits) -> its model runner (None: a ``ModelRunner`` with ``runner_kw``: platform, graph)."""
        from engine.core.kv_cache import PagedCache
        from engine.core.model_runner import ModelRunner
        pools = PagedCache(model.args, cache_config, model.dtype, model.embed.weight.device)
        run = runner(model, pools, limits) if runner is not None else ModelRunner(
            model, pools, limits.max_model_len, limits.batch_size, **runner_kw)
        return cls(run, limits, eos_ids, grammar, run.new_accounting() if hasattr(run, "new_accounting") else None)

    @classmethod
    def build(cls, model, block_size: int = 128, batch_size: int = 8, max_prefill_tokens: int = 2048,
              max_model_len: int | None = None, mem_fraction_static: float = 0.85,
              cpu_memory_bytes: int = 4 << 30, num_kv_blocks: int | None = None, num_reserved_decode_tokens: int = 64,
              eos_ids: tuple[int, ...] | None = None, runner=None, cache_dtype: CacheDtype | None = None,
              next_n: int = 0, prefix_slots: int | None = None, grammar: GrammarBackend | None = None,
              **runner_kw) -> "LLMEngine":
        """Size the pools from memory (or ``num_kv_blocks`` CSA blocks: ``size_pools``) and build the engine
        (``of``); ``cache_dtype``: the caches' storage (``engine.cache_dtype``; None: unquantised);
        ``next_n``: MTP draft tokens per decode step (``engine.core.spec_decode``; the model needs
        its MTP layer); ``prefix_slots``: prefix caching's snapshot rings / slots (``CacheConfig``;
        None: off). ``max_model_len`` None: ``max_position_embeddings`` capped to what the pools hold.
        """
        from engine.core.kv_cache import size_pools
        a = model.args
        if next_n and not len(model.mtp):
            raise ValueError("next_n > 0 needs the model's MTP layer (load it with mtp=True)")
        cfg = size_pools(model, block_size, batch_size, mem_fraction_static, cpu_memory_bytes, num_kv_blocks,
                         cache_dtype, next_n, prefix_slots)
        if max_model_len is None:
            max_model_len = min(a.max_position_embeddings, Geometry.of(a, block_size).capacity(cfg))
        limits = SchedulerLimits(batch_size, max_prefill_tokens, max_model_len, num_reserved_decode_tokens)
        return cls.of(model, cfg, limits, (a.eos_token_id,) if eos_ids is None else eos_ids, runner, grammar,
                      **runner_kw)

    def max_tokens_per_request(self) -> int:
        """Longest request (tokens) the pools can hold on their own."""
        return min(self.cache.geometry.capacity(self.cache.config), self.args.max_position_embeddings)

    def describe(self) -> dict:
        """What /health reports of the engine: device, cache dtype, MTP depth and its counters,
        and how decode runs (``ModelRunner.describe``)."""
        from dataclasses import asdict
        spec = self.spec
        return {"device": str(self.runner.device),
                "cache_dtype": self.cache.config.cache_dtype.describe(),
                "next_n": spec.next_n if spec else 0, "spec_decode": asdict(spec.stats) if spec else None,
                **self.runner.describe()}

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    hold_state: bool = False, output_ids: list[int] = ()) -> None:
        """Queue a request. Raises RequestError naming the bad field (nothing is held then).

        ``hold_state`` (prefill role): after its first new token its decode state stays in the
        pools for ``pd.export_state`` until ``pd.release`` (``_append``). ``output_ids``: tokens this sample already
        generated elsewhere (a stream migrated off a lost decode): computed with the prompt and
        counted as outputs (penalties, ``max_new_tokens``, the sampler's positions), so the next
        token is the one an undisturbed run samples.
        """
        self._check_new(request_id, prompt_ids, params, output_ids)
        seq = Sequence(request_id, list(prompt_ids), params.with_seed(), hold_state=hold_state,
                       output_ids=list(output_ids), matcher=self._matcher(params, output_ids))
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_new(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                   output_ids: list[int] = ()) -> None:
        def in_use(rid: str) -> bool:
            return rid in self.seqs or self.pd.in_use(rid) or any(o.request_id == rid for o in self._finished_out)
        check_request(request_id, prompt_ids, params, output_ids, self.args.vocab_size,
                      self.limits.max_model_len, in_use)

    def _matcher(self, params: SamplingParams, output_ids: list[int]):
        """The sample's grammar matcher (None: unconstrained). Raises RequestError naming
        ``structured`` (no tokenizer, or the constraint does not compile) or ``output_ids``."""
        if params.structured is None:
            return None
        if self.grammar is None:
            raise RequestError("structured: this engine has no tokenizer for constrained decoding")
        return self.grammar.matcher(params.structured, output_ids)

    def _join(self, seq: Sequence, first_token: int, draft_ids: list[int]) -> None:
        """A request prefilled elsewhere (``pd.commit``) joins the running batch with token #1."""
        self.seqs[seq.seq_id] = seq
        seq.scheduled_time = time.monotonic()
        self.scheduler.add_running(seq)
        out = self._append(seq, Sampled(first_token), time.monotonic())
        seq.draft_ids = draft_ids[: self.spec.max_drafts(seq)] if self.spec and not out.finished else []
        if out.finished:
            self._finished_out.append(out)

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (queued, prefilling, decoding, held, reserved); frees
        its state at once. Returns False if it is unknown or already finished. A request of the
        engine's batch or queue gets its final output (``finish_reason`` abort) from the next
        ``step``; a held or reserved one (P/D roles: the worker answers for it) gets none."""
        if self.pd.release(request_id) or self.pd.unreserve(request_id):
            return True
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            return False
        self._finish(seq, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._finished_out)

    def num_free_blocks(self) -> dict[str, int]:
        """Free blocks per pool (``state``: request slots). Equal to ``num_total_blocks`` when idle,
        less what prefix-cache entries hold."""
        return self.cache.num_free()

    def num_total_blocks(self) -> dict[str, int]:
        return self.cache.num_total()

    def reset_prefix_cache(self) -> int:
        """Evict every prefix-cache entry (blocks running requests hold stay); returns how many."""
        return self.cache.reset_prefix_cache()

    # ---- stepping ----------------------------------------------------------------------------
    def step(self, on_layer_final: LayerFinal | None = None) -> list[RequestOutput]:
        """Schedule and run one batch; returns outputs of requests that got tokens or finished.

        ``on_layer_final`` (prefill role, P/D): called as (layer, [(request_id, L)]) once the
        layer's state is final for the held requests whose prompt completes in this step."""
        t0 = time.perf_counter()
        plan, batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        outputs, self._finished_out = self._finished_out, []
        if plan.rows:
            outputs += self._run(plan, batch, on_layer_final)
        elif plan.pool_ops:
            self.runner.execute(plan)              # the pool changes alone (frees, evictions)
        outputs, self._finished_out = outputs + self._finished_out, []
        t2 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.schedule_s += t1 - t0
        st.model_s += t2 - t1
        st.tokens += plan.num_tokens
        st.history.append((len(plan.rows), plan.num_tokens, t1 - t0, t2 - t1))
        del st.history[:-4096]
        return outputs

    def _run(self, plan: StepPlan, batch: ScheduledBatch, on_layer_final: LayerFinal | None) -> list[RequestOutput]:
        sampling = [s for s, r in zip(batch.seqs, plan.rows) if r.samples]
        masked = True
        try:
            plan.grammar = token_bitmask(sampling, sum(1 + r.num_drafts for r in plan.rows if r.samples),
                                         self.args.vocab_size, self.runner.device)
        except Exception:                   # noqa: BLE001 - its rows fail, the rest runs
            log.exception("grammar bitmask failed; failing %d requests", len(sampling))
            masked = False
        hook = None
        if on_layer_final is not None:
            done = [(r.req_id, r.end) for s, r in zip(batch.seqs, plan.rows) if s.hold_state and r.end == s.num_tokens]
            if done:
                hook = lambda layer: on_layer_final(layer, done)  # noqa: E731 - this step's finishing prompts
                plan.eager = True                  # the hook runs in forward_batch's layer loop
        result = self.runner.execute(plan, hook)
        if not masked and result.failed is None:
            result = StepResult(failed="sample")
        self.stats.sample_s += result.sample_s
        return self.update(plan, batch, result)

    def update(self, plan: StepPlan, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """The step's outcome: each row's computed tokens counted, each sampled row's kept
        tokens appended (through the one finish rule, ``_append``), then with MTP the rollback of
        rejected drafts and the next drafts (``runner.draft``), then the prefix-cache boundaries
        reached. A failed forward aborts the batch's requests (their states are half-advanced);
        a failed or non-finite sample aborts its requests."""
        if result.failed == "forward":
            for s in batch.seqs:
                self._finish(s, FinishReason.ABORT)
            return []
        for s, r in zip(batch.seqs, plan.rows):
            s.num_computed += r.num_tokens - r.num_drafts          # drafts count once accepted
        sampling = [s for s, r in zip(batch.seqs, plan.rows) if r.samples]
        if result.failed is None and (bad := _mismatch(sampling, result.rows)):
            log.error("model runner: %s; the step's sampled requests are aborted", bad)
            result = StepResult(failed="sample", error=RuntimeError(bad))
        if result.failed is not None:
            for s in sampling:
                self._finish(s, FinishReason.ABORT)
        outs, settle, now = [], [], time.monotonic()
        for s, rr in zip(sampling, result.rows):
            if s.seq_id not in self.seqs:        # finished during the step (aborted from its layer hook)
                continue
            if not rr.finite:
                log.error("request %s: non-finite logits at position %d; aborted", s.seq_id, s.num_tokens)
                self._finish(s, FinishReason.ABORT)
                continue
            out, kept = None, 0
            for smp in rr.sampled[:rr.accepted + 1]:
                o = self._append(s, smp, now)
                out, kept = (o if out is None else out.merged(o)), kept + 1
                if o.finished:          # a stop inside an accepted run: the rest is not kept
                    break
            if self.spec is not None:
                if s.spec_k and s.seq_id in self.cache.seqs:
                    settle.append((s.seq_id, kept))
                self.spec.settle(s, kept)
            outs.append(out)
        if self.spec is not None:
            self._draft(plan, batch, settle)       # first: an entry copies the MTP rings it writes
        for s in batch.seqs:
            if s.snapshots and s.snapshots[0][0] == s.num_computed:   # a boundary to keep (prefix cache)
                _, key, chain = s.snapshots.pop(0)
                self.cache.cache_prefix(s.seq_id, key, s.num_computed, chain)
        return outs

    def _draft(self, plan: StepPlan, batch: ScheduledBatch, settle: list[tuple[str, int]]) -> None:
        def holding(rid: str) -> bool:
            return rid in self.cache.seqs and (rid in self.seqs or rid in self.pd.held)
        drafts = self.spec.plan(batch, [r.start for r in plan.rows], holding, settle)
        got = self.runner.draft(drafts)
        by_id = {s.seq_id: s for s in batch.seqs}
        for r, d in zip(drafts.rows, got):
            if r.want:
                by_id[r.req_id].draft_ids = d

    def _append(self, s: Sequence, smp: Sampled, now: float) -> RequestOutput:
        """Append one sampled token to ``s`` and apply the finish rule (a complete grammar, then
        ``finish_reason``): the one place a request ends with a token, in every role. A
        ``hold_state`` request (prefill role) leaves the batch after its first new token, its
        state held for export, with the rule's reason (None: the sample goes on elsewhere)."""
        s.output_ids.append(smp.token_id)
        s.logprobs.append(smp)
        if s.first_token_time is None:
            s.first_token_time = now
        s.token_times.append(now)
        tok = smp.token_id
        reason = accept(s, tok) if s.matcher is not None else None      # a complete grammar ends it
        reason = reason or finish_reason(tok, len(s.output_ids), s.num_tokens, s.params, self.eos_ids,
                                         self.limits.max_model_len)
        # a held request (prefill role) leaves after its first new token either way: ``reason``
        # then says whether the sample also ends there (None: decode goes on with it)
        done = reason is not None or s.hold_state
        if done:
            self.scheduler.finish(s, reason, keep_state=s.hold_state)
            del self.seqs[s.seq_id]
            if s.hold_state:
                self.pd.hold(s)
        queue = None
        if len(s.output_ids) == 1 and s.scheduled_time is not None:
            queue = max(0.0, s.scheduled_time - s.arrival)
        return RequestOutput(s.seq_id, [tok], [smp], done, reason, len(s.prompt_ids),
                             len(s.output_ids), queue, s.num_cached)

    def _finish(self, s: Sequence, reason: FinishReason) -> None:
        self.scheduler.finish(s, reason)
        self.seqs.pop(s.seq_id, None)
        self._finished_out.append(RequestOutput(s.seq_id, [], [], True, reason, len(s.prompt_ids),
                                                len(s.output_ids)))

    # ---- convenience ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run prompts to completion (offline use, tests). Returns the finished sequences in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"sampling_params: {len(plist)} for {len(prompts)} prompts")
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        seqs = {}
        try:
            for rid, pr, p in zip(ids, prompts, plist):
                self.add_request(rid, pr, p)
                seqs[rid] = self.seqs[rid]
        except RequestError:
            for rid in seqs:                       # all or nothing
                self.abort(rid)
            self._finished_out = [o for o in self._finished_out if o.request_id not in seqs]
            raise
        while self.has_unfinished():
            self.step()
        return [seqs[r] for r in ids]


def _mismatch(sampling: list[Sequence], rows: list[RowResult]) -> str | None:
    """What is wrong with a runner's sampled rows for ``sampling`` (None: one row per request,
    in order, each with 1 + drafts samples at most and one at least)."""
    if len(rows) != len(sampling):
        return f"{len(rows)} sampled rows for {len(sampling)} sampling requests"
    for s, rr in zip(sampling, rows):
        if rr.req_id != s.seq_id:
            return f"a sampled row of {rr.req_id!r} where {s.seq_id!r} was planned"
        if rr.finite and not (1 <= len(rr.sampled) and 0 <= rr.accepted < len(rr.sampled)):
            return f"request {s.seq_id!r}: {len(rr.sampled)} samples accepting {rr.accepted} drafts"
    return None
