"""Leader and follower sides of a multi-rank worker instance (``server.launch.ranks`` starts them).

Every rank's engine is built with its model runner (``engine.parallel``): the leader's is a
``LeaderRunner``, which sends each step's plan to the followers first, so the leader is the
ordinary prefill / decode worker over it; a follower runs the same steps through a ``RankRunner``. When a rank is lost (its process exits, its connection closes, or it misses
heartbeats for ``--rank-timeout-s``) the leader stops being ready at once and exits with status
1 after its current step, so the gateway sees a killed worker (samples before token #1 retried
elsewhere, later ones ended with an error event); a leader stuck in a collective with the dead
rank is ended 1 s later by a watchdog. A follower exits when the leader goes
away.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import zmq

from engine.parallel.follower import follow
from engine.parallel.leader import LeaderRunner
from engine.parallel.link import FollowerLink, LeaderLink, LinkError, watch
from engine.parallel.rank_runner import RankRunner, cache_layout
from kvtransfer.secure import secure_client, secure_server, stop_authenticator
from server.launch.local import stop_processes

log = logging.getLogger(__name__)


def _cp_fn(cfg):
    if cfg.parallel_config.cp_size == 1:
        return None
    from engine.parallel.cp import cp_prefill
    return cp_prefill


def _layout(cfg, prefill: bool, margs) -> dict:
    """The runner's parallel layout: decode runs attention DP over the ranks (upstream), prefill
    attention on every rank (+ CP)."""
    pc = cfg.parallel_config
    return {"dp": 1 if prefill else pc.attn_dp_size, "cp_prefill": _cp_fn(cfg) if prefill else None,
            "cp_min_tokens": 2 * pc.cp_size * margs.sliding_window}


def rank_runner(cfg, prefill: bool, rank: int):
    """A follower's runner factory (``build_engine``'s ``runner``): the leader's layout."""
    def make(model, pools, limits, platform, graph):
        kw = _layout(cfg, prefill, model.args)
        return RankRunner(model, pools, limits.max_model_len, limits.batch_size, platform, graph, rank, **kw)
    return make


class LeaderRanks:
    """Rank 0's view of its followers: the link (listening from construction), the leader's
    runner (``runner``: the factory to build the engine with) and the watch on every rank."""

    def __init__(self, renv, args, cfg, prefill: bool):
        self.renv, self.timeout_s, self.cfg, self.prefill = renv, args.rank_timeout_s, cfg, prefill
        self.dist_timeout_s = args.dist_timeout_s
        self.children = getattr(args, "children", {})
        secret = args.cluster_secret_value
        self.handler = args.rank_handler
        try:
            self.link = LeaderLink(renv.master_addr, renv.rank_port, renv.world_size, args.rank_timeout_s,
                                   secure=(lambda s: secure_server(s, secret)) if secret else None)
        except zmq.ZMQError as e:
            print(f"launch-pd: --rank-port: cannot listen on {renv.master_addr}:{renv.rank_port} ({e})",
                  file=sys.stderr, flush=True)
            os._exit(2)
        self.leader = None
        self.worker = None
        self.closing = False
        self.lost: str | None = None

    def runner(self, model, pools, limits, platform, graph) -> LeaderRunner:
        """The leader engine's runner (``build_engine``'s ``runner``)."""
        pc, prefill = self.cfg.parallel_config, self.prefill
        if pc.cp_size > 1 and not prefill:
            log.info("parallel_config.cp_size %d: context parallelism is for prefill; this decode instance "
                     "runs attention data parallel", pc.cp_size)
        self.leader = LeaderRunner(model, pools, limits.max_model_len, limits.batch_size, platform, graph,
                                   self.link, on_failure=self._lost, **_layout(self.cfg, prefill, model.args))
        return self.leader

    def wait_followers(self, engine) -> None:
        """Until every follower has said hello with ``engine``'s layout (exits naming a missing or
        different rank); then the graph warm-up, whose collectives the followers run after their
        hello (``run_follower``)."""
        try:
            self.link.wait_followers(cache_layout(engine.runner), self.dist_timeout_s)
        except LinkError as e:
            self.close()
            raise SystemExit(f"launch-pd: {e}") from None
        engine.runner.warmup()

    def attach(self, worker) -> None:
        """Watch the ranks on behalf of ``worker`` (its ``rank_lost`` is called once)."""
        self.worker = worker
        worker.parallel_info = self.info
        watch(self.link.sock, self.link.ctx, self._lost, "leader", fds=self.link.fds)
        self.handler["lost"] = self._lost             # spawned ranks (server.launch.ranks.watch_children)

    def info(self) -> dict:
        """For /health: the layout and every rank's process."""
        ranks = [{"rank": 0, "pid": os.getpid()}] + [
            {"rank": r, "pid": h.get("pid"), "host": h.get("host")} for r, h in sorted(self.link.hellos.items())]
        m = self.leader
        out = {"world_size": self.renv.world_size, "attention": "dp" if m.dp_size > 1 else "replicated",
               "ranks": ranks, "cp_prefills": m.cp_runs}
        if m.dp_size > 1:
            out["dp_requests_total"] = list(self.worker.engine.cache.placed)
        return out

    def _lost(self, reason: str) -> None:
        if self.closing or self.lost is not None:
            return
        self.lost = reason
        log.error("rank lost: %s; the instance leaves routing", reason)
        if self.worker is not None:
            self.worker.rank_lost(reason)
        # a leader blocked in a collective with the dead rank (gloo does not always see a closed
        # peer at once) cannot run its loop: end it after a short grace
        threading.Timer(1.0, lambda: os._exit(1)).start()

    def close(self) -> None:
        self.closing = True
        if getattr(self, "leader", None) is not None and self.lost is None:
            self.leader.stop()
        time.sleep(0.1)
        self.link.close(stop_authenticator)
        stop_processes(self.children.values(), 10)


def start_ranks(renv, args, cfg, prefill: bool) -> tuple[LeaderRanks | None, object]:
    """This rank's part: (rank 0's ``LeaderRanks``, listening; None on a follower) and the factory
    of its engine's model runner (``build_engine``'s ``runner``)."""
    if renv.leader:
        ranks = LeaderRanks(renv, args, cfg, prefill)
        return ranks, ranks.runner
    return None, rank_runner(cfg, prefill, renv.rank)


def run_follower(engine, renv, args, cfg) -> int:
    """Replay the leader's steps until it says stop (0) or goes away (1)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C: the leader drains and stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)         # end now, even inside a collective
    try:
        secret = args.cluster_secret_value
        link = FollowerLink(renv.master_addr, renv.rank_port, renv.rank, cache_layout(engine.runner), args.rank_timeout_s,
                            startup_s=args.dist_timeout_s,
                            secure=(lambda s: secure_client(s, secret)) if secret else None)
    except LinkError as e:
        log.error("%s", e)
        return 1

    def lost(reason: str) -> None:
        log.error("rank %d: leader lost (%s); exiting", renv.rank, reason)
        os._exit(1)
    watch(link.sock, link.ctx, lost, f"rank{renv.rank}")
    engine.runner.warmup()               # after the hello: the leader checks the layout before any collective
    log.info("rank %d following the leader at %s:%d", renv.rank, renv.master_addr, renv.rank_port)
    follow(engine.runner, link)
    log.info("rank %d: stopped by the leader", renv.rank)
    os._exit(0)                          # do not run torch.distributed's teardown against a gone leader
