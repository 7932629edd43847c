"""Multi-rank plumbing without collectives: rank settings, the step channel, and the follower,
running the leader's plans, keeping its state pools equal to the leader's (engine.parallel)."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.build import build_engine, check_min_ranks
from engine.config import ConfigError
from engine.parallel.link import FollowerLink, LeaderLink, LinkError, decode, encode
from engine.core.pd_state import sequence_state_tensors
from engine.run_config import ParallelConfig, RunConfig, SchedulerConfig
from engine.core.sampling_params import SamplingParams
from server.launch.local import free_port
from server.launch.ranks import RankError, rank_env
from rank_pair import pools_equal, rank_pair, replay_mtp_requests, sync

CONFIG = "configs/tiny-flash.yaml"


# ---- rank settings -------------------------------------------------------------------------------
def test_rank_env_from_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    r = rank_env(4, environ=env)
    assert (r.rank, r.world_size, r.local_rank, r.master_addr, r.master_port, r.rank_port, r.spawn) == \
        (3, 4, 1, "10.0.0.1", 29600, 29601, ())
    assert not r.leader


def test_rank_env_from_launch_flags_spawns_the_node_ranks():
    r = rank_env(4, environ={})
    assert (r.rank, r.spawn, r.master_addr, r.master_port) == (0, (1, 2, 3), "127.0.0.1", 29500)
    r = rank_env(8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=4000, environ={})
    assert (r.rank, r.spawn, r.rank_port) == (4, (5, 6, 7), 4001)


@pytest.mark.parametrize("kw, env, msg", [
    ({}, {"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE: 2, but parallel_config.world_size is 4"),
    ({}, {"RANK": "4", "WORLD_SIZE": "4"}, "RANK: 4 must be < WORLD_SIZE (4)"),
    ({}, {"RANK": "x", "WORLD_SIZE": "4"}, "RANK: 'x' is not an integer"),
    ({"nnodes": 3}, {}, "--nnodes 3 x --nproc-per-node 1 must equal parallel_config.world_size (4)"),
    ({"nnodes": 2, "node_rank": 2}, {}, "--node-rank / NODE_RANK: 2 must be in [0, 1]"),
    ({"master_port": 70000}, {}, "--master-port / MASTER_PORT: 70000 must be in [1, 65534]"),
    ({"nnodes": "two"}, {}, "--nnodes / NNODES: 'two' is not an integer"),
])
def test_rank_env_errors_name_the_setting(kw, env, msg):
    with pytest.raises(RankError) as e:
        rank_env(4, environ=env, **kw)
    assert msg in str(e.value)


def test_platform_minimums_count_a3_dies_and_950_chips():
    """Published minimums (reference/peers.md): A3 Flash 4 chips, Pro 32; 950 Flash 4, Pro 16. An
    A3 chip is two 64 GB dies, each a rank: Flash needs 8 A3 ranks, Pro 64; a 950 chip is one rank."""
    def cfg(n):
        return RunConfig(parallel_config=ParallelConfig(world_size=n), scheduler_config=SchedulerConfig(batch_size=n))
    args = type("A", (), {"hidden_size": 7168})()
    check_min_ranks(cfg(16), args, "950")                   # Pro on 950: 16 chips = 16 ranks
    check_min_ranks(cfg(64), args, "A3")                    # Pro on A3: 32 chips = 64 dies
    with pytest.raises(ConfigError, match=r"parallel_config.world_size: DeepSeek-V4-Pro on A3 needs at least "
                                          r"32 chips = 64 ranks .*two 64 GB dies per A3 chip.*, got 32"):
        check_min_ranks(cfg(32), args, "A3")
    args.hidden_size = 4096
    check_min_ranks(cfg(8), args, "A3")
    check_min_ranks(cfg(8), args, None)                     # no platform_version: A3, the default
    with pytest.raises(ConfigError, match=r"DeepSeek-V4-Flash on A3 needs at least 4 chips = 8 ranks .*, got 4"):
        check_min_ranks(cfg(4), args, "A3")
    check_min_ranks(cfg(4), args, "950")
    with pytest.raises(ConfigError, match=r"DeepSeek-V4-Flash on 950 needs at least 4 chips = 4 ranks "
                                          r"\(.*one rank per 950 chip\), got 1"):
        check_min_ranks(RunConfig(), args, "950")
    check_min_ranks(RunConfig(), args, "A2")                # no published A2 minimum
    args.hidden_size = 256                                  # the tiny models: no minimum
    check_min_ranks(RunConfig(), args, "A3")


# ---- the step channel ----------------------------------------------------------------------------
@pytest.mark.parametrize("t", [torch.randn(3, 5), torch.randn(2, 4).to(torch.bfloat16),
                               torch.arange(7), torch.empty(0, 9)])
def test_tensor_frames_round_trip(t):
    meta, buf = encode(t)
    back = decode(meta, buf)
    assert back.dtype == t.dtype and torch.equal(back, t)
    with pytest.raises(LinkError, match="bytes, expected"):
        decode(meta, buf + b"x")
    with pytest.raises(LinkError, match="is not a torch dtype"):
        decode(["Tensor", [1]], b"")


def test_leader_refuses_a_follower_with_another_layout():
    port = free_port()
    leader = LeaderLink("127.0.0.1", port, 2)
    out = {}

    def follower():
        try:
            FollowerLink("127.0.0.1", port, 1, {"block_size": 64}, startup_s=3)
        except LinkError as e:
            out["follower"] = str(e)
    th = threading.Thread(target=follower)
    th.start()
    with pytest.raises(LinkError, match=r"rank 1: its layout \{'block_size': 64\} differs from the leader's"):
        leader.wait_followers({"block_size": 128}, startup_s=10)
    th.join()
    assert "no welcome" in out["follower"]
    with pytest.raises(LinkError, match=r"ranks \[1\] did not connect within 0.2 s"):
        leader.wait_followers({}, startup_s=0.2)
    leader.close()


# ---- replay -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(ckpt):
    yield from rank_pair(ckpt, CONFIG)


@pytest.fixture(scope="module")
def mtp_pair(ckpt):
    yield from rank_pair(ckpt, "configs/tiny-flash-mtp.yaml")


def test_follower_pools_equal_the_leaders_through_prefill_decode_and_frees(pair):
    leader, follower, mirror = pair
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 60000, (n,), generator=gen).tolist() for n in (300, 40, 129)]
    for i, p in enumerate(prompts):
        leader.add_request(f"r{i}", p, SamplingParams(max_new_tokens=6, temperature=0.8, seed=i, ignore_eos=True))
        leader.step()
    held = SamplingParams(max_new_tokens=1, seed=5, ignore_eos=True)
    leader.add_request("held", prompts[0][:200], held, hold_state=True)
    while leader.has_unfinished():
        leader.step()
        sync(mirror)
        pools_equal(leader, follower)
    leader.pd.release("held")
    sync(mirror)
    pools_equal(leader, follower)
    assert leader.num_free_blocks() == leader.num_total_blocks()


def test_a_follower_replays_mtp_verify_rollback_and_drafts(mtp_pair, reference):
    """next_n 3: the verify spans' rollbacks (``settle``) and the MTP catch-up / chained drafts
    (``draft``) replay on the follower: its pools, MTP rings included, equal the leader's after
    every step, and the tokens are the next_n 0 engine's."""
    replay_mtp_requests(mtp_pair, reference)


def test_follower_replays_an_imported_state(pair, reference):
    leader, follower, mirror = pair
    prompt = torch.randint(1000, 60000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=5, temperature=0.0, seed=1, ignore_eos=True)
    reference.add_request("x", prompt, SamplingParams(max_new_tokens=1, seed=1, ignore_eos=True), hold_state=True)
    while reference.has_unfinished():
        out = reference.step()
    seq, tensors = reference.pd.export_state("x")
    reference.pd.release("x")
    leader.pd.reserve("imp", prompt, params)
    leader.pd.load_state("imp", tensors)
    leader.pd.commit("imp", seq.output_ids[0])
    sync(mirror)
    got = follower.runner.state_tensors(leader.cache.seqs["imp"], 150)    # the follower's pools, the plan's tables
    assert set(got) == set(tensors)
    for k, v in got.items():
        assert torch.equal(v, tensors[k]), k
    while leader.has_unfinished():
        leader.step()
    sync(mirror)
    pools_equal(leader, follower)
    assert out


def test_sequence_state_tensors_equal_the_paged_ones(reference):
    m = reference.model
    prompt = torch.randint(1000, 60000, (301,), generator=torch.Generator().manual_seed(4))
    st = m.new_state()
    m.forward(prompt, st)
    reference.add_request("y", prompt.tolist(), SamplingParams(max_new_tokens=1, seed=1, ignore_eos=True),
                          hold_state=True)
    while reference.has_unfinished():
        reference.step()
    _, paged = reference.pd.export_state("y")
    reference.pd.release("y")
    mine = sequence_state_tensors(st, 301)
    assert set(mine) == set(paged)
    for k in paged:
        torch.testing.assert_close(mine[k], paged[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("flags, msg", [
    (["--nnodes", "3"], "launch-pd: --nnodes / NNODES: 3 must be in [1, 2]"),
    (["--rank-timeout-s", "0"], "launch-pd: --rank-timeout-s: 0.0 must be in [0.1, 3600] seconds"),
])
def test_launch_pd_names_a_bad_rank_flag(flags, msg, capsys, monkeypatch):
    from server.launch.cli import main
    for v in ("RANK", "WORLD_SIZE", "NNODES", "NODE_RANK"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--role", "decode", "--config", "configs/tiny-flash-2rank-decode.yaml", "--device", "cpu", *flags])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_a_multi_rank_config_outside_launch_pd_is_refused_before_loading(ckpt):
    cfg = RunConfig.from_yaml("configs/tiny-flash-2rank-decode.yaml")
    with pytest.raises(ConfigError, match=r"parallel_config.world_size: 2 ranks need torch.distributed .* has 1"):
        build_engine(cfg, ckpt, progress=False)


def test_dp_cache_places_requests_on_the_rank_with_room_and_keeps_them_there(reference):
    from engine.core.block_manager import BlockManager, CacheFullError
    from engine.parallel.dp_cache import DPCache
    config = dataclasses.replace(reference.cache.config, max_seqs=2)
    dp = DPCache(reference.cache.args, config, 3)
    total = BlockManager(reference.cache.args, config).num_total()
    assert dp.num_total() == {k: 3 * v for k, v in total.items()}
    for i in range(6):                                    # two request slots per rank
        dp.allocate(f"r{i}", 100)
    assert [dp.rank_of(f"r{i}") for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert not dp.can_allocate("r6", 1)
    with pytest.raises(CacheFullError):
        dp.allocate("r6", 1)
    assert "r6" not in dp.owner
    dp.allocate("r4", 600)                                # grows on its owner
    assert dp.rank_of("r4") == 1 and dp.ranks[1].seqs["r4"] is dp.seqs["r4"]
    # each new request's slot reset is recorded for its owner rank's pools (the plan's PoolOps)
    assert [op.rank for op in dp.take_ops() if op.kind == "reset"] == [0, 1, 2, 0, 1, 2]
    dp.free("r1")
    dp.allocate("r7", 10)
    assert dp.rank_of("r7") == 1                          # the freed slot
    for i in (0, 2, 3, 4, 5, 7):
        dp.free(f"r{i}")
    dp.free("unknown")
    assert dp.num_free() == dp.num_total() and dp.owner == {}


def test_only_a_followers_connection_counts_as_a_lost_rank():
    import socket
    import time

    from engine.parallel.link import watch
    port = free_port()
    leader = LeaderLink("127.0.0.1", port, 2, timeout_s=1)
    box = {}
    th = threading.Thread(target=lambda: box.update(f=FollowerLink("127.0.0.1", port, 1, {}, timeout_s=1)))
    th.start()
    leader.wait_followers({}, startup_s=10)
    th.join()
    lost = []
    watch(leader.sock, leader.ctx, lost.append, "leader", fds=leader.fds)
    for _ in range(3):                                     # a port scan / health probe
        socket.create_connection(("127.0.0.1", port)).close()
    time.sleep(0.5)
    assert lost == []
    box["f"].close()
    end = time.monotonic() + 5
    while not lost and time.monotonic() < end:
        time.sleep(0.05)
    assert lost == ["leader: the connection to rank 1 closed"]
    leader.close()


def test_ranks_with_different_configs_exit_naming_them(ckpt, tmp_path):
    import subprocess
    import sys

    other = tmp_path / "other.yaml"
    other.write_text(open("configs/tiny-flash-2rank-decode.yaml").read().replace("o_proj_tp_size: 2",
                                                                                  "o_proj_tp_size: 1"))
    port = free_port()
    procs = []
    for rank, config in ((0, "configs/tiny-flash-2rank-decode.yaml"), (1, str(other))):
        env = dict(__import__("os").environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "server.launch.cli", "--role", "decode",
                                       "--config", config, "--model", ckpt, "--device", "cpu",
                                       "--port", str(free_port()),
                                       "--http-port", "0", "--state-port", str(free_port()),
                                       "--rank-port", str(free_port()), "--cpu-threads", "1"],
                                      env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2, err[-2000:]
        assert "ranks [1] have another run config or checkpoint config.json than rank 0" in err


def test_dp_preemption_frees_room_on_the_rank_that_needs_it(reference):
    """Under attention DP only a request on the same rank frees room: the victim is the newest
    request of that rank, the other rank's request keeps running, and the victim is not
    readmitted (on the rank with room) in the step that preempted it."""
    from engine.parallel.dp_cache import DPCache
    from engine.core.sampling_params import SamplingParams
    from engine.core.scheduler import Scheduler, SchedulerLimits
    from engine.core.request import Sequence, SeqStatus
    c = reference.cache
    g = c.geometry
    # s0 and s2 (rank 0): L tokens, at the end of their 2nd c4 block, filling rank 0's pool; s1
    # (rank 1, newest overall before s2) holds 1 block: rank 1 would have room for s2 again
    L = next(n for n in range(200, 100_000) if g.blocks_needed("c4", n + 1) > g.blocks_needed("c4", n) == 2)
    short = 100
    assert g.blocks_needed("c4", short + 1) == 1
    cfg = dataclasses.replace(c.config, max_seqs=2, num_blocks={"c4": 4, "c128": 64})
    dp = DPCache(c.args, cfg, 2)
    sched = Scheduler(dp, SchedulerLimits(batch_size=4, max_prefill_tokens=10 * L, max_model_len=10 * L,
                                          num_reserved_decode_tokens=0))
    seqs = [Sequence(f"s{i}", [7] * n, SamplingParams(max_new_tokens=8)) for i, n in enumerate((L, short, L))]
    for s in seqs:
        sched.add(s)
    for _ in range(2):                                    # the prefills, then the first decodes
        _, batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed += n
            s.output_ids.append(5)
    assert [s.seq_id for s in batch.preempted] == ["s2"]   # s0 (rank 0) needed room: rank 0's newest
    assert [s.seq_id for s in batch.seqs] == ["s0", "s1"]
    assert dp.owner == {"s0": 0, "s1": 1} and seqs[2].status is SeqStatus.WAITING
    _, batch = sched.schedule()                           # the next step readmits it, on rank 1
    assert "s2" in [s.seq_id for s in batch.seqs] and dp.owner["s2"] == 1


@pytest.mark.parametrize("path", ["configs/deepseek-v4-flash-a3-decode.yaml", "configs/deepseek-v4-pro-950-16rank.yaml",
                                  "configs/deepseek-v4-flash-a3-w8a8-16rank.yaml"])
def test_a_shipped_multi_rank_graph_config_keeps_its_graph_mode(path, caplog):
    """A multi-rank instance captures its decode step (collectives inside, fixed row counts:
    tests/server/test_pd_multirank_graph.py), so world_size > 1 no longer turns graph mode off."""
    from engine.build import exec_config
    cfg = RunConfig.from_yaml(path)
    assert cfg.parallel_config.world_size == 16 and cfg.model_config.exe_mode == "npugraph_ex"
    with caplog.at_level("WARNING", logger="engine.build"):
        ex = exec_config(cfg)
    assert ex.exe_mode == "npugraph_ex" and ex.graph and not caplog.text
