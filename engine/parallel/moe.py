"""Routed and shared experts over the ranks (``engine.parallel.shard`` installs them): EP x MoE-TP
for the routed experts, TP for the shared expert. The row modes, the dispatch and the summation
orders are described in ``engine.parallel.shard``'s docstring; under ``ParallelContext.fixed`` (a
captured decode step) the routed experts take the fixed-shape path of ``ParallelMoE.routed_fixed``.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model.moe import MLP, MoE
from engine.parallel.comm import all_reduce_max, all_reduce_sum, all_to_all_rows, exchange_counts, gather_rows, scatter_sum
from engine.parallel.context import ParallelContext
from engine.parallel.cuts import cut_weight


# ---- MoE: routed experts (EP x MoE-TP) and the shared expert -------------------------------
class ParallelMoE(nn.Module):
    """An ``MoE`` over the ranks, built from one (``moe``, its experts already this rank's EP /
    MoE-TP shard starting at global expert ``expert_lo``): the same submodules under the same
    names (parameter names stay), the same run options (``chunk``, ``platform``, ``side``, set by
    ``Transformer.configure``)."""

    def __init__(self, moe: MoE, ctx: ParallelContext, expert_lo: int):
        super().__init__()
        self.limit, self.ops = moe.limit, moe.ops
        self.chunk, self.platform, self.side = moe.chunk, moe.platform, moe.side
        self.gate, self.experts, self.shared_experts = moe.gate, moe.experts, moe.shared_experts
        self.parallel, self.expert_lo = ctx, expert_lo

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, routed=None) -> torch.Tensor:
        """x ``[T, H]``, tokens ``[T]`` -> ``[T, H]`` (this rank's rows in either mode);
        ``routed``: the step's routed-expert function over this rank's shard (``MoE.forward``'s),
        run through ``routed_fixed``."""
        weights, ids = self.gate(x, tokens)
        shared = None
        if self.shared_experts is not None and self.side is not None:
            with self.platform.side_stream(self.side):
                shared = self.shared_experts(x)
        if routed is not None:
            y = self.routed_fixed(x, ids, weights, routed).to(x.dtype)
        else:
            y = self._routed(x, ids, weights)
        if self.shared_experts is None:
            return y
        if shared is None:
            return y + self.shared_experts(x)
        self.platform.join(self.side, shared)
        return y + shared

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed experts over the "moe" group: ``[T, H]`` in x.dtype. Slots are put in ascending
        expert order (the single-rank op's summation order)."""
        g, T = self.parallel.groups["moe"], x.shape[0]
        ids, weights = _expert_order(ids, weights)
        c = self.chunk or max(T, 1)
        n = -(-T // c)
        if self.parallel.dp:
            n = all_reduce_max(n, g) if self.chunk else 1
            run = self._dispatch
        else:
            def run(xc, ic, wc):
                return all_reduce_sum(self._local(xc, ic, wc), g)
        if n <= 1:
            return run(x, ids, weights).to(x.dtype)
        return torch.cat([run(x[i * c:(i + 1) * c], ids[i * c:(i + 1) * c], weights[i * c:(i + 1) * c])
                          for i in range(n)]).to(x.dtype)

    def routed_fixed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
        """The routed experts with fixed shapes and no host sync, for a captured decode step (every
        rank runs the same number of rows, ``ParallelContext.fixed``).

        "dp": the group's rows are gathered (all_to_all of equal counts), this rank's experts run
        on every (row, slot) pair with the other shards' slots weighted 0, and the partial sums
        come back by a reduce-scatter added in rank order; "replicated": the rows it has, then an
        fp32 all_reduce. A zero partial adds exactly, so the sums are ``_routed``'s. It costs every
        slot of the group's rows on every rank: the reference twin of a fixed-capacity dispatch /
        combine (Ascend's ``npu_moe_distribute_dispatch``), which sends a row only where its
        experts are.

        Args:
            x: ``[T, H]``; ids / weights: ``[T, k]`` (global expert ids, the gate's weights).
            experts: ``(x [N, H], local ids [N, k], weights [N, k]) -> [N, H]`` fp32, the step's
                routed-expert function over this rank's shard.
        Returns:
            ``[T, H]`` fp32.
        """
        pc = self.parallel
        g = pc.groups["moe"]
        ids, weights = _expert_order(ids, weights)
        c = pc.counts(x.shape[0], g)
        if pc.dp:                                        # one all_to_all for the rows, ids and weights
            got, c = gather_rows(_pack(x, ids, weights), g, c)
            x, ids, weights = _unpack(got, x.dtype, x.shape[1], ids.shape[1])
        local = ids - self.expert_lo
        hit = (local >= 0) & (local < self.experts.num_experts)
        y = experts(x, torch.where(hit, local, 0), torch.where(hit, weights, 0))
        return scatter_sum(y, c, g) if pc.dp else all_reduce_sum(y, g)

    def _local(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's share: x ``[N, H]``, ids / weights ``[N, k]`` (global ids) -> ``[N, H]`` fp32,
        per row the sum over its slots with a local expert (slot order) of
        ``w * expert_slice(x)``; one ``ops.moe_experts`` call on (row, slot) pairs."""
        e = self.experts
        n_loc = e.num_experts
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        hit = (ids >= self.expert_lo) & (ids < self.expert_lo + n_loc)
        r, j = hit.nonzero(as_tuple=True)
        if r.numel() == 0:
            return out
        y = self.ops.moe_experts(x[r], (ids[r, j] - self.expert_lo)[:, None], weights[r, j][:, None],
                                 *e.stored(), self.limit, e.act).float()
        for s in range(ids.shape[1]):                    # rows are unique within one slot: no atomics
            m = j == s
            out[r[m]] += y[m]
        return out

    def _dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """"dp": all_to_all the rows to the EP shards that hold their experts, combine -> ``[T, H]`` fp32."""
        pc = self.parallel
        g, mt, n_loc = pc.groups["moe"], pc.config.moe_tp_size, self.experts.num_experts
        T, H, k = x.shape[0], x.shape[1], ids.shape[1]
        need = torch.zeros(T, pc.config.moe_ep_size, dtype=torch.bool, device=x.device)
        need.scatter_(1, ids // n_loc, True)
        rows = [need[:, d // mt].nonzero().squeeze(1) for d in range(g.size)]   # per destination rank
        send = [int(r.numel()) for r in rows]
        idx = torch.cat(rows)
        recv = exchange_counts(send, g)
        got = all_to_all_rows(_pack(x[idx], ids[idx], weights[idx]), send, recv, g)
        xr, ir, wr = _unpack(got, x.dtype, H, k)
        back = all_to_all_rows(self._local(xr, ir, wr), recv, send, g)         # [sum(send), H] fp32
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        off = 0
        for r, n in zip(rows, send):                     # rank order
            out[r] += back[off:off + n]
            off += n
        return out


def _expert_order(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's slots in ascending expert id (the single-rank op's summation order)."""
    ids, order = ids.sort(dim=-1, stable=True)
    return ids, weights.gather(1, order)


def _pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Rows x ``[T, H]``, ids ``[T, k]``, weights ``[T, k]`` -> one uint8 row each (x's bytes,
    ids int32, weights fp32), so a dispatch is one collective."""
    return torch.cat([x.contiguous().view(torch.uint8), ids.to(torch.int32).view(torch.uint8),
                      weights.float().contiguous().view(torch.uint8)], dim=1)


def _unpack(got: torch.Tensor, dtype: torch.dtype, H: int, k: int):
    """Inverse of ``_pack``: (x ``[N, H]`` dtype, ids ``[N, k]`` int64, weights ``[N, k]`` fp32)."""
    b = dtype.itemsize * H
    return (got[:, :b].contiguous().view(dtype), got[:, b:b + 4 * k].contiguous().view(torch.int32).long(),
            got[:, b + 4 * k:].contiguous().view(torch.float32))


class ParallelSharedMLP(nn.Module):
    """A shared expert (``MLP``) split over the "shared" TP group, built from one whose linears
    hold this rank's slices (w1 / w3 rows, w2 columns; the same names)."""

    def __init__(self, mlp: MLP, ctx: ParallelContext):
        super().__init__()
        self.w1, self.w2, self.w3, self.limit, self.ops = mlp.w1, mlp.w2, mlp.w3, mlp.limit, mlp.ops
        self.parallel = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> ``[T, H]`` (this rank's rows): ``MLP``'s formula on the slices, the
        partial sums joined over the group."""
        g = self.parallel.groups["shared"]
        if self.parallel.dp:
            x, c = gather_rows(x, g, self.parallel.counts(x.shape[0], g))
        y = self.w2(self.ops.swiglu_clamp(self.w1(x), self.w3(x), self.limit))
        return (scatter_sum(y, c, g) if self.parallel.dp else all_reduce_sum(y, g)).to(x.dtype)


def shard_moe(moe: MoE, ctx: ParallelContext) -> ParallelMoE:
    pc, e = ctx.config, moe.experts
    n_loc = e.num_experts // pc.moe_ep_size
    i_loc = e.stored()[0].shape[1] // pc.moe_tp_size
    lo, ilo = ctx.ep_rank * n_loc, ctx.moe_tp_rank * i_loc
    cut_weight(e, "w1", (0, lo, n_loc), (1, ilo, i_loc))
    cut_weight(e, "w3", (0, lo, n_loc), (1, ilo, i_loc))
    cut_weight(e, "w2", (0, lo, n_loc), (2, ilo, i_loc))
    g = ctx.groups["shared"]
    if g.size > 1:
        m = moe.shared_experts
        w = m.w1.stored.shape[0] // g.size
        cut_weight(m.w1, "weight", (0, g.index * w, w))
        cut_weight(m.w3, "weight", (0, g.index * w, w))
        cut_weight(m.w2, "weight", (1, g.index * w, w))
        moe.shared_experts = ParallelSharedMLP(m, ctx)
    return ParallelMoE(moe, ctx, lo)
