"""mHC wrappers: hc_pre (Sinkhorn mixing in) and hc_post (stream mix out) (see ``engine.ops.npu``)."""
from __future__ import annotations

import torch

from engine.ops.npu.runtime import BF16, HALF, device_why, dtype_why, fallback, first_reason


_HC_DIMS = (4096, 7168)        # doc: d = 4096; the repository's example tests also run d = 7168


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix via ``torch.ops.custom.npu_hc_pre``.

    Schema [CRI ops_def_registration.cpp]: ``npu_hc_pre(Tensor x, Tensor hc_fn, Tensor hc_scale,
    Tensor hc_base, *, int hc_mult=4, int hc_sinkhorn_iters=20, float norm_eps=1e-6, float
    hc_eps=1e-6) -> (y, post, comb_frag)``.

    Contract [CRI custom-npu_hc_pre.md, src/hc_pre/op_host/hc_pre_def.cpp, examples/test_npu_hc_pre.py]:
    x ``[T, hc_mult, d]`` bf16 only, contiguous; hc_fn ``[24, 4*d]`` fp32; hc_scale ``[3]`` fp32;
    hc_base ``[24]`` fp32; ``hc_mult`` 4, ``hc_sinkhorn_iters`` 20, d 4096 (the doc; the examples
    also test 7168). Output: y ``[T, d]`` bf16, post ``[T, 4]`` fp32, comb ``[T, 4, 4]`` fp32. The
    example golden (softmax over the last axis, then column/row Sinkhorn) gives the same
    orientation as the reference. The kernel's fn matmul runs in HF32 (per that golden).

    Falls back to the reference for: X not bf16, not on an NPU, no rows, n != 4, H not in
    (4096, 7168), ``sinkhorn_iters != 20``, or fn/scale/base of another shape.
    """
    T, n, H = X.shape
    why = first_reason(dtype_why("X", X, BF16), device_why(X),
                 None if T > 0 else "no rows",
                 None if n == 4 else f"hc_mult {n}, kernel takes 4",
                 None if H in _HC_DIMS else f"hidden {H} not in {_HC_DIMS}",
                 None if sinkhorn_iters == 20 else f"sinkhorn_iters {sinkhorn_iters}, kernel takes 20",
                 None if tuple(fn.shape) == ((2 + n) * n, n * H) and scale.numel() == 3
                 and base.numel() == (2 + n) * n else "fn / scale / base shapes")
    if why:
        return fallback("hc_pre", why, X, fn, scale, base, norm_eps, hc_eps, sinkhorn_iters)
    y, post, comb = torch.ops.custom.npu_hc_pre(
        X.contiguous(), fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous(),
        hc_mult=n, hc_sinkhorn_iters=sinkhorn_iters, norm_eps=float(norm_eps), hc_eps=float(hc_eps))
    return y, post, comb


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post-mix via ``torch.ops.custom.npu_hc_post``.

    Schema [CRI ops_def_registration.cpp]: ``npu_hc_post(Tensor x, Tensor residual, Tensor post,
    Tensor comb) -> Tensor``. It computes ``out[k] = post[k] * x + sum_j comb[j, k] * residual[j]``
    (the CPU golden in examples/test_npu_hc_post.py sums over j), the same as the reference.

    Contract [CRI custom-npu_hc_post.md, src/hc_post/op_host/hc_post_def.cpp]: x ``[T, d]``,
    residual ``[T, hc, d]`` and the output share one dtype (fp16/bf16/fp32); post ``[T, hc]`` and
    comb ``[T, hc, hc]`` share one dtype, which may differ from x's (the def lists every pairing,
    e.g. bf16 x with fp32 post/comb). All contiguous; hc 4; d 4096 (the doc; the examples also test
    7168).

    Falls back to the reference for: f/X not bf16/fp16 (fp32 stays on the reference), not on an
    NPU, f and X dtypes differ, post and comb dtypes differ, no rows, n != 4, or H not in
    (4096, 7168).
    """
    T, n, H = X.shape
    why = first_reason(dtype_why("X", X, HALF), device_why(X),
                 None if f.dtype == X.dtype else "f and X dtypes differ",
                 None if post.dtype == comb.dtype and post.dtype in (torch.float32,) + HALF
                 else "post / comb dtypes differ or are not float",
                 None if T > 0 else "no rows",
                 None if n == 4 else f"hc_mult {n}, kernel takes 4",
                 None if H in _HC_DIMS else f"hidden {H} not in {_HC_DIMS}")
    if why:
        return fallback("hc_post", why, f, X, post, comb)
    return torch.ops.custom.npu_hc_post(f.contiguous(), X.contiguous(), post.contiguous(), comb.contiguous())
