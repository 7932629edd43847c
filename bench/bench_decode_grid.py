"""``python -m bench.bench_decode_grid``: the decode step by batch and context, eager vs captured,
beside the hardware limit (issue 25's benchmark grid).

    python -m bench.bench_decode_grid [--ckpt DIR] [--batch-sizes 1,8,32]
                                      [--contexts 1000,32000,128000] [--steps 4]
                                      [--threads N] [--max-model-len 1048576] [--no-compile]
                                      [--json]

For each (batch B, context C): B requests on a synthetic paged state (``engine_measure.
synthetic_paged``: the pools as after a C-token prefill, random values), then the step that
decodes one token for each, hidden states plus logits, two ways:

- **eager**: what an eager engine's decode step runs (``exe_mode: eager``): the model runner's
  ``decode`` rows through ``StaticDecoder.run`` uncompiled, with host positions (exact per row),
  on the CPU op table;
- **captured**: the graph-mode step (``DecodeRunner`` at batch bucket B and the context bucket of
  C + steps + 1 tokens; on CPU inductor's per-layer-kind graphs and the CPU kernels, ``exe_mode:
  npugraph_ex``), compiled before it is timed.

Median ms of ``--steps`` steps after one warm-up step, each step one position further. ``limit``
is max(bytes moved / read bandwidth, FLOPs / GEMM peak) of ``bench.roofline.decode_cost`` with the
machine probed for 2 s; ``bound`` says which term is larger. ``max |dlogit|`` is the largest
difference between the two ways' logits at the warm-up step (the same state and tokens bit for
bit). HF transformers has no paged batched decode: its single-sequence step is ``dsv4-bench engine``'s HF
column (docs/benchmarks.md).

Contexts default just under 1K / 32K / 128K so that C + steps + 1 tokens stay inside the bucket of
that size (a step's cost follows its context bucket, ``engine.core.graph_runner``; every graph
step of a cell runs at the bucket of its last one).
"""
from __future__ import annotations

import argparse
import gc
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
    """Median ms of ``steps`` calls of ``step(i)`` (i = 1 ..) after the warm-up ``step(0)``, and the
    warm-up's output (the one call whose inputs both ways share bit for bit: later steps read the
    rows each way wrote with its own numerics)."""
    first = step(0)
    times = []
    for i in range(1, steps + 1):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, first


def measure(eager_model, graph_model, B: int, C: int, steps: int, max_model_len: int, hw: dict,
            compiled: bool = True) -> dict:
    """One grid cell: ``eager_ms``, ``captured_ms``, ``limit_ms``, ``bound``, ``compile_s``,
    ``max_dlogit`` (largest |logit difference| at the shared first step, fp32). ``compiled``
    False: the graph step runs uncompiled (``DecodeRunner.use_eager``). Every graph step of the
    cell runs at the context bucket of its last step's ``C + steps + 1`` tokens, so no compile
    lands in a timed step."""
    from bench import roofline as R
    from bench.engine_measure import eager_decode, synthetic_paged
    from engine.core.graph_runner import DecodeRunner, ExecConfig
    from engine.platform import detect

    def fresh(model):
        """``synthetic_paged``: the accounting, its pools (``.paged``) and each request's holding."""
        cache = synthetic_paged(model, C, torch.Generator().manual_seed(C), headroom=steps + 2, requests=B)
        return cache, [cache.seqs[r] for r in range(B)]

    # step i feeds toks[i]: [steps + 1, B] token ids, the same both ways
    toks = torch.randint(2, eager_model.args.vocab_size, (steps + 1, B), generator=torch.Generator().manual_seed(B))

    def run_eager():
        """An eager engine's decode step (``ModelRunner.decode`` of B one-token rows)."""
        decode = eager_decode(eager_model, fresh(eager_model)[0], max_model_len)

        def eager(i: int) -> torch.Tensor:
            return eager_model.logits(decode(toks[i].tolist(), C + i))
        return _timed(eager, steps)

    def run_graph(timed: bool):
        """The compile of the cell's bucket (seconds), or the timed steps: each on a fresh copy of
        the same random state (the compile's step writes position C)."""
        cache, held = fresh(graph_model)
        runner = DecodeRunner(graph_model, cache.paged, max_model_len, B, detect("cpu"),
                              ExecConfig(exe_mode="npugraph_ex"))
        if not compiled:
            runner.use_eager()
        bucket = runner.context_bucket(C + steps + 1)

        def captured(i: int) -> torch.Tensor:
            rows = [([int(toks[i, r])], C + i, h.state_slot, h.tables) for r, h in enumerate(held)]
            return graph_model.logits(runner.step(rows, B, bucket)[:B])
        if timed:
            return _timed(captured, steps)
        t = time.perf_counter()
        captured(0)
        return time.perf_counter() - t

    # each run's pools are freed before the next is filled: a StaticDecoder refers to itself, so
    # only a collection frees them (2 GiB at batch 32 x 128K on tiny flash)
    e_ms, e_out = run_eager()
    gc.collect()
    compile_s = run_graph(timed=False)
    gc.collect()
    c_ms, c_out = run_graph(timed=True)
    gc.collect()
    cost = R.decode_cost(eager_model.args, B, C + steps // 2, eager_model.dtype)
    lim = R.limit(cost, hw, eager_model.dtype)
    return {"batch": B, "context": C, "eager_ms": round(e_ms, 2), "captured_ms": round(c_ms, 2),
            "limit_ms": round(lim["limit_s"] * 1e3, 2), "bound": lim["bound"],
            "compile_s": round(compile_s, 1), "max_dlogit": float((e_out - c_out).abs().max())}


def table(rows: list[dict], ckpt: str, hw: dict, compiled: bool = True) -> str:
    """``measure``'s rows as a markdown table under a line naming the checkpoint, threads and probe."""
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
    """The grid on ``--ckpt``: 0, or 2 on a bad flag / checkpoint (named on stderr)."""
    a = parse_args(argv)
    from bench import roofline as R
    from engine.checkpoint.loader import load_model
    from engine.checkpoint.shards import CheckpointError
    from engine.config import ConfigError
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
    except (CheckpointError, ConfigError) as e:
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
