"""The ops seam: every fused operation the model calls, by name (reference/dsv4-architecture.md §8.1).

The model receives an ``Ops`` table at construction and calls only its members, so a platform
kernel (torch_npu custom ops on Ascend, CUDA kernels) replaces one entry without touching the
model. ``REFERENCE`` holds the pure-torch implementations, which are the numerics contract.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from engine.ops import reference


@dataclass(frozen=True)
class Ops:
    """Named ops; signatures, shapes and dtypes are documented in ``engine.ops.reference``."""

    rms_norm: Callable
    rope: Callable
    linear: Callable
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

    def with_overrides(self, **kernels: Callable) -> "Ops":
        """A copy with some ops replaced by platform kernels. Raises TypeError on an unknown name."""
        return replace(self, **kernels)


REFERENCE = Ops(**{f.name: getattr(reference, f.name) for f in fields(Ops)})

__all__ = ["Ops", "REFERENCE"]
