"""Outer optimizers: Nesterov is ``nesterov_step``; delayed Nesterov against a hand-written
float64 reference of its algorithm (plain Python loops)."""

from __future__ import annotations

import pytest
import torch

from syncer.merge.outer import (
    ACCUM_KEY,
    COUNT_KEY,
    STEPS_KEY,
    DelayedNesterov,
    Nesterov,
    OuterOptimizer,
    OuterState,
    make_outer_optimizer,
    nesterov_step,
    warmed_momentum,
)

pytestmark = pytest.mark.unit


def grads(steps: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(steps)]


def start(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1


def ref_delayed_nesterov(
    param: list[float], mom: list[float], gs: list[list[float]], lr: float, mu: float, n: int, c: float
) -> tuple[list[float], list[float]]:
    """Algorithm 3 of arXiv:2401.09135, written out element by element."""
    p, m = list(param), list(mom)
    acc = [0.0] * len(p)
    for t, g in enumerate(gs):
        acc = [a + x for a, x in zip(acc, g, strict=True)]
        if (t + 1) % n == 0:
            m = [mu * b + a / n for b, a in zip(m, acc, strict=True)]
            p = [w - lr * ((1 - c * n + c) * mu * b + x / n) for w, b, x in zip(p, m, g, strict=True)]
            acc = [0.0] * len(p)
        else:
            p = [w - lr * (c * mu * b + x / n) for w, b, x in zip(p, m, g, strict=True)]
    return p, m


def run(opt: OuterOptimizer, param: torch.Tensor, mom: torch.Tensor, gs: list[torch.Tensor],
        state: OuterState | None = None) -> OuterState:
    state = {} if state is None else state
    for g in gs:
        opt.step(param, mom, g, state)
    return state


def test_nesterov_is_nesterov_step_bit_for_bit() -> None:
    gs = grads(5, 1000, 1)
    p1, m1 = start(1000, 2)
    p2, m2 = p1.clone(), m1.clone()
    run(Nesterov(lr=0.7, momentum=0.9), p1, m1, gs)
    for g in gs:
        nesterov_step(p2, m2, g, lr=0.7, momentum_coef=0.9)
    assert torch.equal(p1, p2) and torch.equal(m1, m2)


@pytest.mark.parametrize("c", [0.0, 0.2, 1 / 3])
def test_delayed_nesterov_matches_reference_over_seven_steps(c: float) -> None:
    n_elems, steps, delay, lr, mu = 64, 7, 3, 0.7, 0.9
    gs = grads(steps, n_elems, 3)
    p, m = start(n_elems, 4)
    want_p, want_m = ref_delayed_nesterov(p.double().tolist(), m.double().tolist(),
                                          [g.double().tolist() for g in gs], lr, mu, delay, c)
    state = run(DelayedNesterov(lr=lr, momentum=mu, delay=delay, activation=c), p, m, gs)
    torch.testing.assert_close(p.double(), torch.tensor(want_p, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.double(), torch.tensor(want_m, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    # 7 = 2 windows of 3 + 1: the accumulator holds exactly the seventh gradient.
    assert state[COUNT_KEY] == 1
    assert torch.equal(state[ACCUM_KEY], torch.zeros(n_elems) + gs[6])


def test_delayed_nesterov_moves_momentum_only_at_the_end_of_a_window() -> None:
    gs = grads(6, 32, 5)
    p, m = start(32, 6)
    m0 = m.clone()
    opt = DelayedNesterov(lr=0.5, momentum=0.9, delay=3)
    state: OuterState = {}
    seen = []
    for g in gs:
        opt.step(p, m, g, state)
        seen.append(m.clone())
    assert torch.equal(seen[0], m0) and torch.equal(seen[1], m0)
    assert not torch.equal(seen[2], m0)
    assert torch.equal(seen[3], seen[2]) and torch.equal(seen[4], seen[2])
    assert not torch.equal(seen[5], seen[2])
    assert state[COUNT_KEY] == 0 and torch.equal(state[ACCUM_KEY], torch.zeros(32))


def test_delayed_nesterov_window_equals_one_nesterov_step_on_the_mean_gradient() -> None:
    # With c = 0 a whole window moves the parameters like one Nesterov step on the window mean.
    gs = [g.double() for g in grads(4, 50, 7)]
    p, m = (t.double() for t in start(50, 8))
    p2, m2 = p.clone(), m.clone()
    run(DelayedNesterov(lr=0.7, momentum=0.9, delay=4), p, m, gs)
    nesterov_step(p2, m2, sum(gs) / 4, lr=0.7, momentum_coef=0.9)
    torch.testing.assert_close(p, p2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m, m2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("c", [0.0, 0.5, 1.0])
def test_delayed_nesterov_with_delay_one_is_nesterov_bit_for_bit(c: float) -> None:
    # N = 1: every step ends a window; m ← μm + g, param ← param − lr(μm + g) whatever c is.
    gs = grads(7, 1000, 9)
    p1, m1 = start(1000, 10)
    p2, m2 = p1.clone(), m1.clone()
    state = run(DelayedNesterov(lr=0.7, momentum=0.9, delay=1, activation=c), p1, m1, gs)
    run(Nesterov(lr=0.7, momentum=0.9), p2, m2, gs)
    assert torch.equal(p1, p2) and torch.equal(m1, m2)
    assert ACCUM_KEY not in state and state[COUNT_KEY] == 0


def test_delayed_nesterov_resumes_from_a_stored_state() -> None:
    gs = grads(7, 40, 11)
    p1, m1 = start(40, 12)
    p2, m2 = p1.clone(), m1.clone()
    opt = DelayedNesterov(lr=0.7, momentum=0.9, delay=3)
    run(opt, p1, m1, gs)
    state = run(opt, p2, m2, gs[:4])
    stored: OuterState = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    run(DelayedNesterov(lr=0.7, momentum=0.9, delay=3), p2, m2, gs[4:], stored)
    assert torch.equal(p1, p2) and torch.equal(m1, m2)


def test_delayed_nesterov_refuses_bad_state_and_settings() -> None:
    p, m = start(8, 13)
    g = torch.ones(8)
    opt = DelayedNesterov(delay=3)
    with pytest.raises(ValueError, match="count"):
        opt.step(p, m, g, {COUNT_KEY: 3})
    with pytest.raises(ValueError, match="accum"):
        opt.step(p, m, g, {ACCUM_KEY: torch.zeros(9)})
    with pytest.raises(ValueError, match="shapes differ"):
        opt.step(p, m, torch.ones(9), {})
    with pytest.raises(ValueError, match="delay"):
        DelayedNesterov(delay=0)
    with pytest.raises(ValueError, match="activation"):
        DelayedNesterov(delay=4, activation=0.3)
    with pytest.raises(ValueError, match="momentum"):
        Nesterov(momentum=1.0)
    with pytest.raises(ValueError, match="lr"):
        Nesterov(lr=0.0)


def test_make_outer_optimizer() -> None:
    assert make_outer_optimizer("nesterov", lr=0.5, momentum=0.8, delay=5) == Nesterov(lr=0.5, momentum=0.8)
    assert make_outer_optimizer("delayed-nesterov", lr=0.5, momentum=0.8, delay=5) == DelayedNesterov(
        lr=0.5, momentum=0.8, delay=5)
    assert make_outer_optimizer("nesterov", lr=0.5, momentum=0.8, warmup=3) == Nesterov(
        lr=0.5, momentum=0.8, warmup=3)
    assert make_outer_optimizer("delayed-nesterov", lr=0.5, momentum=0.8, delay=2, warmup=3) == DelayedNesterov(
        lr=0.5, momentum=0.8, delay=2, warmup=3)
    with pytest.raises(ValueError, match="accepted: nesterov, delayed-nesterov"):
        make_outer_optimizer("adam", lr=0.5, momentum=0.8, delay=1)


@pytest.mark.parametrize("opt", [Nesterov(lr=0.5, momentum=0.5), Nesterov(lr=3.0, momentum=0.95),
                                 DelayedNesterov(lr=0.7, momentum=0.9, delay=3),
                                 DelayedNesterov(lr=2.0, momentum=0.8, delay=4, activation=0.25),
                                 Nesterov(lr=0.5, momentum=0.5, warmup=4),
                                 DelayedNesterov(lr=2.0, momentum=0.8, delay=2, activation=0.25, warmup=3)],
                         ids=["nesterov", "nesterov-big", "delayed", "delayed-active", "warm", "delayed-warm"])
def test_the_bound_covers_every_value_a_step_writes(opt: OuterOptimizer) -> None:
    # One step at a time from the same inputs, so the bound (which sees each step's inputs) applies.
    p, m = start(64, 2)
    state: OuterState = {}
    for t, g in enumerate(grads(7, 64, 9)):
        state[STEPS_KEY] = t
        accum = state.get(ACCUM_KEY)
        bound = opt.bound(param=float(p.abs().max()), momentum=float(m.abs().max()), grad=float(g.abs().max()),
                          accum=float(accum.abs().max()) if isinstance(accum, torch.Tensor) else 0.0)
        before = (p.clone(), m.clone())
        opt.step(p, m, g, state)
        top = max(float(p.abs().max()), float(m.abs().max()),
                  *(float(v.abs().max()) for v in state.values() if isinstance(v, torch.Tensor)))
        assert top <= bound
        # and it is not a wild overestimate: within the ratio of L-inf sums to the true maximum
        assert bound < 50 * max(top, float(before[0].abs().max()))


def test_the_nesterov_bound_by_hand() -> None:
    # m' <= 0.5·2 + 4 = 5; step <= 4 + 0.5·5 = 6.5; lr·step = 3.25; p' <= 1 + 3.25 = 4.25
    assert Nesterov(lr=0.5, momentum=0.5).bound(param=1.0, momentum=2.0, grad=4.0) == 6.5
    assert Nesterov(lr=2.0, momentum=0.5).bound(param=100.0, momentum=2.0, grad=4.0) == 113.0


def test_the_momentum_warms_up_linearly_then_holds() -> None:
    assert [warmed_momentum(0.5, 4, k) for k in range(7)] == [0.0, 0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    assert [warmed_momentum(0.9, 0, k) for k in range(3)] == [0.9, 0.9, 0.9]
    assert warmed_momentum(0.0, 4, 1) == 0.0


def test_warmed_nesterov_is_nesterov_step_with_the_warmed_coefficient_bit_for_bit() -> None:
    p, m = start(33, 4)
    ref_p, ref_m = p.clone(), m.clone()
    opt = Nesterov(lr=0.5, momentum=0.5, warmup=4)
    for t, g in enumerate(grads(7, 33, 5)):
        opt.step(p, m, g, {STEPS_KEY: t})
        nesterov_step(ref_p, ref_m, g, lr=0.5, momentum_coef=0.5 * min(1.0, t / 4))
        assert torch.equal(p, ref_p) and torch.equal(m, ref_m)


def test_without_a_step_count_the_warmup_starts_from_zero_momentum() -> None:
    p, m = start(8, 1)
    ref_p, ref_m = p.clone(), m.clone()
    g = grads(1, 8, 2)[0]
    Nesterov(lr=0.5, momentum=0.5, warmup=4).step(p, m, g, {})
    nesterov_step(ref_p, ref_m, g, lr=0.5, momentum_coef=0.0)
    assert torch.equal(p, ref_p) and torch.equal(m, ref_m)


def test_warmed_delayed_nesterov_with_delay_one_is_warmed_nesterov_bit_for_bit() -> None:
    p1, m1 = start(21, 6)
    p2, m2 = p1.clone(), m1.clone()
    a, b = Nesterov(lr=0.7, momentum=0.9, warmup=3), DelayedNesterov(lr=0.7, momentum=0.9, delay=1, warmup=3)
    s1: OuterState = {}
    s2: OuterState = {}
    for t, g in enumerate(grads(6, 21, 7)):
        s1[STEPS_KEY] = s2[STEPS_KEY] = t
        a.step(p1, m1, g, s1)
        b.step(p2, m2, g, s2)
        assert torch.equal(p1, p2) and torch.equal(m1, m2)


def test_warmed_delayed_nesterov_uses_the_step_counts_coefficient_at_each_move() -> None:
    # delay 2, warm-up over 4 steps: moves at steps 1 and 3 use μ·1/4 and μ·3/4.
    mu, lr = 0.8, 1.0
    p, m = torch.zeros(1), torch.zeros(1)
    opt = DelayedNesterov(lr=lr, momentum=mu, delay=2, warmup=4)
    state: OuterState = {}
    for t, g in enumerate([1.0, 1.0, 1.0, 1.0]):
        state[STEPS_KEY] = t
        opt.step(p, m, torch.tensor([g]), state)
    # each step moves θ by −(lr/2)·g, a move adds −(lr/2)·2·μ_t·m: m = 0.2·0 + 1 = 1 at step 1,
    # m = 0.6·1 + 1 = 1.6 at step 3; θ = −(0.5 + 0.5·(1 + 0.4) + 0.5 + 0.5·(1 + 1.92))
    assert m.item() == pytest.approx(1.6)
    assert p.item() == pytest.approx(-(0.5 + 0.7 + 0.5 + 1.46))


def test_a_bad_step_count_or_warmup_is_refused() -> None:
    with pytest.raises(ValueError, match=r"outer\.steps"):
        Nesterov(warmup=2).step(torch.zeros(2), torch.zeros(2), torch.zeros(2), {STEPS_KEY: -1})
    with pytest.raises(ValueError, match=r"outer\.steps"):
        DelayedNesterov(delay=2, warmup=2).step(torch.zeros(2), torch.zeros(2), torch.zeros(2), {STEPS_KEY: 1.5})
    with pytest.raises(ValueError, match="warmup"):
        Nesterov(warmup=-1)
    with pytest.raises(ValueError, match="warmup"):
        DelayedNesterov(warmup=True)
