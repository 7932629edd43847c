"""Model parallelism (engine.parallel.shard) on real gloo process groups against one process.

The parent runs the single-rank reference on the tiny flash checkpoint (prefill of each prompt,
then 3 greedy decode steps) and writes it as safetensors. One process group per world size; each
rank loads the checkpoint once and, for every parallel config and both row modes, shards a copy,
runs the same steps, and writes its max differences (hidden of every prompt row, logits of every
step) as JSON. "replicated": every rank runs prompt 0 and must also get bit-identical logits;
"dp": rank r runs prompt r; the last rank is idle at decode step 2 and catches up at step 4, where
every other rank is idle (``forward_idle``).
"""
from __future__ import annotations

import copy
import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engine.checkpoint.convert_model import convert_model
from engine.checkpoint.loader import load_model
from engine.config import ConfigError
from engine.parallel.shard import apply_parallel, forward_idle
from engine.run_config import ParallelConfig

TOL = 1e-5
BF16_TOL = 3e-2                             # relative (``_rel``): bf16 vs fp32 is ~1e-2; a wrong byte view is O(1)
# w8a8 (per-token int8 activations) is relative too: a 1e-6 change of the embedding moves the
# hidden by 0.15 (max, |h| <= 4.5) where a value crosses an int8 rounding boundary
LENGTHS = (40, 37, 43, 33)                  # prompt r of rank r in "dp" mode
STEPS = 3                                   # decode steps after the prefill
CONFIGS = {
    2: {"ep": {}, "moe_tp": {"moe_tp_size": 2}, "lmhead": {"lmhead_tp_size": 2}, "embed": {"embed_tp_size": 2},
        "o_proj": {"o_proj_tp_size": 2},
        "all": {"embed_tp_size": 2, "lmhead_tp_size": 2, "o_proj_tp_size": 2, "shared_tp_size": 2, "dense_tp_size": 2}},
    4: {"ep": {}, "moe_tp": {"moe_tp_size": 4}, "ep_moe_tp": {"moe_tp_size": 2}, "lmhead": {"lmhead_tp_size": 4},
        "embed": {"embed_tp_size": 4},
        "all": {"moe_tp_size": 2, "embed_tp_size": 4, "lmhead_tp_size": 2, "o_proj_tp_size": 2, "shared_tp_size": 4}},
}


def _tokens(L: int) -> torch.Tensor:
    return torch.randint(2, 129000, (L,), generator=torch.Generator().manual_seed(1000 + L))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max of ``|a - b| - TOL * |b|`` (<= TOL passes, as assert_close(atol=rtol=TOL)); inf on a shape mismatch."""
    if a.shape != b.shape:
        return float("inf")
    return float(((a.float() - b.float()).abs() - TOL * b.float().abs()).max()) if a.numel() else 0.0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32 (bf16 runs: a few ulps of chaotic drift are expected)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def _schedule(rank: int, world: int, mode: str) -> list[int | None]:
    """Per step (prefill, decode 1..): which decode index this rank runs (0 = prefill), None = idle."""
    if mode == "replicated":
        return list(range(STEPS + 1))
    if rank == world - 1:
        return [0, 1, None, 2, 3]
    return [0, 1, 2, 3, None]


def _run(model, rank: int, world: int, mode: str, ref: dict) -> dict:
    p = 0 if mode == "replicated" else rank
    state, out, logits = model.new_state(), {}, []
    for step, k in enumerate(_schedule(rank, world, mode)):
        if k is None:
            lg = model.logits(forward_idle(model))
            out[f"idle{step}"] = float(lg.shape != (0, model.args.vocab_size))
            continue
        toks = _tokens(LENGTHS[p]) if k == 0 else ref[f"p{p}.next"][k - 1:k]
        h = model.forward_batch(toks, [state], [toks.shape[0]])
        lg = model.logits(h[-1:])
        if k == 0:
            out["hidden"] = _diff(h, ref[f"p{p}.hidden"])
        out[f"logits{k}"] = _diff(lg, ref[f"p{p}.logits"][k:k + 1])
        if k < STEPS:
            out[f"argmax{k}"] = float(int(lg.argmax()) != int(ref[f"p{p}.next"][k]))
        logits.append(lg)
    if mode == "replicated":                   # every rank must hold the same bits
        mine = torch.cat(logits)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        out["ranks_differ"] = float(any(not torch.equal(e, mine) for e in every))
    return out


def _destroy(pc) -> None:
    for g in pc.groups.values():
        if g.group is not None:
            dist.destroy_process_group(g.group)


def _shard_load(ckpt, sharded, world: int, kw: dict, rank: int) -> dict:
    """Load with ``shard`` (sharded before any read) vs ``sharded`` (whole model loaded, then
    sharded): every tensor bit-equal; the share of parameter bytes this rank holds."""
    cfg = ParallelConfig(world_size=world, **kw)
    direct = load_model(ckpt, dtype=torch.float32, device="cpu", progress=False,
                        shard=lambda m: apply_parallel(m, cfg, rank))
    _destroy(direct.parallel)
    a, b = direct.state_dict(), sharded.state_dict()
    same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    full = load_model(ckpt, dtype=torch.float32, device="cpu", progress=False)
    nbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in (direct, full)]
    return {"differs": float(not same), "bytes_share": nbytes[0] / nbytes[1]}


def _worker(rank, world, port, ckpt, refdir, outdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    base = load_model(ckpt, dtype=torch.float32, device="cpu", progress=False)
    ref = load_file(f"{refdir}/ref.safetensors")
    res = {}
    for name, kw in CONFIGS[world].items():
        for mode in ("replicated", "dp"):
            model = copy.deepcopy(base)
            pc = apply_parallel(model, ParallelConfig(world_size=world, **kw), rank)
            with pc.rows(mode):
                res[f"{name}/{mode}"] = _run(model, rank, world, mode, ref)
            _destroy(pc)
            if name == "all" and mode == "dp":
                res["all/shard-load"] = _shard_load(ckpt, model, world, kw, rank)
    if world == 2:                             # bf16: 2-byte floats cross gloo as bytes, sums in fp32
        model = load_model(ckpt, dtype=torch.bfloat16, device="cpu", progress=False)
        with apply_parallel(model, ParallelConfig(world_size=2, **CONFIGS[2]["all"]), rank).rows("dp"):
            h = model.forward(_tokens(LENGTHS[rank]), model.new_state())
            res["bf16/dp"] = {"hidden": _rel(h, ref[f"bf16.p{rank}.hidden"]),
                              "logits0": _rel(model.logits(h[-1:]), ref[f"bf16.p{rank}.logits"])}
        cfg = ParallelConfig(world_size=2, lmhead_tp_size=2)
        model = load_model(f"{refdir}/w8a8", dtype=torch.float32, device="cpu", progress=False,
                           shard=lambda m: apply_parallel(m, cfg, rank))
        with model.parallel.rows("dp"):
            h = model.forward(_tokens(LENGTHS[rank]), model.new_state())
            res["w8a8/dp"] = {"hidden": _rel(h, ref[f"w8a8.p{rank}.hidden"]),
                              "logits0": _rel(model.logits(h[-1:]), ref[f"w8a8.p{rank}.logits"])}
    Path(f"{outdir}/rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ref(tiny_ckpt, tmp_path_factory):
    """(checkpoint path, reference dir): per prompt its prefill hidden, the logits of the prefill's
    last row and of each decode step, and the greedy next tokens."""
    torch.set_num_threads(1)
    ckpt = str(tiny_ckpt("flash", 1))
    model = load_model(ckpt, dtype=torch.float32, device="cpu", progress=False)
    t = {}
    for p, L in enumerate(LENGTHS):
        state = model.new_state()
        h = model.forward(_tokens(L), state)
        lgs, nxt = [model.logits(h[-1:])], []
        for _ in range(STEPS):
            nxt.append(int(lgs[-1].argmax()))
            lgs.append(model.logits(model.forward(torch.tensor(nxt[-1:]), state)))
        t.update({f"p{p}.hidden": h, f"p{p}.logits": torch.cat(lgs), f"p{p}.next": torch.tensor(nxt)})
    bf16 = load_model(ckpt, dtype=torch.bfloat16, device="cpu", progress=False)
    for p in range(2):
        h = bf16.forward(_tokens(LENGTHS[p]), bf16.new_state())
        t.update({f"bf16.p{p}.hidden": h, f"bf16.p{p}.logits": bf16.logits(h[-1:])})
    d = tmp_path_factory.mktemp("parallel-ref")
    # a converted checkpoint (int8 weights, per-token int8 activations): EP shards whole experts
    quant = convert_model(ckpt, d / "w8a8", "w8a8-int", progress=False)
    q = load_model(quant, dtype=torch.float32, device="cpu", progress=False)
    for p in range(2):
        h = q.forward(_tokens(LENGTHS[p]), q.new_state())
        t.update({f"w8a8.p{p}.hidden": h, f"w8a8.p{p}.logits": q.logits(h[-1:])})
    save_file(t, str(d / "ref.safetensors"))
    return ckpt, str(d)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_matches_single_rank(ref, tmp_path, world):
    ckpt, refdir = ref
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, (world, port, ckpt, refdir, str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(res) == {f"{c}/{m}" for c in CONFIGS[world] for m in ("replicated", "dp")} | (
            {"bf16/dp", "w8a8/dp", "all/shard-load"} if world == 2 else {"all/shard-load"})
        # loading sharded gives the same tensors as sharding the loaded model, and holds a share
        # of the bytes (attention, norms and the router stay whole: about 0.54 at world 2, 0.46 at 4)
        load = res.pop("all/shard-load")
        assert load["differs"] == 0 and load["bytes_share"] < (0.6 if world == 2 else 0.5), load
        for run, d in res.items():
            tol = BF16_TOL if run.startswith(("bf16", "w8a8")) else TOL
            bad = {k: v for k, v in d.items() if not v <= (tol if k.startswith(("hidden", "logits")) else 0)}
            assert not bad, f"world {world} rank {r} {run}: {bad}"


def test_config_errors(ref):
    ckpt, _ = ref
    model = load_model(ckpt, dtype=torch.float32, device="cpu", progress=False)
    with pytest.raises(ConfigError, match=r"parallel_config\.o_proj_tp_size: must divide o_groups \(2\)"):
        apply_parallel(model, ParallelConfig(world_size=4, o_proj_tp_size=4), 0)
    with pytest.raises(ConfigError, match=r"parallel_config\.attn_tp_size"):
        apply_parallel(model, ParallelConfig(world_size=2, attn_tp_size=2), 0)
    model.layers[1].ffn.experts.act = "int8-token"     # EP shards whole experts; an I slice is refused
    with pytest.raises(ConfigError, match=r"parallel_config\.moe_tp_size: activation-quantised weights"):
        apply_parallel(model, ParallelConfig(world_size=2, moe_tp_size=2), 0)
    with pytest.raises(ValueError, match="torch.distributed must be initialised"):
        apply_parallel(model, ParallelConfig(world_size=2), 0)
    del model.layers[1].ffn.experts.act
    # MXFP4 experts as stored cut only on whole scale groups: I = 128 over 8 is 16 columns of w2
    with pytest.raises(ConfigError, match=r"parallel_config\.moe_tp_size: cannot cut w2 as stored: .*multiples of 32"):
        apply_parallel(model, ParallelConfig(world_size=8, moe_tp_size=8), 0)
    model.head.fmt = "int8"
    with pytest.raises(ConfigError, match=r"parallel_config\.lmhead_tp_size: .*quantised"):
        apply_parallel(model, ParallelConfig(world_size=2, lmhead_tp_size=2), 0)
    model.head.fmt = None
    model.layers[0].attn.wo_b.act = "int8-token"
    with pytest.raises(ConfigError, match=r"parallel_config\.o_proj_tp_size: .*quantised"):
        apply_parallel(model, ParallelConfig(world_size=2, o_proj_tp_size=2), 0)
    with pytest.raises(ValueError, match="torch.distributed must be initialised"):   # not initialised here
        apply_parallel(model, ParallelConfig(world_size=2), 0)
    assert apply_parallel(model, ParallelConfig(), 0).world_size == 1 and model.parallel.mode == "replicated"
    with pytest.raises(ValueError, match="mode"):
        with model.parallel.rows("tp"):
            pass
