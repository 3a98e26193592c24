"""The end of a run (DESIGN §4.7): abandon the open rounds, make the final state durable, send the
final cut to every learner, and wait, until `--final-timeout-s`, for the learners that should get
it: those connected, and those that trained and lost their link without saying goodbye. Also the
checkpoint writes the coordinator asks for. This mixin holds only those steps; the state it
reads and writes belongs to the `Coordinator` that inherits it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from syncer.checkpoint import CheckpointError, tokens_by_learner
from syncer.links import Link, Phase
from syncer.round_table import RoundTable
from syncer.snapshots import CheckpointWriter
from syncer.tape import EventTape
from yeto_core.faults import FAULT_SEND_WAIT_S, FaultInjector
from yeto_core.settings import SyncerSettings

log = logging.getLogger("yeto.syncer")

PROGRESS_BAR_BYTES = 256 << 20
DURABILITY_EXIT_CODE = 4
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0


class DurabilityLost(Exception):
    """No checkpoint could be written within `checkpoint_retry_s`: the syncer stops."""


class Finale:
    # Provided by the Coordinator (and its Outbox).
    settings: SyncerSettings
    state: Any
    links: dict[int, Link]
    rounds: RoundTable
    tape: EventTape
    writer: CheckpointWriter | None
    phase: Phase
    clock: Callable[[], float]
    faults: FaultInjector
    _final_deadline: float
    _final_expected: set[int]
    _final_acked: set[int]
    _send_final: Callable[..., None]

    def _note_departure(self, link: Link) -> None:
        """A learner's connection ended: whom a finalizing syncer still waits for."""
        if link.final_sent:
            link.acked = True  # whether it installed the cut is its own business now
            self._final_acked.add(link.learner_id)
        elif not link.said_bye and self.state is not None and link.learner_id in tokens_by_learner(self.state.ledger):
            # It trained for this run and may come back (a crash, a stall, a cut link): a
            # finalizing syncer waits for it, until the deadline, so it still gets the cut.
            self._final_expected.add(link.learner_id)

    def _final_wait_over(self, now: float) -> bool:
        waiting = sorted({lid for lid, link in self.links.items() if not link.acked}
                         | (self._final_expected - self._final_acked))
        if waiting and now <= self._final_deadline:
            return False
        if waiting:
            log.warning("learners %s did not confirm the final cut in time", waiting)
        return True

    def _begin_finalizing(self, reason: str, *, save: bool = True) -> None:
        assert self.state is not None
        for entry in self.rounds.abandon_all("finalizing"):
            if entry.attempt is not None:
                self.tape.append({"event": "abandon", "round": entry.round, "attempt": entry.attempt.attempt,
                                  "reason": "finalizing"})
        self.state.finalized = True
        if save:
            self._save_checkpoint(wait=True)  # durable before any FINAL goes out
            self.tape.append({"event": "final", "rounds": self.state.next_round, "versions": self.state.versions,
                              "reason": reason, "ledger": dict(self.state.ledger)})
        log.info("finalizing after %d rounds: %s; sending the final cut to %d learners", self.state.next_round,
                 reason, len(self.links))
        self.phase = Phase.FINALIZING
        self._final_deadline = self.clock() + self.settings.final_timeout_s
        links = list(self.links.values())
        if len(links) < 2:
            self.faults.point("mid-final")
        for n, link in enumerate(links):
            some = n == 0 and len(links) > 1
            self._send_final(link, wait_s=FAULT_SEND_WAIT_S if some and self.faults.armed("mid-final") else 0.0)
            if some:
                self.faults.point("mid-final")

    def _show_progress(self) -> bool:
        # A bar only where someone watches, or where the write takes long enough to wonder about.
        assert self.state is not None
        return sum(t.numel() for t in self.state.params) * 8 > PROGRESS_BAR_BYTES or sys.stderr.isatty()

    def _save_checkpoint(self, *, wait: bool = False) -> float | None:
        """Checkpoint the committed state; returns how long the coordinator was held (ms).

        Durable or stop. A failed write (this one, or the background write before it) is retried
        synchronously, with backoff, while the coordinator holds every round: nothing is
        committed or broadcast meanwhile, and the learners train on locally. The previous file
        stays valid throughout. Past `checkpoint_retry_s` it raises `DurabilityLost`."""
        if self.writer is None or self.state is None:
            return None
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.settings.checkpoint_retry_s
        delay, failures = RETRY_FIRST_S, 0
        while True:
            try:
                held = self.writer.save(self.state, wait=wait)
            except CheckpointError as exc:
                failures += 1
                self.tape.append({"event": "checkpoint_failed", "reason": str(exc)})
                left = deadline - time.monotonic()
                if left <= 0:
                    retry = self.settings.checkpoint_retry_s
                    raise DurabilityLost(f"{exc}; no checkpoint could be written in {retry:g} s "
                                         "(--checkpoint-retry-s), so the syncer stops: nothing after the previous "
                                         "checkpoint is durable") from exc
                log.error("%s; holding every round and retrying in %.1f s (learners train on locally)", exc,
                          min(delay, left))
                time.sleep(min(delay, left))
                delay, wait = min(2 * delay, RETRY_MAX_S), True  # retries write synchronously
                continue
            if failures:
                log.warning("checkpoint %s written after %d failed attempt%s; rounds go on", self.writer.path,
                            failures, "" if failures == 1 else "s")
                self.tape.append({"event": "checkpoint_recovered", "failures": failures})
                return (time.perf_counter() - t0) * 1000
            return held
