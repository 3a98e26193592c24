"""The round lifecycle's table: every state, every allowed move, and a loud error for the rest."""

from __future__ import annotations

import pytest

from syncer.core.round_table import TRANSITIONS, IllegalTransition, RoundTable
from syncer.core.rounds import Attempt, RoundState

pytestmark = pytest.mark.unit

S = RoundState


def attempt(round_id: int, n: int = 1, fragment: int = 0) -> Attempt:
    return Attempt(round=round_id, attempt=n, fragment=fragment, version=0, members={0: 1, 1: 1}, quorum=2,
                   launched_at=0.0, deadline=10.0)


def test_every_state_has_its_moves_and_the_ends_have_none() -> None:
    assert set(TRANSITIONS) == set(RoundState)
    assert TRANSITIONS[S.COMMITTED] == TRANSITIONS[S.ABANDONED] == frozenset()
    assert all(S.UNLAUNCHED not in moves for moves in TRANSITIONS.values())  # nothing goes back to unlaunched


def test_a_round_goes_open_grace_closed_committed() -> None:
    table = RoundTable()
    assert table.state_of(0, next_round=0) is S.UNLAUNCHED
    table.launch(attempt(0), "2 learners eligible")
    assert table.state_of(0, 0) is S.OPEN and table.attempt_of(0) is not None and len(table) == 1
    table.enter_grace(0, quorum_at=1.5, grace_s=0.25, reason="in grace")
    a = table.attempt_of(0)
    assert a is not None and (a.quorum_at, a.grace_s) == (1.5, 0.25) and table.collecting_on(0) is a
    table.close(0, "2 of 2 answered", {0: 1, 1: 1})
    entry = table.entry(0)
    assert entry is not None and entry.state is S.CLOSED and entry.live == {0: 1, 1: 1}
    assert table.attempt_of(0) is None and table.collecting() == []  # a closed round takes no answers
    table.commit(0, "2 of 2 answered")
    assert table.state_of(0, next_round=1) is S.COMMITTED and len(table) == 0


def test_a_parked_round_is_relaunched_under_a_new_attempt() -> None:
    table = RoundTable()
    table.launch(attempt(3, n=1), "launch")
    table.park(3, "quorum 2 unreachable")
    assert table.state_of(3, 0) is S.PARKED and table.attempt_of(3) is None
    assert [e.round for e in table.in_state(S.PARKED)] == [3]
    table.launch(attempt(3, n=2), "relaunched")
    a = table.attempt_of(3)
    assert a is not None and a.attempt == 2


@pytest.mark.parametrize(("moves", "illegal"), [
    ([], "commit"),  # an unlaunched round cannot commit
    (["launch"], "commit"),  # nor an open one: it must close first
    (["launch", "park"], "close"),  # a parked round has no attempt to decide
    (["launch", "grace"], "park"),  # past quorum an attempt never becomes unreachable
    (["launch", "close"], "launch"),  # a closed round is not launched again
])
def test_moves_outside_the_lifecycle_fail_loudly(moves: list[str], illegal: str) -> None:
    table = RoundTable()
    do = {
        "launch": lambda: table.launch(attempt(5), "launch"),
        "grace": lambda: table.enter_grace(5, quorum_at=1.0, grace_s=0.0, reason="grace"),
        "close": lambda: table.close(5, "closed", {}),
        "park": lambda: table.park(5, "parked"),
        "commit": lambda: table.commit(5, "committed"),
    }
    for move in moves:
        do[move]()
    with pytest.raises(IllegalTransition, match=r"round 5: .* is not a move of the round lifecycle"):
        do[illegal]()


def test_finalization_abandons_whatever_is_in_flight() -> None:
    table = RoundTable()
    table.launch(attempt(0), "launch")
    table.launch(attempt(1, fragment=1), "launch")
    table.close(1, "closed", {})
    table.launch(attempt(2, fragment=2), "launch")
    table.park(2, "deadline passed")
    abandoned = table.abandon_all("finalizing")
    assert [(e.round, e.state) for e in abandoned] == [(0, S.ABANDONED), (1, S.ABANDONED), (2, S.ABANDONED)]
    assert len(table) == 0
