"""HeLoCo delta correction against a hand-written float64 reference of the paper's rules."""

from __future__ import annotations

import math

import pytest
import torch

from syncer.merge import correction
from syncer.merge.correction import HelocoConfig, heloco_correct
from syncer.merge.merge import Segment, outer_gradient
from syncer.merge.outer import nesterov_step

pytestmark = pytest.mark.unit

CFG = HelocoConfig()


# ---- reference: the paper's pseudo-gradient Δ = −d, lists of Python floats ----------------------


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def ref_block(d: list[float], m: list[float], cfg: HelocoConfig) -> list[float]:
    delta = [-x for x in d]
    nd, nm = norm(delta), norm(m)
    if nd == 0 or nm == 0:
        return list(d)
    c = sum(x * y for x, y in zip(delta, m, strict=True)) / (nd * nm)
    conf = nd / (nd + cfg.kappa * cfg.momentum_scale * nm + cfg.eps)
    if c >= cfg.keep_threshold:
        hat = delta
    elif c < 0:
        beta = min(cfg.shrink_strength * -c * conf, cfg.shrink_cap)
        hat = [x - beta * c * nd * y / nm for x, y in zip(delta, m, strict=True)]
    else:
        lam = min(cfg.reorient_strength * (1 - c) * conf, 1.0)
        u = [(1 - lam) * x / nd + lam * y / nm for x, y in zip(delta, m, strict=True)]
        nu = max(norm(u), cfg.eps)
        hat = [nd * x / nu for x in u]
    return [-x for x in hat]


def ref_correct(d: list[float], m: list[float], segments: list[Segment], cfg: HelocoConfig) -> list[float]:
    out: list[float] = []
    for seg in segments:
        sl = slice(seg.offset, seg.offset + seg.numel)
        out += ref_block(d[sl], m[sl], cfg)
    return out


# ---- helpers -------------------------------------------------------------------------------------


def block(n: int, cos: float, ratio: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m) of length n whose paper cosine cos(−d, m) is ``cos`` and with ‖d‖ = ratio·‖m‖."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g, dtype=torch.float64)
    v = torch.randn(n, generator=g, dtype=torch.float64)
    m_hat = m / m.norm()
    v -= v.dot(m_hat) * m_hat
    v_hat = v / v.norm() if n > 1 else torch.zeros(1, dtype=torch.float64)
    d = -(cos * m_hat + math.sqrt(1 - cos * cos) * v_hat) * ratio * m.norm()
    return d.float(), m.float()


def paper_cos(d: torch.Tensor, m: torch.Tensor) -> float:
    d64, m64 = d.double(), m.double()
    return float(-d64.dot(m64) / (d64.norm() * m64.norm()))


def check_against_reference(d: torch.Tensor, m: torch.Tensor, segments: list[Segment],
                            cfg: HelocoConfig = CFG) -> torch.Tensor:
    got = heloco_correct(d, m, segments, cfg)
    want = torch.tensor(ref_correct(d.double().tolist(), m.double().tolist(), segments, cfg), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-7 * float(want.abs().max()))
    return got


def whole(n: int) -> list[Segment]:
    return [Segment(0, n, True)]


# ---- the three rules -----------------------------------------------------------------------------


def test_aligned_block_is_kept_bit_for_bit() -> None:
    d, m = block(300, 0.6, 1.0, 1)
    out = heloco_correct(d, m, whole(300), CFG)
    assert out is not d
    assert torch.equal(out.view(torch.int32), d.view(torch.int32))
    check_against_reference(d, m, whole(300))


@pytest.mark.parametrize(("cos", "ratio"), [(-0.7, 1.0), (-0.9, 20.0), (-0.05, 0.3)])
def test_anti_aligned_block_is_shrunk_along_the_momentum(cos: float, ratio: float) -> None:
    d, m = block(257, cos, ratio, 2)
    out = check_against_reference(d, m, whole(257))
    m_hat = m.double() / m.double().norm()
    along_before = float(d.double().dot(m_hat))
    along_after = float(out.double().dot(m_hat))
    # The opposing component loses the fraction β; the part orthogonal to m is untouched.
    conf = ratio / (ratio + 1.0)
    beta = min(-cos * conf, CFG.shrink_cap)
    assert along_after == pytest.approx((1 - beta) * along_before, rel=1e-5)
    ortho_before = d.double() - along_before * m_hat
    ortho_after = out.double() - along_after * m_hat
    torch.testing.assert_close(ortho_after, ortho_before, rtol=1e-5, atol=1e-6 * float(d.abs().max()))
    assert float(out.double().norm()) < float(d.double().norm())
    assert paper_cos(out, m) > cos


# The rules jump at c = 0 (shrink by β → 0 below, turn by λ = k_d·conf above), so no case sits
# within float32 rounding of it.
@pytest.mark.parametrize(("cos", "ratio"), [(0.01, 1.0), (0.1, 3.0), (0.19, 0.1)])
def test_weakly_aligned_block_is_reoriented_with_its_norm_kept(cos: float, ratio: float) -> None:
    d, m = block(513, cos, ratio, 3)
    out = check_against_reference(d, m, whole(513))
    assert float(out.double().norm()) == pytest.approx(float(d.double().norm()), rel=1e-6)
    assert paper_cos(out, m) > cos + 1e-3


def test_zero_momentum_or_zero_delta_passes_through_bit_for_bit() -> None:
    d, m = block(100, -0.8, 1.0, 4)
    segments = [Segment(0, 40, True), Segment(40, 60, False)]
    zero_m = torch.zeros(100)
    assert torch.equal(heloco_correct(d, zero_m, segments, CFG).view(torch.int32), d.view(torch.int32))
    m_half = m.clone()
    m_half[:40] = 0.0  # the first block has no reference, the second is anti-aligned
    out = heloco_correct(d, m_half, segments, CFG)
    assert torch.equal(out[:40].view(torch.int32), d[:40].view(torch.int32))
    assert not torch.equal(out[40:], d[40:])
    zero_d = torch.zeros(100)
    assert torch.equal(heloco_correct(zero_d, m, segments, CFG), zero_d)


def test_each_tensor_is_judged_on_its_own_and_in_place_matches() -> None:
    parts = [block(64, 0.5, 1.0, 5), block(33, -0.6, 2.0, 6), block(1, 1.0, 1.0, 7),
             block(128, 0.05, 0.5, 8), block(20, -0.99, 0.01, 9)]
    d = torch.cat([p[0] for p in parts])
    m = torch.cat([p[1] for p in parts])
    m[64 + 33 + 1 : 64 + 33 + 1 + 128 // 2] *= 1e-3  # uneven momentum inside one tensor
    sizes = [64, 33, 0, 1, 128, 20]
    segments, offset = [], 0
    for i, n in enumerate(sizes):
        segments.append(Segment(offset, n, i % 2 == 0))
        offset += n
    m_before = m.clone()
    got = check_against_reference(d, m, segments)
    assert torch.equal(got[:64], d[:64])  # the aligned first tensor
    in_place = d.clone()
    assert heloco_correct(in_place, m, segments, CFG, out=in_place) is in_place
    assert torch.equal(in_place.view(torch.int32), got.view(torch.int32))
    buf = torch.full_like(d, float("nan"))
    assert heloco_correct(d, m, segments, CFG, out=buf) is buf
    assert torch.equal(buf, got)
    assert torch.equal(m, m_before)


def test_momentum_scale_only_changes_the_confidence() -> None:
    d, m = block(200, -0.5, 0.5, 10)
    cfg = HelocoConfig(momentum_scale=0.1)
    loose = check_against_reference(d, m, whole(200), cfg)
    strict = heloco_correct(d, m, whole(200), CFG)
    # A smaller momentum weight raises the confidence, so more of the opposing part goes.
    m_hat = m.double() / m.double().norm()
    assert float(loose.double().dot(m_hat)) < float(strict.double().dot(m_hat))
    aligned_d, aligned_m = block(200, 0.9, 0.5, 11)
    assert torch.equal(heloco_correct(aligned_d, aligned_m, whole(200), cfg), aligned_d)


# ---- yeto's sign convention ----------------------------------------------------------------------


def test_sign_convention_against_the_syncers_own_momentum() -> None:
    # A learner pushes d; the syncer's outer gradient is −d, and Nesterov's momentum buffer takes it.
    g = torch.Generator().manual_seed(12)
    d_first = torch.randn(500, generator=g)
    param, momentum = torch.zeros(500), torch.zeros(500)
    nesterov_step(param, momentum, outer_gradient(d_first))
    segments = whole(500)
    # A later delta that keeps going the same way is progress: kept unchanged.
    same_way = d_first * 0.8 + 0.1 * torch.randn(500, generator=g)
    assert torch.equal(heloco_correct(same_way, momentum, segments, CFG), same_way)
    # One that walks the progress back opposes the momentum: shrunk, with less of it left.
    back = -same_way
    out = heloco_correct(back, momentum, segments, CFG)
    assert float(out.double().norm()) < float(back.double().norm())
    along = d_first.double() / d_first.double().norm()
    assert 0 > float(out.double().dot(along)) > float(back.double().dot(along))


def test_first_round_momentum_is_zero_so_nothing_changes() -> None:
    d, _ = block(50, -0.9, 1.0, 13)
    assert torch.equal(heloco_correct(d, torch.zeros(50), whole(50), CFG), d)


# ---- long tensors and errors ---------------------------------------------------------------------


def test_long_tensor_uses_chunked_accurate_products() -> None:
    n = 2 * correction._DOT_CHUNK + 12_345
    d, m = block(n, 0.1, 1.0, 14)
    segments = [Segment(0, 100, True), Segment(100, n - 100, True)]
    got = heloco_correct(d, m, segments, CFG)
    # float64 torch reference of the reorientation on the long tensor
    d64, m64 = d[100:].double(), m[100:].double()
    nd, nm = d64.norm(), m64.norm()
    c = float(-d64.dot(m64) / (nd * nm))
    conf = float(nd / (nd + nm + CFG.eps))
    lam = min(CFG.reorient_strength * (1 - c) * conf, 1.0)
    u = (1 - lam) * (-d64) / nd + lam * m64 / nm
    want = -(nd * u / u.norm())
    torch.testing.assert_close(got[100:].double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_refuses_bad_inputs_and_settings() -> None:
    d, m = torch.ones(10), torch.ones(10)
    with pytest.raises(ValueError, match="cover 9"):
        heloco_correct(d, m, [Segment(0, 9, True)], CFG)
    with pytest.raises(ValueError, match="offset"):
        heloco_correct(d, m, [Segment(0, 4, True), Segment(5, 5, True)], CFG)
    with pytest.raises(ValueError, match="momentum must match"):
        heloco_correct(d, torch.ones(11), whole(10), CFG)
    with pytest.raises(ValueError, match="1-D float32"):
        heloco_correct(d.double(), m, whole(10), CFG)
    with pytest.raises(ValueError, match="out must be"):
        heloco_correct(d, m, whole(10), CFG, out=torch.empty(9))
    for field, value in [("keep_threshold", 1.5), ("shrink_cap", -0.1), ("eps", 0.0),
                         ("momentum_scale", 0.0), ("kappa", float("nan"))]:
        with pytest.raises(ValueError, match=field):
            HelocoConfig(**{field: value})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    parts = [block(5000, 0.5, 1.0, 15), block(3000, -0.6, 2.0, 16), block(70_000, 0.05, 0.5, 17)]
    d = torch.cat([p[0] for p in parts])
    m = torch.cat([p[1] for p in parts])
    segments = [Segment(0, 5000, True), Segment(5000, 3000, True), Segment(8000, 70_000, False)]
    cpu = heloco_correct(d, m, segments, CFG)
    gpu = heloco_correct(d.cuda(), m.cuda(), segments, CFG)
    assert torch.equal(gpu[:5000].cpu(), d[:5000])
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-6)
