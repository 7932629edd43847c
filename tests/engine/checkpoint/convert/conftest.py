"""The package's checkpoints: the tiny flash original and its conversion to every quant type (once for
the package: converting is the expensive part)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoint import convert_model as cm
from engine.checkpoint.qscheme import QUANT_TYPES


@pytest.fixture(scope="package")
def orig(tiny_ckpt) -> Path:
    return Path(tiny_ckpt("flash", 1))


@pytest.fixture(scope="package")
def converted(orig, tmp_path_factory):
    out = {}
    for qt in QUANT_TYPES:
        out[qt] = cm.convert_model(orig, tmp_path_factory.mktemp("cv") / qt, qt, progress=False)
    return out
