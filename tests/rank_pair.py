"""A leader and a follower engine of one instance in one process (``rank_pair``), and checks that
the follower, running the leader's plans, keeps its state pools equal to the leader's
(engine.parallel.leader / follower)."""
from __future__ import annotations

import dataclasses
import threading

import torch

from engine.build import build_engine
from engine.core.step import StepPlan
from engine.parallel.follower import follow
from engine.parallel.leader import LeaderRunner
from engine.parallel.link import FollowerLink, LeaderLink
from engine.parallel.rank_runner import RankRunner, cache_layout
from engine.run_config import RunConfig
from server.launch.local import free_port


class Mirror:
    """The pair's bookkeeping: messages the leader sent, messages the follower has handled."""

    def __init__(self, leader):
        self.leader, self.sent, self.seen, self.cond = leader, 0, 0, threading.Condition()

    def handled(self) -> None:
        with self.cond:
            self.seen += 1
            self.cond.notify_all()

    def replayed(self) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.seen == self.sent, timeout=30)


def rank_pair(ckpt, config: str, graph: bool = False):
    """A leader engine with a ``LeaderRunner`` and a follower engine running its plans on a thread
    (world 1 models: no collectives, so this checks the plans alone). ``graph``: both decode
    through a graph runner (exe_mode npugraph_ex, its static step run uncompiled). Yields
    (leader, follower, a ``Mirror``)."""
    cfg = RunConfig.from_yaml(config)
    if graph:
        cfg = dataclasses.replace(cfg, model_config=dataclasses.replace(cfg.model_config, exe_mode="npugraph_ex"))
    port = free_port()
    link = LeaderLink("127.0.0.1", port, 2)
    leader = build_engine(cfg, ckpt, progress=False, warmup=False, runner=lambda m, p, lim, plat, g: LeaderRunner(
        m, p, lim.max_model_len, lim.batch_size, plat, g, link))
    follower = build_engine(cfg, ckpt, progress=False, warmup=False, runner=lambda m, p, lim, plat, g: RankRunner(
        m, p, lim.max_model_len, lim.batch_size, plat, g, rank=1))
    for eng in (leader, follower) if graph else ():
        eng.runner.graph.use_eager()
    box = {}
    th = threading.Thread(target=lambda: box.update(link=FollowerLink("127.0.0.1", port, 1,
                                                                      cache_layout(follower.runner))))
    th.start()
    link.wait_followers(cache_layout(leader.runner), startup_s=30)
    th.join()
    mirror, send, flink = Mirror(leader), link.send, box["link"]
    recv, calls = flink.recv, [0]

    def sent(header, frames=(), to=None):
        mirror.sent += header["op"] != "stop"
        send(header, frames, to)

    def received():                       # the follower asks for the next message: the last is handled
        if calls[0]:
            mirror.handled()
        calls[0] += 1
        return recv()
    link.send, flink.recv = sent, received
    runner = threading.Thread(target=follow, args=(follower.runner, box["link"]), daemon=True)
    runner.start()
    yield leader, follower, mirror
    leader.runner.stop()
    runner.join(10)
    link.close()
    box["link"].close()


def sync(mirror):
    """Send the leader's pending pool changes (a plan of no rows) and wait until the follower has
    handled it (and so everything sent before it, in order)."""
    lead = mirror.leader
    lead.runner.execute(StepPlan(pool_ops=lead.cache.take_ops()))
    assert mirror.replayed(), "the follower did not follow within 30 s"


def pools_equal(leader, follower):
    """The two ranks' state pools hold the same bytes; the follower kept no accounting (its
    engine's blocks are all free: the plans carry the tables) and the same MTP carries."""
    ta, tb = leader.runner.pools.tensors(), follower.runner.pools.tensors()
    assert len(ta) == len(tb)
    for i, (x, y) in enumerate(zip(ta, tb)):
        assert x.shape == y.shape and x.dtype == y.dtype, (i, x.shape, y.shape, x.dtype, y.dtype)
        bx, by = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)     # NaN bits compare too
        if not torch.equal(bx, by):
            raise AssertionError(f"pool tensor {i}: {_first_diff(x, y)}")
    assert follower.cache.seqs == {} and follower.num_free_blocks() == follower.num_total_blocks()
    ca, cb = leader.runner.carries, follower.runner.carries
    assert list(ca) == list(cb) and all(torch.equal(ca[k], cb[k]) for k in ca)


def _first_diff(x: torch.Tensor, y: torch.Tensor) -> str:
    """Where two pool tensors of one shape differ, for the failure message."""
    fx, fy = (x.float(), y.float()) if x.is_floating_point() else (x, y)
    nan = (fx.isnan().sum().item(), fy.isnan().sum().item()) if x.is_floating_point() else (0, 0)
    diff = (fx != fy) & ~(fx.isnan() & fy.isnan()) if x.is_floating_point() else fx != fy
    return (f"{tuple(x.shape)} {x.dtype}: {int(diff.sum())} elements differ, first at {diff.nonzero()[:8].tolist()}; "
            f"NaN: {nan[0]} on the leader, {nan[1]} on the follower")


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
        pools_equal(leader, follower)
    assert leader.spec.stats.num_drafts > 0
    assert leader.runner.spans is None and follower.runner.spans is None
    want = reference.generate(prompts, params)
    assert [done[f"m{i}"] for i in range(3)] == [s.output_ids for s in want]
