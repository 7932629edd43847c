"""Engine benchmark: decode throughput vs batch size, and scheduler vs model time per step.

    .venv/bin/python bench/bench_engine.py [--ckpt DIR] [--batch-sizes 1,2,4,8,16,32,64]

For each batch size B: B requests with ``--prompt-len`` random tokens are prefilled, then decoded
for ``--decode-steps`` steps together (greedy, ignore_eos). Figures per B, side by side: decode
step time (ms), decode throughput (tokens/s), speed-up over B = 1, and the split of a decode step
into scheduling time and model (forward + logits + sampling) time. The HF reference decodes one
sequence at a time (``bench/bench_model.py`` measures it: ~38 ms/token on the tiny flash preset
on a 2-core CPU), so its batch-B throughput is at most B x its batch-1 figure over B streams run
one after another. Writes ``bench/out/engine.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.tiny import make_tiny  # noqa: E402
from engine.weights import load_model  # noqa: E402


def measure(model, batch: int, prompt_len: int, steps: int) -> dict:
    eng = LLMEngine.build(model, block_size=128, batch_size=batch, max_prefill_tokens=8192,
                          max_model_len=prompt_len + steps + 8, num_kv_blocks=max(4, batch * (prompt_len // 512 + 2)))
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{i}", torch.randint(2, model.args.vocab_size, (prompt_len,), generator=g).tolist(), params)
    while any(s.num_pending > 1 or not s.output_ids for s in eng.seqs.values()):
        eng.step()                                          # prefill (and first token) of everyone
    eng.stats.history.clear()
    while eng.has_unfinished():
        eng.step()
    dec = [h for h in eng.stats.history if h[0] == batch and h[1] == batch]   # full decode steps
    sched = statistics.median(h[2] for h in dec)
    model_s = statistics.median(h[3] for h in dec)
    step = sched + model_s
    return {"batch": batch, "decode_steps": len(dec), "step_ms": round(step * 1e3, 2),
            "tokens_per_s": round(batch / step, 1), "schedule_ms": round(sched * 1e3, 3),
            "model_ms": round(model_s * 1e3, 2), "schedule_share": round(sched / step, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=str(ROOT / "models" / "tiny-flash"))
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=16)
    a = ap.parse_args()
    if not (Path(a.ckpt) / "config.json").is_file():
        make_tiny("flash", 0, a.ckpt)
    torch.manual_seed(0)
    model = load_model(a.ckpt, progress=False)
    rows = [measure(model, int(b), a.prompt_len, a.decode_steps) for b in a.batch_sizes.split(",")]
    base = rows[0]["tokens_per_s"]
    print(f"tiny flash, fp32, prompt {a.prompt_len} tokens, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'step ms':>9} {'tok/s':>8} {'x b1':>6} {'sched ms':>9} {'model ms':>9} {'sched %':>8}")
    for r in rows:
        r["speedup_vs_b1"] = round(r["tokens_per_s"] / base, 2)
        print(f"{r['batch']:>5} {r['step_ms']:>9} {r['tokens_per_s']:>8} {r['speedup_vs_b1']:>6} "
              f"{r['schedule_ms']:>9} {r['model_ms']:>9} {100 * r['schedule_share']:>7.2f}%")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps({"prompt_len": a.prompt_len, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
