"""The end of a run (DESIGN §4.7): abandon the rounds in flight, make the final state durable, send
the final cut to every learner, and wait, until `--final-timeout-s`, for the learners that should
get it: those connected, those that lost their link after a FINAL or DONE without the goodbye
that confirms the cut, and those that trained and left while training.
"""

from __future__ import annotations

import logging

from syncer.core import records
from syncer.core.effects import Checkpoint, FaultPoint, Log
from syncer.core.lifecycle import Life
from syncer.core.links import Link, Phase
from syncer.core.outbox import Outbox
from syncer.core.run_state import RunState

log = logging.getLogger("yeto.syncer")


class Finale:
    def __init__(self, run: RunState, outbox: Outbox) -> None:
        self.shared = run
        self.outbox = outbox
        self.deadline = 0.0

    def on_bye(self, link: Link) -> None:
        """A learner said goodbye: after the final cut, it has it; before, it stopped on purpose."""
        lives, lid = self.shared.lives, link.learner_id
        state = lives.get(lid)
        if state is Life.CUT_SENT:
            lives.move(lid, Life.HAS_CUT, self.shared.now)
        elif state in (Life.TRAINING, Life.FINISHED):
            lives.move(lid, Life.QUIT, self.shared.now)

    def wait_over(self, now: float) -> bool:
        """Whether finalizing is over: every learner that may still want the cut has it, or the
        deadline passed (a learner that lost its link may come back for the cut until then)."""
        waiting = self.shared.lives.waited_for()
        if waiting and now <= self.deadline:
            return False
        if waiting:
            log.warning("learners %s did not confirm the final cut in time", waiting)
        return True

    def begin(self, reason: str, *, save: bool = True) -> None:
        run, state = self.shared, self.shared.state
        assert state is not None
        for entry in run.rounds.abandon_all("finalizing"):
            if entry.attempt is not None:
                run.record(records.Abandon(entry.round, entry.attempt.attempt, "finalizing"))
        state.finalized = True
        if save:
            run.emit(Checkpoint(wait=True))  # durable before any FINAL goes out
            run.record(records.Final(state.next_round, list(state.versions), reason, dict(state.ledger)))
        run.emit(Log(f"finalizing after {state.next_round} rounds: {reason}; sending the final cut to "
                     f"{len(run.links)} learners"))
        run.phase = Phase.FINALIZING
        self.deadline = run.now + run.settings.final_timeout_s
        links = list(run.links.values())
        if len(links) < 2:
            run.emit(FaultPoint("mid-final"))
        for n, link in enumerate(links):
            self.outbox.send_final(link)
            if n == 0 and len(links) > 1:  # the point falls between the first learner's cut and the others'
                run.emit(FaultPoint("mid-final", drain=True))
