"""Ascend kernels behind the ops seam (reference/dsv4-architecture.md §8.1).

Each wrapper here has exactly the signature and return contract of the ``engine.ops.reference``
op of the same name and adapts it to a documented torch_npu API or a cann-recipes-infer custom op
(``torch.ops.custom.*``, registered by that repository's ``custom_ops`` package). ``npu_ops`` puts a
wrapper into the ``Ops`` table only when its kernels exist at runtime; the other ops stay on the
reference, and each such op is logged once.

Per call, a wrapper first checks its inputs against the kernel's documented contract using plain
torch only. If an input is outside it, the wrapper calls the reference op and logs the reason once
per (op, reason). Only after the checks pass does it reach torch_npu. The checks cover:

* fp32 activations. The fp32 path is the numerics contract and the HF-parity path, so it always
  runs the reference, even where a kernel also accepts fp32 (rms_norm, rope, grouped_linear,
  hc_post). ``gating_topk`` is the exception: its logits are fp32 in every model dtype (§5 row 1),
  and its kernel takes fp32.
* tensors that are not on an NPU device.
* shapes the kernel does not support.

This module never imports torch_npu at import time. ``npu_ops`` imports it, together with the
optional ``custom_ops`` library.

Signatures were confirmed from:

* [OPP] github Ascend/op-plugin, ``op_plugin/config/op_plugin_functions.yaml`` (schemas) and
  ``docs/zh/custom_APIs/torch_npu/*.md`` (contracts).
* [CRI] github hicann/cann-recipes-infer, ``ops/ascendc/torch_ops_extension/custom_ops/csrc/
  ops_def_registration.cpp`` (schemas), ``ops/ascendc/docs/custom-*.md`` and
  ``ops/ascendc/examples/test_npu_*.py`` (contracts, goldens), ``models/deepseek_v4/`` (call sites).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import fields
from typing import Callable

import torch

from engine.ops import KERNEL_CONFIG_KEY, REFERENCE, Ops, reference, validate_kernel_config

log = logging.getLogger("engine.ops.npu")

_HALF = (torch.bfloat16, torch.float16)
_BF16 = (torch.bfloat16,)
_LOGGED: set[tuple[str, str]] = set()          # (op, reason) already logged
_AVAILABLE: dict[str, bool] = {}               # api name -> present in this runtime


class NpuUnavailableError(ImportError):
    """``--device npu`` was asked for but torch_npu cannot be imported."""


# ---- logging and fallback ----------------------------------------------------------------------
def log_reference_op(op: str, reason: str) -> bool:
    """Log once per op name: "op X: no NPU kernel (reason); using the reference op". True if logged."""
    key = (op, "\0table")
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    log.info("op %s: no NPU kernel (%s); using the reference op", op, reason)
    return True


def log_fallback(op: str, reason: str) -> bool:
    """Log once per (op, reason) that a call fell back to the reference op. True if logged."""
    key = (op, reason)
    if key in _LOGGED or torch.compiler.is_compiling():     # graph tracers cannot call a logger
        return False
    _LOGGED.add(key)
    log.warning("op %s: input outside the NPU kernel's contract (%s); using the reference op for "
                "such calls", op, reason)
    return True


def _fallback(op: str, reason: str, *args):
    log_fallback(op, reason)
    return getattr(reference, op)(*args)


def _dtype_why(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> str | None:
    if t.dtype in allowed:
        return None
    names = "/".join(str(d).removeprefix("torch.") for d in allowed)
    return f"{name} dtype {str(t.dtype).removeprefix('torch.')}, kernel path takes {names}"


def _device_why(t: torch.Tensor) -> str | None:
    return None if t.device.type == "npu" else f"tensors on {t.device.type}, not on an NPU device"


def _first(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r), None)


def _torch_npu():
    """The torch_npu module; reached only after a wrapper's checks passed (inputs on an NPU)."""
    return importlib.import_module("torch_npu")


# ---- wrappers ----------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm via ``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)`` (output 0).

    Contract [OPP npu_rms_norm doc, schema ``npu_rms_norm(Tensor self, Tensor gamma, float
    epsilon)``]: ``x`` 2-8 dims, ND; ``gamma`` = the trailing dim. ``gamma`` is passed in ``x.dtype``,
    the one pairing every documented torch_npu version accepts (older docs require equal dtypes;
    newer ones also allow fp32 gamma with bf16/fp16 x). This is the NPU reference's choice (bf16
    weights in ``npu_rms_norm``, §5 row 5). ``weight=None`` passes a ones gamma.

    Falls back to the reference for: ``x`` not bf16/fp16 (fp32 stays on the reference), not on an
    NPU, or not 2-8 dims.
    """
    why = _first(_dtype_why("x", x, _HALF), _device_why(x),
                 None if 2 <= x.dim() <= 8 else f"x has {x.dim()} dims, kernel takes 2-8")
    if why:
        return _fallback("rms_norm", why, x, weight, eps)
    gamma = (torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if weight is None
             else weight.to(x.dtype))
    return _torch_npu().npu_rms_norm(x, gamma, epsilon=float(eps))[0]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved partial RoPE via ``torch.ops.custom.inplace_partial_rotary_mul``.

    Schema [CRI ops_def_registration.cpp]: ``inplace_partial_rotary_mul(Tensor(a!) x, Tensor r1,
    Tensor r2, *, str rotary_mode, int[2] partial_slice) -> ()``. The op is in place, so the wrapper
    rotates a contiguous copy of ``x``.

    Contract [CRI custom-inplace_partial_rotary_mul.md; DSV4 call sites in modeling_deepseek.py]:
    x ``[b, s, n, d]`` contiguous, d <= 1024 and even; r1/r2 (cos/sin) ``[b, 1, 1, slice]``, full
    width, each frequency repeated twice (``repeat_interleave(2)``, as the recipe's rotary
    embedding builds them); ``rotary_mode="interleave"``; ``partial_slice=[d - r, d]``. x and r1/r2
    may have mixed dtypes; r1 and r2 must match each other. The seam's ``[T, D]`` / ``[T, h, D]`` is
    viewed as ``[T, 1 or h, 1, D]`` with cos/sin ``[T, 1, 1, r]`` fp32, the recipe's layout for kv
    (``view(-1, 1, 1, d)``) and q (``unsqueeze(2)``). Passing ``-sin`` gives the inverse rotation.

    Falls back to the reference for: x not bf16/fp16, not on an NPU, x not 2-D/3-D, no rows,
    ``D > 1024`` or odd, ``r > D``, or cos/sin dtypes that differ or are not float.
    """
    r = 2 * cos.shape[-1]
    D = x.shape[-1]
    why = _first(_dtype_why("x", x, _HALF), _device_why(x),
                 None if x.dim() in (2, 3) else f"x has {x.dim()} dims, seam takes 2 or 3",
                 None if x.shape[0] > 0 else "no rows",
                 None if D <= 1024 and D % 2 == 0 else "last dim > 1024 or odd",
                 None if 0 < r <= D else "rope width outside the last dim",
                 None if cos.dtype == sin.dtype and cos.dtype in (torch.float32,) + _HALF
                 else "cos / sin dtypes differ or are not float")
    if why:
        return _fallback("rope", why, x, cos, sin)
    T = x.shape[0]
    out = x.clone(memory_format=torch.contiguous_format)
    c = cos.repeat_interleave(2, dim=-1).reshape(T, 1, 1, r).contiguous()
    s = sin.repeat_interleave(2, dim=-1).reshape(T, 1, 1, r).contiguous()
    torch.ops.custom.inplace_partial_rotary_mul(out.view(T, -1, 1, D), c, s, rotary_mode="interleave",
                                                partial_slice=[D - r, D])
    return out


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Grouped ``wo_a`` via ``torch_npu.npu_transpose_batchmatmul``.

    Schema [OPP op_plugin_functions.yaml]: ``npu_transpose_batchmatmul(Tensor input, Tensor weight,
    *, Tensor? bias=None, Tensor? scale=None, int[]? perm_x1=None, int[]? perm_x2=None, int[]?
    perm_y=None, int? batch_split_factor=1) -> Tensor``.

    Contract [OPP torch_npu-npu_transpose_batchmatmul.md]: input ``(M, B, K)`` with
    ``perm_x1=[1, 0, 2]``, weight ``(B, K, N)`` (non-contiguous allowed; ``perm_x2`` only
    ``[0, 1, 2]``), ``perm_y=[1, 0, 2]`` gives ``(M, B, N)``. fp16/bf16/fp32. K and N divisible by
    16, ``K * B < 65536``, and N and B below 65536. The recipe calls it the same way
    (``perm_x1=(1, 0, 2), perm_y=(1, 0, 2)``, weight ``[G, K, N]``). Here M = T and B = G, and the
    seam's ``[G*N, K]`` weight is passed as the transposed view ``[G, K, N]``. No FP8 (§5 row 10).

    Falls back to the reference for: x not bf16/fp16, not on an NPU, no rows, or K/N/G outside
    the limits above.
    """
    T, G, K = x.shape
    N = weight.shape[0] // G if G else 0
    why = _first(_dtype_why("x", x, _HALF), _device_why(x),
                 None if T > 0 else "no rows",
                 None if G * N == weight.shape[0] and weight.shape[-1] == K else "weight is not [G*N, K]",
                 None if K % 16 == 0 and N % 16 == 0 else "K or N not a multiple of 16",
                 None if K * G < 65536 and N < 65536 and G < 65536 else "K*G, N or G >= 65536")
    if why:
        return _fallback("grouped_linear", why, x, weight)
    w = weight.to(x.dtype).reshape(G, N, K).transpose(1, 2)            # [G, K, N], a view
    return _torch_npu().npu_transpose_batchmatmul(x, w, perm_x1=[1, 0, 2], perm_x2=[0, 1, 2],
                                                  perm_y=[1, 0, 2])


_HC_DIMS = (4096, 7168)        # doc: d = 4096; the repository's example tests also run d = 7168


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix via ``torch.ops.custom.npu_hc_pre``.

    Schema [CRI ops_def_registration.cpp]: ``npu_hc_pre(Tensor x, Tensor hc_fn, Tensor hc_scale,
    Tensor hc_base, *, int hc_mult=4, int hc_sinkhorn_iters=20, float norm_eps=1e-6, float
    hc_eps=1e-6) -> (y, post, comb_frag)``.

    Contract [CRI custom-npu_hc_pre.md, src/hc_pre/op_host/hc_pre_def.cpp, examples/test_npu_hc_pre.py]:
    x ``[T, hc_mult, d]`` bf16 only, contiguous; hc_fn ``[24, 4*d]`` fp32; hc_scale ``[3]`` fp32;
    hc_base ``[24]`` fp32; ``hc_mult`` 4, ``hc_sinkhorn_iters`` 20, d 4096 (the doc; the examples
    also test 7168). Output: y ``[T, d]`` bf16, post ``[T, 4]`` fp32, comb ``[T, 4, 4]`` fp32. The
    example golden (softmax over the last axis, then column/row Sinkhorn) gives the same
    orientation as the reference. The kernel's fn matmul runs in HF32 (per that golden).

    Falls back to the reference for: X not bf16, not on an NPU, no rows, n != 4, H not in
    (4096, 7168), ``sinkhorn_iters != 20``, or fn/scale/base of another shape.
    """
    T, n, H = X.shape
    why = _first(_dtype_why("X", X, _BF16), _device_why(X),
                 None if T > 0 else "no rows",
                 None if n == 4 else f"hc_mult {n}, kernel takes 4",
                 None if H in _HC_DIMS else f"hidden {H} not in {_HC_DIMS}",
                 None if sinkhorn_iters == 20 else f"sinkhorn_iters {sinkhorn_iters}, kernel takes 20",
                 None if tuple(fn.shape) == ((2 + n) * n, n * H) and scale.numel() == 3
                 and base.numel() == (2 + n) * n else "fn / scale / base shapes")
    if why:
        return _fallback("hc_pre", why, X, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters)
    y, post, comb = torch.ops.custom.npu_hc_pre(
        X.contiguous(), fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous(),
        hc_mult=n, hc_sinkhorn_iters=sinkhorn_iters, norm_eps=float(norm_eps), hc_eps=float(hc_eps))
    return y, post, comb


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post-mix via ``torch.ops.custom.npu_hc_post``.

    Schema [CRI ops_def_registration.cpp]: ``npu_hc_post(Tensor x, Tensor residual, Tensor post,
    Tensor comb) -> Tensor``. It computes ``out[k] = post[k] * x + sum_j comb[j, k] * residual[j]``
    (the CPU golden in examples/test_npu_hc_post.py sums over j), the same as the reference.

    Contract [CRI custom-npu_hc_post.md, src/hc_post/op_host/hc_post_def.cpp]: x ``[T, d]``,
    residual ``[T, hc, d]`` and the output share one dtype (fp16/bf16/fp32); post ``[T, hc]`` and
    comb ``[T, hc, hc]`` share one dtype, which may differ from x's (the def lists every pairing,
    e.g. bf16 x with fp32 post/comb). All contiguous; hc 4; d 4096 (the doc; the examples also test
    7168).

    Falls back to the reference for: f/X not bf16/fp16 (fp32 stays on the reference), not on an
    NPU, f and X dtypes differ, post and comb dtypes differ, no rows, n != 4, or H not in
    (4096, 7168).
    """
    T, n, H = X.shape
    why = _first(_dtype_why("X", X, _HALF), _device_why(X),
                 None if f.dtype == X.dtype else "f and X dtypes differ",
                 None if post.dtype == comb.dtype and post.dtype in (torch.float32,) + _HALF
                 else "post / comb dtypes differ or are not float",
                 None if T > 0 else "no rows",
                 None if n == 4 else f"hc_mult {n}, kernel takes 4",
                 None if H in _HC_DIMS else f"hidden {H} not in {_HC_DIMS}")
    if why:
        return _fallback("hc_post", why, f, X, post, comb)
    return torch.ops.custom.npu_hc_post(f.contiguous(), X.contiguous(), post.contiguous(), comb.contiguous())


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
    why = _first(_dtype_why("q", q, _HALF), _device_why(q),
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
        why = _first(None if win_pos0 <= max(0, p_first - window + 1) and win_pos0 + win_kv.shape[0] >= S2
                     else "window keys do not cover every query's window",
                     None if ckv is None or ckv.shape[0] >= S2 // cmp_ratio
                     else "fewer compressed entries than closed windows")
    if why:
        return _fallback("sparse_attn", why, q, positions, win_kv, win_pos0, window, cmp_kv, cmp_ratio,
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


def gating_topk(logits: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, k: int,
                routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router via ``torch.ops.custom.npu_moe_gating_top_k`` with ``norm_type=2`` (sqrt-softplus).

    Schema [CRI ops_def_registration.cpp]: ``npu_moe_gating_top_k(Tensor x, int k, *, Tensor?
    bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, int k_group=1, int group_count=1, float
    routed_scaling_factor=1., float eps=1e-20, int group_select_mode=0, int renorm=0, int norm_type=0,
    bool out_flag=False) -> (y, expert_idx, norm_out)``.

    Contract [CRI custom-npu_moe_gating_top_k.md, examples/test_npu_moe_gating_top_k.py, call site
    op_impls/gate_topk.py]: x ``[T, E]`` fp16/bf16/fp32; bias ``[E]`` in x's dtype selects only; k at
    most 64 and at most E; ``renorm`` 0; ``norm_type`` 2 = ``sqrt(softplus(x))`` in the golden;
    ``y = s[idx] / (sum + eps) * routed_scaling_factor``; expert_idx int32. Hash mode needs both
    ``input_ids`` (int64 ``[T]``) and ``tid2eid`` (int32 ``[n, k]``) and selects ``tid2eid[input_ids]``.
    The seam already holds the looked-up ``hash_ids [T, k]``, so it passes ``input_ids = arange(T)``
    and ``tid2eid = hash_ids``. Top-k ids come back in kernel order; the wrapper sorts them
    ascending (the seam's contract) and reorders the weights with them. Tie order and the fp32
    softplus rounding are the kernel's (§5 rows 1, 13).

    Logits are fp32 in every model dtype, so fp32 runs the kernel. Falls back to the reference
    for: logits not on an NPU or not 2-D, a non-float dtype, ``k > 64`` or ``k > E``, no bias on a
    non-hash layer, or ``hash_ids`` not ``[T, k]``.
    """
    T, E = logits.shape if logits.dim() == 2 else (0, 0)
    why = _first(_dtype_why("logits", logits, (torch.float32,) + _HALF), _device_why(logits),
                 None if logits.dim() == 2 and T > 0 else "logits not a non-empty [T, E]",
                 None if 0 < k <= min(64, E) else f"k {k} outside 1..min(64, E)",
                 None if hash_ids is not None or bias is not None else "no bias on a top-k layer",
                 None if hash_ids is None or tuple(hash_ids.shape) == (T, k) else "hash_ids not [T, k]")
    if why:
        return _fallback("gating_topk", why, logits, bias, hash_ids, k, routed_scaling)
    common = dict(k_group=1, group_count=1, group_select_mode=1, renorm=0, norm_type=2, out_flag=False,
                  routed_scaling_factor=float(routed_scaling), eps=1e-20)
    if hash_ids is not None:
        y, idx, _ = torch.ops.custom.npu_moe_gating_top_k(
            logits, k, input_ids=torch.arange(T, dtype=torch.int64, device=logits.device),
            tid2eid=hash_ids.to(torch.int32).contiguous(), **common)
        return y.float(), idx.long()
    y, idx, _ = torch.ops.custom.npu_moe_gating_top_k(logits, k, bias=bias.to(logits.dtype), **common)
    ids, order = idx.long().sort(dim=-1)
    return y.gather(1, order).float(), ids


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU via ``torch_npu.npu_clipped_swiglu`` on ``cat([gate, up], -1)``.

    Schema [OPP op_plugin_functions.yaml]: ``npu_clipped_swiglu(Tensor x, *, Tensor?
    group_index=None, int dim=-1, float alpha=1.702, float limit=7.0, float bias=1.0, bool
    interleaved=True) -> Tensor``. It computes ``A = A.clamp(max=limit)``,
    ``B = B.clamp(-limit, limit)``, ``y = A * sigmoid(alpha * A) * (B + bias)``. With
    ``interleaved=False`` (front/back halves), ``alpha=1`` and ``bias=0`` this is
    ``silu(min(gate, limit)) * clamp(up, -limit, limit)``, the reference formula.

    Contract [OPP torch_npu-npu_clipped_swiglu.md]: x fp16/bf16/fp32, contiguous, more than 1 dim,
    the split dim even (it is, after the cat); output in x's dtype.

    Falls back to the reference for: gate not bf16/fp16, not on an NPU, gate and up of different
    shape or dtype, or 1-D inputs.
    """
    why = _first(_dtype_why("gate", gate, _HALF), _device_why(gate),
                 None if gate.shape == up.shape and gate.dtype == up.dtype else "gate / up shape or dtype differ",
                 None if gate.dim() >= 2 else "1-D input, kernel takes more than 1 dim")
    if why:
        return _fallback("swiglu_clamp", why, gate, up, limit)
    return _torch_npu().npu_clipped_swiglu(torch.cat([gate, up], dim=-1), dim=-1, alpha=1.0, limit=float(limit),
                                           bias=0.0, interleaved=False)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, limit: float, act: str | None = None) -> torch.Tensor:
    """Routed experts via ``npu_moe_init_routing_v2``, then ``npu_grouped_matmul`` (W1, W3), the
    clamped SwiGLU, ``npu_grouped_matmul`` (W2) and ``npu_moe_finalize_routing``.

    Schemas [OPP op_plugin_functions.yaml]:

    * ``npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, scale, offset, int active_num=-1,
      int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, int expert_tokens_num_type=0,
      bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] active_expert_range=[], int
      row_idx_type=0) -> (expanded_x, expanded_row_idx, expert_tokens, expanded_scale)``
    * ``npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, ..., Tensor? group_list, int? split_item=0,
      int? group_type, int? group_list_type=0, ...) -> Tensor[]``
    * ``npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2,
      Tensor? bias, Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row,
      int? drop_pad_mode=0) -> Tensor``. The 7th name differs between the yaml
      (``export_for_source_row``) and the doc (``expert_for_source_row``), so it is passed
      positionally.

    Contract [OPP docs of the three ops; recipe call sites ``moe_infer_double_routing`` and
    module/fuse_moe_gmm.py]: dropless routing (``drop_pad_mode=0``, ``quant_mode=-1``), count
    histogram (``expert_tokens_num_type=1``) and gather-type ``expanded_row_idx``
    (``row_idx_type=0``), used with ``finalize drop_pad_mode=2`` (row-major source rows), as the
    recipe does. expert_idx is int32. ``expert_num`` is at most 10240. The GMM is unquantised, has a
    single x/weight/y (``split_item=3``), groups by m (``group_type=0``) and takes counts
    (``group_list_type=1``, so E >= 2). Its weight is ``[E, K, N]``; the seam's ``[E, N, K]`` is passed
    as its documented transposed view. The inner axis must stay below 65536. ``scales`` are cast to
    the rows' dtype. The clamped SwiGLU in between is this module's ``swiglu_clamp`` (the fused
    kernel) when ``npu_clipped_swiglu`` exists, else the reference's. Weighting and summation run in the activation dtype
    inside finalize, as in the recipe; the reference accumulates in fp32.

    Falls back to the reference for: x not bf16/fp16, not on an NPU, no tokens, E < 2 or
    E > 10240, expert weights not in x's dtype, H/I >= 65536, or quantised activations (``act``).
    """
    T, H = x.shape
    E, inter = w1.shape[0], w1.shape[1]
    why = _first(_dtype_why("x", x, _HALF), _device_why(x),
                 None if T > 0 and ids.numel() > 0 else "no tokens",
                 None if 2 <= E <= 10240 else f"{E} experts, kernels take 2..10240",
                 None if w1.dtype == w3.dtype == w2.dtype == x.dtype else "expert weights not in x's dtype",
                 None if H < 65536 and inter < 65536 else "H or I >= 65536",
                 None if act is None else f"{act} activations (the quantised GMM is not mapped)")
    if why:
        return _fallback("moe_experts", why, x, ids, weights, w1, w3, w2, limit, act)
    npu = _torch_npu()
    k = ids.shape[1]
    expanded_x, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, ids.to(torch.int32), active_num=T * k, expert_num=E, drop_pad_mode=0, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, E], row_idx_type=0)

    def gmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return npu.npu_grouped_matmul([a], [w.transpose(1, 2)], group_list=counts, split_item=3, group_type=0,
                                      group_list_type=1)[0]

    act = swiglu_clamp if _api_available("torch_npu.npu_clipped_swiglu", npu) else reference.swiglu_clamp
    h = act(gmm(expanded_x, w1), gmm(expanded_x, w3), limit)
    y = gmm(h, w2)                                                       # [T*k, H], expert-sorted rows
    return npu.npu_moe_finalize_routing(y, None, None, None, weights.to(y.dtype), row_idx, None,
                                        drop_pad_mode=2)


def quant_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str, act: str | None
                 ) -> torch.Tensor:
    """W8A8 int8 linear: ``npu_dynamic_quant`` (per-token int8, smooth scales 1) then
    ``npu_quant_matmul`` with the per-channel weight scale and the per-token scale.

    Schemas [OPP op_plugin_functions.yaml]: ``npu_dynamic_quant(Tensor input, *, Tensor?
    smooth_scales=None, ...) -> (Tensor, Tensor)``; ``npu_quant_matmul(Tensor x1, Tensor x2, Tensor
    scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, Tensor? bias=None, int?
    output_dtype=None, ...)``. Contract [OPP torch_npu-npu_quant_matmul.md, table 2, A2/A3]: int8
    x1 ``[m, k]`` and x2 ``[k, n]``, scale ``[n]`` float32 / bfloat16, pertoken_scale ``[m]`` float32,
    output bfloat16 (float16 with a float32 scale). x2 is the stored ``[n, k]`` weight's transposed
    view, as upstream's W8A8 linear passes it (recipe ``compressed_tensors_w8a8_int8.py``).

    Falls back to the reference for: MXFP8 / HiF8 weights (the 950 kernels take MX scales / HiF8
    dtypes this wrapper does not set up), x not bf16/fp16, not on an NPU, no rows, or a weight dim
    of 65536 or more (the doc caps x1 / x2's last dims at 65535; upstream transposes wq_b there).
    """
    lead = x.shape[:-1]
    why = _first(None if fmt == "int8" and act == "int8-token" else f"{fmt} weights with {act} activations",
                 _dtype_why("x", x, _HALF), _device_why(x), None if x.numel() else "no rows",
                 None if max(weight.shape) < 65536 else "a weight dim >= 65536 (the kernel takes <= 65535)")
    if why:
        return _fallback("quant_linear", why, x, weight, scale, fmt, act)
    npu = _torch_npu()
    xq, xs = npu.npu_dynamic_quant(x.reshape(-1, x.shape[-1]))
    s = scale.reshape(-1).to(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
    y = npu.npu_quant_matmul(xq, weight.t(), s, pertoken_scale=xs.reshape(-1).float(), output_dtype=x.dtype)
    return y.view(*lead, weight.shape[0])


# ---- the table ---------------------------------------------------------------------------------
KERNELS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "rope": rope,
    "grouped_linear": grouped_linear,
    "hc_pre": hc_pre,
    "hc_post": hc_post,
    "sparse_attn": sparse_attn,
    "gating_topk": gating_topk,
    "swiglu_clamp": swiglu_clamp,
    "moe_experts": moe_experts,
    "quant_linear": quant_linear,
}

# The runtime kernels each wrapper needs: "torch_npu.<name>" or "custom.<name>" (torch.ops.custom).
KERNEL_APIS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("torch_npu.npu_rms_norm",),
    "rope": ("custom.inplace_partial_rotary_mul",),
    "grouped_linear": ("torch_npu.npu_transpose_batchmatmul",),
    "hc_pre": ("custom.npu_hc_pre",),
    "hc_post": ("custom.npu_hc_post",),
    "sparse_attn": ("custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"),
    "gating_topk": ("custom.npu_moe_gating_top_k",),
    "swiglu_clamp": ("torch_npu.npu_clipped_swiglu",),
    "moe_experts": ("torch_npu.npu_moe_init_routing_v2", "torch_npu.npu_grouped_matmul",
                    "torch_npu.npu_moe_finalize_routing"),
    "quant_linear": ("torch_npu.npu_dynamic_quant", "torch_npu.npu_quant_matmul"),
}

NOT_MAPPED: dict[str, str] = {
    "linear": "plain GEMM: the reference's F.linear already runs as the NPU matmul on NPU tensors; "
              "quantised GEMMs go through quant_linear",
    "lm_head": "the vocab projection is a plain GEMM: on device tensors the reference runs it as the "
               "NPU matmul (its streamed 8-row blocks are the CPU path only)",
    "act_quant": "emulates activation quantisation in front of the linears a converted checkpoint keeps "
                 "dense (routed experts, wo_a, compressors); on devices it belongs inside the quantised "
                 "GMM / batched matmul, which need packed weights those paths do not carry yet",
    "hc_head": "no fused op for the final mHC collapse in §8.1",
    "compressor": "custom.compressor keeps its fp32 kv/score state in a paged, position-indexed "
                  "state_cache (state_block_table, cache_mode=1) and takes bf16/fp16 x and half-width "
                  "rope tables per output row; the seam's CompressorState is an m-slot ring plus the "
                  "previous window, and which state rows the kernel reads and writes around start_pos "
                  "(and its window-0 overlap handling, §5 row 11) is not documented, so the state "
                  "cannot be translated both ways with confidence",
    "indexer_topk": "the DSV4 compressed-causal indexer (cmp_ratio) exists only as the quantised "
                    "custom.npu_quant_lightning_indexer (int8 q/k per-token-head + fp16 scales, Hadamard "
                    "pre-rotation in the recipe); the seam takes unquantised q/keys, and the unquantised "
                    "npu_lightning_indexer (DeepSeek-V3.2) has no cmp_ratio and differs between builds "
                    "(selected_count vs sparse_count): signature unconfirmed for this contract",
}


# ---- building the table ------------------------------------------------------------------------
def _import_torch_npu():
    try:
        return importlib.import_module("torch_npu")
    except Exception as e:            # ImportError; OSError / RuntimeError when the CANN libs are missing
        raise NpuUnavailableError(
            f"engine.ops.npu: torch_npu is required for --device npu but it failed to import "
            f"({type(e).__name__}: {e}); install dsv4-pd[npu] with the CANN toolkit") from e


def _load_custom_ops() -> bool:
    """Import cann-recipes-infer's ``custom_ops`` (registers ``torch.ops.custom.*``). False if absent."""
    try:
        importlib.import_module("custom_ops")
        return True
    except Exception as e:            # any failure means: no custom kernels from it
        key = ("custom_ops", "\0import")
        if key not in _LOGGED:
            _LOGGED.add(key)
            log.warning("custom op library custom_ops (cann-recipes-infer ops/ascendc) not importable "
                        "(%s: %s); torch.ops.custom kernels are used only if registered otherwise",
                        type(e).__name__, e)
        return False


def _api_available(api: str, torch_npu) -> bool:
    if api not in _AVAILABLE:
        ns, _, name = api.partition(".")
        if ns == "torch_npu":
            ok = hasattr(torch_npu, name)
        else:
            try:                      # the namespace lookup raises when the op is not registered
                getattr(getattr(torch.ops, ns), name)
                ok = True
            except (AttributeError, RuntimeError):
                ok = False
        _AVAILABLE[api] = ok
    return _AVAILABLE[api]


def npu_ops(base: Ops = REFERENCE, kernel_config: dict[str, str] | None = None) -> Ops:
    """``base`` with every mapped op whose kernels exist at runtime replaced by its NPU wrapper.

    ``kernel_config`` is ``model_config.custom_params.kernel_config`` ``{op: "native" | "npu"}``.
    "native" keeps that op on ``base``; "npu" (or no entry) uses the kernel where one exists. Each
    op left on ``base`` is logged once: "op X: no NPU kernel (reason); using the reference op".

    Raises:
        ValueError: bad ``kernel_config`` (checked before torch_npu is imported).
        NpuUnavailableError (an ImportError): torch_npu cannot be imported.
    """
    cfg = validate_kernel_config(kernel_config)
    torch_npu = _import_torch_npu()
    _load_custom_ops()
    overrides: dict[str, Callable] = {}
    for name in (f.name for f in fields(Ops)):
        if name in NOT_MAPPED:
            log_reference_op(name, NOT_MAPPED[name])
        elif cfg.get(name) == "native":
            log_reference_op(name, f"{KERNEL_CONFIG_KEY}.{name} is native")
        else:
            missing = [a for a in KERNEL_APIS[name] if not _api_available(a, torch_npu)]
            if missing:
                log_reference_op(name, f"{', '.join(missing)} not in this runtime")
            else:
                overrides[name] = KERNELS[name]
    return base.with_overrides(**overrides)


__all__ = ["KERNELS", "KERNEL_APIS", "NOT_MAPPED", "NpuUnavailableError", "npu_ops", "log_fallback",
           "log_reference_op"]
