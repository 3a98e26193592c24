"""The isotropic merge (`--merge iso`): against a float64 SVD by hand, its degenerate cases, and in `merge_deltas`."""

from __future__ import annotations

import pytest
import torch

from syncer.core.links import backend_id
from syncer.merge.iso import direction_weights, isotropic_, spectrum_rank
from syncer.merge.merge import Segment, merge_deltas, rda
from syncer.merge.round_merge import fragment_segments
from yeto_core.layout import build_layout, specs_from_named_tensors
from yeto_core.sections import MergeSettings


def flat_spectrum_f64(update: torch.Tensor) -> torch.Tensor:
    """The reference: a float64 SVD; the directions weighted 0 at float32 rounding t of the largest
    singular value, 1 from 2t; the weighted mean of the singular values times Σ w_i·u_i·v_iᵀ."""
    u, s, vh = torch.linalg.svd(update.double(), full_matrices=False)
    if not s[0] > 0:
        return torch.zeros_like(update, dtype=torch.float64)
    tol = max(update.shape) * torch.finfo(torch.float32).eps * s[0]
    w = ((s - tol) / tol).clamp(0, 1)
    return (w * s).sum() / w.sum() * ((u * w) @ vh)


@pytest.mark.parametrize("shape", [(8, 5), (5, 8), (16, 16), (1, 7)])
def test_a_full_rank_update_gets_a_flat_spectrum_as_a_float64_svd_gives_it(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    update = torch.randn(shape, generator=g) * torch.logspace(0, 2, shape[1])  # a steep spectrum
    want = flat_spectrum_f64(update)
    got = isotropic_(update.clone())
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-5 * want.abs().max())
    s = torch.linalg.svdvals(got.double())
    assert torch.allclose(s, s.mean().expand_as(s), rtol=1e-5)  # every singular value equal
    # its norm: s̄·√r, accurate to float32 rounding
    assert abs(float(got.double().norm()) / float(want.norm()) - 1) < 1e-6


def test_a_rank_deficient_update_keeps_its_own_subspace() -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(12, 2, generator=g), torch.randn(2, 9, generator=g)
    update = (a * torch.tensor([10.0, 0.5])) @ b  # rank 2 of a 12 x 9 matrix
    got = isotropic_(update.clone())
    want = flat_spectrum_f64(update)
    assert spectrum_rank(torch.linalg.svdvals(update), (12, 9)) == 2
    assert torch.allclose(got.double(), want, atol=2e-5 * want.abs().max())
    s = torch.linalg.svdvals(got.double())
    assert s[2:].max() < 1e-5 * s[0] and abs(float(s[0] / s[1]) - 1) < 1e-5


def test_a_rank_one_update_is_returned_as_it_is_and_a_zero_update_stays_zero() -> None:
    g = torch.Generator().manual_seed(4)
    update = torch.outer(torch.randn(6, generator=g), torch.randn(4, generator=g))
    assert torch.allclose(isotropic_(update.clone()), update, rtol=1e-5, atol=1e-6)
    zero = torch.zeros(5, 3)
    assert torch.equal(isotropic_(zero), torch.zeros(5, 3))
    assert isotropic_(torch.zeros(0, 3)).shape == (0, 3)
    with pytest.raises(ValueError, match="float32 matrix"):
        isotropic_(torch.zeros(4))


def test_a_value_near_float32_rounding_fades_in_instead_of_jumping() -> None:
    shape = (100, 100)
    tol = 100 * torch.finfo(torch.float32).eps
    s = torch.tensor([1.0, 0.5, 1.5 * tol, 0.5 * tol], dtype=torch.float64)
    assert direction_weights(s, shape).tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0])
    assert spectrum_rank(s, shape) == 3
    assert direction_weights(torch.zeros(3), shape).tolist() == [0.0, 0.0, 0.0]


def test_merge_deltas_flattens_the_matrices_of_the_rda_update_and_leaves_the_rest() -> None:
    g = torch.Generator().manual_seed(5)
    deltas = torch.randn(3, 6 * 4 + 5 + 2 * 3, generator=g)
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    segments = [Segment(0, 24, rda=True, iso_shape=(6, 4)), Segment(24, 5, rda=True),
                Segment(29, 6, rda=False)]  # a matrix, a vector, a plainly averaged span
    for threads in (1, 2):
        got = merge_deltas(deltas, weights, segments, threads=threads)
        matrix = rda(deltas[:, :24], weights)
        assert torch.allclose(got[:24].view(6, 4).double(), flat_spectrum_f64(matrix.view(6, 4)), atol=2e-5)
        assert torch.equal(got[24:29], rda(deltas[:, 24:29], weights))
        assert torch.allclose(got[29:], (weights.float()[:, None] * deltas[:, 29:]).sum(0), atol=1e-6)
    assert torch.equal(merge_deltas(deltas, weights, segments, threads=1),
                       merge_deltas(deltas, weights, segments, threads=2))


def test_one_learner_gets_its_own_update_flattened() -> None:
    g = torch.Generator().manual_seed(6)
    delta = torch.randn(1, 20, generator=g)
    got = merge_deltas(delta, torch.ones(1, dtype=torch.float64), [Segment(0, 20, rda=True, iso_shape=(4, 5))])
    assert torch.allclose(got.view(4, 5).double(), flat_spectrum_f64(delta.view(4, 5)), atol=2e-5)


def test_iso_segments_are_the_non_embedding_matrices_and_name_the_backend() -> None:
    named = [("embed.weight", torch.zeros(10, 4)), ("layer.weight", torch.zeros(4, 4)), ("layer.bias", torch.zeros(4)),
             ("conv.weight", torch.zeros(2, 2, 2))]
    layout = build_layout(specs_from_named_tensors(named, {"embed.weight"}), 1, "binpack")
    (segments,) = fragment_segments(layout, "iso")
    by_offset = {seg.offset: seg for seg in segments}
    slots = {s.name: s for s in layout.fragments[0].slots}
    assert by_offset[slots["layer.weight"].offset].iso_shape == (4, 4)
    assert by_offset[slots["layer.weight"].offset].rda
    assert by_offset[slots["layer.bias"].offset].iso_shape is None and by_offset[slots["layer.bias"].offset].rda
    assert by_offset[slots["conv.weight"].offset].iso_shape is None
    assert by_offset[slots["embed.weight"].offset].iso_shape is None and by_offset[slots["embed.weight"].offset].rda
    assert all(seg.iso_shape is None for seg in fragment_segments(layout, "rda")[0])
    assert backend_id(MergeSettings(merge="iso")) != backend_id(MergeSettings(merge="rda"))
    assert backend_id(MergeSettings(merge="iso")).startswith("iso-")


@pytest.mark.parametrize("ramp", [0.1, 0.5, 0.9])
def test_a_direction_on_the_threshold_ramp_is_weighed_by_its_float64_singular_value(
        ramp: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A singular value between t and 2t (t the float32 rounding of the largest) has a weight
    between 0 and 1, and a float32 SVD misplaces it by a good share of the ramp: the result's
    norm must still be the float64 one to ~1e-7, not ~1e-4 (what the float32 value gives)."""
    n = 64
    g = torch.Generator().manual_seed(int(ramp * 10))
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    s = torch.linspace(1.0, 0.5, n, dtype=torch.float64)
    tol = n * torch.finfo(torch.float32).eps
    s[-1] = tol * (1 + ramp)  # on the ramp
    update = ((u * s) @ v.t()).float()
    want = float(flat_spectrum_f64(update).norm())
    got = float(isotropic_(update.clone()).double().norm())
    assert abs(got / want - 1) < 3e-7, (got, want)
