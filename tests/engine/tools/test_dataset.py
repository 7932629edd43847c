"""InfiniteBench longbook_qa_eng-shaped JSONL: the shipped sample, the loader's errors, prompt, truncation."""
import json
from pathlib import Path

import pytest

from engine.tools.dataset import (DatasetError, Sample, build_prompt, load_dataset, truncate_middle,
                                  write_sample_infinitebench)

SHIPPED = Path(__file__).resolve().parents[3] / "data" / "infinitebench_sample.jsonl"
GOOD = {"id": 0, "context": "A book.", "input": "What?", "answer": ["this"], "options": []}


def test_shipped_sample_is_regenerated_byte_identical(tmp_path):
    out = write_sample_infinitebench(tmp_path / "sub" / "s.jsonl")     # defaults: 8 samples, seed 0
    assert out.read_bytes() == SHIPPED.read_bytes()


def test_determinism_and_seed(tmp_path):
    a = write_sample_infinitebench(tmp_path / "a.jsonl", num_samples=3, seed=5, context_words=(50, 80))
    b = write_sample_infinitebench(tmp_path / "b.jsonl", num_samples=3, seed=5, context_words=(50, 80))
    c = write_sample_infinitebench(tmp_path / "c.jsonl", num_samples=3, seed=6, context_words=(50, 80))
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "c.jsonl"]   # no temp files


def test_sample_shape_and_planted_fact():
    samples = load_dataset(SHIPPED)
    assert len(samples) == 8 and [s.id for s in samples] == list(range(8))
    for line in SHIPPED.read_text().splitlines():
        assert list(json.loads(line)) == ["id", "context", "input", "answer", "options"]
    for s in samples:
        assert 200 <= len(s.context.split()) <= 1500 + 30
        assert s.options == () and len(s.answer) == 1
        who, what = s.input.removeprefix("Where did ").removesuffix("?").split(" hide ")
        assert f"{who} hid {what} in {s.answer[0]}" in s.context            # the answer is in the book


def test_prompt_contains_context_and_question():
    s = load_dataset(SHIPPED)[0]
    p = build_prompt(s)
    assert p.startswith("Read the book below and answer a question.\n\n" + s.context)
    assert p.endswith(f"\n\nQuestion: {s.input}\n\nBe very concise.")


@pytest.mark.parametrize("ids, n, expected", [
    (list(range(10)), 4, [0, 1, 8, 9]),
    (list(range(10)), 5, [0, 1, 7, 8, 9]),             # odd: the tail gets the extra token
    (list(range(10)), 1, [9]),
    (list(range(10)), 0, []),
    (list(range(10)), 10, list(range(10))),
    (list(range(3)), 8, [0, 1, 2]),
])
def test_truncate_middle(ids, n, expected):
    out = truncate_middle(ids, n)
    assert out == expected and len(out) == min(len(ids), n)


def test_truncate_middle_rejects_negative_and_copies():
    with pytest.raises(ValueError, match="max_len"):
        truncate_middle([1, 2], -1)
    ids = [1, 2]
    assert truncate_middle(ids, 5) is not ids


def _write(tmp_path, lines) -> Path:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return f


@pytest.mark.parametrize("bad, message", [
    ("{not json\n", ":2: invalid JSON"),
    ("[1, 2]\n", ":2: expected a JSON object, got list"),
    ({k: v for k, v in GOOD.items() if k != "input"}, ":2: missing field 'input'"),
    ({k: v for k, v in GOOD.items() if k != "options"}, ":2: missing field 'options'"),
    (dict(GOOD, id="0"), ":2: field 'id' must be an integer"),
    (dict(GOOD, id=True), ":2: field 'id' must be an integer"),
    (dict(GOOD, context=None), ":2: field 'context' must be a string, got NoneType"),
    (dict(GOOD, answer="this"), ":2: field 'answer' must be a list of strings"),
    (dict(GOOD, answer=[1]), ":2: field 'answer' must be a list of strings"),
    (dict(GOOD, options=None), ":2: field 'options' must be a list of strings"),
])
def test_loader_errors_name_line_and_field(tmp_path, bad, message):
    f = _write(tmp_path, [GOOD, bad])
    with pytest.raises(DatasetError) as e:
        load_dataset(f)
    assert str(e.value).startswith(f"{f}{message}")


def test_loader_file_errors(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="has no samples"):
        load_dataset(_write(tmp_path, ["\n", "  \n"]))
    with pytest.raises(DatasetError, match="'LongBench' is not supported"):
        load_dataset(SHIPPED, kind="LongBench")


def test_loader_skips_blank_lines_and_ignores_extra_keys(tmp_path):
    f = _write(tmp_path, ["\n", dict(GOOD, length=7), "\n", dict(GOOD, id=1, options=["a", "b"])])
    assert load_dataset(f) == [Sample(0, "A book.", "What?", ("this",)),
                               Sample(1, "A book.", "What?", ("this",), ("a", "b"))]


def test_write_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="num_samples"):
        write_sample_infinitebench(tmp_path / "x.jsonl", num_samples=0)
    with pytest.raises(ValueError, match="context_words"):
        write_sample_infinitebench(tmp_path / "x.jsonl", context_words=(10, 5))
