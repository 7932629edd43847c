"""The per-rank memory plan of a run config, checked before any weight is read (``dsv4-plan``,
``launch-pd``): weights, workspace and decode state (``engine.memory_sizes`` says how each is
counted) against the device's memory. Torch-free: it needs only config.json and the YAML.

Device memory: the given size, else the platform's per rank (``DEVICE_GIB``), else
``cpu_memory_gb`` (a CPU run config, as the engine sizes its pools), times ``mem_fraction_static``.
What weights and workspace leave is for state; the plan counts how many requests of 8K / 128K /
1M tokens (and ``max_model_len``) it holds after the pools' scratch part.

Decode state is counted in the storage of the caches (``Layout.cache_dtype``: ``dsv4-plan`` resolves
``scheduler_config.kv_cache_dtype`` against the checkpoint's cache schemes, ``engine.cache_dtype``).

A layout fits when the state left holds the pools' minimum (``block_manager.plan_cache``: a window
ring, a state slot and one block of each growing pool per request of the batch per DP rank, plus
scratch), a request of ``scheduler_config.max_model_len`` when that is set, and world_size meets
the published minimum of the platform (``config_checks.min_ranks``), and the caches are ones the
platform computes in (no FP8 / HiF8 caches on A2 / A3, reference §7). Otherwise ``require_fit``
raises ``MemoryPlanError`` with the numbers and what would fit: more ranks, a converted type, a
higher mem fraction, a smaller prefill chunk, a larger device.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.cache_dtype import indexer_row_bytes, kv_row_bytes
from engine.checkpoint.qscheme import compressed_tensors_config
from engine.config import ConfigError, ModelArgs
from engine.config_checks import MODEL_NAMES, RANKS_PER_CHIP, min_ranks
from engine.memory_sizes import (GIB, MIB, Layout, WeightRow, pool_overheads, state_per_request, weight_bytes,
                                 workspace)

STATE_LENGTHS = (8192, 131072, 1048576)                 # 8K, 128K, 1M tokens
# Per-rank device memory, GiB (HBM sizes are binary): an Atlas A2 chip (910B) and an A3 die (910C:
# two per chip) 64; a 950PR 128 (HiBL 1.0; Huawei Connect 2025, the Ascend 950 white paper's table
# 3-1). A 950DT has 144 (HiZQ 2.0): pass --device-memory-gib 144.
DEVICE_GIB = {"A2": 64, "A3": 64, "950": 128}
# converted types that suit each Ascend generation (reference §7): int on A2 / A3, MX / HiF8 on 950
TYPES_FOR = {"A2": ("w8a8-int", "w4a8-int"), "A3": ("w8a8-int", "w4a8-int"), "950": ("w4a8-mx", "w4a8-mx-hif")}
NO_FP8 = ("A2", "A3")          # Ascend generations without FP8 / HiF8 arithmetic (reference §7): C16 / LI-int8 only


class MemoryPlanError(ValueError):
    """A layout that does not fit its devices; the message gives the numbers and what to change,
    ``plan`` the whole ``MemoryPlan``."""

    def __init__(self, message: str, plan: "MemoryPlan"):
        super().__init__(message)
        self.plan = plan


def with_quant_type(args: ModelArgs, quant_type: str) -> ModelArgs:
    """``args`` as ``dsv4-convert-model --quant-type`` leaves them: the compressed-tensors
    quantization_config it writes (``qscheme.compressed_tensors_config``). Raises ConfigError
    when ``args`` are unquantised (nothing to convert from)."""
    if args.quant is None:
        raise ConfigError(f"quant type {quant_type!r}: config.json has no quantization_config; only the "
                          "original FP8-MXFP4 checkpoint converts")
    qc = compressed_tensors_config(args.num_hidden_layers, list(args.compress_ratios), quant_type)
    return ModelArgs.from_dict({**args.to_dict(), "quantization_config": qc})


def type_name(args: ModelArgs) -> str:
    """"original" (FP8 + MXFP4), a converted type, or "bf16" (no quantization_config)."""
    return "bf16" if args.quant is None else (args.quant.quant_type or "original")


def model_name(args: ModelArgs) -> str:
    return MODEL_NAMES.get(args.hidden_size, f"DeepSeek-V4 (hidden {args.hidden_size})")


# ---- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory (bytes). ``problems``: why it does not fit (empty: it fits)."""

    model: str
    quant_type: str
    layout: Layout
    rank: int
    device_bytes: int
    device_source: str
    weights: dict[str, WeightRow]
    workspace: dict[str, int]
    state: dict[int, dict[str, int]]       # tokens -> part -> bytes per request
    scratch: int
    min_state: int
    problems: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = ()
    cache_rows: tuple[int, int] = (0, 0)   # bytes of one KV row, of one indexer-key entry (as stored)
    cache_source: str = ""                 # where layout.cache_dtype came from (dsv4-plan prints it)

    @property
    def budget(self) -> int:
        return int(self.device_bytes * self.layout.mem_fraction)

    @property
    def resident(self) -> int:
        return sum(r.resident for r in self.weights.values())

    @property
    def left(self) -> int:
        """Bytes left for decode state: budget - resident weights - workspace (may be < 0)."""
        return self.budget - self.resident - sum(self.workspace.values())

    def requests(self, tokens: int) -> int:
        """Requests of ``tokens`` tokens the state left holds (0 when none)."""
        return max(0, (self.left - self.scratch) // sum(self.state[tokens].values()))

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        """JSON-ready: every number in bytes, plus the derived totals."""
        d = dataclasses.asdict(self)
        d["state"] = {str(t): {**parts, "total": sum(parts.values())} for t, parts in self.state.items()}
        d["layout"]["cache_dtype"] = self.layout.cache_dtype.describe()
        d.update(budget=self.budget, resident=self.resident, workspace_total=sum(self.workspace.values()),
                 left=self.left, requests={str(t): self.requests(t) for t in self.state}, fits=self.fits)
        return d


def plan_memory(args: ModelArgs, lay: Layout, device_bytes: int, device_source: str = "",
                accelerator: bool | None = None, rank: int = 0, advise: bool = True,
                cache_source: str = "") -> MemoryPlan:
    """The plan of ``rank`` for ``args`` (config.json, converted type applied) laid out as ``lay``
    (decode state in ``lay.cache_dtype``'s storage) on devices of ``device_bytes``. ``accelerator``
    (None: ``lay.platform`` is set) adds the runtime / HCCL reserve. ``advise``: when it does not
    fit, try other layouts for suggestions. ``cache_source``: a note on where the cache dtype came
    from. Raises ConfigError when ``device_bytes`` < 1 MiB."""
    accel = lay.platform is not None if accelerator is None else accelerator
    lengths = sorted({*STATE_LENGTHS, *([lay.max_model_len] if lay.max_model_len else [])})
    scratch, minimum = pool_overheads(args, lay)
    if device_bytes < MIB:
        raise ConfigError(f"{device_source or 'device memory'}: {device_bytes} bytes per rank is too small to plan "
                          f"(at least 1 MiB)")
    plan = MemoryPlan(model_name(args), type_name(args), lay, rank, device_bytes, device_source,
                      weight_bytes(args, lay, rank), workspace(args, lay, accel),
                      {t: state_per_request(args, lay, t) for t in lengths}, scratch, minimum,
                      cache_rows=(kv_row_bytes(lay.cache_dtype.kv, args.head_dim, args.qk_rope_head_dim, lay.act_bytes),
                                  indexer_row_bytes(lay.cache_dtype.indexer, args.index_head_dim, lay.act_bytes)),
                      cache_source=cache_source)
    problems = _problems(plan, args)
    if not problems:
        return plan
    plan = dataclasses.replace(plan, problems=tuple(problems))
    return dataclasses.replace(plan, suggestions=tuple(_suggest(args, plan, accel))) if advise else plan


def _problems(plan: MemoryPlan, args: ModelArgs) -> list[str]:
    lay, out = plan.layout, []
    if plan.left < plan.min_state:
        used = (f"weights {plan.resident / GIB:.2f} GiB + workspace {sum(plan.workspace.values()) / GIB:.2f} GiB")
        budget = (f"the {plan.budget / GIB:.2f} GiB budget ({plan.device_bytes / GIB:g} GiB x mem_fraction_static "
                  f"{lay.mem_fraction:g})")
        out.append(f"{used} exceed {budget} by {-plan.left / GIB:.2f} GiB" if plan.left < 0 else
                   f"{used} leave {plan.left / GIB:.2f} GiB of {budget}, below the {plan.min_state / GIB:.2f} GiB "
                   f"the state pools need for {lay.batch_per_rank} request(s)")
    elif lay.max_model_len and plan.requests(lay.max_model_len) < 1:
        out.append(f"scheduler_config.max_model_len {lay.max_model_len}: one request needs "
                   f"{sum(plan.state[lay.max_model_len].values()) / GIB:.2f} GiB of state, "
                   f"{plan.left / GIB:.2f} GiB are left")
    need = min_ranks(args.hidden_size, lay.platform) if lay.platform else None
    if need is not None and lay.world_size < need[1]:
        out.append(f"parallel_config.world_size {lay.world_size}: below the published minimum of "
                   f"{model_name(args)} on {lay.platform}, {need[0]} chips = {need[1]} ranks")
    if _fp8_cache_on(lay):
        c = lay.cache_dtype
        key = plan.cache_source.split(":")[0] or "scheduler_config.kv_cache_dtype"
        out.append(f"{key}: KV {c.kv} / indexer {c.indexer} caches need FP8 / HiF8, "
                   f"which Ascend {lay.platform} lacks (950 only)")
    return out


def _fp8_cache_on(lay: Layout) -> bool:
    return lay.platform in NO_FP8 and bool({lay.cache_dtype.kv, lay.cache_dtype.indexer} & {"fp8", "hif8"})


def _suggest(args: ModelArgs, base: MemoryPlan, accel: bool) -> list[str]:
    """What would fit ``base``'s model: more ranks (the fewest that fit); unless the rank minimum
    is the problem, also a converted type, a higher mem fraction, a smaller prefill chunk, a
    larger device."""
    lay, dev = base.layout, base.device_bytes
    if _fp8_cache_on(lay):                              # no other change lifts this one
        return [f"scheduler_config.kv_cache_dtype int8 (bf16 KV, int8 indexer keys) or bfloat16 on {lay.platform}; "
                "FP8 / HiF8 caches on a 950"]

    def fits(a: ModelArgs, lo: Layout) -> MemoryPlan | None:
        p = plan_memory(a, lo, dev, accelerator=accel, advise=False)
        return p if p.fits else None

    out, per_chip = [], RANKS_PER_CHIP.get(lay.platform or "", 1)
    for w in (lay.world_size * f for f in (2, 4, 8, 16)):
        if args.n_routed_experts % (w // lay.moe_tp_size) == 0 and (p := fits(args, dataclasses.replace(
                lay, world_size=w))):
            out.append(f"more ranks: parallel_config.world_size {w}"
                       f"{f' ({w // per_chip} chips)' if per_chip > 1 else ''} leaves {p.left / GIB:.1f} GiB per "
                       f"rank for state")
            break
    need = min_ranks(args.hidden_size, lay.platform) if lay.platform else None
    if need is not None and lay.world_size < need[1]:
        return out                                      # nothing else lifts the published minimum
    if args.quant is not None:
        for qt in TYPES_FOR.get(lay.platform or "", TYPES_FOR["A3"] + TYPES_FOR["950"]):
            if qt != type_name(args) and (p := fits(with_quant_type(args, qt), lay)):
                out.append(f"a converted type: {qt} (model_config.quant_type; dsv4-convert-model --quant-type "
                           f"{qt}) holds {p.resident / GIB:.1f} GiB of weights per rank, leaves {p.left / GIB:.1f} GiB")
    state = base.min_state + (sum(base.state[lay.max_model_len].values()) if lay.max_model_len else 0)
    frac = (base.resident + sum(base.workspace.values()) + state) / dev
    if lay.mem_fraction < frac <= 0.95:
        out.append(f"a higher scheduler_config.mem_fraction_static: >= {math.ceil(frac * 100) / 100:.2f}")
    for t in (lay.prefill_tokens // 2, lay.prefill_tokens // 4, 2048, 1024):
        if 0 < t < lay.prefill_tokens and (p := fits(args, dataclasses.replace(lay, prefill_tokens=t))):
            out.append(f"a smaller prefill chunk: scheduler_config.max_prefill_tokens {t * lay.cp_size} "
                       f"(workspace {sum(p.workspace.values()) / GIB:.1f} GiB)")
            break
    out.append("a device with more memory (--device-memory-gib" + ("; a 950DT has 144 GiB)" if lay.platform == "950"
                                                                   else ")"))
    return out


def require_fit(plan: MemoryPlan) -> MemoryPlan:
    """``plan`` if it fits. Raises MemoryPlanError with the numbers and what to change otherwise."""
    if plan.fits:
        return plan
    lay = plan.layout
    msg = (f"memory plan: {plan.model} ({plan.quant_type}) on {lay.world_size} rank(s) of "
           f"{plan.device_bytes / GIB:.0f} GiB ({plan.device_source or 'device'}) does not fit: "
           + "; ".join(plan.problems) + ". Change: " + "; or ".join(plan.suggestions))
    raise MemoryPlanError(msg, plan)
