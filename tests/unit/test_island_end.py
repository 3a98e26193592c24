"""`IslandSession` owns the end of the run: a last step waits for the final cut there, `finish` is idempotent,
an RL phase ends with a sweep and, after the last, the final cut; rank 0 says once at which step the cut
came. A real `LearnerSession` runs under it, its syncer the test (`learner_harness.MemoryLink`); ranks
exchange one typed `Outcome`."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from learner_harness import MemoryLink, hand_fed

from yeto_core.conductor import Outcome
from yeto_core.island import IslandSession
from yeto_core.learner import LearnerSession
from yeto_core.wire.messages import Done

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

CUT = torch.full((2,), 5.0)


def island_of(session: LearnerSession, **kwargs: Any) -> IslandSession:
    """An island of one process around `session` (the session the island built for itself is replaced
    before it connects)."""
    island = IslandSession(session.settings, [("w", torch.zeros(2))], **kwargs)
    island.session = session
    return island


def started(w: torch.Tensor, **settings: Any) -> tuple[IslandSession, LearnerSession, MemoryLink, list[int]]:
    """An island joined at the trainer's step 10 whose syncer sends the final cut once it hears DONE;
    `finals` counts the DONEs it heard (one per wait for the final cut)."""
    session, link, _, _ = hand_fed([("w", w)], **settings)
    link.bcast(0, 0, 0, torch.zeros(2))
    island = island_of(session, on_final="the test stops")
    island.start(first_step=10)
    finals: list[int] = []

    def syncer() -> None:
        dones = sum(isinstance(m, Done) for m in link.sent)
        if dones and not session.final_ready and len(finals) < dones:
            finals.append(dones)
            link.final(0, 1, CUT)

    link.on_wait = syncer
    return island, session, link, finals


def test_the_last_step_waits_for_the_final_cut_and_a_second_finish_waits_for_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    w = torch.zeros(2)
    island, _, link, finals = started(w, sync_interval=100)
    caplog.set_level(logging.WARNING, logger="yeto.island")
    assert not island.step(4) and not island.final
    assert island.step(4, last=True) and island.final and torch.equal(w, CUT)
    assert island.finish() and island.step(4)  # nothing asked again, nothing counted
    assert finals == [1] and sum(isinstance(m, Done) for m in link.sent) == 1
    assert island.stats.steps == 2
    said = [r.getMessage() for r in caplog.records if "final cut installed" in r.getMessage()]
    assert said == ["yeto learner 0: final cut installed at step 12, the trainer's last; the test stops"]
    island.close()


def test_finish_after_training_ended_early_is_asked_once() -> None:
    island, _, link, finals = started(torch.zeros(2), sync_interval=100)
    island.step(4)
    assert island.finish() and island.finish()
    assert finals == [1] and sum(isinstance(m, Done) for m in link.sent) == 1
    island.close()
    island.close()  # closing twice is harmless too


def test_an_rl_phase_sweeps_and_the_last_one_ends_with_the_final_cut() -> None:
    w = torch.zeros(2)
    island, _, _, finals = started(w, rl_mode="sweep", sync_interval=100)
    island.step(4)
    assert not island.end_iteration() and not finals  # a sweep; no PULL held, nothing to wait for
    assert island.end_iteration(last=True) and island.final and torch.equal(w, CUT) and finals == [1]
    assert island.end_iteration(last=True) and finals == [1]
    island.close()


def test_an_outcome_travels_as_one_header() -> None:
    for outcome in (Outcome(), Outcome(True, False, 3, 2), Outcome(False, True, 7, 9), Outcome(True, True, 0, 1)):
        assert Outcome.from_header(*outcome.header()) == outcome
