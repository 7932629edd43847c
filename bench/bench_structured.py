"""Structured outputs: what constrained decoding costs a worker.

    python -m bench.bench_structured [--ckpt DIR] [--config YAML] [--batch 32] [--constrained 0,8,32]
                                     [--steps 16] [--schemas 20] [--json OUT]

1. Grammar compile per schema (``engine.core.grammar.GrammarBackend``, DeepSeek-V4's 129,280-token
   vocab): the random schemas of ``bench.structured_schemas`` and a two-tool DSML call as the
   gateway writes them (``server.gateway.structured``), cold (first compile) and cached (the same
   text again), plus the one-time tokenizer load.
2. Decode step at ``--batch`` rows with 0 / 8 / 32 of them constrained (a 200-integer JSON array:
   no row ends during the measurement), the others free (``ignore_eos``): ms per step, its
   sampling part (bitmask fill + copy + apply, draw, one copy to the host), and the grammar's own
   two parts timed alone on the same rows: the host fill and the apply on ``[batch, V]`` logits.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from bench.structured_schemas import schemas

ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200, "maxItems": 200}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "required": ["query"], "properties": {
                 "query": {"type": "string"}, "top_k": {"type": "integer"}, "lang": {"enum": ["en", "zh"]}}}}}]


def _json_tag(schema: dict) -> str:
    from server.gateway.structured import _json, _tag
    return _tag(_json(schema), False, {})


def _tool_tag(ckpt: str) -> str:
    from server.gateway.dsformat import DeepSeekFormat
    from server.gateway.structured import structural_tag
    fmt = DeepSeekFormat(ckpt, "m", default_thinking=False)
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": TOOLS, "tool_choice": "required"}
    return structural_tag("chat", fmt.convert("chat", body)[0], body, False, fmt.marker_ids)[0]


def compile_times(ckpt: str, n: int) -> dict:
    """ms per compile, cold and cached, over ``n`` random schemas and the DSML tool call."""
    from engine.core.grammar import GrammarBackend
    g = GrammarBackend(ckpt, 129280, (1,))
    t = time.perf_counter()
    g.compile(_json_tag({"type": "object"}))
    load_ms = (time.perf_counter() - t) * 1e3
    tags = [_json_tag(s) for s in schemas(n, seed=1)] + [_tool_tag(ckpt)]
    rows = []
    for tag in tags:
        t0 = time.perf_counter()
        g.compile(tag)
        t1 = time.perf_counter()
        g.compile(tag)
        rows.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    cold, cached = [r[0] for r in rows[:-1]], [r[1] for r in rows[:-1]]
    return {"first_load_ms": round(load_ms, 1), "schemas": n, "cold_ms_median": round(statistics.median(cold), 2),
            "cold_ms_max": round(max(cold), 2), "cached_ms_median": round(statistics.median(cached), 3),
            "tool_call_cold_ms": round(rows[-1][0], 2), "tool_call_cached_ms": round(rows[-1][1], 3),
            "compiles": g.compiled}


def _mask_ms(seqs: list, vocab: int, repeat: int = 10) -> tuple[float, float]:
    """The grammar's own part of a step: host bitmask fill (+ copy) and the apply on the logits."""
    import torch

    from engine.core.grammar import apply_token_bitmask, token_bitmask
    t = time.perf_counter()
    for _ in range(repeat):
        mask = token_bitmask(seqs, len(seqs), vocab, torch.device("cpu"))
    fill = (time.perf_counter() - t) / repeat * 1e3
    if mask is None:
        return 0.0, 0.0
    logits = torch.randn(len(seqs), vocab)
    t = time.perf_counter()
    for _ in range(repeat):
        apply_token_bitmask(logits, mask)
    return round(fill, 3), round((time.perf_counter() - t) / repeat * 1e3, 3)


def step_times(ckpt: str, config: str, batch: int, constrained: list[int], steps: int) -> list[dict]:
    """ms per decode step (and its sampling part) at ``batch`` rows, ``k`` of them constrained."""
    from engine.build import build_engine
    from engine.core.sampling_params import SamplingParams
    from engine.run_config import RunConfig
    run = yaml.safe_load(Path(config).read_text())
    run["scheduler_config"]["batch_size"] = batch
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "run.yaml").write_text(yaml.safe_dump(run))
        eng = build_engine(RunConfig.from_yaml(Path(d) / "run.yaml"), ckpt, progress=False)
    tag, prompt = _json_tag(ARRAY), [0, 128803, 3476, 477, 260, 128804, 128822]
    out = []
    for k in constrained:
        for i in range(batch):
            eng.add_request(f"r{k}-{i}", prompt, SamplingParams(
                max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True, structured=tag if i < k else None))
        while eng.scheduler.waiting or not all(s.output_ids for s in eng.seqs.values()):
            eng.step()                      # prefill until every row decodes
        eng.step()
        s0, t0 = eng.stats.sample_s, time.perf_counter()
        for _ in range(steps):
            eng.step()
        ms = (time.perf_counter() - t0) / steps * 1e3
        fill_ms, apply_ms = _mask_ms(list(eng.seqs.values()), eng.model.args.vocab_size)
        out.append({"batch": batch, "constrained": k, "step_ms": round(ms, 2),
                    "sample_ms": round((eng.stats.sample_s - s0) / steps * 1e3, 2),
                    "fill_ms": fill_ms, "apply_ms": apply_ms})
        for rid in list(eng.seqs):
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
    base = out[0]["step_ms"] if out and out[0]["constrained"] == 0 else None
    for r in out:
        r["vs_unconstrained"] = round(r["step_ms"] / base, 3) if base else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_structured", description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default="models/tiny-flash", help="checkpoint dir (tokenizer + weights)")
    ap.add_argument("--config", default="configs/tiny-flash.yaml", help="run config (batch_size is overridden)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--constrained", default="0,8,32", help="comma-separated constrained rows per step")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per row count")
    ap.add_argument("--schemas", type=int, default=20, help="random schemas compiled")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    try:
        ks = [int(x) for x in a.constrained.split(",")]
        if a.batch < 1 or a.steps < 1 or a.schemas < 1 or not ks or min(ks) < 0 or max(ks) > a.batch:
            raise ValueError
    except ValueError:
        ap.error(f"--batch / --steps / --schemas >= 1 and --constrained {a.constrained!r} in [0, batch]")
    if not (Path(a.ckpt) / "tokenizer.json").is_file():
        ap.error(f"--ckpt {a.ckpt}: no tokenizer.json (dsv4-make-tiny --preset flash --out {a.ckpt})")
    comp = compile_times(a.ckpt, a.schemas)
    print(f"grammar compile ({comp['schemas']} random schemas; tokenizer load once: {comp['first_load_ms']} ms)")
    print(f"  json schema   cold median {comp['cold_ms_median']} ms (max {comp['cold_ms_max']})   "
          f"cached {comp['cached_ms_median']} ms")
    print(f"  DSML tools    cold {comp['tool_call_cold_ms']} ms   cached {comp['tool_call_cached_ms']} ms")
    rows = step_times(a.ckpt, a.config, a.batch, ks, a.steps)
    print(f"\n{'batch':>5} {'constrained':>11} {'step ms':>9} {'vs 0':>6} {'sample ms':>10} {'fill ms':>8} "
          f"{'apply ms':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['constrained']:>11} {r['step_ms']:>9} "
              f"{r['vs_unconstrained'] if r['vs_unconstrained'] is not None else '-':>6} {r['sample_ms']:>10} "
              f"{r['fill_ms']:>8} {r['apply_ms']:>9}")
    if a.json:
        Path(a.json).write_text(json.dumps({"compile": comp, "steps": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
