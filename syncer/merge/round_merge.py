"""One round's merge, as a function of tensors and settings (DESIGN §5).

The protocol asks for the merge of a closed round (`effects.Merge`) and the shell's
`RoundMerger` performs it: this module corrects stale deltas (HeLoCo, optional), weights the
learners (tokens²/steps), merges (RDA per tensor), and takes the outer optimizer step in place
on the fragment's params and momentum, unless it would overflow them: such a round is merged
again without the learner whose delta is largest. No sockets, no clocks but a stopwatch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from syncer.core.rounds import Answer
from syncer.durability.checkpoint import SyncerState
from syncer.merge.correction import HelocoConfig, heloco_correct
from syncer.merge.fused import PLAN_CHUNK, FusedPlan, fusable, plan_fused, step_fused
from syncer.merge.held import HeldDelta
from syncer.merge.merge import (
    Flattener,
    Row,
    Rows,
    Segment,
    accurate_norm,
    learner_weights,
    merge_deltas,
    segment_sq_norms,
)
from syncer.merge.outer import (
    ACCUM_KEY,
    COUNT_KEY,
    STEP_CHUNK,
    STEPS_KEY,
    Nesterov,
    OuterOptimizer,
    OuterState,
    outer_optimizer,
    warmed_momentum,
)
from yeto_core.layout import Layout, TensorSlot
from yeto_core.sections import MergeSettings

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
HEADROOM = 0.999
"""The share of float32's range a bounded step may reach: a handful of roundings cannot cross it."""


@dataclass(frozen=True)
class MergeOutcome:
    answers: list[Answer]  # in learner-id order, the order they were merged in; empty if none could be
    weights: list[float]
    outer_grad_norm: float
    delta_norms: list[float]
    merge_ms: float
    overflowed: dict[int, float] = field(default_factory=dict)  # learner -> largest |value| of its delta


class MergeWorkspace:
    """Scratch tensors kept from one merge to the next. A merge needs the merged delta and a chunk of
    the outer step's temporary (with HeLoCo, a corrected copy of the deltas too); a fresh 64 MiB CPU
    tensor faults in every page as it is first
    written (~16 ms here, allocations that size are always fresh memory), which made up most of
    a merge. Each buffer grows to the largest fragment merged and is viewed at the size asked."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel].view(shape)


def fragment_segments(layout: Layout, merge: str) -> list[list[Segment]]:
    """Per fragment, its tensors' spans and whether RDA merges each (`--merge rda` and `iso`:
    every tensor, the embedding's too) or the plain weighted average does (`average`); with
    `iso`, which are the 2-D matrices, embeddings aside, whose merged update gets a flat spectrum."""
    def segment(s: TensorSlot) -> Segment:
        iso = merge == "iso" and not s.embedding and len(s.shape) == 2
        return Segment(s.offset, s.numel, rda=merge in ("rda", "iso"),
                       iso_shape=(int(s.shape[0]), int(s.shape[1])) if iso else None, name=s.name)

    return [[segment(s) for s in frag.slots] for frag in layout.fragments]


@dataclass(frozen=True)
class FragmentTensors:
    """One fragment's committed tensors, lent by the protocol for a merge and handed back by it:
    the outer step writes `params` and `momentum` in place and may replace `accum` (delayed
    Nesterov); `outer_steps` is the fragment's version, from which the momentum warm-up resumes."""

    params: torch.Tensor
    momentum: torch.Tensor
    accum: torch.Tensor | None
    accum_count: int
    outer_steps: int

    @classmethod
    def of(cls, state: SyncerState, fragment: int) -> FragmentTensors:
        accum = state.outer_accum[fragment] if state.outer_accum is not None else None
        count = state.outer_count[fragment] if state.outer_accum is not None else 0
        return cls(state.params[fragment], state.momentum[fragment], accum, count, state.versions[fragment])

    def install(self, state: SyncerState, fragment: int) -> None:
        """Take the tensors back into `state` (a lease may have swapped one for a fresh copy)."""
        state.params[fragment], state.momentum[fragment] = self.params, self.momentum
        if state.outer_accum is not None:
            assert self.accum is not None
            state.outer_accum[fragment], state.outer_count[fragment] = self.accum, self.accum_count


class RoundMerger:
    """The merges the protocol asks for, on the run's own tensors: one outer optimizer, HeLoCo's
    settings, the merge threads and a workspace kept from round to round. Whatever the outer
    optimizer remembers between rounds (delayed Nesterov's accumulator and count) lives in the
    `SyncerState`, so a checkpoint holds it and a resume continues it."""

    def __init__(self, merging: MergeSettings, *, iso: Flattener | None = None) -> None:
        self.iso = iso  # the iso worker pool, when there is one
        self.outer = outer_optimizer(merging)
        # HeLoCo's confidence compares against an averaged momentum; ours is a 1/(1−μ)-longer sum.
        self.heloco = (HelocoConfig(momentum_scale=1.0 - merging.outer_momentum)
                       if merging.delta_correction == "heloco" else None)
        self.threads = merging.merge_threads
        self.workspace = MergeWorkspace()

    def prepare(self, momentum: torch.Tensor, answers: list[Answer], segments: list[Segment],
                finished: float = 0.0) -> PreparedMerge:
        """The heavy half of a merge, on any thread (its own scratch: the workspace is the commit's)."""
        fused = fusable(self.outer, momentum.device, segments, corrected=self.heloco is not None)
        return prepare_merge(answers, momentum=momentum, segments=segments, heloco=self.heloco,
                             threads=self.threads, iso=self.iso, finished=finished, fused=fused)

    def merge(self, lent: FragmentTensors, answers: list[Answer], segments: list[Segment],
              prepared: PreparedMerge | None = None, finished: float = 0.0) -> tuple[MergeOutcome, FragmentTensors]:
        """Merge `answers` into the lent tensors, in place (the caller has made them writable:
        `leases.py`), and hand them back; `prepared`: its heavy half, done ahead by `prepare`;
        `finished`: the raw weight of the learners that finished training (`learner_weights`)."""
        # The fragment's version counts its outer steps: the momentum's warm-up resumes with it.
        outer_state: OuterState = {STEPS_KEY: lent.outer_steps}
        if lent.accum is not None:
            outer_state.update({ACCUM_KEY: lent.accum, COUNT_KEY: lent.accum_count})
        out = merge_round(answers, params=lent.params, momentum=lent.momentum, outer_state=outer_state,
                          segments=segments, outer=self.outer, heloco=self.heloco, threads=self.threads,
                          workspace=self.workspace, iso=self.iso, prepared=prepared, finished=finished)
        if out.answers and lent.accum is not None:
            accum = outer_state[ACCUM_KEY]
            assert isinstance(accum, torch.Tensor)
            lent = replace(lent, accum=accum, accum_count=int(outer_state[COUNT_KEY]))
        return out, lent

    def run(self, state: SyncerState, fragment: int, answers: list[Answer], segments: list[Segment],
            prepared: PreparedMerge | None = None) -> MergeOutcome:
        """`merge` fragment `fragment` of `state` and take its tensors back into it (for callers
        that own the state themselves: tests, benchmarks)."""
        out, back = self.merge(FragmentTensors.of(state, fragment), answers, segments, prepared)
        back.install(state, fragment)
        return out


@dataclass(frozen=True)
class PreparedMerge:
    """The heavy half of a round's merge, done ahead of its commit (`prepare_merge`): the learners'
    weights and the outer gradient of every delta whose norm fits float32 (`grad`), or, on the
    fused path, what forms that gradient a chunk at a time during the step (`plan`). Only the
    outer step is left, and it reads nothing this half wrote but `grad` or `plan`."""

    ordered: list[Answer]  # in learner-id order, without the overflowed
    norms: dict[int, float]
    overflowed: dict[int, float]
    weights: torch.Tensor | None
    grad: torch.Tensor | None
    ms: float
    plan: FusedPlan | None = None


def prepare_merge(
    answers: list[Answer],
    *,
    momentum: torch.Tensor,
    segments: list[Segment],
    heloco: HelocoConfig | None,
    threads: int = 1,
    workspace: MergeWorkspace | None = None,
    iso: Flattener | None = None,
    finished: float = 0.0,
    fused: bool = False,
) -> PreparedMerge:
    """Weights and outer gradient of `answers` (RDA, and with `--merge iso` the SVDs); `fused`
    (`fused.fusable`): weights and the plan that forms the gradient during the step instead. It
    reads the fragment's momentum (HeLoCo) and no params, so it may run before the rounds ahead
    of it commit, as long as none of them is on the same fragment."""
    t0 = time.perf_counter()
    ordered = sorted(answers, key=lambda a: a.learner_id)
    # One pass over the deltas takes every learner's norm per tensor: RDA weighs its directions by
    # them, and their sum is the delta's norm for the tape.
    deltas = _rows(ordered, momentum, workspace, heloco)
    held = [a.delta.sq_norms for a in ordered if isinstance(a.delta, HeldDelta) and a.delta.sq_norms is not None]
    if heloco is None and len(held) == len(ordered):
        sq = torch.stack(held)  # taken on arrival, the same bits
    else:
        sq = segment_sq_norms(deltas, segments, threads=threads)
    totals = sq.sum(dim=1).tolist()
    norms = {a.learner_id: math.sqrt(t) for a, t in zip(ordered, totals, strict=True)}
    # A delta whose norm does not fit float32 (values past ~1e19 do that) cannot be weighed by RDA.
    overflowed = {a.learner_id: max_abs(a.delta) for a in ordered if not math.isfinite(norms[a.learner_id])}
    if overflowed:  # rare: the rows left are stacked again
        keep = [i for i, a in enumerate(ordered) if a.learner_id not in overflowed]
        ordered = [ordered[i] for i in keep]
        if ordered:
            deltas, sq = _rows(ordered, momentum, workspace, heloco), sq[keep]
    weights = grad = plan = None
    if ordered and fused:
        weights = _weights(ordered, finished)
        size = (min(PLAN_CHUNK, momentum.numel()),)
        scratch = None if workspace is None else workspace.take("plan", size, momentum.device)
        plan = plan_fused(deltas, weights.to(torch.float32), segments, sq, scratch, threads)
    elif ordered:
        weights, grad = _outer_gradient(ordered, momentum=momentum, segments=segments, heloco=heloco,
                                        threads=threads, workspace=workspace, iso=iso, stacked=(deltas, sq),
                                        finished=finished)
    return PreparedMerge(ordered, norms, overflowed, weights, grad, (time.perf_counter() - t0) * 1000, plan)


def merge_round(
    answers: list[Answer],
    *,
    params: torch.Tensor,
    momentum: torch.Tensor,
    outer_state: dict[str, Any],
    segments: list[Segment],
    outer: OuterOptimizer,
    heloco: HelocoConfig | None,
    threads: int = 1,
    workspace: MergeWorkspace | None = None,
    iso: Flattener | None = None,
    prepared: PreparedMerge | None = None,
    finished: float = 0.0,
) -> MergeOutcome:
    """Merge one fragment's answers into `params` / `momentum` (in place), never into NaN or Inf.

    Every delta is finite when it gets here, yet finite values can still overflow: a delta of
    3e38 averaged and stepped with momentum makes the fragment Inf. So the step is screened
    first (`screen_step`); a merge that would overflow is done again without the learner whose
    delta is largest, until one fits. Those learners are in `overflowed`; when none fits, nothing
    is written and `answers` is empty. `prepared`: the first merge, done ahead (`prepare_merge`)
    on these same answers; the outcome is the same bits as without it.
    """
    t0 = time.perf_counter()
    fused = fusable(outer, momentum.device, segments, corrected=heloco is not None)
    first = prepared or prepare_merge(answers, momentum=momentum, segments=segments, heloco=heloco,
                                      threads=threads, workspace=workspace, iso=iso, finished=finished, fused=fused)
    spent_ms = first.ms if prepared is not None else 0.0  # its time counts as the merge's
    ordered, norms, overflowed = list(first.ordered), first.norms, dict(first.overflowed)
    weights, grad = first.weights, first.grad
    if first.plan is not None and weights is not None:
        assert isinstance(outer, Nesterov)
        grad_norm = _fused_step(first.plan, outer, params, momentum, outer_state, workspace, threads)
        if grad_norm is not None:
            return MergeOutcome(ordered, [float(w) for w in weights], grad_norm, [norms[a.learner_id] for a in ordered],
                                spent_ms + (time.perf_counter() - t0) * 1000, overflowed)
        weights = None  # the screen could not clear it cheaply: the gradient is formed whole below
    while ordered:
        if grad is None or weights is None:
            weights, grad = _outer_gradient(ordered, momentum=momentum, segments=segments, heloco=heloco,
                                            threads=threads, workspace=workspace, iso=iso, finished=finished)
        scratch = None if workspace is None else workspace.take("step", (min(params.numel(), STEP_CHUNK),),
                                                                params.device)
        grad_norm = accurate_norm(grad)
        if screen_step(outer, params, momentum, grad, outer_state, grad_norm=grad_norm, scratch=scratch):
            kept = [float(w) for w in weights]
            return MergeOutcome(ordered, kept, grad_norm, [norms[a.learner_id] for a in ordered],
                                spent_ms + (time.perf_counter() - t0) * 1000, overflowed)
        largest = [max_abs(a.delta) for a in ordered]
        worst = max(range(len(ordered)), key=lambda i: largest[i])
        overflowed[ordered.pop(worst).learner_id] = largest[worst]
        weights = grad = None
    return MergeOutcome([], [], 0.0, [], spent_ms + (time.perf_counter() - t0) * 1000, overflowed)


def _fused_step(plan: FusedPlan, outer: Nesterov, params: torch.Tensor, momentum: torch.Tensor,
                outer_state: dict[str, Any], workspace: MergeWorkspace | None, threads: int) -> float | None:
    """The fused commit (`fused.step_fused`) when the output screen's fast test clears it from the
    gradient's bound (`screen_step`'s first test, with that bound for ‖g‖): the gradient's norm.
    None, with nothing written, when it does not: the caller screens the gradient formed whole."""
    bound = outer.bound(param=accurate_norm(params), momentum=accurate_norm(momentum), grad=plan.grad_bound)
    if not bound < HEADROOM * FLOAT32_MAX:
        return None
    size = (min(params.numel(), STEP_CHUNK),)
    grad_scratch = None if workspace is None else workspace.take("fused", size, params.device)
    step_scratch = None if workspace is None else workspace.take("step", size, params.device)
    mu = warmed_momentum(outer.momentum, outer.warmup, int(outer_state.get(STEPS_KEY, 0)))
    return step_fused(plan, params, momentum, lr=outer.lr, mu=mu, grad_scratch=grad_scratch,
                      step_scratch=step_scratch, threads=threads)


def _rows(ordered: list[Answer], momentum: torch.Tensor, workspace: MergeWorkspace | None,
          heloco: HelocoConfig | None) -> Rows:
    """The learners' deltas as the merge reads them: the pushes themselves, where they were received
    (stacking them would hold a round's M·N floats twice). HeLoCo rewrites the rows it corrects, and a
    round merged again after an overflow must find the pushes as they came: it gets a stacked copy
    (in the workspace, when given). A delta on another device than the fragment is moved there."""
    rows: list[Row] = [a.delta if a.delta.device == momentum.device else a.delta.to(momentum.device)
                       for a in ordered]
    if heloco is None:
        return rows
    stacked = None if workspace is None else workspace.take("deltas", (len(rows), momentum.numel()),
                                                            momentum.device)
    whole = [r if isinstance(r, torch.Tensor) else r.decode() for r in (a.delta for a in ordered)]
    return list(torch.stack([r.to(momentum.device) for r in whole], out=stacked).unbind())


def _outer_gradient(
    ordered: list[Answer], *, momentum: torch.Tensor, segments: list[Segment],
    heloco: HelocoConfig | None, threads: int, workspace: MergeWorkspace | None, iso: Flattener | None = None,
    stacked: tuple[Rows, torch.Tensor] | None = None, finished: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The learners' weights and the fragment's outer gradient; `stacked`: the `ordered` deltas
    stacked already, with their `segment_sq_norms`; `finished`: as `learner_weights` takes it."""
    weights = _weights(ordered, finished)
    deltas, sq = stacked if stacked is not None else (_rows(ordered, momentum, workspace, heloco), None)
    if heloco is not None:  # realign deltas that oppose the outer momentum (a no-op while it is zero)
        for row in deltas:
            assert isinstance(row, torch.Tensor)  # `_rows` stacked them
            heloco_correct(row, momentum, segments, heloco, out=row)
        sq = None  # the corrected rows have norms of their own
    if sq is None:
        sq = segment_sq_norms(deltas, segments, threads=threads)
    out = None if workspace is None else workspace.take("merged", (momentum.numel(),), momentum.device)
    # Δ = −merged, written by the merge itself: the negation costs no pass of its own.
    grad = merge_deltas(deltas, weights.to(device=momentum.device, dtype=torch.float32), segments, out=out,
                        threads=threads, iso=iso, sq_norms=sq, negate=True)
    return weights, grad


def _weights(ordered: list[Answer], finished: float) -> torch.Tensor:
    return learner_weights([a.tokens for a in ordered], [a.steps for a in ordered], [a.age for a in ordered], finished)


def max_abs(x: torch.Tensor | HeldDelta) -> float:
    """The largest |value| of `x` (one read pass, no temporary)."""
    if isinstance(x, HeldDelta):
        return x.max_abs()
    return float(torch.linalg.vector_norm(x, ord=math.inf)) if x.numel() else 0.0


def screen_step(
    outer: OuterOptimizer, params: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor,
    state: dict[str, Any], *, grad_norm: float | None = None, scratch: torch.Tensor | None = None,
) -> bool:
    """Take the outer step in place if everything it writes stays finite; else write nothing.

    The usual case costs one fast read of params and momentum: ‖x‖₂ ≥ max|x|, so when the
    optimizer's bound on its values (`OuterOptimizer.bound`) from the inputs' L2 norms stays
    inside float32, nothing can overflow and the step runs in place. (`grad_norm`, ‖grad‖, is
    taken anyway for the tape.) Norms of values past ~1e19 overflow themselves: then the bound is
    taken again from the exact largest magnitudes, and past that too the step is tried on copies
    and kept (copied back, bit for bit the in-place result) if all it produced is finite.
    """
    accum = state.get(ACCUM_KEY)
    held = accum if isinstance(accum, torch.Tensor) else None
    norm_bound = outer.bound(param=accurate_norm(params), momentum=accurate_norm(momentum),
                             grad=accurate_norm(grad) if grad_norm is None else grad_norm,
                             accum=0.0 if held is None else accurate_norm(held))
    if norm_bound < HEADROOM * FLOAT32_MAX or outer.bound(
            param=max_abs(params), momentum=max_abs(momentum), grad=max_abs(grad),
            accum=0.0 if held is None else max_abs(held)) < HEADROOM * FLOAT32_MAX:
        outer.step(params, momentum, grad, state, scratch=scratch)
        return True
    trial_params, trial_momentum = params.clone(), momentum.clone()
    trial_state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    outer.step(trial_params, trial_momentum, grad, trial_state)
    written = [trial_params, trial_momentum, *(v for v in trial_state.values() if isinstance(v, torch.Tensor))]
    if not all(bool(torch.isfinite(t).all()) for t in written):
        return False
    params.copy_(trial_params)
    momentum.copy_(trial_momentum)
    for k, v in trial_state.items():
        kept = state.get(k)
        if isinstance(v, torch.Tensor) and isinstance(kept, torch.Tensor):
            kept.copy_(v)
        else:
            state[k] = v
    return True
