"""Which prefill instance computes a sample: ``cache_aware`` (default), ``least_load``, ``round_robin``.

``cache_aware`` is SGLang's router policy of the same name, on DeepSeek-V4's cache unit: the
gateway keeps, per prefill instance, the 128-token chunk hashes of the prompts it sent there
(``engine.core.prefix_cache.chain_hashes``, the key the workers' prefix caches use), and sends a
prompt to the instance expected to hold its longest prefix when that covers more than
``cache_threshold`` of the prompt's chunks and that instance is not busier than the least-loaded
one by more than ``balance_abs`` samples; otherwise to the least-loaded instance, ties going to the
one that holds the least (SGLang's cache threshold, balance threshold and smallest-tree rule: new
conversations sharing only a system prompt spread out, follow-up turns stay). The index is approximate: it learns what a worker evicts only by missing it
there (its entries age out least recently used first), and forgets an instance that is lost or
restarts. Instances without prefix caching (their
pong says ``prefix_caching``) are chosen by load alone.
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import count

from engine.core.prefix_cache import CHUNK, chain_hashes
from server.backends.instances import Instance

POLICIES = ("cache_aware", "least_load", "round_robin")


class PrefillRouter:
    """Args: policy (one of ``POLICIES``); max_hashes: chunk hashes remembered per instance;
    balance_abs: how many more samples (in flight + queued) than the least-loaded instance a
    cache hit may cost; cache_threshold: the fraction of a prompt's chunks a hit must cover.
    Raises ValueError on an unknown policy."""

    def __init__(self, policy: str = "cache_aware", max_hashes: int = 1 << 18, balance_abs: int = 4,
                 cache_threshold: float = 0.5):
        if policy not in POLICIES:
            raise ValueError(f"prefill routing: expected one of {POLICIES}, got {policy!r}")
        self.policy, self.max_hashes, self.balance_abs = policy, max_hashes, balance_abs
        self.cache_threshold = cache_threshold
        self._index: dict[str, OrderedDict[bytes, None]] = {}
        self._turn = count()
        self.routed = self.by_prefix = 0       # samples routed; of which to the longest expected prefix

    def choose(self, candidates: list[Instance], prompt_ids: list[int]) -> Instance:
        """The instance of ``candidates`` (healthy, non-empty) to prefill ``prompt_ids``."""
        self.routed += 1
        if self.policy == "round_robin":
            return sorted(candidates, key=lambda i: i.addr)[next(self._turn) % len(candidates)]
        caching = [i for i in candidates if i.load.get("prefix_caching")]
        if self.policy == "least_load" or not caching:
            return min(candidates, key=Instance.score)
        least = min(candidates, key=lambda i: (i.score(), len(self._index.get(i.addr, ()))))
        chain = chain_hashes(prompt_ids, (len(prompt_ids) - 1) // CHUNK)
        best, hit = max(((i, self.expected_hit(i.addr, chain)) for i in caching),
                        key=lambda ih: (ih[1], -ih[0].score()))
        good = hit > self.cache_threshold * len(chain) and best.score() - least.score() <= self.balance_abs
        pick = best if good else least
        self.by_prefix += good
        self._remember(pick.addr, chain)
        return pick

    def expected_hit(self, addr: str, chain: list[bytes]) -> int:
        """Leading chunks of ``chain`` sent to ``addr`` before (tokens = 128 x this)."""
        seen = self._index.get(addr, {})
        return next((k for k, h in enumerate(chain) if h not in seen), len(chain))

    def forget(self, addr: str) -> None:
        """Drop what ``addr`` was sent (it restarted, or was lost)."""
        self._index.pop(addr, None)

    def _remember(self, addr: str, chain: list[bytes]) -> None:
        seen = self._index.setdefault(addr, OrderedDict())
        for h in chain:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_hashes:
            seen.popitem(last=False)
