"""Quantised decode-state caches on Ascend: the cache epilogues (quantise + scatter) and the quantised
lightning indexer reading the stored int8 keys (see ``engine.ops.npu``; layouts in
``engine.cache_dtype`` / ``engine.ops.cache_codec``).

``cache_sparse_attn`` has no wrapper: see ``engine.ops.npu.NOT_MAPPED``.
"""
from __future__ import annotations

import torch

from engine.ops.npu.runtime import BF16, HALF, custom_namespace, device_why, dtype_why, fallback, first_reason, \
    torch_npu_module

_KV_DIM, _KV_ROPE, _KV_ROW = 512, 64, 640     # kv_compress_epilog: d fixed 512, rope slice 64, d' = 640
_IDX_BLOCK = 128                              # indexer_compress_epilog: one scale per 128 elements
LI_HEADS, LI_DIM, LI_MAX_TOPK = 64, 128, 2048
LI_RATIOS = (1, 2, 4, 8, 16, 32, 64, 128)
_SCATTER_WIDTHS = (1, 128, 512)               # scatter_nd_update_asc: s in {1, 128, 512}


def _write_why(rows, idx: torch.Tensor, x: torch.Tensor) -> str | None:
    """Reason ``cache_write`` cannot use its kernels for these inputs (None if it can)."""
    c = rows.codec
    kind = ("indexer " if c.indexer else "kv ") + c.kind
    if kind == "kv fp8":
        dtype, shape = dtype_why("x", x, BF16), (
            None if (c.dim, c.rope_dim, c.row_bytes) == (_KV_DIM, _KV_ROPE, _KV_ROW)
            else f"kv row d={c.dim} rope={c.rope_dim} ({c.row_bytes} B), kernel takes 512 / 64 (640 B)")
    elif kind == "indexer fp8":
        dtype, shape = dtype_why("x", x, HALF), first_reason(
            None if c.dim == _IDX_BLOCK else f"indexer d {c.dim}, pool keeps one scale per 128",
            None if rows.num_rows < 2 ** 31 else "pool rows exceed int32 slot_mapping")
    elif kind == "indexer int8" or c.kind == "none":
        dtype, shape = dtype_why("x", x, HALF), (
            None if c.dim in _SCATTER_WIDTHS else f"{kind} d {c.dim}, scatter takes 1 / 128 / 512")
    else:
        return f"{kind} cache: no documented epilogue kernel for this kind"
    return first_reason(dtype, device_why(x), device_why(rows.parts[0]),
                        None if x.dim() == 2 and x.shape[-1] == c.dim
                        else f"x shape {tuple(x.shape)}, seam takes [N, {c.dim}]",
                        None if idx.dim() == 1 and idx.shape[0] == x.shape[0] else "idx is not [N]",
                        None if x.shape[0] > 0 else "no rows",
                        None if x.dtype == c.dtype else "x dtype differs from the pool's compute dtype",
                        None if all(p.is_contiguous() for p in rows.parts) else "pool parts not contiguous", shape)


def cache_write(rows, idx: torch.Tensor, x: torch.Tensor) -> None:
    """Quantise rows and scatter them into the pool with the cache epilogue kernels.

    * KV ``fp8`` (950): ``torch.ops.custom.kv_compress_epilog(kv_compress_cache, x, slot_mapping, *,
      quant_group_size=64, quant_mode=2, round_scale_flag=True)``. Contract [CRI
      custom-npu_kv_compress_epilog.md; golden ``examples/test_npu_kv_compress_epilog.py``]: 950PR/DT;
      cache float8_e4m3fn ``[rows, d']``, contiguous (the uint8 part viewed as e4m3, no copy); x
      bfloat16 ``[T, d]``, d fixed 512, contiguous; slot_mapping int32 / int64 ``[T]``. Row =
      rope (last 64 of x) as bf16 bytes | 448 nope e4m3 | per-64 e8m0 exponents | zeros to d' = 640:
      ``engine.ops.cache_codec``'s fp8 KV layout.
    * indexer ``fp8`` (950): ``torch.ops.custom.indexer_compress_epilog(indexer_compress_cache,
      indexer_compress_scale, x, slot_mapping, *, quant_mode=1, round_scale=True)``. Contract [CRI
      custom-npu_indexer_compress_epilog.md; DSV4 call site ``compressor.py update_compress_cache``]:
      cache float8_e4m3fn ``[rows, d]`` (the uint8 part as e4m3), scale float32 ``[rows, d / 128]``,
      x float16 / bfloat16 ``[T, d]``, slot_mapping int32 only; quant_mode 1 = scale amax / 448 per
      128 elements (round_scale acts on the MX mode 0 only). The doc fixes d at 4096, the DSV4 recipe
      calls it with the indexer keys, d = index_head_dim = 128 (its tiling splits d in 128-blocks);
      the wrapper takes d = 128, the pool's one scale per row.
    * indexer ``int8`` (A3): ``torch_npu.npu_dynamic_quant(x)`` (per-row int8, scale amax / 127,
      fp32) then ``torch.ops.custom.scatter_nd_update_asc(var, indices, update)`` for the keys and
      the fp16 scales, as the DSV4 recipe writes ``li_cmp_kv`` / ``li_key_dequant_scale``. Contract
      [CRI custom-npu_scatter_nd_update_asc.md]: var bfloat16 / float16 / int8 ``[b, s]`` with s in
      {1, 128, 512}; indices int32 / int64 ``[u, 1]``, u <= b; update ``[u, s]`` of var's dtype.
      [OPP npu_dynamic_quant]: x float16 / bfloat16.
    * unquantised KV / indexer keys (``none``: bf16 / fp16 rows, e.g. the window ring of every
      layer): ``torch.ops.custom.scatter_nd_update_asc(var, indices, update)`` with the rows as
      they are (same contract: s = d in {1, 128, 512}, so Flash / Pro's 512-wide KV rows and
      128-wide indexer keys).

    Args / Returns / Raises: as ``engine.ops.reference.cache_write`` (idx ``[N]`` int64 flat rows,
    none -1; x ``[N, dim]``; the pool's parts updated in place).

    Falls back to the reference for: a pool kind with no documented epilogue (HiF8: its
    quant_mode 3 is outside the doc's contract), x or the pool not on an
    NPU, x not ``[N, dim]`` in the pool's compute dtype, no rows, non-contiguous parts; per kind:
    KV fp8 with x not bfloat16, d != 512, rope != 64 or a row other than 640 bytes; indexer fp8 with
    d != 128 or more rows than int32 indexes; indexer int8 and unquantised rows with d not in
    {1, 128, 512}.
    """
    c = rows.codec
    kind = ("indexer " if c.indexer else "kv ") + c.kind
    why = _write_why(rows, idx, x)
    if why:
        return fallback("cache_write", why, rows, idx, x)
    x = x.contiguous()
    if kind == "kv fp8":
        custom_namespace().kv_compress_epilog(rows.parts[0].view(torch.float8_e4m3fn), x, idx.contiguous(),
                                              quant_group_size=64, quant_mode=2, round_scale_flag=True)
    elif kind == "indexer fp8":
        custom_namespace().indexer_compress_epilog(rows.parts[0].view(torch.float8_e4m3fn), rows.parts[1], x,
                                                   idx.to(torch.int32).contiguous(), quant_mode=1, round_scale=True)
    elif c.kind == "none":
        custom_namespace().scatter_nd_update_asc(rows.parts[0], idx.reshape(-1, 1).contiguous(), x)
    else:
        q, s = torch_npu_module().npu_dynamic_quant(x)
        ind = idx.reshape(-1, 1).contiguous()
        custom = custom_namespace()
        custom.scatter_nd_update_asc(rows.parts[1], ind, s.to(torch.float16).reshape(-1, 1).contiguous())
        custom.scatter_nd_update_asc(rows.parts[0], ind, q.contiguous())
    return None


def lightning_indexer_why(q: torch.Tensor, keys, topk: int, ratio: int, block_size: int, empty: str) -> str | None:
    """The first reason ``npu_quant_lightning_indexer`` cannot take these inputs (None if it can):
    int8 keys only, q bfloat16 / float16 on an NPU, at least one query row (``empty`` names the
    case otherwise), 64 x 128 heads, top-k 1..2048, a power-of-two ratio up to 128, blocks of a
    multiple of 16 up to 1024."""
    n, h, dI = q.shape
    c = keys.codec
    return first_reason(None if c.indexer and c.kind == "int8" else f"indexer {c.kind} keys: only int8 keys are documented",
                        dtype_why("q", q, HALF), device_why(q), None if n > 0 else empty,
                        None if (h, dI) == (LI_HEADS, LI_DIM) else f"heads x dim {h} x {dI}, kernel takes 64 x 128",
                        None if 1 <= topk <= LI_MAX_TOPK else f"topk {topk}, kernel takes 1..2048",
                        None if ratio in LI_RATIOS else f"ratio {ratio}, kernel takes 1..128 (powers of two)",
                        None if block_size % 16 == 0 and 0 < block_size <= 1024 else f"block size {block_size}")


def ascending_ids(ids: torch.Tensor) -> torch.Tensor:
    """The kernel's int32 picks ``[n, k]`` (-1 = none, in score order) as the reference returns
    them: int64, ascending, -1 last."""
    big = torch.iinfo(torch.long).max
    ids = ids.long()
    ids = torch.where(ids < 0, big, ids).sort(dim=-1).values
    return torch.where(ids == big, -1, ids)


def cache_indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys, block_table: torch.Tensor,
                       block_size: int, positions: torch.Tensor, ratio: int, topk: int, scale: float) -> torch.Tensor:
    """Lightning-indexer top-k over the stored int8 keys via ``torch.ops.custom.npu_quant_lightning_indexer``,
    tiled by ``npu_quant_lightning_indexer_metadata``; q quantised by ``torch_npu.npu_dynamic_quant``.

    Schemas [CRI ops_def_registration.cpp]: ``npu_quant_lightning_indexer(Tensor query, Tensor key,
    Tensor weights, Tensor query_dequant_scale, Tensor key_dequant_scale, int query_quant_mode, int
    key_quant_mode, *, Tensor? actual_seq_lengths_query, Tensor? actual_seq_lengths_key, Tensor?
    block_table, Tensor? metadata, str layout_query, str layout_key, int sparse_count, int
    sparse_mode, ..., int cmp_ratio, bool return_value) -> (Tensor, Tensor)`` and
    ``npu_quant_lightning_indexer_metadata(int num_heads_q, int num_heads_k, int head_dim, int
    query_quant_mode, int key_quant_mode, *, actual_seq_lengths_query, actual_seq_lengths_key, int
    batch_size, int max_seqlen_q, int max_seqlen_k, str layout_query, str layout_key, int
    sparse_count, int sparse_mode, ..., int cmp_ratio, str device) -> Tensor``.

    Contract [CRI custom-npu_quant_lightning_indexer(_metadata).md; DSV4 call site ``indexer.py
    forward_li_quant``]: A3. query int8 TND ``[T, 64, 128]`` with per token-head fp16
    query_dequant_scale ``[T, 64]`` (quant modes 0); key int8 PA_BSND ``[blocks, bs, 1, 128]`` with
    fp16 key_dequant_scale ``[blocks, bs, 1]``, bs a multiple of 16 up to 1024; weights fp16 ``[T,
    64]`` (the recipe folds the softmax scale in); int32 block_table ``[B, blocks]``;
    actual_seq_lengths_query the prefix sums of query counts, actual_seq_lengths_key the
    uncompressed key count (query i sits at ``S2 - T + i``); sparse_mode 3 (right-down causal),
    cmp_ratio 1..128 (powers of two), sparse_count 1..2048. Output int32 ``[T, 1, sparse_count]``.
    score = sum_h w_h ReLU(sq_h sk (q_h . k)): with the fp16 scales as stored, the reference's
    ``quant_query`` + decoded keys up to the fp16 weights and summation order; ties may pick other ids.

    Adaptation: one sequence, B = 1, ``S2 = positions[-1] + 1``; the pool's parts are viewed as
    blocks (no copy; the trailing trash row is left out); the result is sorted ascending, -1 last.

    Falls back to the reference for: keys not int8 (fp8 keys: the doc covers int8 q / k on A3 only;
    HiF8: ``cann_ops_transformer.quant_lightning_indexer`` is not documented in [CRI]; unquantised:
    see ``NOT_MAPPED['indexer_topk']``), q not bfloat16 / float16, not on an NPU, no queries or no
    closed window, h x dI != 64 x 128, topk outside 1..2048, a ratio not a power of two up to 128,
    bs not a multiple of 16 up to 1024, positions not consecutive.
    """
    T, h, dI = q.shape
    why = lightning_indexer_why(q, keys, topk, ratio, block_size, "no queries")
    if not why:
        p0, p1 = int(positions[0]), int(positions[-1])
        why = first_reason(None if p1 - p0 == T - 1 else "positions not consecutive",
                           None if (p1 + 1) // ratio > 0 else "no closed window")
    if why:
        return fallback("cache_indexer_topk", why, q, weights, keys, block_table, block_size, positions, ratio,
                        topk, scale)
    dev, i32, bs = q.device, torch.int32, block_size
    nb = keys.num_rows // bs
    k = keys.parts[0][:nb * bs].view(nb, bs, 1, dI)
    ks = keys.parts[1][:nb * bs].view(nb, bs, 1)
    qq, qs = torch_npu_module().npu_dynamic_quant(q.contiguous())            # int8 [T, h, dI], fp32 [T, h]
    S2 = p1 + 1
    seq_q = torch.tensor([T], dtype=i32, device=dev)
    seq_k = torch.tensor([S2], dtype=i32, device=dev)
    modes = dict(layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=3, cmp_ratio=ratio)
    custom = custom_namespace()
    meta = custom.npu_quant_lightning_indexer_metadata(
        h, 1, dI, 0, 0, actual_seq_lengths_query=seq_q, actual_seq_lengths_key=seq_k, batch_size=1,
        max_seqlen_q=T, max_seqlen_k=S2, device=str(dev), **modes)
    out = custom.npu_quant_lightning_indexer(
        qq, k, (weights.float() * scale).to(torch.float16).contiguous(), qs.to(torch.float16).contiguous(), ks, 0, 0,
        actual_seq_lengths_query=seq_q, actual_seq_lengths_key=seq_k,
        block_table=block_table.to(i32).reshape(1, -1).contiguous(), metadata=meta, return_value=False, **modes)[0]
    return ascending_ids(out.reshape(T, topk))
