"""Round decisions are pure functions of state and time; each returns its reason."""

import pytest
import torch

from syncer.rounds import (
    Answer,
    Attempt,
    Verdict,
    attempt_quorum,
    decide_round,
    fragment_of_round,
    should_finalize,
    should_launch,
)

pytestmark = pytest.mark.unit


def attempt(members: dict[int, int], quorum: int, answered: tuple[int, ...] = (), deadline: float = 10.0) -> Attempt:
    a = Attempt(round=7, attempt=3, fragment=3, version=1, members=dict(members), quorum=quorum, launched_at=0.0,
                deadline=deadline)
    for lid in answered:
        a.answers[lid] = Answer(lid, members[lid], tokens=100, steps=4, delta=torch.zeros(2))
    return a


def test_commit_when_every_member_answered() -> None:
    verdict, reason = decide_round(1.0, attempt({0: 1, 1: 1}, 2, (0, 1)), live={0: 1, 1: 1})
    assert verdict is Verdict.COMMIT and "2 of 2" in reason


def test_commit_at_quorum_without_waiting_for_the_rest() -> None:
    verdict, reason = decide_round(1.0, attempt({0: 1, 1: 1, 2: 1}, 2, (0, 2)), live={0: 1, 1: 1, 2: 1})
    assert verdict is Verdict.COMMIT and "quorum 2 reached" in reason


def test_wait_below_quorum_before_the_deadline() -> None:
    verdict, reason = decide_round(1.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1, 1: 1})
    assert verdict is Verdict.WAIT and "1 of quorum 2" in reason


def test_retry_after_the_deadline_below_quorum() -> None:
    verdict, reason = decide_round(10.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1, 1: 1})
    assert verdict is Verdict.RETRY and "deadline" in reason


def test_retry_at_once_when_quorum_became_unreachable() -> None:
    # learner 1 disconnected: nothing can close this attempt any more
    verdict, reason = decide_round(1.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1})
    assert verdict is Verdict.RETRY and "unreachable" in reason


def test_a_reconnected_member_does_not_count_for_a_frozen_attempt() -> None:
    # learner 1 came back as generation 2; the attempt froze generation 1
    verdict, _ = decide_round(1.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1, 1: 2})
    assert verdict is Verdict.RETRY


def test_a_disconnect_does_not_erase_an_accepted_answer() -> None:
    verdict, _ = decide_round(1.0, attempt({0: 1, 1: 1}, 2, (0, 1)), live={})
    assert verdict is Verdict.COMMIT


@pytest.mark.parametrize(("k", "m", "finished", "expected"), [(2, 2, 0, 2), (2, 2, 1, 1), (3, 4, 0, 3),
                                                              (3, 4, 2, 2), (2, 2, 2, 1)])
def test_quorum_lowers_only_for_finished_learners(k: int, m: int, finished: int, expected: int) -> None:
    assert attempt_quorum(k, m, finished) == expected


def test_rounds_stagger_over_fragments() -> None:
    assert [fragment_of_round(r, 4) for r in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_launch_rules() -> None:
    assert should_launch(eligible=2, quorum=2, next_round=0, total_rounds=10, in_flight=False)[0]
    go, why = should_launch(eligible=1, quorum=2, next_round=0, total_rounds=10, in_flight=False)
    assert not go and "1 connected, quorum 2" in why
    assert not should_launch(eligible=2, quorum=2, next_round=10, total_rounds=10, in_flight=False)[0]
    assert not should_launch(eligible=2, quorum=2, next_round=0, total_rounds=10, in_flight=True)[0]
    assert should_launch(eligible=2, quorum=2, next_round=99, total_rounds=0, in_flight=False)[0]


def test_finalize_rules() -> None:
    assert should_finalize(next_round=10, total_rounds=10, training=2, finished=0) == (True, "completed 10 rounds")
    assert not should_finalize(next_round=3, total_rounds=10, training=1, finished=1)[0]
    done, why = should_finalize(next_round=3, total_rounds=10, training=0, finished=2)
    assert done and "finished training" in why
    assert not should_finalize(next_round=3, total_rounds=0, training=0, finished=0)[0]
