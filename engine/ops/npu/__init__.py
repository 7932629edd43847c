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
from typing import TYPE_CHECKING, Callable

from engine.kernel_config import KERNEL_CONFIG_KEY, OP_NAMES, validate_kernel_config
from engine.ops.npu.attention import sparse_attn
from engine.ops.npu.cache_quant import cache_indexer_topk, cache_write
from engine.ops.npu.decode import decode_indexer_topk, decode_sparse_attn
from engine.ops.npu.dense import grouped_linear, quant_linear, rms_norm, rope
from engine.ops.npu import runtime
from engine.ops.npu.runtime import api_available, load_custom_ops, log_fallback, log_reference_op
from engine.ops.npu.mhc import hc_post, hc_pre
from engine.ops.npu.moe import gating_topk, moe_experts, swiglu_clamp

if TYPE_CHECKING:
    from engine.ops.table import Ops

log = logging.getLogger("engine.ops.npu")


class NpuUnavailableError(ImportError):
    """``--device npu`` was asked for but torch_npu cannot be imported."""


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
    "cache_write": cache_write,
    "cache_indexer_topk": cache_indexer_topk,
    "decode_indexer_topk": decode_indexer_topk,
    "decode_sparse_attn": decode_sparse_attn,
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
                    "torch_npu.npu_moe_finalize_routing", "torch_npu.npu_dynamic_quant"),
    "quant_linear": ("torch_npu.npu_dynamic_quant", "torch_npu.npu_quant_matmul"),
    # any one of the epilogues serves its pool kind; the wrapper needs all three to be mapped
    "cache_write": ("custom.kv_compress_epilog", "custom.indexer_compress_epilog", "custom.scatter_nd_update_asc",
                    "torch_npu.npu_dynamic_quant"),
    "cache_indexer_topk": ("custom.npu_quant_lightning_indexer", "custom.npu_quant_lightning_indexer_metadata",
                           "torch_npu.npu_dynamic_quant"),
    "decode_indexer_topk": ("custom.npu_quant_lightning_indexer", "custom.npu_quant_lightning_indexer_metadata",
                            "torch_npu.npu_dynamic_quant"),
    "decode_sparse_attn": ("custom.npu_sparse_attn_sharedkv", "custom.npu_sparse_attn_sharedkv_metadata"),
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
    "cache_sparse_attn": "FP8 KV: custom.npu_kv_quant_sparse_attn_sharedkv has a schema in [CRI] "
                         "ops_def_registration.cpp (kv_quant_mode, tile_size, rope_head_dim) but no "
                         "custom-*.md contract; the recipe fills its cache with "
                         "cann_ops_transformer.kv_compress_epilog(quant_mode='fp8_bf16') and describes the "
                         "row as nope fp8 | rope bf16 | 2-byte scales per 64, while the pools hold "
                         "custom.kv_compress_epilog's rope | nope | 1-byte e8m0 row: which row it reads is "
                         "unconfirmed. HiF8: cann_ops_transformer.quant_sparse_flash_mla is not documented in "
                         "[CRI]. Unquantised pools go through sparse_attn",
}


# ---- building the table ------------------------------------------------------------------------
def _import_torch_npu():
    try:
        return importlib.import_module("torch_npu")
    except Exception as e:            # ImportError; OSError / RuntimeError when the CANN libs are missing
        raise NpuUnavailableError(
            f"engine.ops.npu: torch_npu is required for --device npu but it failed to import "
            f"({type(e).__name__}: {e}); install dsv4-pd[npu] with the CANN toolkit") from e


def npu_ops(base: Ops, kernel_config: dict[str, str] | None = None) -> Ops:
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
    runtime.TORCH_NPU = torch_npu
    load_custom_ops()
    overrides: dict[str, Callable] = {}
    for name in OP_NAMES:
        if name in NOT_MAPPED:
            log_reference_op(name, NOT_MAPPED[name])
        elif cfg.get(name) == "native":
            log_reference_op(name, f"{KERNEL_CONFIG_KEY}.{name} is native")
        else:
            missing = [a for a in KERNEL_APIS[name] if not api_available(a, torch_npu)]
            if missing:
                log_reference_op(name, f"{', '.join(missing)} not in this runtime")
            else:
                overrides[name] = KERNELS[name]
    return base.with_overrides(**overrides)


__all__ = ["KERNELS", "KERNEL_APIS", "NOT_MAPPED", "NpuUnavailableError", "npu_ops", "log_fallback",
           "log_reference_op"]
