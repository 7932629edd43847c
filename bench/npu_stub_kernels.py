"""Pure-torch twins of the Ascend kernels that ``engine.ops.npu`` calls, for ``bench.npu_stub``.

One function per API in ``engine.ops.npu.KERNEL_APIS``, named as the API and taking its schema's
arguments by name (``bench.npu_stub`` binds a call against the schema, fills the defaults and
passes every argument; the ones a twin does not read land in ``**_``). Each twin first checks the
documented contract the wrappers rely on (dtypes, layouts, modes: the wrappers' docstrings and
[OPP] / [CRI] as cited there) and raises ``ContractError`` when a call is outside it, or
``NotImplementedError`` for a documented mode no wrapper uses (so the stub does not model it).

Values: the real result, from the doc's formula or golden, for rms_norm, transpose_batchmatmul,
clipped_swiglu, the MoE routing / grouped matmul / finalize, dynamic_quant, quant_matmul, the
partial rotary (in place), gating top-k, the three cache epilogues (in place) and the quantised
lightning indexer; hc_pre / hc_post run the reference op, which has the kernel's signature. The
sparse attention returns zeros of its output's shape and dtype, and both metadata ops a zero
int32 placeholder (their real content is the kernel's tiling). Written from the docs, not from
``engine.ops.cache_codec``, so tests can hold the codec's bytes against them.
"""
from __future__ import annotations

import torch

from engine.ops import reference

E4M3 = torch.float8_e4m3fn
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALF = (torch.float16, torch.bfloat16)


class ContractError(ValueError):
    """A stub kernel got arguments outside its documented contract (a wrapper bug on hardware)."""


def need(ok: bool, api: str, what: str) -> None:
    """Raise ``ContractError("<api>: <what>")`` unless ``ok``."""
    if not ok:
        raise ContractError(f"{api}: {what}")


def unmodelled(api: str, what: str) -> NotImplementedError:
    """The error for a documented mode the stub does not model (the caller raises it)."""
    return NotImplementedError(f"{api}: {what} is documented but not modelled by the stub (no wrapper uses it)")


# ---- torch_npu [OPP] ------------------------------------------------------------------------------
def npu_rms_norm(self, gamma, epsilon, **_):
    """(y in x's dtype, rstd fp32 ``[..., 1]``): ``x * rsqrt(mean(x^2) + eps) * gamma``, in fp32."""
    need(self.dtype in FLOATS and 2 <= self.dim() <= 8, "npu_rms_norm", "x fp16/bf16/fp32 with 2-8 dims")
    need(tuple(gamma.shape) == tuple(self.shape[-1:]) and gamma.dtype in (self.dtype, torch.float32),
         "npu_rms_norm", "gamma [d] in x's dtype (or fp32)")
    x = self.float()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


def npu_transpose_batchmatmul(input, weight, bias, scale, perm_x1, perm_x2, perm_y, **_):
    """``permute(permute(input, perm_x1) @ weight, perm_y)`` in fp32, returned in input's dtype."""
    api = "npu_transpose_batchmatmul"
    if bias is not None or scale is not None:
        raise unmodelled(api, "bias / scale")
    need(input.dim() == 3 and weight.dim() == 3 and input.dtype in FLOATS and weight.dtype == input.dtype, api,
         "3-D input / weight of one float dtype")
    need(perm_x2 in (None, [0, 1, 2]), api, "perm_x2 takes only [0, 1, 2]")
    a = input.permute(perm_x1 or [0, 1, 2])
    B, M, K = a.shape
    need(weight.shape[:2] == (B, K) and K % 16 == 0 and weight.shape[2] % 16 == 0 and K * B < 65536, api,
         "weight (B, K, N) against input, K and N multiples of 16, K * B < 65536")
    return torch.bmm(a.float(), weight.float()).permute(perm_y or [0, 1, 2]).to(input.dtype).contiguous()


def npu_clipped_swiglu(x, group_index, dim, alpha, limit, bias, interleaved, **_):
    """``A.clamp(max=limit) * sigmoid(alpha * A) * (B.clamp(-limit, limit) + bias)`` over the halves
    (front / back, or even / odd when interleaved) of ``dim``, in fp32; output in x's dtype."""
    api = "npu_clipped_swiglu"
    if group_index is not None:
        raise unmodelled(api, "group_index")
    need(x.dtype in FLOATS and x.dim() > 1 and x.is_contiguous() and x.shape[dim] % 2 == 0, api,
         "contiguous fp16/bf16/fp32 x, more than 1 dim, even split dim")
    v = x.movedim(dim, -1).float()
    a, b = (v[..., 0::2], v[..., 1::2]) if interleaved else v.chunk(2, dim=-1)
    a, b = a.clamp(max=limit), b.clamp(-limit, limit)
    return (a * torch.sigmoid(alpha * a) * (b + bias)).to(x.dtype).movedim(-1, dim).contiguous()


def npu_moe_init_routing_v2(x, expert_idx, scale, offset, active_num, expert_num, drop_pad_mode,
                            expert_tokens_num_type, quant_mode, active_expert_range, row_idx_type, **_):
    """Dropless routing: (expanded_x ``[T*k, H]`` x's rows sorted by expert (stable), row_idx int32
    ``[T*k]`` (expanded row i came from flat slot ``row_idx[i]``, token ``row_idx[i] // k``),
    expert_tokens int64 ``[expert_num]`` counts, expanded_scale: an empty fp32 tensor)."""
    api = "npu_moe_init_routing_v2"
    need(x.dim() == 2 and x.dtype in FLOATS and expert_idx.dtype == torch.int32 and expert_idx.dim() == 2
         and expert_idx.shape[0] == x.shape[0], api, "x [T, H] float, expert_idx int32 [T, k]")
    if scale is not None or offset is not None or quant_mode != -1 or drop_pad_mode != 0:
        raise unmodelled(api, "quantised or drop/pad routing")
    if expert_tokens_num_type != 1 or row_idx_type != 0:
        raise unmodelled(api, "cumsum / key counts or scatter-type row_idx")
    T, k = expert_idx.shape
    need(0 < expert_num <= 10240 and list(active_expert_range) in ([], [0, expert_num]), api,
         "expert_num 1..10240 and the full active range")
    need(active_num in (-1, T * k), api, "active_num T * k (dropless)")
    flat = expert_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=expert_num)
    return x[order // k], order.to(torch.int32), counts, torch.empty(0)


def npu_grouped_matmul(x, weight, bias, scale, offset, antiquant_scale, per_token_scale, group_list, split_item,
                       group_type, group_list_type, act_type, output_dtype, **_):
    """One x / weight / y (``split_item`` 3) grouped by m: rows of group e times ``weight[e]``
    ``[K, N]``, in fp32. Float x: output in x's dtype. int8 x / weight: times the per-channel
    ``scale[e]`` and ``per_token_scale``, output ``output_dtype`` (bf16 / fp16). Returns ``[y]``."""
    api = "npu_grouped_matmul"
    if bias is not None or offset is not None or antiquant_scale is not None or act_type != 0:
        raise unmodelled(api, "bias / offset / antiquant / fused activation")
    need(len(x) == len(weight) == 1 and split_item == 3 and group_type == 0 and group_list_type in (0, 1), api,
         "one x / weight, split_item 3, group_type 0 (by m), group_list_type 0 / 1")
    (a,), (w,) = x, weight
    E = w.shape[0]
    need(a.dim() == 2 and w.dim() == 3 and w.shape[1] == a.shape[1] and group_list.shape == (E,), api,
         "x [M, K], weight [E, K, N], group_list [E]")
    gl = group_list.long()
    counts = gl if group_list_type == 1 else torch.diff(gl, prepend=gl.new_zeros(1))      # 0: cumulative
    need(int(counts.sum()) == a.shape[0], api, "group sizes add up to the rows of x")
    quant = a.dtype == torch.int8
    if quant:
        need(w.dtype == torch.int8 and scale is not None and per_token_scale is not None, api,
             "int8 x with int8 weight, per-channel scale and per-token scale")
        s, pts = scale[0].reshape(E, -1), per_token_scale[0]
        need(pts.dtype == torch.float32 and pts.shape == (a.shape[0],) and s.shape[1] == w.shape[2], api,
             "per_token_scale fp32 [M], scale [E, N]")
        need((output_dtype, s.dtype) in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)), api,
             "bf16 output with a bf16 scale, or fp16 output with an fp32 scale")
    else:
        need(a.dtype in FLOATS and w.dtype == a.dtype and scale is None, api, "float x and weight of one dtype")
    out = a.new_empty(a.shape[0], w.shape[2], dtype=output_dtype if quant else a.dtype)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            y = a[start:start + c].float() @ w[e].float()
            if quant:
                y = y * s[e].float() * pts[start:start + c, None]
            out[start:start + c] = y.to(out.dtype)
        start += c
    return [out]


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             drop_pad_mode, **_):
    """``out[t] = sum_j scales[t, j] * rows[i]`` over the rows i of token t (``row_idx[i] // k``),
    in fp32; output ``[T, H]`` in the rows' dtype."""
    api = "npu_moe_finalize_routing"
    if skip1 is not None or skip2 is not None or bias is not None or drop_pad_mode != 2:
        raise unmodelled(api, "skip / bias inputs or a drop_pad_mode other than 2")
    y, row_idx = expanded_permuted_rows, expanded_src_to_dst_row.long()
    need(scales is not None and scales.dim() == 2 and scales.dtype == y.dtype and y.dim() == 2
         and y.shape[0] == row_idx.shape[0] == scales.numel(), api, "rows [T*k, H], scales [T, k] in their dtype")
    k = scales.shape[1]
    out = torch.zeros(scales.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, row_idx // k, y.float() * scales.reshape(-1)[row_idx, None].float())
    return out.to(y.dtype)


def npu_dynamic_quant(input, smooth_scales, group_index, dst_type, quant_mode, **_):
    """Per-row symmetric int8 over the last dim: (int8 in input's shape, fp32 scale ``amax / 127``
    of shape ``input.shape[:-1]``; an all-zero row gets scale 1)."""
    api = "npu_dynamic_quant"
    need(input.dtype in HALF, api, "input fp16 / bf16")
    if smooth_scales is not None or group_index is not None or dst_type not in (None, torch.int8) \
            or quant_mode != "pertoken":
        raise unmodelled(api, "smooth scales, groups, other output types or modes")
    s = input.float().abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(input.float() / s).clamp(-127, 127).to(torch.int8), s.squeeze(-1)


def npu_quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype, **_):
    """``(x1 @ x2) * scale * pertoken_scale[:, None]`` in fp32; output ``[m, n]`` ``output_dtype``."""
    api = "npu_quant_matmul"
    if offset is not None or bias is not None or output_dtype is None:
        raise unmodelled(api, "offset / bias / int8 output")
    need(x1.dtype == x2.dtype == torch.int8 and x1.dim() == x2.dim() == 2 and x1.shape[1] == x2.shape[0], api,
         "int8 x1 [m, k], x2 [k, n]")
    m, n = x1.shape[0], x2.shape[1]
    need(max(x1.shape[1], n) < 65536 and scale.shape == (n,) and pertoken_scale is not None
         and pertoken_scale.shape == (m,) and pertoken_scale.dtype == torch.float32, api,
         "k, n <= 65535, scale [n], pertoken_scale fp32 [m]")
    need((output_dtype, scale.dtype) in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                         (torch.float16, torch.float32)), api,
         "bf16 output (fp32 / bf16 scale) or fp16 output (fp32 scale)")
    y = (x1.float() @ x2.float()) * scale.float() * pertoken_scale[:, None]
    return y.to(output_dtype)


# ---- torch.ops.custom [CRI] -----------------------------------------------------------------------
def inplace_partial_rotary_mul(x, r1, r2, rotary_mode, partial_slice, **_):
    """In place on ``x[..., s0:s1]``: ``x * r1 + rotate(x) * r2`` in fp32, where ``rotate`` maps each
    pair (a, b) to (-b, a) ("interleave" mode); returns nothing."""
    api = "inplace_partial_rotary_mul"
    if rotary_mode != "interleave":
        raise unmodelled(api, f"rotary_mode {rotary_mode!r}")
    s0, s1 = partial_slice
    D = x.shape[-1]
    need(x.dim() == 4 and x.is_contiguous() and x.dtype in FLOATS and D <= 1024 and D % 2 == 0, api,
         "contiguous float x [b, s, n, d], d even and <= 1024")
    need(0 <= s0 < s1 == D and (s1 - s0) % 2 == 0, api, "partial_slice [d - r, d], r even")
    need(r1.dtype == r2.dtype and r1.shape == r2.shape and r1.dim() == 4 and r1.shape[-1] == s1 - s0
         and r1.shape[1:3] == (1, 1) and r1.shape[0] == x.shape[0], api, "r1 / r2 alike, [b, 1, 1, r]")
    pe = x[..., s0:s1].float()
    rot = torch.stack((-pe[..., 1::2], pe[..., 0::2]), dim=-1).flatten(-2)
    x[..., s0:s1] = (pe * r1.float() + rot * r2.float()).to(x.dtype)


def npu_hc_pre(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps, **_):
    """(y ``[T, d]`` bf16, post ``[T, 4]`` fp32, comb ``[T, 4, 4]`` fp32): the reference ``hc_pre``."""
    api = "npu_hc_pre"
    need(x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 3 and x.shape[1] == hc_mult == 4, api,
         "contiguous bf16 x [T, 4, d], hc_mult 4")
    n, d = hc_mult, x.shape[2]
    need(all(t.dtype == torch.float32 for t in (hc_fn, hc_scale, hc_base)) and hc_fn.shape == ((2 + n) * n, n * d)
         and hc_scale.shape == (3,) and hc_base.shape == ((2 + n) * n,), api,
         "fp32 hc_fn [24, 4d], hc_scale [3], hc_base [24]")
    y, post, comb = reference.hc_pre(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps, hc_sinkhorn_iters)
    return y.to(torch.bfloat16), post.float(), comb.float()


def npu_hc_post(x, residual, post, comb, **_):
    """``out[k] = post[k] * x + sum_j comb[j, k] * residual[j]`` (the reference ``hc_post``):
    ``[T, hc, d]`` in x's dtype."""
    api = "npu_hc_post"
    T, hc, d = residual.shape
    need(x.dtype == residual.dtype and x.dtype in FLOATS and x.shape == (T, d), api,
         "x [T, d] and residual [T, hc, d] of one float dtype")
    need(post.dtype == comb.dtype and post.shape == (T, hc) and comb.shape == (T, hc, hc), api,
         "post [T, hc] and comb [T, hc, hc] of one dtype")
    need(all(t.is_contiguous() for t in (x, residual, post, comb)), api, "contiguous inputs")
    return reference.hc_post(x, residual, post, comb).to(x.dtype)


def _plan(kw: dict) -> torch.Tensor:
    """1024 int32 zeros made from a tensor argument: a tracer's fake tensors get a fake plan."""
    return next(v for v in kw.values() if isinstance(v, torch.Tensor)).new_zeros(1024, dtype=torch.int32)


def npu_sparse_attn_sharedkv_metadata(num_heads_kv, has_ori_kv, layout_q, layout_kv, **kw):
    """A placeholder: 1024 int32 zeros (the real tensor is the kernel's tiling plan)."""
    need(num_heads_kv == 1 and has_ori_kv and (layout_q, layout_kv) == ("TND", "PA_ND"),
         "npu_sparse_attn_sharedkv_metadata", "one kv head, ori_kv present, TND / PA_ND")
    return _plan(kw)


def npu_sparse_attn_sharedkv(q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q,
                             seqused_kv, sinks, metadata, cmp_ratio, ori_mask_mode, cmp_mask_mode, layout_q,
                             layout_kv, return_softmax_lse, **_):
    """(out ``[T, N, D]`` zeros in q's dtype, softmax_lse: an empty fp32 tensor). Placeholder values:
    the paged, masked attention is not recomputed."""
    api = "npu_sparse_attn_sharedkv"
    if return_softmax_lse:
        raise unmodelled(api, "return_softmax_lse")
    need((layout_q, layout_kv, ori_mask_mode, cmp_mask_mode) == ("TND", "PA_ND", 4, 3), api,
         "TND / PA_ND, mask modes 4 / 3")
    need(q.dim() == 3 and q.shape[0] > 0 and q.shape[1:] == (64, 512) and q.dtype in HALF and q.is_contiguous(),
         api, "contiguous bf16 / fp16 q [T, 64, 512]")
    for name, kv, table in (("ori", ori_kv, ori_block_table), ("cmp", cmp_kv, cmp_block_table)):
        if kv is None:
            need(name == "cmp" and table is None and cmp_sparse_indices is None, api, "ori_kv is required")
            continue
        need(kv.dim() == 4 and kv.shape[2:] == (1, 512) and kv.dtype == q.dtype and kv.shape[1] % 16 == 0
             and kv.shape[1] <= 1024, api, f"{name}_kv PA_ND [blocks, bs, 1, 512] in q's dtype, bs 16k <= 1024")
        need(table is not None and table.dtype == torch.int32 and table.dim() == 2, api,
             f"{name}_block_table int32 [B, blocks]")
    need(cmp_ratio in ((1,) if cmp_kv is None else (4, 128)), api, "cmp_ratio 4 / 128 (1 without cmp_kv)")
    need(cmp_sparse_indices is None or (cmp_sparse_indices.dtype == torch.int32 and cmp_ratio == 4
                                        and cmp_sparse_indices.shape == (q.shape[0], 1, 512)), api,
         "cmp_sparse_indices int32 [T, 1, 512], ratio 4 only")
    need(sinks is not None and sinks.dtype == torch.float32 and sinks.shape == (64,), api, "sinks fp32 [64]")
    need(metadata is not None and cu_seqlens_q is not None and seqused_kv is not None
         and cu_seqlens_q.dtype == seqused_kv.dtype == torch.int32, api,
         "metadata, int32 cu_seqlens_q and seqused_kv")
    return torch.zeros_like(q), torch.empty(0)


def npu_moe_gating_top_k(x, k, bias, input_ids, tid2eid, k_group, group_count, routed_scaling_factor, eps,
                         renorm, norm_type, out_flag, **_):
    """(y ``[T, k]`` in x's dtype, expert_idx int32 ``[T, k]``, norm_out fp32 ``[T, E]``):
    ``s = sqrt(softplus(x))`` in fp32 (norm_type 2); experts = top-k of ``s + bias`` (descending),
    or ``tid2eid[input_ids]`` in hash mode; ``y = s[idx] / (sum + eps) * routed_scaling_factor``."""
    api = "npu_moe_gating_top_k"
    if norm_type != 2 or renorm != 0 or k_group != 1 or group_count != 1 or out_flag:
        raise unmodelled(api, "norm types 0 / 1, renorm, expert groups or out_flag")
    need(x.dim() == 2 and x.dtype in FLOATS and 0 < k <= min(64, x.shape[1]), api, "x [T, E] float, k <= min(64, E)")
    need((input_ids is None) == (tid2eid is None), api, "hash mode takes input_ids and tid2eid together")
    s = torch.sqrt(torch.nn.functional.softplus(x.float()))
    if tid2eid is not None:
        need(input_ids.dtype == torch.int64 and input_ids.shape == (x.shape[0],) and tid2eid.dtype == torch.int32
             and tid2eid.dim() == 2 and tid2eid.shape[1] == k, api, "input_ids int64 [T], tid2eid int32 [n, k]")
        idx = tid2eid[input_ids].long()
    else:
        need(bias is not None and bias.shape == (x.shape[1],) and bias.dtype == x.dtype, api,
             "bias [E] in x's dtype")
        idx = torch.topk(s + bias.float(), k, dim=-1).indices
    w = s.gather(1, idx)
    y = w / (w.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), s


def kv_compress_epilog(kv_compress_cache, x, slot_mapping, quant_group_size, quant_mode, round_scale_flag, **_):
    """In place: row ``slot_mapping[i]`` (skipped when -1) of the e4m3 cache ``[rows, 640]`` gets
    rope (last 64 of x) as bf16 bytes | 448 nope e4m3 | 7 per-64 e8m0 exponents (amax / 448
    rounded up to a power of two, floor 1e-4) | zeros [CRI golden_mxfp8_row, quant_mode 2]."""
    api = "kv_compress_epilog"
    need(kv_compress_cache.dtype == E4M3 and kv_compress_cache.is_contiguous() and kv_compress_cache.dim() == 2,
         api, "contiguous float8_e4m3fn cache [rows, d']")
    need(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == 512 and x.is_contiguous(), api,
         "contiguous bf16 x [T, 512]")
    need(slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.shape == (x.shape[0],), api,
         "slot_mapping int32 / int64 [T]")
    if (quant_group_size, quant_mode, round_scale_flag) != (64, 2, True):
        raise unmodelled(api, "group sizes / quant modes other than 64 / 2 with rounded scales")
    rope, nope = x[:, 448:], x[:, :448].float().view(-1, 7, 64)
    s = nope.abs().amax(-1, keepdim=True).clamp_min(1e-4) * torch.tensor(1 / 448.0, dtype=torch.float32)
    bits = s.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()        # round the scale up to 2^k
    s = (exp << 23).view(torch.float32)
    q = (nope / s).clamp(-448, 448).to(E4M3).view(torch.uint8).view(-1, 448)
    row = torch.zeros(x.shape[0], kv_compress_cache.shape[1], dtype=torch.uint8, device=x.device)
    row[:, :128] = rope.contiguous().view(torch.uint8)
    row[:, 128:576], row[:, 576:583] = q, exp.view(-1, 7).to(torch.uint8)
    keep = slot_mapping >= 0
    kv_compress_cache.view(torch.uint8)[slot_mapping[keep].long()] = row[keep]


def indexer_compress_epilog(indexer_compress_cache, indexer_compress_scale, x, slot_mapping, quant_mode, **_):
    """In place: row ``slot_mapping[i]`` (skipped when -1) gets x in e4m3 per 128-block with fp32
    scale ``amax / 448`` (a zero block: scale 0, codes 0) [CRI dynamic_block_quant, quant_mode 1]."""
    api = "indexer_compress_epilog"
    need(indexer_compress_cache.dtype == E4M3 and indexer_compress_scale.dtype == torch.float32, api,
         "float8_e4m3fn cache and fp32 scale")
    need(x.dtype in HALF and x.dim() == 2 and slot_mapping.dtype == torch.int32
         and slot_mapping.shape == (x.shape[0],), api, "fp16 / bf16 x [T, d], slot_mapping int32 [T]")
    d = x.shape[1]
    need(d % 128 == 0 and indexer_compress_cache.shape[1] == d and indexer_compress_scale.shape[1] == d // 128, api,
         "cache [rows, d] and scale [rows, d / 128]")
    if quant_mode != 1:
        raise unmodelled(api, f"quant_mode {quant_mode}")
    blocks = x.float().view(x.shape[0], -1, 128)
    s = blocks.abs().amax(-1, keepdim=True) / 448.0
    q = torch.nan_to_num((blocks / s).clamp(-448, 448)).to(E4M3).view(x.shape[0], d)
    keep = slot_mapping >= 0
    indexer_compress_cache[slot_mapping[keep].long()] = q[keep]
    indexer_compress_scale[slot_mapping[keep].long()] = s.squeeze(-1)[keep]


def scatter_nd_update_asc(var, indices, update, **_):
    """In place: ``var[indices[i, 0]] = update[i]`` (skipped when -1)."""
    api = "scatter_nd_update_asc"
    need(var.dtype in (torch.bfloat16, torch.float16, torch.int8) and var.dim() == 2 and var.shape[1] in (1, 128, 512),
         api, "var bf16 / fp16 / int8 [b, s], s in {1, 128, 512}")
    need(indices.dtype in (torch.int32, torch.int64) and indices.shape == (update.shape[0], 1)
         and update.shape[0] <= var.shape[0], api, "indices int32 / int64 [u, 1], u <= b")
    need(update.dtype == var.dtype and update.dim() == 2 and update.shape[1] == var.shape[1]
         and update.is_contiguous(), api, "contiguous update [u, s] in var's dtype")
    keep = indices[:, 0] >= 0
    var[indices[keep, 0].long()] = update[keep]


def npu_quant_lightning_indexer_metadata(num_heads_k, query_quant_mode, key_quant_mode, batch_size, layout_query,
                                         layout_key, **kw):
    """A placeholder: 1024 int32 zeros (the real tensor is the kernel's tiling plan)."""
    need((num_heads_k, query_quant_mode, key_quant_mode) == (1, 0, 0) and batch_size >= 1
         and (layout_query, layout_key) == ("TND", "PA_BSND"), "npu_quant_lightning_indexer_metadata",
         "one key head, quant modes 0, batch_size >= 1, TND / PA_BSND")
    return _plan(kw)


def npu_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode,
                                key_quant_mode, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                                metadata, layout_query, layout_key, sparse_count, sparse_mode, cmp_ratio,
                                return_value, **_):
    """(indices int32 ``[T, 1, sparse_count]``, values: an empty fp32 tensor). Top-``sparse_count``
    (by score, -1 padded) of ``sum_h w_h ReLU(sq_h sk (q_h . k))`` over the closed compressed
    entries each query sees (query i of a sequence of T_b queries and S2 keys sits at ``S2 - T_b +
    i`` and sees ``(S2 - T_b + i + 1) // cmp_ratio``), for each of the B sequences of
    ``block_table`` (one per decode row, or one prefill chunk)."""
    api = "npu_quant_lightning_indexer"
    T, n1, d = query.shape
    nb, bs, n2, _ = key.shape
    need(query.dtype == key.dtype == torch.int8 and (n1, n2, d) == (64, 1, 128), api,
         "int8 query [T, 64, 128] and key [blocks, bs, 1, 128]")
    need(weights.dtype == query_dequant_scale.dtype == key_dequant_scale.dtype == torch.float16
         and key_dequant_scale.shape == (nb, bs, 1) and weights.shape == query_dequant_scale.shape == (T, 64), api,
         "fp16 weights / query scale [T, 64], key scale [blocks, bs, 1]")
    need(block_table is not None and block_table.dtype == torch.int32 and block_table.dim() == 2
         and metadata is not None and bs % 16 == 0 and 0 < bs <= 1024, api,
         "int32 block_table [B, blocks], metadata, bs a multiple of 16 up to 1024")
    need((layout_query, layout_key, sparse_mode, query_quant_mode, key_quant_mode) == ("TND", "PA_BSND", 3, 0, 0)
         and 1 <= sparse_count <= 2048 and cmp_ratio in (1, 2, 4, 8, 16, 32, 64, 128), api,
         "TND / PA_BSND, sparse_mode 3, quant modes 0, sparse_count 1..2048, cmp_ratio a power of two <= 128")
    cu = [0, *actual_seq_lengths_query.tolist()]                       # prefix sums of query counts
    B = block_table.shape[0]
    if return_value:
        raise unmodelled(api, "return_value")
    need(len(cu) == B + 1 == actual_seq_lengths_key.shape[0] + 1 and cu[-1] == T
         and all(a <= b for a, b in zip(cu, cu[1:])), api,
         "actual_seq_lengths_query: B ascending prefix sums ending at T; actual_seq_lengths_key [B]")
    out = torch.full((T, sparse_count), -1, dtype=torch.int32)
    for b in range(B):
        t0, t1, S2 = cu[b], cu[b + 1], int(actual_seq_lengths_key[b])
        n = S2 // cmp_ratio
        if n == 0 or t1 == t0:
            continue
        ids = torch.arange(n)
        rows = block_table[b, ids // bs].long() * bs + ids % bs
        k = key.view(nb * bs, d)[rows].float() * key_dequant_scale.view(-1)[rows, None].float()
        q = query[t0:t1].float() * query_dequant_scale[t0:t1].float()[..., None]
        s = (torch.einsum("thd,nd->thn", q, k).relu() * weights[t0:t1].float()[..., None]).sum(1)
        seen = (S2 - (t1 - t0) + torch.arange(t1 - t0) + 1) // cmp_ratio
        s = s.masked_fill(ids[None] >= seen[:, None], float("-inf"))
        kk = min(sparse_count, n)
        v, top = s.topk(kk, dim=-1)                                      # by score, not by id
        out[t0:t1, :kk] = torch.where(torch.isinf(v), -1, top).int()
    return out.view(T, 1, sparse_count), torch.empty(0)
