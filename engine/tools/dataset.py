"""Offline prompts: InfiniteBench ``longbook_qa_eng``-shaped JSONL, and a synthetic sample of it.

A line of InfiniteBench (HF ``xinrongzhang2022/InfiniteBench``, ``longbook_qa_eng.jsonl``) is one
JSON object: ``id`` (int), ``context`` (the book), ``input`` (the question), ``answer`` (list of
strings) and ``options`` (list of strings, empty for qa_eng). Prompts use InfiniteBench's
longbook_qa_eng template for chat models (OpenBMB/InfiniteBench src/prompt.py, ``gpt4_templates``)
and long prompts are cut in the middle of their token ids (src/eval_utils.py ``truncate_input``).

``write_sample_infinitebench`` makes a small deterministic stand-in (no download): book-like text
with one planted fact, and a question whose answer is that fact.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.config import read_text_file

KINDS = ("InfiniteBench",)
LONGBOOK_QA_ENG_TEMPLATE = ("Read the book below and answer a question.\n\n{context}\n\n"
                            "Question: {question}\n\nBe very concise.")


class DatasetError(ValueError):
    """A dataset file is missing or malformed. The message names the file, line and field."""


@dataclass(frozen=True)
class Sample:
    """One longbook_qa_eng example."""

    id: int
    context: str
    input: str
    answer: tuple[str, ...]
    options: tuple[str, ...] = ()


# ---- reading ---------------------------------------------------------------------------------
def load_dataset(path: str | Path, kind: str = "InfiniteBench") -> list[Sample]:
    """Read a longbook_qa_eng-shaped JSONL file (blank lines skipped; extra keys ignored).

    Returns: the samples in file order.
    Raises:
        DatasetError: unknown ``kind``; missing / unreadable / empty file; a line that is not a
            JSON object, lacks a key or has a wrong type (message: ``<file>:<line>: <field> ...``).
    """
    if kind not in KINDS:
        raise DatasetError(f"dataset kind {kind!r} is not supported (supported: {', '.join(KINDS)})")
    p = Path(path)
    text = read_text_file(p, DatasetError, "dataset file")
    samples = [_parse_line(line, f"{p}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not samples:
        raise DatasetError(f"{p}: dataset has no samples")
    return samples


def _parse_line(line: str, where: str) -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("id", "context", "input", "answer", "options"):
        if key not in obj:
            raise DatasetError(f"{where}: missing field '{key}'")
    if isinstance(obj["id"], bool) or not isinstance(obj["id"], int):
        raise DatasetError(f"{where}: field 'id' must be an integer, got {obj['id']!r}")
    for key in ("context", "input"):
        if not isinstance(obj[key], str):
            raise DatasetError(f"{where}: field '{key}' must be a string, got {type(obj[key]).__name__}")
        try:
            obj[key].encode("utf-8")
        except UnicodeEncodeError:      # a lone surrogate (\ud800) in the JSON
            raise DatasetError(f"{where}: field '{key}' is not valid Unicode text (lone surrogate)") from None
    for key in ("answer", "options"):
        v = obj[key]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise DatasetError(f"{where}: field '{key}' must be a list of strings, got {v!r}")
    return Sample(obj["id"], obj["context"], obj["input"], tuple(obj["answer"]), tuple(obj["options"]))


# ---- prompts ---------------------------------------------------------------------------------
def build_prompt(sample: Sample) -> str:
    """The longbook_qa_eng prompt: instruction, the book (``context``), the question (``input``)."""
    return LONGBOOK_QA_ENG_TEMPLATE.format(context=sample.context, question=sample.input)


def truncate_middle(ids: list[int], max_len: int) -> list[int]:
    """Keep the first ``max_len // 2`` and the last ``max_len - max_len // 2`` token ids.

    Returns ``ids`` unchanged (a copy) when it already fits. Raises ValueError if max_len < 0.
    """
    if max_len < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    if len(ids) <= max_len:
        return list(ids)
    head = max_len // 2
    tail = max_len - head
    return list(ids[:head]) + (list(ids[-tail:]) if tail else [])


# ---- the synthetic sample --------------------------------------------------------------------
_NAMES = ("Aldric", "Brenna", "Corwin", "Delphine", "Edmund", "Fiora", "Gideon", "Helena", "Ivo",
          "Jessamy", "Kester", "Lucinda", "Marek", "Nerys", "Osric", "Perpetua", "Quentin", "Rowena")
_PLACES = ("the mill", "the harbour", "the old chapel", "the orchard", "the lighthouse", "the market square",
           "the library", "the ferry landing", "the forge", "the north tower", "the inn", "the granary")
_OBJECTS = ("a brass compass", "a silver key", "a sealed letter", "a blue lantern", "a copper locket",
            "a leather map", "an ivory chess piece", "a broken watch", "a jar of honey", "a green ribbon")
_VERBS = ("walked to", "waited near", "hurried past", "looked for", "spoke of", "remembered", "returned to",
          "sketched", "avoided", "cleaned")
_TIMES = ("At dawn", "Before supper", "In the evening", "On the third day", "Later that week", "By midnight",
          "After the storm", "During the fair")
_MOODS = ("quietly", "with some reluctance", "in high spirits", "without a word", "as the bells rang",
          "while the rain fell", "for the last time", "with great care")
_WEATHER = ("The wind came off the sea and rattled the shutters.", "Fog lay thick over the fields.",
            "The river ran high and brown with the spring melt.", "Snow settled softly on the rooftops.",
            "The sun was warm on the stones of the square.")


def _sentence(rng: random.Random) -> str:
    """One filler sentence of the synthetic book."""
    roll = rng.random()
    if roll < 0.15:
        return rng.choice(_WEATHER)
    if roll < 0.55:
        return (f"{rng.choice(_TIMES)}, {rng.choice(_NAMES)} {rng.choice(_VERBS)} {rng.choice(_PLACES)} "
                f"{rng.choice(_MOODS)}.")
    if roll < 0.8:
        return (f"{rng.choice(_NAMES)} told {rng.choice(_NAMES)} about {rng.choice(_OBJECTS)} "
                f"seen near {rng.choice(_PLACES)}.")
    return f"Nobody in {rng.choice(_PLACES)} had heard from {rng.choice(_NAMES)} since the winter."


def _make_sample(i: int, rng: random.Random, context_words: tuple[int, int]) -> dict:
    target = rng.randint(*context_words)
    sentences: list[str] = []
    words = 0
    while words < target:
        s = _sentence(rng)
        sentences.append(s)
        words += len(s.split())
    who, what, where = rng.choice(_NAMES), rng.choice(_OBJECTS), rng.choice(_PLACES)
    fact = f"{who} hid {what} in {where}, and told no one."
    sentences.insert(rng.randint(0, len(sentences)), fact)
    paragraphs, k = [], 0
    while k < len(sentences):                       # paragraphs of 3-7 sentences
        n = rng.randint(3, 7)
        paragraphs.append(" ".join(sentences[k:k + n]))
        k += n
    return {"id": i, "context": "\n\n".join(paragraphs), "input": f"Where did {who} hide {what}?",
            "answer": [where], "options": []}


def write_sample_infinitebench(path: str | Path, num_samples: int = 8, seed: int = 0,
                               context_words: tuple[int, int] = (200, 1500)) -> Path:
    """Write ``num_samples`` synthetic longbook_qa_eng lines to ``path`` (JSONL, UTF-8, ``\\n``).

    Each context has between ``context_words[0]`` and about ``context_words[1]`` words (plus the
    planted fact); the same arguments give byte-identical files. The file is replaced atomically
    (temporary file in the same folder, then ``os.replace``); parent folders are created.

    Returns: the path written. Raises ValueError for num_samples < 1 or a bad word range.
    """
    lo, hi = context_words
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 1 <= lo <= hi:
        raise ValueError(f"context_words must be (lo, hi) with 1 <= lo <= hi, got {context_words}")
    rng = random.Random(seed)
    lines = [json.dumps(_make_sample(i, rng, (lo, hi)), ensure_ascii=False) + "\n" for i in range(num_samples)]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write("".join(lines).encode("utf-8"))
        os.chmod(tmp, 0o644)                        # mkstemp makes it 0600
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
