"""The round lifecycle (DESIGN §4.3): every round in flight, its state, and the moves between states.

A round is launched (OPEN), reaches quorum and waits out its grace window (GRACE), is decided
(CLOSED) and, strictly in round order, COMMITTED. An attempt that can no longer reach quorum is
discarded and its round PARKED until a quorum of learners is live again, then relaunched under
a new attempt id. Finalization ABANDONS whatever has not committed. The table holds only rounds
in flight; a round it does not hold is COMMITTED below the next round to commit, else
UNLAUNCHED. Every move is checked against `TRANSITIONS`, so a coordinator bug that would, say,
commit a parked round fails loudly instead of corrupting the run.

    UNLAUNCHED ─▶ OPEN ─▶ GRACE ─▶ CLOSED ─▶ COMMITTED
                   │ ▲              │
                   ▼ │              │ (every delta would overflow)
                  PARKED ◀──────────┘          any in flight ─▶ ABANDONED
"""

from __future__ import annotations

import dataclasses

from syncer.core.rounds import Attempt, RoundState

S = RoundState
TRANSITIONS: dict[RoundState, frozenset[RoundState]] = {
    S.UNLAUNCHED: frozenset({S.OPEN}),
    S.OPEN: frozenset({S.GRACE, S.CLOSED, S.PARKED, S.ABANDONED}),
    S.GRACE: frozenset({S.CLOSED, S.ABANDONED}),  # past quorum an attempt never becomes unreachable
    S.PARKED: frozenset({S.OPEN, S.ABANDONED}),
    S.CLOSED: frozenset({S.COMMITTED, S.PARKED, S.ABANDONED}),
    S.COMMITTED: frozenset(),
    S.ABANDONED: frozenset(),
}
COLLECTING = frozenset({S.OPEN, S.GRACE})  # states whose attempt takes answers


class IllegalTransition(RuntimeError):
    """A move the round lifecycle does not allow: a coordinator bug, never a peer's doing."""


@dataclasses.dataclass
class RoundEntry:
    round: int
    state: RoundState
    attempt: Attempt | None = None  # the latest attempt (kept while parked, for the tape)
    reason: str = ""  # why it took its current state
    live: dict[int, int] = dataclasses.field(default_factory=dict)  # learners live when it closed


class RoundTable:
    def __init__(self) -> None:
        self._rounds: dict[int, RoundEntry] = {}

    # -- reading -----------------------------------------------------------------------------
    def state_of(self, round_id: int, next_round: int) -> RoundState:
        entry = self._rounds.get(round_id)
        if entry is not None:
            return entry.state
        return S.COMMITTED if round_id < next_round else S.UNLAUNCHED

    def entry(self, round_id: int) -> RoundEntry | None:
        return self._rounds.get(round_id)

    def in_state(self, *states: RoundState) -> list[RoundEntry]:
        """The rounds in any of `states`, in round order."""
        return [e for r, e in sorted(self._rounds.items()) if e.state in states]

    def collecting(self) -> list[Attempt]:
        """The attempts taking answers (OPEN or GRACE), in round order."""
        return [e.attempt for e in self.in_state(*COLLECTING) if e.attempt is not None]

    def attempt_of(self, round_id: int) -> Attempt | None:
        """The round's attempt if it takes answers now, else None."""
        entry = self._rounds.get(round_id)
        return entry.attempt if entry is not None and entry.state in COLLECTING else None

    def collecting_on(self, fragment: int) -> Attempt | None:
        return next((a for a in self.collecting() if a.fragment == fragment), None)

    def __len__(self) -> int:
        """Rounds in flight: launched and neither committed nor abandoned."""
        return len(self._rounds)

    # -- moving ------------------------------------------------------------------------------
    def _move(self, round_id: int, to: RoundState, reason: str) -> RoundEntry:
        entry = self._rounds.get(round_id) or RoundEntry(round_id, S.UNLAUNCHED)
        if to not in TRANSITIONS[entry.state]:
            raise IllegalTransition(f"round {round_id}: {entry.state.value} -> {to.value} is not a move of the "
                                    f"round lifecycle ({reason})")
        entry.state, entry.reason = to, reason
        if to in (S.COMMITTED, S.ABANDONED):
            self._rounds.pop(round_id, None)
        else:
            self._rounds[round_id] = entry
        return entry

    def launch(self, attempt: Attempt, reason: str) -> None:
        """A first launch (UNLAUNCHED) or a relaunch (PARKED) under `attempt`."""
        self._move(attempt.round, S.OPEN, reason).attempt = attempt

    def enter_grace(self, round_id: int, *, quorum_at: float, grace_s: float, reason: str) -> None:
        entry = self._move(round_id, S.GRACE, reason)
        assert entry.attempt is not None
        entry.attempt.quorum_at, entry.attempt.grace_s = quorum_at, grace_s

    def close(self, round_id: int, reason: str, live: dict[int, int]) -> None:
        self._move(round_id, S.CLOSED, reason).live = dict(live)

    def park(self, round_id: int, reason: str) -> None:
        self._move(round_id, S.PARKED, reason)

    def commit(self, round_id: int, reason: str) -> None:
        self._move(round_id, S.COMMITTED, reason)

    def abandon_all(self, reason: str) -> list[RoundEntry]:
        """Every round in flight, abandoned (finalization); returned in round order."""
        entries = [self._rounds[r] for r in sorted(self._rounds)]
        for entry in entries:
            self._move(entry.round, S.ABANDONED, reason)
        return entries
