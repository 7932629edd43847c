"""Shared fixtures: tiny checkpoints written by dsv4-make-tiny (once per session)."""
from __future__ import annotations

import pytest

from engine.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: ``tiny_ckpt(preset, seed)`` -> path of a tiny checkpoint (cached per session)."""
    cache: dict[tuple[str, int], object] = {}

    def get(preset: str = "flash", seed: int = 1):
        key = (preset, seed)
        if key not in cache:
            cache[key] = make_tiny(preset, seed, tmp_path_factory.mktemp(f"tiny-{preset}-{seed}"))
        return cache[key]

    return get
