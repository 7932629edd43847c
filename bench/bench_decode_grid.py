"""``python -m bench.bench_decode_grid``: the decode step by batch and context, eager vs captured,
beside the hardware limit (issue 25's benchmark grid).

    python -m bench.bench_decode_grid [--ckpt DIR] [--batch-sizes 1,8,32]
                                      [--contexts 1000,32000,128000] [--steps 4]
                                      [--threads N] [--max-model-len 1048576] [--json]

For each (batch B, context C): B requests on a synthetic paged state (``engine_measure.
synthetic_paged``: the pools as after a C-token prefill, random values), then the step that
decodes one token for each, hidden states plus logits, two ways:

- **eager**: ``Transformer.forward_batch`` with the reference ops (``exe_mode: eager``);
- **captured**: the graph-mode step (``DecodeRunner`` at batch bucket B and the context bucket of
  C + steps; on CPU inductor's per-layer-kind graphs and the CPU kernels, ``exe_mode:
  npugraph_ex``), compiled before it is timed.

Median ms of ``--steps`` steps after one warm-up step, each step one position further. ``limit``
is max(bytes moved / read bandwidth, FLOPs / GEMM peak) of ``bench.roofline.decode_cost`` with the
machine probed for 2 s; ``bound`` says which term is larger. ``max |dlogit|`` is the largest
difference between the two ways' logits at the first timed step (same state, same tokens). HF
transformers has no paged batched decode: its single-sequence step is ``dsv4-bench engine``'s HF
column (docs/benchmarks.md).

Contexts default just under 1K / 32K / 128K so that C + steps stays inside the bucket of that
size (a step's cost follows its context bucket, ``engine.core.model_runner``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _ints(text: str, flag: str, ap: argparse.ArgumentParser) -> list[int]:
    try:
        out = [int(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{flag}: comma-separated integers, got {text!r}")
    if not out or min(out) < 1:
        ap.error(f"{flag}: each must be >= 1, got {text!r}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_decode_grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=str(ROOT / "models" / "tiny-flash"))
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--contexts", default="1000,32000,128000")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--max-model-len", type=int, default=1 << 20)
    ap.add_argument("--no-compile", action="store_true",
                    help="run the graph step uncompiled (its shapes, no compile time: tests)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.batch_sizes = _ints(a.batch_sizes, "--batch-sizes", ap)
    a.contexts = _ints(a.contexts, "--contexts", ap)
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    if a.threads is not None and a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    if min(a.contexts) < 2 or max(a.contexts) + a.steps + 1 > a.max_model_len:
        ap.error(f"--contexts {a.contexts}: each must be >= 2 and leave --steps + 1 tokens under "
                 f"--max-model-len {a.max_model_len}")
    return a


def _timed(step, steps: int) -> tuple[float, torch.Tensor]:
    """Median ms of ``steps`` calls of ``step(i)`` after ``step(0)``; the first timed call's output."""
    step(0)
    times, first = [], None
    for i in range(1, steps + 1):
        t = time.perf_counter()
        out = step(i)
        times.append(time.perf_counter() - t)
        first = out if first is None else first
    return statistics.median(times) * 1e3, first


def measure(eager_model, graph_model, B: int, C: int, steps: int, max_model_len: int, hw: dict,
            compile: bool = True) -> dict:
    """One grid cell: ``eager_ms``, ``captured_ms``, ``limit_ms``, ``bound``, ``compile_s``,
    ``max_dlogit``. ``compile`` False: the graph step runs uncompiled (``DecodeRunner.use_eager``)."""
    from bench import roofline as R
    from bench.engine_measure import synthetic_paged
    from engine.core.model_runner import DecodeRunner, ExecConfig
    from engine.platform import detect

    def fresh(model):
        return synthetic_paged(model, C, torch.Generator().manual_seed(C), headroom=steps + 2, requests=B)

    toks = torch.randint(2, eager_model.args.vocab_size, (steps + 1, B), generator=torch.Generator().manual_seed(B))
    cache = fresh(eager_model)

    def eager(i: int) -> torch.Tensor:
        states = [cache.sequence_state(r, C + i) for r in range(B)]
        return eager_model.logits(eager_model.forward_batch(toks[i], states, [1] * B))

    e_ms, e_out = _timed(eager, steps)
    del cache
    def graph_runner(cache) -> DecodeRunner:
        runner = DecodeRunner(graph_model, cache, max_model_len, B, detect("cpu"), ExecConfig(exe_mode="npugraph_ex"))
        if not compile:
            runner.use_eager()
        return runner

    cache = fresh(graph_model)
    runner = graph_runner(cache)
    held = [cache.seqs[r] for r in range(B)]

    def captured(i: int) -> torch.Tensor:
        rows = [([int(toks[i, r])], C + i, h.state_slot, h.tables) for r, h in enumerate(held)]
        return graph_model.logits(runner.run(rows))

    t = time.perf_counter()
    captured(0)                                      # the compile of this bucket, not timed below
    compile_s = time.perf_counter() - t
    # the warm-up wrote position C: rewind by rebuilding the same random state
    del runner, cache
    cache = fresh(graph_model)
    runner = graph_runner(cache)
    held = [cache.seqs[r] for r in range(B)]
    c_ms, c_out = _timed(captured, steps)
    cost = R.decode_cost(eager_model.args, B, C + steps // 2, eager_model.dtype)
    lim = R.limit(cost, hw, eager_model.dtype)
    return {"batch": B, "context": C, "eager_ms": round(e_ms, 2), "captured_ms": round(c_ms, 2),
            "limit_ms": round(lim["limit_s"] * 1e3, 2), "bound": lim["bound"],
            "compile_s": round(compile_s, 1), "max_dlogit": float((e_out - c_out).abs().max())}


def table(rows: list[dict], ckpt: str, hw: dict, compiled: bool = True) -> str:
    lines = [f"decode step (hidden + logits{'' if compiled else '; graph step uncompiled'}), {Path(ckpt).name}, "
             f"{torch.get_num_threads()} threads; probe: "
             f"{hw['read_gbs']:.1f} GB/s read, {hw['gemm_gflops']['float32']:.0f} GFLOP/s fp32; median ms",
             "", "| batch | context | eager | captured | limit (bound) | eager / captured | captured / limit "
             "| max \\|dlogit\\| | compile s |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']:,} | {r['eager_ms']:.1f} | {r['captured_ms']:.1f} | "
                     f"{r['limit_ms']:.1f} ({r['bound']}) | {r['eager_ms'] / r['captured_ms']:.2f} | "
                     f"{r['captured_ms'] / r['limit_ms']:.1f} | {r['max_dlogit']:.1e} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    from bench import roofline as R
    from engine.checkpoint.loader import load_model
    from engine.checkpoint.shards import CheckpointError
    from engine.ops import ops_for
    from engine.ops.cpu import prepare

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if not Path(a.ckpt).is_dir():
        print(f"bench_decode_grid: error: --ckpt {a.ckpt!r} is not a checkpoint directory (scripts/quickstart.sh "
              f"writes models/tiny-flash)", file=sys.stderr)
        return 2
    try:
        eager_model = load_model(a.ckpt, progress=False, ops=ops_for("cpu"))
        graph_model = load_model(a.ckpt, progress=False, ops=ops_for("cpu", compiled=True))
    except CheckpointError as e:
        print(f"bench_decode_grid: error: --ckpt {a.ckpt!r}: {e}", file=sys.stderr)
        return 2
    prepare(graph_model)
    hw = R.probe_hardware(2.0)
    rows = []
    with torch.no_grad():
        for C in a.contexts:
            for B in a.batch_sizes:
                rows.append(measure(eager_model, graph_model, B, C, a.steps, a.max_model_len, hw, not a.no_compile))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"hardware": hw, "rows": rows}, indent=1) if a.json else table(rows, a.ckpt, hw, not a.no_compile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
