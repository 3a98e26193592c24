"""Overlap rebasing (Mix1) and blocking fragments (Mix2), on a session fed by hand.

The "model" is one integer-valued f32 vector and each training step adds a known integer vector,
so every expected value below is exact: the test checks that each step's progress reaches the
syncer in exactly one push (with its steps and tokens counted once) and is never lost.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from learner_harness import hand_fed

from yeto_core.blocking import blocking_fragments, parse_blocking
from yeto_core.layout import TensorSpec, build_layout

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

N = 6


def progress(step: int) -> torch.Tensor:
    """What training step `step` adds to θ: small distinct integers, so sums stay exact."""
    return torch.arange(N, dtype=torch.float32) * step + step


class HandFed:
    """A session over one tensor whose syncer is the test (an in-memory link, a fake clock)."""

    def __init__(self, **settings: Any) -> None:
        self.theta = torch.zeros(N)
        self.session, self.link, self.clock, _ = hand_fed([("w", self.theta)], **settings)
        self.jobs = self.link.jobs
        self.step = 0

    def bcast(self, version: int, round_id: int, values: torch.Tensor, *, merged: bool) -> None:
        self.link.bcast(0, version, round_id, values, merged=merged)

    def initial_cut(self, values: torch.Tensor) -> None:
        """Version 0 of the fragment, installed before training starts."""
        self.bcast(0, 0, values, merged=False)
        self.session.start()
        assert self.session.initial_cut_installed

    def pull(self, round_id: int, version: int) -> None:
        self.link.pull(round_id, 0, version)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            self.theta.add_(progress(self.step))
            self.session.step(tokens=10)


def steps_sum(first: int, last: int) -> torch.Tensor:
    return sum((progress(t) for t in range(first, last + 1)), torch.zeros(N))


def test_rebasing_counts_every_step_once_and_keeps_what_trained_after_the_push() -> None:
    fed = HandFed(overlap=True)
    g0 = torch.full((N,), 100.0)
    fed.initial_cut(g0)
    fed.train(1)
    assert torch.equal(fed.theta, g0 + progress(1))
    fed.pull(0, 0)
    fed.train(1)  # step 2 is a boundary (H = 2, one fragment): push round 0
    (job0,) = fed.jobs
    assert torch.equal(job0.delta, steps_sum(1, 2)) and job0.steps == 2 and job0.tokens == 20
    fed.train(3)  # overlap: steps 3-5 train while round 0 is merged
    other = torch.full((N,), 7.0)  # another island's contribution to the merge
    g1 = g0 + job0.delta + other
    fed.bcast(1, 0, g1, merged=True)
    fed.pull(1, 1)
    fed.train(1)  # step 6: installs G1 by rebasing, then pushes round 1
    # θ = G1 + what trained after the push (steps 3-6): steps 1-2 are inside G1 once, not twice.
    assert torch.equal(fed.theta, g1 + steps_sum(3, 6))
    job1 = fed.jobs[1]
    assert torch.equal(job1.delta, steps_sum(3, 6)) and job1.steps == 4 and job1.tokens == 40
    assert fed.session.stats.rebases == 1
    # Steps 3-6 trained between round 0's push and the install of its merge.
    assert (fed.session.stats.round_trips, fed.session.stats.round_trip_steps) == (1, 4)
    # Every step so far went out in exactly one push.
    assert sum(j.steps for j in fed.jobs) == fed.step == 6
    assert torch.equal(sum((j.delta for j in fed.jobs), torch.zeros(N)), steps_sum(1, 6))


def test_a_round_that_did_not_merge_the_push_keeps_its_progress_for_the_next_push() -> None:
    fed = HandFed(overlap=True)
    g0 = torch.zeros(N)
    fed.initial_cut(g0)
    fed.pull(0, 0)
    fed.train(2)  # push round 0 at step 2
    fed.train(1)
    other = torch.full((N,), 3.0)
    fed.bcast(1, 0, g0 + other, merged=False)  # round 0 committed without this learner's push
    fed.pull(1, 1)
    fed.train(1)  # step 4: rebase keeps steps 1-3, then pushes
    assert torch.equal(fed.theta, g0 + other + steps_sum(1, 4))
    job1 = fed.jobs[1]
    assert torch.equal(job1.delta, steps_sum(1, 4)) and job1.steps == 4  # nothing lost, nothing twice
    assert fed.session.stats.rebases == 0
    assert (fed.session.stats.round_trips, fed.session.stats.round_trip_steps) == (1, 2)  # committed without it


def test_without_overlap_the_install_blends() -> None:
    fed = HandFed(overlap=False)
    fed.initial_cut(torch.zeros(N))
    fed.pull(0, 0)
    fed.train(3)
    g1 = torch.full((N,), 50.0)
    fed.bcast(1, 0, g1, merged=True)
    fed.train(1)
    assert torch.equal(fed.theta, g1)  # merge_alpha 0: the install at step 4 overwrites what it trained


def _specs() -> list[TensorSpec]:
    return [TensorSpec("model.embed_tokens.weight", (8, 4), "float32", embedding=True),
            *[TensorSpec(f"model.layers.{i}.mlp.weight", (4, 4), "float32") for i in range(4)],
            TensorSpec("model.norm.weight", (4,), "float32"), TensorSpec("lm_head.weight", (8, 4), "float32")]


def test_blocking_items_name_their_fragments() -> None:
    layout = build_layout(_specs(), 4, "strided")
    where = {s.name: f.index for f in layout.fragments for s in f.slots}
    assert blocking_fragments(layout, "embedding") == {where["model.embed_tokens.weight"]}
    assert blocking_fragments(layout, "head") == {where["lm_head.weight"]}
    assert blocking_fragments(layout, "layers:2") == {where["model.layers.0.mlp.weight"],
                                                       where["model.layers.1.mlp.weight"]}
    assert blocking_fragments(layout, " 3 , embedding") == {3, where["model.embed_tokens.weight"]}
    assert blocking_fragments(layout, "") == frozenset()
    with pytest.raises(ValueError, match="blocking fragment 9 does not exist"):
        blocking_fragments(layout, "9")
    with pytest.raises(ValueError, match="unknown blocking item 'lyers:2'"):
        parse_blocking("embedding,lyers:2")


def test_a_blocking_fragment_is_installed_at_its_own_boundary() -> None:
    fed = HandFed(blocking="0", blocking_timeout_s=5)
    g0 = torch.zeros(N)
    fed.initial_cut(g0)
    fed.pull(0, 0)
    g1 = torch.full((N,), 9.0)

    def merged_meanwhile() -> None:  # the syncer answers while the step waits, 0.3 s later
        if fed.jobs and fed.session.fragments[0].version < 1:
            fed.clock.advance(0.3)
            fed.bcast(1, 0, g1, merged=True)

    fed.link.on_wait = merged_meanwhile
    fed.train(2)  # step 2 pushes round 0 and waits for it: G1 is installed before step 3
    assert fed.session.fragments[0].version == 1
    assert torch.equal(fed.theta, g1)  # merge_alpha 0: the merged value, at the boundary itself
    assert fed.session.stats.blocked_s == pytest.approx(0.3)


def test_a_broadcast_after_the_anchors_were_released_goes_in_as_an_overwrite() -> None:
    # DONE (or the fragment's FINAL) releases the anchors; a broadcast still on its way then has
    # nothing to rebase onto, and the island pushes no more: it installs exactly.
    fed = HandFed(overlap=True)
    g0 = torch.full((N,), 100.0)
    fed.initial_cut(g0)
    fed.pull(0, 0)
    fed.train(2)  # a push of round 0
    assert len(fed.jobs) == 1
    fed.session.sync.release_anchors()
    g1 = torch.full((N,), 5.0)
    fed.bcast(1, 0, g1, merged=True)
    fed.pull(1, 1)
    fed.train(1)  # step 3's progress, then G1 installed over it: an overwrite, not a rebase
    assert torch.equal(fed.theta, g1)
    assert len(fed.jobs) == 1 and fed.session.stats.rebases == 0
