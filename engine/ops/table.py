"""The ``Ops`` table type and ``REFERENCE``, its pure-torch instance (reference/dsv4-architecture.md §8.1).

A module of its own so that the platform kernel modules (``engine.ops.npu``, ``.cpu``, ``.cuda``),
which ``engine.ops.ops_for`` imports, can name the table's type without importing ``engine.ops``
back. ``engine.ops`` re-exports both names; import them from there.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from engine.kernel_config import OP_NAMES
from engine.ops import reference


@dataclass(frozen=True)
class Ops:
    """Named ops; signatures, shapes and dtypes are documented in ``engine.ops.reference``."""

    rms_norm: Callable
    rope: Callable
    linear: Callable
    lm_head: Callable
    act_quant: Callable
    quant_linear: Callable
    grouped_linear: Callable
    hc_pre: Callable
    hc_post: Callable
    hc_head: Callable
    compressor: Callable
    indexer_topk: Callable
    sparse_attn: Callable
    gating_topk: Callable
    swiglu_clamp: Callable
    moe_experts: Callable
    cache_write: Callable
    cache_indexer_topk: Callable
    cache_sparse_attn: Callable
    decode_indexer_topk: Callable
    decode_sparse_attn: Callable

    def with_overrides(self, **kernels: Callable) -> "Ops":
        """A copy with some ops replaced by platform kernels. Raises TypeError on an unknown name."""
        return replace(self, **kernels)


REFERENCE = Ops(**{f.name: getattr(reference, f.name) for f in fields(Ops)})

if tuple(f.name for f in fields(Ops)) != OP_NAMES:
    raise ImportError("engine.kernel_config.OP_NAMES must list the fields of engine.ops.Ops, in order")
