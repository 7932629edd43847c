"""engine.detokenizer: incremental decoding never splits a character and matches a full decode."""
from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

TEXT = "你好，世界！天气🌤️不错 👨‍👩‍👧 emoji 🚀🚀 and 漢字かなカナ — naïve café ∑x² done"


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer(tiny_ckpt("flash", 1))


def run(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    return [d.push(i) for i in ids] + [d.flush()]


@pytest.mark.parametrize("prompt", [None, [0, 128803], "chat"])
def test_concatenation_equals_full_decode(tok, prompt):
    if prompt == "chat":
        prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>写一首诗<｜Assistant｜><think>")
    ids = tok.encode(TEXT)
    pieces = run(tok, ids, prompt_ids=prompt)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # the text really does split characters across tokens
    assert sum("\ufffd" in tok.decode([i]) for i in ids) > 0


def test_holds_back_partial_character(tok):
    ids = tok.encode("🚀")
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok)
    assert [d.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1]) == "🚀"
    assert d.flush() == ""


def test_flush_emits_incomplete_tail(tok):
    ids = tok.encode("ab🚀")[:-1]
    pieces = run(tok, ids)
    assert "".join(pieces) == tok.decode(ids) and pieces[-1].endswith("\ufffd")


def test_special_tokens(tok):
    ids = tok.encode("R</think>A") + [tok.eos_id]
    assert "".join(run(tok, ids)) == "R</think>A"
    assert "".join(run(tok, ids, skip_special_tokens=False)) == "R</think>A<｜end▁of▁sentence｜>"


def test_decodes_a_small_window_not_the_whole_sequence(tok):
    class Counting:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, skip_special_tokens=False):
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens)

    c = Counting()
    ids = tok.encode(TEXT * 20)
    assert "".join(run(c, ids)) == TEXT * 20
    assert len(ids) > 400 and c.longest <= 8
