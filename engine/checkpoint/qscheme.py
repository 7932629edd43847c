"""Quantisation schemes: which linear is stored how, and the compressed-tensors config (§1.3, §7).

A scheme is one of ``QUANT_TYPES`` (upstream ``convert_model.py --quant_type``). For a linear of
the original checkpoint (its name and original kind ``fp8`` / ``fp4`` / ``bf16``),
``linear_format`` gives its converted storage format (``engine.checkpoint.layout``) and ``ACT_SCHEME``
the activation quantisation the kernels apply in front of it.

The config builders write what upstream's ``convert_config.py`` (original weights) and
``convert_model.py`` (converted weights) write; ``parse_compressed_tensors`` reads both back.
"""
from __future__ import annotations

from typing import Any

QUANT_TYPES = ("w8a8-int", "w4a8-int", "w4a8-mx", "w4a8-mx-hif")
CSA, HCA = 4, 128
# activation quantisation in front of a linear stored in each format (None: none, as HF)
ACT_SCHEME = {"int8": "int8-token", "int4": "int8-token", "mxfp8": "mxfp8", "mxfp4": "mxfp8", "hif8": "hif8",
              "bf16": None, "fp8": None, "fp4": None}
_COMPRESSOR = (".attn.compressor.wkv", ".attn.compressor.wgate", ".attn.indexer.weights_proj",
               ".attn.indexer.compressor.wkv", ".attn.indexer.compressor.wgate")
_ATTN_A = (".attn.wq_a", ".attn.wkv", ".attn.wo_a")
_ATTN_B = (".attn.wq_b", ".attn.wo_b", ".attn.indexer.wq_b", ".e_proj", ".h_proj")


def linear_format(quant_type: str | None, name: str, orig_kind: str) -> str:
    """Storage format of linear ``name`` (no ``.weight``) under ``quant_type`` (None: original).

    Upstream ``generate_quant_layers``: routed experts int8 / int4 / MXFP4; shared experts int8 /
    MXFP8; ``wq_b``, ``wo_b``, ``indexer.wq_b``, MTP ``e_proj`` / ``h_proj`` int8 / MXFP8 / HiF8;
    ``wq_a``, ``wkv``, ``wo_a`` bf16 (int types) / MXFP8 / HiF8; compressor and indexer-scorer
    linears HiF8 in ``w4a8-mx-hif`` and bf16 otherwise; router and head always bf16. A linear that
    is FP8 / FP4 in the original and not requantised is stored dequantised as bf16.
    """
    if quant_type is None:
        return orig_kind
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"unknown quant type {quant_type!r}; expected one of {', '.join(QUANT_TYPES)}")
    mx, hif = "-mx" in quant_type, quant_type.endswith("-hif")
    if ".ffn.experts." in name:
        return "mxfp4" if mx else ("int4" if quant_type == "w4a8-int" else "int8")
    if ".ffn.shared_experts." in name:
        return "mxfp8" if mx else "int8"
    if name.endswith(_ATTN_B):
        return "hif8" if hif else ("mxfp8" if mx else "int8")
    if name.endswith(_ATTN_A):
        return "hif8" if hif else ("mxfp8" if mx else "bf16")
    if hif and name.startswith("layers.") and name.endswith(_COMPRESSOR):
        return "hif8"
    return "bf16"


# ---- compressed-tensors quantization_config ------------------------------------------------------
def _ignore(num_layers: int, ratios: list[int], int_type: bool, hif: bool) -> list[str]:
    """Upstream ``generate_ignore_item``: the linears the NPU runs unquantised."""
    out: list[str] = []
    for i in range(num_layers):
        if int_type:
            out += [f"layers.{i}.attn.{n}" for n in ("wq_a", "wkv", "wo_a")]
        if ratios[i] == CSA and not hif:
            out += [f"layers.{i}.attn.{n}" for n in ("indexer.weights_proj", "indexer.compressor.wgate",
                                                     "indexer.compressor.wkv", "compressor.wgate", "compressor.wkv")]
        if ratios[i] == HCA and not hif:
            out += [f"layers.{i}.attn.compressor.wgate", f"layers.{i}.attn.compressor.wkv"]
    if int_type:
        out += ["mtp.0.attn.wq_a", "mtp.0.attn.wkv", "mtp.0.attn.wo_a"]
    return out + ["mtp.0.head", "head"]


def _group(a_bits: int, w_bits: int, qtype: str, mx: bool, hif: bool, input_strategy: str) -> dict[str, Any]:
    """Upstream ``generate_quant_group``."""
    in_group = w_group = block = None
    if hif:
        a_strategy, w_strategy = input_strategy, "channel"
    elif qtype == "int":
        a_strategy, w_strategy = "token", "channel"
    else:
        a_strategy, w_strategy = "group", ("group" if mx else "block")
        in_group, w_group, block = (32 if mx else 128), (32 if mx else None), (None if mx else "128x128")
    return {
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": in_group,
                              "num_bits": a_bits, "observer": "memoryless", "observer_kwargs": {},
                              "strategy": a_strategy, "symmetric": True, "type": qtype},
        "activation_use_clip": False,
        "output_activations": None,
        "weights": {"actorder": None, "block_structure": block, "dynamic": False, "group_size": w_group,
                    "num_bits": w_bits, "observer": "minmax", "observer_kwargs": {}, "strategy": w_strategy,
                    "symmetric": True, "type": qtype},
    }


def compressed_tensors_config(num_layers: int, compress_ratios: list[int], quant_type: str | None,
                              hif: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` upstream writes.

    Args:
        quant_type: a ``QUANT_TYPES`` entry (``convert_model``), or None for ``convert_config`` on
            the original Hybrid FP8-MXFP4 weights (``hif`` selects its ``--hif`` variant).
    """
    if quant_type is None:
        int_type, w4, mx, cache = False, True, False, ("float", "float")
    else:
        hif = quant_type.endswith("-hif")
        int_type, w4, mx = quant_type.endswith("-int"), quant_type.startswith("w4a8"), "-mx" in quant_type
        cache = (None, "int") if int_type else ("float", "float")
    qtype = "int" if int_type else "float"
    groups: dict[str, Any] = {"group_0": {"targets": ["Linear"],
                                          **_group(8, 8, qtype, mx, hif, "tensor" if hif else "group")}}
    if w4:
        groups["group_1"] = {"targets": ["MoEGMM"], **_group(8, 4, qtype, not int_type, False, "group")}
    qc: dict[str, Any] = {
        "config_groups": groups, "format": "int-quantized" if int_type else "float-quantized",
        "global_compression_ratio": 1, "ignore": _ignore(num_layers, list(compress_ratios), int_type, hif),
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "kv_cache_scheme": {"num_bits": 8, "type": cache[0]} if cache[0] else None,
        "li_cache_scheme": {"type": cache[1], "num_bits": 8},
    }
    if hif:
        qc["weight_block_size"] = [128, 128]
    return qc


def parse_compressed_tensors(qc: dict[str, Any]) -> tuple[str | None, tuple[int, int]]:
    """(quant type, FP8 block) of a compressed-tensors ``quantization_config``.

    The quant type is None when the config describes the original FP8-MXFP4 weights (what
    ``convert_config`` writes: Linear weights float 8-bit ``block`` 128x128). A HiF8 config is the
    same whether ``convert_config --hif`` (original tensors) or ``convert_model w4a8-mx-hif`` wrote
    it; the loader tells them apart by the stored dtypes.

    Raises:
        ValueError: the config matches none of the upstream schemes (message names the key).
    """
    key = "quantization_config"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not isinstance(groups.get("group_0"), dict):
        raise ValueError(f"{key}.config_groups.group_0: missing (compressed-tensors needs a Linear group)")
    w0 = groups["group_0"].get("weights") or {}
    w1 = (groups.get("group_1") or {}).get("weights") or {}
    fmt = qc.get("format")
    if fmt == "int-quantized":
        if w0.get("num_bits") != 8 or w0.get("strategy") != "channel":
            raise ValueError(f"{key}.config_groups.group_0.weights: expected int 8-bit per-channel, found {w0}")
        return ("w4a8-int" if w1.get("num_bits") == 4 else "w8a8-int"), (128, 128)
    if fmt != "float-quantized":
        raise ValueError(f"{key}.format: expected 'int-quantized' or 'float-quantized', found {fmt!r}")
    strategy = w0.get("strategy")
    if strategy == "block":
        bs = w0.get("block_structure") or "128x128"
        try:
            bo, bi = (int(v) for v in str(bs).split("x"))
        except ValueError:
            raise ValueError(f"{key}.config_groups.group_0.weights.block_structure: expected 'RxC', "
                             f"found {bs!r}") from None
        return None, (bo, bi)
    if strategy == "group":
        return "w4a8-mx", (128, 128)
    if strategy == "channel":
        return "w4a8-mx-hif", (128, 128)
    raise ValueError(f"{key}.config_groups.group_0.weights.strategy: expected block, group or channel, "
                     f"found {strategy!r}")
