"""Prefix caching of the decode state at 128-token boundaries (accounting only; no torch).

What a boundary state is (reference/dsv4-architecture.md §3-§4): at a position B that is a
multiple of 128 the HCA compressor's remainder is empty and the CSA compressors' hold only their
previous window, while CSA entries / indexer keys (one per 4 tokens) and HCA entries (one per
128) are final and append-only. So the state after B tokens is

  * the first ``B/4`` CSA and ``B/128`` HCA entries: blocks of the growing pools, SHARED by
    reference count with the request that made them and with every request that reuses them;
    a block the prefix fills only in part is copied into a block of the reusing request (which
    appends to it);
  * the window ring (the last 128 positions, every layer) and the compressor state slot: COPIED
    into a snapshot the entry owns (one ring + one slot: ~5 MiB for real Flash), and from it
    into the reusing request.

Reuse is exact: the reusing request continues from the very tensors a prefill of the prefix
left, as a chunked prefill with a chunk boundary at B would (SGLang's ShadowRadix and vLLM's
hybrid KV manager reuse DeepSeek-V4's state the same way; this keeps no per-token tree).

Which boundaries are kept: a request's last boundary before its final prompt token (a
follow-up turn re-sends the whole conversation) and the boundary where its prompt leaves the
chunks of the prefixes already cached (a shared system prompt or tool list: the second request
that shares it leaves a snapshot there, the third reuses it). Entries are keyed by a hash chain
over 128-token chunks (``chain_hashes``; the gateway's cache-aware routing hashes alike) and
evicted least recently used when a pool runs short; a block a running request holds is never
freed by an eviction (only its reference is dropped).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import HCA_RATIO

CHUNK = HCA_RATIO   # tokens per hashed chunk: a reusable boundary every 128 tokens


def chain_hashes(token_ids: Sequence[int], num_chunks: int) -> list[bytes]:
    """16-byte hashes of the first ``num_chunks`` 128-token chunks, each over its predecessor's
    hash and its tokens, so hash k names the whole prefix of ``(k + 1) * 128`` tokens (vLLM's
    block-hash chain). Stable across processes and platforms."""
    out, h = [], b""
    for k in range(num_chunks):
        h = hashlib.blake2b(h + array("q", token_ids[k * CHUNK:(k + 1) * CHUNK]).tobytes(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class PrefixEntry:
    """A cached boundary state: ``num_tokens`` (a multiple of 128), the blocks it holds
    (``engine.core.block_manager.SeqBlocks``: its own ring and state slot, shared entry blocks)
    and its prefix's chunk hashes. An MTP engine's runner also keeps, under the entry's key, the
    trunk's output streams at position ``num_tokens - 1`` (its carry, ``PoolOp`` "carry_save"),
    which a reusing request's MTP layer takes with ITS token at ``num_tokens`` to redo that one
    ring row: the row depends on the token after the boundary, which the key does not cover
    (``spec_decode.SpecDecoder.plan``)."""

    num_tokens: int
    blocks: object
    chain: tuple[bytes, ...]


@dataclass
class PrefixPlan:
    """A new request's use of the cache: ``hit`` (the entry key its state starts from; None: no
    hit), ``snapshots`` (boundaries to keep on the way, as
    (tokens, key), ascending, past the hit) and ``chain`` (its chunk hashes)."""

    hit: bytes | None = None
    snapshots: list[tuple[int, bytes]] = field(default_factory=list)
    chain: tuple[bytes, ...] = ()


class PrefixCache:
    """The entries of one set of pools, most recently used last, and the hit counters (tokens)."""

    def __init__(self):
        self.entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._known: Counter[bytes] = Counter()   # chunk hashes of every entry's prefix
        self.queries = 0        # prompt tokens looked up (tokens a hit could have covered)
        self.hits = 0           # prompt tokens whose state came from an entry
        self.evictions = 0

    def plan(self, token_ids: Sequence[int], num_tokens: int) -> PrefixPlan:
        """What a request of ``num_tokens`` tokens (``token_ids``, at least that many) reuses and
        keeps. The last token is always computed (its logits are the first sample's)."""
        n = (num_tokens - 1) // CHUNK
        chain = chain_hashes(token_ids, n)
        hit = next((k for k in range(n, 0, -1) if chain[k - 1] in self.entries), 0)
        shared = next((k for k in range(n) if chain[k] not in self._known), n)
        snaps = sorted({k for k in (shared, n) if k > hit})
        return PrefixPlan(chain[hit - 1] if hit else None, [(k * CHUNK, chain[k - 1]) for k in snaps], tuple(chain))

    def add(self, key: bytes, entry: PrefixEntry) -> None:
        self.entries[key] = entry
        self._known.update(entry.chain)

    def touch(self, key: bytes) -> PrefixEntry | None:
        """The entry under ``key``, now the most recently used (None: not cached)."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def pop_lru(self, keep: bytes | None = None, evicted: bool = True) -> tuple[bytes | None, PrefixEntry | None]:
        """Remove the least recently used entry other than ``keep``: (its key, it), or (None,
        None) when none is left; ``evicted``: count it in ``evictions`` (a reset does not)."""
        key = next((k for k in self.entries if k != keep), None)
        if key is None:
            return None, None
        entry = self.entries.pop(key)
        self.evictions += evicted
        for h in entry.chain:
            self._known[h] -= 1
            if not self._known[h]:
                del self._known[h]
        return key, entry

    def count(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit
