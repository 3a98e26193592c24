"""The syncer's merge math against hand-written float64 references (plain Python loops)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from syncer.merge import merge
from syncer.merge.merge import (
    Segment,
    accurate_norm,
    check_finite,
    learner_weights,
    merge_deltas,
    outer_gradient,
    rda,
    weighted_average,
)
from syncer.merge.outer import nesterov_step

pytestmark = pytest.mark.unit

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---- references: lists of Python floats, float64 arithmetic --------------------------------------


def ref_weights(tokens: list[int], steps: list[int]) -> list[float]:
    raw = [t * t / s for t, s in zip(tokens, steps, strict=True)]
    total = sum(raw)
    if total == 0:
        return [1.0 / len(raw)] * len(raw)
    return [r / total for r in raw]


def ref_norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def ref_average(rows: list[list[float]], w: list[float]) -> list[float]:
    n = len(rows[0])
    return [sum(w[m] * rows[m][i] for m in range(len(rows))) for i in range(n)]


def ref_rda(rows: list[list[float]], w: list[float]) -> list[float]:
    n = len(rows[0])
    u = [0.0] * n
    r = 0.0
    for row, wm in zip(rows, w, strict=True):
        norm = ref_norm(row)
        r += wm * norm
        if norm > 0:
            for i in range(n):
                u[i] += wm * row[i] / norm
    u_norm = ref_norm(u)
    if u_norm == 0 or r == 0:
        return [0.0] * n
    return [r * x / u_norm for x in u]


def ref_merge(rows: list[list[float]], w: list[float], segments: list[Segment]) -> list[float]:
    out: list[float] = []
    for seg in segments:
        cols = [row[seg.offset : seg.offset + seg.numel] for row in rows]
        out += ref_rda(cols, w) if seg.rda else ref_average(cols, w)
    return out


def ref_nesterov(
    param: list[float], mom: list[float], grad: list[float], lr: float, mu: float
) -> tuple[list[float], list[float]]:
    new_mom = [mu * b + g for b, g in zip(mom, grad, strict=True)]
    new_param = [p - lr * (g + mu * b) for p, g, b in zip(param, grad, new_mom, strict=True)]
    return new_param, new_mom


def rand_rows(rng: random.Random, m: int, n: int) -> list[list[float]]:
    return [[rng.gauss(0.0, 1.0) for _ in range(n)] for _ in range(m)]


def t32(rows: list[list[float]] | list[float], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, device=device)


def as64(rows: torch.Tensor) -> list[list[float]]:
    # The reference sees exactly the float32 values the code under test sees.
    return rows.double().cpu().tolist()


def close(got: torch.Tensor, want: list[float], rtol: float = 2e-6, atol: float = 1e-7) -> None:
    torch.testing.assert_close(got.double().cpu(), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=atol)


# ---- learner weights --------------------------------------------------------------------------------


def test_learner_weights_match_hand_computation() -> None:
    # raw: 100²/10 = 1000, 200²/40 = 1000, 300²/45 = 2000 -> 1/4, 1/4, 1/2
    w = learner_weights([100, 200, 300], [10, 40, 45])
    assert w.dtype == torch.float64 and w.device.type == "cpu"
    assert w.tolist() == pytest.approx([0.25, 0.25, 0.5], rel=1e-15)
    tokens, steps = [7, 0, 123_456_789, 42], [3, 5, 1000, 1]
    assert learner_weights(tokens, steps).tolist() == pytest.approx(ref_weights(tokens, steps), rel=1e-14)


def test_learner_weights_share_the_total_with_learners_that_finished() -> None:
    # raw 1000, 1000 and 2000 as above; finished learners standing for 4000 halve every weight
    w = learner_weights([100, 200, 300], [10, 40, 45], finished=4000.0)
    assert w.tolist() == pytest.approx([0.125, 0.125, 0.25], rel=1e-15)
    assert learner_weights([100], [10], [3], finished=250.0).tolist() == pytest.approx([0.5])  # 1000/4 stale
    same = learner_weights([7, 11], [3, 5], [1, 0], finished=0.0)
    assert torch.equal(same, learner_weights([7, 11], [3, 5], [1, 0]))  # no one finished: the same bits
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="finished learners' weight"):
            learner_weights([1, 2], [1, 1], finished=bad)


def test_learner_weights_one_silent_learner_gets_zero() -> None:
    assert learner_weights([0, 50], [4, 2]).tolist() == [0.0, 1.0]


def test_learner_weights_fall_back_to_equal_without_tokens() -> None:
    assert learner_weights([0, 0, 0, 0], [1, 7, 3, 2]).tolist() == [0.25] * 4


@pytest.mark.parametrize("steps", [[3, 0, 2], [3, 1, -4]])
def test_learner_weights_refuse_bad_steps(steps: list[int]) -> None:
    bad = next(i for i, s in enumerate(steps) if s < 1)
    with pytest.raises(ValueError, match=f"learner {bad} reported {steps[bad]} steps"):
        learner_weights([10, 10, 10], steps)


def test_learner_weights_refuse_negative_tokens_and_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="learner 1 reported -5 tokens"):
        learner_weights([1, -5], [1, 1])
    with pytest.raises(ValueError, match="2 token counts, 3 step counts, 2 ages"):
        learner_weights([1, 2], [1, 1, 1], [0, 0])
    with pytest.raises(ValueError, match="no learners"):
        learner_weights([], [])
    with pytest.raises(ValueError, match="learner 0 has age -1"):
        learner_weights([1, 2], [1, 1], [-1, 0])


def test_a_stale_answer_is_damped_by_one_plus_its_age() -> None:
    fresh = learner_weights([100, 100, 200], [10, 10, 20])  # the third: two rounds' steps and tokens
    assert fresh.tolist() == pytest.approx([0.25, 0.25, 0.5])
    aged = learner_weights([100, 100, 200], [10, 10, 20], [0, 0, 1])  # ... because it missed one commit
    assert aged.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert learner_weights([100, 100], [10, 10], [0, 0]).tolist() == learner_weights([100, 100], [10, 10]).tolist()


# ---- norms --------------------------------------------------------------------------------------


def test_accurate_norm_matches_float64_on_2_24_elements() -> None:
    gen = torch.Generator().manual_seed(0)
    # A shared offset makes every square positive and same-signed: the worst case for fp32 sums.
    x = torch.randn(1 << 24, generator=gen) * 0.01 + 0.003
    want = math.sqrt(float(x.double().square().sum()))
    got = accurate_norm(x)
    assert abs(got - want) / want < 1e-6
    assert isinstance(got, float)


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 16 * 3 + 7])
def test_accurate_norm_block_and_tail_paths(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "_NORM_BLOCK", 16)
    v = [random.Random(n).uniform(-2, 2) for _ in range(n)]
    assert accurate_norm(t32(v)) == pytest.approx(ref_norm(as64(t32([v]))[0]), rel=1e-6, abs=0)


def test_accurate_norm_of_a_strided_view() -> None:
    base = torch.arange(12, dtype=torch.float32)
    assert accurate_norm(base[::3]) == pytest.approx(ref_norm([0.0, 3.0, 6.0, 9.0]), rel=1e-7)
    with pytest.raises(ValueError, match="1-D"):
        accurate_norm(base.view(3, 4))


# ---- RDA and the weighted average ----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 2, 3])
def test_rda_matches_reference(m: int, device: str) -> None:
    rng = random.Random(m)
    rows = t32(rand_rows(rng, m, 37), device)
    w = learner_weights([rng.randint(1, 1000) for _ in range(m)], [rng.randint(1, 50) for _ in range(m)])
    got = rda(rows, w)
    assert got.dtype == torch.float32 and got.device == rows.device
    close(got, ref_rda(as64(rows), w.tolist()))


def test_rda_single_learner_returns_its_delta() -> None:
    rows = t32(rand_rows(random.Random(9), 1, 50))
    close(rda(rows, torch.tensor([1.0], dtype=torch.float64)), as64(rows)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_rda_zero_row_gives_no_direction_but_counts_in_the_radius(device: str) -> None:
    rows = rand_rows(random.Random(3), 3, 20)
    rows[1] = [0.0] * 20
    x = t32(rows, device)
    w = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    got = rda(x, w)
    close(got, ref_rda(as64(x), w.tolist()))
    # The radius is 0.2‖δ0‖ + 0.3‖δ2‖: the zero row's weight is not handed to the others.
    radius = 0.2 * ref_norm(as64(x)[0]) + 0.3 * ref_norm(as64(x)[2])
    assert accurate_norm(got.cpu()) == pytest.approx(radius, rel=1e-6)


def test_rda_restores_the_norm_of_orthogonal_steps() -> None:
    rows = t32([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    plain = weighted_average(rows, w)
    merged = rda(rows, w)
    assert accurate_norm(plain) == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    assert accurate_norm(merged) == pytest.approx(1.0, rel=1e-6)
    close(merged, [1 / math.sqrt(2), 1 / math.sqrt(2), 0.0])


def test_rda_of_opposite_or_all_zero_rows_is_zero() -> None:
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    opposite = rda(t32([[1.0, -2.0, 3.0], [-1.0, 2.0, -3.0]]), w)
    assert torch.equal(opposite, torch.zeros(3))
    assert torch.equal(rda(torch.zeros(2, 4), w), torch.zeros(4))


@pytest.mark.parametrize("device", DEVICES)
def test_rda_of_exactly_opposite_long_rows_is_zero_not_rounding_noise(device: str) -> None:
    row = torch.randn(5000, generator=torch.Generator().manual_seed(1)).to(device)
    got = rda(torch.stack([row, -row]), torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert torch.count_nonzero(got) == 0


def test_rda_keeps_a_small_but_real_direction() -> None:
    rows = t32([[1.0, 0.0], [-1.0, 1e-3]])  # directions nearly cancel; the residual is real
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    got = rda(rows, w)
    close(got, ref_rda(as64(rows), w.tolist()), rtol=1e-3, atol=1e-4)  # u[0] is float32 rounding
    assert accurate_norm(got) == pytest.approx(0.5 + 0.5 * math.hypot(1.0, 1e-3), rel=1e-6)


def test_rda_on_column_slices_and_long_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small block and chunk sizes drive the blocked norm and the chunked CPU sum with tails.
    monkeypatch.setattr(merge, "_NORM_BLOCK", 8)
    monkeypatch.setattr(merge, "_CPU_CHUNK", 7)
    rng = random.Random(11)
    wide = t32(rand_rows(rng, 3, 90))
    cols = wide[:, 13:13 + 61]
    w = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    close(rda(cols, w), ref_rda(as64(cols), w.tolist()))
    close(weighted_average(cols, w), ref_average(as64(cols), w.tolist()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_weighted_average_matches_reference(m: int, device: str) -> None:
    rng = random.Random(100 + m)
    rows = t32(rand_rows(rng, m, 33), device)
    w = learner_weights([rng.randint(1, 100) for _ in range(m)], [1] * m)
    got = weighted_average(rows, w)
    assert got.dtype == torch.float32 and got.device == rows.device
    close(got, ref_average(as64(rows), w.tolist()))


def test_out_buffers_are_written_in_place_and_checked() -> None:
    rows = t32(rand_rows(random.Random(5), 2, 10))
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    out = torch.empty(10)
    assert rda(rows, w, out=out) is out
    assert weighted_average(rows, w, out=out) is out
    with pytest.raises(ValueError, match="out must be a float32"):
        rda(rows, w, out=torch.empty(9))
    with pytest.raises(ValueError, match="weights for 2 learners"):
        rda(rows, torch.ones(3, dtype=torch.float64) / 3)
    with pytest.raises(ValueError, match="float32"):
        weighted_average(rows.double(), w)
    with pytest.raises(ValueError, match="M >= 1"):
        rda(torch.zeros(0, 10), torch.zeros(0, dtype=torch.float64))


# ---- a fragment: segments -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_merge_deltas_mixes_rda_and_averaging_segments(device: str) -> None:
    segments = [Segment(0, 12, True), Segment(12, 30, False), Segment(42, 0, True), Segment(42, 9, True)]
    rng = random.Random(21)
    rows = t32(rand_rows(rng, 3, 51), device)
    w = learner_weights([300, 120, 80], [10, 4, 2])
    got = merge_deltas(rows, w, segments)
    assert got.shape == (51,) and got.dtype == torch.float32 and got.device == rows.device
    want = ref_merge(as64(rows), w.tolist(), segments)
    close(got, want)
    # Each segment is merged on its own: not the RDA of the whole row, nor its plain average.
    assert not torch.allclose(got.cpu(), rda(rows, w).cpu(), atol=1e-4)
    assert not torch.allclose(got.cpu(), weighted_average(rows, w).cpu(), atol=1e-4)


def test_merge_deltas_into_a_preallocated_buffer() -> None:
    rows = t32(rand_rows(random.Random(2), 2, 8))
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    out = torch.full((8,), float("nan"))
    assert merge_deltas(rows, w, [Segment(0, 3, False), Segment(3, 5, True)], out) is out
    close(out, ref_merge(as64(rows), w.tolist(), [Segment(0, 3, False), Segment(3, 5, True)]))


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([Segment(0, 4, True), Segment(5, 3, True)], "segment 1 is at offset 5"),
        ([Segment(0, 4, True), Segment(3, 5, True)], "segment 1 is at offset 3"),
        ([Segment(0, 4, True)], "segments cover 4 elements, the fragment has 8"),
        ([Segment(0, 4, True), Segment(4, 6, False)], "segments cover 10 elements"),
    ],
)
def test_merge_deltas_refuses_bad_segments(segments: list[Segment], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        merge_deltas(torch.zeros(2, 8), torch.tensor([0.5, 0.5]), segments)


# ---- refusing a bad push ----------------------------------------------------------------------------


def test_check_finite() -> None:
    x = torch.randn(4, 100)
    assert check_finite(x) is None
    y = x.clone()
    y[2, 17] = float("nan")
    y[3, 1] = float("inf")
    assert check_finite(y) == 2
    z = x.clone()
    z[1, 99] = float("-inf")
    assert check_finite(z) == 1


def test_check_finite_tells_overflowing_sums_from_bad_values() -> None:
    big = torch.full((2, 8), 3e38)  # every row sum overflows to inf, yet every value is finite
    assert check_finite(big) is None
    big[1, 7] = float("nan")
    assert check_finite(big) == 1


# ---- the outer step ---------------------------------------------------------------------------------


def test_outer_gradient_is_the_negated_delta() -> None:
    d = torch.tensor([1.5, -2.0, 0.0])
    assert outer_gradient(d).tolist() == [-1.5, 2.0, -0.0]
    out = torch.empty(3)
    assert outer_gradient(d, out=out) is out and out.tolist() == [-1.5, 2.0, -0.0]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize(("lr", "mu"), [(0.7, 0.9), (0.35, 0.5)])
def test_nesterov_step_equals_torch_sgd_bit_for_bit(lr: float, mu: float, foreach: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(1000, generator=gen)
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([ref], lr=lr, momentum=mu, nesterov=True, dampening=0, foreach=foreach)
    param, momentum, scratch = start.clone(), torch.zeros(1000), torch.empty(1000)
    for step in range(6):
        grad = torch.randn(1000, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        nesterov_step(param, momentum, grad, lr, mu, scratch=scratch if step % 2 else None)
        assert torch.equal(param, ref.detach()), f"step {step}"
        assert torch.equal(momentum, opt.state[ref]["momentum_buffer"]), f"step {step}"


def test_nesterov_step_equals_hand_formula() -> None:
    rng = random.Random(4)
    p32, m32 = t32([rng.gauss(0, 1) for _ in range(16)]), torch.zeros(16)
    param, mom = as64(p32[None])[0], [0.0] * 16
    for _ in range(5):
        grad = t32([rng.gauss(0, 1) for _ in range(16)])
        nesterov_step(p32, m32, grad)  # defaults: lr 0.7, momentum 0.9
        param, mom = ref_nesterov(param, mom, as64(grad[None])[0], 0.7, 0.9)
        close(m32, mom, rtol=1e-6, atol=1e-6)
        close(p32, param, rtol=1e-6, atol=1e-6)


def test_nesterov_step_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        nesterov_step(torch.zeros(3), torch.zeros(4), torch.zeros(3))


# ---- a whole round ----------------------------------------------------------------------------------


def test_two_learner_rounds_end_to_end() -> None:
    """Learners push θ − anchor; the syncer weighs, merges, negates and takes Nesterov steps."""
    rng = random.Random(2024)
    gen = torch.Generator().manual_seed(2024)
    segments = [Segment(0, 6, True), Segment(6, 4, False), Segment(10, 5, True)]
    n = 15
    global_param = t32([rng.gauss(0, 1) for _ in range(n)])
    momentum = torch.zeros(n)
    ref_param, ref_mom = as64(global_param[None])[0], [0.0] * n
    for round_ in range(3):
        anchor = global_param.clone()
        # Each learner trains from the anchor; one of them reports twice the tokens per step.
        local = [anchor + 0.01 * torch.randn(n, generator=gen) for _ in range(2)]
        deltas = torch.stack([theta - anchor for theta in local])
        tokens, steps = [4096 * 24, 2 * 4096 * 24], [24, 24]
        assert check_finite(deltas) is None
        w = learner_weights(tokens, steps)
        merged = merge_deltas(deltas, w, segments)
        nesterov_step(global_param, momentum, outer_gradient(merged))

        w_ref = ref_weights(tokens, steps)
        assert w_ref == pytest.approx([0.2, 0.8], rel=1e-15)
        rows = as64(deltas)
        merged_ref = ref_merge(rows, w_ref, segments)
        grad_ref = [-x for x in merged_ref]
        ref_param, ref_mom = ref_nesterov(ref_param, ref_mom, grad_ref, 0.7, 0.9)
        close(merged, merged_ref)
        close(momentum, ref_mom, rtol=1e-5, atol=1e-7)
        close(global_param, ref_param, rtol=1e-5, atol=1e-6)
        if round_ == 0:
            # With no momentum yet, the global moves along the learners' progress, 0.7·1.9 as far.
            close(global_param - anchor, [1.33 * x for x in merged_ref], rtol=1e-4, atol=1e-7)
