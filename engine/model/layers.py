"""Small building blocks: Linear, RMSNorm, rotary tables (reference/dsv4-architecture.md §3, §3.6)."""
from __future__ import annotations

import contextlib
import math
import threading

import torch
from torch import nn

from engine.ops import Ops

_DEFERRED = threading.local()


def param(shape, dtype) -> nn.Parameter:
    """A zero, frozen parameter of ``shape`` / ``dtype``, on the meta device inside ``deferred_params``
    (the loader fills it; shard-aware loading reads only the kept slice)."""
    device = "meta" if getattr(_DEFERRED, "on", False) else None
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


@contextlib.contextmanager
def deferred_params():
    """Modules built inside (this thread) get their parameters on the meta device (no memory): a
    loader can shard them first and then ``materialize`` only the shards."""
    before = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = before


def materialize(model: nn.Module) -> None:
    """Replace every meta parameter of ``model`` by zeros of its shape and dtype on the CPU."""
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                new = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=False)
                new.__dict__.update(p.__dict__)          # e.g. a shard's ``shard_cuts``
                mod._parameters[name] = new


class Linear(nn.Module):
    """``y = x @ weight^T`` through ``ops.linear``; weight ``[out, in]`` in ``dtype``.

    For a converted checkpoint (§7) the loader sets ``act``, the activation quantisation
    ``ops.act_quant`` applies to x first, and, on a ``packable`` linear stored as int8 / MXFP8 /
    HiF8, replaces ``weight`` by the stored tensor plus ``weight_scale`` and sets ``fmt``: forward
    then runs ``ops.quant_linear`` (a fused quantised GEMM on devices). Linears whose weight other
    code reads directly (``wo_a``, compressors) are not packable and keep a dense weight.
    """

    act: str | None = None
    fmt: str | None = None
    packable: bool = True

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, ops: Ops):
        super().__init__()
        self.weight = param((out_features, in_features), dtype)
        self.ops = ops

    def quant_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as this linear's kernel sees it (quantised per ``act``), same shape and dtype."""
        return x if self.act is None else self.ops.act_quant(x, self.act)

    def store_quantised(self, weight: torch.Tensor, scale: torch.Tensor, fmt: str, act: str) -> None:
        """Keep the stored ``weight`` / ``scale`` of format ``fmt`` instead of a dense weight."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"store_quantised: weight {tuple(weight.shape)} != {tuple(self.weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.fmt, self.act = fmt, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt is not None:
            return self.ops.quant_linear(x, self.weight, self.weight_scale, self.fmt, self.act)
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
