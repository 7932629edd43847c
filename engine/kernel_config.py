"""The run config's ``kernel_config`` mapping, checked without importing torch.

The op names are the fields of ``engine.ops.Ops`` (that module refuses to import if they differ),
spelled out here so the gateway and ``dsv4-plan`` validate a run config without the ops.
"""
from __future__ import annotations

from collections.abc import Mapping

OP_NAMES: tuple[str, ...] = (
    "rms_norm", "rope", "linear", "lm_head", "act_quant", "quant_linear", "grouped_linear", "hc_pre", "hc_post",
    "hc_head", "compressor", "indexer_topk", "sparse_attn", "gating_topk", "swiglu_clamp", "moe_experts",
    "cache_write", "cache_indexer_topk", "cache_sparse_attn", "decode_indexer_topk", "decode_sparse_attn",
)
KERNEL_CONFIG_KEY = "model_config.custom_params.kernel_config"
IMPLS = ("native", "npu", "ascendc")   # "ascendc": upstream's name for the kernel impl (= "npu")


def validate_kernel_config(kernel_config: Mapping[str, str] | None) -> dict[str, str]:
    """Check the YAML ``model_config.custom_params.kernel_config`` mapping ``{op_name: impl}``.

    ``op_name`` is a field of ``Ops``; ``impl`` is "native" (force the reference op) or "npu" /
    "ascendc" (upstream's spelling; use the platform kernel where one exists, the default). Returns a plain dict copy ({} for None).

    Raises:
        ValueError: not a mapping, an unknown op name (the message names the key and lists the
            known ops) or an impl other than "native" / "npu" / "ascendc" (the message names the key).
    """
    if kernel_config is None:
        return {}
    if not isinstance(kernel_config, Mapping):
        raise ValueError(f"{KERNEL_CONFIG_KEY}: must be a mapping of op name to impl, "
                         f"got {type(kernel_config).__name__}")
    for op, impl in kernel_config.items():
        if op not in OP_NAMES:
            raise ValueError(f"{KERNEL_CONFIG_KEY}.{op}: unknown op {op!r}; known ops: {', '.join(OP_NAMES)}")
        if impl not in IMPLS:
            raise ValueError(f"{KERNEL_CONFIG_KEY}.{op}: impl {impl!r} is not one of "
                             f"{', '.join(repr(i) for i in IMPLS)}")
    return dict(kernel_config)
