"""State-transfer benchmark: GB/s of one decode-state message over each transport vs a memcpy.

    .venv/bin/python bench/bench_transfer.py [--sizes tiny-4k,flash-8k,64M,256M] [--kinds zmq-tcp,zmq-ipc,dist]
                                             [--kv-cache-dtype bfloat16|int8|fp8|hif8] [--reps 5] [--json]

Messages (built with ``kvtransfer.wire.encode_state``, random bytes):
    tiny-4k    the tiny flash preset's decode state at L = 4096 (``engine.core.pd_state.expected_shapes``)
    flash-8k   a DeepSeek-V4-Flash-shaped state at L = 8192 (configs/models/deepseek-v4-flash: 43
               layers, 2 window-only, 21 CSA, 20 HCA, head_dim 512, index_head_dim 128), fp32
               compressor remainders (reference/dsv4-architecture.md section 4: ~59 MiB in bf16);
               any ``tiny-Nk`` / ``flash-Nk`` / ``pro-Nk`` gives that model's state at L = N * 1024
The KV and indexer caches of the two state messages are stored as ``--kv-cache-dtype`` says
(``engine.cache_dtype``; default bfloat16: nothing quantised; fp8 ships 640 B per KV row instead
of 1024, ``engine.ops.cache_codec``), so ``--kv-cache-dtype fp8 --kinds zmq-tcp`` times the
quantised state over zmq-tcp.
    NM         a synthetic N MiB message of 4 bf16 tensors
The receiver runs in this process, the sender in a subprocess (``--role sender``). One transfer
is timed on the sender from ``send`` until the receiver's ack comes back (``poll_replies``), so it
covers the whole delivery of the message to the decode side; a warm-up transfer per size is
verified with ``wire.decode_state`` (crc32) and not timed. Figures are medians over ``--reps``;
GB = 1e9 bytes. memcpy: ``torch.empty(n, uint8).copy_(src)`` of the same byte count in one
process on one thread (the ceiling for a copy on this machine). ``--json`` writes bench/out/transfer.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

import msgpack
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.cache_dtype import SETTINGS as CACHE_SETTINGS, CacheDtype  # noqa: E402
from engine.core.pd_state import expected_shapes  # noqa: E402
from engine.config import ModelArgs  # noqa: E402
from engine.checkpoint.make_tiny import PRESETS  # noqa: E402
from engine.ops.cache_codec import codecs_for  # noqa: E402
from kvtransfer import make_receiver, make_sender  # noqa: E402
from kvtransfer.wire import decode_state, encode_state, model_fingerprint  # noqa: E402

FP = model_fingerprint({"bench": "transfer"}, torch.bfloat16)
KIND_LABEL = {"zmq-tcp": "zmq-tcp", "zmq-ipc": "zmq-ipc", "dist": "dist (gloo)"}
MODELS = {m: ROOT / "configs" / "models" / f"deepseek-v4-{m}" for m in ("flash", "pro")}


def layout(cache: CacheDtype) -> dict:
    """The handshake layout both ends present (they must agree)."""
    return {"kv_dtype": "bfloat16", "cache_dtype": cache.describe(), "bench": True}


def state_shapes(args: ModelArgs, cache: CacheDtype, tokens: int, dtype: torch.dtype = torch.bfloat16
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of one request's P/D state after ``tokens`` tokens
    (``pd_state.expected_shapes``), the KV / indexer caches stored as ``cache``, compute ``dtype``."""
    kv, idx = codecs_for(cache, args.head_dim, args.qk_rope_head_dim, args.index_head_dim, dtype)
    layout = NS(args=args, geometry=NS(num_layers=args.num_hidden_layers), kv_codec=kv, idx_codec=idx)
    return expected_shapes(layout, tokens)


def state_bytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of the tensors ``shapes`` describes (what the wire format's frames carry)."""
    return sum(torch.Size(sh).numel() * torch.empty(0, dtype=d).element_size() for sh, d in shapes.values())


def shapes_for(size: str, cache: CacheDtype = CacheDtype()) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the message called ``size``, state caches stored as ``cache``.
    Raises ValueError for unknown names."""
    model, _, k = size.partition("-")
    if k.endswith("k") and k[:-1].isdigit() and model in ("tiny", "flash", "pro"):
        args = ModelArgs.from_dict(PRESETS["flash"]) if model == "tiny" else ModelArgs.from_json(MODELS[model])
        return state_shapes(args, cache, int(k[:-1]) * 1024)
    if size.endswith("M") and size[:-1].isdigit():
        n = int(size[:-1]) << 20
        return {f"t{i}": ((n // 8,), torch.bfloat16) for i in range(4)}
    raise ValueError(f"--sizes: unknown message {size!r} (tiny-Nk, flash-Nk, pro-Nk or NM such as 64M)")


def build(size: str, cache: CacheDtype = CacheDtype(), seed: int = 0) -> list:
    """The wire frames of message ``size`` filled with random bytes."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, dtype) in shapes_for(size, cache).items():
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        tensors[name] = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)
    return encode_state(size, FP, 1, 0, tensors)


def nbytes_of(frames) -> int:
    return sum(memoryview(f).nbytes for f in frames)


def sender(kind: str, dest: str, sizes: list[str], reps: int, cache: CacheDtype) -> None:
    """Subprocess side: per size one verified warm-up, then ``reps`` timed send -> ack round trips."""
    tx = make_sender(kind, FP, layout(cache), "bench-prefill")
    tx.connect(dest, timeout_s=30)
    out = []
    for size in sizes:
        frames = build(size, cache)
        times = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            tx.send(dest, frames)
            replies = []
            while not replies:
                replies = tx.poll_replies(timeout_s=60)
            if rep:
                times.append(time.perf_counter() - t0)
            assert replies[0][1].get("ok"), replies
        out.append({"size": size, "bytes": nbytes_of(frames), "times_s": times})
    tx.close()
    print(json.dumps({"kind": kind, "results": out}), flush=True)


def receive(kind: str, sizes: list[str], reps: int, setting: str) -> dict:
    rx = make_receiver(kind, "127.0.0.1", 0, FP, layout(CacheDtype(*CACHE_SETTINGS[setting])))
    cmd = [sys.executable, __file__, "--role", "sender", "--kind", kind, "--dest", rx.address,
           "--sizes", ",".join(sizes), "--reps", str(reps), "--kv-cache-dtype", setting]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen: dict[str, int] = {}
    try:
        while p.poll() is None:
            for peer, frames in rx.recv(timeout_s=0.2):
                tid = msgpack.unpackb(bytes(frames[0]))["transfer_id"]
                first = tid not in seen
                seen[tid] = seen.get(tid, 0) + 1
                if first:   # warm-up: verify every crc before acking (not timed by the sender)
                    decode_state(frames, FP)
                rx.reply(peer, {"op": "ack", "ok": True})
                del frames
        out, err = p.communicate()
    finally:
        if p.poll() is None:
            p.kill()
        rx.close()
    if p.returncode != 0:
        raise SystemExit(f"sender for {kind} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def memcpy(nbytes: int, reps: int) -> list[float]:
    """One-thread ``copy_`` (intra-op threads only add wake-up stalls on a shared small machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _memcpy(nbytes, max(reps, 10))
    finally:
        torch.set_num_threads(threads)


def _memcpy(nbytes: int, reps: int) -> list[float]:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny-4k,flash-8k,64M,256M", help="comma list (see the module doc)")
    ap.add_argument("--kinds", default="zmq-tcp,zmq-ipc,dist")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-cache-dtype", default="bfloat16", choices=sorted(CACHE_SETTINGS),
                    help="storage of the state messages' KV / indexer caches (default bfloat16)")
    ap.add_argument("--json", action="store_true", help="also write bench/out/transfer.json")
    ap.add_argument("--role", default="main", choices=["main", "sender"], help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--dest", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    cache = CacheDtype(*CACHE_SETTINGS[a.kv_cache_dtype])
    for s in sizes:
        shapes_for(s, cache)
    if a.role == "sender":
        return sender(a.kind, a.dest, sizes, a.reps, cache)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    res = {k: {r["size"]: r for r in receive(k, sizes, a.reps, a.kv_cache_dtype)["results"]} for k in kinds}
    table = []
    for s in sizes:
        n = next(iter(res.values()))[s]["bytes"] if res else state_bytes(shapes_for(s, cache))
        row = {"size": s, "bytes": n, "memcpy_s": statistics.median(memcpy(n, a.reps))}
        for k in kinds:
            row[f"{k}_s"] = statistics.median(res[k][s]["times_s"])
        table.append(row)

    def cell(n, t):
        return f"{n / t / 1e9:.2f} ({t * 1e3:.3g} ms)"
    head = ["message", "MiB", "memcpy (1 thread)"] + [KIND_LABEL.get(k, k) for k in kinds]
    print(f"\nGB/s, median of {a.reps} (median time per message); state caches {a.kv_cache_dtype} "
          f"(KV {cache.kv}, indexer {cache.indexer})\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] * len(head)) + "|")
    for r in table:
        cells = [r["size"], f"{r['bytes'] / 2**20:.1f}", cell(r["bytes"], r["memcpy_s"])]
        cells += [cell(r["bytes"], r[f"{k}_s"]) for k in kinds]
        print("| " + " | ".join(cells) + " |")
    if a.json:
        out = ROOT / "bench" / "out" / "transfer.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"reps": a.reps, "kv_cache_dtype": a.kv_cache_dtype, "rows": table,
                                   "gbps": {r["size"]: {k: r["bytes"] / r[f"{k}_s"] / 1e9
                                                        for k in ["memcpy"] + kinds} for r in table}}, indent=2))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
