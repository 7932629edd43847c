"""Multi-rank figures on this machine (gloo): context-parallel prefill and attention-DP decode at
world 1, 2 (and 4), the cores split evenly over the ranks.

    .venv/bin/python -m bench.bench_parallel [--ckpt DIR] [--prompt 4096] [--batch 8] [--context 1024]

Prefill: one prompt, world 1 ``Transformer.forward`` vs world N ``cp_prefill`` (CP N + EP N +
LM-head TP N). Decode: ``batch`` single-token rows at ``context`` tokens of history, world 1 one
``forward_batch`` vs world N attention DP (each rank batch/N rows, EP N + LM-head TP N), logits
included. Load: seconds, the parameter MiB a rank holds and its peak RSS after loading (torch
included); world N shards before reading, so a rank keeps only its experts and LM-head slice.
Medians of ``--repeat`` runs. On a CPU the ranks share the socket's memory bandwidth: the figures
show the collectives' cost and the split's balance, not an accelerator's scaling.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _nothing():
    return contextlib.nullcontext()


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
    from engine.checkpoint.loader import load_model
    from engine.parallel.cp import cp_prefill
    from engine.parallel.shard import apply_parallel
    from engine.run_config import ParallelConfig
    pc = ParallelConfig(world_size=world, cp_size=world, lmhead_tp_size=world)
    t = time.perf_counter()                           # sharded before loading: each rank reads its shard
    model = load_model(args.ckpt, dtype=torch.float32, device="cpu", progress=False,
                       shard=(lambda m: apply_parallel(m, pc, rank)) if world > 1 else None)
    load_s = time.perf_counter() - t
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # KiB -> MiB (Linux)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 60000, (args.prompt,), generator=g)
    pre = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        if world == 1:
            model.logits(model.forward(prompt, model.new_state())[-1:])
        else:
            model.logits(cp_prefill(model, prompt, gather_hidden=False)[0])
        pre.append(time.perf_counter() - t)
    states = []
    for i in range(rank, args.batch, world):          # each rank its own rows (attention DP)
        st = model.new_state()
        with model.parallel.rows("dp") if world > 1 else _nothing():
            model.forward(torch.randint(1000, 60000, (args.context,), generator=torch.Generator().manual_seed(i)), st)
        states.append(st)
    dec = []
    for _ in range(args.repeat):
        toks = torch.full((len(states),), 7, dtype=torch.long)
        t = time.perf_counter()
        if world == 1:
            h = model.forward_batch(toks, states, [1] * len(states))
        else:
            with model.parallel.rows("dp"):
                h = model.forward_batch(toks, states, [1] * len(states))
                model.logits(h)
        if world == 1:
            model.logits(h)
        dec.append(time.perf_counter() - t)
    if rank == 0:
        Path(out).write_text(json.dumps({"load_s": load_s, "params_mib": held / 2 ** 20, "load_peak_mib": peak,
                                         "prefill_s": statistics.median(pre),
                                         "decode_ms": 1000 * statistics.median(dec)}))
    if world > 1:                 # a gloo group left to interpreter exit can abort the process
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_parallel", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="checkpoint (default: a tiny flash one written to a temp dir)")
    p.add_argument("--worlds", default="1,2", help="world sizes to run, comma-separated")
    p.add_argument("--prompt", type=int, default=4096, help="prefill prompt tokens")
    p.add_argument("--batch", type=int, default=8, help="decode rows (a multiple of every world size)")
    p.add_argument("--context", type=int, default=1024, help="decode history tokens per row")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    if any(w < 1 or args.batch % w for w in worlds):
        p.error(f"--worlds {args.worlds}: each must be >= 1 and divide --batch {args.batch}")
    if args.ckpt is None:
        from engine.checkpoint.make_tiny import make_tiny
        args.ckpt = str(make_tiny("flash", 1, tempfile.mkdtemp(prefix="dsv4-bench-")))
    from server.launch.local import free_port
    rows = []
    for w in worlds:
        out = tempfile.mktemp(suffix=".json")
        mp.spawn(_worker, (w, free_port(), args, out), nprocs=w, join=True)
        rows.append((w, json.loads(Path(out).read_text())))
    base = rows[0][1]
    print(f"{'world':>5} {'threads/rank':>12} {'load s':>7} {'params MiB/rank':>15} {'peak RSS MiB':>12} "
          f"{'prefill ' + str(args.prompt) + ' s':>14} {'x':>5} {'decode b' + str(args.batch) + ' ms':>14} {'x':>5}")
    for w, r in rows:
        print(f"{w:>5} {max(1, (os.cpu_count() or 1) // w):>12} {r['load_s']:>7.2f} {r['params_mib']:>15.1f} "
              f"{r['load_peak_mib']:>12.0f} {r['prefill_s']:>14.2f} {base['prefill_s'] / r['prefill_s']:>5.2f} "
              f"{r['decode_ms']:>14.1f} {base['decode_ms'] / r['decode_ms']:>5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
