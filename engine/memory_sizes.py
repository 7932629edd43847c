"""The sizes a rank's memory plan adds up (``engine.memory_plan``), per rank (one device), in bytes:
the weights it keeps, the workspace of a step, and the decode state of one request. Torch-free.

* **Weights**, resident exactly as stored (the loader's rule): every tensor of
  ``engine.checkpoint.layout.checkpoint_layout`` a rank keeps, at its stored dtype and shape (FP8 +
  e8m0 scales, MXFP4, int8 / int4 + scales, bf16, fp32; nothing upcast), cut as
  ``engine.parallel.shard`` cuts them: routed experts over ``moe_ep_size = world_size /
  moe_tp_size`` ranks (whole experts; moe_tp cuts w1 / w3 rows and w2 columns), the shared expert
  over ``shared_tp_size`` (the same cuts), o_proj over ``o_proj_tp_size`` (wo_a rows, wo_b
  columns), the embedding and LM head over ``embed_tp_size`` / ``lmhead_tp_size`` in contiguous
  vocab slices of ceil(V/s) rows (the LM head's last slice is zero-padded to that: resident may
  exceed what a rank reads); everything else replicated. MTP weights only when next_n > 0.
* **Workspace** (``workspace``): the largest transient tensors of a step. T = the prefill chunk a
  rank runs (``effective_max_prefill_tokens`` / cp_size), a = the compute dtype's bytes:

  ==========  ===============================================  =====================================
  residual    2 * hc_mult * T * H * 4                          the mHC streams into and out of a
                                                               block (fp32)
  attention   T * (2*n_h*d + q_lora + d + n_idx*d_idx) * a     queries and output, q latent, KV,
              + T * index_topk * 4                             indexer queries, top-k ids (fused
                                                               sparse attention / indexer kernels:
                                                               no [T, L] score matrix)
  moe         T_m * k * (2*H*a + 3*I_loc*a + 2*H*4) + T_m*H*4  dispatched rows sent + received, w1 /
              T_m = min(T, moe_chunk_max_len), I_loc = I/tp    w3 outputs and SwiGLU, fp32 partials
                                                               sent + received, the fp32 combine
  logits      2 * R * V * 4, R = batch per DP rank * (1+next_n)  fp32 logits of the sampled rows +
                                                               one temporary of their size
  reserve     accelerator: 1 GiB + 2 * 200 MiB per group of    runtime, graphs, allocator slack;
              more than one rank; CPU: 0                       HCCL_BUFFSIZE (200 MB default) in +
                                                               out per communicator
  ==========  ===============================================  =====================================

  Prefill and sampling terms are added although a step never peaks in both: an upper bound.
* **Decode state per request** (``state_per_request``): ``engine.core.block_manager``'s paged
  layout (its ``Geometry``), in whole blocks as the engine allocates them: the window ring, CSA
  compressed KV + indexer keys and HCA compressed KV in blocks of ``block_size`` entries, the fp32
  compressor-state slot (with next_n > 0 the ring and state keep the MTP groups), and with
  next_n > 0 the MTP layers' window rings (reference §4: ``ring_len`` rows per MTP layer, in the
  same ``win`` blocks as the trunk's ring; a P/D transfer ships their live min(L, W-1) rows as
  ``mtp.k.win_kv``), counted once, apart from ``window``. KV rows and indexer-key entries are
  stored as ``Layout.cache_dtype`` says (``engine.cache_dtype``: KV 1024 B bf16 / 640 B fp8 /
  512 B HiF8 per row at head_dim 512, indexer 256 B bf16 / 130 B int8 / 132 B fp8 / 128 B HiF8
  per entry at index_head_dim 128).
  The totals match reference/dsv4-architecture.md §4's rows (bf16, A3 default, 950 C8) up to
  the block rounding (HCA's 64 entries at 8K take a whole 128-entry block).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engine.cache_dtype import CacheDtype, indexer_row_bytes, kv_row_bytes, resolve
from engine.checkpoint.layout import ITEMSIZE, TensorSpec, checkpoint_layout
from engine.config import ModelArgs
from engine.core.block_manager import GROWING, Geometry

GIB, MIB = 1 << 30, 1 << 20
RUNTIME_RESERVE, HCCL_BUFFER = 1 * GIB, 200 * MIB
COMPONENTS = ("embedding", "lm_head", "attention", "compressor_indexer", "router", "shared_experts",
              "routed_experts", "mhc_norms", "mtp")
ACT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+|\*)\.w([123])\.")


@dataclass(frozen=True)
class Layout:
    """What the plan reads from a run config (``Layout.of``); change a field to try another layout."""

    world_size: int = 1
    moe_tp_size: int = 1
    shared_tp_size: int = 1
    o_proj_tp_size: int = 1
    embed_tp_size: int = 1
    lmhead_tp_size: int = 1
    cp_size: int = 1
    next_n: int = 0
    act_bytes: int = 2                   # compute dtype; the KV pools use it too
    block_size: int = 128
    batch_per_rank: int = 1              # batch_size per attention-DP rank
    prefill_tokens: int = 8192           # the prefill chunk one rank runs
    moe_chunk: int = 65536
    mem_fraction: float = 0.85
    max_model_len: int | None = None     # scheduler_config.max_model_len (None: not set)
    platform: str | None = None          # A2 | A3 | 950; None: no Ascend platform named (CPU)
    cache_dtype: CacheDtype = CacheDtype()   # storage of the KV / indexer caches (engine.cache_dtype)

    @property
    def moe_ep_size(self) -> int:
        return self.world_size // self.moe_tp_size

    @classmethod
    def of(cls, cfg, cache_dtype: CacheDtype | None = None) -> "Layout":
        """From a ``engine.run_config.RunConfig``; the caches' storage ``cache_dtype`` (None:
        ``scheduler_config.kv_cache_dtype`` resolved with no checkpoint, where ``auto`` means
        unquantised: pass ``cfg.cache_dtype_for(args)`` to read the checkpoint's cache schemes)."""
        p, s, m = cfg.parallel_config, cfg.scheduler_config, cfg.model_config
        return cls(p.world_size, p.moe_tp_size, p.shared_tp_size, p.o_proj_tp_size, p.embed_tp_size,
                   p.lmhead_tp_size, p.cp_size, m.next_n, ACT_BYTES[m.dtype], s.block_size,
                   cfg.batch_size_per_dp_rank, -(-cfg.effective_max_prefill_tokens // p.cp_size),
                   m.custom_params.moe_chunk_max_len, s.mem_fraction_static, s.max_model_len, m.platform_version,
                   resolve(s.kv_cache_dtype, None) if cache_dtype is None else cache_dtype)


@dataclass(frozen=True)
class WeightRow:
    """One component's weights: bytes in the whole checkpoint (every rank's share), bytes of the
    stored slices this rank keeps, bytes it holds (those plus the LM head's padding rows)."""

    checkpoint: int
    read: int
    resident: int


# ---- weights -----------------------------------------------------------------------------------
def component(name: str) -> str:
    """Which ``COMPONENTS`` entry a stored tensor belongs to (by its checkpoint name)."""
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith(("embed.", "head.")):
        return "embedding" if name.startswith("embed.") else "lm_head"
    for part, comp in ((".ffn.experts.", "routed_experts"), (".ffn.shared_experts.", "shared_experts"),
                       (".ffn.gate.", "router"), (".attn.compressor.", "compressor_indexer"),
                       (".attn.indexer.", "compressor_indexer")):
        if part in name:
            return comp
    if "hc_" in name or "norm" in name:
        return "mhc_norms"
    if ".attn." in name:
        return "attention"
    raise ValueError(f"memory plan: no component for tensor {name!r}")


def _cut(shape: list[int], dim: int, parts: int) -> None:
    if parts > 1 and len(shape) > dim:
        shape[dim] = -(-shape[dim] // parts)


def kept_bytes(name: str, spec: TensorSpec, args: ModelArgs, lay: Layout, rank: int) -> tuple[int, int]:
    """(bytes ``rank`` reads, bytes it holds) of the stored tensor ``name``; (0, 0): not kept.
    A routed expert's name may carry ``*`` for its index: then one expert's bytes, kept by every rank."""
    if name.startswith("mtp.") and lay.next_n == 0:
        return 0, 0
    shape, item = list(spec.shape), ITEMSIZE[spec.dtype]
    m = _EXPERT.search(name)
    if m:
        per = args.n_routed_experts // lay.moe_ep_size
        if m.group(1) != "*" and int(m.group(1)) // per != rank // lay.moe_tp_size:
            return 0, 0
        _cut(shape, 1 if m.group(2) == "2" else 0, lay.moe_tp_size)
    elif ".ffn.shared_experts.w" in name:
        _cut(shape, 1 if ".w2." in name else 0, lay.shared_tp_size)
    elif ".attn.wo_a." in name or ".attn.wo_b." in name:
        _cut(shape, 0 if ".wo_a." in name else 1, lay.o_proj_tp_size)
    elif name in ("embed.weight", "head.weight"):
        s = lay.embed_tp_size if name == "embed.weight" else lay.lmhead_tp_size
        per = -(-args.vocab_size // s)
        lo = min(args.vocab_size, (rank % s) * per)
        rows = min(args.vocab_size, lo + per) - lo
        held = per if name == "head.weight" and s > 1 else rows      # the LM head's padded slice
        return rows * shape[1] * item, held * shape[1] * item
    n = math.prod(shape) * item
    return n, n


_GROUPED: dict[int, tuple[ModelArgs, list]] = {}


def _grouped_layout(args: ModelArgs) -> list[tuple[str, str, TensorSpec, int]]:
    """(component, name, spec, count) for every stored tensor of ``checkpoint_layout(args)``, the
    routed experts of one layer and weight kind folded into one entry (index ``*``, count E: they
    are all the same size); cached per ``args`` object (the layout of Pro takes ~0.7 s)."""
    hit = _GROUPED.get(id(args))
    if hit is not None and hit[0] is args:
        return hit[1]
    groups: dict[str, list] = {}
    for name, spec in checkpoint_layout(args).items():
        if ".ffn.experts." in name:                  # "<p>.ffn.experts.<e>.w1.weight" -> "<p>.ffn.experts.*.w1.weight"
            head, rest = name.split(".ffn.experts.", 1)
            name = f"{head}.ffn.experts.*.{rest.split('.', 1)[1]}"
        if name in groups:
            groups[name][3] += 1
        else:
            groups[name] = [component(name), name, spec, 1]
    if len(_GROUPED) >= 8:
        _GROUPED.clear()
    _GROUPED[id(args)] = (args, [tuple(g) for g in groups.values()])
    return _GROUPED[id(args)][1]


def weight_bytes(args: ModelArgs, lay: Layout, rank: int = 0) -> dict[str, WeightRow]:
    """Per component: ``WeightRow`` of ``rank`` (rank 0 holds the most: the first vocab slices)."""
    acc = {c: [0, 0, 0] for c in COMPONENTS}
    for comp, name, spec, count in _grouped_layout(args):
        row = acc[comp]
        read, held = kept_bytes(name, spec, args, lay, rank)
        kept = count // lay.moe_ep_size if count > 1 else 1        # this rank's experts of the layer
        row[0] += spec.nbytes * count
        row[1] += read * kept
        row[2] += held * kept
    return {c: WeightRow(*v) for c, v in acc.items()}


# ---- workspace and state ---------------------------------------------------------------------------
def workspace(args: ModelArgs, lay: Layout, accelerator: bool) -> dict[str, int]:
    """Transient bytes per rank by term (the module docstring's table)."""
    a, T, H = lay.act_bytes, lay.prefill_tokens, args.hidden_size
    tm, k, i_loc = min(T, lay.moe_chunk), args.num_experts_per_tok, args.moe_intermediate_size // lay.moe_tp_size
    attn = T * (2 * args.num_attention_heads * args.head_dim + args.q_lora_rank + args.head_dim
                + args.index_n_heads * args.index_head_dim) * a + T * args.index_topk * 4
    groups = (lay.world_size > 1) + sum(s > 1 for s in (lay.embed_tp_size, lay.lmhead_tp_size,
                                                         lay.o_proj_tp_size, lay.shared_tp_size))
    return {
        "residual": 2 * args.hc_mult * T * H * 4,
        "attention": attn,
        "moe": tm * k * (2 * H * a + 3 * i_loc * a + 2 * H * 4) + tm * H * 4,
        "logits": 2 * lay.batch_per_rank * (1 + lay.next_n) * args.vocab_size * 4,
        "reserve": RUNTIME_RESERVE + 2 * HCCL_BUFFER * groups if accelerator else 0,
    }


def state_per_request(args: ModelArgs, lay: Layout, tokens: int) -> dict[str, int]:
    """Bytes one request of ``tokens`` processed tokens holds, by part (the module docstring):
    KV and indexer rows as ``lay.cache_dtype`` stores them, the compressor state fp32."""
    g = Geometry.of(args, lay.block_size, lay.next_n, lay.cache_dtype)
    kv = kv_row_bytes(lay.cache_dtype.kv, args.head_dim, args.qk_rope_head_dim, lay.act_bytes)
    idx = indexer_row_bytes(lay.cache_dtype.indexer, args.index_head_dim, lay.act_bytes)
    c4 = g.blocks_needed("c4", tokens) * lay.block_size * len(g.csa_layers)      # CSA entries, all layers
    # the win blocks hold the MTP rings too (``Geometry.bytes_per_block``): split them out, once
    mtp = g.mtp_layers * g.ring_len * kv
    return {
        "window": g.blocks_needed("win", 0) * g.bytes_per_block("win", lay.act_bytes) - mtp,
        "csa_kv": c4 * kv,
        "indexer": c4 * idx,
        "hca_kv": g.blocks_needed("c128", tokens) * g.bytes_per_block("c128", lay.act_bytes),
        "compressor_state": g.state_bytes(),
        "mtp_window": mtp,
    }


def pool_overheads(args: ModelArgs, lay: Layout) -> tuple[int, int]:
    """(scratch, minimum) bytes: the pools' part no request holds (a window ring, a state slot,
    one trash row per entry pool), and the least state the engine starts with (``plan_cache``'s
    fixed part: a request of one block of each growing pool per batch slot, plus the scratch);
    rows stored as ``lay.cache_dtype`` says."""
    g = Geometry.of(args, lay.block_size, lay.next_n, lay.cache_dtype)
    a = lay.act_bytes
    ring = g.blocks_needed("win", 0) * g.bytes_per_block("win", a) + g.state_bytes()
    scratch = ring + sum(g.bytes_per_block(p, a) // lay.block_size for p in GROWING)
    one = ring + sum(g.bytes_per_block(p, a) for p in GROWING)          # ``ring``: the MTP rings included
    return scratch, scratch + lay.batch_per_rank * one
