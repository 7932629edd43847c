"""Device check (issue 6): the tiny model eager vs graph-mode decode, multi-streams off vs on.

Prints, per mode and batch size, the median decode step time and the largest logprob difference
from eager (top-20 logprobs of every sampled position), and whether the greedy tokens are equal.
Run by ``deploy/device-check``; on a CUDA machine it finishes in a few minutes.

    python deploy/device_check.py [--device auto|cuda:0|npu:0|cpu] [--dtype float32|bfloat16]
                                  [--modes eager,static,graph,graph+streams] [--steps 64] [--next-n 0]
                                  [--preset flash|flash-real-width|...] [--reference-ops] [--no-fp8]

On CUDA it then times the FP8 block-scaled GEMM (``engine.ops.cuda``) against the reference op at
real Flash linear shapes.

Modes: ``eager`` (the model runner's eager decode step, exact per row), ``static`` (the fixed-shape step run eagerly: the
graph mode's math), ``graph`` (CUDA graphs / npugraph_ex / torch.compile on CPU), and
``graph+streams`` (graph with enable_multi_streams). ``--next-n`` > 0 runs every mode with MTP
(the graph modes verify the spans of ``1 + next_n`` tokens in the graph step; a step time is then
that of one verify step, drafts included).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.ops import ops_for  # noqa: E402
from engine.platform import detect  # noqa: E402
from engine.core.graph_runner import ExecConfig  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.checkpoint.make_tiny import make_tiny  # noqa: E402
from engine.checkpoint.loader import load_model  # noqa: E402

MAX_LEN = 2048


def run_mode(model, plat, mode: str, batch: int, prompts, steps: int, next_n: int = 0):
    graph = None if mode == "eager" else ExecConfig(exe_mode="npugraph_ex", multi_streams=mode.endswith("+streams"))
    eng = LLMEngine.build(model, block_size=64, batch_size=batch, max_prefill_tokens=4096, max_model_len=MAX_LEN,
                          num_kv_blocks=64 * batch, num_reserved_decode_tokens=0, next_n=next_n, platform=plat,
                          graph=graph)
    warm = 0.0
    if graph is not None:
        if mode == "static":
            eng.runner.graph.use_eager()
        t = time.perf_counter()
        eng.runner.warmup()
        warm = time.perf_counter() - t
    params = SamplingParams(max_new_tokens=steps, temperature=0, ignore_eos=True, logprobs=20)
    for i, p in enumerate(prompts[:batch]):
        eng.add_request(f"r{i}", p, params)
    outs: dict[str, list] = {f"r{i}": [] for i in range(batch)}
    step_s = []
    while eng.has_unfinished():
        decode = all(s.num_pending <= 1 + next_n and s.num_computed > 0 for s in eng.scheduler.running) and \
            eng.scheduler.running
        plat.synchronize()
        t = time.perf_counter()
        got = eng.step()
        plat.synchronize()
        if decode and not eng.scheduler.waiting:
            step_s.append(time.perf_counter() - t)
        for o in got:
            outs[o.request_id] += list(zip(o.new_token_ids, o.new_logprobs))
    assert eng.num_free_blocks() == eng.num_total_blocks(), "state leaked"
    short = {rid: len(seq) for rid, seq in outs.items() if len(seq) < steps}
    if short:
        raise RuntimeError(f"requests ended early (tokens per request: {short}); see the log above")
    return outs, statistics.median(step_s[2:] or step_s), warm


def compare(ref, got) -> tuple[float, bool]:
    worst, same = 0.0, True
    for rid, seq in ref.items():
        other = got[rid]
        same &= [t for t, _ in seq] == [t for t, _ in other]
        for (_, a), (_, b) in zip(seq, other):
            da = dict(a.top_logprobs)
            worst = max([worst] + [abs(da[t] - v) for t, v in b.top_logprobs if t in da])
    return worst, same


# real Flash linear shapes (N, K): wq_a, wq_b, wo_b, shared w1 (reference §2.2)
FP8_SHAPES = ((1024, 4096), (32768, 1024), (4096, 8192), (2048, 4096))


def fp8_gemm_check(plat, rows=(1, 16, 256)) -> bool:
    """The FP8 block-scaled GEMM (``engine.ops.cuda``) against the reference op at real shapes:
    median ms of each and the largest relative difference (activation quantisation: ~1e-2)."""
    from engine.checkpoint.fp8_mxfp4 import quant_fp8_block
    from engine.ops import reference
    from engine.ops.cuda import fp8_why, quant_linear
    from engine.ops.packed import Packed
    print(f"{'fp8 GEMM N x K':<18}{'rows':>6}{'kernel ms':>11}{'reference ms':>14}{'max rel diff':>14}  path")
    ok = True
    for n, k in FP8_SHAPES:
        q, s = quant_fp8_block(torch.randn(n, k) * 0.02, (128, 128))
        w = Packed(q.to(plat.device), s.to(plat.device), "fp8")
        for m in rows:
            x = torch.randn(m, k, device=plat.device, dtype=torch.bfloat16)
            times = {}
            for name, fn in (("kernel", quant_linear), ("reference", reference.quant_linear)):
                fn(x, w, None)
                plat.synchronize()
                ts = []
                for _ in range(5):
                    t = time.perf_counter()
                    y = fn(x, w, None)
                    plat.synchronize()
                    ts.append(time.perf_counter() - t)
                times[name] = (statistics.median(ts), y.float())
            rel = ((times["kernel"][1] - times["reference"][1]).abs().max() / times["reference"][1].abs().max()).item()
            ok &= rel < 0.05
            print(f"{f'{n} x {k}':<18}{m:>6}{times['kernel'][0] * 1e3:>11.3f}{times['reference'][0] * 1e3:>14.3f}"
                  f"{rel:>14.2e}  {fp8_why(x, w, None) or 'scaled_mm'}", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--modes", default="eager,static,graph,graph+streams")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--next-n", type=int, default=0, help="MTP drafts per step (0 .. 3)")
    ap.add_argument("--preset", default="flash", help="dsv4-make-tiny preset of the random checkpoint "
                    "(flash-real-width: every width of the real Flash, 2 layers)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 GEMM table on CUDA")
    ap.add_argument("--reference-ops", action="store_true", help="the reference ops only (no device kernels)")
    a = ap.parse_args(argv)
    plat = detect(a.device)
    plat.activate()
    modes = a.modes.split(",")
    print(f"device-check: {plat.kind} {plat.device} ({torch.cuda.get_device_name(plat.device) if plat.kind == 'cuda' else ''}) "
          f"torch {torch.__version__}, preset {a.preset}, dtype {a.dtype}, modes {modes}, next_n {a.next_n}, "
          f"ops {'reference' if a.reference_ops else plat.kind}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        ckpt = make_tiny(a.preset, 0, Path(d) / "tiny")
        ops = ops_for("cpu" if a.reference_ops else plat.kind)
        model = load_model(ckpt, dtype=getattr(torch, a.dtype), device=plat.device, ops=ops, progress=False,
                           mtp=a.next_n > 0)
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in a.batches.split(",")]
    prompts = [torch.randint(2, model.args.vocab_size, (a.prompt_len + 37 * i,), generator=g).tolist()
               for i in range(max(batches))]
    print(f"{'mode':<15}{'batch':>6}{'decode step ms':>16}{'warm-up s':>11}{'max |dlogprob|':>16}  tokens = eager")
    ok = True
    for batch in batches:
        ref, ref_failed = None, False        # the first mode is the reference
        for mode in modes:
            model.configure(None, plat, mode.endswith("+streams"))
            try:
                outs, step, warm = run_mode(model, plat, mode, batch, prompts, a.steps, a.next_n)
            except Exception as e:      # report and go on: one run should show every failing mode
                ok = False
                print(f"{mode:<15}{batch:>6}  FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                ref_failed |= ref is None
                continue
            if ref is None and not ref_failed:
                ref = outs
            if ref_failed:              # nothing to compare with
                print(f"{mode:<15}{batch:>6}{step * 1e3:>16.2f}{warm:>11.1f}{'n/a':>16}  n/a", flush=True)
                continue
            worst, same = compare(ref, outs)
            ok &= same
            print(f"{mode:<15}{batch:>6}{step * 1e3:>16.2f}{warm:>11.1f}{worst:>16.2e}  {same}", flush=True)
    model.configure(None)
    if plat.kind == "cuda" and not a.no_fp8:
        try:
            ok &= fp8_gemm_check(plat)
        except Exception as e:
            ok = False
            print(f"fp8 GEMM FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
    print("device-check:", "OK" if ok else "MISMATCH (greedy tokens differ from eager, or the FP8 GEMM is off)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
