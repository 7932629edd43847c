"""The ranks of one multi-rank worker instance: where they come from and how they meet.

A prefill or decode instance with ``parallel_config.world_size`` N > 1 runs N processes. They come
from torchrun-style environment variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``: torchrun, Slurm or a deployment script starts every rank), or,
with none set, ``launch-pd`` starts them itself: ``--nnodes`` / ``--node-rank`` /
``--nproc-per-node`` (default: all N on this node) with ``--master-addr`` / ``--master-port``.
Rank 0 is the leader (the worker the gateway talks to); the others follow it
(``engine.parallel.executor``). The step channel listens on ``--rank-port`` (default MASTER_PORT + 1).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from server.launch.local import term_with_parent

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
log = logging.getLogger(__name__)


class RankError(ValueError):
    """A bad rank setting; the message names the flag or variable."""


@dataclass(frozen=True)
class RankEnv:
    """One process's place in its instance."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    rank_port: int
    spawn: tuple[int, ...] = ()      # global ranks this process starts (launch-pd mode, rank 0 of a node)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def _int(name: str, v, lo: int, hi: int) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise RankError(f"{name}: {v!r} is not an integer") from None
    if not lo <= n <= hi:
        raise RankError(f"{name}: {n} must be in [{lo}, {hi}]")
    return n


def rank_env(world_size: int, nnodes: int = 1, node_rank: int = 0, nproc_per_node: int | None = None,
             master_addr: str | None = None, master_port: int | None = None, rank_port: int | None = None,
             environ=os.environ) -> RankEnv:
    """This process's rank from the environment (torchrun) or from the launch-pd flags.

    ``world_size``: parallel_config.world_size, which the environment's WORLD_SIZE must equal.
    Raises RankError naming the flag / variable / key.
    """
    addr = master_addr or environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _int("--master-port / MASTER_PORT", master_port or environ.get("MASTER_PORT") or 29500, 1, 65534)
    rport = _int("--rank-port", rank_port or port + 1, 1, 65535)
    if "RANK" in environ:
        rank = _int("RANK", environ["RANK"], 0, 1 << 20)
        world = _int("WORLD_SIZE", environ.get("WORLD_SIZE"), 1, 1 << 20)
        if world != world_size:
            raise RankError(f"WORLD_SIZE: {world}, but parallel_config.world_size is {world_size}")
        if rank >= world:
            raise RankError(f"RANK: {rank} must be < WORLD_SIZE ({world})")
        local = _int("LOCAL_RANK", environ.get("LOCAL_RANK", rank), 0, 1 << 20)
        return RankEnv(rank, world, local, addr, port, rport)
    nnodes = _int("--nnodes / NNODES", nnodes, 1, world_size)
    node_rank = _int("--node-rank / NODE_RANK", node_rank, 0, nnodes - 1)
    per = nproc_per_node if nproc_per_node is not None else world_size // nnodes
    per = _int("--nproc-per-node", per, 1, world_size)
    if per * nnodes != world_size:
        raise RankError(f"--nnodes {nnodes} x --nproc-per-node {per} must equal parallel_config.world_size "
                        f"({world_size})")
    first = node_rank * per
    return RankEnv(first, world_size, 0, addr, port, rport, spawn=tuple(range(first + 1, first + per)))


def spawn_ranks(env: RankEnv, argv: list[str]) -> dict[int, subprocess.Popen]:
    """Start this node's other ranks: ``launch-pd`` again with ``argv`` and RANK / WORLD_SIZE /
    LOCAL_RANK / MASTER_* set; each dies with this process (PR_SET_PDEATHSIG)."""
    procs = {}
    for r in env.spawn:
        child = dict(os.environ, RANK=str(r), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(r - env.rank),
                     MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port))
        procs[r] = subprocess.Popen([sys.executable, "-m", "server.launch.cli", *argv,
                                     "--rank-port", str(env.rank_port)], env=child, preexec_fn=term_with_parent)
    return procs


def init_distributed(env: RankEnv, device_kind: str, timeout_s: float) -> None:
    """``torch.distributed.init_process_group`` over MASTER_ADDR:MASTER_PORT (TCP store hosted by
    rank 0): HCCL on Ascend, NCCL on CUDA, gloo on CPU. ``timeout_s`` bounds each collective."""
    import torch.distributed as dist
    dist.init_process_group(BACKENDS.get(device_kind, "gloo"), init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def watch_children(procs: dict[int, subprocess.Popen], handler: dict) -> None:
    """From a daemon thread: the first spawned rank that exits calls ``handler["lost"](reason)``,
    or, while there is none yet (starting up: the leader may be blocked in a rendezvous that will
    never complete), ends this process at once (status 1)."""
    def run():
        while True:
            for r, p in procs.items():
                if p.poll() is not None:
                    reason = f"rank {r} (pid {p.pid}) exited with status {p.returncode}"
                    if handler.get("lost") is None:
                        log.error("%s while the instance started; exiting", reason)
                        os._exit(1)
                    handler["lost"](reason)
                    return
            time.sleep(0.1)
    threading.Thread(target=run, name="rank-children", daemon=True).start()


def check_same_config(run_config: dict, ckpt_config: bytes) -> None:
    """Every rank has the same run config (paths aside) and checkpoint config.json; call right
    after ``init_distributed`` (ranks that disagree would otherwise hang in their first sharding
    collective). Raises RankError naming the ranks that differ from rank 0."""
    import torch
    import torch.distributed as dist
    digest = hashlib.sha256(json.dumps(run_config, sort_keys=True, default=str).encode() + ckpt_config).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    bad = [r for r, d in enumerate(every) if not torch.equal(d, every[0])]
    if bad:
        raise RankError(f"ranks {bad} have another run config or checkpoint config.json than rank 0 "
                        f"(every rank of an instance needs the same --config and checkpoint)")
