"""Cutting weights for one rank, dense or as stored (``engine.ops.packed``).

A cut is ``(dim, first, length)`` of the logical weight (``[N, K]`` for a linear, ``[E, N, K]``
for stacked experts). On a packed weight each stored tensor gets the matching cut of its own
layout (``packed.stored_cut``: FP8 block scales cut by 128, MXFP4 bytes by 2 columns, a per-row
scale kept whole on a column cut, ...). Every cut tensor is tagged ``shard_cuts`` in its own stored
coordinates, so ``engine.checkpoint.loader`` reads exactly that slice of the stored tensor.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.checkpoint.loader import narrow_cuts
from engine.ops.packed import cut_offset, stored_cut

_ROLE = {"": "data", "_scale": "scale", "_bias": "bias"}


def shard_tensor(p: torch.Tensor, *cuts: tuple[int, int, int]) -> nn.Parameter:
    """``p`` narrowed to each (dim, first, length), tagged ``shard_cuts`` (on meta: no memory)."""
    out = nn.Parameter(narrow_cuts(p, cuts).contiguous().clone(), requires_grad=False)
    out.shard_cuts = cuts
    return out


def _tensors(mod: nn.Module, base: str) -> list[tuple[str, str]]:
    """(attribute, stored role) of a weight family: ``weight`` / ``scale`` / ``bias`` of a Linear,
    ``w1`` / ``w1_scale`` / ``w1_bias`` of an expert stack."""
    if base == "weight":
        names = {"weight": "data", "scale": "scale", "bias": "bias"}
    else:
        names = {f"{base}{suffix}": role for suffix, role in _ROLE.items()}
    return [(a, r) for a, r in names.items() if getattr(mod, a, None) is not None]


def stored_cuts(mod: nn.Module, base: str, cuts: list[tuple[int, int, int]]) -> dict[str, tuple]:
    """The cuts of each stored tensor of weight family ``base`` of ``mod`` (logical ``cuts``).

    Raises:
        ValueError: a cut off the stored format's units (``packed.stored_cut``'s message).
    """
    fmt, block = getattr(mod, "fmt", None), getattr(mod, "block", (128, 128))
    out = {}
    for attr, role in _tensors(mod, base):
        ndim = getattr(mod, attr).dim() if role != "bias" else getattr(mod, attr).dim() + 1
        if fmt is None:
            out[attr] = tuple(cuts)
            continue
        mine = [stored_cut(fmt, role, d, lo, n, ndim, block) for d, lo, n in cuts]
        out[attr] = tuple(c for c in mine if c is not None)
    return out


def cut_weight(mod: nn.Module, base: str, *cuts: tuple[int, int, int]) -> None:
    """Cut weight family ``base`` of ``mod`` in place (every stored tensor of it); an FP8 cut inside
    a scale block records where (``Linear.offset`` / ``Experts.offsets``)."""
    for attr, c in stored_cuts(mod, base, list(cuts)).items():
        if c:
            setattr(mod, attr, shard_tensor(getattr(mod, attr), *c))
    fmt = getattr(mod, "fmt", None)
    if fmt is not None:
        off = cut_offset(fmt, cuts, 2 if base == "weight" else 3, getattr(mod, "block", (128, 128)))
        if base == "weight":
            mod.offset = off
        else:
            mod.offsets = {**mod.offsets, base: off}
