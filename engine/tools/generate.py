"""``dsv4-generate``: greedy generation on one device with the real tokenizer.

    dsv4-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N
                  [--dtype fp32|bf16] [--json]

``--prompt`` is tokenised with BOS prepended; ``--prompt-ids`` are used as given. Generation stops
at the config's ``eos_token_id`` or after N tokens. ``--json`` prints ``{"prompt_ids": [...], "output_ids": [...], "text": ...}``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from engine.checkpoint.loader import load_model
from engine.checkpoint.shards import CheckpointError
from engine.config import ConfigError, ModelArgs
from engine.model.transformer import Transformer
from engine.tokenizer import Tokenizer, TokenizerError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class NonFiniteLogits(RuntimeError):
    """NaN / inf logits: broken weights or config values; never turned into tokens."""


def generate_greedy(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                    eos_id: int | None = None, prefill_chunk: int = 8192) -> list[int]:
    """Greedy decoding: chunked prefill of ``prompt_ids``, then one token per step.

    Args:
        prompt_ids: non-empty list of ids in ``[0, vocab_size)``.
        max_new_tokens: tokens to generate at most (>= 0). eos_id: stop after emitting it.
        prefill_chunk: prompt tokens per forward (bounds activation memory).
    Returns:
        generated ids (the EOS included when it ends the output).
    Raises:
        ValueError: empty prompt, or an id outside the vocabulary.
    """
    V = model.args.vocab_size
    if not prompt_ids:
        raise ValueError("prompt_ids: must not be empty")
    bad = [i for i in prompt_ids if not 0 <= i < V]
    if bad:
        raise ValueError(f"prompt_ids: ids must be in [0, {V}), found {bad[:5]}")
    if max_new_tokens <= 0:
        return []
    state = model.new_state()
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    for s in range(0, len(prompt_ids), prefill_chunk):
        hidden = model(prompt[s:s + prefill_chunk], state)
    out: list[int] = []
    logits = model.logits(hidden[-1:])
    while True:
        if not torch.isfinite(logits).all():
            raise NonFiniteLogits(f"the model produced non-finite logits at position {state.num_tokens - 1}")
        out.append(int(logits.argmax(-1)))
        if len(out) >= max_new_tokens or (eos_id is not None and out[-1] == eos_id):
            return out
        logits = model.logits(model(torch.tensor(out[-1:]), state))



def _parse_ids(text: str, vocab_size: int) -> list[int]:
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise ValueError("--prompt-ids: expected at least one id")
    if not all(re.fullmatch(r"[0-9]+", t) for t in items):
        raise ValueError(f"--prompt-ids: expected comma-separated integers, found {text!r}")
    ids = [int(t) for t in items]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--prompt-ids: ids must be in [0, {vocab_size}), found {bad[:5]}")
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4-generate", description="Greedy DeepSeek-V4 generation (CPU or device).")
    p.add_argument("--model", required=True, help="checkpoint directory (original DeepSeek-V4 layout)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (BOS is prepended)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, used as given")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--json", action="store_true", help="print prompt_ids, output_ids and text as JSON")
    a = p.parse_args(argv)
    try:
        if a.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens: must be >= 0, found {a.max_new_tokens}")
        if not a.model or not Path(a.model).is_dir():
            raise ValueError(f"--model: directory {a.model!r} does not exist")
        args = ModelArgs.from_json(a.model)
        tok = Tokenizer(a.model)
        if a.prompt_ids is not None:
            prompt_ids = _parse_ids(a.prompt_ids, args.vocab_size)
        else:
            try:
                a.prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("--prompt: not valid UTF-8 text") from None
            prompt_ids = tok.encode(a.prompt, add_bos=True)
        if len(prompt_ids) + a.max_new_tokens > args.max_position_embeddings:
            raise ValueError(f"--max-new-tokens: prompt ({len(prompt_ids)} tokens) + {a.max_new_tokens} new tokens "
                             f"exceeds the model's max_position_embeddings ({args.max_position_embeddings})")
        model = load_model(a.model, DTYPES[a.dtype])
        out = generate_greedy(model, prompt_ids, a.max_new_tokens, args.eos_token_id)
    except (ValueError, ConfigError, CheckpointError, TokenizerError) as e:
        print(f"dsv4-generate: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLogits as e:
        print(f"dsv4-generate: error: {e}", file=sys.stderr)
        return 1
    text = tok.decode(out)
    if a.json:
        print(json.dumps({"prompt_ids": prompt_ids, "output_ids": out, "text": text}, ensure_ascii=False))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
