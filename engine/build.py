"""Run config + checkpoint -> a ready ``LLMEngine`` (what the offline mode and the workers start from)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ConfigError, ModelArgs
from engine.llm_engine import LLMEngine
from engine.run_config import RunConfig
from engine.weights import load_model

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


def build_engine(cfg: RunConfig, model_dir: str | Path | None = None, device: str = "cpu",
                 progress: bool = True) -> LLMEngine:
    """Load the checkpoint of ``model_config.model_path`` (or ``model_dir``) and size the engine
    from ``scheduler_config``.

    Raises:
        ConfigError: no model path, a checkpoint / config combination the run config forbids, or
            state pools too small for ``max_model_len``. CheckpointError: unreadable checkpoint.
    """
    path = Path(model_dir or cfg.model_config.model_path)
    if not str(path) or not path.is_dir():
        raise ConfigError(f"model_config.model_path: {str(path)!r} is not a checkpoint directory")
    model = load_model(path, dtype=DTYPES[cfg.model_config.dtype], device=device, progress=progress)
    cfg.check_model(model.args)
    s = cfg.scheduler_config
    max_len = cfg.max_model_len_for(model.args) if s.max_model_len is not None else None
    try:
        return LLMEngine.build(model, block_size=s.block_size, batch_size=cfg.batch_size_per_dp_rank,
                               max_prefill_tokens=cfg.effective_max_prefill_tokens, max_model_len=max_len,
                               mem_fraction_static=s.mem_fraction_static, cpu_memory_bytes=s.cpu_memory_bytes,
                               num_kv_blocks=s.num_kv_blocks, num_reserved_decode_tokens=s.num_reserved_decode_tokens,
                               eos_ids=eos_token_ids(path, model.args))
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("scheduler_config") else f"scheduler_config: {e}") from None
    except (RuntimeError, MemoryError) as e:    # a pool larger than the machine (e.g. num_kv_blocks)
        raise ConfigError(f"scheduler_config: cannot allocate the state pools ({str(e).splitlines()[0][:200]}); "
                          f"lower num_kv_blocks / batch_size / mem_fraction_static") from None
