"""What a merged round becomes (DESIGN §4.1, §6.2): the commit, in the order the contract wants.

The shell has merged a closed round into the fragment's params and momentum (`effects.Merge`,
`round_merge.py`) and hands back the outcome. The commit then bumps the fragment's version, moves
the round to COMMITTED, credits each merged learner's tokens to the ledger, and emits, in order:
the `mid-merge` fault point, the checkpoint when one is due, the tape record, the broadcasts and
the consensus figures — so a checkpoint is durable before any learner hears of what it holds. A
delta broadcast is encoded by the shell first (an ask, `outbox.py`); what follows it waits in the
stream for the answer, so the order stays the same.
A round whose every delta would overflow the fragment commits nothing and is parked for a retry.
Its one log line comes last, so it is written once the shell has performed all of it.
"""

from __future__ import annotations

import logging

from syncer.core import records
from syncer.core.effects import Checkpoint, FaultPoint, Log, Record, Send
from syncer.core.memory import keep_merged
from syncer.core.outbox import Outbox
from syncer.core.rounds import Attempt, smoothed
from syncer.core.run_state import RunState
from syncer.durability.checkpoint import ledger_key
from syncer.merge.merge import raw_weight
from syncer.merge.round_merge import MergeOutcome
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import Error

log = logging.getLogger("yeto.syncer")


class Commit:
    def __init__(self, run: RunState, outbox: Outbox) -> None:
        self.shared = run
        self.outbox = outbox
        self.sync_s: float | None = None  # ξ_sync: EMA of the time a commit holds the coordinator
        self._committed: int | None = None  # the round committed by the last merge, if any

    def merged(self, round_id: int, out: MergeOutcome) -> None:
        self._committed = None
        run, state = self.shared, self.shared.state
        entry = run.rounds.entry(round_id)
        assert state is not None and entry is not None and entry.attempt is not None
        attempt, reason, live = entry.attempt, entry.reason, entry.live
        for lid, largest in out.overflowed.items():
            self._overflowed(attempt, lid, largest)
        f = attempt.fragment
        if not out.answers:  # nothing was written: the round goes round again
            self.discard(attempt, f"every delta would overflow fragment {f} (learners {sorted(out.overflowed)})")
            return
        run.emit(FaultPoint("mid-merge"))
        answers, weights = out.answers, out.weights
        state.versions[f] += 1
        state.next_round = attempt.round + 1
        run.rounds.commit(attempt.round, reason)
        state.merged_by[f] = (attempt.round, sorted(a.learner_id for a in answers))
        run.merged_versions.setdefault(f, {}).update((a.learner_id, state.versions[f]) for a in answers)
        run.merged_weights.update((a.learner_id, raw_weight(a.tokens, a.steps)) for a in answers)
        for a in answers:
            key = ledger_key(a.learner_id, a.generation)
            state.ledger[key] = state.ledger.get(key, 0) + a.tokens
            run.merged_rounds.setdefault(a.origin, set()).add(a.learner_id)
        # A push later than max_base_lag commits of its fragment is refused anyway: older rounds go.
        # What is left goes into the checkpoint, so a resumed syncer refuses a push sent twice too.
        keep_merged(state, run.merged_rounds, run.settings.max_base_lag)
        total = run.settings.total_rounds
        last = bool(total) and state.next_round >= total  # finalization writes that cut, once
        numel = run.layout.fragments[f].numel if run.layout is not None else 0
        record = records.Commit(
            round=attempt.round, attempt=attempt.attempt, fragment=f, version=state.versions[f],
            learners=[a.learner_id for a in answers], generations=[a.generation for a in answers],
            answered=[a.learner_id for a in answers if not a.carried],
            carried=[a.learner_id for a in answers if a.carried],
            waited_for=sorted(a.learner_id for a in answers if attempt.quorum_at is not None
                              and not a.carried and a.at > attempt.quorum_at),
            not_waited_for=sorted(lid for lid in attempt.members if lid not in attempt.answers and lid in live),
            dropped=sorted(lid for lid in attempt.members if lid not in attempt.answers and lid not in live),
            base_versions=[a.base_version for a in answers], grace_ms=round(attempt.grace_s * 1000, 1),
            weights=[round(w, 6) for w in weights], tokens=[a.tokens for a in answers],
            steps=[a.steps for a in answers], ages=[a.age for a in answers],
            delta_norms=[round(n, 6) for n in out.delta_norms],
            outer_grad_norm=out.outer_grad_norm, merge_ms=round(out.merge_ms, 3),
            wait_ms=round((run.now - attempt.launched_at) * 1000, 1), reason=reason,
            bytes_in=sum(a.nbytes for a in answers), bytes_out=self.outbox.broadcast_bytes(attempt.round, f),
            receivers=len(run.links), numel=numel, overflowed=sorted(out.overflowed) if out.overflowed else None,
            moments=[a.learner_id for a in answers if a.moment is not None] or None,
            # DESIGN §8: the learners' JS distance, each fragment's L2 drift
            extra=run.consensus.on_commit(f, out.delta_norms) if run.consensus is not None else {},
        )
        due = state.next_round % run.settings.checkpoint_every == 0 and not last
        if due:
            run.emit(Checkpoint())
        run.emit(Record(record, checkpoint_ms=due))
        self.outbox.broadcast(attempt.round, f, merged=set(record.learners))
        self.outbox.send_consensus(attempt.round)
        carried = f" (carried {record.carried})" if record.carried else ""
        suffix = run.consensus.log_suffix() if run.consensus is not None else ""
        run.emit(Log(f"round {attempt.round} committed: fragment {f} -> v{state.versions[f]}, learners "
                     f"{record.learners}{carried}, weights {[f'{w:.2f}' for w in weights]}, |outer grad| "
                     f"{out.outer_grad_norm:.4g}, merge {out.merge_ms:.1f} ms ({reason}){suffix}"))
        self._committed = attempt.round

    def synced(self, round_id: int, seconds: float) -> None:
        """The shell performed round `round_id`'s merge and commit in `seconds`: a ξ_sync sample."""
        if self._committed != round_id:
            return  # nothing was committed (every delta would overflow): no sample
        self.sync_s = smoothed(self.sync_s, seconds)
        self._committed = None

    def discard(self, attempt: Attempt, reason: str) -> None:
        """The attempt is over without a commit: its round is parked, to be launched again."""
        log.warning("round %d attempt %d discarded: %s", attempt.round, attempt.attempt, reason)
        self.shared.record(records.Retry(attempt.round, attempt.attempt, attempt.fragment, reason,
                                         sorted(attempt.answers)))
        self.shared.rounds.park(attempt.round, reason)

    def _overflowed(self, attempt: Attempt, learner_id: int, largest: float) -> None:
        """A finite delta that would still have made the merged fragment Inf: left out, said."""
        reason = (f"delta for fragment {attempt.fragment} (largest |value| {largest:.3g}) would overflow the merged "
                  f"fragment; round {attempt.round} merged without it")
        log.warning("learner %d: push for round %d refused: %s", learner_id, attempt.round, reason)
        self.shared.record(records.Refused(learner_id, round=attempt.round, reason=reason, overflow=True))
        link = self.shared.links.get(learner_id)
        answer = attempt.answers[learner_id]
        if link is not None and link.generation == answer.generation:
            self.shared.emit(Send(link.peer, Error(ErrorCode.REFUSED, reason)))
