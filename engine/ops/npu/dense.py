"""Dense-path wrappers: RMSNorm, RoPE, the grouped output projection and the quantised linear (see ``engine.ops.npu``)."""
from __future__ import annotations

import torch

from engine.ops.packed import Packed
from engine.ops.npu.runtime import HALF, device_why, dtype_why, fallback, first_reason, torch_npu_module

_DIM_CAP = 65536          # npu_quant_matmul / npu_transpose_batchmatmul: dims (and K * groups) below it


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
    why = first_reason(dtype_why("x", x, HALF), device_why(x),
                 None if 2 <= x.dim() <= 8 else f"x has {x.dim()} dims, kernel takes 2-8")
    if why:
        return fallback("rms_norm", why, x, weight, eps)
    gamma = (torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if weight is None
             else weight.to(x.dtype))
    return torch_npu_module().npu_rms_norm(x, gamma, epsilon=float(eps))[0]


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
    why = first_reason(dtype_why("x", x, HALF), device_why(x),
                 None if x.dim() in (2, 3) else f"x has {x.dim()} dims, seam takes 2 or 3",
                 None if x.shape[0] > 0 else "no rows",
                 None if D <= 1024 and D % 2 == 0 else "last dim > 1024 or odd",
                 None if 0 < r <= D else "rope width outside the last dim",
                 None if cos.dtype == sin.dtype and cos.dtype in (torch.float32,) + HALF
                 else "cos / sin dtypes differ or are not float")
    if why:
        return fallback("rope", why, x, cos, sin)
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

    Past ``K * G < 65536`` (Pro: 16 groups of K = 4096) the groups go in calls of as many as fit,
    joined along the group axis: the groups are independent, so the result is the same.

    Falls back to the reference for: a ``Packed`` (quantised) weight, x not bf16/fp16, not on an
    NPU, no rows, K or N not multiples of 16, or K / N at 65536 or more.
    """
    T, G, K = x.shape
    N = weight.shape[0] // G if G else 0
    why = first_reason(None if isinstance(weight, torch.Tensor) else f"a {weight.fmt} weight (no quantised kernel)",
                 dtype_why("x", x, HALF), device_why(x),
                 None if T > 0 else "no rows",
                 None if G * N == weight.shape[0] and weight.shape[-1] == K else "weight is not [G*N, K]",
                 None if K % 16 == 0 and N % 16 == 0 else "K or N not a multiple of 16",
                 None if K < 65536 and N < 65536 else "K or N >= 65536")
    if why:
        return fallback("grouped_linear", why, x, weight)
    w = weight.to(x.dtype).reshape(G, N, K).transpose(1, 2)            # [G, K, N], a view
    calls = -(-G // ((_DIM_CAP - 1) // K))                            # at most 65535 // K groups a call
    step = -(-G // calls)                                              # even calls, K * step < 65536
    npu = torch_npu_module()
    outs = [npu.npu_transpose_batchmatmul(x[:, g:g + step], w[g:g + step], perm_x1=[1, 0, 2], perm_x2=[0, 1, 2],
                                          perm_y=[1, 0, 2]) for g in range(0, G, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)



def quant_linear(x: torch.Tensor, weight: Packed, act: str | None) -> torch.Tensor:
    """W8A8 int8 linear: ``npu_dynamic_quant`` (per-token int8, smooth scales 1) then
    ``npu_quant_matmul`` with the per-channel weight scale and the per-token scale.

    Schemas [OPP op_plugin_functions.yaml]: ``npu_dynamic_quant(Tensor input, *, Tensor?
    smooth_scales=None, ...) -> (Tensor, Tensor)``; ``npu_quant_matmul(Tensor x1, Tensor x2, Tensor
    scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, Tensor? bias=None, int?
    output_dtype=None, ...)``. Contract [OPP torch_npu-npu_quant_matmul.md, table 2, A2/A3]: int8
    x1 ``[m, k]`` and x2 ``[k, n]``, scale ``[n]`` float32 / bfloat16, pertoken_scale ``[m]`` float32,
    output bfloat16 (float16 with a float32 scale). x2 is the stored ``[n, k]`` weight's transposed
    view, as upstream's W8A8 linear passes it (recipe ``compressed_tensors_w8a8_int8.py``).

    The doc caps x1 / x2's last dims at 65535: a weight with n >= 65536 output rows (Pro's
    ``wq_b``, 128 x 512) runs in slices of n, each with its scale slice, joined along n (the
    per-token activation quantised once); upstream transposes wq_b there instead.

    Falls back to the reference (which dequantises one tile at a time, so memory stays as stored)
    for: other formats (FP8 block, MXFP8, HiF8: the A5 / 950 kernels take scale layouts this
    wrapper does not set up), x not bf16/fp16, not on an NPU, no rows, or k >= 65536.
    """
    lead = x.shape[:-1]
    w, fmt = weight.data, weight.fmt
    why = first_reason(None if fmt == "int8" and act == "int8-token" else f"{fmt} weights with {act} activations",
                 dtype_why("x", x, HALF), device_why(x), None if x.numel() else "no rows",
                 None if w.shape[1] < _DIM_CAP else "an input dim >= 65536 (the kernel takes <= 65535)")
    if why:
        return fallback("quant_linear", why, x, weight, act)
    npu = torch_npu_module()
    xq, xs = npu.npu_dynamic_quant(x.reshape(-1, x.shape[-1]))
    s = weight.scale.reshape(-1).to(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
    ts = xs.reshape(-1).float()
    step = _DIM_CAP // 2
    ys = [npu.npu_quant_matmul(xq, w[n:n + step].t(), s[n:n + step], pertoken_scale=ts, output_dtype=x.dtype)
          for n in range(0, w.shape[0], step)]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    return y.view(*lead, w.shape[0])
