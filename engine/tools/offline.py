"""``dsv4-offline``: run a JSONL dataset (InfiniteBench longbook_qa_eng shape) through the engine.

    dsv4-offline --config configs/tiny-flash.yaml --out out.jsonl
    dsv4-offline --model models/tiny-flash --dataset data/infinitebench_sample.jsonl --out out.jsonl

Each sample's prompt (``engine.tools.dataset.build_prompt``) is tokenised, middle-truncated to
``data_config.input_truncated_len`` tokens (as InfiniteBench does), rendered as one user turn in
chat (non-thinking) mode by DeepSeek's own format library (``deepseek_recipe``) and queued; all samples run through continuous batching.
One output line per sample, in dataset order: id, prompt / output token counts, output ids, text,
finish reason, TTFT and per-token latencies in seconds (from the moment the sample was queued).
The summary printed last is one JSON line; with ``model_config.next_n > 0`` it has a ``spec_decode``
object (MTP drafts proposed and accepted, acceptance rate, mean acceptance length: ``spec_summary``).
Exit codes: 0 done, 2 bad arguments / config / dataset (the message names the flag or key).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

import deepseek_recipe as dr

from engine.build import build_engine
from engine.checkpoint.shards import CheckpointError
from engine.config import ConfigError
from engine.run_config import RunConfig
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.tokenizer import Tokenizer, TokenizerError
from engine.tools.dataset import DatasetError, build_prompt, load_dataset, truncate_middle


TEMPLATE_TOKENS = 8          # chat-template ids around a prompt (BOS, role markers, </think>), with margin


def chat_encoding(model_dir: str | Path) -> dr.DeepseekV4Encoding:
    """DeepSeek's V4 prompt encoding with the checkpoint's tokenizer."""
    return dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))


def encode_sample(tok: Tokenizer, enc: dr.DeepseekV4Encoding, text: str, max_len: int) -> list[int]:
    """Prompt text -> the ids of one user turn in chat mode, the text middle-truncated to ``max_len`` tokens."""
    ids = truncate_middle(tok.encode(text), max_len)
    conv = dr.Conversation([dr.UserMessage(tok.decode(ids))], thinking_mode=False)
    return enc.encode(conv)


def spec_summary(stats, next_n: int) -> dict:
    """The summary's ``spec_decode`` object from an engine's ``SpecStats``: counts as vLLM names
    them, ``acceptance_rate`` (accepted / proposed drafts, 0..1) and ``mean_acceptance_length``
    (tokens per verify step, 1 + accepted drafts per step), both rounded to 4 decimals."""
    return {"next_n": next_n, "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4)}


def run(cfg: RunConfig, model_dir: str | None, dataset: str, out: str, limit: int | None = None,
        progress: bool = True) -> dict:
    """Run the dataset; write ``out``; return a summary (samples, tokens, seconds, tokens/s, and
    with next_n > 0 the MTP acceptance: ``spec_summary``)."""
    samples = load_dataset(dataset)[:limit]
    eng = build_engine(cfg, model_dir, progress=progress)
    tok = Tokenizer(model_dir or cfg.model_config.model_path)
    enc = chat_encoding(tok.model_dir)
    d, s = cfg.data_config, cfg.scheduler_config
    room = eng.limits.max_model_len - 1
    if room < TEMPLATE_TOKENS + 2:
        raise ConfigError(f"scheduler_config.max_model_len: {eng.limits.max_model_len} tokens leave no room for a "
                          f"templated prompt and an answer; use at least {TEMPLATE_TOKENS + 3}")
    ids = {f"s{i}": encode_sample(tok, enc, build_prompt(x), min(d.input_truncated_len, room - TEMPLATE_TOKENS - 1))
           for i, x in enumerate(samples)}
    t0 = time.perf_counter()
    for i, (rid, prompt) in enumerate(ids.items()):
        try:
            params = SamplingParams(max_new_tokens=max(1, min(s.max_new_tokens, room + 1 - len(prompt))),
                                    temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
                                    seed=None if d.seed is None else (d.seed + i) % (1 << 63))
        except SamplingError as e:
            raise ConfigError(f"data_config.{e}") from None
        eng.add_request(rid, prompt, params)
    seqs = dict(eng.seqs)
    bar = tqdm(total=len(ids), desc="offline", unit="sample", disable=not progress)
    while eng.has_unfinished():
        bar.update(sum(o.finished for o in eng.step()))
    bar.close()
    wall = time.perf_counter() - t0
    lines = []
    for i, (rid, x) in enumerate(zip(ids, samples)):
        q = seqs[rid]
        times = [q.arrival] + q.token_times
        lines.append({"id": x.id, "prompt_tokens": len(q.prompt_ids), "output_tokens": len(q.output_ids),
                      "output_ids": q.output_ids, "text": tok.decode(q.output_ids, skip_special_tokens=True),
                      "finish_reason": q.finish_reason.value, "answer": list(x.answer),
                      "ttft_s": round(q.first_token_time - q.arrival, 6),
                      "token_latencies_s": [round(b - a, 6) for a, b in zip(times, times[1:])]})
    _write_jsonl(Path(out), lines)
    n_out = sum(x["output_tokens"] for x in lines)
    summary = {"samples": len(lines), "prompt_tokens": sum(x["prompt_tokens"] for x in lines),
               "output_tokens": n_out, "seconds": round(wall, 3),
               "output_tokens_per_s": round(n_out / wall, 2) if wall else None,
               "preemptions": eng.scheduler.num_preemptions}
    if eng.spec is not None:
        summary["spec_decode"] = spec_summary(eng.spec.stats, eng.spec.next_n)
    return summary


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write atomically: a crash never leaves a half-written output file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-offline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="YAML run config (cann-recipes-infer schema)")
    ap.add_argument("--model", help="checkpoint directory (overrides model_config.model_path)")
    ap.add_argument("--dataset", help="JSONL dataset (overrides data_config.dataset_path)")
    ap.add_argument("--out", required=True, help="output JSONL")
    ap.add_argument("--limit", type=int, help="run only the first N samples")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"dsv4-offline: error: {msg}", file=sys.stderr)
        return 2

    if not a.config and not a.model:
        return fail("one of --config or --model is required")
    if a.limit is not None and a.limit < 1:
        return fail(f"--limit: must be >= 1, got {a.limit}")
    if a.model and not (Path(a.model) / "config.json").is_file():
        return fail(f"--model: {a.model!r} is not a checkpoint directory (no config.json)")
    out = Path(a.out)
    if not out.parent.is_dir():
        return fail(f"--out: directory {str(out.parent)!r} does not exist")
    if out.is_dir() or not os.access(out.parent, os.W_OK):
        return fail(f"--out: {a.out!r} is a directory or not writable")
    try:
        cfg = RunConfig.from_yaml(a.config) if a.config else RunConfig.from_dict({"model_config": {"dtype": "float32"}})
        dataset = a.dataset or cfg.data_config.dataset_path
        if not dataset:
            return fail("--dataset: no dataset given (and data_config.dataset_path is empty)")
        if cfg.data_config.dataset not in ("InfiniteBench", "default"):
            return fail(f"data_config.dataset: {cfg.data_config.dataset!r} is not supported by dsv4-offline "
                        f"(InfiniteBench longbook_qa_eng shape only)")
        summary = run(cfg, a.model, dataset, a.out, a.limit, progress=not a.no_progress)
    except (ConfigError, DatasetError, CheckpointError, TokenizerError, SamplingError) as e:
        return fail(str(e))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
