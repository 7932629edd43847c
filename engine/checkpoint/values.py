"""Value checks a loader can afford on every rank: each costs at most one pass over a small tensor.

Checked: NaN / inf in every bf16 / fp16 / fp32 tensor (norms, router, compressors, embedding,
head, mHC, sinks: ~10% of a checkpoint's bytes, and the int8 / HiF8 per-row scales); NaN (code
255) in every e8m0 scale, float8 or uint8 (MX) (a NaN scale poisons its whole block); the int4
uint64 scales (high half zero, a finite fp32 below); hash-routing expert ids in range; the int4
"assistance" bias on the first row pair of every expert. Not checked: the FP8 / FP4 / int8 / HiF8
weight bytes themselves (FP4 and int8 have no NaN; finding NaN codes in FP8 runs at ~0.4 GB/s a
core, 4x slower than the copy itself).
"""
from __future__ import annotations

import torch

from engine.checkpoint.int8_int4 import int4_bias, u64_to_scale, unpack_int4_rows
from engine.checkpoint.shards import CheckpointError
from engine.config import ModelArgs


# float dtype -> (same-width int view, magnitude mask, the first non-finite magnitude): NaN / inf
# have every exponent bit set, so a value is finite iff (bits & mask) < that pattern; one AND and
# one max run ~5x faster than torch.isfinite on bf16
_FINITE = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
           torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}


def all_finite(t: torch.Tensor) -> bool:
    """Whether a float tensor holds no NaN / inf (checked on its bits for bf16 / fp16 / fp32)."""
    if t.numel() == 0:
        return True
    if t.dtype in _FINITE:
        as_int, mask, inf = _FINITE[t.dtype]
        return int((t.contiguous().view(as_int) & mask).max()) < inf
    return bool(torch.isfinite(t).all())


def check_values(name: str, t: torch.Tensor, args: ModelArgs) -> None:
    """Raise CheckpointError when stored tensor ``name`` (a host view) holds values it must not."""
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64) and not all_finite(t):
        raise CheckpointError(f"checkpoint: tensor '{name}' holds NaN or inf values")
    e8m0 = t.dtype == torch.float8_e8m0fnu or (t.dtype == torch.uint8 and name.endswith(".scale"))   # MX: uint8
    if e8m0 and (t.view(torch.uint8) == 255).any():
        raise CheckpointError(f"checkpoint: tensor '{name}' holds NaN scales (e8m0 code 255)")
    if t.dtype == torch.uint64 and name.endswith(".scale"):                # int4: fp32 bits in the low half
        bits = t.contiguous().view(torch.int64)
        if bool((bits >> 32).any()):
            raise CheckpointError(f"checkpoint: tensor '{name}' has int4 scales with non-zero high 32 bits")
        if not all_finite(bits.to(torch.int32).view(torch.float32)):
            raise CheckpointError(f"checkpoint: tensor '{name}' holds NaN or inf values")
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
            bad = ((bias[:, :2].float().cpu() - want).abs() > tol).any(-1).nonzero()
            if bad.numel():
                e = int(bad[0, 0]) + _first_expert(getattr(mod, w))
                raise CheckpointError(f"checkpoint: tensor '{name}.{e}.{w}.bias': int4 assistance bias does not "
                                      "equal sum_k 8 * scale * q (stale or foreign bias)")


def _first_expert(p: torch.Tensor) -> int:
    """Global index of a (sharded) expert stack's first expert."""
    return next((lo for d, lo, _ in getattr(p, "shard_cuts", ()) if d == 0), 0)


__all__ = ["check_values", "check_int4_bias", "int4_bias"]
