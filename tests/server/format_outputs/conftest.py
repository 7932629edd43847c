"""The gateway under test, built once for every test of the output corpora (``stack``)."""
from __future__ import annotations

import deepseek_recipe as dr
import pytest

from engine.tokenizer import Tokenizer
from server.gateway.dsformat import DeepSeekFormat
from server.gateway.app import create_app

from .corpus import MODEL
from .harness import Scripted, Stack


@pytest.fixture(scope="package")
def stack(tiny_ckpt) -> Stack:
    ckpt = tiny_ckpt("flash", 1)
    tok = Tokenizer(ckpt)
    backend = Scripted()
    fmt = DeepSeekFormat(ckpt, MODEL)
    return Stack(tok, dr.Tokenizer.from_file(str(ckpt / "tokenizer.json")), fmt, backend,
                 create_app(backend, tok, MODEL, fmt=fmt))
