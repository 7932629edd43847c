"""The output of ``dsv4-bench engine`` (``bench.engine_bench``): one printed table per section (decode vs
batch, vs context, prefill, the per-op breakdown, the HF reference) and the optional PNG of step time
vs batch and vs context beside the limit lines.
"""
from __future__ import annotations

from pathlib import Path

OTHER = "other (python / glue)"


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


def batch_table(rows: list[dict], prompt_len: int, steps: int) -> None:
    base = next((r for r in rows if r["batch"] == 1), rows[0])
    _table(f"decode step vs batch (engine, prompt {prompt_len}, {steps} steps)",
           [("batch", "batch", "d"), ("step ms", "step_ms", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
            ("x b1" if base["batch"] == 1 else f"x b{base['batch']}", "speedup_vs_first", ".2f"),
            ("sched ms", "schedule_ms", ".3f"), ("limit ms", "limit_ms", ".2f"), ("bound", "bound", ""),
            ("meas/limit", "ratio", ".1f")], rows)


def context_table(rows: list[dict], steps: int) -> None:
    _table(f"decode step vs context (batch 1, synthetic state, {steps} steps)",
           [("context", "context", "d"), ("step ms", "step_ms", ".2f"), ("x first", "vs_first", ".2f"),
            ("limit ms", "limit_ms", ".2f"), ("bound", "bound", ""), ("meas/limit", "ratio", ".1f")], rows)


def prefill_table(rows: list[dict], chunk: int) -> None:
    _table(f"prefill vs length (chunks of {chunk}; linearity 1.0 = linear in length)",
           [("tokens", "length", "d"), ("seconds", "seconds", ".3f"), ("tok/s", "tokens_per_s", ".0f"),
            ("linearity", "linearity", ".2f"), ("limit s", "limit_s", ".4f"), ("bound", "bound", ""),
            ("meas/limit", "ratio", ".1f"), ("idx flops", "indexer_flops_share", ".0%")], rows)


def breakdown_table(bds: list[dict], prompt_len: int, profile_steps: int) -> None:
    """Ops (rows) by breakdown (columns: ms and share of the step), then other split, then the step."""
    names = list(dict.fromkeys(k for bd in bds for k in bd["ops"]))
    print(f"\nper-op time of one decode step (engine, after {prompt_len}-token prompts; torch.profiler over "
          f"{profile_steps} steps; other = torch ops outside the ops table + Python)")
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


def hf_table(h: dict, hf_length: int, steps: int) -> None:
    def ms(r):
        return f"{r['decode_ms']:.2f}" if "error" not in r else r["error"][:20]
    print(f"\ndecode batch 1 after {hf_length} tokens (fp32, separate processes, {steps} steps, "
          f"mean; ours = the model's own single-sequence path, no engine or paging)")
    print(f"{'':>10} {'ms/token':>10} {'x limit':>8}")
    for name, r in (("ours", h["ours"]), ("HF", h["hf"])):
        x = f"{r['decode_ms'] / h['limit_ms']:.1f}" if "error" not in r else "-"
        print(f"{name:>10} {ms(r):>10} {x:>8}")
    print(f"{'limit':>10} {h['limit_ms']:>10.2f} {'1.0':>8}   ({h['bound']} bound)")
    if "speedup_vs_hf" in h:
        print(f"speed-up ours vs HF: {h['speedup_vs_hf']:.2f}x")


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
