"""Mixture of experts: hash / score-routed gate, routed experts, shared expert (§3.7).

Letters: T tokens, H hidden, E routed experts, I expert width, k experts per token.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelArgs
from engine.model.layers import Linear, param, zeros
from engine.ops.packed import Packed
from engine.ops import Ops


class Gate(nn.Module):
    """Router. Hash layers pick ``tid2eid[token]``; others top-k of ``sqrtsoftplus + bias``.

    The router runs in fp32 (§5 row 1, the NPU A3 choice; HF runs it in bf16 when in bf16).
    """

    def __init__(self, args: ModelArgs, hash_layer: bool, ops: Ops):
        super().__init__()
        self.k, self.scale, self.ops = args.num_experts_per_tok, args.routed_scaling_factor, ops
        self.weight = param((args.n_routed_experts, args.hidden_size), torch.float32)
        if hash_layer:
            self.register_buffer("tid2eid", zeros((args.vocab_size, self.k), torch.long))
            self.bias = None
        else:
            self.bias = param((args.n_routed_experts,), torch.float32)
            self.tid2eid = None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, H]``, tokens ``[T]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]``)."""
        logits = self.ops.linear(x.float(), self.weight)                          # [T, E] fp32
        hash_ids = self.tid2eid[tokens] if self.tid2eid is not None else None
        return self.ops.gating_topk(logits, self.bias, hash_ids, self.k, self.scale)


class Experts(nn.Module):
    """Routed experts stacked: ``w1``/``w3`` ``[E, I, H]`` (gate / up), ``w2`` ``[E, H, I]`` (down).

    As the checkpoint stores them (``engine.checkpoint.loader``): dense (bf16) or, with ``fmt``
    set, each ``wN`` the stacked stored weights plus ``wN_scale`` (+ ``wN_bias`` for int4), passed to
    ``ops.moe_experts`` as ``Packed``. ``act``: activation quantisation of a converted checkpoint
    (``Linear.act``), None by default. ``compute_dtype``: the dtype of a dense copy.
    """

    act: str | None = None
    fmt: str | None = None
    block: tuple[int, int] = (128, 128)
    offsets: dict[str, tuple[int, int]] = {}          # per weight: ``Packed.offset`` of a shard

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        E, H, I = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        self.w1 = param((E, I, H), dtype)
        self.w3 = param((E, I, H), dtype)
        self.w2 = param((E, H, I), dtype)
        for w in ("w1", "w2", "w3"):
            self.register_parameter(f"{w}_scale", None)
            self.register_parameter(f"{w}_bias", None)
        self.compute_dtype = dtype

    @property
    def num_experts(self) -> int:
        """Experts held here (this rank's EP shard)."""
        return self.w1.shape[0]

    def stored(self) -> tuple:
        """(w1, w3, w2) as ``ops.moe_experts`` takes them: tensors, or ``Packed`` when ``fmt`` is set."""
        if self.fmt is None:
            return self.w1, self.w3, self.w2
        return tuple(Packed(getattr(self, w), getattr(self, f"{w}_scale"), self.fmt, getattr(self, f"{w}_bias"),
                            self.block, self.offsets.get(w, (0, 0))) for w in ("w1", "w3", "w2"))


class MLP(nn.Module):
    """Shared expert: ``w2(silu(min(w1 x, limit)) * clamp(w3 x, +-limit))``."""

    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype, ops: Ops):
        super().__init__()
        self.w1 = Linear(dim, inter, dtype, ops)
        self.w2 = Linear(inter, dim, dtype, ops)
        self.w3 = Linear(dim, inter, dtype, ops)
        self.limit, self.ops = limit, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.swiglu_clamp(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    """``sum_e w_e * expert_e(x) + shared(x)`` (§3.7)."""

    def __init__(self, args: ModelArgs, hash_layer: bool, dtype: torch.dtype, ops: Ops):
        super().__init__()
        self.limit, self.ops = args.swiglu_limit, ops
        self.gate = Gate(args, hash_layer, ops)
        self.experts = Experts(args, dtype)
        inter = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args.hidden_size, inter, args.swiglu_limit, dtype, ops) if inter else None

    # set by Transformer.configure: tokens per routed-expert dispatch (custom_params.
    # moe_chunk_max_len; None = all at once), and the platform + side stream for the shared expert
    chunk: int | None = None
    platform = None
    side = None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, routed=None) -> torch.Tensor:
        """x ``[T, H]``, tokens ``[T]`` -> ``[T, H]``.

        The routed experts run on chunks of at most ``chunk`` tokens (bounds the dispatch buffers
        of a long prefill; a row's result does not depend on its chunk). With a side stream the
        shared expert runs on it beside the routed experts (reference §8.2). ``routed``: the
        routed experts as ``(x [T, H], ids [T, k], weights [T, k]) -> [T, H]`` fp32 instead (a
        captured decode step's fixed-shape form: no host sync, no chunks).
        """
        weights, ids = self.gate(x, tokens)
        e = self.experts
        p, side = self.platform, self.side
        shared = None
        if self.shared_experts is not None and side is not None:
            with p.side_stream(side):
                shared = self.shared_experts(x)
        T, c = x.shape[0], self.chunk or x.shape[0]
        if routed is not None:
            y = routed(x, ids, weights).to(x.dtype)
        elif T <= c:
            y = self.ops.moe_experts(x, ids, weights, *e.stored(), self.limit, e.act)
        else:
            w = e.stored()
            y = torch.cat([self.ops.moe_experts(x[i:i + c], ids[i:i + c], weights[i:i + c], *w, self.limit, e.act)
                           for i in range(0, T, c)])
        if self.shared_experts is None:
            return y
        if shared is None:
            return y + self.shared_experts(x)
        p.join(side, shared)
        return y + shared
