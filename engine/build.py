"""Run config + checkpoint -> a ready ``LLMEngine`` (what the offline mode and the workers start from)."""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from engine.cache_dtype import CacheDtype
from engine.config import ConfigError, ModelArgs
from engine.core.grammar import GrammarBackend
from engine.core.graph_runner import ExecConfig
from engine.core.llm_engine import LLMEngine
from engine.ops import ops_for, residual_dtype_for
from engine.platform import detect
from engine.run_config import RunConfig, check_min_ranks
from engine.checkpoint.loader import load_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def eos_token_ids(ckpt_dir: str | Path, args: ModelArgs) -> tuple[int, ...]:
    """EOS ids: config.json's plus generation_config.json's (an int or a list), as vLLM unions them."""
    ids = {args.eos_token_id}
    gen = Path(ckpt_dir) / "generation_config.json"
    if gen.is_file():
        try:
            v = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError, OSError):
            v = None
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < args.vocab_size:
                ids.add(t)
    return tuple(sorted(ids))


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build the CPU graph step's kernels with ($CXX, else g++,
    c++ or clang++ on PATH); None without one."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def resolve_exe_mode(mode: str, kind: str) -> str:
    """``model_config.exe_mode`` on a platform ``kind`` (cpu | cuda | npu): ``auto`` is the
    captured step (npugraph_ex) on a device and on a CPU with a C++ compiler; on a CPU without one
    eager (logged: inductor cannot build the step's kernels there). Other modes as given."""
    if mode != "auto":
        return mode
    if kind == "cpu" and cpp_compiler() is None:
        log.warning("model_config.exe_mode auto: no C++ compiler ($CXX, g++, c++, clang++) for inductor's CPU "
                    "kernels, so decode runs eager (install g++, or set exe_mode: eager to silence this)")
        return "eager"
    return "npugraph_ex"


def exec_config(cfg: RunConfig, kind: str = "cpu") -> ExecConfig:
    """The run config's execution keys as an ``ExecConfig`` on platform ``kind`` (``exe_mode``
    auto resolved by ``resolve_exe_mode``). A multi-rank instance captures its decode step too:
    every rank runs the same bucket of rows, the step's collectives inside it (the graph step's
    ``rows_mode``)."""
    m, cp = cfg.model_config, cfg.model_config.custom_params
    mode = resolve_exe_mode(m.exe_mode, kind)
    return ExecConfig(exe_mode=mode, multi_streams=cp.enable_multi_streams, limit_core=cp.enable_limit_core,
                      static_kernel=m.enable_static_kernel, cache_compile=m.enable_cache_compile,
                      compile_dir=m.output_path, dynamic_graph=m.enable_dynamic_graph, superkernel=cp.enable_superkernel,
                      batch_sizes=None if m.graph_batch_sizes is None else tuple(m.graph_batch_sizes))


def check_platform_version(cfg: RunConfig, found: str | None) -> None:
    """The run config against the Ascend generation found on the device (``Platform.
    platform_version``; None: unknown SoC). Raises ConfigError naming the key: a
    ``model_config.platform_version`` other than the device's, or A3-only options
    (enable_limit_core, enable_pypto) on another generation."""
    m, cp = cfg.model_config, cfg.model_config.custom_params
    if m.platform_version is not None and found is not None and m.platform_version != found:
        raise ConfigError(f"model_config.platform_version: {m.platform_version!r}, but the device is {found!r}")
    version = m.platform_version or found
    for name in ("enable_limit_core", "enable_pypto"):
        if getattr(cp, name) and version not in (None, "A3"):
            raise ConfigError(f"model_config.custom_params.{name}: A3 only, but the device is {version!r}")


def check_cache_platform(cache: CacheDtype, version: str | None) -> None:
    """A2 / A3 have no FP8 / HiF8 arithmetic: their caches are bf16 KV with a bf16 or int8 indexer
    (reference §7). Raises ConfigError naming ``scheduler_config.kv_cache_dtype``."""
    if version in ("A2", "A3") and {cache.kv, cache.indexer} & {"fp8", "hif8"}:
        raise ConfigError(f"scheduler_config.kv_cache_dtype: {cache.describe()} needs FP8 / HiF8 caches, which "
                          f"Ascend {version} lacks (950 only); use int8 (int8 indexer, bf16 KV) or bfloat16")


def build_engine(cfg: RunConfig, model_dir: str | Path | None = None, device: str = "cpu",
                 progress: bool = True, graph: bool = True, rank: int = 0,
                 runner=None, warmup: bool = True) -> LLMEngine:
    """Load the checkpoint of ``model_config.model_path`` (or ``model_dir``) and size the engine
    from ``scheduler_config``; with a graph ``exe_mode`` (and ``graph``: False for a prefill-only
    worker, which always runs eager) compile / capture the decode step now.

    ``device``: a spec for ``engine.platform.detect`` ("cpu", "cuda:0", "npu:0", "auto").
    ``rank``: with ``parallel_config.world_size`` > 1, this process's rank; torch.distributed must
    be initialised: the model is sharded for it (``engine.parallel.shard.apply_parallel``).
    ``runner``: (model, pools, limits, platform, graph) -> the engine's model runner (None:
    ``ModelRunner``, this process only). A multi-rank instance passes its rank's
    (``server.launch.rank_worker``: ``engine.parallel``'s ``LeaderRunner`` on rank 0, a
    ``RankRunner`` on the others).
    ``warmup``: False leaves the compile / capture to the caller (``engine.runner.warmup()``): a
    multi-rank instance warms up only after every rank has shown the same cache layout, since the
    warm-up steps run the model's collectives.
    Raises:
        ConfigError: no model path, a checkpoint / config combination the run config forbids, or
            state pools too small for ``max_model_len``. CheckpointError: unreadable checkpoint.
        PlatformError: the device is not available.
    """
    path = Path(model_dir or cfg.model_config.model_path)
    if not str(path) or not path.is_dir():
        raise ConfigError(f"model_config.model_path: {str(path)!r} is not a checkpoint directory")
    plat = detect(device)
    _check_ranks(cfg)
    cp, ex = cfg.model_config.custom_params, exec_config(cfg, plat.kind)
    if plat.kind == "npu":
        check_platform_version(cfg, plat.platform_version)
    elif ex.limit_core:
        log.info("custom_params.enable_limit_core: Ascend A3 only; no effect on %s", plat.kind)
    pc = cfg.parallel_config

    def check(model) -> None:
        cfg.check_model(model.args)
        if plat.kind == "npu":
            version = cfg.model_config.platform_version or plat.platform_version
            check_min_ranks(cfg, model.args, version)
            check_cache_platform(cfg.cache_dtype_for(model.args), version)
        if pc.world_size > 1:            # shard before loading: a rank reads and holds its shard only
            from engine.parallel.shard import apply_parallel
            apply_parallel(model, pc, rank)

    model = load_model(path, dtype=DTYPES[cfg.model_config.dtype], device=plat.device,
                       ops=ops_for(plat.kind, cp.kernel_config, compiled=ex.graph), progress=progress, shard=check,
                       mtp=cfg.model_config.next_n > 0, num_layers=cp.num_hidden_layers,
                       max_position_embeddings=cp.max_position_embeddings)
    if plat.kind == "cpu" and ex.graph:
        from engine.ops.cpu import prepare
        prepare(model)
    model.configure(cp.moe_chunk_max_len, plat, cp.enable_multi_streams,
                    residual_dtype_for(plat.kind, DTYPES[cfg.model_config.dtype]))
    eos = eos_token_ids(path, model.args)
    grammar = GrammarBackend(path, model.args.vocab_size, eos)
    gx = ex if graph and ex.graph else None

    def make_runner(model, pools, limits):
        if runner is not None:
            return runner(model, pools, limits, plat, gx)
        from engine.core.model_runner import ModelRunner
        return ModelRunner(model, pools, limits.max_model_len, limits.batch_size, plat, gx)

    engine = _size(cfg, model, path, make_runner, eos, grammar)
    if warmup:
        engine.runner.warmup()
    return engine


def _check_ranks(cfg: RunConfig) -> None:
    import torch.distributed as dist
    n = cfg.parallel_config.world_size
    have = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if n != have:
        raise ConfigError(f"parallel_config.world_size: {n} ranks need torch.distributed with that many "
                          f"processes (launch-pd --role prefill|decode starts them); this process has {have}")


def _size(cfg: RunConfig, model, path: Path, runner, eos: tuple[int, ...], grammar: GrammarBackend) -> LLMEngine:
    s = cfg.scheduler_config
    max_len = cfg.max_model_len_for(model.args) if s.max_model_len is not None else None
    try:
        return LLMEngine.build(model, block_size=s.block_size, batch_size=cfg.batch_size_per_dp_rank,
                               max_prefill_tokens=cfg.effective_max_prefill_tokens, max_model_len=max_len,
                               mem_fraction_static=s.mem_fraction_static, cpu_memory_bytes=s.cpu_memory_bytes,
                               num_kv_blocks=s.num_kv_blocks, num_reserved_decode_tokens=s.num_reserved_decode_tokens,
                               eos_ids=eos, runner=runner, grammar=grammar,
                               cache_dtype=cfg.cache_dtype_for(model.args), next_n=cfg.model_config.next_n,
                               prefix_slots=(s.prefix_cache_slots or cfg.batch_size_per_dp_rank)
                               if s.enable_prefix_caching else None)
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("scheduler_config") else f"scheduler_config: {e}") from None
    except (RuntimeError, MemoryError) as e:    # a pool larger than the machine (e.g. num_kv_blocks)
        raise ConfigError(f"scheduler_config: cannot allocate the state pools ({str(e).splitlines()[0][:200]}); "
                          f"lower num_kv_blocks / batch_size / mem_fraction_static") from None
