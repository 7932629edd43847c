"""Shard a DeepSeek-V4 model over ranks (loaded, or before loading) and install its collective forwards.

Each block's ``ffn`` is replaced by a ``ParallelMoE`` built from the original's modules (its shared
expert by a ``ParallelSharedMLP``), so ``type(model.layers[i].ffn)`` says what runs; the
embedding, the LM head and o_proj are set on the model's documented TP fields
(``Transformer.embed_tp`` / ``lmhead_tp``, ``Attention.o_proj_tp``), which its forward calls.

Source: reference/upstream-parallel-and-mtp.md "Parallel strategy" (decode: attention DP, MoE EP,
LM-head TP, o_a_proj TP with DP->TP all_to_all and reduce-scatter back). Rank layout and row modes:
``engine.parallel.context``; the collectives: ``engine.parallel.comm``. What each part does, with
``T`` this rank's rows, ``N`` the rows of its group, ``s`` a group's size:

* Routed experts (EP x MoE-TP, group "moe" = every rank). Rank r holds experts
  ``[e*E/ep, (e+1)*E/ep)`` (e = r // moe_tp_size) and the ``I`` slice ``moe_tp_rank`` of each
  (w1 / w3 rows, w2 columns). The gate stays replicated. "replicated": each rank computes its
  experts' share for all rows, then one fp32 all_reduce. "dp": the counts, then the rows (x, the
  row's k expert ids, its k weights, one byte payload) go by ``all_to_all_single`` with uneven
  splits (gloo supports them) to every rank of each EP shard they need; each rank sums its local
  slots of each received row in slot order (fp32), the partials come back by a second
  all_to_all, and the origin adds them in rank order. With ``moe_chunk_max_len`` the ranks agree
  on the chunk count first (an all_reduce MAX) so every rank runs the same collectives.
* Shared expert (``shared_tp_size``): w1 / w3 rows and w2 columns split; "replicated": partial +
  all_reduce; "dp": gather the group's rows (all_to_all), partial, reduce-scatter (all_to_all +
  sum in rank order).
* o_proj (``o_proj_tp_size``, o_groups % s == 0): rank keeps the wo_a rows of its G/s groups and
  the matching wo_b columns; "dp": DP->TP all_to_all of each rank's rows for those groups,
  grouped_linear + wo_b partial, reduce-scatter back; "replicated": partial + all_reduce.
* Embedding (``embed_tp_size``): contiguous vocab slices, masked lookup (zero rows elsewhere);
  "replicated": all_reduce; "dp": gather the group's token ids, look up, reduce-scatter. Exact:
  one nonzero term per element.
* LM head (``lmhead_tp_size``): contiguous vocab slices of ceil(V/s) rows (the last padded with
  zeros, cut after); "replicated": local logits + all_gather along V; "dp": gather the group's
  hidden rows, local logits ``[N, V/s]``, all_to_all each rank its rows, concatenate along V.
* ``dense_tp_size``: a no-op (DeepSeek-V4 has no dense FFN layers; every layer is MoE).
  ``attn_tp_size`` must be 1 (attention runs replicated or data parallel).

Partial sums travel and add in fp32 and are cast to the compute dtype once. Idle ranks: in "dp"
mode a rank without sequences calls ``forward_idle(model)`` (= ``forward_batch`` with no sequences,
which runs every layer on zero rows) and, when the step samples, ``model.logits`` on its
``[0, H]`` result. The captured decode step (``engine.core.static_decode``) runs every rank on
the same bucket of rows (``ParallelContext.fixed``): counts are then known without asking, and
the routed experts go by a fixed-shape all-gather / reduce-scatter (``ParallelMoE.routed_fixed``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError
from engine.model.transformer import Transformer
from engine.parallel.comm import all_gather_cols, all_reduce_sum, all_to_all_rows, counts, gather_rows, scatter_sum
from engine.parallel.context import GroupInfo, ParallelContext, trivial_context
from engine.parallel.cuts import cut_weight, shard_tensor, stored_cuts
from engine.parallel.moe import shard_moe
from engine.run_config import ParallelConfig

_KEY = "parallel_config"


def apply_parallel(model: Transformer, pc: ParallelConfig, rank: int) -> ParallelContext:
    """Shard a model in place for ``rank`` of ``pc.world_size`` and install the collective
    forwards: a loaded one, or an unloaded one (meta parameters) as
    ``engine.checkpoint.loader.load_model``'s ``shard`` (each sharded parameter's ``shard_cuts`` tell the
    loader which slice to read). torch.distributed must be initialised (any backend) with
    world_size == pc.world_size; the process groups come from ``dist.new_group`` (every rank
    calls this with the same config, so the groups are made in the same order). World size 1:
    only sets ``model.parallel`` to a trivial context. Returns ``model.parallel``.

    Raises:
        ConfigError: a size that does not divide the model (``parallel_config.<key>: ...``),
            attn_tp_size != 1, moe_tp_size > 1 over activation-quantised experts, or a packed /
            activation-quantised shared expert, o_proj or LM head (``fmt``) to cut.
        ValueError: torch.distributed not initialised, its world size / rank differ, or the model
            is already sharded.
    """
    if pc.world_size == 1:
        model.parallel = trivial_context(pc)
        return model.parallel
    if getattr(model, "parallel", None) is not None and model.parallel.world_size > 1:
        raise ValueError("apply_parallel: the model is already sharded")
    _check(model, pc)
    if not dist.is_initialized() or dist.get_world_size() != pc.world_size or dist.get_rank() != rank:
        raise ValueError(f"apply_parallel: torch.distributed must be initialised with world_size "
                         f"{pc.world_size} and rank {rank}")
    ctx = ParallelContext(rank, pc.world_size, pc, _groups(pc, rank))
    for blk in [*model.layers, *model.mtp]:
        blk.ffn = shard_moe(blk.ffn, ctx)
        if pc.o_proj_tp_size > 1:
            _shard_o_proj(blk.attn, ctx)
    if pc.embed_tp_size > 1:
        _shard_embed(model, ctx)
    if pc.lmhead_tp_size > 1:
        _shard_head(model, ctx)
    model.parallel = ctx
    return ctx


@torch.no_grad()
def forward_idle(model: Transformer) -> torch.Tensor:
    """A "dp" step for a rank without sequences: every layer on zero rows, so the rank joins each
    collective of the step. Returns the ``[0, H]`` hidden (pass it to ``model.logits`` when the
    other ranks sample)."""
    return model.forward_batch(torch.zeros(0, dtype=torch.long, device=model.embed.weight.device), [], [])


# ---- checks and groups ---------------------------------------------------------------------
def _fail(key: str, msg: str):
    raise ConfigError(f"{_KEY}.{key}: {msg}")


def _act_quantised(mod: nn.Module) -> bool:
    return getattr(mod, "act", None) is not None


def _check_cut(key: str, mod: nn.Module, base: str, *cuts) -> None:
    try:
        stored_cuts(mod, base, list(cuts))
    except ValueError as e:
        _fail(key, f"cannot cut {base} as stored: {e}")


def _check(model: Transformer, pc: ParallelConfig) -> None:
    """Every ConfigError before anything is sharded."""
    a = model.args
    if pc.attn_tp_size != 1:
        _fail("attn_tp_size", f"attention tensor parallelism is not supported (attention runs replicated or "
                              f"data parallel); must be 1, got {pc.attn_tp_size}")
    if a.n_routed_experts % pc.moe_ep_size:
        _fail("moe_tp_size", f"moe_ep_size = world_size / moe_tp_size = {pc.moe_ep_size} must divide "
                             f"n_routed_experts ({a.n_routed_experts})")
    if a.moe_intermediate_size % pc.moe_tp_size:
        _fail("moe_tp_size", f"must divide moe_intermediate_size ({a.moe_intermediate_size}), got {pc.moe_tp_size}")
    if a.o_groups % pc.o_proj_tp_size:
        _fail("o_proj_tp_size", f"must divide o_groups ({a.o_groups}), got {pc.o_proj_tp_size}")
    inter = a.moe_intermediate_size * a.n_shared_experts
    if pc.shared_tp_size > 1 and (not inter or inter % pc.shared_tp_size):
        _fail("shared_tp_size", f"must divide the shared expert width ({inter}), got {pc.shared_tp_size}")
    for key in ("embed_tp_size", "lmhead_tp_size"):
        if getattr(pc, key) > a.vocab_size:
            _fail(key, f"must be <= vocab_size ({a.vocab_size}), got {getattr(pc, key)}")
    # Activation quantisation is per token over the whole input: a weight cut along its input
    # (wo_b / shared w2 / expert w2 columns) would quantise each slice on its own. Weight-only
    # formats (FP8 / MXFP4 of the original checkpoint) cut exactly, on their block units.
    no_q = "activation-quantised weights (a converted checkpoint) cannot be cut along their input; must be 1"
    for blk in [*model.layers, *model.mtp]:
        e, a = blk.ffn.experts, blk.attn
        if pc.moe_tp_size > 1:
            if _act_quantised(e):
                _fail("moe_tp_size", f"{no_q}, got {pc.moe_tp_size}")
            i = model.args.moe_intermediate_size // pc.moe_tp_size
            _check_cut("moe_tp_size", e, "w1", (1, 0, i))
            _check_cut("moe_tp_size", e, "w2", (2, 0, i))
        m = blk.ffn.shared_experts
        if pc.shared_tp_size > 1 and m is not None:
            if _act_quantised(m.w2):
                _fail("shared_tp_size", f"{no_q}, got {pc.shared_tp_size}")
            w = m.w1.stored.shape[0]
            _check_cut("shared_tp_size", m.w1, "weight", (0, 0, w // pc.shared_tp_size))
            _check_cut("shared_tp_size", m.w2, "weight", (1, 0, w // pc.shared_tp_size))
        if pc.o_proj_tp_size > 1:
            if _act_quantised(a.wo_b) or _act_quantised(a.wo_a):
                _fail("o_proj_tp_size", f"{no_q}, got {pc.o_proj_tp_size}")
            rows = model.args.o_groups * model.args.o_lora_rank // pc.o_proj_tp_size
            _check_cut("o_proj_tp_size", a.wo_a, "weight", (0, 0, rows))
            _check_cut("o_proj_tp_size", a.wo_b, "weight", (1, 0, rows))
    if pc.lmhead_tp_size > 1 and (model.head.fmt is not None or model.head.act is not None):
        _fail("lmhead_tp_size", "a quantised LM head cannot be cut (every checkpoint format stores it bf16)")
    if pc.embed_tp_size > 1 and not model.embed.weight.is_floating_point():
        _fail("embed_tp_size", "a quantised embedding cannot be cut")


def _groups(pc: ParallelConfig, rank: int) -> dict[str, GroupInfo]:
    """"moe": all ranks; the TP kinds: consecutive ranks. Every rank creates every group, in order."""
    W, out = pc.world_size, {}
    sizes = {"moe": W, "embed": pc.embed_tp_size, "lmhead": pc.lmhead_tp_size, "o_proj": pc.o_proj_tp_size,
             "shared": pc.shared_tp_size}
    for kind, t in sizes.items():
        if t == 1:
            out[kind] = GroupInfo((rank,), 0, None)
            continue
        for start in range(0, W, t):
            ranks = tuple(range(start, start + t))
            g = dist.new_group(list(ranks))
            if rank in ranks:
                out[kind] = GroupInfo(ranks, rank - start, g)
    return out


def _vocab_slice(V: int, g: GroupInfo) -> tuple[int, int, int]:
    """(first id, ids held, slice length ceil(V/s)) of this rank's contiguous vocab slice."""
    per = -(-V // g.size)
    lo = min(V, g.index * per)
    return lo, min(V, lo + per) - lo, per


# ---- attention output projection -----------------------------------------------------------
def _shard_o_proj(attn: nn.Module, ctx: ParallelContext) -> None:
    g = ctx.groups["o_proj"]
    rows = attn.wo_a.stored.shape[0] // g.size                     # (G/s) * o_lora_rank
    cut_weight(attn.wo_a, "weight", (0, g.index * rows, rows))
    cut_weight(attn.wo_b, "weight", (1, g.index * rows, rows))
    attn.o_proj_tp = OProjTP(ctx)


class OProjTP:
    """``Attention.o_proj_tp``: the grouped output projection over the "o_proj" group."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def __call__(self, attn: nn.Module, o: torch.Tensor) -> torch.Tensor:
        """o ``[T, h, d]`` -> ``[T, H]`` (compute dtype; this rank's rows)."""
        ctx = self.ctx
        g = ctx.groups["o_proj"]
        T, G = o.shape[0], attn.n_groups
        Gl, K = G // g.size, attn.n_heads * attn.head_dim // G
        o = o.reshape(T, G, K)

        def partial_out(oa):                                          # [M, Gl, K] -> [M, H]
            return attn.wo_b(attn.ops.grouped_linear(oa, attn.wo_a.stored).flatten(1))

        if ctx.dp:
            c = ctx.counts(T, g) or counts(T, g)
            blocks = o.reshape(T, g.size, Gl, K).transpose(0, 1).reshape(g.size * T, Gl, K)   # block j: rank j's groups
            oa = all_to_all_rows(blocks, [T] * g.size, c, g)           # [N, Gl, K]: the group's rows, my groups
            return scatter_sum(partial_out(oa), c, g).to(o.dtype)
        return all_reduce_sum(partial_out(o[:, g.index * Gl:(g.index + 1) * Gl]), g).to(o.dtype)


# ---- embedding and LM head -----------------------------------------------------------------
def _shard_embed(model: Transformer, ctx: ParallelContext) -> None:
    lo, n, _ = _vocab_slice(model.args.vocab_size, ctx.groups["embed"])
    model.embed.weight = shard_tensor(model.embed.weight, (0, lo, n))
    model.embed_tp = EmbedTP(ctx, lo)


class EmbedTP:
    """``Transformer.embed_tp``: the embedding lookup over the "embed" group, this rank holding
    the contiguous vocab slice from id ``lo``."""

    def __init__(self, ctx: ParallelContext, lo: int):
        self.ctx, self.lo = ctx, lo

    def __call__(self, model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
        """tokens ``[T]`` int64 -> ``[T, H]`` compute dtype (this rank's rows)."""
        ctx, lo = self.ctx, self.lo
        g, w = ctx.groups["embed"], model.embed.weight
        ids, c = gather_rows(tokens, g, ctx.counts(tokens.shape[0], g)) if ctx.dp else (tokens, None)
        local = ids - lo
        hit = (local >= 0) & (local < w.shape[0])
        e = torch.where(hit[:, None], F.embedding(local.clamp(0, w.shape[0] - 1), w), w.new_zeros(()))
        return (scatter_sum(e, c, g) if ctx.dp else all_reduce_sum(e, g)).to(w.dtype)


def _shard_head(model: Transformer, ctx: ParallelContext) -> None:
    V = model.args.vocab_size
    lo, n, per = _vocab_slice(V, ctx.groups["lmhead"])
    w = model.head.weight
    local = w.new_zeros(per, w.shape[1])                          # rows past n: zero padding
    local[:n] = w[lo:lo + n]
    model.head.weight = nn.Parameter(local, requires_grad=False)
    model.head.weight.shard_cuts = ((0, lo, n),)
    model.lmhead_tp = LMHeadTP(ctx)


class LMHeadTP:
    """``Transformer.lmhead_tp``: the LM head over the "lmhead" group (vocab slices of ceil(V/s))."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def __call__(self, model: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, H]`` -> ``[T, V]`` fp32 (this rank's rows)."""
        ctx = self.ctx
        g, h = ctx.groups["lmhead"], model.head
        x = h.quant_input(hidden.float())
        if ctx.dp:
            xa, c = gather_rows(x, g, ctx.counts(x.shape[0], g))
            T = c[g.index]
            got = all_to_all_rows(model.ops.lm_head(xa, h.weight), c, [T] * g.size, g)   # [s*T, V/s]
            full = got.view(g.size, T, h.weight.shape[0]).permute(1, 0, 2).reshape(T, g.size * h.weight.shape[0])
        else:
            full = all_gather_cols(model.ops.lm_head(x, h.weight), g)
        return full[:, :model.args.vocab_size]
