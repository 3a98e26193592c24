"""A learner does not send a delta holding NaN or Inf: it names the tensor, the round goes
on without it, and the fragment's next broadcast replaces the diverged values."""

from __future__ import annotations

import pytest
import torch
from learner_harness import MemoryLink, hand_fed

from yeto_core.layout import TensorSpec, build_layout
from yeto_core.learner import LearnerSession
from yeto_core.store import nonfinite_tensor

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def session(a: torch.Tensor, b: torch.Tensor, overlap: bool = False) -> tuple[LearnerSession, MemoryLink, list[str]]:
    s, link, _, said = hand_fed([("a", a), ("b", b)], overlap=overlap)
    return s, link, said


@pytest.mark.parametrize("overlap", [False, True], ids=["overwrite", "overlap"])
def test_a_poisoned_delta_is_not_pushed_and_the_next_broadcast_heals_the_fragment(overlap: bool) -> None:
    # Overlap rebases θ ← Θ + (θ − anchor): the diverged progress is dropped, not carried into Θ.
    a, b = torch.zeros(3), torch.zeros(4)
    s, link, said = session(a, b, overlap)
    jobs = link.jobs
    link.bcast(0, 0, 0, torch.ones(7))
    s.start()
    link.pull(0, 0, 0)
    s.step(tokens=8)
    b[2] = float("nan")  # training diverged in tensor b
    s.step(tokens=8)  # the boundary: the pull is not answered
    assert jobs == [] and s.stats.nonfinite_deltas == 1 and s.stats.pushes == 0
    (message,) = said
    assert "the delta of fragment 0 holds NaN or Inf (first in 'b'); round 0 is not answered" in message

    link.pull(1, 0, 0)
    s.step(tokens=8)
    s.step(tokens=8)
    assert jobs == [] and s.stats.nonfinite_deltas == 2
    assert len(said) == 1  # said once to the user (and every time in the log)

    g1 = torch.arange(7, dtype=torch.float32)
    link.bcast(0, 1, 1, g1)  # round 1 committed without this learner
    link.pull(2, 0, 1)
    s.step(tokens=8)  # installs G1 (the diverged values are gone), then trains on from it
    assert torch.equal(torch.cat([a, b]), g1)
    a.add_(1.0)
    s.step(tokens=8)
    s.step(tokens=8)
    (job,) = jobs
    assert job.pull.round == 2 and torch.equal(job.delta, torch.tensor([1.0, 1, 1, 0, 0, 0, 0]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_tensor_names_the_first_poisoned_tensor(bad: float) -> None:
    layout = build_layout([TensorSpec("x", (2, 2), "float32"), TensorSpec("y", (3,), "float32"),
                           TensorSpec("z", (2,), "float32")], 1)
    fragment = layout.fragments[0]
    values = torch.zeros(fragment.numel)
    assert nonfinite_tensor(fragment, values) is None
    slot = {s.name: s for s in fragment.slots}
    values[slot["z"].offset] = bad
    values[slot["y"].offset + 2] = bad
    first = min(("y", "z"), key=lambda n: slot[n].offset)
    assert nonfinite_tensor(fragment, values) == first


def test_nonfinite_tensor_passes_finite_values_whose_sum_overflows() -> None:
    layout = build_layout([TensorSpec("x", (4,), "float32")], 1)
    assert nonfinite_tensor(layout.fragments[0], torch.full((4,), 3.0e38)) is None
