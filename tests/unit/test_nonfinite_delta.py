"""A learner does not send a delta holding NaN or Inf (SPEC §6): it names the tensor, the round goes
on without it, and the fragment's next broadcast replaces the diverged values."""

from __future__ import annotations

import pytest
import torch

from yeto_core.client import PushJob, Received
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings
from yeto_core.store import nonfinite_tensor
from yeto_core.wire.messages import BCAST_FULL, Bcast, Pull

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def session(a: torch.Tensor, b: torch.Tensor, overlap: bool = False) -> tuple[LearnerSession, list[PushJob]]:
    config = LearnerSettings(syncer="127.0.0.1:9", key="k" * 32, sync_interval=2, merge_alpha=0.0, overlap=overlap)
    s = LearnerSession(config, [("a", a), ("b", b)])
    s._layout_for(1, "binpack")
    jobs: list[PushJob] = []

    def submit(job: PushJob) -> None:
        job.done.set()
        jobs.append(job)

    s.client.submit = submit  # type: ignore[method-assign]
    return s, jobs


def bcast(s: LearnerSession, version: int, round_id: int, values: torch.Tensor) -> None:
    s._accept(Received(Bcast(0, version, round_id, BCAST_FULL, 0, 0, 0), values.clone()))
    s._install_bcasts()


@pytest.mark.parametrize("overlap", [False, True], ids=["overwrite", "overlap"])
def test_a_poisoned_delta_is_not_pushed_and_the_next_broadcast_heals_the_fragment(
        capsys: pytest.CaptureFixture[str], overlap: bool) -> None:
    # Overlap rebases θ ← Θ + (θ − anchor): the diverged progress is dropped, not carried into Θ.
    a, b = torch.zeros(3), torch.zeros(4)
    s, jobs = session(a, b, overlap)
    bcast(s, 0, 0, torch.ones(7))
    s._accept(Received(Pull(0, 1, 0, 0)))
    s.step(tokens=8)
    b[2] = float("nan")  # training diverged in tensor b
    s.step(tokens=8)  # the boundary: the pull is not answered
    assert jobs == [] and s.stats.nonfinite_deltas == 1 and s.stats.pushes == 0
    err = capsys.readouterr().err
    assert "the delta of fragment 0 holds NaN or Inf (first in 'b'); round 0 is not answered" in err, err

    s._accept(Received(Pull(1, 1, 0, 0)))
    s.step(tokens=8)
    s.step(tokens=8)
    assert jobs == [] and s.stats.nonfinite_deltas == 2
    assert capsys.readouterr().err == ""  # said once on stderr (and every time in the log)

    g1 = torch.arange(7, dtype=torch.float32)
    bcast(s, 1, 1, g1)  # round 1 committed without this learner
    assert torch.equal(torch.cat([a, b]), g1)
    s._accept(Received(Pull(2, 1, 0, 1)))
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
