"""Prefix caching on a multi-rank instance: every rank makes each entry's snapshot, each hit's
copies and drops each evicted entry's carry (the leader's accounting records them as the plan's
``PoolOp`` s, every rank's runner applies them), so a follower's pools stay the leader's, MTP
rings and carried streams included, and the tokens are an uncached single-rank engine's."""
from __future__ import annotations

import random

import pytest
import torch

from engine.core.prefix_cache import CHUNK
from engine.core.sampling_params import SamplingParams
from rank_pair import pools_equal, rank_pair, sync


def _config(tmp_path, src: str, slots: int) -> str:
    text = open(src).read().replace("scheduler_config:\n", f"scheduler_config:\n  enable_prefix_caching: True\n"
                                                          f"  prefix_cache_slots: {slots}\n  max_prefill_tokens: 200\n", 1)
    text = text.replace("  max_prefill_tokens: 2048\n", "").replace("  batch_size: 8\n", "  batch_size: 2\n")
    out = tmp_path / "prefix.yaml"
    out.write_text(text)
    return str(out)


def _entries_equal(leader, follower) -> None:
    """Every rank holds the carried streams of exactly the leader's entries (MTP), the same bytes."""
    entries, ca, cb = leader.cache.prefix.entries, leader.runner.carries, follower.runner.carries
    assert set(ca) == set(cb) == (set(entries) if leader.spec is not None else set())
    for k in ca:
        assert torch.equal(ca[k], cb[k])


@pytest.mark.parametrize("config, graph", [("configs/tiny-flash.yaml", False), ("configs/tiny-flash-mtp.yaml", False),
                                           ("configs/tiny-flash-mtp.yaml", True)])
def test_a_follower_replays_snapshots_hits_and_evictions(ckpt, reference, tmp_path, config, graph):
    """Two conversations x 3 turns over a shared 256-token system prompt, greedy and seeded, with
    one entry slot beyond the 2 requests' (entries are evicted): after every step the follower's
    pools and entries (MTP carries included) equal the leader's; later turns hit, the second
    conversation at 256 with its own token there; tokens are the uncached engine's; a reset on
    the leader reaches the follower and every block is free again. ``graph``: short chunks and
    decode through the graph runner (its static step run uncompiled)."""
    pair = rank_pair(ckpt, _config(tmp_path, config, 1), graph=graph)
    leader, follower, mirror = next(pair)
    try:
        rng = random.Random(7)
        V = leader.model.args.vocab_size
        sys_p = [rng.randrange(1000, V) for _ in range(256)]
        prompts = [sys_p + [rng.randrange(1000, V) for _ in range(rng.randint(20, 120))] for _ in range(2)]
        cached = []
        for turn in range(3):
            params = [SamplingParams(max_new_tokens=5, temperature=t, seed=turn, ignore_eos=True) for t in (0.0, 0.8)]
            want = [reference.generate([p], q)[0].output_ids for p, q in zip(prompts, params)]
            for i, (p, q) in enumerate(zip(prompts, params)):
                leader.add_request(f"t{turn}c{i}", p, q)
            got = {}
            while leader.has_unfinished():
                for out in leader.step():
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finished:
                        cached.append(out.num_cached_tokens)
                sync(mirror)
                pools_equal(leader, follower)
                _entries_equal(leader, follower)
            assert [got[f"t{turn}c{i}"] for i in range(2)] == want
            prompts = [p + got[f"t{turn}c{i}"] + [rng.randrange(1000, V) for _ in range(40)]
                       for i, p in enumerate(prompts)]
        assert cached[2:] == [2 * CHUNK] * 4 and leader.cache.prefix.evictions > 0   # one conversation: its own token at 256
        assert leader.reset_prefix_cache() > 0                  # what POST /reset_prefix_cache calls
        sync(mirror)
        pools_equal(leader, follower)
        assert not follower.runner.carries and not leader.cache.prefix.entries
        assert follower.num_free_blocks() == follower.num_total_blocks() == leader.num_free_blocks()
    finally:
        next(pair, None)                                        # rank_pair's teardown
