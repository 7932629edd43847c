"""``dsv4-bench census``: what one decode step runs, op by op, and how often it waits for the host.

    dsv4-bench census --config configs/deepseek-v4-flash-a3-decode.yaml [--preset flash-real-width |
                      --ckpt DIR] [--platform npu-stub|cpu] [--batch 4] [--context 300] [--steps 2]
                      [--graph] [--json]

Loads the checkpoint with the run config's dtype, cache dtypes and ``kernel_config`` onto the
op table of ``--platform`` (``cpu``: the reference ops; ``npu-stub``: the Ascend wrappers of
``engine.ops.npu`` over ``bench.npu_stub``, a contract stub of torch_npu / cann-recipes-infer's
custom ops, so every wrapper's input checks run as on an A3 and each call's path is known).
Then ``--batch`` requests of ``--context`` random tokens are prefilled through the serving engine
(``LLMEngine``) and ``--steps`` full decode steps (scheduler + model + sampling; the decode rows
run through the eager decode step, ``StaticDecoder.run`` with host positions) are counted:

* per seam op (``engine.ops.Ops``): calls per decode step by path (kernel / reference /
  fallback with the wrapper's reason), ``bench.census_count.OpRecorder``;
* host syncs per decode step by kind and call site (``bench.census_count.SyncCounter``);
* with ``--graph``: the same for one call of the graph-mode step (``StaticDecoder``'s fixed-shape
  step, no host positions, called uncompiled),
  and its graph breaks under ``torch._dynamo.explain`` (those inside the contract stub's own
  Python are counted apart: on an NPU its kernels are graph-capturable ops).

``--preset`` writes that ``dsv4-make-tiny`` preset (seed 0) to a temporary directory first
(flash-real-width: 2.9 GB, about a minute on 2 cores), converted by ``dsv4-convert-model`` to
the config's ``model_config.quant_type`` when it names one. Prints a table; ``--json`` prints the
figures as JSON instead. Exit 2 on a bad flag or config.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch

from bench.census_count import OpRecorder, SyncCounter

PLATFORMS = ("npu-stub", "cpu")
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="dsv4-bench census", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="run config YAML (dtype, cache dtypes, kernel_config)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="checkpoint directory")
    src.add_argument("--preset", default="flash-real-width",
                     help="dsv4-make-tiny preset written to a temp dir (default flash-real-width: 2.9 GB)")
    ap.add_argument("--platform", choices=PLATFORMS, default="npu-stub",
                    help="npu-stub: the Ascend wrappers over bench.npu_stub; cpu: the reference ops (default npu-stub)")
    ap.add_argument("--batch", type=int, default=4, help="decode rows per step")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=2, help="decode steps counted")
    ap.add_argument("--graph", action="store_true", help="also count the graph-mode step and its graph breaks")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    for name in ("batch", "context", "steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    return a


def _engine(model, cfg, batch: int, context: int, steps: int):
    """An ``LLMEngine`` sized for ``batch`` requests of ``context + steps + batch + 4`` tokens
    (``census`` gives each ``steps + batch + 2`` new tokens at most)."""
    from engine.core.llm_engine import LLMEngine

    s, max_len = cfg.scheduler_config, context + steps + batch + 4
    blocks = batch * (-(-max_len // (s.block_size * 4)) + 1)
    return LLMEngine.build(model, block_size=s.block_size, batch_size=batch,
                           max_prefill_tokens=max(context, 256), max_model_len=max_len,
                           num_kv_blocks=max(4, blocks), cache_dtype=cfg.cache_dtype_for(model.args),
                           cpu_memory_bytes=64 << 30,       # pools sized by num_kv_blocks; no budget check
                           next_n=cfg.model_config.next_n)


def census(cfg, ckpt: Path, platform: str, batch: int, context: int, steps: int, graph: bool) -> dict:
    """Count ``steps`` decode steps (see the module docstring); returns the figures as a dict:
    ``ops`` (``OpRecorder.by_op`` per step), ``host_syncs_per_step``, ``sync_kinds`` /
    ``sync_sites`` per step, and with ``graph`` a ``graph_step`` dict of the same plus
    ``graph_breaks`` / ``break_reasons``."""
    from engine.build import DTYPES
    from engine.checkpoint.loader import load_model
    from engine.core.sampling_params import SamplingParams
    from engine.ops import ops_for, residual_dtype_for

    rec, syncs = OpRecorder(), SyncCounter()
    with ExitStack() as stack:
        if platform == "npu-stub":
            from bench import npu_stub
            from engine.ops.npu import runtime
            npu_stub.install()
            stack.callback(npu_stub.uninstall)
            runtime.FALLBACK_OBSERVERS.append(rec.on_fallback)
            stack.callback(runtime.FALLBACK_OBSERVERS.remove, rec.on_fallback)
        cp = cfg.model_config.custom_params
        kind = "npu" if platform == "npu-stub" else "cpu"
        ops = rec.table(ops_for(kind, cp.kernel_config))
        model = load_model(ckpt, dtype=DTYPES[cfg.model_config.dtype], ops=ops, progress=False,
                           mtp=cfg.model_config.next_n > 0, num_layers=cp.num_hidden_layers,
                           max_position_embeddings=cp.max_position_embeddings)
        model.configure(cp.moe_chunk_max_len,
                        residual_dtype=residual_dtype_for(kind, DTYPES[cfg.model_config.dtype]))
        eng = _engine(model, cfg, batch, context, steps)
        g = torch.Generator().manual_seed(0)
        # room past the counted steps: a request prefilled one step earlier must not finish inside them
        params = SamplingParams(max_new_tokens=steps + batch + 2, temperature=0, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"c{i}", torch.randint(2, model.args.vocab_size, (context,), generator=g).tolist(), params)
        while any(s.num_pending > 1 or not s.output_ids for s in eng.seqs.values()):
            eng.step()                                       # prefill, and each request's first token
        rec.active = True
        with syncs:
            for _ in range(steps):
                eng.step()
        rec.active = False
        out = _figures(rec, syncs, steps)
        out.update(platform=platform, dtype=cfg.model_config.dtype, batch=batch, context=context, steps=steps,
                   preset_layers=model.args.num_hidden_layers)
        if graph:
            out["graph_step"] = _graph_step(model, eng, rec, syncs)
    return out


def _figures(rec: OpRecorder, syncs: SyncCounter, per: int) -> dict:
    return {"ops": rec.by_op(per), "host_syncs_per_step": syncs.total() / per,
            "sync_kinds": {k: n / per for k, n in sorted(syncs.kinds.items())},
            "sync_sites": {f"{k} @ {s}": n / per for (k, s), n in sorted(syncs.sites.items(), key=lambda x: -x[1])}}


def _graph_step(model, eng, rec: OpRecorder, syncs: SyncCounter) -> dict:
    """One eager call of the graph-mode ``StaticDecoder`` step over the engine's padded batch
    (padding rows only: no request state is touched), counted; then its graph breaks."""
    from engine.core.graph_runner import DecodeRunner, ExecConfig
    from engine.platform import detect

    pools = eng.runner.pools                  # the tensors; ``eng.cache`` is the block accounting
    runner = DecodeRunner(model, pools, eng.limits.max_model_len, eng.limits.batch_size, detect("cpu"),
                          ExecConfig(exe_mode="npugraph_ex"), span=1 + pools.config.next_n)
    B = runner.buckets[-1]
    inputs = runner._inputs([], B, runner.contexts[-1])
    rec.reset()
    syncs.reset()
    rec.active = True
    with syncs:
        runner.static(*inputs)
    rec.active = False
    out = _figures(rec, syncs, 1)
    torch._dynamo.reset()
    # static shapes, as the step compiles: after a stub break dynamo compiles each layer's
    # ``layer_step`` as its own frame, and the layer kinds' pools differ in size
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        ex = torch._dynamo.explain(runner.static.__call__)(*inputs)
    # breaks inside the contract stub (its Python argument binding) are the stub's: on an NPU its
    # kernels are torch_npu / torch.ops.custom ops, which a graph captures
    reasons = [_break_reason(r) for r in ex.break_reasons]
    ours = [r for r in reasons if " @ bench/npu_stub" not in r]
    out["graph_breaks"], out["stub_graph_breaks"] = len(ours), len(reasons) - len(ours)
    out["break_reasons"] = sorted(set(ours))
    return out


def _break_reason(r) -> str:
    """A graph break as "reason @ path:line" (the innermost frame of this repository)."""
    frames = [f for f in getattr(r, "user_stack", []) or [] if f.filename.startswith(str(ROOT))]
    where = f" @ {Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno}" if frames else ""
    return str(r.reason).splitlines()[0][:160] + where


def table(fig: dict) -> str:
    """The figures as a fixed-width text table."""
    lines = [f"op census: platform {fig['platform']}, dtype {fig['dtype']}, batch {fig['batch']}, context "
             f"{fig['context']}, {fig['preset_layers']} layers; calls per decode step"]
    for title, f in (("eager step (scheduler, model, LM head, sampling)", fig),
                     ("graph step (StaticDecoder: the model only; multi-streams and core limits are no-ops on "
                      "the CPU platform, so not traced)", fig.get("graph_step"))):
        if f is None:
            continue
        lines += ["", f"{title}:", f"{'op':<20}{'kernel':>8}{'reference':>11}{'fallback':>10}  fallback reasons"]
        for op, row in f["ops"].items():
            fb = row["fallback"]
            lines.append(f"{op:<20}{row['kernel']:>8g}{row['reference']:>11g}{sum(fb.values()):>10g}  "
                         + "; ".join(f"{n:g}x {why}" for why, n in fb.items()))
        lines.append(f"host syncs per step: {f['host_syncs_per_step']:g}  "
                     + ", ".join(f"{k} {n:g}" for k, n in f["sync_kinds"].items()))
        lines += [f"  {n:>6g}  {site}" for site, n in list(f["sync_sites"].items())[:15]]
        if "graph_breaks" in f:
            lines.append(f"graph breaks: {f['graph_breaks']} (and {f['stub_graph_breaks']} inside the contract stub)"
                         + "".join(f"\n  {r}" for r in f["break_reasons"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from engine.checkpoint.shards import CheckpointError
    from engine.config import ConfigError
    from engine.run_config import RunConfig

    try:
        cfg = RunConfig.from_yaml(a.config)
    except ConfigError as e:
        print(f"dsv4-bench census: error: {e}", file=sys.stderr)
        return 2
    with ExitStack() as stack:
        ckpt = Path(a.ckpt) if a.ckpt else None
        if ckpt is None:
            from engine.checkpoint.make_tiny import PRESETS, make_tiny
            if a.preset not in PRESETS:
                print(f"dsv4-bench census: error: --preset {a.preset!r}: choose from {', '.join(PRESETS)}",
                      file=sys.stderr)
                return 2
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="census-")))
            ckpt = make_tiny(a.preset, 0, tmp / "original")
            if cfg.model_config.quant_type is not None:          # the weights the config serves
                from engine.checkpoint.convert_model import convert_model
                ckpt = convert_model(ckpt, tmp / cfg.model_config.quant_type, cfg.model_config.quant_type,
                                     progress=False)
        elif not ckpt.is_dir():
            print(f"dsv4-bench census: error: --ckpt {a.ckpt!r} is not a checkpoint directory", file=sys.stderr)
            return 2
        elif cfg.model_config.quant_type is not None:
            print(f"dsv4-bench census: note: --ckpt is counted as given; the config serves "
                  f"quant_type {cfg.model_config.quant_type} (--preset converts to it)", file=sys.stderr)
        try:
            fig = census(cfg, Path(ckpt), a.platform, a.batch, a.context, a.steps, a.graph)
        except CheckpointError as e:
            print(f"dsv4-bench census: error: --ckpt {a.ckpt!r}: {e}", file=sys.stderr)
            return 2
    print(json.dumps(fig, indent=1) if a.json else table(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
