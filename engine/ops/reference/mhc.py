"""mHC: hc_pre (Sinkhorn mixing into the layer), hc_post (the stream mix out), hc_head (§3.2).

Part of the reference ops (``engine.ops.reference``): plain math, the numerics contract.
"""
from __future__ import annotations

import torch

from engine.ops.reference.blas import gemm


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid via fp64: the CPU kernel's vector and scalar-tail paths round differently in
    fp32, so on a small last dim (n = 4) a row's value would depend on the number of rows."""
    return torch.sigmoid(x.double()).float()


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix: collapse n streams into the block input and build post / comb (§3.2).

    Args:
        X: ``[T, n, H]`` residual streams. fn: ``[(2+n)*n, n*H]`` fp32; scale ``[3]``; base ``[(2+n)*n]``.
    Returns:
        ``y [T, H]`` (X.dtype), ``post [T, n]`` fp32, ``comb [T, n, n]`` fp32 (rows = input
        stream j, cols = output stream k; doubly stochastic after Sinkhorn).
    """
    T, n, H = X.shape
    flat = X.reshape(T, n * H).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mix = gemm(flat, fn.float())                                   # [T, (2+n)*n]
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = _sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * _sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):                             # in place: 4 small ops, not 6
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(hc_eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc_eps))
    y = (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)                 # [T, H]
    return y, post, comb


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post-mix ``X'_k = post_k * f + sum_j comb[j, k] * X_j`` in fp32 (§3.2).

    Args:
        f: ``[T, H]`` block output; X: ``[T, n, H]``; post: ``[T, n]``; comb: ``[T, n, n]``.
    Returns:
        ``[T, n, H]`` in X.dtype.
    """
    # elementwise over the n input streams in order, not a batched matmul: no BLAS call whose
    # shape depends on the number of rows (batch invariance, see GEMM_ROW_MULTIPLE)
    Xf = X.float()
    out = post.unsqueeze(-1) * f.float().unsqueeze(1)
    for j in range(X.shape[1]):
        out.add_(comb[:, j, :, None] * Xf[:, j, None, :])
    return out.to(X.dtype)


def hc_head(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Final stream collapse ``h = sum_j (sigmoid(mix_j * scale + base_j) + eps) X_j`` (§3.2 end).

    X: ``[T, n, H]``; fn ``[n, n*H]``; scale ``[1]``; base ``[n]``. Returns ``[T, H]`` in X.dtype.
    """
    T, n, H = X.shape
    flat = X.reshape(T, n * H).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = _sigmoid(gemm(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
