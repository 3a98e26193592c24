"""The isotropic merge (`--merge iso`, DESIGN §5.2): a merged matrix update with a flat spectrum.

A merged update M = U·diag(s)·Vᵀ moves the model far along a few directions (the large singular
values) and hardly along the rest. The isotropic merge keeps M's singular vectors and replaces its
singular values by their mean, s̄ = mean(s): M' = s̄·U·Vᵀ. Only 2-D matrices of non-embedding
fragments take it; vectors, 1-D tensors and embeddings keep their RDA update (`merge.py`).

Only the update's own subspace is kept: singular values at or below the float32 rounding of the
largest (t = max(m, n)·ε·s₁, as `torch.linalg.matrix_rank`) carry no direction of the update, and
their singular vectors are whatever the SVD happens to return, so they are left out of both the
mean and the product. A hard cut would make the result jump when a value crosses t (one direction
more changes s̄·√r by about 1/(2r)), and a float32 SVD puts values near t on either side of it; so
each direction i enters with a weight w_i rising linearly from 0 at t to 1 at 2t (its singular
value taken again in float64 as u_iᵀ·M·v_i when near that ramp):
M' = s̄·Σ w_i·u_i·v_iᵀ with s̄ = Σ w_i·s_i / Σ w_i. A zero update stays zero; a rank-1 update is
returned as it is.

The SVD is exact (LAPACK's, in float32, one call per matrix). Float32 singular values are off by
~1e-7 relative, so s̄ is taken again from the singular vectors, Σ w_i·s_i = ⟨M, Σ w_i·u_i·v_iᵀ⟩ in
float64 (second-order accurate), and the result is scaled to the norm it should have, s̄·√(Σ w_i²),
measured in float64: against a float64 SVD of the same matrix its norm is off by ~1e-7 (under
3e-7 with a value on the ramp, tests/unit/test_iso_merge.py), where it was off by up to 6e-5. The same
input on the same device gives the same bits: each matrix is one deterministic call.
"""

from __future__ import annotations

import math

import torch

__all__ = ["direction_weights", "isotropic_", "spectrum_rank"]

_CHUNK = 1 << 20  # elements converted to float64 at a time for the result's mean and norm


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
    shape = (matrix.size(0), matrix.size(1))
    w = direction_weights(_refined(matrix, u, s, vh), shape)
    keep = (w > 0).nonzero().flatten()
    if keep.numel() == 0:
        return matrix.zero_()
    w = w[keep]
    product = torch.mm(u[:, keep] * w.float(), vh[keep])
    # Σ w_i·s_i = ⟨M, Σ w_i·u_i·v_iᵀ⟩: each s_i taken again as u_iᵀ·M·v_i, a Rayleigh quotient whose
    # error is second order in the float32 singular vectors', where the float32 values themselves
    # are off by ~1e-7 relative. The product's norm is taken too, so the result's is s̄·√(Σ w_i²)
    # however far float32 rounding took U and V from orthonormal.
    inner, sq_norm = _inner_and_sq_norm(matrix, product)
    if not sq_norm > 0.0:
        return matrix.zero_()
    mean = inner / float(w.sum())
    scale = mean * math.sqrt(float((w * w).sum()) / sq_norm)
    return matrix.copy_(product).mul_(scale)


def _refined(matrix: torch.Tensor, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    """The singular values in float64, those near the rank threshold taken again as u_iᵀ·M·v_i.

    A float32 SVD puts a small singular value off by ~ε·s₁ (times a modest factor), a sizeable
    share of the threshold's ramp (t = max(m, n)·ε·s₁ to 2t): the weight of such a direction, and
    with it s̄, would move by ~1e-6. The Rayleigh quotient is off by the square of the vectors'
    error instead. Values below t/2 cannot reach the ramp and keep weight 0."""
    s64 = s.double()
    if s64.numel() == 0 or not float(s64[0]) > 0.0:
        return s64
    tol = max(matrix.shape) * torch.finfo(torch.float32).eps * float(s64[0])
    near = ((s64 > tol / 2) & (s64 < 4 * tol)).nonzero().flatten()
    if near.numel() == 0:
        return s64
    uk, vk = u[:, near], vh[near]
    rows = max(1, _CHUNK // max(1, matrix.size(1)))
    x = torch.zeros(near.numel(), matrix.size(1), dtype=torch.float64, device=matrix.device)
    for start in range(0, matrix.size(0), rows):  # uₖᵀ·M in float64, a bounded band of rows at a time
        x.addmm_(uk[start : start + rows].double().t(), matrix[start : start + rows].double())
    s64 = s64.clone()
    s64[near] = (x * vk.double()).sum(dim=1)
    return s64


def _inner_and_sq_norm(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """⟨a, b⟩ and ‖b‖² of two float32 matrices of one shape, in float64, a bounded chunk at a time."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    inner = sq = 0.0
    for start in range(0, flat_b.numel(), _CHUNK):
        pa, pb = flat_a[start : start + _CHUNK].double(), flat_b[start : start + _CHUNK].double()
        inner += float(torch.dot(pa, pb))
        sq += float(torch.dot(pb, pb))
    return inner, sq
