"""Fixed-shape BLAS calls: every GEMM and per-row product in blocks of ``GEMM_ROW_MULTIPLE`` rows
(batch invariance on CPU).

Part of the reference ops (``engine.ops.reference``): plain math, the numerics contract.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


# Batch invariance on CPU: a row's bits must not depend on how many rows share a BLAS call. CPU
# BLAS picks kernels and splits work across threads by the call's shape (leftover rows, narrow
# column slices when rows are few), and rounds differently in each; MKL's strict CNR mode
# (engine/__init__.py) holds that still on Intel CPUs but not on AMD ones (EPYC: a row of an
# [M, 256] x [256, 16] GEMM changes bits between M = 8 and M = 16 on 2 threads, a batched
# matmul item between 1 and 2 items, a score column between 11 and 12 columns). So on CPU every
# GEMM and every per-row batched matmul here runs in calls of exactly GEMM_ROW_MULTIPLE rows (the
# last block zero-padded), and a row's products have the same number of columns on every path:
# the same call shape, hence the same kernel and split, for every row whatever the number of
# rows. On other devices linear / grouped_linear / the per-row products stay single calls (rows
# padded to a multiple of GEMM_ROW_MULTIPLE).
GEMM_ROW_MULTIPLE = 8


def pad_rows(M: int) -> int:
    """Rows to add to M to reach a multiple of ``GEMM_ROW_MULTIPLE``."""
    return -(-M // GEMM_ROW_MULTIPLE) * GEMM_ROW_MULTIPLE - M


def pad_block(x: torch.Tensor) -> torch.Tensor:
    """x ``[r, ...]`` (r <= GEMM_ROW_MULTIPLE) zero-padded to ``GEMM_ROW_MULTIPLE`` rows, contiguous."""
    r = x.shape[0]
    if r == GEMM_ROW_MULTIPLE:
        return x.contiguous()
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, GEMM_ROW_MULTIPLE - r))


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` in row blocks of exactly ``GEMM_ROW_MULTIPLE``: x ``[M, K]``, weight ``[N, K]`` ->
    ``[M, N]`` in x's dtype. Fixed-shape calls make a row's result independent of M (batch
    invariance: a row computes the same alone or batched)."""
    M, R = x.shape[0], GEMM_ROW_MULTIPLE
    if M == 0:
        return F.linear(x, weight)
    if x.device.type != "cpu":
        return F.linear(F.pad(x, (0, 0, 0, pad_rows(M))), weight)[:M]
    x, wt = x.contiguous(), weight.t()
    if M <= R:
        return torch.mm(pad_block(x), wt)[:M]
    full = M // R * R
    out = torch.empty(-(-M // R) * R, weight.shape[0], dtype=x.dtype, device=x.device)
    if full:
        for xb, ob in zip(x[:full].view(-1, R, x.shape[1]), out[:full].view(-1, R, out.shape[1])):
            torch.mm(xb, wt, out=ob)
    if full < M:
        torch.mm(pad_block(x[full:]), wt, out=out[full:])
    return out[:M]


def _row_bmm(a: torch.Tensor, b: torch.Tensor, b_t: bool) -> torch.Tensor:
    """Per-row products ``a[t] @ b[t]`` (``b[t]^T`` with ``b_t``) as batched matmuls of exactly
    ``GEMM_ROW_MULTIPLE`` rows each, the last group padded (see ``GEMM_ROW_MULTIPLE``).

    a: ``[T, m, k]``. b: ``[T, k, n]`` (``[T, n, k]`` with b_t) or, shared by all rows, ``[k, n]``
    (``[n, k]``), used in place (stride-0 batch). a is made contiguous and b's items dense
    (row-major), so every call sees the same item layouts (a window of overlapping rows, a slice of
    a wider tensor, a gathered copy or a shared tensor alike). Returns ``[T, m, n]`` in a's dtype.
    """
    T, R = a.shape[0], GEMM_ROW_MULTIPLE
    shared = b.dim() == 2
    if a.device.type != "cpu":
        b = b.expand(T, *b.shape) if shared else b
        return torch.bmm(a, b.transpose(1, 2) if b_t else b)
    if not shared and (b.stride(-1) != 1 or b.stride(-2) != b.shape[-1]):
        b = b.contiguous()
    a = a.contiguous()

    def group(t0: int, r: int) -> torch.Tensor:
        if r == 1:                                   # padding items repeat the row (results unused)
            ag, bg = a[t0:t0 + 1].expand(R, *a.shape[1:]), b if shared else b[t0:t0 + 1]
        else:
            ag = pad_block(a[t0:t0 + r])
            bg = b if shared else b[t0:t0 + R] if r == R else pad_block(b[t0:t0 + r])
        bg = bg.expand(R, *b.shape) if shared else bg.expand(R, *bg.shape[1:])
        return torch.bmm(ag, bg.transpose(1, 2) if b_t else bg)

    if T <= R:
        return group(0, T)[:T] if T else a.new_empty((0, a.shape[1], b.shape[-2] if b_t else b.shape[-1]))
    return torch.cat([group(t0, min(R, T - t0)) for t0 in range(0, T, R)])[:T]


def row_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q[t] @ keys[t]^T`` per row: q ``[T, h, d]``, keys ``[T, n, d]`` or shared ``[n, d]`` -> ``[T, h, n]``."""
    return _row_bmm(q, keys, True)


def row_mix(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``p[t] @ values[t]`` per row: p ``[T, h, n]``, values ``[T, n, d]`` or shared ``[n, d]`` -> ``[T, h, d]``."""
    return _row_bmm(p, values, False)
