"""The serving engine of one worker: requests in, tokens out, many requests per forward.

``LLMEngine`` = paged state pools (``engine.core.kv_cache``) + scheduler (``engine.core.scheduler``)
+ the model + sampler. ``step()`` runs one batch (decodes and prefill chunks packed together) and
returns what each touched request produced. Both P/D roles run it; the offline mode drives it directly.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.cache_dtype import CacheDtype
from engine.core.block_manager import CacheConfig, CacheFullError, Geometry
from engine.core.executor import Executor, ExecutorFactory
from engine.core.grammar import GrammarBackend, accept
from engine.core.kv_cache import PagedCache, size_pools
from engine.core.model_runner import forward_packed, spec_graph
from engine.core.pd_state import mtp_state_tensors, state_tensors
from engine.core.request import (FinishReason, RequestError, RequestOutput, Sequence, SeqStatus, StepStats,
                                 check_request, finish_reason)
from engine.core.sample_step import sample_rows
from engine.core.sampling_params import Sampled, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerLimits
from engine.core.spec_decode import SpecDecoder
from engine.model.transformer import Transformer

log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
        model: a loaded ``Transformer``.
        cache_config: pool sizes (``plan_cache`` or explicit, e.g. in tests).
        limits: scheduler limits. ``max_model_len`` must fit one request in the pools.
        eos_ids: token ids that end a sample unless ``ignore_eos``.
        executor: (model, pools) -> the executor every pool change and model call goes through
            (``engine.core.executor``; None: ``Executor``); ``limits.batch_size`` is per DP rank.
    Raises:
        ValueError: the pools cannot hold one ``max_model_len`` request.
    """

    def __init__(self, model: Transformer, cache_config: CacheConfig, limits: SchedulerLimits,
                 eos_ids: tuple[int, ...] = (), executor: ExecutorFactory | None = None):
        self.model, self.eos_ids = model, frozenset(eos_ids)
        self.executor = (executor or Executor)(model, PagedCache(model.args, cache_config, model.dtype,
                                                                 model.embed.weight.device))
        self.cache = self.executor.cache
        self.limits = replace(limits, batch_size=limits.batch_size * self.executor.dp_size)
        cap = self.max_tokens_per_request()
        if limits.max_model_len > cap:
            raise ValueError(f"scheduler_config.max_model_len: {limits.max_model_len} tokens do not fit the state "
                             f"pools, which hold {cap} tokens per request; lower max_model_len or raise "
                             f"mem_fraction_static / cpu_memory_gb / num_kv_blocks")
        self.scheduler = Scheduler(self.cache, self.limits, self.executor)
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}      # finished, state kept for export (prefill role)
        self.reserved: dict[str, Sequence] = {}  # decode role: state slots taken, state not yet loaded
        # prefill role: called as (layer, [(request_id, L)]) once layer's state is final for the
        # held requests whose prefill completes in this step (P/D pushes it at once)
        self.on_layer_final: Callable[[int, list[tuple[str, int]]], None] | None = None
        self.stats = StepStats()
        self._finished_out: list[RequestOutput] = []
        # graph-mode decode (engine.core.model_runner.DecodeRunner): runs the batch's single-token rows
        self.runner = None
        # MTP speculative decoding (next_n > 0): drafts, verification, rollback
        self.spec = SpecDecoder(self, cache_config.next_n) if cache_config.next_n else None
        # constrained decoding (SamplingParams.structured): compiles grammars against the tokenizer
        self.grammar: GrammarBackend | None = None

    @classmethod
    def build(cls, model: Transformer, block_size: int = 128, batch_size: int = 8, max_prefill_tokens: int = 2048,
              max_model_len: int | None = None, mem_fraction_static: float = 0.85,
              cpu_memory_bytes: int = 4 << 30, num_kv_blocks: int | None = None, num_reserved_decode_tokens: int = 64,
              eos_ids: tuple[int, ...] | None = None, executor: ExecutorFactory | None = None,
              cache_dtype: CacheDtype | None = None, next_n: int = 0, prefix_slots: int | None = None
              ) -> "LLMEngine":
        """Size the pools from memory (or ``num_kv_blocks`` CSA blocks: ``size_pools``) and build the engine;
        ``cache_dtype``: the caches' storage (``engine.cache_dtype``; None: unquantised); ``next_n``:
        MTP draft tokens per decode step (``engine.core.spec_decode``; the model needs its MTP layer);
        ``prefix_slots``: prefix caching's snapshot rings / slots (``CacheConfig``; None: off).

        ``max_model_len`` None: ``max_position_embeddings`` capped to what the pools hold.
        """
        a = model.args
        cfg = size_pools(model, block_size, batch_size, mem_fraction_static, cpu_memory_bytes, num_kv_blocks,
                         cache_dtype, next_n, prefix_slots)
        if max_model_len is None:
            max_model_len = min(a.max_position_embeddings, Geometry.of(a, block_size).capacity(cfg))
        limits = SchedulerLimits(batch_size, max_prefill_tokens, max_model_len, num_reserved_decode_tokens)
        return cls(model, cfg, limits, (a.eos_token_id,) if eos_ids is None else eos_ids, executor)

    def max_tokens_per_request(self) -> int:
        """Longest request (tokens) the pools can hold on their own."""
        return min(self.cache.geometry.capacity(self.cache.config), self.model.args.max_position_embeddings)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    hold_state: bool = False, output_ids: list[int] = ()) -> None:
        """Queue a request. Raises RequestError naming the bad field (nothing is held then).

        ``hold_state`` (prefill role): when it finishes normally its decode state stays in the
        pools for ``export_state`` until ``release``. ``output_ids``: tokens this sample already
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
            return (rid in self.seqs or rid in self.held or rid in self.reserved
                    or any(o.request_id == rid for o in self._finished_out))
        check_request(request_id, prompt_ids, params, output_ids, self.model.args.vocab_size,
                      self.limits.max_model_len, in_use)

    def _matcher(self, params: SamplingParams, output_ids: list[int]):
        """The sample's grammar matcher (None: unconstrained). Raises RequestError naming
        ``structured`` (no tokenizer, or the constraint does not compile) or ``output_ids``."""
        if params.structured is None:
            return None
        if self.grammar is None:
            raise RequestError("structured: this engine has no tokenizer for constrained decoding")
        return self.grammar.matcher(params.structured, output_ids)

    # ---- P/D: a request's state out of a prefill engine, into a decode engine ------------------
    def export_state(self, request_id: str) -> tuple[Sequence, dict[str, torch.Tensor]]:
        """A held request (``hold_state``, finished) and its state tensors (``state_tensors``
        at L = prompt length: the sampled first token is not yet in the state). Raises KeyError."""
        seq = self.held[request_id]
        return seq, {**state_tensors(self.cache, request_id, seq.num_computed), **self.mtp_state(request_id)}

    def mtp_state(self, request_id: str) -> dict[str, torch.Tensor]:
        """A held request's MTP window rings (``mtp_state_tensors``; {} without MTP): final once
        the step that sampled its first token ran (its drafts: the held ``Sequence.draft_ids``)."""
        return mtp_state_tensors(self.cache, request_id, self.held[request_id].num_computed) if self.spec else {}

    def layer_state(self, request_id: str, num_tokens: int, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer`` of a request's state after ``num_tokens`` tokens (``state_tensors``
        names; copies, safe to send later): what ``on_layer_final`` announces. Raises KeyError."""
        return state_tensors(self.cache, request_id, num_tokens, [layer])

    def release(self, request_id: str) -> bool:
        """Free a held request's state. False if it holds none."""
        if self.held.pop(request_id, None) is None:
            return False
        self.executor.free(request_id)
        return True

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                output_ids: list[int] = ()) -> None:
        """Decode role: take the state slots and a batch place for a request prefilled elsewhere,
        before its prefill runs (its state then lands in place: ``load_state`` + ``commit``).

        Holds blocks for L + 1 + ``num_reserved_decode_tokens`` tokens (capped at max_model_len),
        L = prompt + ``output_ids`` (a migrated stream's tokens so far, as in ``add_request``).
        Raises:
            RequestError: a bad field (``params.seed`` must be set: prefill samples with it).
            CacheFullError: no room (state blocks, or ``batch_size`` places); nothing is held then.
        """
        self._check_new(request_id, prompt_ids, params, output_ids)
        if request_id in self.reserved:
            raise RequestError(f"request_id: {request_id!r} is already reserved")
        if params.seed is None:
            raise RequestError("sampling_params.seed: must be the seed prefill samples with")
        if len(self.scheduler.running) + len(self.reserved) >= self.limits.batch_size:
            raise CacheFullError(f"batch full: {self.limits.batch_size} requests running or reserved")
        L = len(prompt_ids) + len(output_ids)
        matcher = self._matcher(params, output_ids)
        self.executor.allocate(request_id, min(L + 1 + self.limits.num_reserved_decode_tokens, self.limits.max_model_len))
        self.reserved[request_id] = Sequence(request_id, list(prompt_ids), params, output_ids=list(output_ids),
                                             num_computed=L, matcher=matcher)
        self.scheduler.num_reserved = len(self.reserved)

    def load_state(self, request_id: str, tensors: dict[str, torch.Tensor], layers: list[int] | None = None) -> None:
        """Write (some layers of) a reserved request's imported state (``state_tensors`` names).

        Raises:
            KeyError: not reserved. RequestError: tensors that do not match this model (``state``);
                nothing is written then.
        """
        seq = self.reserved[request_id]
        mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
        try:
            if mtp and self.spec is None:
                raise ValueError(f"MTP state {sorted(mtp)[:2]} for an engine without MTP (next_n 0)")
            self.executor.load_state(request_id, seq.num_computed, tensors, layers)
        except ValueError as e:
            raise RequestError(f"state: {e}") from None

    def commit(self, request_id: str, first_token: int, draft_ids: list[int] = ()) -> None:
        """A reserved request whose whole state is loaded joins the running batch with token #1
        (and, with MTP, the drafts prefill made after it, its MTP rings loaded).

        Decoding continues exactly as if this engine had prefilled it (same seed -> same tokens).
        Raises KeyError (not reserved), RequestError (bad token or drafts; the reservation is kept).
        """
        seq = self.reserved[request_id]
        V = self.model.args.vocab_size
        if not isinstance(first_token, int) or not 0 <= first_token < V:
            raise RequestError(f"first_token: {first_token!r} is not a token id")
        if draft_ids and (self.spec is None or len(draft_ids) > self.spec.next_n
                          or any(not isinstance(t, int) or not 0 <= t < V for t in draft_ids)):
            raise RequestError(f"draft_ids: {list(draft_ids)[:8]!r} are not up to next_n "
                               f"{self.spec.next_n if self.spec else 0} token ids")
        del self.reserved[request_id]
        self.scheduler.num_reserved = len(self.reserved)
        self.seqs[request_id] = seq
        seq.scheduled_time = time.monotonic()
        self.scheduler.add_running(seq)
        out = self._append(seq, Sampled(first_token), time.monotonic())
        seq.draft_ids = list(draft_ids)[: self.spec.max_drafts(seq)] if self.spec and not out.finished else []
        if out.finished:
            self._finished_out.append(out)

    def unreserve(self, request_id: str) -> bool:
        """Drop a reservation and free its slots. False if there is none."""
        if self.reserved.pop(request_id, None) is None:
            return False
        self.scheduler.num_reserved = len(self.reserved)
        self.executor.free(request_id)
        return True

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, params: SamplingParams,
                      tensors: dict[str, torch.Tensor]) -> None:
        """Join a request prefilled elsewhere: its state for L = len(prompt_ids) and token #1
        (``reserve`` + ``load_state`` + ``commit`` in one call).

        Raises:
            RequestError: a bad field, or state tensors that do not match this model (``state``).
            CacheFullError: no room (state blocks or ``batch_size``); nothing is held then.
        """
        if not isinstance(first_token, int) or not 0 <= first_token < self.model.args.vocab_size:
            raise RequestError(f"first_token: {first_token!r} is not a token id")
        self.reserve(request_id, prompt_ids, params)
        try:
            self.load_state(request_id, tensors)
        except RequestError:
            self.unreserve(request_id)
            raise
        self.commit(request_id, first_token)

    def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (queued, prefilling, decoding); frees its state at once.

        Returns False if it is unknown or already finished. Its final output (``finish_reason``
        abort) comes from the next ``step``.
        """
        if self.release(request_id) or self.unreserve(request_id):
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

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns outputs of requests that got tokens or finished."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        outputs, self._finished_out = self._finished_out, []
        if batch:
            outputs += self._run(batch)
        outputs, self._finished_out = outputs + self._finished_out, []
        t2 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.schedule_s += t1 - t0
        st.model_s += t2 - t1
        st.tokens += sum(batch.num_tokens)
        st.history.append((len(batch.seqs), sum(batch.num_tokens), t1 - t0, t2 - t1))
        del st.history[:-4096]
        return outputs

    def _run(self, batch) -> list[RequestOutput]:
        dev = self.model.embed.weight.device
        ids = [t for s, n in zip(batch.seqs, batch.num_tokens) for t in s.pending_ids(n)]
        tokens = torch.tensor(ids, dtype=torch.long, device=dev)
        hook = None
        if self.on_layer_final is not None:
            done = [(s.seq_id, s.num_computed + n) for s, n in zip(batch.seqs, batch.num_tokens)
                    if s.hold_state and s.num_computed + n == s.num_tokens]
            if done:
                cb = self.on_layer_final
                hook = lambda layer: cb(layer, done)  # noqa: E731 - this step's finishing prompts
        spec = self.spec
        try:
            if spec is None:
                hidden = forward_packed(self.executor, self.runner if hook is None else None, batch, ids,
                                        tokens, hook)
            else:
                graph = spec_graph(self.executor, self.runner if hook is None else None, batch, ids, tokens)
                states = spec.begin(batch, states=graph is None)
                hidden = self.executor.forward_spec(tokens, states, batch.num_tokens, [s.seq_id for s in batch.seqs],
                                                    [s.spec_k for s in batch.seqs], layer_hook=hook, graph=graph)
        except Exception:
            # states are half-advanced: the batch's requests cannot continue (logged, not hidden)
            log.exception("forward failed; failing %d requests", len(batch.seqs))
            for s in batch.seqs:
                self._finish(s, FinishReason.ABORT)
            return []
        rows, last, off = [], [], 0
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed += n - s.spec_k          # drafts count once accepted
            off += n
            if s.num_pending == 0:
                rows.append(s)
                last += range(off - 1 - s.spec_k, off)        # the pending token's row, then each draft's
        outs = sample_rows(self, rows, hidden[torch.tensor(last, dtype=torch.long, device=dev)]) if rows else []
        if spec is not None:
            spec.draft()                            # first: an entry copies the MTP rings it writes
        for s in batch.seqs:
            if s.snapshots and s.snapshots[0][0] == s.num_computed:   # a boundary to keep (prefix cache)
                _, key, chain = s.snapshots.pop(0)
                self.executor.cache_prefix(s.seq_id, key, s.num_computed, chain)
        return outs

    def _append(self, s: Sequence, smp: Sampled, now: float) -> RequestOutput:
        s.output_ids.append(smp.token_id)
        s.logprobs.append(smp)
        if s.first_token_time is None:
            s.first_token_time = now
        s.token_times.append(now)
        tok = smp.token_id
        reason = accept(s, tok) if s.matcher is not None else None      # a complete grammar ends it
        reason = reason or finish_reason(tok, len(s.output_ids), s.num_tokens, s.params, self.eos_ids,
                                         self.limits.max_model_len)
        if reason is not None:
            self.scheduler.finish(s, reason, keep_state=s.hold_state)
            del self.seqs[s.seq_id]
            if s.hold_state:
                self.held[s.seq_id] = s
        queue = None
        if len(s.output_ids) == 1 and s.scheduled_time is not None:
            queue = max(0.0, s.scheduled_time - s.arrival)
        return RequestOutput(s.seq_id, [tok], [smp], reason is not None, reason, len(s.prompt_ids),
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

