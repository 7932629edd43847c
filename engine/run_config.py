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
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.cache_dtype import SETTINGS as CACHE_SETTINGS, CacheDtype, resolve as resolve_cache_dtype
from engine.config import ConfigError, ModelArgs, read_text_file
from engine.checkpoint.qscheme import QUANT_TYPES
from engine.config_checks import (check_dsv4_settings, check_model_args, choice, coerce, fail, field_hints,
                                  in_range, positive, type_name, unknown_key_hint)
from engine.kernel_config import validate_kernel_config

DTYPES = ("bfloat16", "float32", "float16")
EXE_MODES = ("eager", "ge_graph", "npugraph_ex")
PLATFORMS = ("A2", "A3", "950")
DATASETS = ("default", "LongBench", "InfiniteBench")
MAX_NEXT_N = 3                                 # MTP depth DSV4 supports (§5.1)
_GIB = 1 << 30


# ---- sections --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CustomParams:
    """``model_config.custom_params`` for DeepSeek-V4 (§5.1)."""

    _PATH: typing.ClassVar[str] = "model_config.custom_params"

    enable_multi_streams: bool = False    # overlap shared/routed experts, compressor/indexer vs attention
    enable_limit_core: bool = False       # per-stream AI-core budget; A3 only, needs multi-streams
    enable_pypto: bool = False            # PyPTO kernels; A3 only
    moe_chunk_max_len: int = 65536        # tokens per routed-MoE chunk in prefill
    enable_superkernel: bool = False      # graph option (super_kernel_optimize); not in eager
    kernel_config: dict[str, str] = field(default_factory=dict)   # {seam op: native | npu | ascendc}
    num_hidden_layers: int | None = None          # override for reduced-layer runs
    max_position_embeddings: int | None = None    # override of the checkpoint's value

    def __post_init__(self) -> None:
        _check_fields(self)
        positive(self, "moe_chunk_max_len")
        try:
            validate_kernel_config(self.kernel_config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        positive(self, "num_hidden_layers", optional=True)
        positive(self, "max_position_embeddings", optional=True)


#: The served model name when a run config names none: the name the shipped configs, the gateway,
#: the workers' metrics labels and the README use.
DEFAULT_MODEL_NAME = "deepseek_v4"


@dataclass(frozen=True)
class ModelConfig:
    """``model_config``: which model, from where, in which dtype and execution mode."""

    _PATH: typing.ClassVar[str] = "model_config"

    model_name: str = DEFAULT_MODEL_NAME
    model_path: str = ""
    output_path: str = ""                 # "" -> offline picks a work dir; online: ./compile_cache
    dtype: str = "bfloat16"
    with_ckpt: bool = True                # False -> dummy weights
    next_n: int = 0                       # MTP speculative depth
    platform_version: str | None = None   # A2 | A3 | 950; None -> detected from the device (else A3)
    exe_mode: str = "eager"               # eager | ge_graph | npugraph_ex (decode only; prefill is eager)
    enable_cache_compile: bool = False
    enable_static_kernel: bool = False    # npugraph_ex only
    enable_dynamic_graph: bool = True     # npugraph_ex: torch.compile(dynamic=...)
    force_eplb: bool = False
    enable_profiler: bool = False
    enable_weight_nz: bool = True
    enable_hadamard: bool = False
    hadamard_weight_path: str = ""
    custom_params: CustomParams = field(default_factory=CustomParams)
    # ---- dsv4-pd additions ----
    # the converted type model_path holds (dsv4-convert-model --quant-type); None: as its config.json
    # says. Checked against that config.json at load; the memory plan applies it to plan_config's.
    quant_type: str | None = None
    # config.json (or a directory holding one) the memory plan reads while model_path has none (a
    # placeholder): configs/models/deepseek-v4-flash | deepseek-v4-pro, the real published ones
    plan_config: str = ""
    # batch buckets of the graph decode step, in sequences per rank (vLLM's cudagraph_capture_sizes
    # counts tokens); the rank's batch size is always one. None: 1, 2, 4, .. on a device, on CPU it alone
    graph_batch_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.platform_version, int) and not isinstance(self.platform_version, bool):
            object.__setattr__(self, "platform_version", str(self.platform_version))   # YAML `950`
        _check_fields(self)
        choice(self, "dtype", DTYPES)
        choice(self, "exe_mode", EXE_MODES)
        if self.platform_version is not None:
            choice(self, "platform_version", PLATFORMS)
        in_range(self, "next_n", 0, MAX_NEXT_N)
        if self.quant_type is not None:
            choice(self, "quant_type", QUANT_TYPES)
        if self.enable_static_kernel and self.exe_mode != "npugraph_ex":
            fail(self, "enable_static_kernel", f"needs exe_mode 'npugraph_ex', got exe_mode {self.exe_mode!r}")
        sizes = self.graph_batch_sizes
        if sizes is not None and (not sizes or min(sizes) < 1 or sizes != sorted(set(sizes))):
            fail(self, "graph_batch_sizes", f"must be positive integers in ascending order, got {sizes!r}")


@dataclass(frozen=True)
class DataConfig:
    """``data_config``: the offline dataset and its sampling (online requests bring their own)."""

    _PATH: typing.ClassVar[str] = "data_config"

    dataset: str = "default"              # default | LongBench | InfiniteBench
    dataset_path: str = ""
    input_truncated_len: int = 256        # prompt tokens kept (middle truncated); warm-up shape
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1: disabled
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        choice(self, "dataset", DATASETS)
        positive(self, "input_truncated_len")
        if self.temperature < 0:
            fail(self, "temperature", f"must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            fail(self, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            fail(self, "top_k", f"must be >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and self.seed < 0:
            fail(self, "seed", f"must be a non-negative integer or null, got {self.seed!r}")


_TP_KEYS = ("attn_tp_size", "moe_tp_size", "embed_tp_size", "lmhead_tp_size", "dense_tp_size",
            "shared_tp_size", "o_proj_tp_size")


@dataclass(frozen=True)
class ParallelConfig:
    """``parallel_config``: ranks of one instance (a prefill or a decode instance) and their groups."""

    _PATH: typing.ClassVar[str] = "parallel_config"

    world_size: int = 1
    attn_tp_size: int = 1
    moe_tp_size: int = 1
    embed_tp_size: int = 1
    lmhead_tp_size: int = 1
    dense_tp_size: int = 1
    shared_tp_size: int = 1
    o_proj_tp_size: int = 1
    cp_size: int = 1                      # context-parallel prefill: 1 or world_size
    offline_prefill_dp_group_size: int = 1

    def __post_init__(self) -> None:
        _check_fields(self)
        positive(self, "world_size")
        for name in (*_TP_KEYS, "cp_size", "offline_prefill_dp_group_size"):
            positive(self, name)
            if self.world_size % getattr(self, name):
                fail(self, name, f"must divide world_size ({self.world_size}), got {getattr(self, name)}")
        if self.cp_size > 1:
            if self.cp_size != self.world_size:
                fail(self, "cp_size", f"must be 1 or world_size ({self.world_size}), got {self.cp_size}")
            if self.attn_tp_size != 1:
                fail(self, "attn_tp_size", f"must be 1 with context parallelism (cp_size {self.cp_size}), "
                                            f"got {self.attn_tp_size}")

    # ---- derived (upstream ParallelConfig.from_dict) ---------------------------------------
    @property
    def attn_dp_size(self) -> int:
        return self.world_size // self.attn_tp_size

    @property
    def moe_ep_size(self) -> int:
        return self.world_size // self.moe_tp_size

    @property
    def embed_dp_size(self) -> int:
        return self.world_size // self.embed_tp_size

    @property
    def cp_prefill_dp_size(self) -> int:
        """Prefill DP groups when all CP ranks share one request batch."""
        return self.world_size // (self.attn_tp_size * self.cp_size)


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler_config``: batching, the prefill token budget and the state pool size."""

    _PATH: typing.ClassVar[str] = "scheduler_config"

    batch_size: int = 1                   # global, over all attention-DP ranks
    max_new_tokens: int = 32              # server-side cap on a request's output tokens
    max_prefill_tokens: int = 0           # 0 -> input_truncated_len x prefill batch (RunConfig)
    mem_fraction_static: float = 0.85     # of device memory (or cpu_memory_gb on CPU) for weights + state
    block_size: int = 128                 # tokens per state block
    num_reserved_decode_tokens: int = 64  # per in-flight request, decode admission headroom
    cp_mini_batch: int = -1               # requests per CP prefill step; -1 = no limit
    # ---- dsv4-pd additions ----
    cpu_memory_gb: float = 4.0            # GiB that mem_fraction_static applies to on CPU
    num_kv_blocks: int | None = None      # explicit pool size (blocks), overrides the computed one
    max_model_len: int | None = None      # prompt + output tokens; None -> max_position_embeddings
    kv_cache_dtype: str = "auto"          # auto (the checkpoint's cache schemes) | bfloat16 | int8 | fp8 | hif8
    enable_prefix_caching: bool = False   # reuse cached prompt-prefix state (engine.core.prefix_cache)
    prefix_cache_slots: int = 0           # its snapshot rings / state slots per DP rank; 0 -> batch_size

    def __post_init__(self) -> None:
        _check_fields(self)
        positive(self, "batch_size")
        positive(self, "max_new_tokens")
        if self.max_prefill_tokens < 0:
            fail(self, "max_prefill_tokens", f"must be >= 0 (0 = derived), got {self.max_prefill_tokens}")
        if not 0 < self.mem_fraction_static <= 1:
            fail(self, "mem_fraction_static", f"must be in (0, 1], got {self.mem_fraction_static!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            what = "a positive integer" if self.block_size <= 0 else "a power of two"
            fail(self, "block_size", f"must be {what}, got {self.block_size}")
        if self.num_reserved_decode_tokens < 0:
            fail(self, "num_reserved_decode_tokens", f"must be >= 0, got {self.num_reserved_decode_tokens}")
        if self.cp_mini_batch != -1 and self.cp_mini_batch < 1:
            fail(self, "cp_mini_batch", f"must be -1 (no limit) or a positive integer, got {self.cp_mini_batch}")
        if not self.cpu_memory_gb > 0:
            fail(self, "cpu_memory_gb", f"must be > 0, got {self.cpu_memory_gb!r}")
        positive(self, "num_kv_blocks", optional=True)
        positive(self, "max_model_len", optional=True)
        if self.prefix_cache_slots < 0:
            fail(self, "prefix_cache_slots", f"must be >= 0 (0 = batch_size), got {self.prefix_cache_slots}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in CACHE_SETTINGS:
            fail(self, "kv_cache_dtype", f"expected 'auto' or one of {sorted(CACHE_SETTINGS)}, "
                                         f"got {self.kv_cache_dtype!r}")

    @property
    def cpu_memory_bytes(self) -> int:
        """``cpu_memory_gb`` in bytes (GiB = 2^30)."""
        return int(self.cpu_memory_gb * _GIB)


_SECTIONS: dict[str, type] = {"model_config": ModelConfig, "data_config": DataConfig,
                              "parallel_config": ParallelConfig, "scheduler_config": SchedulerConfig}


@dataclass(frozen=True)
class RunConfig:
    """A whole run config: the four sections plus the cross-section and DeepSeek-V4 checks."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    data_config: DataConfig = field(default_factory=DataConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
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
        """Checks that need the checkpoint's config.json (``config_checks.check_model_args``).
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
            raise ConfigError(f"{p}: run config is empty (expected a mapping of sections: {', '.join(_SECTIONS)})")
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
            raise ConfigError(f"top level: must be a mapping of sections ({', '.join(_SECTIONS)}), "
                              f"got {type_name(raw)}")
        kw = {}
        for key, value in raw.items():
            if key == "disagg_config":
                raise ConfigError("disagg_config: not a YAML section; the P/D role, bootstrap address and "
                                  "transfer backend come from launch-pd's command-line flags")
            if key not in _SECTIONS:
                raise ConfigError(f"{key}: unknown section{_suggest(key, _SECTIONS, top_level=True)}")
            kw[key] = _section_from_dict(_SECTIONS[key], value, key)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The YAML-shaped dict (inverse of from_dict); every key present, derived values not."""
        return dataclasses.asdict(self)


# ---- field helpers ---------------------------------------------------------------------------
def _section_from_dict(cls: type, raw: Any, path: str) -> Any:
    """One section (or custom_params) from its mapping; ``None`` (an empty YAML section) = defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: must be a mapping, got {type_name(raw)}")
    hints = field_hints(cls)
    for key in raw:
        if key not in hints:
            raise ConfigError(f"{path}.{key}: unknown key{_suggest(key, hints, section=path)}")
    return cls(**raw)


def _check_fields(obj: Any) -> None:
    """Type-check (and normalise: int -> float, mapping -> section) every field of a section."""
    for name, hint in field_hints(type(obj)).items():
        value = getattr(obj, name)
        new = coerce(f"{obj._PATH}.{name}", value, hint, _section_from_dict)
        if new is not value:
            object.__setattr__(obj, name, new)


def _suggest(key: Any, known: Any, section: str | None = None, top_level: bool = False) -> str:
    return unknown_key_hint(key, known, {**_SECTIONS, CustomParams._PATH: CustomParams}, section, top_level)
