"""Small building blocks: Linear, RMSNorm, rotary tables (reference/dsv4-architecture.md §3, §3.6)."""
from __future__ import annotations

import contextlib
import math
import threading

import torch
from torch import nn

from engine.ops import Ops
from engine.ops.packed import Packed, dequant

_DEFERRED = threading.local()


def zeros(shape, dtype) -> torch.Tensor:
    """Zeros of ``shape`` / ``dtype``, on the meta device inside ``deferred_params``."""
    return torch.zeros(*shape, dtype=dtype, device="meta" if getattr(_DEFERRED, "on", False) else None)


def param(shape, dtype) -> nn.Parameter:
    """A zero, frozen parameter of ``shape`` / ``dtype``, on the meta device inside ``deferred_params``
    (the loader gives it the stored dtype and shape, shards it, then fills it)."""
    return nn.Parameter(zeros(shape, dtype), requires_grad=False)


@contextlib.contextmanager
def deferred_params():
    """Modules built inside (this thread) get their parameters on the meta device (no memory): a
    loader can retype and shard them first and then fill only the shards."""
    before = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = before


class Linear(nn.Module):
    """``y = x @ weight^T`` through the ops seam; ``weight`` ``[out, in]`` as the checkpoint stores it.

    The loader (``engine.checkpoint.loader``) keeps the stored tensors: a bf16 / fp32 linear keeps
    ``weight`` in that dtype (``ops.linear`` computes in x's dtype); a quantised one keeps the
    stored ``weight`` + ``scale`` (+ ``bias`` for int4) and sets ``fmt`` (``engine.ops.packed``
    formats), and forward runs ``ops.quant_linear`` on ``packed``. For a converted checkpoint (§7)
    ``act`` names the activation quantisation applied to x first. ``compute_dtype`` is the dtype a
    dense copy of this weight would have (``dense_weight``; the dequantised reference path).
    """

    act: str | None = None
    fmt: str | None = None
    block: tuple[int, int] = (128, 128)
    offset: tuple[int, int] = (0, 0)

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, ops: Ops):
        super().__init__()
        self.weight = param((out_features, in_features), dtype)
        self.register_parameter("scale", None)
        self.register_parameter("bias", None)
        self.ops, self.compute_dtype = ops, dtype

    @property
    def packed(self) -> Packed:
        """The stored weight as a ``Packed`` (``fmt`` must be set)."""
        return Packed(self.weight, self.scale, self.fmt, self.bias, self.block, self.offset)

    @property
    def stored(self) -> torch.Tensor | Packed:
        """What the ops seam takes for this weight: the dense tensor, or ``packed``."""
        return self.weight if self.fmt is None else self.packed

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense ``[out, in]`` tensor: ``weight`` itself when not quantised (any
        dtype; callers cast), else dequantised to ``dtype``. For small weights read whole by
        other ops (compressors) and the dequantised reference path."""
        return self.weight if self.fmt is None else dequant(self.packed, dtype)

    def quant_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as this linear's kernel sees it (quantised per ``act``), same shape and dtype."""
        return x if self.act is None else self.ops.act_quant(x, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt is not None:
            return self.ops.quant_linear(x, self.packed, self.act)
        return self.ops.linear(self.quant_input(x), self.weight)


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``; weight kept in fp32, math in fp32, output in x.dtype."""

    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = param((dim,), torch.float32)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_pos: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """YaRN inverse frequencies for ``dim`` rope dims, no mscale (§3.6; YaRN paper, arXiv 2309.00071).

    Pairs below the ``beta_fast`` correction dim keep ``base^(-2i/dim)``, pairs above the
    ``beta_slow`` one are divided by ``factor``, and a linear ramp blends in between.
    Returns ``[dim/2]`` fp32.
    """
    def corr_dim(rot: float) -> float:
        return dim * math.log(original_max_pos / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryTable:
    """cos / sin of ``position * inv_freq`` in fp32 for one rope kind (main or compress)."""

    def __init__(self, rope_dim: int, theta: float, yarn: dict | None = None):
        if yarn is None:
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        else:
            self.inv_freq = yarn_inv_freq(rope_dim, theta, yarn["factor"], yarn["original_max_position_embeddings"],
                                          yarn["beta_fast"], yarn["beta_slow"])

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` int64 -> (cos, sin) ``[T, r/2]`` fp32."""
        freqs = (positions.float()[:, None] * self.inv_freq.to(positions.device)).double()
        # fp64 then round: CPU cos/sin take a vector or a scalar path by an element's place in the
        # tensor, which rounds differently in fp32; rounded fp64 agrees (batch / chunk invariance)
        return freqs.cos().float(), freqs.sin().float()
