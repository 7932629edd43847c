"""The YAML run config's four sections (and ``custom_params``): fields, defaults, per-section checks.

``engine.run_config`` puts them together into a ``RunConfig`` and re-exports them; they live here so
that the whole-config checks there can name their types without an import cycle. Every bad value
raises ``ConfigError`` whose message starts with the full key path.
"""
from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.cache_dtype import SETTINGS as CACHE_SETTINGS
from engine.config import ConfigError
from engine.checkpoint.qscheme import QUANT_TYPES
from engine.config_checks import (choice, coerce, fail, field_hints, in_range, positive, type_name,
                                  unknown_key_hint)
from engine.kernel_config import validate_kernel_config

DTYPES = ("bfloat16", "float32", "float16")
EXE_MODES = ("auto", "eager", "ge_graph", "npugraph_ex")
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
    # auto | eager | ge_graph | npugraph_ex (decode only; prefill is eager). auto: the captured step
    # (npugraph_ex) on a device, and on CPU where inductor finds a C++ compiler, else eager. The
    # default is upstream's (eager): a cann-recipes-infer YAML means here what it means there
    exe_mode: str = "eager"
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


SECTIONS: dict[str, type] = {"model_config": ModelConfig, "data_config": DataConfig,
                              "parallel_config": ParallelConfig, "scheduler_config": SchedulerConfig}


# ---- field helpers ---------------------------------------------------------------------------
def section_from_dict(cls: type, raw: Any, path: str) -> Any:
    """One section (or custom_params) from its mapping; ``None`` (an empty YAML section) = defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: must be a mapping, got {type_name(raw)}")
    hints = field_hints(cls)
    for key in raw:
        if key not in hints:
            raise ConfigError(f"{path}.{key}: unknown key{suggest_key(key, hints, section=path)}")
    return cls(**raw)


def _check_fields(obj: Any) -> None:
    """Type-check (and normalise: int -> float, mapping -> section) every field of a section."""
    for name, hint in field_hints(type(obj)).items():
        value = getattr(obj, name)
        new = coerce(f"{obj._PATH}.{name}", value, hint, section_from_dict)
        if new is not value:
            object.__setattr__(obj, name, new)


def suggest_key(key: Any, known: Any, section: str | None = None, top_level: bool = False) -> str:
    """' (did you mean ...?)' for an unknown key (``config_checks.unknown_key_hint`` over the sections)."""
    return unknown_key_hint(key, known, {**SECTIONS, CustomParams._PATH: CustomParams}, section, top_level)
