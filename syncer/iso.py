"""The isotropic merge (`--merge iso`, DESIGN §5.2): a merged matrix update with a flat spectrum.

A merged update M = U·diag(s)·Vᵀ moves the model far along a few directions (the large singular
values) and hardly along the rest. The isotropic merge keeps M's singular vectors and replaces its
singular values by their mean, s̄ = mean(s): M' = s̄·U·Vᵀ. Only 2-D matrices of non-embedding
fragments take it; vectors, 1-D tensors and embeddings keep the RDA or averaged update (`merge.py`).

Only the update's own subspace is kept: singular values at or below the float32 rounding of the
largest (t = max(m, n)·ε·s₁, as `torch.linalg.matrix_rank`) carry no direction of the update, and
their singular vectors are whatever the SVD happens to return, so they are left out of both the
mean and the product. A hard cut would make the result jump when a value crosses t (one direction
more changes s̄·√r by about 1/(2r)), and a float32 SVD puts values near t on either side of it; so
each direction i enters with a weight w_i rising linearly from 0 at t to 1 at 2t:
M' = s̄·Σ w_i·u_i·v_iᵀ with s̄ = Σ w_i·s_i / Σ w_i. A zero update stays zero; a rank-1 update is
returned as it is.

The SVD is exact (LAPACK's, in float32, one call per matrix); the mean is taken in float64, so
the result's norm, s̄·√r for rank r, is as accurate as the singular values themselves. The same
input on the same device gives the same bits: each matrix is one deterministic call.
"""

from __future__ import annotations

import torch

__all__ = ["direction_weights", "isotropic_", "spectrum_rank"]


def direction_weights(singular: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Float64 weights of the (descending) singular values: 0 at or below float32 rounding of the
    largest, 1 from twice that, linear between."""
    s = singular.double()
    if s.numel() == 0 or not float(s[0]) > 0.0:
        return torch.zeros_like(s)
    tol = max(shape) * torch.finfo(torch.float32).eps * float(s[0])
    return ((s - tol) / tol).clamp_(0.0, 1.0)


def spectrum_rank(singular: torch.Tensor, shape: tuple[int, int]) -> int:
    """How many of the singular values take part (a weight above 0)."""
    return int((direction_weights(singular, shape) > 0).sum())


def isotropic_(matrix: torch.Tensor) -> torch.Tensor:
    """Replace the float32 ``[m, n]`` `matrix` (a merged update) by s̄·Σ w_i·u_i·v_iᵀ in place, and return it."""
    if matrix.dim() != 2 or matrix.dtype != torch.float32:
        raise ValueError(f"isotropic_: expected a float32 matrix, got {matrix.dtype} of shape {tuple(matrix.shape)}")
    if matrix.numel() == 0:
        return matrix
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    w = direction_weights(s, (matrix.size(0), matrix.size(1)))
    rank = int((w > 0).sum())
    if rank == 0:
        return matrix.zero_()
    mean = float((w * s.double()).sum() / w.sum())
    w32 = w[:rank].float()
    torch.mm(u[:, :rank] * w32, vh[:rank], out=matrix)
    return matrix.mul_(mean)
