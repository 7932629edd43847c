"""A leader and a follower engine of one instance in one process (``rank_pair``), and checks that
the follower's replay keeps its pools equal to the leader's (engine.parallel.executor)."""
from __future__ import annotations

import dataclasses
import threading

import torch

from engine.build import build_engine
from engine.parallel.executor import LeaderExecutor, RankExecutor, cache_layout
from engine.parallel.follower import follow
from engine.parallel.link import FollowerLink, LeaderLink
from engine.run_config import RunConfig
from server.launch.local import free_port


def rank_pair(ckpt, config: str, graph: bool = False):
    """A leader engine with a LeaderExecutor and a follower engine replaying it on a thread
    (world 1 models: no collectives, so this checks the replay alone). ``graph``: both decode
    through a graph runner (exe_mode npugraph_ex, its static step run uncompiled). Yields
    (leader, follower, the leader's executor)."""
    cfg = RunConfig.from_yaml(config)
    if graph:
        cfg = dataclasses.replace(cfg, model_config=dataclasses.replace(cfg.model_config, exe_mode="npugraph_ex"))
    port = free_port()
    link = LeaderLink("127.0.0.1", port, 2)
    leader = build_engine(cfg, ckpt, progress=False, executor=lambda m, c: LeaderExecutor(m, c, link), warmup=False)
    follower = build_engine(cfg, ckpt, progress=False, executor=RankExecutor, warmup=False)
    for eng in (leader, follower) if graph else ():
        eng.runner.use_eager()
    box = {}
    th = threading.Thread(target=lambda: box.update(link=FollowerLink("127.0.0.1", port, 1, cache_layout(follower))))
    th.start()
    link.wait_followers(cache_layout(leader), startup_s=30)
    th.join()
    mirror = leader.executor
    count, cond, logits, send = {"sent": 0, "seen": 0}, threading.Condition(), follower.executor.logits, link.send

    def sent(header, frames=(), to=None):
        count["sent"] += header["op"] == "logits"
        send(header, frames, to)

    def seen(hidden):                     # the follower has replayed everything up to this call
        out = logits(hidden)
        with cond:
            count["seen"] += 1
            cond.notify_all()
        return out
    link.send, follower.executor.logits = sent, seen      # the replayed logits calls (not a draft's)

    def replayed() -> bool:
        with cond:
            return cond.wait_for(lambda: count["seen"] == count["sent"], timeout=30)
    mirror.replayed = replayed
    runner = threading.Thread(target=follow, args=(follower.executor, box["link"]),
                              kwargs={"runner": follower.runner}, daemon=True)
    runner.start()
    yield leader, follower, mirror
    mirror.stop()
    runner.join(10)
    link.close()
    box["link"].close()


def sync(mirror):
    """Flush pending cache calls with a logits call and wait until the follower has replayed
    it (and so everything sent before it, in order)."""
    mirror.logits(torch.zeros(1, mirror.model.args.hidden_size))
    assert mirror.replayed(), "the follower did not replay within 30 s"


def pools_equal(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))
    assert {k: v.state_slot for k, v in a.seqs.items()} == {k: v.state_slot for k, v in b.seqs.items()}
    assert {k: v.tables for k, v in a.seqs.items()} == {k: v.tables for k, v in b.seqs.items()}
    assert a.num_free() == b.num_free()


def replay_mtp_requests(pair, reference) -> None:
    """Three MTP requests (greedy and sampled; one prompt past the 128-token window) on the
    leader of ``pair`` (``rank_pair``): after every step the follower's pools, MTP rings included,
    equal the leader's; drafts were verified, no rollback is left, and the tokens are
    ``reference``'s (an in-process next_n 0 engine)."""
    from engine.core.sampling_params import SamplingParams
    leader, follower, mirror = pair
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1000, 60000, (n,), generator=gen).tolist() for n in (131, 20, 64)]
    params = [SamplingParams(max_new_tokens=12, temperature=t, seed=i, ignore_eos=True)
              for i, t in enumerate((0.0, 0.8, 1.0))]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        leader.add_request(f"m{i}", p, sp)
    done = {f"m{i}": [] for i in range(3)}
    while leader.has_unfinished():
        for out in leader.step():
            done[out.request_id] += out.new_token_ids
        sync(mirror)
        pools_equal(leader.cache, follower.cache)
    assert leader.spec.stats.num_drafts > 0 and not mirror.rollbacks and not follower.executor.rollbacks
    want = reference.generate(prompts, params)
    assert [done[f"m{i}"] for i in range(3)] == [s.output_ids for s in want]
