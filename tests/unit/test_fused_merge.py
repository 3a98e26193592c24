"""The fused merge (`syncer/merge/fused.py`): the bits of the merged delta formed whole and stepped from."""

from __future__ import annotations

import math
import random

import pytest
import torch

from syncer.core.rounds import Answer
from syncer.merge.fused import PLAN_CHUNK, fusable
from syncer.merge.held import HeldDelta
from syncer.merge.merge import _NORM_BLOCK, Segment, accurate_norm, learner_weights, merge_deltas, segment_sq_norms
from syncer.merge.outer import STEP_CHUNK, STEPS_KEY, DelayedNesterov, Nesterov
from syncer.merge.round_merge import FragmentTensors, MergeWorkspace, RoundMerger, merge_round
from yeto_core.codecs import codec_by_name
from yeto_core.sections import MergeSettings

SIZES = [0, 1, 5, _NORM_BLOCK - 1, _NORM_BLOCK + 3, PLAN_CHUNK + 7, STEP_CHUNK - 2, STEP_CHUNK + 13, 2 * STEP_CHUNK + 1]


def layout(rng: random.Random, count: int) -> list[Segment]:
    segments, offset = [], 0
    for _ in range(count):
        n = rng.choice(SIZES) if rng.random() < 0.5 else rng.randrange(1, 3 * _NORM_BLOCK)
        segments.append(Segment(offset, n, rda=rng.random() < 0.75))
        offset += n
    return segments


def answers_for(n: int, m: int, gen: torch.Generator, rng: random.Random) -> list[Answer]:
    return [Answer(i, 1, rng.randrange(100, 5000), rng.randrange(1, 30), torch.randn(n, generator=gen)
                   .mul_(10 ** rng.uniform(-4, 1)), 0, age=rng.randrange(0, 3)) for i in range(m)]


def reference(answers: list[Answer], params: torch.Tensor, momentum: torch.Tensor, segments: list[Segment],
              outer: Nesterov, steps: int, finished: float = 0.0) -> float:
    """The merge as it was before it was fused: the negated merged delta formed whole, then the step."""
    ordered = sorted(answers, key=lambda a: a.learner_id)
    rows = [a.delta for a in ordered]
    weights = learner_weights([a.tokens for a in ordered], [a.steps for a in ordered], [a.age for a in ordered],
                              finished)
    grad = merge_deltas(rows, weights.to(torch.float32), segments, sq_norms=segment_sq_norms(rows, segments),
                        negate=True)
    norm = accurate_norm(grad)
    outer.step(params, momentum, grad, {STEPS_KEY: steps})
    return norm


@pytest.mark.parametrize("seed", range(6))
def test_the_fused_merge_gives_the_bits_of_the_merged_delta_formed_whole(seed: int) -> None:
    """On one thread (even seeds) or three: the chunks are independent, and each is the serial one's."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    segments = layout(rng, rng.randrange(1, 9))
    n = sum(s.numel for s in segments)
    m = rng.choice([1, 2, 3, 5])
    answers = answers_for(n, m, gen, rng)
    outer = Nesterov(lr=0.7, momentum=0.5, warmup=4)
    steps = rng.randrange(0, 6)
    finished = rng.choice([0.0, 250.0])
    params, momentum = torch.randn(n, generator=gen), torch.randn(n, generator=gen).mul_(0.01)
    ref_params, ref_momentum = params.clone(), momentum.clone()
    ref_norm = reference(answers, ref_params, ref_momentum, segments, outer, steps, finished)

    workspace = MergeWorkspace()
    out = merge_round(answers, params=params, momentum=momentum, outer_state={STEPS_KEY: steps}, segments=segments,
                      outer=outer, heloco=None, workspace=workspace, finished=finished, threads=1 + 2 * (seed % 2))
    assert torch.equal(params, ref_params) and torch.equal(momentum, ref_momentum)
    assert out.outer_grad_norm == ref_norm
    assert "merged" not in workspace._buffers  # nothing the size of the fragment was held


def test_held_pushes_and_a_prepared_merge_give_the_same_bits() -> None:
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    segments = [Segment(0, STEP_CHUNK + 5, True), Segment(STEP_CHUNK + 5, 300, False),
                Segment(STEP_CHUNK + 305, PLAN_CHUNK + 11, True)]
    n = sum(s.numel for s in segments)
    codec = codec_by_name("int4")
    answers = answers_for(n, 3, gen, rng)
    held = []
    for a in answers:  # each push as the syncer keeps it: encoded, decoded a span at a time
        payload = memoryview(bytearray(codec.encoded_nbytes(n)))
        codec.encode(a.delta, payload)
        delta = HeldDelta(codec, payload, n).with_norms(segments)
        held.append(Answer(a.learner_id, 1, a.tokens, a.steps, delta, 0, age=a.age))
    decoded = [Answer(a.learner_id, 1, a.tokens, a.steps, a.delta.decode(), 0, age=a.age) for a in held]
    outer = Nesterov(lr=0.7, momentum=0.5, warmup=4)
    params, momentum = torch.randn(n, generator=gen), torch.randn(n, generator=gen).mul_(0.01)
    ref_params, ref_momentum = params.clone(), momentum.clone()
    ref_norm = reference(decoded, ref_params, ref_momentum, segments, outer, 5)

    merger = RoundMerger(MergeSettings(outer_lr=0.7, outer_momentum=0.5, outer_momentum_warmup=4))

    prepared = merger.prepare(momentum, held, segments)
    assert prepared.plan is not None and prepared.grad is None
    lent = FragmentTensors(params, momentum, None, 0, 5)
    out, _ = merger.merge(lent, held, segments, prepared)
    assert torch.equal(params, ref_params) and torch.equal(momentum, ref_momentum)
    assert out.outer_grad_norm == ref_norm


def test_opposite_deltas_merge_to_no_step_as_before() -> None:
    n = 2 * _NORM_BLOCK + 3
    delta = torch.randn(n, generator=torch.Generator().manual_seed(3))
    answers = [Answer(0, 1, 100, 4, delta.clone(), 0), Answer(1, 1, 100, 4, delta.neg(), 0)]
    segments = [Segment(0, n, True)]
    params, momentum = torch.randn(n), torch.zeros(n)
    ref_params, ref_momentum = params.clone(), momentum.clone()
    ref_norm = reference(answers, ref_params, ref_momentum, segments, Nesterov(lr=0.7, momentum=0.5), 0)
    out = merge_round(answers, params=params, momentum=momentum, outer_state={}, segments=segments,
                      outer=Nesterov(lr=0.7, momentum=0.5), heloco=None)
    assert out.outer_grad_norm == ref_norm == 0.0
    assert torch.equal(params, ref_params) and torch.equal(momentum, ref_momentum)


def test_a_step_the_bound_cannot_clear_is_screened_whole_and_still_merges_right() -> None:
    """Deltas near float32's top: the fused path's bound fails its fast test, the gradient is formed
    whole and screened as before (the learner whose delta would overflow is left out)."""
    n = 4 * _NORM_BLOCK
    big = torch.full((n,), 3e38)
    small = torch.randn(n, generator=torch.Generator().manual_seed(1))
    answers = [Answer(0, 1, 100, 4, big, 0), Answer(1, 1, 100, 4, small, 0)]
    params, momentum = torch.zeros(n), torch.zeros(n)
    out = merge_round(answers, params=params, momentum=momentum, outer_state={}, segments=[Segment(0, n, True)],
                      outer=Nesterov(lr=0.7, momentum=0.5), heloco=None)
    assert 0 in out.overflowed and [a.learner_id for a in out.answers] == [1]
    assert bool(torch.isfinite(params).all()) and bool(torch.isfinite(momentum).all())
    assert math.isfinite(out.outer_grad_norm) and out.outer_grad_norm > 0


def test_only_plain_nesterov_on_the_cpu_without_heloco_or_iso_is_fused() -> None:
    cpu, plain = torch.device("cpu"), [Segment(0, 4, True)]
    assert fusable(Nesterov(), cpu, plain, corrected=False)
    assert not fusable(Nesterov(), cpu, plain, corrected=True)
    assert not fusable(DelayedNesterov(), cpu, plain, corrected=False)
    assert not fusable(Nesterov(), cpu, [Segment(0, 4, True, iso_shape=(2, 2))], corrected=False)
    assert not fusable(Nesterov(), torch.device("meta"), plain, corrected=False)


def test_the_plan_reads_no_param_and_writes_no_delta() -> None:
    n = PLAN_CHUNK + 9
    gen = torch.Generator().manual_seed(4)
    answers = [Answer(i, 1, 100, 4, torch.randn(n, generator=gen), 0) for i in range(2)]
    kept = [a.delta.clone() for a in answers]
    momentum = torch.full((n,), 0.25)
    merger = RoundMerger(MergeSettings(outer_lr=0.7))
    assert merger.prepare(momentum, answers, [Segment(0, n, True)]).plan is not None
    assert all(torch.equal(a.delta, k) for a, k in zip(answers, kept, strict=True))
    assert bool((momentum == 0.25).all())
