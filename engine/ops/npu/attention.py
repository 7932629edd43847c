"""Sparse attention over the window and the selected compressed entries (see ``engine.ops.npu``)."""
from __future__ import annotations

import torch

from engine.ops.npu.runtime import HALF, device_why, dtype_why, fallback, first_reason


_SAS_BLOCK = 128               # PA_ND block size: a multiple of 16, at most 1024
_SAS_HEADS, _SAS_DIM, _SAS_WINDOW, _SAS_TOPK = 64, 512, 128, 512


def sparse_attn(q: torch.Tensor, positions: torch.Tensor, win_kv: torch.Tensor, win_pos0: int, window: int,
                cmp_kv: torch.Tensor | None, cmp_ratio: int, topk_idx: torch.Tensor | None,
                sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Window + compressed (+ top-k) shared-KV attention with sinks via
    ``torch.ops.custom.npu_sparse_attn_sharedkv``, tiled by ``npu_sparse_attn_sharedkv_metadata``.

    Schemas [CRI ops_def_registration.cpp]: ``npu_sparse_attn_sharedkv(Tensor q, *, ori_kv, cmp_kv,
    ori_sparse_indices, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q,
    cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_kv, sinks, metadata, float
    softmax_scale, int cmp_ratio, int ori_mask_mode=4, int cmp_mask_mode=3, int ori_win_left=127,
    int ori_win_right=0, str layout_q, str layout_kv, bool return_softmax_lse) -> (out, lse)`` and
    ``npu_sparse_attn_sharedkv_metadata(int num_heads_q, int num_heads_kv, int head_dim, *,
    cu_seqlens_q, ..., seqused_kv, int batch_size, int max_seqlen_q, int max_seqlen_kv, int
    ori_topk, int cmp_topk, int cmp_ratio, masks, windows, layouts, bool has_ori_kv, bool
    has_cmp_kv, str device) -> Tensor``.

    Contract [CRI custom-npu_sparse_attn_sharedkv(_metadata).md; call site ``prepare_fa_kwargs`` /
    ``generate_sas_metadata_kwargs`` in modeling_deepseek.py]: A3 only. q is TND ``[T, 64, 512]``
    bf16/fp16, contiguous. ori_kv/cmp_kv are PA_ND ``[blocks, block_size, 1, 512]`` in q's dtype, with
    int32 block tables ``[B, blocks]``. sinks ``[64]`` fp32. The band mask (mode 4) has
    ``ori_win_left`` 127 and ``ori_win_right`` 0. The compressed mask is mode 3 (right-down causal)
    with ``cmp_ratio`` 4 or 128. ``cmp_sparse_indices`` is int32 ``[T, 1, 512]`` (K2 = 512 only), and
    the recipe passes the indexer's output (padded with -1) directly. metadata is required. Empty
    tensors are not supported. Query i sits at position ``seqused_kv - T + i``.

    Adaptation: one sequence, B = 1, ``seqused_kv = positions[-1] + 1``. The window keys are copied
    into a small paged buffer. Logical blocks before ``win_pos0``'s block map to physical block 0:
    every key there lies outside every query's band, so the band mask never lets it in. Window-only
    layers pass ``cmp_ratio=1`` and ``has_cmp_kv=False``, as the recipe does for its c1a layers.

    Falls back to the reference for: q not bf16/fp16, not on an NPU, no queries, h != 64, d != 512,
    ``window != 128``, or kv dtypes other than q's. Also when ``cmp_ratio`` is not 4/128, or a top-k
    width is not 512 (or comes with a ratio other than 4). Also when the window keys do not cover
    ``win_pos0 .. positions[-1]`` or fewer compressed entries exist than windows closed.
    """
    T, h, d = q.shape
    ckv, tk = (None, None) if cmp_kv is not None and cmp_kv.shape[0] == 0 else (cmp_kv, topk_idx)
    why = first_reason(dtype_why("q", q, HALF), device_why(q),
                 None if T > 0 else "no queries",
                 None if (h, d) == (_SAS_HEADS, _SAS_DIM) else f"heads x dim {h} x {d}, kernel takes 64 x 512",
                 None if window == _SAS_WINDOW else f"window {window}, kernel takes 128",
                 None if win_kv.dtype == q.dtype and (ckv is None or ckv.dtype == q.dtype)
                 else "kv dtype differs from q",
                 None if ckv is None or cmp_ratio in (4, 128) else f"cmp_ratio {cmp_ratio}, kernel takes 4 or 128",
                 None if tk is None or (tk.shape[-1] == _SAS_TOPK and cmp_ratio == 4)
                 else "top-k width is not 512 (or not on a ratio-4 layer)")
    if not why:
        p_first, p_last = int(positions[0]), int(positions[-1])
        S2 = p_last + 1
        why = first_reason(None if win_pos0 <= max(0, p_first - window + 1) and win_pos0 + win_kv.shape[0] >= S2
                     else "window keys do not cover every query's window",
                     None if ckv is None or ckv.shape[0] >= S2 // cmp_ratio
                     else "fewer compressed entries than closed windows")
    if why:
        return fallback("sparse_attn", why, q, positions, win_kv, win_pos0, window, cmp_kv, cmp_ratio,
                         topk_idx, sinks, scale)
    dev, bs, i32 = q.device, _SAS_BLOCK, torch.int32
    b0, b_last = win_pos0 // bs, p_last // bs
    nb = b_last - b0 + 1
    ori = q.new_zeros(nb * bs, d)
    off, used = win_pos0 - b0 * bs, S2 - win_pos0
    ori[off:off + used] = win_kv[:used]
    ori_bt = torch.zeros(1, b_last + 1, dtype=i32, device=dev)
    ori_bt[0, b0:] = torch.arange(nb, dtype=i32, device=dev)
    cmp_buf = cmp_bt = sparse = None
    if ckv is not None:
        nc = -(-ckv.shape[0] // bs)
        cmp_buf = q.new_zeros(nc * bs, d)
        cmp_buf[:ckv.shape[0]] = ckv
        cmp_buf = cmp_buf.view(nc, bs, 1, d)
        cmp_bt = torch.arange(nc, dtype=i32, device=dev).view(1, nc)
        if tk is not None:
            sparse = tk.to(i32).reshape(T, 1, tk.shape[-1]).contiguous()
    ratio = cmp_ratio if ckv is not None else 1
    cu_q = torch.tensor([0, T], dtype=i32, device=dev)
    seqused = torch.tensor([S2], dtype=i32, device=dev)
    masks = dict(ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=window - 1, ori_win_right=0,
                 layout_q="TND", layout_kv="PA_ND")
    metadata = torch.ops.custom.npu_sparse_attn_sharedkv_metadata(
        h, 1, d, cu_seqlens_q=cu_q, seqused_kv=seqused, batch_size=1, max_seqlen_q=T, max_seqlen_kv=S2,
        cmp_topk=0 if sparse is None else sparse.shape[-1], cmp_ratio=ratio, has_ori_kv=True,
        has_cmp_kv=ckv is not None, device=str(dev), **masks)
    out = torch.ops.custom.npu_sparse_attn_sharedkv(
        q.contiguous(), ori_kv=ori.view(nb, bs, 1, d), cmp_kv=cmp_buf, cmp_sparse_indices=sparse,
        ori_block_table=ori_bt, cmp_block_table=cmp_bt, cu_seqlens_q=cu_q, seqused_kv=seqused,
        sinks=sinks.float().contiguous(), metadata=metadata, softmax_scale=float(scale), cmp_ratio=ratio,
        return_softmax_lse=False, **masks)[0]
    return out.view(T, h, d)
