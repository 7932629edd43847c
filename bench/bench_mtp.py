"""MTP speculative decoding side by side: next_n 0 / 1 / 3, batch 1 and 32, on an agreeing and a random model.

    .venv/bin/python -m bench.bench_mtp [--quick] [--random DIR] [--agree DIR] [--json] [--out FILE]

Models: the tiny Flash checkpoint (``dsv4-make-tiny --preset flash --seed 1``, random weights: its
MTP drafts are almost never accepted) and the same with ``--mtp-agree`` (an MTP layer drafting
what the trunk predicts next: most drafts accepted). Missing ones are written under
``bench/out/mtp`` (about 10 s each). Each cell runs ``batch`` greedy requests (random prompts of
``--prompt-len`` tokens, ``--new-tokens`` outputs, ignore_eos) through one engine
(``engine.core.llm_engine``, fp32, CPU or whatever device the model loads on), after a one-request
warm-up, prefilling all prompts in the first step. Columns:

* decode steps: engine steps that ran decode rows (target forwards of the batch);
* fwd / token: target forwards per decoded token, per request (its decode rows over its tokens
  after the first; 1.0 at next_n 0, ``1 / (1 + accepted per forward)`` with drafts);
* tok/s: decoded tokens of all requests over the decode steps' wall time (the prefill step,
  which also drafts the first drafts, is TTFT, not counted);
* ITL ms: per request (last token time - first token time) / (tokens - 1), mean over requests
  (tokens of one verify step arrive together, as a client sees them);
* acceptance rate, mean acceptance length (``engine.core.spec_decode.SpecStats``: accepted /
  proposed drafts; 1 + accepted per verify step), beside upstream's published DeepSeek-V4 MTP
  acceptance (reference/upstream-parallel-and-mtp.md: MTP1 accepts 0.7 of 1, MTP3 1.44 of 3);
* same tokens: the outputs equal next_n 0's token for token (exact acceptance).

``--quick`` (tests): batch 2, 4-token prompts, 5 new tokens, no warm-up. The full run takes
about 2 minutes on 2 idle CPU cores (its timings mean nothing on a shared, busy machine). Writes ``--out`` (default ``bench/out/mtp.json``).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.checkpoint.loader import load_model  # noqa: E402
from engine.checkpoint.make_tiny import make_tiny  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402

# reference/upstream-parallel-and-mtp.md: accepted drafts per verify step -> (rate, mean length)
UPSTREAM = {1: (0.7 / 1, 1.7), 3: (1.44 / 3, 2.44)}
BLOCK = 16
QUICK_BATCHES = (2,)             # --quick: one batched cell per (model, next_n) keeps the test's CPU time small


def checkpoint(path: str | None, agree: bool, work: Path) -> Path:
    """The given checkpoint, or the tiny flash seed-1 one (``--mtp-agree`` if ``agree``) under ``work``."""
    if path:
        return Path(path)
    out = work / ("tiny-flash-1-agree" if agree else "tiny-flash-1")
    if not (out / "config.json").is_file():
        make_tiny("flash", 1, out, mtp_agree=agree)
    return out


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 60000) for _ in range(length)] for _ in range(batch)]


def run_cell(model, batch: int, next_n: int, prompt_len: int, new: int, warmup: bool) -> dict:
    """One engine, ``batch`` greedy requests; the figures of one table row (module docstring) and the
    output ids (``outputs``). Seconds are wall time; ITL in ms."""
    blocks = batch * (-(-(prompt_len + new + next_n) // BLOCK) + 2) + 8
    eng = LLMEngine.build(model, block_size=BLOCK, batch_size=batch, max_prefill_tokens=batch * prompt_len,
                          max_model_len=prompt_len + new + 8, num_kv_blocks=blocks, num_reserved_decode_tokens=0,
                          next_n=next_n)
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    if warmup:
        eng.generate(prompts(1, prompt_len, seed=99), SamplingParams(max_new_tokens=3, temperature=0.0,
                                                                     ignore_eos=True))
    st0 = _counts(eng)                     # the warm-up's drafts are not this cell's
    ids = [f"r{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts(batch, prompt_len)):
        eng.add_request(rid, p, params)
    seqs = [eng.seqs[r] for r in ids]
    decode_steps = forwards = 0
    decode_s = 0.0
    while eng.has_unfinished():
        before = {s.seq_id: len(s.output_ids) for s in seqs}
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        rows = sum(1 for o in outs if o.new_token_ids and before[o.request_id] >= 1)
        if rows:                 # this step decoded (all prompts prefill in the first step)
            decode_steps += 1
            forwards += rows
            decode_s += dt
    decoded = sum(len(s.output_ids) - 1 for s in seqs)
    itl = [(s.token_times[-1] - s.token_times[0]) / (len(s.output_ids) - 1) for s in seqs if len(s.output_ids) > 1]
    drafts, proposed, accepted, per_pos = (b - a if isinstance(b, int) else [y - x for x, y in zip(a, b)]
                                           for a, b in zip(st0, _counts(eng)))
    on = eng.spec is not None
    row = {"batch": batch, "next_n": next_n, "decode_steps": decode_steps, "forwards": forwards,
           "decoded_tokens": decoded, "fwd_per_token": forwards / decoded, "decode_s": decode_s,
           "tok_s": decoded / decode_s if decode_s else None, "itl_ms": 1e3 * sum(itl) / len(itl),
           "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
           "num_accepted_tokens_per_pos": per_pos,
           "acceptance_rate": (accepted / proposed if proposed else 0.0) if on else None,
           "mean_acceptance_length": (1 + accepted / drafts if drafts else 1.0) if on else None,
           "outputs": [s.output_ids for s in seqs]}
    assert eng.num_free_blocks() == eng.num_total_blocks(), "state blocks leaked"
    return row


def _counts(eng) -> tuple[int, int, int, list[int]]:
    """The engine's cumulative (drafts, draft tokens, accepted, accepted per position); zeros at next_n 0."""
    st = eng.spec.stats if eng.spec is not None else None
    if st is None:
        return 0, 0, 0, []
    return st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.num_accepted_tokens_per_pos)


def measure(ckpts: dict[str, Path], batches: list[int], next_ns: list[int], prompt_len: int, new: int,
            warmup: bool) -> list[dict]:
    """Every (model, batch, next_n) row, next_n 0 first within a (model, batch) so each row can say
    whether its tokens equal next_n 0's."""
    rows = []
    for name, path in ckpts.items():
        model = load_model(path, dtype=torch.float32, mtp=True, progress=False)
        for b in batches:
            base = None
            for n in next_ns:
                r = {"model": name, **run_cell(model, b, n, prompt_len, new, warmup)}
                base = r["outputs"] if n == 0 else base
                r["same_tokens"] = None if base is None else r["outputs"] == base
                rows.append(r)
                print(f"{name} batch {b} next_n {n}: {r['decode_steps']} decode steps, "
                      f"{r['tok_s']:.1f} tok/s", file=sys.stderr)
        del model
        gc.collect()
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict]) -> list[str]:
    """The markdown table ``main`` prints, one line per row after the two header lines."""
    out = ["| model | batch | next_n | decode steps | fwd / token | tok/s | ITL ms | acceptance rate | "
           "mean acc. length | accepted per pos | upstream rate / length | same tokens |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        up = UPSTREAM.get(r["next_n"])
        out.append(f"| {r['model']} | {r['batch']} | {r['next_n']} | {r['decode_steps']} | "
                   f"{r['fwd_per_token']:.3f} | {_f(r['tok_s'], '.1f')} | {r['itl_ms']:.1f} | "
                   f"{_f(r['acceptance_rate'], '.3f')} | {_f(r['mean_acceptance_length'], '.2f')} | "
                   f"{'/'.join(map(str, r['num_accepted_tokens_per_pos'])) or '-'} | "
                   f"{f'{up[0]:.2f} / {up[1]:.2f}' if up else '-'} | "
                   f"{'-' if r['same_tokens'] is None else ('yes' if r['same_tokens'] else 'NO')} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_mtp", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 2, 4-token prompts, 5 new tokens, no warm-up (tests)")
    p.add_argument("--random", help="random tiny checkpoint (default: written under bench/out/mtp)")
    p.add_argument("--agree", help="--mtp-agree tiny checkpoint (default: written under bench/out/mtp)")
    p.add_argument("--batches", help="comma-separated batch sizes (default 1,32; --quick 2)")
    p.add_argument("--next-n", default="0,1,3", help="comma-separated next_n values (0 first; default 0,1,3)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default 16; --quick 4)")
    p.add_argument("--new-tokens", type=int, help="output tokens per request (default 32; --quick 5)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "mtp.json"), help="JSON file to write")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    a = p.parse_args(argv)
    batches = [int(x) for x in (a.batches or (",".join(map(str, QUICK_BATCHES)) if a.quick else "1,32")).split(",")]
    next_ns = [int(x) for x in a.next_n.split(",")]
    prompt_len = a.prompt_len or (4 if a.quick else 16)
    new = a.new_tokens or (5 if a.quick else 32)
    if min(batches) < 1 or min(next_ns) < 0 or prompt_len < 1 or new < 2:
        p.error("batches >= 1, next_n >= 0, --prompt-len >= 1 and --new-tokens >= 2")
    work = ROOT / "bench" / "out" / "mtp"
    ckpts = {"agree": checkpoint(a.agree, True, work), "random": checkpoint(a.random, False, work)}
    rows = measure(ckpts, batches, next_ns, prompt_len, new, warmup=not a.quick)
    doc = {"prompt_len": prompt_len, "new_tokens": new, "upstream": {str(k): v for k, v in UPSTREAM.items()},
           "rows": rows}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1) if a.json else "\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
