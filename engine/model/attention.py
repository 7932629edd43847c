"""Shared-KV MQA with sink, sliding window, CSA / HCA compressors and the lightning indexer.

reference/dsv4-architecture.md §3.3 (attention), §3.4 (compressor), §3.5 (indexer). One class per
paper component; the math lives in the ops (``engine.ops.reference``).
Letters: T tokens, H hidden, h heads, d head dim, q_lora rank, G output groups.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import CSA_RATIO, ModelArgs
from engine.model.layers import Linear, RMSNorm, RotaryTable, param
from engine.ops import Ops
from engine.ops.reference import num_new_entries
from engine.model.state import CompressorState, LayerState


class Compressor(nn.Module):
    """Softmax-gated pooling of every ``ratio`` tokens into one KV entry (§3.4).

    ratio 4 (CSA) uses overlapping windows (``wkv``/``wgate`` emit 2*dim: Ca | Cb); ratio 128
    (HCA) does not. The projections, state and pooling run in fp32 (weights as stored: bf16, or
    HiF8 in ``w4a8-mx-hif``, dequantised whole per call: ``[c*d, H]`` is small).
    """

    def __init__(self, args: ModelArgs, ratio: int, dim: int, rope: RotaryTable, ops: Ops):
        super().__init__()
        width = (2 if ratio == CSA_RATIO else 1) * dim
        self.ratio, self.dim, self.rope, self.ops = ratio, dim, rope, ops
        self.wkv = Linear(args.hidden_size, width, torch.float32, ops)
        self.wgate = Linear(args.hidden_size, width, torch.float32, ops)
        self.ape = param((ratio, width), torch.float32)
        self.norm = RMSNorm(dim, args.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, start_pos: int, state: CompressorState, out_dtype: torch.dtype) -> torch.Tensor:
        """x ``[T, H]`` -> new entries ``[n_new, dim]`` (RMSNormed, roped at ``ratio * i``)."""
        n_new = num_new_entries(start_pos, x.shape[0], self.ratio)
        first = start_pos // self.ratio
        cos, sin = self.rope.cos_sin(torch.arange(first, first + n_new, device=x.device) * self.ratio)
        f32 = torch.float32
        return self.ops.compressor(self.wkv.quant_input(x), self.wkv.dense_weight(f32), self.wgate.dense_weight(f32),
                                   self.ape, self.norm.weight, self.norm.eps, state, start_pos, cos, sin, out_dtype)


class Indexer(nn.Module):
    """Lightning indexer: picks ``index_topk`` compressed entries per query (§3.5)."""

    def __init__(self, args: ModelArgs, rope: RotaryTable, dtype: torch.dtype, ops: Ops):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.ops = ops
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, dtype, ops)
        self.weights_proj = Linear(args.hidden_size, self.n_heads, torch.float32, ops)
        self.compressor = Compressor(args, CSA_RATIO, self.head_dim, rope, ops)

    def project(self, x: torch.Tensor, c_q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Row-wise part for all packed tokens: x ``[T, H]``, c_q ``[T, q_lora]`` -> roped queries
        ``[T, h_I, d_I]`` and head weights ``[T, h_I]`` fp32 (already * h_I^-0.5)."""
        T = x.shape[0]
        q = self.ops.rope(self.wq_b(c_q).view(T, self.n_heads, self.head_dim), cos, sin)
        return q, self.weights_proj(x.float()) * self.n_heads ** -0.5

    def select(self, x: torch.Tensor, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, start_pos: int,
               state: LayerState) -> torch.Tensor:
        """One sequence: compress its indexer keys, then top-k entry ids ``[T, index_topk]`` (-1 = none).
        The keys are read as stored (``ops.cache_indexer_topk``: with a quantised key cache the
        queries are quantised alike)."""
        keys = state.idx_kv
        keys.append(self.compressor(x, start_pos, state.idx_comp, keys.codec.dtype))
        return self.ops.cache_indexer_topk(q, w, *keys.paged(), positions, CSA_RATIO, self.topk,
                                           self.head_dim ** -0.5)


class Attention(nn.Module):
    """Shared-KV MQA: q-LoRA queries, one K=V head, window + compressed keys, sink, grouped wo (§3.3)."""

    def __init__(self, args: ModelArgs, ratio: int, rope: RotaryTable, dtype: torch.dtype, ops: Ops):
        super().__init__()
        H, d, nh = args.hidden_size, args.head_dim, args.num_attention_heads
        self.n_heads, self.head_dim, self.n_groups = nh, d, args.o_groups
        self.window, self.ratio, self.eps, self.ops = args.sliding_window, ratio, args.rms_norm_eps, ops
        self.wq_a = Linear(H, args.q_lora_rank, dtype, ops)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, ops)
        self.wq_b = Linear(args.q_lora_rank, nh * d, dtype, ops)
        self.wkv = Linear(H, d, dtype, ops)
        self.kv_norm = RMSNorm(d, args.rms_norm_eps, ops)
        self.wo_a = Linear(nh * d // args.o_groups, args.o_groups * args.o_lora_rank, dtype, ops)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, H, dtype, ops)
        self.attn_sink = param((nh,), torch.float32)
        self.compressor = Compressor(args, ratio, d, rope, ops) if ratio else None
        self.indexer = Indexer(args, rope, dtype, ops) if ratio == CSA_RATIO else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, spans: list[tuple[int, int, int]],
                states: list[LayerState], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Packed tokens of several sequences -> attention output ``[T, H]``.

        x ``[T, H]`` (normed); positions ``[T]``; spans: per sequence ``(offset, length, start_pos)``
        into the packed rows; states: that sequence's state for this layer (updated in place);
        cos/sin ``[T, r/2]`` of this layer's rope. Projections run over all rows at once; the window,
        compressors, indexer and sparse attention run per sequence (the decode rows of many
        requests run together in the serving engine's decode step, ``engine.core.static_decode``).
        """
        T = x.shape[0]
        ops = self.ops
        c_q = self.q_norm(self.wq_a(x))                                           # [T, q_lora]
        q = self.wq_b(c_q).view(T, self.n_heads, self.head_dim)                   # [T, h, d]
        q = ops.rope(ops.rms_norm(q, None, self.eps), cos, sin)
        kv = ops.rope(self.kv_norm(self.wkv(x)), cos, sin)                        # [T, d]
        if self.indexer is not None:
            iq, iw = self.indexer.project(x, c_q, cos, sin)
        o = torch.empty_like(q)
        for (off, n, start_pos), state in zip(spans, states):
            sl = slice(off, off + n)
            win_kv, win_pos0 = state.window_keys(kv[sl], start_pos)
            state.write_window(kv[sl], start_pos)
            cmp_kv = topk = None
            if self.compressor is not None:
                state.cmp_kv.append(self.compressor(x[sl], start_pos, state.comp, kv.dtype))
                cmp_kv = state.cmp_kv.view()
                if self.indexer is not None:
                    topk = self.indexer.select(x[sl], iq[sl], iw[sl], positions[sl], start_pos, state)
            o[sl] = ops.sparse_attn(q[sl], positions[sl], win_kv, win_pos0, self.window, cmp_kv, self.ratio, topk,
                                    self.attn_sink, self.head_dim ** -0.5)
        o = ops.rope(o, cos, -sin)                                                # undo rope on V
        return self.out_proj(o)

    # o_proj tensor parallelism (``engine.parallel.shard.OProjTP``): (attention, o) -> ``[T, H]``
    # from this rank's groups, the ranks' partial sums joined; None: every group here
    o_proj_tp = None

    def out_proj(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped output projection (§3.3 step 8): o ``[T, h, d]`` -> ``[T, H]``; under o_proj TP
        through ``o_proj_tp``."""
        if self.o_proj_tp is not None:
            return self.o_proj_tp(self, o)
        o = o.reshape(o.shape[0], self.n_groups, self.n_heads * self.head_dim // self.n_groups)
        o = self.ops.grouped_linear(self.wo_a.quant_input(o), self.wo_a.stored)
        return self.wo_b(o.flatten(1))
