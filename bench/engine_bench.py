"""``dsv4-bench engine``: model step times beside the hardware limit (roofline, ``bench.roofline``).

    dsv4-bench engine [--ckpt DIR] [--dtype float32|bfloat16] [--threads N] [--quick] [--no-hf]
                      [--batch-sizes 1,2,4,8,16,32,64] [--prompt-len 512] [--decode-steps 16]
                      [--contexts 1024,8192,32768,131072] [--prefill-lens 1024,8192,32768]
                      [--prefill-chunk 8192] [--out bench/out/engine_bench.json] [--plot PATH.png]

Probes the machine (read bandwidth GB/s, GEMM GFLOP/s), then measures, each beside its limit
``max(bytes / bandwidth, flops / peak)`` from the analytic cost model, the ratio measured / limit
and which term binds:

* decode step vs batch, through the serving engine (``LLMEngine``: paged state, continuous
  batching): B requests of ``--prompt-len`` random tokens prefilled, then ``--decode-steps``
  full decode steps timed (median; scheduler + model, sampling included);
* decode step vs context at batch 1 on a synthetic paged state (``synthetic_paged``: the pools
  of one request filled with random unit-scale values for ``context`` tokens; prefilling 128K
  tokens on a CPU takes minutes), the engine's decode path: ``forward_batch`` + logits (median);
* prefill time vs prompt length: fresh state, chunks of ``--prefill-chunk`` tokens, then the
  logits of the last row; ``linearity`` = time / (time at the first length x length ratio);
* per-op breakdown of one engine decode step (batch 1 and the largest batch, after
  ``--prompt-len``-token prompts): every op of the ``engine.ops.Ops`` table under
  ``torch.profiler.record_function(name)``, the LM head (``model.logits``) as ``lm_head``; ms per
  step per op and "other (python / glue)" = step - ops, split into torch ops run outside the table
  (sampling, batching glue) and Python; the batched decode attention is ``decode_rows``;
* unless ``--no-hf``: HF transformers' batch-1 decode ms/token beside ours and the limit
  (``bench.bench_model.run_one``, separate processes, fp32).

Times are seconds (s) or milliseconds (ms) of wall time; bandwidth GB/s = 1e9 B/s. Writes every
row, the hardware probe and the breakdown as JSON (``--out``), and with ``--plot`` a PNG of step
time vs batch and vs context with the limit lines.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import roofline as R

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CKPT = ROOT / "models" / "tiny-flash"
DEFAULT_OUT = ROOT / "bench" / "out" / "engine_bench.json"
STEP = "decode_step"           # profiler label of one whole step
HEAD = "lm_head"               # profiler label of model.logits
OTHER = "other (python / glue)"

FULL = dict(batch_sizes=[1, 2, 4, 8, 16, 32, 64], contexts=[1024, 8192, 32768, 131072],
            prefill_lens=[1024, 8192, 32768], prompt_len=512, decode_steps=16, profile_steps=5,
            probe_seconds=2.0, probe_mib=512, hf_length=1024)
QUICK = dict(batch_sizes=[1, 2], contexts=[256, 512], prefill_lens=[128, 256], prompt_len=64, decode_steps=3,
             profile_steps=2, probe_seconds=0.5, probe_mib=128, hf_length=256)


# ---- state -------------------------------------------------------------------------------------
def synthetic_paged(model, context: int, generator: torch.Generator, headroom: int = 64):
    """A ``PagedCache`` holding one request (id 0) as after prefilling ``context`` tokens, random
    values: every pool filled with unit-scale normals (the entries, ring and compressor rows a
    real prefill writes are all in there; the rest is never read). Room for ``headroom`` more."""
    from engine.cache import CacheConfig, Geometry, PagedCache
    from engine.config import CSA_RATIO

    g = Geometry.of(model.args, 128)
    n = context + headroom
    cache = PagedCache(model.args, CacheConfig(128, 1, {p: max(1, g.blocks_needed(p, n)) for p in ("c4", "c128")}),
                       model.dtype, model.embed.weight.device)
    held = cache.allocate(0, n)
    pools = [*cache.win, *cache.cmp_kv.values(), *cache.idx_kv.values(),
             *(t for pair in [*cache.comp.values(), *cache.idx_comp.values()] for t in pair)]
    for t in pools:
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    if context < CSA_RATIO:                         # no CSA window closed yet: overlap weights still 0
        cache._reset_state(held.state_slot)
    return cache


# ---- ops labelled for the profiler ---------------------------------------------------------------
def _label(name: str, fn):
    """``fn`` inside ``record_function(name)`` while a profiler runs (otherwise one flag check).
    ``functools.wraps`` keeps ``__wrapped__``, so code that unwraps an op to recognise the
    reference (``Transformer``'s batched decode) sees the op it wraps and takes the same path."""
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
    from engine.llm_engine import LLMEngine
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
    """Batch 1 on ``synthetic_paged(context)`` (the serving engine's paged path): median of
    ``steps`` timed ``logits(forward_batch(token))``."""
    g = torch.Generator().manual_seed(seed)
    cache = synthetic_paged(model, context, g, headroom=steps + 16)
    tok = torch.randint(2, model.args.vocab_size, (1,), generator=g)
    times = []
    for i in range(steps + 1):                                 # first step: warm-up
        t0 = time.perf_counter()
        h = model.forward_batch(tok, [cache.sequence_state(0, context + i)], [1])
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
    torch ops run outside the table (e.g. sampling) and Python. The batched decode attention of
    paged requests (window, compressors, indexer, sparse attention) is labelled ``decode_rows``.
    """
    from engine.model.batched_decode import PROFILE_LABEL as DECODE_ROWS
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
    at = attribute(prof.events(), set(OP_NAMES) | {HEAD, DECODE_ROWS})
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


# ---- output ------------------------------------------------------------------------------------
def _table(title: str, cols: list[tuple[str, str, str]], rows: list[dict]) -> None:
    """Print rows; cols = (header, key, format spec)."""
    print(f"\n{title}")
    widths = [max(len(h), 9) for h, _, _ in cols]
    print("  ".join(f"{h:>{w}}" for (h, _, _), w in zip(cols, widths)))
    for r in rows:
        cells = []
        for (h, k, spec), w in zip(cols, widths):
            v = r.get(k, "-")
            cells.append(f"{format(v, spec) if not isinstance(v, str) else v:>{w}}")
        print("  ".join(cells))


def plot(path: Path, res: dict) -> str:
    """Step time vs batch and vs context, measured and limit (log-log). Returns a message."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot: matplotlib is not installed; no plot written (pip install matplotlib)"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, x, xlabel in ((axes[0], "decode_batch", "batch", "batch size"),
                               (axes[1], "decode_context", "context", "context (tokens), batch 1")):
        rows = res.get(key) or []
        if not rows:
            ax.set_visible(False)
            continue
        xs = [r[x] for r in rows]
        ax.plot(xs, [r["step_ms"] for r in rows], "o-", label="measured step")
        ax.plot(xs, [r["limit_ms"] for r in rows], "k--", label="limit max(bytes/BW, flops/peak)")
        ax.plot(xs, [r["memory_ms"] for r in rows], ":", label="bytes / bandwidth")
        ax.plot(xs, [r["compute_ms"] for r in rows], ":", label="flops / peak")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("decode step (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    hw = res["hardware"]
    fig.suptitle(f"DeepSeek-V4 {res['config']['ckpt_name']}, {res['config']['dtype']}: read {hw['read_gbs']:.1f} GB/s, "
                 f"GEMM {hw['gemm_gflops']['float32']:.0f} (fp32) / {hw['gemm_gflops']['bfloat16']:.0f} (bf16) "
                 f"GFLOP/s, {hw['threads']} threads", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# ---- CLI ---------------------------------------------------------------------------------------
def _sizes(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return vals


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsv4-bench engine", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=str(DEFAULT_CKPT),
                   help="checkpoint dir (default models/tiny-flash, written with make_tiny('flash', 0) if missing)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--threads", type=_positive, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sweeps for tests: batch 1,2; contexts 256,512; prefill 128,256; prompt 64; 3 steps")
    p.add_argument("--batch-sizes", type=_sizes, help="decode vs batch (default 1,2,4,8,16,32,64)")
    p.add_argument("--prompt-len", type=_positive, help="prompt tokens per request in the batch sweep and the "
                   "context of the breakdown (default 512)")
    p.add_argument("--decode-steps", type=_positive, help="timed decode steps per row (default 16)")
    p.add_argument("--contexts", type=_sizes, help="decode vs context, batch 1 (default 1024,8192,32768,131072)")
    p.add_argument("--prefill-lens", type=_sizes, help="prefill vs length (default 1024,8192,32768)")
    p.add_argument("--prefill-chunk", type=_positive, default=8192, help="tokens per prefill forward (8192)")
    p.add_argument("--profile-steps", type=_positive, help="profiled decode steps per breakdown (default 5)")
    p.add_argument("--probe-seconds", type=_positive_float, help="hardware probe budget (default 2)")
    p.add_argument("--probe-mib", type=_positive, help="bandwidth probe buffer, MiB (default 512)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers reference")
    p.add_argument("--hf-length", type=_positive, help="prompt tokens before the HF / ours decode (default 1024)")
    p.add_argument("--hf-timeout", type=_positive, default=1200, help="seconds per HF / ours subprocess")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output (default bench/out/engine_bench.json)")
    p.add_argument("--plot", help="PNG: step time vs batch and vs context with the limit lines")
    a = p.parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    from engine.checkpoint.loader import load_model
    from engine.checkpoint.make_tiny import make_tiny

    if a.threads:
        torch.set_num_threads(a.threads)
        os.environ["OMP_NUM_THREADS"] = str(a.threads)         # the HF / ours subprocesses too
    ckpt = Path(a.ckpt)
    if not (ckpt / "config.json").is_file():
        if ckpt != DEFAULT_CKPT:                               # a typo must not become a random model
            print(f"dsv4-bench engine: error: argument --ckpt: {ckpt} holds no config.json", file=sys.stderr)
            return 2
        print(f"writing the tiny flash checkpoint to {ckpt}", flush=True)
        make_tiny("flash", 0, ckpt)
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(a.seed)
    model = load_model(ckpt, dtype=dtype, progress=False)
    args = model.args
    clock = time.perf_counter()
    took: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        took[name] = round(now - clock, 2)
        clock = now

    hw = R.probe_hardware(a.probe_seconds, a.probe_mib)
    lap("probe")
    wb = R.weight_bytes(args, dtype)
    res = {"config": {"ckpt": str(ckpt), "ckpt_name": ckpt.name, "dtype": a.dtype, "threads": torch.get_num_threads(),
                      "batch_sizes": a.batch_sizes, "prompt_len": a.prompt_len, "decode_steps": a.decode_steps,
                      "contexts": a.contexts, "prefill_lens": a.prefill_lens, "prefill_chunk": a.prefill_chunk,
                      "quick": a.quick},
           "hardware": hw,
           "model": {"weight_bytes": wb, "weight_bytes_no_mtp": R.weight_bytes(args, dtype, mtp=False),
                     "param_bytes_loaded": sum(p.numel() * p.element_size() for p in model.parameters()),
                     "layers": args.num_hidden_layers, "compress_ratios": list(args.compress_ratios)}}
    print(f"{ckpt.name}, {a.dtype}, {hw['threads']} threads | read {hw['read_gbs']:.1f} GB/s ({hw['read_method']}), "
          f"copy {hw['copy_gbs']:.1f} GB/s, GEMM {hw['gemm_gflops']['float32']:.0f} GFLOP/s fp32, "
          f"{hw['gemm_gflops']['bfloat16']:.0f} bf16 | weights {wb / 1e6:.1f} MB (incl. MTP)", flush=True)

    rows = [decode_vs_batch(model, b, a.prompt_len, a.decode_steps, hw, dtype, a.seed) for b in a.batch_sizes]
    base = next((r for r in rows if r["batch"] == 1), rows[0])
    for r in rows:
        r["speedup_vs_first"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
    res["decode_batch"] = rows
    lap("decode_batch")
    _table(f"decode step vs batch (engine, prompt {a.prompt_len}, {a.decode_steps} steps)",
           [("batch", "batch", "d"), ("step ms", "step_ms", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
            ("x b1" if base["batch"] == 1 else f"x b{base['batch']}", "speedup_vs_first", ".2f"), ("sched ms", "schedule_ms", ".3f"), ("limit ms", "limit_ms", ".2f"),
            ("bound", "bound", ""), ("meas/limit", "ratio", ".1f")], rows)

    rows = [decode_vs_context(model, c, a.decode_steps, hw, dtype, a.seed) for c in a.contexts]
    for r in rows:
        r["vs_first"] = round(r["step_ms"] / rows[0]["step_ms"], 2)
    res["decode_context"] = rows
    lap("decode_context")
    _table(f"decode step vs context (batch 1, synthetic state, {a.decode_steps} steps)",
           [("context", "context", "d"), ("step ms", "step_ms", ".2f"), ("x first", "vs_first", ".2f"),
            ("limit ms", "limit_ms", ".2f"), ("bound", "bound", ""), ("meas/limit", "ratio", ".1f")], rows)

    rows = [prefill(model, L, a.prefill_chunk, hw, dtype, a.seed) for L in a.prefill_lens]
    for r in rows:
        r["linearity"] = round(r["seconds"] / (rows[0]["seconds"] * r["length"] / rows[0]["length"]), 2)
    res["prefill"] = rows
    lap("prefill")
    _table(f"prefill vs length (chunks of {a.prefill_chunk}; linearity 1.0 = linear in length)",
           [("tokens", "length", "d"), ("seconds", "seconds", ".3f"), ("tok/s", "tokens_per_s", ".0f"),
            ("linearity", "linearity", ".2f"), ("limit s", "limit_s", ".4f"), ("bound", "bound", ""),
            ("meas/limit", "ratio", ".1f"), ("idx flops", "indexer_flops_share", ".0%")], rows)

    wmodel = labelled_model(ckpt, dtype)
    bds = [breakdown(wmodel, b, a.prompt_len, a.profile_steps, a.seed) for b in sorted({1, max(a.batch_sizes)})]
    del wmodel
    res["breakdown"] = bds
    lap("breakdown")
    names = list(dict.fromkeys(k for bd in bds for k in bd["ops"]))
    print(f"\nper-op time of one decode step (engine, after {a.prompt_len}-token prompts; torch.profiler over "
          f"{a.profile_steps} steps; other = torch ops outside the ops table + Python)")
    print(f"{'op':>22}" + "".join(f"  {'b' + str(bd['batch']) + ' ms':>10} {'share':>6}" for bd in bds))
    for k in names + [OTHER]:
        cells = []
        for bd in bds:
            o = bd["ops"].get(k) if k != OTHER else {"ms": bd["other_ms"], "share": bd["other_share"]}
            cells.append(f"  {o['ms']:>10.3f} {o['share']:>6.1%}" if o else f"  {'-':>10} {'-':>6}")
        print(f"{k:>22}" + "".join(cells))
    for label, key in (("  torch ops, untabled", "other_torch_ms"), ("  python", "other_python_ms")):
        print(f"{label:>22}" + "".join(f"  {bd[key]:>10.3f} {bd[key] / bd['profiled_step_ms']:>6.1%}" for bd in bds))
    print(f"{'profiled step':>22}" + "".join(f"  {bd['profiled_step_ms']:>10.3f} {'':>6}" for bd in bds))
    print(f"{'unprofiled step':>22}" + "".join(f"  {bd['step_ms']:>10.3f} {'':>6}" for bd in bds))

    if not a.no_hf:
        h = hf_reference(str(ckpt), a.hf_length, a.decode_steps, a.prefill_chunk, args, hw, a.hf_timeout)
        res["hf"] = h
        lap("hf")

        def ms(r):
            return f"{r['decode_ms']:.2f}" if "error" not in r else r["error"][:20]
        print(f"\ndecode batch 1 after {a.hf_length} tokens (fp32, separate processes, {a.decode_steps} steps, "
              f"mean; ours = the model's own single-sequence path, no engine or paging)")
        print(f"{'':>10} {'ms/token':>10} {'x limit':>8}")
        for name, r in (("ours", h["ours"]), ("HF", h["hf"])):
            x = f"{r['decode_ms'] / h['limit_ms']:.1f}" if "error" not in r else "-"
            print(f"{name:>10} {ms(r):>10} {x:>8}")
        print(f"{'limit':>10} {h['limit_ms']:>10.2f} {'1.0':>8}   ({h['bound']} bound)")
        if "speedup_vs_hf" in h:
            print(f"speed-up ours vs HF: {h['speedup_vs_hf']:.2f}x")

    res["section_seconds"] = took
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out}")
    if a.plot:
        print(plot(Path(a.plot), res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
