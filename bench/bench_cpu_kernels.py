"""``python -m bench.bench_cpu_kernels``: graph mode's CPU kernels (``engine.ops.cpu``) against the
reference ops and the memory limit, per op and for the whole decode step.

    python -m bench.bench_cpu_kernels [--ckpt DIR] [--batch-sizes 1,8] [--prompt-len 512]
                                      [--steps 24] [--threads 2] [--no-step] [--json]

* **ops**: the LM head (the checkpoint's own bf16 head) at 1 / 8 / 64 rows, and an FP8
  block-scaled linear at Flash's ``wq_b`` / ``wo_b`` shapes (32768 x 1024, 4096 x 8192) at 1 / 2 /
  4 rows, and the routed experts (MXFP4, 6 slots a row) at ``MOE_SHAPES``: the reference op
  (eager), the reference compiled (how the graph step ran these before the kernels: a dequantised
  fp32 tile, then BLAS; for the experts ``moe_experts_gathered``; the head always ran eager: "-"),
  the kernel; beside the limit = stored bytes / the probed read bandwidth. Median ms.
* **step**: the engine's decode step (``build_engine`` on the checkpoint's ``configs/tiny-flash.yaml``
  run config, ``--prompt-len`` random prompts, greedy) in ``eager``, in graph mode with every
  kernel pinned to the reference (``kernel_config: native``) and in graph mode with the kernels;
  median ms over ``--steps`` steps, the greedy tokens compared with eager's and the largest
  |logprob| difference of the sampled tokens. Each graph engine compiles its step first (about
  2 minutes on 2 cores when inductor's cache is cold).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import yaml

from bench import roofline as R

ROOT = Path(__file__).resolve().parents[1]
FP8_SHAPES = [(32768, 1024), (4096, 8192)]          # Flash wq_b, wo_b (reference §2.2)
# routed experts (E, I, H, batch sizes): the bundled tiny model's widths with 64 experts (the
# vLLM-CPU comparison checkpoint of issue 25), and one Flash expert shape (§2.2) at batch 1
MOE_SHAPES = [(64, 128, 256, (1, 8)), (8, 2048, 4096, (1,))]


def _ms(fn, *args, reps: int = 20) -> float:
    fn(*args)
    fn(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def ops_rows(ckpt: Path, hw: dict, fp8_shapes=FP8_SHAPES, moe_shapes=MOE_SHAPES) -> list[dict]:
    """The ops table's rows: ``{op, rows, reference, compiled_reference, kernel, limit}`` in ms."""
    from safetensors import safe_open

    from engine.checkpoint.fp8_mxfp4 import quant_fp8_block
    from engine.ops import cpu, reference
    from engine.ops.packed import Packed

    gbs = hw["read_gbs"] * 1e9
    head = None
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            if "head.weight" in st.keys():
                head = st.get_tensor("head.weight")
    if head is None:
        raise SystemExit(f"--ckpt: no head.weight in {ckpt} (scripts/quickstart.sh writes models/tiny-flash)")
    rows = []
    kernel = cpu.CompiledHead()
    for M in (1, 8, 64):
        x = torch.randn(M, head.shape[1])
        rows.append(dict(op=f"lm_head {list(head.shape)} bf16", rows=M, reference=_ms(reference.lm_head, x, head),
                         compiled_reference=None, kernel=_ms(kernel, x, head), limit=1e3 * head.numel() * 2 / gbs))
    step_ref = torch.compile(reference.quant_linear, dynamic=False)
    step_fused = torch.compile(cpu.quant_linear, dynamic=False)
    for N, K in fp8_shapes:
        q, s = quant_fp8_block(torch.randn(N, K) * 0.05, (128, 128))
        w = Packed(q, s.view(torch.uint8), "fp8")
        for M in (1, 2, 4):
            x = torch.randn(M, K)
            rows.append(dict(op=f"fp8 linear [{N}, {K}]", rows=M, reference=_ms(reference.quant_linear, x, w, None),
                             compiled_reference=_ms(step_ref, x, w, None), kernel=_ms(step_fused, x, w, None),
                             limit=1e3 * (q.numel() + s.numel()) / gbs))
    rows += moe_rows(gbs, moe_shapes)
    return rows


def moe_rows(gbs: float, shapes=MOE_SHAPES, k: int = 6) -> list[dict]:
    """Routed experts (MXFP4, k slots per row) in the compiled step: the graph step's reference
    (``moe_experts_gathered``: each gathered expert dequantised to fp32, then a batched GEMV) and
    the fused kernel (``cpu.moe_experts``), compiled alike; the eager reference op beside them."""
    from engine.checkpoint.fp8_mxfp4 import quant_mxfp4
    from engine.ops.reference.moe import moe_experts_gathered
    from engine.ops import cpu, reference
    from engine.ops.packed import Packed

    def stack(E, N, K):
        qs = [quant_mxfp4(torch.randn(N, K) * 0.05) for _ in range(E)]
        return Packed(torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs]).view(torch.uint8), "fp4")

    rows = []
    for E, I, H, batches in shapes:
        w = (stack(E, I, H), stack(E, I, H), stack(E, H, I))
        gathered = torch.compile(moe_experts_gathered, dynamic=False)
        fused = torch.compile(cpu.moe_experts, dynamic=False)
        for B in batches:
            x, ids, wt = torch.randn(B, H), torch.randint(0, E, (B, k)), torch.rand(B, k)
            reps = 20 if I * H <= 1 << 20 else 3
            used = B * k                     # gathered experts: repeats are read again
            stored = used * sum(p.data[0].numel() + p.scale[0].numel() for p in w)
            rows.append(dict(op=f"moe experts fp4 E={E} [{I}, {H}] k={k}", rows=B,
                             reference=_ms(reference.moe_experts, x, ids, wt, *w, 10.0, reps=reps),
                             compiled_reference=_ms(gathered, x, ids, wt, *w, 10.0, reps=reps),
                             kernel=_ms(fused, x, ids, wt, *w, 10.0, reps=reps), limit=1e3 * stored / gbs))
    return rows


def _engine(ckpt: Path, batch: int, exe_mode: str, kernel_config: dict | None):
    from engine.build import build_engine
    from engine.run_config import RunConfig
    raw = yaml.safe_load((ROOT / "configs/tiny-flash.yaml").read_text())
    raw["model_config"]["exe_mode"] = exe_mode
    if kernel_config:
        raw["model_config"].setdefault("custom_params", {})["kernel_config"] = kernel_config
    raw["scheduler_config"]["batch_size"] = batch
    return build_engine(RunConfig.from_dict(raw), ckpt, progress=False)


def step_row(ckpt: Path, batch: int, prompt_len: int, steps: int) -> dict:
    from engine.core.sampling_params import SamplingParams
    native = {"lm_head": "native", "quant_linear": "native", "moe_experts": "native"}
    modes = {"eager": ("eager", None), "graph, reference ops": ("npugraph_ex", native),
             "graph, CPU kernels": ("npugraph_ex", None)}
    out, got = {"batch": batch}, {}
    for name, (mode, kc) in modes.items():
        eng = _engine(ckpt, batch, mode, kc)
        rng = random.Random(0)
        V = eng.model.args.vocab_size
        params = SamplingParams(max_new_tokens=steps + 4, temperature=0, ignore_eos=True, logprobs=0)
        for i in range(batch):
            eng.add_request(str(i), [rng.randrange(V) for _ in range(prompt_len)], params)
        times, seqs = [], {str(i): [] for i in range(batch)}
        while eng.has_unfinished():
            t = time.perf_counter()
            outs = eng.step()
            times.append(time.perf_counter() - t)
            for o in outs:
                seqs[o.request_id] += [(s.token_id, s.logprob) for s in o.new_logprobs]
        out[name] = 1e3 * statistics.median(times[3:])
        got[name] = seqs
        if name != "eager":
            pairs = [(a, b) for rid in seqs for a, b in zip(seqs[rid], got["eager"][rid])]
            out[f"{name}: tokens equal eager"] = all(a[0] == b[0] for a, b in pairs) and \
                all(len(seqs[r]) == len(got["eager"][r]) for r in seqs)
            out[f"{name}: max |dlogprob|"] = max(abs(a[1] - b[1]) for a, b in pairs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_cpu_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=str(ROOT / "models" / "tiny-flash"))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-step", action="store_true", help="the ops table only")
    ap.add_argument("--no-ops", action="store_true", help="the step table only")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    hw = R.probe_hardware(seconds=1.0, buffer_mib=256)
    ckpt = Path(a.ckpt)
    result = {"threads": a.threads, "read_gbs": hw["read_gbs"], "ops": [] if a.no_ops else ops_rows(ckpt, hw),
              "steps": []}
    print(f"{a.threads} threads, read {hw['read_gbs']:.1f} GB/s; median ms")
    print(f"{'op':>28} {'rows':>5} {'reference':>10} {'ref compiled':>13} {'kernel':>8} {'limit':>7}")
    for r in result["ops"]:
        compiled = "-" if r["compiled_reference"] is None else f"{r['compiled_reference']:.2f}"
        print(f"{r['op']:>28} {r['rows']:>5} {r['reference']:>10.2f} {compiled:>13} {r['kernel']:>8.2f} {r['limit']:>7.2f}")
    if not a.no_step:
        for B in (int(b) for b in a.batch_sizes.split(",")):
            result["steps"].append(step_row(ckpt, B, a.prompt_len, a.steps))
            print(json.dumps(result["steps"][-1]), flush=True)
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
