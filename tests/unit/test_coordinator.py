"""The coordinator's round lifecycle on a fake clock, with the test as every learner: each case runs
in milliseconds and checks the decision the syncer took and the reason it gave (on the tape)."""

from __future__ import annotations

import pytest
from syncer_harness import SyncerUnderTest

from syncer.core.rounds import RoundState
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import BCAST_MERGED, Bye, Error, Pull

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

S = RoundState


def first_pull(s: SyncerUnderTest, lid: int, round_id: int = 0) -> Pull:
    return next(p for p in s.pulls(lid) if p.round == round_id)


def test_the_initial_cut_launches_round_0_to_every_live_learner_with_its_reason() -> None:
    s = SyncerUnderTest(pipeline=1)
    s.start(0, 1)
    (init,) = s.tape.of("init")
    assert init["fragments"] == 2
    assert [len(s.bcasts(lid)) for lid in (0, 1)] == [2, 2]  # the full state, every fragment
    (launch,) = s.tape.of("launch")
    assert launch["round"] == 0 and launch["members"] == [0, 1] and launch["quorum"] == 2
    assert launch["reason"] == "2 learners eligible, quorum 2"
    assert first_pull(s, 0) == first_pull(s, 1) == Pull(0, 1, 0, 0)


def test_a_round_commits_when_every_member_answered_and_broadcasts_flagged_merges() -> None:
    s = SyncerUnderTest(pipeline=1)
    s.start(0, 1)
    pull = first_pull(s, 0)
    s.push(0, pull, 1.0)
    assert s.round_state(0) is S.OPEN and not s.tape.of("commit")
    s.push(1, pull, 3.0)
    (commit,) = s.tape.of("commit")
    assert commit["reason"] == "2 of 2 members answered (quorum 2)" and sorted(commit["learners"]) == [0, 1]
    assert s.round_state(0) is S.COMMITTED
    new = [b for b in s.bcasts(1) if b.version == 1]
    assert len(new) == 1 and new[0].flags & BCAST_MERGED
    assert first_pull(s, 0, 1) == Pull(1, 2, 1, 0)  # round 1 merges fragment 1


def test_grace_waits_for_a_straggler_on_the_clock_then_commits_without_it() -> None:
    s = SyncerUnderTest(learners=3, quorum=2, pipeline=1, grace_s=5.0, sync_interval_steps=0)
    s.start(0, 1, 2)
    pull = first_pull(s, 0)
    s.push(0, pull, 1.0, step_s=1.0)
    s.push(1, pull, 1.0, step_s=1.0)
    assert s.round_state(0) is S.GRACE  # γ·(τ·1 s − 0 − 0) = 2 s of grace for learner 2
    s.advance(1.9)
    assert s.round_state(0) is S.GRACE and not s.tape.of("commit")
    s.advance(0.2)
    (commit,) = s.tape.of("commit")
    assert "grace 2000 ms spent, 1 not waited for" in commit["reason"]
    assert commit["not_waited_for"] == [2] and commit["grace_ms"] == 2000.0


def test_a_straggler_that_answers_in_grace_ends_it_early() -> None:
    s = SyncerUnderTest(learners=3, quorum=2, pipeline=1, grace_s=5.0, sync_interval_steps=0)
    s.start(0, 1, 2)
    pull = first_pull(s, 0)
    s.push(0, pull, 1.0, step_s=1.0)
    s.push(1, pull, 1.0, step_s=1.0)
    s.advance(0.5)
    s.push(2, pull, 1.0, step_s=1.0)
    (commit,) = s.tape.of("commit")
    assert commit["reason"] == "3 of 3 members answered (quorum 2)" and commit["waited_for"] == [2]


def test_grace_counts_from_the_launch_the_wait_for_the_members_boundaries() -> None:
    # H = 8 over 2 fragments, one round in flight: a learner answers at its next boundary, up to 4
    # steps after a launch.
    s = SyncerUnderTest(learners=3, quorum=2, pipeline=1, grace_s=10.0, sync_interval_steps=8)
    s.start(0, 1, 2)
    pull = first_pull(s, 0)
    s.advance(3.0)  # the quorum comes 3 s (three steps) after the launch: members' boundaries, not lateness
    s.push(0, pull, 1.0, step_s=1.0)
    s.push(1, pull, 1.0, step_s=1.0)
    assert s.round_state(0) is S.GRACE  # γ·((4 + τ)·1 s − 3 s − 0) = 3 s of grace for learner 2
    s.advance(2.9)
    assert s.round_state(0) is S.GRACE
    s.advance(0.2)
    (commit,) = s.tape.of("commit")
    assert commit["grace_ms"] == 3000.0 and commit["not_waited_for"] == [2]


def test_a_straggler_far_slower_than_the_fleet_is_not_waited_for() -> None:
    s = SyncerUnderTest(learners=3, quorum=2, pipeline=1, grace_s=10.0, sync_interval_steps=8)
    s.start(0, 1, 2)
    pull = first_pull(s, 0)
    for lid, step_s in ((0, 1.0), (1, 1.0), (2, 4.0)):  # learner 2 trains at a quarter of the others' speed
        s.push(lid, pull, 1.0, step_s=step_s)
    assert s.round_state(0) is S.COMMITTED
    s.advance(4.0)  # one round per (H/P)·ξ_step
    pull = first_pull(s, 0, 1)
    s.push(0, pull, 1.0, step_s=1.0)
    s.push(1, pull, 1.0, step_s=1.0)
    commit = s.tape.of("commit")[-1]  # at once: 4 s a step is more than τ = 2 times the fleet's 1 s
    assert commit["round"] == 1 and commit["grace_ms"] == 0.0 and commit["not_waited_for"] == [2]


def test_an_answer_after_missed_rounds_weighs_less_for_its_age() -> None:
    s = SyncerUnderTest(learners=3, quorum=2, pipeline=1, grace_s=5.0, sync_interval_steps=0)
    s.start(0, 1, 2)
    for r in range(2):  # learner 2 misses round 0 (fragment 0) and round 1 (fragment 1)
        pull = first_pull(s, 0, r)
        s.push(0, pull, 1.0, step_s=1.0)
        s.push(1, pull, 1.0, step_s=1.0)
        s.advance(2.1)  # the grace, 2 s, runs out
    pull = first_pull(s, 0, 2)  # fragment 0 again: learner 2 answers with its progress since the start
    for lid in (0, 1, 2):
        s.push(lid, pull, 1.0, step_s=1.0)
    commit = s.tape.of("commit")[-1]
    assert commit["round"] == 2 and commit["learners"] == [0, 1, 2] and commit["ages"] == [0, 0, 1]
    assert commit["weights"] == pytest.approx([0.4, 0.4, 0.2])  # equal tokens and steps; 1/(1 + 1) for learner 2


def test_the_rendezvous_is_frozen_at_launch() -> None:
    s = SyncerUnderTest(learners=3, quorum=2, pipeline=1)
    s.start(0, 1)  # learner 2 is not there when round 0 launches
    pull = first_pull(s, 0)
    s.join(2)
    s.push(2, pull, 1.0)  # it saw no PULL of this attempt: not a member
    (refused,) = s.tape.of("refused")
    assert refused["learner"] == 2 and "is not a member of round 0 attempt 1" in refused["reason"]
    assert s.groups[2].of(Error)[0].code is ErrorCode.REFUSED
    s.push(0, pull, 1.0)
    s.push(1, pull, 1.0)
    (commit,) = s.tape.of("commit")
    assert sorted(commit["learners"]) == [0, 1]  # never waited for the newcomer


def test_a_departure_that_makes_quorum_unreachable_parks_the_round_until_enough_learners_return() -> None:
    s = SyncerUnderTest(pipeline=1)
    s.start(0, 1)
    s.push(0, first_pull(s, 0), 1.0)
    s.leave(1, "test: cable cut")
    (left,) = s.tape.of("left")
    assert left["learner"] == 1 and left["reason"] == "test: cable cut"
    (retry,) = s.tape.of("retry")
    assert "quorum 2 unreachable: 1 answered, 0 of 2 members still connected" in retry["reason"]
    assert s.round_state(0) is S.PARKED and len(s.tape.of("launch")) == 1  # no relaunch with one learner
    s.advance(10.0)
    assert s.round_state(0) is S.PARKED
    s.join(1)
    relaunch = s.tape.of("launch")[-1]
    assert relaunch["round"] == 0 and relaunch["attempt"] == 2
    assert relaunch["reason"] == "relaunched: 2 learners live, quorum 2"
    assert s.round_state(0) is S.OPEN and first_pull(s, 1).attempt == 2


def test_a_round_below_quorum_is_retried_at_its_deadline() -> None:
    s = SyncerUnderTest(pipeline=1, round_timeout_s=30.0)
    s.start(0, 1)
    s.push(0, first_pull(s, 0), 1.0)
    s.advance(29.0)
    assert s.round_state(0) is S.OPEN
    s.advance(1.0)
    retry, = s.tape.of("retry")
    assert retry["reason"] == "deadline passed with 1 of quorum 2 answers"
    relaunch = s.tape.of("launch")[-1]  # both learners are still live: relaunched at once
    assert (relaunch["round"], relaunch["attempt"]) == (0, 2) and s.round_state(0) is S.OPEN


def test_a_late_push_is_carried_into_its_fragments_next_round() -> None:
    s = SyncerUnderTest(pipeline=1, round_timeout_s=30.0, carry_answers_round=True)
    s.start(0, 1)
    old = first_pull(s, 0)
    s.push(0, old, 1.0)
    s.advance(30.0)  # attempt 1 discarded at its deadline; attempt 2 launched at once
    s.push(1, old, 2.0)  # learner 1 answers the discarded attempt: late, but its base is still current
    (carry,) = s.tape.of("carry")
    assert carry["learner"] == 1 and "late for round 0 attempt 1 (base lag 0): carried" in carry["reason"]
    s.push(0, s.pulls(0)[-1], 1.0)
    (commit,) = s.tape.of("commit")  # the carried answer counts toward this attempt's quorum
    assert commit["attempt"] == 2 and commit["carried"] == [1] and commit["answered"] == [0]


def test_an_overlapping_learners_late_push_is_refused_not_carried() -> None:
    s = SyncerUnderTest(pipeline=1, round_timeout_s=30.0)
    s.start(0, 1, overlap=True)
    old = first_pull(s, 0)
    s.advance(30.0)
    s.push(1, old, 2.0)
    (refused,) = s.tape.of("refused")
    assert "not carried for a learner that overlaps (it pushes it again)" in refused["reason"]
    assert not s.tape.of("carry")


def test_pipelined_rounds_commit_strictly_in_round_order() -> None:
    s = SyncerUnderTest(pipeline=2)
    s.start(0, 1)
    s.advance(0.0)  # one launch per turn of the actor
    r0, r1 = first_pull(s, 0, 0), first_pull(s, 0, 1)
    assert (r0.fragment, r1.fragment) == (0, 1)  # two rounds in flight, on distinct fragments
    s.push(0, r1, 1.0)
    s.push(1, r1, 1.0)
    assert s.round_state(1) is S.CLOSED and not s.tape.of("commit")  # decided, waits for round 0
    s.push(0, r0, 1.0)
    s.push(1, r0, 1.0)
    assert [c["round"] for c in s.tape.of("commit")] == [0, 1]


def test_the_run_finalizes_after_its_round_budget_and_sends_the_final_cut() -> None:
    s = SyncerUnderTest(pipeline=1, total_rounds=1)
    s.start(0, 1)
    pull = first_pull(s, 0)
    s.push(0, pull, 1.0)
    s.push(1, pull, 1.0)
    assert s.tape.of("commit") and not s.tape.of("launch")[1:]  # the budget is spent: nothing more launches
    s.advance(0.0)  # the next turn finalizes
    (final,) = s.tape.of("final")
    assert final["reason"] == "completed 1 rounds"
    assert [len(s.finals(lid)) for lid in (0, 1)] == [2, 2]


def test_learners_that_finish_end_the_run_and_open_rounds_are_abandoned() -> None:
    s = SyncerUnderTest(pipeline=1)
    s.start(0, 1)
    s.done(0)
    assert not s.tape.of("final")  # learner 1 still trains; quorum lowers to 1 for it
    s.done(1)
    (final,) = s.tape.of("final")
    assert final["reason"] == "2 learner(s) finished training and none is still training"
    (abandon,) = s.tape.of("abandon")
    assert abandon["round"] == 0 and abandon["reason"] == "finalizing"


def test_a_learner_that_crashed_is_waited_for_and_trains_on_when_it_comes_back() -> None:
    s = SyncerUnderTest(pipeline=1, rejoin_wait_s=60.0)
    s.start(0, 1)
    s.leave(1)  # a crash: no goodbye, no DONE
    s.done(0)
    s.advance(59.0)
    assert not s.tape.of("final")  # learner 1 may still come back to train its remaining steps
    s.join(1)
    s.advance(120.0)
    assert not s.tape.of("final")  # it is training again
    s.done(1)
    (final,) = s.tape.of("final")
    assert final["reason"] == "2 learner(s) finished training and none is still training"


def test_a_learner_that_crashed_and_stays_away_is_given_up_on_after_the_rejoin_window() -> None:
    s = SyncerUnderTest(pipeline=1, rejoin_wait_s=60.0)
    s.start(0, 1)
    s.leave(1)
    s.advance(30.0)
    s.done(0)
    s.advance(29.0)
    assert not s.tape.of("final")
    s.advance(1.0)  # 60 s since learner 1 left
    (final,) = s.tape.of("final")
    assert final["reason"] == ("1 learner(s) finished training and none is still training; learner(s) 1 left "
                               "while training and did not come back within 60 s")


def test_a_learner_that_said_goodbye_is_not_waited_for() -> None:
    s = SyncerUnderTest(pipeline=1, rejoin_wait_s=60.0)
    s.start(0, 1)
    s.got(1, Bye("test: stopped on purpose"))
    s.leave(1)
    s.done(0)
    (final,) = s.tape.of("final")
    assert final["reason"] == "1 learner(s) finished training and none is still training"


def test_a_second_process_with_a_held_id_is_refused_and_the_holder_stays() -> None:
    s = SyncerUnderTest(pipeline=1)
    s.join(0, instance=b"A" * 16)
    holder = s.groups[0]
    s.generations[0] = 0  # the duplicate arrives as the next generation
    duplicate = s.join(0, instance=b"B" * 16)
    assert duplicate.closed and duplicate.of(Error)[0].code is ErrorCode.DUPLICATE
    assert not holder.closed
    assert s.tape.of("refused")[0]["code"] == "DUPLICATE"


@pytest.mark.parametrize("instance", [bytes(16), b"B" * 16], ids=["no-instance", "another-process"])
def test_an_id_held_by_a_live_group_is_never_handed_to_a_newcomer(instance: bytes) -> None:
    """The newcomer is refused (DUPLICATE, naming where the holder connects from), whether it names
    a process of its own or none at all; the holder keeps its link and its rounds commit."""
    s = SyncerUnderTest(pipeline=1)
    s.start(0, 1)
    holder = s.groups[1]
    newcomer = s.join(1, instance=instance)
    (error,) = newcomer.of(Error)
    assert newcomer.closed and error.code is ErrorCode.DUPLICATE
    assert "learner id 1 is held by another live process, connected from test:1" in error.reason
    assert ("cannot be told from the holder" in error.reason) == (not any(instance))
    assert not holder.closed and s.co.protocol.links[1].generation == 1
    s.groups[1], s.generations[1] = holder, 1  # the test speaks as the holder again
    s.advance(0.0)
    for lid in (0, 1):
        s.push(lid, first_pull(s, lid), 1.0)
    s.advance(0.0)
    (commit,) = s.tape.of("commit")
    assert commit["learners"] == [0, 1] and commit["generations"] == [1, 1]
    assert [r["code"] for r in s.tape.of("refused")] == ["DUPLICATE"]


def test_the_holder_redialing_replaces_its_own_stale_group() -> None:
    """A learner whose connection broke on its side redials before the syncer saw the old group
    close: the same instance is the same process, welcomed with the full state."""
    s = SyncerUnderTest(pipeline=1)
    s.start(0, 1)
    stale = s.groups[1]
    redial = s.join(1)
    assert not redial.closed and not redial.of(Error)
    assert stale.closed and stale.close_reason == "replaced by generation 2"
    assert len(s.bcasts(1)) == 2  # every fragment, on the new group
    assert s.co.protocol.links[1].generation == 2


@pytest.mark.parametrize("instance", [bytes(16), b"B" * 16], ids=["no-instance", "another-process"])
def test_a_holder_whose_group_closed_frees_the_id(instance: bytes) -> None:
    s = SyncerUnderTest(pipeline=1)
    s.start(0, 1)
    s.groups[1].closed = True  # its connection broke; the syncer has not taken in its departure yet
    newcomer = s.join(1, instance=instance)
    assert not newcomer.closed and not newcomer.of(Error)
    assert s.co.protocol.links[1].generation == 2 and not s.tape.of("refused")


def test_rounds_that_lost_their_quorum_are_retired_once_and_wait_for_the_learner_to_return() -> None:
    """With every learner needed, a departure makes the open rounds unreachable: each is retired
    once and relaunched only when the learner is back, not retried every turn while it is away
    (which would re-pull a whole fragment from the survivors each time)."""
    s = SyncerUnderTest(learners=3, quorum=3, pipeline=2, fragments=2)
    s.start(0, 1, 2)
    s.advance(0.0)
    for r in (0, 1):  # two rounds commit with everyone
        for lid in (0, 1, 2):
            s.push(lid, first_pull(s, lid, r), 1.0)
        s.advance(0.0)
    assert [c["round"] for c in s.tape.of("commit")] == [0, 1]
    s.advance(0.0)
    in_flight = sorted(p.round for p in s.pulls(0) if p.round >= 2)
    assert in_flight == [2, 3]
    s.push(0, first_pull(s, 0, 2), 1.0)
    s.leave(2)
    for _ in range(400):  # 100 s of turns while learner 2 is away
        s.advance(0.25)
    retries = s.tape.of("retry")
    assert sorted(r["round"] for r in retries) == [2, 3], retries  # once each, never again
    assert len(s.tape.of("launch")) == 4 and len(s.tape.of("commit")) == 2
    assert s.round_state(2) is S.PARKED and s.round_state(3) is S.PARKED
    s.join(2)
    s.advance(0.0)
    relaunched = [r for r in s.tape.of("launch") if r["attempt"] > 4]
    assert [r["round"] for r in relaunched] == [2, 3]
    for r in (2, 3):
        for lid in (0, 1, 2):
            s.push(lid, [p for p in s.pulls(lid) if p.round == r][-1], 1.0)
    s.advance(0.0)
    assert [c["round"] for c in s.tape.of("commit")] == [0, 1, 2, 3]
