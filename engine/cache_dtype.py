"""Which format the decode-state caches are kept in, and what one row of each costs. Torch-free.

reference/dsv4-architecture.md §4 (per-request state) and §7 (conversion schemes): the KV caches
(window ring, CSA / HCA compressed KV) and the lightning-indexer key cache may be quantised; the
compressor remainders always stay fp32. The storage of each kind, per row (one token / entry):

============  ===================================================================  ===============
KV kind       row layout (bytes)                                                   Flash / Pro row
============  ===================================================================  ===============
``none``      d elements of the compute dtype                                      1024 B (bf16)
``fp8``       [rope r x bf16 | nope (d-r) x e4m3 | ceil((d-r)/64) x e8m0 scale]     640 B
              padded to a multiple of 128 (``kv_compress_epilog`` quant_mode 2:
              per-64 nope groups, power-of-two scales rounded up)
``hif8``      d x HiF8 (``kv_compress_epilog`` quant_mode 3, per-tensor scale 1)   512 B
============  ===================================================================  ===============

============  ===================================================================  ===============
indexer kind  row layout                                                           dI = 128
============  ===================================================================  ===============
``none``      dI elements of the compute dtype                                     256 B (bf16)
``int8``      dI x int8 + one fp16 scale (amax / 127; A3 ``li_cmp_kv`` +            130 B
              ``li_key_dequant_scale``)
``fp8``       dI x e4m3 + one fp32 scale (amax / 448; ``indexer_compress_epilog``  132 B
              quant_mode 1)
``hif8``      dI x HiF8 (per-tensor scale 1)                                        128 B
============  ===================================================================  ===============

``scheduler_config.kv_cache_dtype`` picks a pair: ``auto`` (the checkpoint's ``kv_cache_scheme`` /
``li_cache_scheme``), ``bfloat16`` (nothing quantised: both caches in the compute dtype, C16),
``int8`` (A3 W8A8C16: KV unquantised, indexer int8), ``fp8`` (950 C8: both FP8), ``hif8`` (950
HiF8: both HiF8).
"""
from __future__ import annotations

import math
from typing import NamedTuple

KV_KINDS = ("none", "fp8", "hif8")
INDEXER_KINDS = ("none", "int8", "fp8", "hif8")
SETTINGS = {"bfloat16": ("none", "none"), "int8": ("none", "int8"), "fp8": ("fp8", "fp8"),
            "hif8": ("hif8", "hif8")}
KEY = "scheduler_config.kv_cache_dtype"
FP8_GROUP, ROW_ALIGN = 64, 128


class CacheDtype(NamedTuple):
    """The storage kinds of the KV caches (``kv``) and the indexer key cache (``indexer``)."""

    kv: str = "none"
    indexer: str = "none"

    @property
    def quantised(self) -> bool:
        return self != ("none", "none")

    def describe(self) -> dict[str, str]:
        """Plain dict for handshake layouts, metrics and logs."""
        return {"kv": self.kv, "indexer": self.indexer}


def kv_row_bytes(kind: str, head_dim: int, rope_dim: int, act_bytes: int) -> int:
    """Bytes of one KV row (window slot or compressed entry) of ``kind`` (see the module table)."""
    if kind == "none":
        return head_dim * act_bytes
    if kind == "hif8":
        return head_dim
    if kind == "fp8":
        nope = head_dim - rope_dim
        used = 2 * rope_dim + nope + math.ceil(nope / FP8_GROUP)
        return math.ceil(used / ROW_ALIGN) * ROW_ALIGN
    raise ValueError(f"kv cache kind {kind!r}: expected one of {KV_KINDS}")


def indexer_row_bytes(kind: str, index_head_dim: int, act_bytes: int) -> int:
    """Bytes of one indexer-key entry of ``kind`` (data + its scale)."""
    extra = {"none": None, "int8": 2, "fp8": 4, "hif8": 0}
    if kind not in extra:
        raise ValueError(f"indexer cache kind {kind!r}: expected one of {INDEXER_KINDS}")
    return index_head_dim * act_bytes if kind == "none" else index_head_dim + extra[kind]


def resolve(setting: str, quantization_config: dict | None) -> CacheDtype:
    """``scheduler_config.kv_cache_dtype`` -> the cache kinds.

    ``auto`` reads the checkpoint's compressed-tensors ``quantization_config`` (None or an
    original FP8 config: nothing quantised): ``kv_cache_scheme`` float -> fp8 KV (HiF8 when the
    Linear group quantises activations per tensor, the HiF8 scheme), absent -> unquantised;
    ``li_cache_scheme`` int -> int8 indexer, float -> fp8 (HiF8 as above).

    Raises:
        ValueError: an unknown setting (names ``scheduler_config.kv_cache_dtype``) or a cache
            scheme this project cannot keep (names the ``quantization_config`` key).
    """
    if setting in SETTINGS:
        return CacheDtype(*SETTINGS[setting])
    if setting != "auto":
        raise ValueError(f"{KEY}: expected 'auto' or one of {sorted(SETTINGS)}, got {setting!r}")
    qc = quantization_config if isinstance(quantization_config, dict) else {}
    if qc.get("quant_method") != "compressed-tensors":
        return CacheDtype()
    path, node = "quantization_config", qc
    for key in ("config_groups", "group_0", "input_activations"):
        node, path = node.get(key) if isinstance(node, dict) else None, f"{path}.{key}"
        if node is not None and not isinstance(node, dict):
            raise ValueError(f"{path}: expected an object, got {node!r}")
    hif = (node or {}).get("strategy") == "tensor"

    def kind(key: str, allowed: dict[str, str]) -> str:
        scheme = qc.get(key)
        if scheme is None:
            return "none"
        typ = scheme.get("type") if isinstance(scheme, dict) else None
        bits = scheme.get("num_bits") if isinstance(scheme, dict) else None
        if not isinstance(typ, str) or typ not in allowed or type(bits) is not int or bits != 8:
            raise ValueError(f"quantization_config.{key}: expected 8-bit {sorted(allowed)} or null, got {scheme!r}")
        return allowed[typ]

    f8 = "hif8" if hif else "fp8"
    return CacheDtype(kind("kv_cache_scheme", {"float": f8}), kind("li_cache_scheme", {"int": "int8", "float": f8}))
