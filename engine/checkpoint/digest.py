"""The weights digest: one string that changes when any byte of any weight shard changes.

Two instances pair for a state transfer only when they run the same weights, and config.json
alone cannot say so (a fine-tune, a different conversion, a re-quantisation keep the config).
So each shard is hashed whole (its safetensors header and every tensor byte) with sha256, and the
digest is sha256 over the sorted (shard name, size, shard sha256) list: ``"sha256:<64 hex>"``.

Cost: one sequential read of the checkpoint, done once. sha256 (OpenSSL, SHA-NI) measured
1300-1430 MB/s on one core of the development machine from the page cache (blake2b: about
850 MB/s, so sha256 it is); a cached start took 0.5 ms. Shards are hashed on up to ``workers``
threads (hashlib releases the GIL; the scaling was not measurable on the development machine's two
shared cores), so a cold start is bounded by the disk or by one core per thread: ~150 GB of
V4-Flash in ~40-60 shards is about two minutes on one core, a ~800 GB V4-Pro about ten.

Cache: per shard, keyed by file name + size + mtime_ns (what make and rsync trust), so a second
start reads no tensor byte and an edited or replaced shard is hashed again. The cache is a JSON
file beside the checkpoint (``.dsv4-weights-digest.json``; dot-named, so ``dsv4-convert-model``
does not copy it), or, where the checkpoint directory cannot be written (a read-only mount,
another user's files), in the user cache directory: ``$DSV4_CACHE_DIR``, else
``$XDG_CACHE_HOME/dsv4-pd``, else ``~/.cache/dsv4-pd``, one file per checkpoint path. Two
processes hashing the same checkpoint at once (a prefill and a decode starting together) both
hash and both write; each write is atomic (a temporary file renamed), so readers never see half.

Multi-rank instances: a rank reads only its slices of the weights, so no rank sees every byte;
the instance's leader (rank 0) hashes the whole checkpoint once (``server.launch.roles``) while
the ranks load, and only the leader takes part in transfers and the gateway's pairing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.shards import CheckpointError, shard_files

log = logging.getLogger(__name__)

CACHE_FILE = ".dsv4-weights-digest.json"
ALGO = "sha256"
_VERSION = 1


@dataclass(frozen=True)
class WeightsDigest:
    """``value``: ``"sha256:<64 hex>"``. ``hashed``: the shard names read this time (empty when
    the cache held every one). ``nbytes`` / ``seconds``: bytes hashed and wall time (s).
    ``cache``: where the cache was written or found valid (None: nowhere could be written)."""

    value: str
    hashed: tuple[str, ...]
    nbytes: int
    seconds: float
    cache: Path | None


def user_cache_dir() -> Path:
    """``$DSV4_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsv4-pd``, else ``~/.cache/dsv4-pd``."""
    if os.environ.get("DSV4_CACHE_DIR"):
        return Path(os.environ["DSV4_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4-pd"


def _user_cache_file(ckpt: Path, cache_dir: Path | None) -> Path:
    key = hashlib.sha256(str(ckpt.resolve()).encode()).hexdigest()[:16]
    return (cache_dir or user_cache_dir()) / f"weights-digest-{ckpt.resolve().name}-{key}.json"


def _read_cache(path: Path) -> dict[str, dict]:
    """The shard entries of a cache file ({} when absent, unreadable or of another version)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION or data.get("algo") != ALGO:
        return {}
    shards = data.get("shards")
    return shards if isinstance(shards, dict) else {}


def _write_cache(path: Path, shards: dict[str, dict]) -> bool:
    """Atomically write the cache file; False when the directory cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".dsv4-digest-", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": _VERSION, "algo": ALGO, "shards": shards}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    except OSError:
        return False


def _vouches(entry, now: dict) -> bool:
    """A cache entry still describes the shard: same size and mtime_ns, with a digest."""
    return isinstance(entry, dict) and entry.get("size") == now["size"] and entry.get("mtime_ns") == now["mtime_ns"] \
        and isinstance(entry.get("digest"), str)


def _hash_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, ALGO).hexdigest()


def weights_digest(ckpt_dir: str | Path, cache_dir: str | Path | None = None,
                   workers: int | None = None) -> WeightsDigest:
    """The checkpoint's weights digest, hashing only shards the cache does not vouch for.

    Args:
        ckpt_dir: the checkpoint directory (the shards ``shards.shard_files`` names).
        cache_dir: where the cache goes when the checkpoint directory cannot be written (None:
            ``user_cache_dir()``).
        workers: threads hashing shards at once (None: min(8, CPU count)).
    Returns:
        ``WeightsDigest`` (the value, what was hashed, bytes, seconds).
    Raises:
        CheckpointError: no shards / a malformed index, or a shard that cannot be read.
    """
    t0 = time.perf_counter()
    ckpt = Path(ckpt_dir)
    names, _ = shard_files(ckpt)
    beside, user = ckpt / CACHE_FILE, _user_cache_file(ckpt, None if cache_dir is None else Path(cache_dir))
    caches = {beside: _read_cache(beside), user: _read_cache(user)}
    entries: dict[str, dict] = {}
    for name in names:
        try:
            st = (ckpt / name).stat()
        except OSError as e:
            raise CheckpointError(f"checkpoint: shard {name} cannot be read: {e}") from None
        entries[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        for c in caches.values():
            if _vouches(c.get(name), entries[name]):
                entries[name]["digest"] = c[name]["digest"]
                break
    stale = [n for n in names if "digest" not in entries[n]]
    try:
        with ThreadPoolExecutor(max(1, min(workers or min(8, os.cpu_count() or 1), len(stale) or 1))) as ex:
            for name, d in zip(stale, ex.map(lambda n: _hash_file(ckpt / n), stale)):
                entries[name]["digest"] = d
    except OSError as e:
        raise CheckpointError(f"checkpoint: a shard cannot be read for the weights digest: {e}") from None
    where = next((p for p, c in caches.items() if all(_vouches(c.get(n), entries[n]) for n in names)), None)
    if where is None:            # the first start, or a shard changed: write beside, else the user cache
        where = next((p for p in (beside, user) if _write_cache(p, entries)), None)
    blob = json.dumps([[n, entries[n]["size"], entries[n]["digest"]] for n in names], separators=(",", ":"))
    out = WeightsDigest(f"{ALGO}:{hashlib.sha256(blob.encode()).hexdigest()}", tuple(stale),
                        sum(entries[n]["size"] for n in stale), time.perf_counter() - t0, where)
    if stale:
        log.info("weights digest: hashed %d of %d shards, %.2f GB in %.1f s (%.0f MB/s); cache %s", len(stale),
                 len(names), out.nbytes / 1e9, out.seconds, out.nbytes / 1e6 / max(out.seconds, 1e-9), where)
    return out
