"""The weights digest: any changed tensor byte changes it; the per-shard cache (name + size +
mtime_ns) is reused when nothing changed, re-hashed when a shard's size or mtime changed, and kept
in the user cache directory when the checkpoint directory cannot be written."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint.digest import CACHE_FILE, weights_digest
from engine.checkpoint.shards import CheckpointError


def _ckpt(d: Path) -> Path:
    d.mkdir()
    save_file({"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, 8)}, str(d / "model-00001.safetensors"))
    save_file({"c": torch.zeros(16, dtype=torch.bfloat16)}, str(d / "model-00002.safetensors"))
    (d / "config.json").write_text("{}")
    return d


def _flip_last_byte(path: Path) -> None:
    """One tensor byte changes (the last byte of the data section), the size does not."""
    with path.open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_changed_tensor_byte_changes_the_digest_and_only_its_shard_is_hashed_again(tmp_path):
    ckpt = _ckpt(tmp_path / "ckpt")
    first = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert first.value.startswith("sha256:") and len(first.value) == len("sha256:") + 64
    assert first.hashed == ("model-00001.safetensors", "model-00002.safetensors") and first.cache == ckpt / CACHE_FILE
    _flip_last_byte(ckpt / "model-00002.safetensors")
    second = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert second.value != first.value and second.hashed == ("model-00002.safetensors",)
    _flip_last_byte(ckpt / "model-00002.safetensors")              # back to the original bytes
    assert weights_digest(ckpt, cache_dir=tmp_path / "cache").value == first.value


def test_the_cache_is_reused_when_nothing_changed_and_rehashed_on_size_or_mtime(tmp_path):
    ckpt = _ckpt(tmp_path / "ckpt")
    first = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    again = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert again.value == first.value and again.hashed == () and again.nbytes == 0
    shard = ckpt / "model-00001.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))     # touched: hashed again, same bytes
    touched = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert touched.hashed == ("model-00001.safetensors",) and touched.value == first.value
    save_file({"a": torch.arange(65, dtype=torch.float32), "b": torch.ones(8, 8)}, str(shard))   # other size
    grown = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert grown.hashed == ("model-00001.safetensors",) and grown.value != first.value
    entry = json.loads((ckpt / CACHE_FILE).read_text())["shards"]["model-00001.safetensors"]
    assert entry["size"] == shard.stat().st_size and entry["mtime_ns"] == shard.stat().st_mtime_ns


def test_the_cache_trusts_size_and_mtime(tmp_path):
    """What the key promises, and no more: bytes rewritten with the old size and mtime restored
    are not noticed (as make / rsync would not); deleting the cache file re-hashes."""
    ckpt = _ckpt(tmp_path / "ckpt")
    first = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    shard = ckpt / "model-00002.safetensors"
    st = shard.stat()
    _flip_last_byte(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_digest(ckpt, cache_dir=tmp_path / "cache").value == first.value
    (ckpt / CACHE_FILE).unlink()
    assert weights_digest(ckpt, cache_dir=tmp_path / "cache").value != first.value


def test_an_unwritable_checkpoint_dir_keeps_the_cache_in_the_user_cache_dir(tmp_path):
    ckpt = _ckpt(tmp_path / "ckpt")
    (ckpt / CACHE_FILE).mkdir()          # the cache's name is taken: writing beside fails (even as root)
    first = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert first.cache is not None and first.cache.parent == tmp_path / "cache" and first.cache.is_file()
    again = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert again.hashed == () and again.value == first.value and again.cache == first.cache
    elsewhere = weights_digest(ckpt, cache_dir=tmp_path / "other")   # no cache there: hashed, same value
    assert elsewhere.hashed and elsewhere.value == first.value


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_a_read_only_checkpoint_dir_keeps_the_cache_in_the_user_cache_dir(tmp_path):
    ckpt = _ckpt(tmp_path / "ckpt")
    ckpt.chmod(0o555)
    try:
        first = weights_digest(ckpt, cache_dir=tmp_path / "cache")
        assert first.cache.parent == tmp_path / "cache" and not (ckpt / CACHE_FILE).exists()
        assert weights_digest(ckpt, cache_dir=tmp_path / "cache").hashed == ()
    finally:
        ckpt.chmod(0o755)


def test_the_shards_of_the_index_and_errors(tmp_path):
    ckpt = _ckpt(tmp_path / "ckpt")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"c": "model-00002.safetensors"}}))
    d = weights_digest(ckpt, cache_dir=tmp_path / "cache")
    assert d.hashed == ("model-00002.safetensors",)           # what the loader reads, nothing else
    (ckpt / "model-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002.safetensors"):
        weights_digest(ckpt, cache_dir=tmp_path / "cache")
