"""CUDA kernels behind the ops seam: torch's own FP8 block-scaled GEMM for the original checkpoint's
FP8 linears (every other op is the reference, which runs on CUDA as it is).

``quant_linear`` on an FP8 128x128 block-scaled weight (reference/dsv4-architecture.md §2.1) runs
``torch.nn.functional.scaled_mm`` with the stored ``float8_e4m3fn`` weight and its e8m0 block
scales as ``BlockWise128x128`` and the activations quantised per (1 token x 128 channels) to e4m3
as ``BlockWise1x128``: the scheme of DeepSeek's own inference kernels (``act_quant`` +
``fp8_gemm``, scales rounded to powers of two, ue8m0) and of the 950's FP8 path (§7, "Original
Hybrid FP8-MXFP4 on 950"). Its numerics are the kernel's: activations are quantised, which the
reference (HF parity) does not do.

Contract [torch ``_check_scaled_mm_sizes_v2``, the meta kernel CPU tests run against]: mat_a
e4m3 ``[M, K]`` row-major, mat_b e4m3 ``[K, N]`` column-major (the stored ``[N, K]`` transposed);
scale_a fp32 ``[M, K/128]`` with strides ``(1, M)``, scale_b fp32 ``[K/128, N/128]`` with strides
``(1, L4)``, L4 = ``round_up(K/128, 4)``. The hardware needs sm90 or newer. cuBLAS (12.9 / 13.0 on
an H200) also needs M a multiple of 4: its heuristic answers ``CUBLAS_STATUS_NOT_SUPPORTED`` for
M = 1, 2 or 263 and runs 4, 8, 16, 128 and 256 (``deploy/device-check``), so rows are padded with
zeros to a multiple of 4 and the output sliced: each row is quantised and multiplied alone, so a
padding row changes no other row.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.checkpoint.fp8_mxfp4 import E4M3_MAX, e8m0_to_float
from engine.ops import reference
from engine.ops.packed import Packed

log = logging.getLogger(__name__)
GROUP = 128
ROW_MULTIPLE = 4            # cuBLAS's blockwise GEMM refuses other row counts (module docstring)
_LOGGED: set[str] = set()


def act_quant_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row x 128 channels) e4m3 quantisation with power-of-two scales.

    Args:
        x: ``[M, K]`` float, K % 128 == 0.
    Returns:
        (``float8_e4m3fn [M, K]``, fp32 scales ``[M, K/128]`` with strides ``(1, M)``:
        column-major, as the blockwise GEMM takes them), ``x ~= q * scale`` per group.
    """
    M, K = x.shape
    g = x.float().view(M, K // GROUP, GROUP)
    amax = g.abs().amax(-1).clamp_min(1e-10)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))            # ue8m0: a power of two
    q = (g / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(M, K)
    col = torch.empty(K // GROUP, M, dtype=torch.float32, device=x.device)
    col.copy_(scale.t())
    return q, col.t()


def fp8_why(x: torch.Tensor, w: Packed, act: str | None) -> str | None:
    """None when ``quant_linear(x, w, act)`` fits the blockwise GEMM, else the reason."""
    K, N = w.shape[-1], w.shape[-2]
    if w.fmt != "fp8" or act is not None:
        return f"{w.fmt} weights with {act} activations (only the original FP8 blocks are mapped)"
    if x.device.type not in ("cuda", "meta"):
        return f"tensors on {x.device.type}"
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (9, 0):
        return "blockwise FP8 GEMM needs sm90 or newer"
    if x.numel() == 0:
        return "no rows"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}, the kernel outputs bf16 / fp16"
    if tuple(w.block) != (GROUP, GROUP) or tuple(w.offset) != (0, 0):
        return f"blocks {w.block} at offset {w.offset} (the kernel takes whole 128x128 blocks)"
    if K % GROUP or (K // GROUP) % 4 or N % GROUP:
        return f"[{N}, {K}] is not whole 128x128 blocks with K/128 a multiple of 4"
    return None


def quant_linear(x: torch.Tensor, weight: Packed, act: str | None) -> torch.Tensor:
    """``reference.quant_linear`` through the FP8 blockwise GEMM where ``fp8_why`` allows, else the
    reference (logged once per reason). x ``[..., K]`` -> ``[..., N]`` in x.dtype."""
    why = fp8_why(x, weight, act)
    if why:
        if why not in _LOGGED:
            _LOGGED.add(why)
            log.info("quant_linear on cuda: reference op (%s)", why)
        return reference.quant_linear(x, weight, act)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M % ROW_MULTIPLE:
        x2 = F.pad(x2, (0, 0, 0, -M % ROW_MULTIPLE))
    xq, xs = act_quant_1x128(x2)
    sb = e8m0_to_float(weight.scale).t()                                   # [K/128, N/128], strides (1, K/128)
    y = F.scaled_mm(xq, weight.data.t(), xs, F.ScalingType.BlockWise1x128, sb, F.ScalingType.BlockWise128x128,
                    output_dtype=x.dtype)
    return y[:M].view(*lead, weight.shape[-2])


def cuda_ops(base):
    """``base`` (the reference table) with the CUDA kernels above."""
    return base.with_overrides(quant_linear=quant_linear)
