"""Batched decode attention and indexer on Ascend: one kernel call per layer for all decode rows
(see ``engine.ops.npu``; the reference is ``engine.ops.reference.decode``).

The kernels are the ones the per-sequence wrappers call (``attention.sparse_attn``,
``cache_quant.cache_indexer_topk``, whose docstrings quote the schemas and contracts [CRI]); here
they get B sequences of one query each, the form the recipe's decode step passes them: TND
queries with ``cu_seqlens_q = 0, 1, .., B``, ``seqused_kv`` / ``actual_seq_lengths_key`` =
position + 1 per row, and each row's blocks of the stored pools through a block table, read in
place (no copy of any key). Every size the tiling metadata needs comes from ``pos`` (positions on
the host) or, in a captured step, from ``max_seqlen`` (its context bucket), so a call has no host
sync.
"""
from __future__ import annotations

import torch

from engine.ops.npu.cache_quant import ascending_ids, lightning_indexer_why
from engine.ops.npu.runtime import (HALF, custom_namespace, device_why, dtype_why, fallback, first_reason,
                                    torch_npu_module)

_SAS_HEADS, _SAS_DIM, _SAS_WINDOW, _SAS_TOPK = 64, 512, 128, 512


def _block_why(bs: int) -> str | None:
    return None if bs % 16 == 0 and 0 < bs <= 1024 else f"block size {bs}, kernel takes a multiple of 16 up to 1024"


def _paged(pool, bs: int) -> torch.Tensor:
    """An unquantised pool's rows as PA_ND blocks ``[blocks, bs, 1, d]`` (a view; the trailing
    trash row is left out)."""
    nb = pool.num_rows // bs
    return pool.parts[0][:nb * bs].view(nb, bs, 1, pool.codec.dim)


def _table(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """int32 block table; padding past a row's blocks (an out-of-pool id) becomes a real block id,
    which the kernel never reads (it lies past the row's ``seqused_kv``)."""
    return t.clamp(max=num_blocks - 1).to(torch.int32).contiguous()


def decode_sparse_attn(q: torch.Tensor, positions: torch.Tensor, pos: list[int] | None, win,
                       win_table: torch.Tensor, ring_len: int, window: int, cmp, cmp_table: torch.Tensor | None,
                       cmp_ratio: int, topk_idx: torch.Tensor | None, sinks: torch.Tensor, scale: float,
                       block_size: int, max_seqlen: int | None = None) -> torch.Tensor:
    """``reference.decode_sparse_attn`` via ``torch.ops.custom.npu_sparse_attn_sharedkv`` (tiled by
    ``npu_sparse_attn_sharedkv_metadata``), B sequences of one query each.

    The window ring as the kernel's ``ori_kv``: the kernel addresses position p through logical
    block ``p // bs`` of the row's ``ori_block_table``; the ring keeps p in slot ``p % ring_len``,
    so logical block j maps to ring block ``win_table[b, j % (ring_len / bs)]`` (a table of
    ``S2 / bs`` entries per row, S2 = ``max(pos) + 1`` or ``max_seqlen``: O(context), int32). The band mask (mode 4, left
    ``window - 1``) lets in exactly the ring's live positions. The entry pool as ``cmp_kv`` with
    the row's entry blocks; CSA passes the indexer's picks as ``cmp_sparse_indices [B, 1, 512]``
    (-1 padded), HCA none (mode 3 causal: every closed entry). Window-only layers pass
    ``cmp_ratio=1``, ``has_cmp_kv=False``.

    Pro's 128 heads run as two calls of 64 (heads share the KV; each has its own sink).

    Falls back to the reference for: q not bfloat16 / float16, not on an NPU, no rows, d != 512
    or h not a multiple of 64, window != 128, a quantised or other-dtype pool (quantised KV: see
    ``NOT_MAPPED['cache_sparse_attn']``), a ratio other than 4 / 128, a top-k width other than 512
    (or on a ratio other than 4), a block size outside the PA_ND contract, or a ring that is not
    whole blocks.
    """
    B, h, d = q.shape
    if cmp is not None and cmp_table is None:       # no row holds an entry block: window only
        cmp = topk_idx = None
    pools = [win] + ([cmp] if cmp is not None else [])
    why = first_reason(dtype_why("q", q, HALF), device_why(q), None if B > 0 else "no rows",
                       None if d == _SAS_DIM and h % _SAS_HEADS == 0
                       else f"heads x dim {h} x {d}, kernel takes 64 x 512 (n x 64 heads: n calls)",
                       None if window == _SAS_WINDOW else f"window {window}, kernel takes 128",
                       next((f"{p.codec.kind} KV pool: the quantised-KV kernel is not mapped" for p in pools
                             if p.codec.kind != "none"), None),
                       None if all(p.parts[0].dtype == q.dtype for p in pools) else "kv dtype differs from q",
                       None if cmp is None or cmp_ratio in (4, 128) else f"cmp_ratio {cmp_ratio}, kernel takes 4 or 128",
                       None if topk_idx is None or (topk_idx.shape[-1] == _SAS_TOPK and cmp_ratio == 4)
                       else "top-k width is not 512 (or not on a ratio-4 layer)",
                       _block_why(block_size),
                       None if ring_len % block_size == 0 else f"ring of {ring_len} slots is not whole blocks",
                       None if pos is not None or max_seqlen else "neither host positions nor max_seqlen")
    if why:
        return fallback("decode_sparse_attn", why, q, positions, pos, win, win_table, ring_len, window, cmp,
                        cmp_table, cmp_ratio, topk_idx, sinks, scale, block_size, max_seqlen)
    dev, bs, i32 = q.device, block_size, torch.int32
    S2 = max(pos) + 1 if pos is not None else max_seqlen
    n_ring = ring_len // bs
    logical = torch.arange(S2 // bs + (S2 % bs > 0), device=dev) % n_ring
    ori_bt = win_table.gather(1, logical.expand(B, -1)).to(i32).contiguous()
    cmp_kv = cmp_bt = sparse = None
    if cmp is not None:
        cmp_kv = _paged(cmp, bs)
        cmp_bt = _table(cmp_table, cmp_kv.shape[0])
        if topk_idx is not None:
            sparse = topk_idx.to(i32).reshape(B, 1, topk_idx.shape[-1]).contiguous()
    ratio = cmp_ratio if cmp is not None else 1
    cu_q = torch.arange(B + 1, dtype=i32, device=dev)
    seqused = (positions + 1).to(i32)
    masks = dict(ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=window - 1, ori_win_right=0,
                 layout_q="TND", layout_kv="PA_ND")
    custom = custom_namespace()
    hk = _SAS_HEADS
    metadata = custom.npu_sparse_attn_sharedkv_metadata(
        hk, 1, d, cu_seqlens_q=cu_q, seqused_kv=seqused, batch_size=B, max_seqlen_q=1, max_seqlen_kv=S2,
        cmp_topk=0 if sparse is None else sparse.shape[-1], cmp_ratio=ratio, has_ori_kv=True,
        has_cmp_kv=cmp is not None, device=str(dev), **masks)
    # Pro's 128 heads: heads share the KV and have their own sink, so 64 at a time is exact
    outs = [custom.npu_sparse_attn_sharedkv(
        q[:, j:j + hk].contiguous(), ori_kv=_paged(win, bs), cmp_kv=cmp_kv, cmp_sparse_indices=sparse,
        ori_block_table=ori_bt, cmp_block_table=cmp_bt, cu_seqlens_q=cu_q, seqused_kv=seqused,
        sinks=sinks[j:j + hk].float().contiguous(), metadata=metadata, softmax_scale=float(scale), cmp_ratio=ratio,
        return_softmax_lse=False, **masks)[0].view(B, hk, d) for j in range(0, h, hk)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def decode_indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys, block_table: torch.Tensor, block_size: int,
                        positions: torch.Tensor, pos: list[int] | None, ratio: int, topk: int, scale: float,
                        max_seqlen: int | None = None) -> torch.Tensor:
    """``reference.decode_indexer_topk`` via ``torch_npu.npu_dynamic_quant`` +
    ``torch.ops.custom.npu_quant_lightning_indexer`` (tiled by ``npu_quant_lightning_indexer_metadata``), B sequences of one query
    each over the stored int8 keys (PA_BSND, read in place) with each row's block table.

    The kernel's ``[B, 1, topk]`` int32 comes back as the reference returns it: ``[B, topk]``
    int64, ascending, -1 last.

    Falls back to the reference for: keys not int8 (``cache_indexer_topk``'s reasons), q not
    bfloat16 / float16, not on an NPU, no rows, no row with a closed window (known from ``pos``; a
    captured step passes ``max_seqlen`` and the kernel pads such rows with -1), h x dI != 64 x 128,
    topk outside 1..2048, a ratio not a power of two up to 128, a block size outside 16..1024.
    """
    B, h, dI = q.shape
    S2 = max(pos) + 1 if pos is not None and B else max_seqlen
    why = first_reason(lightning_indexer_why(q, keys, topk, ratio, block_size, "no rows"),
                       "neither host positions nor max_seqlen" if not S2 else None,
                       None if pos is None or (B and S2 // ratio > 0) else "no closed window")
    if why:
        return fallback("decode_indexer_topk", why, q, weights, keys, block_table, block_size, positions, pos,
                        ratio, topk, scale, max_seqlen)
    dev, i32, bs = q.device, torch.int32, block_size
    nb = keys.num_rows // bs
    k = keys.parts[0][:nb * bs].view(nb, bs, 1, dI)
    ks = keys.parts[1][:nb * bs].view(nb, bs, 1)
    qq, qs = torch_npu_module().npu_dynamic_quant(q.contiguous())            # int8 [B, h, dI], fp32 [B, h]
    seq_q = torch.arange(1, B + 1, dtype=i32, device=dev)                    # prefix sums of one query per row
    seq_k = (positions + 1).to(i32)
    modes = dict(layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=3, cmp_ratio=ratio)
    custom = custom_namespace()
    meta = custom.npu_quant_lightning_indexer_metadata(
        h, 1, dI, 0, 0, actual_seq_lengths_query=seq_q, actual_seq_lengths_key=seq_k, batch_size=B,
        max_seqlen_q=1, max_seqlen_k=S2, device=str(dev), **modes)
    out = custom.npu_quant_lightning_indexer(
        qq, k, (weights.float() * scale).to(torch.float16).contiguous(), qs.to(torch.float16).contiguous(), ks, 0, 0,
        actual_seq_lengths_query=seq_q, actual_seq_lengths_key=seq_k, block_table=_table(block_table, nb),
        metadata=meta, return_value=False, **modes)[0]
    return ascending_ids(out.reshape(B, topk))
