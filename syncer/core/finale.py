"""The end of a run (DESIGN §4.7): abandon the rounds in flight, make the final state durable, send
the final cut to every learner, and wait, until `--final-timeout-s`, for the learners that should
get it: those connected, and those that trained and lost their link without saying goodbye.
"""

from __future__ import annotations

import logging

from syncer.core.effects import Checkpoint, FaultPoint, Log
from syncer.core.links import Link, Phase
from syncer.core.outbox import Outbox
from syncer.core.run_state import RunState

log = logging.getLogger("yeto.syncer")


class Finale:
    def __init__(self, run: RunState, outbox: Outbox) -> None:
        self.shared = run
        self.outbox = outbox
        self.deadline = 0.0
        # Learners a finalizing syncer waits for even while they are not connected, until the
        # deadline: those that trained and lost their link without saying goodbye before the
        # final cut went out, and after a resume from a final checkpoint everyone who trained.
        self.expected: set[int] = set()
        self.acked: set[int] = set()

    def on_bye(self, link: Link) -> None:
        """A learner said goodbye: after the final cut, it has it; before, it stopped on purpose."""
        link.said_bye = True
        link.acked = link.final_sent
        if link.acked:
            self.acked.add(link.learner_id)
        elif self.shared.state is None or not self.shared.state.finalized:
            self.expected.discard(link.learner_id)

    def note_departure(self, link: Link) -> None:
        """A learner's connection ended: whom a finalizing syncer still waits for. Only its goodbye
        says it has the final cut: a FINAL handed to a connection that then died may never have
        arrived, so such a learner is expected back like one that never got it."""
        if link.said_bye or self.shared.state is None:
            return
        # It trained on this run's model (merged or not yet) and may come back (a crash, a stall,
        # a cut link): a finalizing syncer waits for it, until the deadline, so it still gets the cut.
        self.expected.add(link.learner_id)

    def wait_over(self, now: float) -> bool:
        unacked = {lid for lid, link in self.shared.links.items() if not link.acked}
        waiting = sorted(unacked | (self.expected - self.acked))
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
                run.record({"event": "abandon", "round": entry.round, "attempt": entry.attempt.attempt,
                                 "reason": "finalizing"})
        state.finalized = True
        if save:
            run.emit(Checkpoint(wait=True))  # durable before any FINAL goes out
            run.record({"event": "final", "rounds": state.next_round, "versions": state.versions,
                             "reason": reason, "ledger": dict(state.ledger)})
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
