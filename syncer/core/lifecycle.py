"""One learner's life in a run, as the syncer's protocol knows it (DESIGN §4.2, §4.7).

Each learner id the run has met is in exactly one state, kept across its connections; every
change is checked against the transition table, as rounds are (`round_table.py`):

    joins ──► TRAINING ──DONE──► FINISHED ──FINAL──► CUT_SENT ──goodbye──► HAS_CUT
                 │                   │                   │
                 │ leaves            │ leaves            │ leaves, no goodbye
                 ▼                   ▼                   ▼
               AWAY                LOST ◄────────────────┘         a goodbye before the cut: QUIT

A join (a redial, a restarted process) starts it TRAINING again from any state; a FINAL goes to
every connected learner at once (one that already said goodbye stays QUIT). Whom the run waits
for follows from the states alone: rounds wait for TRAINING learners; finalization waits
`--rejoin-wait-s` for AWAY ones (they may come back to train); a finalizing syncer waits, until
its deadline, for every learner not HAS_CUT or QUIT: AWAY only if it trained (pushed, finished,
or named by a resumed checkpoint), LOST always, since only the goodbye a learner says once it
installed the cut proves it arrived, and a FINAL handed to a link that had died unnoticed looks
sent. Quorums stop counting on a learner once it said DONE.
"""

from __future__ import annotations

import dataclasses
import enum


class Life(enum.Enum):
    TRAINING = "training"  # connected, training
    FINISHED = "finished"  # connected, said DONE: waits for the final cut
    CUT_SENT = "final cut sent"  # connected, every FINAL went out
    HAS_CUT = "has the final cut"  # said goodbye after the FINAL: done for good
    QUIT = "quit"  # said goodbye before the final cut: stopped on purpose
    AWAY = "away"  # left while training, without a goodbye: may come back to train
    LOST = "lost"  # left after DONE or a FINAL, without a goodbye: may come back for the cut


TRANSITIONS: dict[Life, frozenset[Life]] = {
    Life.TRAINING: frozenset({Life.FINISHED, Life.CUT_SENT, Life.QUIT, Life.AWAY}),
    Life.FINISHED: frozenset({Life.CUT_SENT, Life.QUIT, Life.LOST}),
    Life.CUT_SENT: frozenset({Life.HAS_CUT, Life.QUIT, Life.LOST}),
    Life.HAS_CUT: frozenset(),
    Life.QUIT: frozenset(),
    Life.AWAY: frozenset(),
    Life.LOST: frozenset(),
}
WAITED_FOR = frozenset({Life.TRAINING, Life.FINISHED, Life.CUT_SENT, Life.AWAY, Life.LOST})  # by a finalizing syncer


class LifecycleError(RuntimeError):
    """A change of a learner's state that its lifecycle does not allow: a bug, never a peer's doing."""


@dataclasses.dataclass
class LearnerLife:
    state: Life
    since: float  # when it entered that state
    # It said DONE since it last joined: it finished training on purpose, so quorums no longer
    # count on it, whatever it does next (a goodbye, a lost link).
    done: bool = False
    # It pushed (or finished, or a resumed checkpoint names it): a finalizing syncer waits for it
    # to come back for the cut. A peer that only connected and left while training is not waited
    # for, though it gets the cut if it comes back while the syncer finalizes.
    trained: bool = False

    def move(self, to: Life, now: float, learner_id: int) -> None:
        if to is not self.state and to not in TRANSITIONS[self.state]:
            raise LifecycleError(f"learner {learner_id}: {self.state.value} -> {to.value} is not a transition")
        if to is not self.state:
            self.state, self.since = to, now


class Lives:
    """Every learner's `LearnerLife`, and the questions the protocol asks of them."""

    def __init__(self) -> None:
        self.by_id: dict[int, LearnerLife] = {}

    def __getitem__(self, learner_id: int) -> LearnerLife:
        return self.by_id[learner_id]

    def get(self, learner_id: int) -> Life | None:
        life = self.by_id.get(learner_id)
        return life.state if life is not None else None

    def joined(self, learner_id: int, now: float) -> None:
        """A connection passed its handshake: whatever came before, it trains (again)."""
        before = self.by_id.get(learner_id)
        self.by_id[learner_id] = LearnerLife(Life.TRAINING, now, trained=before is not None and before.trained)

    def expect(self, learner_id: int, state: Life, now: float) -> None:
        """A resumed syncer: a learner its checkpoint names, not connected yet (AWAY or LOST)."""
        assert state in (Life.AWAY, Life.LOST)
        self.by_id.setdefault(learner_id, LearnerLife(state, now, trained=True))

    def move(self, learner_id: int, to: Life, now: float) -> None:
        self.by_id[learner_id].move(to, now, learner_id)

    def left(self, learner_id: int, now: float, *, trained: bool) -> None:
        """Its connection ended. `trained`: the run had a model, so it may come back; a learner that
        leaves before that is forgotten, as if it never came."""
        life = self.by_id.get(learner_id)
        if life is None:
            return
        if not trained:
            del self.by_id[learner_id]
        elif life.state is Life.TRAINING:
            life.move(Life.AWAY, now, learner_id)
        elif life.state in (Life.FINISHED, Life.CUT_SENT):
            life.move(Life.LOST, now, learner_id)

    def finished(self) -> list[int]:
        """Learners that finished training on purpose (DONE) since they last joined."""
        return sorted(lid for lid, life in self.by_id.items() if life.done)

    def ids(self, *states: Life) -> list[int]:
        return sorted(lid for lid, life in self.by_id.items() if life.state in states)

    def away(self) -> dict[int, float]:
        """Learners that left while training -> when: finalization waits for them to come back."""
        return {lid: life.since for lid, life in self.by_id.items() if life.state is Life.AWAY}

    def waited_for(self) -> list[int]:
        """Whom a finalizing syncer still waits for: the connected ones without the cut, those lost
        after a FINAL or DONE without the goodbye, and those away that trained."""
        return sorted(lid for lid, life in self.by_id.items() if life.state in WAITED_FOR
                      and (life.trained or life.state is not Life.AWAY))

