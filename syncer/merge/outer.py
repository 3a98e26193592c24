"""Outer optimizers behind one interface: Nesterov and delayed Nesterov (DESIGN §5.3).

An outer optimizer turns a fragment's outer gradient g (``merge.outer_gradient``: the negated
merged delta) into an in-place update of the fragment's flat parameter buffer and its momentum
buffer. Whatever else it must remember between rounds lives in a per-fragment ``state`` dict of
tensors and ints, which the caller keeps next to the momentum and a checkpoint can store as is.

- ``Nesterov``: DiLoCo's SGD with Nesterov momentum, ``nesterov_step`` unchanged.
- ``DelayedNesterov``: delayed Nesterov momentum from "Asynchronous Local-SGD Training for
  Language Modeling" (arXiv:2401.09135, Algorithm 3), for a syncer that steps once per push: the
  momentum moves only every N-th step, from the average of the N gradients since the last move,
  so a burst of stale gradients cannot compound in it; every step still applies its own gradient.

Both warm their momentum coefficient up (``warmed_momentum``): over a fragment's first W outer
steps μ rises linearly from 0, so the large, fast-turning deltas of the first rounds do not
linger in the momentum after the landscape under them has moved on. The step count comes in
``state`` (``STEPS_KEY``: the fragment's version, which a checkpoint already keeps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import torch

from yeto_core.sections import MergeSettings

__all__ = [
    "ACCUM_KEY",
    "COUNT_KEY",
    "OUTER_OPTIMIZERS",
    "STEPS_KEY",
    "STEP_CHUNK",
    "DelayedNesterov",
    "Nesterov",
    "OuterOptimizer",
    "OuterState",
    "add_pulled",
    "make_outer_optimizer",
    "nesterov_step",
    "warmed_momentum",
]

OuterState: TypeAlias = dict[str, torch.Tensor | int]

ACCUM_KEY = "delayed_nesterov.accum"
"""State key: float32 tensor shaped like the parameters, the sum of the gradients since the last
momentum update (all zeros right after one). Created on the first step."""
COUNT_KEY = "delayed_nesterov.count"
"""State key: int in [0, N), how many gradients ``ACCUM_KEY`` holds."""
STEPS_KEY = "outer.steps"
"""State key: int >= 0, the outer steps the fragment took before this one (absent: 0)."""


def warmed_momentum(momentum: float, warmup: int, steps: int) -> float:
    """The momentum coefficient of a fragment's outer step number ``steps`` (0 first) under a
    linear warm-up over ``warmup`` steps: μ·min(1, steps/warmup); ``warmup`` 0 is μ throughout."""
    if warmup <= 0 or steps >= warmup:
        return momentum
    return momentum * steps / warmup


def _steps(name: str, state: OuterState) -> int:
    steps = state.get(STEPS_KEY, 0)
    _check_int(name, f"state[{STEPS_KEY!r}]", steps, 0)
    assert isinstance(steps, int)
    return steps


class OuterOptimizer(Protocol):
    """One outer step on one fragment, in place."""

    def step(
        self, param: torch.Tensor, momentum: torch.Tensor, outer_grad: torch.Tensor, state: OuterState,
        *, scratch: torch.Tensor | None = None,
    ) -> None:
        """Update ``param`` and ``momentum`` (and ``state``) from ``outer_grad``; all the same shape.
        ``scratch`` lends the step's one temporary its memory (a chunk of it: ``add_pulled``)."""
        ...

    def bound(self, *, param: float, momentum: float, grad: float, accum: float = 0.0) -> float:
        """An upper bound on the magnitude of every value the step computes, its temporaries
        included, given bounds on the magnitudes of its inputs (``accum``: of the state's
        accumulator, when it keeps one). Exact arithmetic; the caller leaves room for rounding."""
        ...


# Chunk of the outer step's one temporary (g + μ·m): 4 MiB, not a fragment-sized buffer. A multiple
# of every vector width, so each chunk is done by the same vectorised loop as the whole would be.
STEP_CHUNK = 1 << 20

def nesterov_step(
    param: torch.Tensor,
    momentum: torch.Tensor,
    outer_grad: torch.Tensor,
    lr: float = 0.7,
    momentum_coef: float = 0.9,
    *,
    scratch: torch.Tensor | None = None,
) -> None:
    """One outer Nesterov step in place (DiLoCo's outer optimizer, with its stock lr 0.7 and momentum 0.9).

    The same arithmetic, op for op, as ``torch.optim.SGD(nesterov=True, dampening=0)``:
    momentum ← μ·momentum + g, then param ← param − lr·(g + μ·momentum), with g = ``outer_grad``.
    ``g + μ·momentum`` is formed a chunk at a time (``add_pulled``); ``scratch`` lends it the memory.
    """
    if not (param.shape == momentum.shape == outer_grad.shape):
        raise ValueError(f"nesterov_step: shapes differ: param {tuple(param.shape)}, momentum "
                         f"{tuple(momentum.shape)}, outer_grad {tuple(outer_grad.shape)}")
    momentum.mul_(momentum_coef).add_(outer_grad)
    add_pulled(param, outer_grad, momentum, pull=momentum_coef, rate=-lr, scratch=scratch)


def add_pulled(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, *, pull: float, rate: float,
               scratch: torch.Tensor | None = None) -> None:
    """param ← param + rate·(grad + pull·momentum), in place, element for element the bits of the
    unchunked ops, through one temporary of at most ``STEP_CHUNK`` elements (``scratch``, when it
    is that large, else a new one): the outer step holds no fragment-sized buffer of its own."""
    n = param.numel()
    if not (param.is_contiguous() and grad.is_contiguous() and momentum.is_contiguous()):
        param.add_(torch.add(grad, momentum, alpha=pull), alpha=rate)
        return
    size = min(n, STEP_CHUNK)
    if scratch is not None and scratch.numel() >= size and scratch.is_contiguous() and scratch.device == param.device:
        buf = scratch.view(-1)[:size]
    else:
        buf = torch.empty(size, dtype=param.dtype, device=param.device)
    p, g, m = param.view(-1), grad.view(-1), momentum.view(-1)
    for start in range(0, n, STEP_CHUNK):
        stop = min(start + STEP_CHUNK, n)
        p[start:stop].add_(torch.add(g[start:stop], m[start:stop], alpha=pull, out=buf[: stop - start]), alpha=rate)


def _check_shapes(name: str, param: torch.Tensor, momentum: torch.Tensor, outer_grad: torch.Tensor) -> None:
    if not (param.shape == momentum.shape == outer_grad.shape):
        raise ValueError(f"{name}: shapes differ: param {tuple(param.shape)}, momentum "
                         f"{tuple(momentum.shape)}, outer_grad {tuple(outer_grad.shape)}")


def _check_int(name: str, what: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: {what} must be an int >= {least}, got {value!r}")


def _check_coefficients(name: str, lr: float, momentum: float) -> None:
    if not (math.isfinite(lr) and lr > 0.0):
        raise ValueError(f"{name}: lr must be finite and > 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{name}: momentum must be in [0, 1), got {momentum}")


@dataclass(frozen=True, slots=True)
class Nesterov:
    """SGD with Nesterov momentum (DiLoCo's outer optimizer), exactly ``nesterov_step``.

    momentum ← μ·momentum + g, then param ← param − lr·(g + μ·momentum), with μ warmed up over
    ``warmup`` steps (``warmed_momentum``; 0: none). Keeps no state of its own.
    """

    lr: float = 0.7
    momentum: float = 0.9
    warmup: int = 0

    def __post_init__(self) -> None:
        _check_coefficients("Nesterov", self.lr, self.momentum)
        _check_int("Nesterov", "warmup", self.warmup, 0)

    def step(
        self, param: torch.Tensor, momentum: torch.Tensor, outer_grad: torch.Tensor, state: OuterState,
        *, scratch: torch.Tensor | None = None,
    ) -> None:
        mu = warmed_momentum(self.momentum, self.warmup, _steps("Nesterov", state))
        nesterov_step(param, momentum, outer_grad, lr=self.lr, momentum_coef=mu, scratch=scratch)

    def bound(self, *, param: float, momentum: float, grad: float, accum: float = 0.0) -> float:
        # With the full μ: a warmed-up μ only makes every term smaller.
        new_momentum = self.momentum * momentum + grad
        step = grad + self.momentum * new_momentum
        return max(new_momentum, step, self.lr * step, param + self.lr * step)


@dataclass(frozen=True, slots=True)
class DelayedNesterov:
    """Delayed Nesterov momentum (arXiv:2401.09135, Algorithm 3) with delay N and activation c.

    With step counter t = 0, 1, …, accumulator A (``ACCUM_KEY``) and gradient g_t:

        A ← A + g_t
        if (t + 1) mod N = 0:   m ← μ·m + A/N
                                param ← param − lr·((1 − cN + c)·μ·m + g_t/N);   A ← 0
        else:                   param ← param − lr·(c·μ·m + g_t/N)

    Over one window of N steps the parameters move by −lr·(ḡ + μ·m) with ḡ the window's mean
    gradient: one Nesterov step on the mean, spread over the window. ``activation`` c ∈ [0, 1/N]
    moves part of the momentum term from the window's last step to every step (0, the default,
    applies it only there). With N = 1 every step is a momentum step, m ← μ·m + g and
    param ← param − lr·(μ·m + g): exactly ``Nesterov``, and computed op for op like it, with no
    accumulator.

    The window is counted per fragment in ``state`` (``COUNT_KEY``), so it survives a checkpoint
    together with ``ACCUM_KEY``. μ is warmed up over ``warmup`` steps, counted in steps (one a
    round), not momentum moves, as ``Nesterov`` does (``warmed_momentum``; 0: none).
    """

    lr: float = 0.7
    momentum: float = 0.9
    delay: int = 1
    activation: float = 0.0
    warmup: int = 0

    def __post_init__(self) -> None:
        _check_coefficients("DelayedNesterov", self.lr, self.momentum)
        _check_int("DelayedNesterov", "warmup", self.warmup, 0)
        _check_int("DelayedNesterov", "delay", self.delay, 1)
        if not 0.0 <= self.activation <= 1.0 / self.delay:
            raise ValueError(f"DelayedNesterov: activation must be in [0, 1/delay] = [0, {1.0 / self.delay}], "
                             f"got {self.activation}")

    def step(
        self, param: torch.Tensor, momentum: torch.Tensor, outer_grad: torch.Tensor, state: OuterState,
        *, scratch: torch.Tensor | None = None,
    ) -> None:
        _check_shapes("DelayedNesterov", param, momentum, outer_grad)
        n = self.delay
        mu = warmed_momentum(self.momentum, self.warmup, _steps("DelayedNesterov", state))
        count = state.get(COUNT_KEY, 0)
        if not isinstance(count, int) or not 0 <= count < n:
            raise ValueError(f"DelayedNesterov: state[{COUNT_KEY!r}] must be an int in [0, {n}), got {count!r}")
        accum = state.get(ACCUM_KEY)
        if n > 1 and accum is None:
            accum = torch.zeros_like(param)
            state[ACCUM_KEY] = accum
        if accum is not None and (not isinstance(accum, torch.Tensor) or accum.shape != param.shape):
            raise ValueError(f"DelayedNesterov: state[{ACCUM_KEY!r}] must be a tensor shaped like the "
                             f"parameters {tuple(param.shape)}")
        if count + 1 == n:
            if accum is None:
                momentum.mul_(mu).add_(outer_grad)
            else:
                momentum.mul_(mu).add_(accum.add_(outer_grad), alpha=1.0 / n)
                accum.zero_()
            # lr·(k·μ·m + g/N) as (lr/N)·(g + N·k·μ·m), with k = 1 − cN + c = 1 + c(1 − N): for N = 1
            # both factors are exactly 1 and the arithmetic is nesterov_step's.
            pull = n * (1.0 + self.activation * (1 - n)) * mu
            add_pulled(param, outer_grad, momentum, pull=pull, rate=-self.lr / n, scratch=scratch)
            state[COUNT_KEY] = 0
            return
        assert accum is not None
        accum.add_(outer_grad)
        if self.activation > 0.0:
            pull = n * self.activation * mu
            add_pulled(param, outer_grad, momentum, pull=pull, rate=-self.lr / n, scratch=scratch)
        else:
            param.add_(outer_grad, alpha=-self.lr / n)
        state[COUNT_KEY] = count + 1

    def bound(self, *, param: float, momentum: float, grad: float, accum: float = 0.0) -> float:
        # Both branches at once: the accumulator, the momentum move, the largest pull on either.
        n = self.delay
        summed = accum + grad
        new_momentum = self.momentum * momentum + summed / n
        pulled = n * self.momentum * max(momentum, new_momentum)  # pull <= n·μ for any activation
        step = grad + pulled
        return max(summed, new_momentum, pulled, step, self.lr / n * step, param + self.lr / n * step)


OUTER_OPTIMIZERS = ("nesterov", "delayed-nesterov")


def outer_optimizer(merging: MergeSettings) -> OuterOptimizer:
    """The outer optimizer of a syncer's merge settings, their outer lr resolved (`SyncerSettings`
    does it from M): an unresolved 0 would take steps of length zero without a word."""
    if not merging.outer_lr:
        raise ValueError("the outer lr is unset (0): resolve it with MergeSettings.for_learners(M)")
    return make_outer_optimizer(merging.outer_optimizer, lr=merging.outer_lr, momentum=merging.outer_momentum,
                                delay=merging.outer_delay, warmup=merging.outer_momentum_warmup)


def make_outer_optimizer(name: str, *, lr: float, momentum: float, delay: int = 1, warmup: int = 0) -> OuterOptimizer:
    """The outer optimizer ``--outer-optimizer`` names: ``nesterov`` or ``delayed-nesterov``.

    ``delay`` is delayed Nesterov's N; plain Nesterov has no delay and ignores it. ``warmup``:
    the momentum's warm-up in outer steps (``warmed_momentum``).
    """
    if name == "nesterov":
        return Nesterov(lr=lr, momentum=momentum, warmup=warmup)
    if name == "delayed-nesterov":
        return DelayedNesterov(lr=lr, momentum=momentum, delay=delay, warmup=warmup)
    raise ValueError(f"unknown outer optimizer {name!r}; accepted: {', '.join(OUTER_OPTIMIZERS)}")
