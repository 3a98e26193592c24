"""A learner's lifecycle in the syncer (`syncer/core/lifecycle.py`): states, transitions, whom the
run waits for."""

from __future__ import annotations

import pytest

from syncer.core.lifecycle import TRANSITIONS, Life, LifecycleError, Lives

pytestmark = pytest.mark.unit


def test_a_learner_that_trains_to_the_end_and_confirms_the_cut() -> None:
    lives = Lives()
    lives.joined(3, 1.0)
    assert lives.get(3) is Life.TRAINING and lives.waited_for() == [3]
    lives[3].done = True
    lives.move(3, Life.FINISHED, 2.0)
    assert lives.finished() == [3]
    lives.move(3, Life.CUT_SENT, 3.0)
    lives.move(3, Life.HAS_CUT, 4.0)
    assert lives.waited_for() == [] and lives[3].since == 4.0


def test_leaving_without_a_goodbye_is_away_while_training_and_lost_after() -> None:
    lives = Lives()
    for lid in (0, 1, 2, 3):
        lives.joined(lid, 0.0)
    lives[1].done = True
    lives.move(1, Life.FINISHED, 1.0)
    lives.move(2, Life.FINISHED, 1.0)
    lives.move(2, Life.CUT_SENT, 2.0)
    lives[0].trained = lives[1].trained = lives[2].trained = True  # learner 3 only connected: it pushed nothing
    for lid in (0, 1, 2, 3):
        lives.left(lid, 5.0, trained=True)
    assert [lives.get(lid) for lid in (0, 1, 2, 3)] == [Life.AWAY, Life.LOST, Life.LOST, Life.AWAY]
    assert lives.away() == {0: 5.0, 3: 5.0} and lives.waited_for() == [0, 1, 2]
    lives.joined(3, 6.0)
    assert lives.waited_for() == [0, 1, 2, 3]  # connected again: it gets the cut like anyone


def test_a_final_cut_sent_into_a_dead_link_is_waited_for_even_from_a_learner_that_never_pushed() -> None:
    # Its link died unnoticed before any push got through; the syncer finalized and handed it the
    # FINAL, which looked sent. Until its goodbye it may be training on, and will redial for the cut.
    lives = Lives()
    lives.joined(2, 0.0)
    lives.move(2, Life.CUT_SENT, 3.0)
    lives.left(2, 4.0, trained=True)
    assert lives.get(2) is Life.LOST and not lives[2].trained and lives.waited_for() == [2]


def test_a_goodbye_ends_the_wait_for_a_learner_and_a_join_starts_it_over() -> None:
    lives = Lives()
    lives.joined(0, 0.0)
    lives.move(0, Life.QUIT, 1.0)
    lives.left(0, 2.0, trained=True)
    assert lives.get(0) is Life.QUIT and lives.waited_for() == []
    lives.joined(0, 3.0)
    assert lives.get(0) is Life.TRAINING and not lives[0].done


def test_leaving_before_the_model_is_pinned_forgets_the_learner() -> None:
    lives = Lives()
    lives.joined(4, 0.0)
    lives.left(4, 1.0, trained=False)
    assert lives.get(4) is None and lives.waited_for() == []


def test_a_resumed_syncer_expects_the_learners_its_checkpoint_names() -> None:
    lives = Lives()
    lives.expect(0, Life.AWAY, 7.0)
    lives.expect(1, Life.LOST, 7.0)
    assert lives.away() == {0: 7.0} and lives.waited_for() == [0, 1]


@pytest.mark.parametrize("start", list(Life))
def test_every_change_outside_the_table_is_refused(start: Life) -> None:
    for to in Life:
        lives = Lives()
        lives.joined(0, 0.0)
        lives[0].state = start
        if to is start or to in TRANSITIONS[start]:
            lives.move(0, to, 1.0)
            assert lives.get(0) is to
        else:
            with pytest.raises(LifecycleError, match=f"{start.value} -> {to.value}"):
                lives.move(0, to, 1.0)
