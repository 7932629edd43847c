"""The measurements of ``dsv4-bench engine`` (``bench.engine_bench``): a synthetic paged state, the ops
labelled for the profiler and how profiled time is attributed to them, and one function per row kind
(decode vs batch, decode vs context, prefill, per-op breakdown, the HF reference), each row beside its
roofline limit (``bench.roofline``). Times are seconds (s) or milliseconds (ms) of wall time.
"""
from __future__ import annotations

import functools
import math
import statistics
import time

import torch

from bench import roofline as R

STEP = "decode_step"           # profiler label of one whole step
HEAD = "lm_head"               # profiler label of model.logits


# ---- state -------------------------------------------------------------------------------------
def synthetic_paged(model, context: int, generator: torch.Generator, headroom: int = 64, requests: int = 1):
    """A ``LocalCache`` (block accounting + its pools, ``.paged``) holding ``requests`` requests
    (ids 0 ..) each as after prefilling ``context`` tokens, random values: every pool filled with
    unit-scale normals (the entries, ring and compressor rows a real prefill writes are all in
    there; the rest is never read). Room for ``headroom`` more tokens each."""
    from engine.core.block_manager import CacheConfig, Geometry
    from engine.core.kv_cache import LocalCache
    from engine.config import CSA_RATIO

    g = Geometry.of(model.args, 128)
    n = context + headroom
    blocks = {p: max(1, g.blocks_needed(p, n)) * requests for p in ("c4", "c128")}
    cache = LocalCache(model.args, CacheConfig(128, requests, blocks), model.dtype, model.embed.weight.device)
    held = [cache.allocate(i, n) for i in range(requests)]
    for t in cache.tensors():
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    if context < CSA_RATIO:                         # no CSA window closed yet: overlap weights still 0
        for h in held:
            cache.paged.reset_slot(h.state_slot)
    return cache


def eager_decode(model, cache, max_model_len: int):
    """An eager engine's decode step over ``cache`` (``synthetic_paged``): ``step(tokens, position)``
    runs token ``tokens[r]`` of each request r (ids 0 ..) at ``position`` through the model
    runner's decode rows (``ModelRunner.decode``: ``StaticDecoder.run`` uncompiled, host positions,
    exact per row) -> hidden ``[requests, H]``; the pools advance."""
    from engine.core.model_runner import ModelRunner
    from engine.core.step import ScheduledRow

    held = [cache.seqs[r] for r in sorted(cache.seqs)]
    runner = ModelRunner(model, cache.paged, max_model_len, len(held))

    def step(tokens, position: int) -> torch.Tensor:
        rows = [ScheduledRow(str(r), position, [int(t)], samples=True, state_slot=h.state_slot, block_tables=h.tables)
                for r, (t, h) in enumerate(zip(tokens, held))]
        return runner.decode(rows, list(range(len(rows))))
    return step


# ---- ops labelled for the profiler ---------------------------------------------------------------
def _label(name: str, fn):
    """``fn`` inside ``record_function(name)`` while a profiler runs (otherwise one flag check).
    ``functools.wraps`` keeps ``__wrapped__``, so code that unwraps an op to recognise the
    reference (``StaticDecoder``'s routed experts) sees the op it wraps and takes the same path."""
    enabled = torch.autograd._profiler_enabled

    @functools.wraps(fn)
    def op(*args, **kw):
        if enabled():
            with torch.profiler.record_function(name):
                return fn(*args, **kw)
        return fn(*args, **kw)
    return op


def labelled_ops(base=None):
    """``base`` (default ``engine.ops.REFERENCE``) with every op labelled by its name (``_label``)."""
    from engine.ops import OP_NAMES, REFERENCE

    base = REFERENCE if base is None else base
    return base.with_overrides(**{n: _label(n, getattr(base, n)) for n in OP_NAMES})


def labelled_model(ckpt, dtype):
    """The model on ``labelled_ops``, with ``model.logits`` (the LM head) labelled ``lm_head``."""
    from engine.checkpoint.loader import load_model

    m = load_model(ckpt, dtype=dtype, ops=labelled_ops(), progress=False)
    m.logits = _label(HEAD, m.logits)
    return m


def attribute(events, labels: set[str], root: str = STEP) -> dict:
    """Split profiled ``root`` events (one per step) into time per label, in µs.

    A labelled event inside ``root`` counts for its label; labelled events nested in another
    label fold into the outer one. Events directly under ``root`` that carry no label (torch ops
    run outside the ops table) are summed as ``untabled_us``. Returns ``{"per": {label: [us,
    calls]}, "total_us", "steps", "untabled_us"}``; root's remaining own time is Python glue.
    """
    per: dict[str, list] = {}
    total, n_root, untabled = 0.0, 0, 0.0
    for e in events:
        if e.name == root:
            total += e.time_range.elapsed_us()
            n_root += 1
            continue
        p = e.cpu_parent
        if e.name not in labels:
            if p is not None and p.name == root:
                untabled += e.time_range.elapsed_us()
            continue
        while p is not None and p.name not in labels and p.name != root:
            p = p.cpu_parent
        if p is None or p.name != root:
            continue                                           # outside a step, or folded into p
        slot = per.setdefault(e.name, [0.0, 0])
        slot[0] += e.time_range.elapsed_us()
        slot[1] += 1
    return {"per": per, "total_us": total, "steps": n_root, "untabled_us": untabled}


# ---- measurements ------------------------------------------------------------------------------
def _ms(s: float) -> float:
    return round(s * 1e3, 3)


def _limit_row(cost: dict, hw: dict, dtype, measured_s: float) -> dict:
    lim = R.limit(cost, hw, dtype)
    return {"limit_ms": _ms(lim["limit_s"]), "memory_ms": _ms(lim["memory_s"]), "compute_ms": _ms(lim["compute_s"]),
            "bound": lim["bound"], "ratio": round(measured_s / lim["limit_s"], 2),
            "bytes": cost["bytes"], "flops": cost["flops"]}


def _engine_ready(model, batch: int, prompt_len: int, new_tokens: int, seed: int = 0):
    """An ``LLMEngine`` with ``batch`` requests of ``prompt_len`` random tokens, all prefilled (each
    has its first token), greedy, ``new_tokens`` tokens each at most; step history cleared."""
    from engine.core.llm_engine import LLMEngine
    from engine.core.sampling_params import SamplingParams

    max_len = prompt_len + new_tokens + 8
    blocks = batch * (math.ceil(max_len / (128 * 4)) + 1)
    eng = LLMEngine.build(model, block_size=128, batch_size=batch, max_prefill_tokens=8192, max_model_len=max_len,
                          num_kv_blocks=max(4, blocks))
    g = torch.Generator().manual_seed(seed * 1000 + batch)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{i}", torch.randint(2, model.args.vocab_size, (prompt_len,), generator=g).tolist(), params)
    while any(s.num_pending > 1 or not s.output_ids for s in eng.seqs.values()):
        eng.step()                                              # prefill (and first token) of everyone
    eng.stats.history.clear()
    return eng


def _full_steps(eng, batch: int) -> list:
    return [h for h in eng.stats.history if h[0] == batch and h[1] == batch]


def decode_vs_batch(model, batch: int, prompt_len: int, steps: int, hw: dict, dtype, seed: int = 0) -> dict:
    """B requests through ``LLMEngine``: median full decode step (scheduler + model + sampling)."""
    eng = _engine_ready(model, batch, prompt_len, steps + 1, seed)
    while eng.has_unfinished():
        eng.step()
    dec = _full_steps(eng, batch)
    if not dec:
        raise RuntimeError(f"decode_vs_batch: no full decode step of batch {batch} (raise --decode-steps)")
    sched = statistics.median(h[2] for h in dec)
    model_s = statistics.median(h[3] for h in dec)
    step = sched + model_s
    row = {"batch": batch, "context": prompt_len + steps // 2, "decode_steps": len(dec), "step_ms": _ms(step),
           "tokens_per_s": round(batch / step, 1), "schedule_ms": _ms(sched), "model_ms": _ms(model_s)}
    row.update(_limit_row(R.decode_cost(model.args, batch, prompt_len + steps // 2, dtype), hw, dtype, step))
    return row


def decode_vs_context(model, context: int, steps: int, hw: dict, dtype, seed: int = 0) -> dict:
    """Batch 1 on ``synthetic_paged(context)`` through the serving engine's eager decode step
    (``eager_decode``): median of ``steps`` timed ``logits(decode step(token))``."""
    g = torch.Generator().manual_seed(seed)
    cache = synthetic_paged(model, context, g, headroom=steps + 16)
    decode = eager_decode(model, cache, context + steps + 16)
    tok = torch.randint(2, model.args.vocab_size, (1,), generator=g)
    times = []
    for i in range(steps + 1):                                 # first step: warm-up
        t0 = time.perf_counter()
        h = decode(tok.tolist(), context + i)
        tok = model.logits(h).argmax(-1)
        if i:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    row = {"context": context, "steps": steps, "step_ms": _ms(step)}
    row.update(_limit_row(R.decode_cost(model.args, 1, context + steps // 2, dtype), hw, dtype, step))
    return row


def prefill(model, length: int, chunk: int, hw: dict, dtype, seed: int = 0) -> dict:
    """Fresh state, ``length`` random tokens in chunks of ``chunk``, then the last row's logits."""
    ids = torch.randint(2, model.args.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    state = model.new_state()
    t0 = time.perf_counter()
    for s in range(0, length, chunk):
        hidden = model(ids[s:s + chunk], state)
    model.logits(hidden[-1:])
    t = time.perf_counter() - t0
    row = {"length": length, "seconds": round(t, 4), "tokens_per_s": round(length / t, 1)}
    cost = R.prefill_cost(model.args, length, dtype, chunk)
    row.update(_limit_row(cost, hw, dtype, t))
    row["limit_s"] = round(row.pop("limit_ms") / 1e3, 5)
    row["indexer_flops_share"] = round(cost["parts"]["state_indexer"]["flops"] / cost["flops"], 4)
    return row


def breakdown(wmodel, batch: int, prompt_len: int, steps: int, seed: int = 0) -> dict:
    """Per-op time of a full decode step of ``batch`` requests through ``LLMEngine`` (the serving
    path: scheduler, model, sampling), after ``prompt_len``-token prompts; ``wmodel`` from
    ``labelled_model``. ``steps`` steps timed, then ``steps`` profiled with ``torch.profiler``.

    Per step: ms of every labelled op (the ``Ops`` table, ``lm_head``), and the rest ("other"):
    torch ops run outside the table (e.g. sampling, the compressors' state updates) and Python.
    The decode rows run through the decode step (``StaticDecoder.run``), whose attention, indexer
    and compressors call the table's ops, so they are counted op by op.
    """
    from engine.ops import OP_NAMES

    eng = _engine_ready(wmodel, batch, prompt_len, 2 * steps + 4, seed)
    eng.step()                                                 # warm-up decode step
    eng.stats.history.clear()
    for _ in range(steps):
        eng.step()
    plain = [h[2] + h[3] for h in _full_steps(eng, batch)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function(STEP):
                eng.step()
    full = len(_full_steps(eng, batch)) - len(plain)
    at = attribute(prof.events(), set(OP_NAMES) | {HEAD})
    n, total_us = max(at["steps"], 1), at["total_us"]
    total_ms = total_us / n / 1e3
    ops = {k: {"ms": round(v[0] / n / 1e3, 4), "share": round(v[0] / total_us, 4), "calls_per_step": v[1] / n}
           for k, v in sorted(at["per"].items(), key=lambda kv: -kv[1][0])}
    other = total_ms - sum(o["ms"] for o in ops.values())
    untabled = at["untabled_us"] / n / 1e3
    return {"batch": batch, "context": prompt_len + steps + 1, "steps": steps, "full_decode_steps_profiled": full,
            "step_ms": _ms(statistics.median(plain)) if plain else None,
            "profiled_step_ms": round(total_ms, 3), "ops": ops, "other_ms": round(other, 3),
            "other_share": round(other / total_ms, 4) if total_ms else 0.0,
            "other_torch_ms": round(untabled, 3), "other_python_ms": round(other - untabled, 3)}


def hf_reference(ckpt: str, length: int, steps: int, chunk: int, args, hw: dict, timeout: int) -> dict:
    """Batch-1 decode ms/token of HF transformers and of ours (``bench.bench_model.run_one``, fp32)."""
    from bench.bench_model import run_one

    res = {impl: run_one(impl, "decode", ckpt, length, steps, chunk, 20.0, timeout) for impl in ("ours", "hf")}
    lim = R.limit(R.decode_cost(args, 1, length + steps // 2, torch.float32), hw, torch.float32)
    out = {"length": length, "steps": steps, "ours": res["ours"], "hf": res["hf"], "limit_ms": _ms(lim["limit_s"]),
           "bound": lim["bound"]}
    if "error" not in res["ours"] and "error" not in res["hf"]:
        out["speedup_vs_hf"] = round(res["hf"]["decode_ms"] / res["ours"]["decode_ms"], 2)
    return out
