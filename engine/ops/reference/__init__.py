"""Pure-torch reference ops: the numerics contract of the model (reference/dsv4-architecture.md §3).

Each function is one fused op of the NPU port (§8.1) written as plain math. They must match HF
transformers 5.23.0 ``DeepseekV4ForCausalLM`` in fp32; in bf16 they keep the precision choices of
§5 (fp32 router, compressor pooling, mHC, norms, RoPE tables, softmax). Memory stays linear in the
number of query tokens: attention and indexer work on query chunks, never on an L x L matrix.

Letters: T query tokens, H hidden, h heads, d head dim, r rope dims (trailing), N kv entries,
k selected entries, E experts, I expert width, n mHC streams (hc_mult), m compress ratio.

One module per family (blas: the fixed-shape GEMM calls; dense; mhc; attention: compressor, indexer,
sparse attention; moe; cache: ops over the stored decode-state pools; decode: those ops for a batch of
one-query rows); this package is the table of
all of them, by op name (``engine.ops.REFERENCE``).
"""
from __future__ import annotations

from engine.ops.reference.blas import gemm, row_mix, row_scores
from engine.ops.reference.dense import lm_head, rms_norm, rope, linear, quant_linear, act_quant, grouped_linear
from engine.ops.reference.mhc import hc_pre, hc_post, hc_head
from engine.ops.reference.attention import (compressor, num_new_entries, indexer_topk, indexer_scores,
                                            weighted_relu_sum, topk_low_index, sparse_attn)
from engine.ops.reference.moe import gating_topk, swiglu_clamp, moe_experts
from engine.ops.reference.cache import cache_write, cache_indexer_topk, cache_sparse_attn
from engine.ops.reference.decode import decode_indexer_topk, decode_sparse_attn

__all__ = [
    "gemm", "row_mix", "row_scores", "lm_head", "rms_norm", "rope", "linear", "quant_linear",
    "act_quant", "grouped_linear", "hc_pre", "hc_post", "hc_head", "compressor", "num_new_entries",
    "indexer_topk", "indexer_scores", "weighted_relu_sum", "topk_low_index", "sparse_attn", "gating_topk",
    "swiglu_clamp", "moe_experts", "cache_write", "cache_indexer_topk", "cache_sparse_attn",
    "decode_indexer_topk", "decode_sparse_attn",
]
