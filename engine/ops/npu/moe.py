"""MoE wrappers: gating top-k, the clamped SwiGLU and the routed experts (see ``engine.ops.npu``)."""
from __future__ import annotations

import torch

from engine.ops import reference
from engine.ops.packed import Packed
from engine.ops.npu.runtime import HALF, api_available, device_why, dtype_why, fallback, first_reason, torch_npu_module


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
    why = first_reason(dtype_why("logits", logits, (torch.float32,) + HALF), device_why(logits),
                 None if logits.dim() == 2 and T > 0 else "logits not a non-empty [T, E]",
                 None if 0 < k <= min(64, E) else f"k {k} outside 1..min(64, E)",
                 None if hash_ids is not None or bias is not None else "no bias on a top-k layer",
                 None if hash_ids is None or tuple(hash_ids.shape) == (T, k) else "hash_ids not [T, k]")
    if why:
        return fallback("gating_topk", why, logits, bias, hash_ids, k, routed_scaling)
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
    why = first_reason(dtype_why("gate", gate, HALF), device_why(gate),
                 None if gate.shape == up.shape and gate.dtype == up.dtype else "gate / up shape or dtype differ",
                 None if gate.dim() >= 2 else "1-D input, kernel takes more than 1 dim")
    if why:
        return fallback("swiglu_clamp", why, gate, up, limit)
    return torch_npu_module().npu_clipped_swiglu(torch.cat([gate, up], dim=-1), dim=-1, alpha=1.0, limit=float(limit),
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

    W8A8 experts as stored (``Packed`` int8 with ``act`` "int8-token", the A3 layout of a
    ``w8a8-int`` checkpoint): each GMM's input is quantised per token by ``npu_dynamic_quant``
    (the routed rows are copies of token rows, so this equals quantising x first) and the GMM runs
    int8 x int8 with the per-channel ``scale`` and ``per_token_scale`` fp32, output in the rows'
    dtype: the doc's "pertoken full quantisation" rows [OPP torch_npu-npu_grouped_matmul.md, A2/A3
    table: x / weight int8, per_token_scale float32; scale bfloat16 for bfloat16 output, float32
    for float16 output], as upstream's W8A8 MoE does.

    Falls back to the reference (one expert dequantised at a time, memory as stored) for: other
    packed formats (int4 / MXFP4 / FP4: their GMM layouts are not mapped), x not bf16/fp16, not
    on an NPU, no tokens, E < 2 or E > 10240, dense experts not in x's dtype, H/I >= 65536, or
    quantised activations over dense experts.
    """
    T, H = x.shape
    E = w1.shape[0]
    packed = isinstance(w1, Packed)
    why = moe_experts_why(x, ids, w1, w3, w2, act)
    if why:
        return fallback("moe_experts", why, x, ids, weights, w1, w3, w2, limit, act)
    npu = torch_npu_module()
    k = ids.shape[1]
    expanded_x, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x, ids.to(torch.int32), active_num=T * k, expert_num=E, drop_pad_mode=0, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, E], row_idx_type=0)

    def gmm(a: torch.Tensor, w) -> torch.Tensor:
        if not packed:
            return npu.npu_grouped_matmul([a], [w.transpose(1, 2)], group_list=counts, split_item=3, group_type=0,
                                          group_list_type=1)[0]
        aq, a_scale = npu.npu_dynamic_quant(a)                      # per-token int8 (act "int8-token")
        scale_dtype = torch.bfloat16 if a.dtype == torch.bfloat16 else torch.float32     # doc: bf16 out / fp16 out
        return npu.npu_grouped_matmul([aq], [w.data.transpose(1, 2)], scale=[w.scale.reshape(E, -1).to(scale_dtype)],
                                      per_token_scale=[a_scale.reshape(-1).float()], group_list=counts,
                                      split_item=3, group_type=0, group_list_type=1, output_dtype=a.dtype)[0]

    swiglu = swiglu_clamp if api_available("torch_npu.npu_clipped_swiglu", npu) else reference.swiglu_clamp
    h = swiglu(gmm(expanded_x, w1), gmm(expanded_x, w3), limit)
    y = gmm(h, w2)                                                       # [T*k, H], expert-sorted rows
    return npu.npu_moe_finalize_routing(y, None, None, None, weights.to(y.dtype), row_idx, None,
                                        drop_pad_mode=2)


def moe_experts_why(x: torch.Tensor, ids: torch.Tensor, w1, w3, w2, act: str | None) -> str | None:
    """Why ``moe_experts`` would fall back to the reference for these inputs (None: the kernels
    run them, with no host sync). Shapes and dtypes only, so a graph step can choose its path
    before calling (``StaticDecoder``: ``moe_experts.why``)."""
    T, H = x.shape
    E, inter = w1.shape[0], w1.shape[1]             # logical shape, dense or Packed
    packed = isinstance(w1, Packed)
    return first_reason(dtype_why("x", x, HALF), device_why(x),
                        None if T > 0 and ids.numel() > 0 else "no tokens",
                        None if 2 <= E <= 10240 else f"{E} experts, kernels take 2..10240",
                        _w8a8_why(w1, act) if packed else
                        (None if w1.dtype == w3.dtype == w2.dtype == x.dtype else "expert weights not in x's dtype"),
                        None if H < 65536 and inter < 65536 else "H or I >= 65536",
                        None if act is None or packed else f"{act} activations over dense experts")


moe_experts.why = moe_experts_why


def _w8a8_why(w1, act: str | None) -> str | None:
    """None when packed experts are the W8A8 int8 layout the A3 GMM takes (int8 ``[E, N, K]``,
    fp32 per-channel scale ``[E, N, 1]``, per-token int8 activations), else the reason."""
    if w1.fmt != "int8" or act != "int8-token":
        return f"{w1.fmt} experts with {act} activations (only W8A8 int8 is mapped)"
    return None
