"""``dsv4-plan``: the per-rank memory plan of a run config (``engine.memory_plan``), before anything loads.

    dsv4-plan --config YAML [--model DIR] [--quant-type T] [--kv-cache-dtype D] [--device-memory-gib N] [--json]

Prints, for rank 0 (it holds the most: the first vocab slices), the weights by component (the whole
checkpoint, the stored slices the rank reads, what it holds), the workspace, the decode state of
one request of 8K / 128K / 1M tokens, how many of each fit, and the verdict. The config.json is the
checkpoint's (``--model`` or ``model_config.model_path``), else ``model_config.plan_config`` (a
shipped real one); ``--quant-type`` / ``model_config.quant_type`` plans it as that converted type.
Decode state is counted in the caches' storage: ``--kv-cache-dtype``, else
``scheduler_config.kv_cache_dtype``, resolved against that config.json (``auto``: its
``kv_cache_scheme`` / ``li_cache_scheme``; ``engine.cache_dtype.resolve``); the plan prints which.
Device memory: ``--device-memory-gib``, else the platform's (``model_config.platform_version``),
else ``scheduler_config.cpu_memory_gb``. Exit status 0: it fits; 2: it does not (the message names
what to change) or a bad flag / config value.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from engine.cache_dtype import KEY as CACHE_KEY, SETTINGS as CACHE_SETTINGS, CacheDtype, resolve
from engine.checkpoint.qscheme import QUANT_TYPES
from engine.config import ConfigError, ModelArgs
from engine.memory_plan import (DEVICE_GIB, MemoryPlan, MemoryPlanError, plan_memory, require_fit, type_name,
                                with_quant_type)
from engine.memory_sizes import GIB, MIB, Layout

_STATE_ROWS = (("window", "window ring"), ("csa_kv", "CSA compressed KV"), ("indexer", "indexer keys"),
               ("hca_kv", "HCA compressed KV"), ("compressor_state", "compressor state (fp32)"),
               ("mtp_window", "MTP window ring"))


def plan_args(cfg, model: str | None = None, quant_type: str | None = None) -> tuple[ModelArgs, str]:
    """The config.json to plan ``cfg`` (a RunConfig) with, and a line saying where it came from: the
    checkpoint's (``model``, else ``model_config.model_path``) when it has one, else
    ``model_config.plan_config``; planned as ``quant_type`` (else ``model_config.quant_type``) when
    that differs from what it says. A checkpoint's own config.json must agree with
    ``model_config.quant_type`` (as at load). Raises ConfigError naming the flag or key."""
    m = cfg.model_config
    ckpt = model or m.model_path
    if model and not (Path(model) / "config.json").is_file():
        raise ConfigError(f"--model: no config.json in {model!r}; point it at a checkpoint directory")
    if ckpt and (Path(ckpt) / "config.json").is_file():
        path, from_ckpt = Path(ckpt) / "config.json", True
    elif m.plan_config:
        path, from_ckpt = Path(m.plan_config), False
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"model_config.plan_config: no config.json at {str(path)!r}")
    else:
        key = "--model" if model else "model_config.model_path"
        raise ConfigError(f"{key}: no config.json in {ckpt!r}; point it at a checkpoint, or set "
                          f"model_config.plan_config to a real config.json (configs/models/deepseek-v4-flash | "
                          f"deepseek-v4-pro)")
    args, source = ModelArgs.from_json(path), str(path)
    if from_ckpt and quant_type is None:
        cfg.check_model(args)                       # model_config.quant_type: what config.json says
        return args, source
    want = quant_type or m.quant_type
    if want and want != type_name(args):
        args = with_quant_type(args, want)
        source += f", planned as {want} ({'--quant-type' if quant_type else 'model_config.quant_type'})"
    dataclasses.replace(cfg, model_config=dataclasses.replace(m, quant_type=None)).check_model(args)
    return args, source


def device_memory(cfg, gib: float | None = None) -> tuple[int, str, bool]:
    """(bytes per rank, where the figure comes from, whether it is an accelerator) for ``cfg``:
    ``gib`` (--device-memory-gib), else the platform's (``memory_plan.DEVICE_GIB``), else
    ``scheduler_config.cpu_memory_gb`` (what the engine sizes its pools from on CPU)."""
    plat = cfg.model_config.platform_version
    if gib is not None:
        return int(gib * GIB), "--device-memory-gib", plat is not None
    if plat is not None:
        return DEVICE_GIB[plat] * GIB, {"A2": "an A2 chip", "A3": "an A3 die", "950": "a 950PR chip"}[plat], True
    return cfg.scheduler_config.cpu_memory_bytes, "scheduler_config.cpu_memory_gb, CPU", False


def cache_dtype(cfg, args: ModelArgs, setting: str | None = None) -> tuple[CacheDtype, str]:
    """(the decode-state caches' storage, where it comes from): ``setting`` (--kv-cache-dtype),
    else ``scheduler_config.kv_cache_dtype``, resolved against ``args``' quantization_config.
    Raises ConfigError naming the flag or key."""
    if setting is None:
        setting, key, cache = cfg.scheduler_config.kv_cache_dtype, CACHE_KEY, cfg.cache_dtype_for(args)
    else:
        key = "--kv-cache-dtype"
        try:
            cache = resolve(setting, args.quant and args.quant.compressed)
        except ValueError as e:
            raise ConfigError(f"--kv-cache-dtype {setting}: {e}") from None
    return cache, f"{key} {setting}" + (": the checkpoint's kv_cache_scheme / li_cache_scheme" if setting == "auto"
                                        else "")


def plan_run(cfg, model: str | None = None, quant_type: str | None = None, device_bytes: int | None = None,
             device_source: str = "", accelerator: bool | None = None, kv_cache_dtype: str | None = None
             ) -> tuple[MemoryPlan, str]:
    """(the plan of ``cfg``'s rank 0, the config.json line of ``plan_args``); device memory from
    ``device_memory`` unless ``device_bytes`` is given (launch-pd: the device's own); caches as
    ``cache_dtype`` resolves ``kv_cache_dtype`` (None: the run config's). Raises ConfigError
    naming the flag or key; the plan may not fit (``require_fit``)."""
    args, source = plan_args(cfg, model, quant_type)
    cache, cache_source = cache_dtype(cfg, args, kv_cache_dtype)
    if device_bytes is None:
        device_bytes, device_source, accelerator = device_memory(cfg)
    return plan_memory(args, Layout.of(cfg, cache), device_bytes, device_source, accelerator,
                       cache_source=cache_source), source


def _gib(n: int) -> str:
    return f"{n / GIB:10.2f}"


def format_plan(plan: MemoryPlan, source: str = "") -> str:
    """The plan as the table ``dsv4-plan`` prints (GiB = 2^30, MiB = 2^20)."""
    lay = plan.layout
    tp = ", ".join(f"{k} {getattr(lay, k + '_size')}" for k in ("moe_tp", "shared_tp", "o_proj_tp", "embed_tp",
                                                               "lmhead_tp", "cp") if getattr(lay, k + "_size") > 1)
    out = [f"{plan.model} ({plan.quant_type}): rank {plan.rank} of {lay.world_size} on {lay.platform or 'CPU'} "
           f"(moe_ep {lay.moe_ep_size}{', ' + tp if tp else ''}; next_n {lay.next_n}; "
           f"batch {lay.batch_per_rank} / rank; prefill chunk {lay.prefill_tokens})"]
    if source:
        out.append(f"config.json: {source}")
    out += [f"device: {plan.device_bytes / GIB:g} GiB ({plan.device_source}) x mem_fraction_static "
            f"{lay.mem_fraction:g} = {plan.budget / GIB:.2f} GiB", cache_line(plan), "",
            f"{'weights (GiB)':24}{'checkpoint':>10} {'rank reads':>10} {'resident':>10}"]
    for comp, row in plan.weights.items():
        out.append(f"  {comp:22}{_gib(row.checkpoint)} {_gib(row.read)} {_gib(row.resident)}")
    total = [sum(getattr(r, f) for r in plan.weights.values()) for f in ("checkpoint", "read", "resident")]
    out += [f"  {'total':22}" + " ".join(_gib(t) for t in total), "", "workspace (GiB)"]
    out += [f"  {k:22}{_gib(v)}" for k, v in plan.workspace.items()]
    out += [f"  {'total':22}{_gib(sum(plan.workspace.values()))}", "",
            f"left for decode state: {plan.left / GIB:.2f} GiB (pools' minimum {plan.min_state / GIB:.2f} GiB)", ""]
    lengths = list(plan.state)
    out.append(f"{'state per request (MiB)':28}" + "".join(f"{_tokens(t):>10}" for t in lengths))
    for key, label in _STATE_ROWS:
        out.append(f"  {label:26}" + "".join(f"{plan.state[t][key] / MIB:10.2f}" for t in lengths))
    out.append(f"  {'total':26}" + "".join(f"{sum(plan.state[t].values()) / MIB:10.2f}" for t in lengths))
    out += [f"{'requests that fit / rank':28}" + "".join(f"{plan.requests(t):>10}" for t in lengths), ""]
    if plan.fits:
        out.append(f"verdict: fits; {plan.left / GIB:.2f} GiB per rank for decode state")
    else:
        out += ["verdict: does NOT fit"] + [f"  - {p}" for p in plan.problems]
        out += ["  change:"] + [f"  - {s}" for s in plan.suggestions]
    return "\n".join(out)


def cache_line(plan: MemoryPlan) -> str:
    """Which storage the decode-state caches are counted in, bytes per row, and why."""
    c, (kv, idx) = plan.layout.cache_dtype, plan.cache_rows

    def name(kind: str) -> str:
        return "unquantised" if kind == "none" else kind
    return (f"decode-state caches: KV {name(c.kv)} ({kv} B/row), indexer keys {name(c.indexer)} ({idx} B/entry)"
            + (f" ({plan.cache_source})" if plan.cache_source else ""))


def _tokens(t: int) -> str:
    return f"{t >> 20}M" if t % (1 << 20) == 0 else (f"{t >> 10}K" if t % 1024 == 0 else str(t))


def main(argv: list[str] | None = None) -> int:
    from engine.run_config import RunConfig
    p = argparse.ArgumentParser(prog="dsv4-plan", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML run config (configs/*.yaml)")
    p.add_argument("--model", help="checkpoint directory whose config.json to plan (default model_config.model_path, "
                                   "else model_config.plan_config)")
    p.add_argument("--quant-type", choices=QUANT_TYPES, help="plan the checkpoint as this converted type "
                   "(dsv4-convert-model --quant-type; default model_config.quant_type)")
    p.add_argument("--kv-cache-dtype", choices=("auto", *CACHE_SETTINGS), help="plan the decode-state caches "
                   "in this storage (default scheduler_config.kv_cache_dtype; auto: the checkpoint's cache schemes)")
    p.add_argument("--device-memory-gib", type=float, help="memory of one rank's device, GiB (default: the "
                   "platform's: A2 / A3 die 64, 950 128; CPU: scheduler_config.cpu_memory_gb)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    a = p.parse_args(argv)
    if a.device_memory_gib is not None and not 0 < a.device_memory_gib < 1 << 20:
        p.error(f"--device-memory-gib: {a.device_memory_gib} must be in (0, 2^20) GiB")
    try:
        cfg = RunConfig.from_yaml(a.config)
        dev = device_memory(cfg, a.device_memory_gib)
        plan, source = plan_run(cfg, a.model, a.quant_type, *dev, kv_cache_dtype=a.kv_cache_dtype)
    except ConfigError as e:
        print(f"dsv4-plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"config_json": source, **plan.to_dict()}, indent=1) if a.json else format_plan(plan, source))
    try:
        require_fit(plan)
    except MemoryPlanError as e:
        print(f"dsv4-plan: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
