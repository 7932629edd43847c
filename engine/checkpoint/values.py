"""Value checks a loader can afford on every rank: each costs at most one pass over a small tensor.

Checked: NaN / inf in every bf16 / fp16 / fp32 tensor (norms, router, compressors, embedding,
head, mHC, sinks: ~10% of a checkpoint's bytes); NaN (code 255) in every e8m0 scale (a NaN scale
poisons its whole block); hash-routing expert ids in range; the int4 "assistance" bias on the first
row pair of every expert. Not checked: the FP8 / FP4 / int8 / HiF8 weight bytes themselves (FP4
and int8 have no NaN; a full pass over FP8 would double the load time).
"""
from __future__ import annotations

import torch

from engine.checkpoint.int8_int4 import int4_bias, u64_to_scale, unpack_int4_rows
from engine.checkpoint.shards import CheckpointError
from engine.config import ModelArgs


def check_values(name: str, t: torch.Tensor, args: ModelArgs) -> None:
    """Raise CheckpointError when stored tensor ``name`` (a host view) holds values it must not."""
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64) and not torch.isfinite(t).all():
        raise CheckpointError(f"checkpoint: tensor '{name}' holds NaN or inf values")
    if t.dtype == torch.float8_e8m0fnu and (t.view(torch.uint8) == 255).any():
        raise CheckpointError(f"checkpoint: tensor '{name}' holds NaN scales (e8m0 code 255)")
    if name.endswith("tid2eid") and t.numel() and (t.min() < 0 or t.max() >= args.n_routed_experts):
        raise CheckpointError(f"checkpoint: tensor '{name}' has expert ids outside [0, {args.n_routed_experts})")


def check_int4_bias(model: torch.nn.Module) -> None:
    """The int4 experts' stored bias equals ``sum_k 8 * scale * q`` (reference §7) on rows 0 and 1
    of every expert held: a stale or foreign bias is off by O(1). Upstream computes it in bf16,
    so 2^-6 of ``sum_k |8 s q|`` is allowed.

    Raises:
        CheckpointError: naming the first mismatching weight.
    """
    for name, mod in model.named_modules():
        if getattr(mod, "fmt", None) != "int4" or not hasattr(mod, "w1_bias"):
            continue
        for w in ("w1", "w3", "w2"):
            data, scale, bias = getattr(mod, w), getattr(mod, f"{w}_scale"), getattr(mod, f"{w}_bias")
            q = unpack_int4_rows(data[:, :1].flatten(0, 1).cpu()).view(data.shape[0], 2, -1)      # [E, 2, K]
            s = u64_to_scale(scale[:, :2].reshape(-1, 1).cpu()).view(data.shape[0], 2, 1)
            want = (8 * s * q.float()).sum(-1)
            tol = (8 * s * q.float()).abs().sum(-1) * 2 ** -6 + 1e-6
            if ((bias[:, :2].float().cpu() - want).abs() > tol).any():
                raise CheckpointError(f"checkpoint: tensor '{name}.<e>.{w}.bias': int4 assistance bias does not "
                                      "equal sum_k 8 * scale * q (stale or foreign bias)")


__all__ = ["check_values", "check_int4_bias", "int4_bias"]
