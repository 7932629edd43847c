"""The ops seam: every fused operation the model calls, by name (reference/dsv4-architecture.md §8.1).

The model receives an ``Ops`` table at construction and calls only its members, so a platform
kernel (torch_npu custom ops on Ascend, CUDA kernels) replaces one entry without touching the
model. ``REFERENCE`` holds the pure-torch implementations, which are the numerics contract.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.kernel_config import IMPLS, KERNEL_CONFIG_KEY, OP_NAMES, validate_kernel_config
from engine.ops.table import REFERENCE, Ops


def ops_for(kind: str, kernel_config: Mapping[str, str] | None = None, compiled: bool = False) -> Ops:
    """The ops table for a device kind (``engine.platform.Platform.kind``).

    "cpu": ``REFERENCE``, or with ``compiled`` (a graph ``exe_mode``) the inductor kernels of
    ``engine.ops.cpu`` over it; "cuda": ``REFERENCE`` with torch's FP8 block-scaled GEMM as
    ``quant_linear`` (``engine.ops.cuda``); "npu" entries of ``kernel_config`` change nothing there,
    but the mapping is still validated. "npu": the Ascend kernels
    of ``engine.ops.npu`` over ``REFERENCE`` (imported here, on demand: importing ``engine.ops``
    never imports ``engine.ops.npu`` nor torch_npu).

    Raises:
        ValueError: a bad ``kernel_config`` (see ``validate_kernel_config``) or an unknown kind.
        engine.ops.npu.NpuUnavailableError (an ImportError): kind "npu" without a usable torch_npu.
    """
    cfg = validate_kernel_config(kernel_config)
    if kind == "cpu":
        if compiled:
            from engine.ops.cpu import cpu_ops
            return cpu_ops(REFERENCE, cfg)
        return REFERENCE
    if kind == "cuda":
        from engine.ops.cuda import cuda_ops
        return cuda_ops(REFERENCE)
    if kind == "npu":
        from engine.ops.npu import npu_ops
        return npu_ops(REFERENCE, cfg)
    raise ValueError(f"ops_for: unknown device kind {kind!r} (expected cpu, cuda or npu)")


def residual_dtype_for(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The mHC residual streams' dtype on a device kind for a compute dtype.

    bf16 on an NPU computing in bf16: ``npu_hc_pre`` takes bf16 streams only and ``npu_hc_post``
    returns them in its input's dtype, so the fused path keeps them in bf16 between blocks, as
    upstream runs it (§5 row 6) and as HF's bf16 model does. Everywhere else fp32: no kernel asks
    for less, and fp32 streams are what the fp32 reference matches HF with (and what keeps a bf16
    run closest to it). The math inside hc_pre / hc_post / hc_head is fp32 either way.
    """
    return torch.bfloat16 if kind == "npu" and dtype == torch.bfloat16 else torch.float32


__all__ = ["Ops", "REFERENCE", "OP_NAMES", "IMPLS", "KERNEL_CONFIG_KEY", "validate_kernel_config", "ops_for",
           "residual_dtype_for"]
