"""The end of an engine step: the rows that sample get logits, their grammars' masks, one draw,
MTP verification, and what each request keeps appended (``LLMEngine._append``)."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from engine.core.grammar import token_bitmask
from engine.core.request import FinishReason, RequestOutput, Sequence
from engine.core.sampler import sample_device, unpack
from engine.core.sampling_params import SampleRow

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

log = logging.getLogger(__name__)


def sample_rows(engine: "LLMEngine", rows: list[Sequence], hidden: torch.Tensor) -> list[RequestOutput]:
    """Sample ``rows`` (requests whose pending tokens all ran; each with ``spec_k`` drafts after
    them: ``1 + spec_k`` rows of ``hidden`` ``[R, H]`` each, verified by ``spec.accept``) and
    append what each keeps. A row whose sample has a grammar is masked by it first
    (``engine.core.grammar``). A failure in logits / sampling, or non-finite logits, aborts the
    requests concerned (their state is past what they sampled)."""
    want = [SampleRow(s.params, s.num_tokens + j, s.prompt_ids, s.output_ids + s.draft_ids[:j])
            for s in rows for j in range(1 + s.spec_k)]
    spec = engine.spec
    try:
        logits = engine.executor.logits(hidden)
        t = time.perf_counter()
        # filled on the host while the device runs the LM head (launched, not waited for)
        mask = token_bitmask(rows, len(want), engine.model.args.vocab_size, hidden.device)
        # the step's one copy to the host: ids, requested logprobs and finite flags
        sampled, finite = unpack(sample_device(logits, want, mask).tolist(), want)
        engine.stats.sample_s += time.perf_counter() - t
    except Exception:
        log.exception("logits / sampling failed; failing %d requests", len(rows))
        for s in rows:
            engine._finish(s, FinishReason.ABORT)
        return []
    now = time.monotonic()
    outs, i = [], 0
    for s in rows:
        n, i = 1 + s.spec_k, i + 1 + s.spec_k
        got = sampled[i - n:i]
        if not all(finite[i - n:i]):
            log.error("request %s: non-finite logits at position %d; aborted", s.seq_id, s.num_tokens)
            engine._finish(s, FinishReason.ABORT)
            continue
        if spec is not None:
            got = got[: spec.accept(s, [g.token_id for g in got]) + 1]
        out, kept = None, 0
        for smp in got:
            o = engine._append(s, smp, now)
            out, kept = (o if out is None else out.merged(o)), kept + 1
            if o.finished:          # a stop inside an accepted run: the rest is not kept
                break
        if spec is not None:
            spec.settle(s, kept)
        outs.append(out)
    return outs
