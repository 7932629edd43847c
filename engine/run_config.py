"""The YAML run config: how to run a model (cann-recipes-infer schema), read and checked.

Four sections with the upstream keys and defaults (reference/upstream-baseline.md §5.1):
``model_config`` (with ``custom_params``), ``data_config``, ``parallel_config`` and
``scheduler_config``, so an upstream DeepSeek-V4 YAML loads as is. Our additions: in
``scheduler_config`` ``cpu_memory_gb``, ``num_kv_blocks``, ``max_model_len``; in ``model_config``
``quant_type``, ``plan_config`` (the memory plan, ``engine.memory_plan``) and ``graph_batch_sizes``.

Unlike config.json (written by the checkpoint's publisher, so unknown keys are only logged), a run
config is written by the user: an unknown section or key is an error with a "did you mean"
suggestion, and every bad value raises ``ConfigError`` whose message starts with the full key
path, e.g. ``scheduler_config.block_size: must be a positive power of two, got 96``.

Checks follow upstream's ``InferenceConfig`` plus DeepSeek-V4's ``check_model_settings``; where
upstream silently repairs a combination (cache-compile in eager) we refuse it instead.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.cache_dtype import CacheDtype, resolve as resolve_cache_dtype
from engine.config import ConfigError, ModelArgs, read_text_file
from engine.config_checks import MODEL_NAMES, RANKS_PER_CHIP, min_ranks, type_name
from engine.run_sections import (DATASETS, DEFAULT_MODEL_NAME, DTYPES, EXE_MODES, MAX_NEXT_N, PLATFORMS, SECTIONS,
                                 CustomParams, DataConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                                 section_from_dict, suggest_key)


@dataclass(frozen=True)
class RunConfig:
    """A whole run config: the four sections plus the cross-section and DeepSeek-V4 checks."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        p, s = self.parallel_config, self.scheduler_config
        if s.batch_size % p.attn_dp_size:
            raise ConfigError(f"scheduler_config.batch_size: must be a multiple of the attention-DP size "
                              f"{p.attn_dp_size} (world_size / attn_tp_size), got {s.batch_size}")
        check_dsv4_settings(self)

    # ---- derived (upstream InferenceConfig.from_dict) --------------------------------------
    @property
    def batch_size_per_dp_rank(self) -> int:
        return self.scheduler_config.batch_size // self.parallel_config.attn_dp_size

    @property
    def effective_max_prefill_tokens(self) -> int:
        """Prefill token budget per step: ``max_prefill_tokens``, or when 0, input_truncated_len x
        the prefill batch per DP rank (batch_size / cp_prefill_dp_size with CP), as upstream."""
        s, p = self.scheduler_config, self.parallel_config
        if s.max_prefill_tokens:
            return s.max_prefill_tokens
        batch = s.batch_size // p.cp_prefill_dp_size if p.cp_size > 1 else self.batch_size_per_dp_rank
        return self.data_config.input_truncated_len * batch

    def max_model_len_for(self, args: ModelArgs) -> int:
        """Tokens per request (prompt + output): ``scheduler_config.max_model_len``, else
        ``custom_params.max_position_embeddings``, else the checkpoint's. Raises ConfigError if
        max_model_len exceeds the positions the model supports."""
        limit = self.model_config.custom_params.max_position_embeddings or args.max_position_embeddings
        n = self.scheduler_config.max_model_len
        if n is not None and n > limit:
            raise ConfigError(f"scheduler_config.max_model_len: must be <= max_position_embeddings ({limit}), "
                              f"got {n}")
        return limit if n is None else n

    def check_model(self, args: ModelArgs) -> None:
        """Checks that need the checkpoint's config.json (``check_model_args`` below).
        Raises ConfigError naming the key."""
        check_model_args(self, args)
        self.max_model_len_for(args)
        self.cache_dtype_for(args)

    def cache_dtype_for(self, args: ModelArgs) -> CacheDtype:
        """The decode-state caches' storage: ``scheduler_config.kv_cache_dtype`` resolved against
        the checkpoint's cache schemes (``engine.cache_dtype.resolve``). Raises ConfigError naming
        the key."""
        try:
            return resolve_cache_dtype(self.scheduler_config.kv_cache_dtype, args.quant and args.quant.compressed)
        except ValueError as e:
            raise ConfigError(f"{e} (scheduler_config.kv_cache_dtype is {self.scheduler_config.kv_cache_dtype!r})"
                              ) from None

    # ---- loading / saving ------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> "RunConfig":
        """Read and validate a YAML run config (``yaml.safe_load``).

        Raises:
            ConfigError: missing/unreadable file, YAML syntax error, top level not a mapping
                (an empty file included), or any check; the message starts with the file path.
        """
        p = Path(path)
        text = read_text_file(p, ConfigError, "run config")
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: invalid YAML: {e}") from None
        if raw is None:
            raise ConfigError(f"{p}: run config is empty (expected a mapping of sections: {', '.join(SECTIONS)})")
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None

    @classmethod
    def from_dict(cls, raw: Any) -> "RunConfig":
        """Build and validate from a YAML-shaped dict; missing sections / keys take the defaults.

        Raises:
            ConfigError: not a mapping, an unknown section or key, a wrong type or a failed check.
        """
        if not isinstance(raw, Mapping):
            raise ConfigError(f"top level: must be a mapping of sections ({', '.join(SECTIONS)}), "
                              f"got {type_name(raw)}")
        kw = {}
        for key, value in raw.items():
            if key == "disagg_config":
                raise ConfigError("disagg_config: not a YAML section; the P/D role, bootstrap address and "
                                  "transfer backend come from launch-pd's command-line flags")
            if key not in SECTIONS:
                raise ConfigError(f"{key}: unknown section{suggest_key(key, SECTIONS, top_level=True)}")
            kw[key] = section_from_dict(SECTIONS[key], value, key)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The YAML-shaped dict (inverse of from_dict); every key present, derived values not."""
        return dataclasses.asdict(self)



# ---- DeepSeek-V4's own checks ---------------------------------------------------------------
def check_dsv4_settings(c: RunConfig) -> None:
    """DSV4 combinations (reference/upstream-baseline.md §5.1). Raises ConfigError naming the key."""
    # upstream's DSV4 check also refuses exe_mode ge_graph; we run it (torchair GE on Ascend,
    # the same captured step as npugraph_ex elsewhere), see engine.core.model_runner
    m, cp = c.model_config, c.model_config.custom_params
    if c.parallel_config.attn_tp_size != 1:
        raise ConfigError(f"parallel_config.attn_tp_size: DeepSeek-V4 needs 1 (attention is data-parallel), "
                          f"got {c.parallel_config.attn_tp_size}")
    if m.exe_mode == "eager":
        for path, on in (("model_config.enable_cache_compile", m.enable_cache_compile),
                         ("model_config.custom_params.enable_superkernel", cp.enable_superkernel)):
            if on:
                raise ConfigError(f"{path}: needs a graph exe_mode (npugraph_ex), got exe_mode 'eager'")
    if not m.with_ckpt and not m.force_eplb:
        raise ConfigError("model_config.force_eplb: must be true with dummy weights (with_ckpt: false)")
    if cp.enable_limit_core:
        if not cp.enable_multi_streams:
            raise ConfigError("model_config.custom_params.enable_limit_core: needs "
                              "model_config.custom_params.enable_multi_streams: true")
        if cp.enable_pypto:
            raise ConfigError("model_config.custom_params.enable_limit_core: cannot be combined with "
                              "model_config.custom_params.enable_pypto")
    for name in ("enable_limit_core", "enable_pypto"):
        if getattr(cp, name) and m.platform_version not in (None, "A3"):
            raise ConfigError(f"model_config.custom_params.{name}: A3 only, got platform_version "
                              f"{m.platform_version!r}")
    if c.parallel_config.cp_size > 1 and m.next_n:
        # the MTP catch-up reads the trunk's output streams, which context-parallel prefill keeps sharded
        raise ConfigError(f"model_config.next_n: MTP needs parallel_config.cp_size 1, got cp_size "
                          f"{c.parallel_config.cp_size}; set next_n 0 on a context-parallel prefill instance")
    if c.parallel_config.cp_size > 1 and c.scheduler_config.cp_mini_batch != 1:
        raise ConfigError(f"scheduler_config.cp_mini_batch: must be 1 with context parallelism "
                          f"(cp_size {c.parallel_config.cp_size}), got {c.scheduler_config.cp_mini_batch}")


def check_model_args(c: RunConfig, args: ModelArgs) -> None:
    """The run config against the checkpoint's config.json: TP / EP sizes that divide the model,
    the layer-count override, MTP present for next_n, and ``model_config.quant_type`` equal to the
    type config.json says. Raises ConfigError naming the key."""
    p, cp, m = c.parallel_config, c.model_config.custom_params, c.model_config
    if args.num_attention_heads % p.attn_tp_size:
        raise ConfigError(f"parallel_config.attn_tp_size: must divide num_attention_heads "
                          f"({args.num_attention_heads}), got {p.attn_tp_size}")
    if args.n_routed_experts % p.moe_ep_size:
        raise ConfigError(f"parallel_config.moe_tp_size: moe_ep_size = world_size / moe_tp_size = "
                          f"{p.moe_ep_size} must divide n_routed_experts ({args.n_routed_experts})")
    if cp.num_hidden_layers is not None and cp.num_hidden_layers > args.num_hidden_layers:
        raise ConfigError(f"model_config.custom_params.num_hidden_layers: must be <= the checkpoint's "
                          f"num_hidden_layers ({args.num_hidden_layers}), got {cp.num_hidden_layers}")
    if m.next_n > 0 and args.num_nextn_predict_layers < 1:
        raise ConfigError(f"model_config.next_n: needs an MTP layer in the checkpoint "
                          f"(num_nextn_predict_layers is 0), got {m.next_n}")
    found = args.quant.quant_type if args.quant is not None else None
    if m.quant_type is not None and found != m.quant_type:
        raise ConfigError(f"model_config.quant_type: {m.quant_type!r}, but the checkpoint's config.json says "
                          f"{found or 'the original (unconverted) weights'!r}")


def check_min_ranks(cfg: RunConfig, args: ModelArgs, version: str | None) -> None:
    """A full-size Flash / Pro on an Ascend generation needs at least its published number of
    chips, counted in ranks (two per A3 chip). Raises ConfigError naming ``parallel_config.world_size``."""
    need = min_ranks(args.hidden_size, version)
    got = cfg.parallel_config.world_size
    if need is not None and got < need[1]:
        v = version or "A3"
        per = "two 64 GB dies per A3 chip, one rank each" if RANKS_PER_CHIP[v] == 2 else f"one rank per {v} chip"
        raise ConfigError(f"parallel_config.world_size: {MODEL_NAMES[args.hidden_size]} on {v} needs at least "
                          f"{need[0]} chips = {need[1]} ranks (the published deployment minimum; {per}), got {got}")


__all__ = ["RunConfig", "CustomParams", "ModelConfig", "DataConfig", "ParallelConfig", "SchedulerConfig",
           "DEFAULT_MODEL_NAME", "DTYPES", "EXE_MODES", "PLATFORMS", "DATASETS", "MAX_NEXT_N",
           "check_dsv4_settings", "check_model_args", "check_min_ranks"]
