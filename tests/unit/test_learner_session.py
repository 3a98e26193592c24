"""The learner session through its public API only: an in-memory link plays the syncer and a fake
clock moves only while the session waits, so timeouts of minutes pass in microseconds and every
schedule below is exact."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from learner_harness import FakeClock, MemoryLink, hand_fed

from yeto_core.learner import OWED_ROUND_PATIENCE_S, LearnerSession
from yeto_core.probe import PROBE_EXIT_CODE, ProbeResult
from yeto_core.refusal import IslandRefused, ProbeFailed
from yeto_core.settings import LearnerSettings, SettingsError, load_settings
from yeto_core.wire.errors import ErrorCode, Refused
from yeto_core.wire.messages import Bye, Done

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_learner_0_answers_init_at_its_next_tick_and_replays_one_snapshot_until_the_first_cut() -> None:
    w = torch.arange(4, dtype=torch.float32)
    s, link, clock, _ = hand_fed([("w", w)], init_timeout_s=5)
    link.ask_init()  # the syncer has no state: learner 0 must describe and upload the model
    s.start()  # no cut comes: it gives up after 5 s of its clock, the request answered meanwhile
    assert [a is not None and torch.equal(a[0], torch.arange(4.0)) for a in link.init_answers] == [True]
    assert clock.now == pytest.approx(1005.0, abs=0.5)
    w.add_(10.0)
    s.step(tokens=1)
    link.ask_init()  # a new connection before the first cut: the same initial snapshot again
    s.step(tokens=1)
    assert torch.equal(link.init_answers[1][0], torch.arange(4.0))  # type: ignore[index]
    link.bcast(0, 0, 0, torch.zeros(4))
    s.step(tokens=1)
    link.ask_init(reseed=True)  # the syncer lost its state after the first cut: seed it from now
    w.add_(1.0)
    s.step(tokens=1)
    assert torch.equal(link.init_answers[2][0], torch.ones(4))  # type: ignore[index]
    assert s.stats.init_answers == 2  # the first read and the reseed; the replay reused the snapshot


def test_a_run_never_starts_from_nan_weights_and_the_link_is_not_left_waiting() -> None:
    w = torch.tensor([0.0, float("nan")])
    s, link, _, _ = hand_fed([("w", w)])
    link.ask_init()
    with pytest.raises(ValueError, match=r"initial weights hold NaN or Inf \(first in 'w'\)"):
        s.start()
    assert link.init_answers == [None]


def test_an_init_request_is_answered_inside_a_lockstep_wait_that_then_runs_out() -> None:
    w = torch.zeros(3)
    s, link, clock, _ = hand_fed([("w", w)], lockstep=True, lockstep_timeout_s=60)
    link.bcast(0, 0, 0, torch.zeros(3))
    s.start()
    asked = []

    def syncer_restarted() -> None:  # while the step waits for a pull, the syncer asks for INIT once
        if not asked:
            asked.append(True)
            link.ask_init(reseed=True)

    link.on_wait = syncer_restarted
    s.step(tokens=1)
    s.step(tokens=1)  # a boundary: waits for a pull that never comes
    assert len(link.init_answers) == 1 and link.init_answers[0] is not None  # not starved by the wait
    assert s.stats.lockstep_misses == 1
    assert clock.now >= 1060.0


def test_every_deadline_is_on_the_session_clock() -> None:
    s, link, clock, _ = hand_fed([("w", torch.zeros(2))], init_timeout_s=600, final_timeout_s=300)
    s.start()
    assert not s.initial_cut_installed and clock.now == pytest.approx(1600.0, abs=0.5)
    assert not s.finish()  # no final cut: it gives up after 300 s of its clock, having said DONE once
    assert clock.now == pytest.approx(1900.0, abs=0.6)
    assert link.sent == [Done(0)]


def test_no_boundary_counts_before_the_syncer_announced_its_schedule() -> None:
    # Stepping before the first CHALLENGE (the initial cut never came): no layout, no H yet, so a
    # lockstep island does not wait at a boundary of a schedule it does not know.
    s, link, clock, _ = hand_fed([("w", torch.zeros(2))], lockstep=True, sync_interval=None)
    before = clock.now
    for _ in range(2 * s.sync_interval):
        s.step(tokens=1)
    assert clock.now == before and s.stats.lockstep_misses == 0 and link.jobs == []


def test_pushes_carry_what_trained_since_the_anchor_and_the_step_time_of_the_clock() -> None:
    w = torch.zeros(2)
    s, link, clock, _ = hand_fed([("w", w)], sync_interval=3)
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    for _ in range(3):
        clock.advance(2.0)
        w.add_(1.0)
        s.step(tokens=5)
    (job,) = link.jobs
    assert (job.tokens, job.steps, job.base_version) == (15, 3, 0)
    assert torch.equal(job.delta, torch.full((2,), 3.0)) and job.step_s == pytest.approx(2.0)
    s.step(tokens=5)  # the next step counts the push that went out
    assert (s.stats.pushes, s.stats.bytes_pushed) == (1, 8)


def test_a_round_pulled_again_on_a_new_connection_gets_the_very_same_delta() -> None:
    w = torch.zeros(2)
    s, link, _, _ = hand_fed([("w", w)])
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    w.add_(1.0)
    s.step(tokens=4)
    s.step(tokens=4)  # boundary: push round 0
    w.add_(5.0)  # trained after the push: not part of the replay
    link.lose()
    link.connect()
    link.pull(0, 0, 0, attempt=2)  # the syncer restarted before committing round 0
    s.step(tokens=4)
    first, replay = link.jobs
    assert replay.pull.attempt == 2 and torch.equal(replay.delta, first.delta)
    assert (replay.tokens, replay.steps) == (first.tokens, first.steps) == (8, 2)
    assert s.stats.replays == 1 and s.generation == 2


def test_a_re_pull_after_the_base_moved_is_answered_with_a_fresh_delta() -> None:
    w = torch.zeros(2)
    s, link, _, _ = hand_fed([("w", w)])
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    w.add_(1.0)
    s.step(tokens=1)
    s.step(tokens=1)  # push round 0 on base 0
    link.bcast(0, 1, 0, torch.full((2,), 7.0), merged=True)  # round 0 committed with this push
    link.pull(1, 0, 1)
    s.step(tokens=1)  # rebases onto version 1: θ = 7 + what trained since the push (nothing)
    assert torch.equal(w, torch.full((2,), 7.0))
    link.pull(0, 0, 0, attempt=2)  # a late re-pull of round 0: its base has moved on, nothing to replay
    w.add_(1.0)
    s.step(tokens=1)  # boundary: round 1 on base 1
    assert [j.pull.round for j in link.jobs] == [0, 1] and s.stats.replays == 0
    second = link.jobs[1]
    assert torch.equal(second.delta, torch.ones(2)) and (second.base_version, second.steps) == (1, 2)


def test_finish_installs_the_final_cut_exactly() -> None:
    w = torch.zeros(3)
    s, link, _, _ = hand_fed([("w", w)], merge_alpha=0.5)
    link.bcast(0, 0, 0, torch.zeros(3))
    s.start()
    w.add_(2.0)
    s.step(tokens=1)
    cut = torch.tensor([1.0, 2.0, 3.0])

    def syncer_finalizes() -> None:
        if any(isinstance(m, Done) for m in link.sent) and not s.final_ready:
            link.final(0, 9, cut, rounds=4)

    link.on_wait = syncer_finalizes
    assert s.finish()
    assert torch.equal(w, cut) and s.stats.final_installed and s.fragments[0].version == 9
    s.close()
    assert link.closed == "final cut installed"


def test_done_is_said_again_to_a_restarted_syncer_whose_generations_start_over() -> None:
    """A DONE sent as the old syncer died is lost with it; the new syncer numbers this learner's
    first connection 1 again, so the learner owes DONE per connection, not per generation."""
    w = torch.zeros(2)
    s, link, _, _ = hand_fed([("w", w)])
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    restarted: list[bool] = []

    def syncer() -> None:
        dones = sum(isinstance(m, Done) for m in link.sent)
        if dones == 1 and not restarted:  # the DONE went into a link that was already dead
            restarted.append(True)
            link.lose()
            link.generation = 0  # a syncer started afresh
            link.connect()
        elif dones == 2 and not s.final_ready:
            link.final(0, 1, torch.full((2,), 5.0))

    link.on_wait = syncer
    assert s.finish()
    assert link.sent == [Done(0), Done(0), Bye("final cut installed")] and s.stats.connected_generations == [1, 1]
    assert torch.equal(w, torch.full((2,), 5.0))


def test_the_final_flush_pushes_what_trained_since_the_last_push_before_saying_done() -> None:
    w = torch.zeros(2)
    s, link, _, _ = hand_fed([("w", w)], final_flush=True, sync_interval=100)
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    w.add_(3.0)
    s.step(tokens=2)  # no boundary before the end
    link.pull(0, 0, 0)

    def syncer() -> None:
        if link.jobs and s.fragments[0].version == 0:
            link.bcast(0, 1, 0, torch.full((2,), 3.0), merged=True)
        elif any(isinstance(m, Done) for m in link.sent) and not s.final_ready:
            link.final(0, 1, torch.full((2,), 3.0))

    link.on_wait = syncer
    assert s.finish()
    (job,) = link.jobs
    assert torch.equal(job.delta, torch.full((2,), 3.0)) and job.steps == 1
    assert link.sent == [Done(1), Bye("final cut installed")]  # DONE only once the flushed push was merged


def test_sweep_answers_every_pull_then_waits_for_the_merges() -> None:
    a, b = torch.zeros(2), torch.zeros(2)
    s, link, _, _ = hand_fed([("a", a), ("b", b)], fragments=2, sync_interval=1000, overlap=False)
    link.bcast(0, 0, 0, torch.zeros(2))
    link.bcast(1, 0, 0, torch.zeros(2))
    s.start()
    a.add_(1.0)
    b.add_(2.0)
    s.step(tokens=1)
    link.pull(0, 0, 0)
    link.pull(1, 1, 0)

    def syncer_merges() -> None:
        for job in link.jobs:
            f = job.pull.fragment
            if s.fragments[f].version == 0 and s.fragments[f].bcast is None:
                link.bcast(f, 1, job.pull.round, job.delta, merged=True)

    link.on_wait = syncer_merges
    assert not s.sweep()
    assert sorted(j.pull.fragment for j in link.jobs) == [0, 1]
    assert [f.version for f in s.fragments] == [1, 1] and not s.pulls_to_answer()
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.full((2,), 2.0))


def test_with_overlap_a_sweep_returns_once_the_pushes_are_out() -> None:
    s, link, clock, _ = hand_fed([("w", torch.ones(2))], overlap=True, sync_interval=1000)
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    s.step(tokens=1)
    link.pull(0, 0, 0)
    before = clock.now
    assert not s.sweep()
    assert len(link.jobs) == 1 and s.fragments[0].version == 0 and clock.now - before < 0.2


def test_a_push_that_failed_is_counted_and_its_pull_waits_for_the_next_one() -> None:
    w = torch.zeros(2)
    s, link, _, _ = hand_fed([("w", w)])
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.send_pushes = False
    link.pull(0, 0, 0)
    w.add_(1.0)
    s.step(tokens=1)
    s.step(tokens=1)
    (job,) = link.jobs
    link.pull(1, 0, 0)
    s.step(tokens=1)
    s.step(tokens=1)  # a boundary while the push still streams: nothing new goes out
    assert len(link.jobs) == 1 and s.push is job
    job.error = "no link to the syncer"
    job.done.set()
    s.step(tokens=1)
    s.step(tokens=1)
    assert s.stats.push_failures == 1 and [j.pull.round for j in link.jobs] == [0, 1]


def test_a_permanent_refusal_stops_the_island_unless_it_may_train_alone() -> None:
    s, link, _, _ = hand_fed([("w", torch.zeros(2))])
    link.refused = Refused(ErrorCode.AUTH, "wrong key")
    with pytest.raises(IslandRefused, match="wrong key"):
        s.step(tokens=1)
    alone, link2, _, _ = hand_fed([("w", torch.zeros(2))], alone_if_refused=True)
    link2.refused = Refused(ErrorCode.AUTH, "wrong key")
    assert not alone.step(tokens=1) and not alone.finish()


def test_a_link_below_the_minimum_rate_raises_probe_failed_with_exit_code_75_before_joining() -> None:
    s, link, _, said = hand_fed([("w", torch.zeros(2))], wan_probe_min_mbps=100)
    link.measured = ProbeResult(12.5, 900.0)
    with pytest.raises(ProbeFailed) as failed:
        s.start()
    assert failed.value.exit_code == PROBE_EXIT_CODE and link.layout is None  # never dialed
    assert str(failed.value).startswith("yeto learner 0: too slow to join: link to 127.0.0.1:9 measured 12.5 Mbit/s up")
    assert said == []  # the session says nothing: whoever owns the process prints the line and exits


def test_rl_sweep_mode_changes_no_weight_inside_an_iteration_and_pushes_every_fragment_at_its_end() -> None:
    """RL iterations (`rl_mode=sweep`): steps are counted, but pushes and installs wait for the
    sweep, so the policy an update started from stays put until the iteration ends."""
    a, b = torch.zeros(2), torch.zeros(2)
    s, link, _, _ = hand_fed([("a", a), ("b", b)], fragments=2, sync_interval=2, rl_mode="sweep")
    link.bcast(0, 0, 0, torch.zeros(2))
    link.bcast(1, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    link.pull(1, 1, 0)
    link.bcast(1, 5, 7, torch.full((2,), 9.0))  # another island's merge arrives mid-iteration
    for _ in range(4):  # H/P = 1: every step would be a boundary in stream mode
        a.add_(1.0)
        b.add_(1.0)
        assert not s.step(tokens=10)
    assert link.jobs == [] and torch.equal(b, torch.full((2,), 4.0)) and s.fragments[1].version == 0

    def syncer() -> None:  # merges each push into the next version, and launches fragment 1's next round
        for job in link.jobs:
            state = s.fragments[job.pull.fragment]
            if state.bcast is None and state.version == job.pull.version:
                assert state.anchor is not None
                link.bcast(job.pull.fragment, job.pull.version + 1, job.pull.round, state.anchor + job.delta,
                           merged=True)
        if s.fragments[1].version == 5 and s.fragments[1].pull is None and len(link.jobs) == 1:
            link.pull(9, 1, 5)

    link.on_wait = syncer
    assert not s.sweep()
    # Fragment 1's merge came in before the sweep: rebased in first, so its pull (version 0) is stale.
    # Its 4 steps are still unpushed, so the sweep waits for its next round, and merges them there.
    assert [(j.pull.round, j.pull.fragment, j.steps, j.tokens) for j in link.jobs] == [(0, 0, 4, 40), (9, 1, 4, 40)]
    assert [f.version for f in s.fragments] == [1, 6]
    assert torch.equal(a, torch.full((2,), 4.0)) and torch.equal(b, torch.full((2,), 13.0))


def test_rl_overlap_mode_trains_on_at_once_and_rebases_its_merge_in_at_the_next_sweep() -> None:
    w = torch.zeros(2)
    s, link, clock, _ = hand_fed([("w", w)], sync_interval=1, rl_mode="overlap")
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    w.add_(1.0)
    s.step(tokens=5)
    before = clock.now
    assert not s.sweep() and clock.now - before < 0.2  # the push is out; nothing waited for
    assert len(link.jobs) == 1
    w.add_(1.0)  # iteration k+1 trains on the local weights
    s.step(tokens=5)
    link.bcast(0, 1, 0, torch.full((2,), 0.5), merged=True)  # the global merge of iteration k's push
    link.pull(1, 0, 1)
    s.sweep()
    # θ ← G + (θ_local − θ at the push) = 0.5 + (2 − 1); the next push carries only what came after.
    assert torch.equal(w, torch.full((2,), 1.5)) and s.fragments[0].version == 1
    assert [j.steps for j in link.jobs] == [1, 1] and torch.equal(link.jobs[1].delta, torch.ones(2))


def overlapping_two_fragments() -> tuple[LearnerSession, MemoryLink, FakeClock, tuple[torch.Tensor, torch.Tensor]]:
    """An overlapping RL learner of two fragments, one step trained and fragment 0's pull held."""
    a, b = torch.zeros(2), torch.zeros(2)
    s, link, clock, _ = hand_fed([("a", a), ("b", b)], fragments=2, rl_mode="overlap")
    link.bcast(0, 0, 0, torch.zeros(2))
    link.bcast(1, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    a.add_(1.0)
    b.add_(1.0)
    s.step(tokens=5)
    return s, link, clock, (a, b)


def test_an_overlap_sweep_waits_for_a_pull_still_on_its_way_so_one_round_takes_the_whole_iteration() -> None:
    """The syncer launches a sweep's rounds one after another: a pull can trail the sweep. Pushing
    that fragment at a later sweep would put two iterations into one round; the sweep waits."""
    s, link, clock, _ = overlapping_two_fragments()
    waits = []

    def second_pull_arrives_later() -> None:
        waits.append(clock.now)
        if len(waits) == 3:
            link.pull(1, 1, 0)

    link.on_wait = second_pull_arrives_later
    before = clock.now
    assert not s.sweep()
    assert [(j.pull.fragment, j.steps) for j in link.jobs] == [(0, 1), (1, 1)]
    assert clock.now - before < 1.0 and len(waits) == 3  # back as soon as the last push is out


def test_an_overlap_sweep_leaves_the_merge_of_its_own_push_for_the_next_sweep_however_soon_it_comes() -> None:
    """A round can merge while the sweep that pushed it still waits for another fragment's pull.
    Installed there, the next iteration would train from the merge or not as timing has it, and an
    overlapping run would not be reproducible; it goes in at the next sweep, by rebasing."""
    s, link, clock, (a, b) = overlapping_two_fragments()
    waits = []

    def merge_then_pull() -> None:
        waits.append(clock.now)
        if len(waits) == 2:  # fragment 0's round merges before fragment 1's pull is in
            link.bcast(0, 1, 0, torch.full((2,), 0.5), merged=True)
        if len(waits) == 4:
            link.pull(1, 1, 0)

    link.on_wait = merge_then_pull
    assert not s.sweep()
    assert [j.pull.fragment for j in link.jobs] == [0, 1] and len(waits) == 4
    assert torch.equal(a, torch.ones(2)) and s.fragments[0].version == 0  # held, not installed
    a.add_(1.0)
    b.add_(1.0)
    s.step(tokens=5)
    link.pull(2, 0, 1)
    assert not s.sweep()
    # rebased at this sweep: θ ← Θ + (θ − θ at the push) = 0.5 + (2 − 1)
    assert torch.equal(a, torch.full((2,), 1.5)) and s.fragments[0].version == 1
    assert torch.equal(link.jobs[2].delta, torch.ones(2))


def test_a_sweep_does_not_wait_for_a_fragment_whose_rounds_are_over() -> None:
    """The syncer flags the broadcast of a fragment's last round (BCAST_LAST): no pull follows, so a
    sweep does not wait `blocking_timeout_s` for one; the steps go into the final cut instead."""
    a, b = torch.zeros(2), torch.zeros(2)
    s, link, clock, _ = hand_fed([("a", a), ("b", b)], fragments=2, rl_mode="overlap", blocking_timeout_s=100)
    link.bcast(0, 0, 0, torch.zeros(2))
    link.bcast(1, 3, 7, torch.zeros(2), last=True)  # fragment 1's rounds ended with round 7
    s.start()
    link.pull(8, 0, 0)
    a.add_(1.0)
    b.add_(1.0)
    s.step(tokens=5)
    before = clock.now
    assert not s.sweep()
    assert [j.pull.fragment for j in link.jobs] == [0] and clock.now - before < 1.0
    link.bcast(1, 4, 9, torch.zeros(2))  # a resumed run with more rounds: fragment 1 is open again
    s.sweep()
    assert clock.now - before >= 100  # its pull never came: waited out, then training goes on


def test_a_re_pull_is_replayed_at_once_even_behind_a_push_still_streaming() -> None:
    """A restarted syncer re-pulls the rounds it lost; an RL island between sweeps reaches no
    boundary for a while, so the replay is queued behind the push streaming, not held."""
    a, b = torch.zeros(2), torch.zeros(2)
    s, link, _, _ = hand_fed([("a", a), ("b", b)], fragments=2, rl_mode="overlap")
    link.bcast(0, 0, 0, torch.zeros(2))
    link.bcast(1, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    link.pull(1, 1, 0)
    a.add_(1.0)
    b.add_(2.0)
    s.step(tokens=5)
    s.sweep()
    link.send_pushes = False  # from now on the pushes stream for a while
    link.lose()
    link.connect()
    link.pull(0, 0, 0, attempt=2)
    link.pull(1, 1, 0, attempt=2)
    s.pump(0.0)
    replays = link.jobs[2:]
    assert [(j.pull.round, j.pull.attempt) for j in replays] == [(0, 2), (1, 2)] and s.stats.replays == 2
    assert torch.equal(replays[1].delta, torch.full((2,), 2.0))


def test_rl_overlap_mode_needs_rebasing_installs() -> None:
    with pytest.raises(SettingsError, match="YETO_DILOCO_OVERLAP=false"):
        load_settings(LearnerSettings, syncer="127.0.0.1:1", rl_mode="overlap", overlap=False)


def test_a_merge_installed_with_nothing_trained_since_the_push_is_the_global_value_exactly() -> None:
    """A sweep that waits leaves no step between push and install: θ is θ at the push, so the rebase
    θ ← Θ + (θ − (anchor + delta)) would only add the rounding of anchor + delta (here a weight that
    went from 1 to 1e-20: the delta rounds to −1). Θ goes in as it is, the same bits on every island."""
    w = torch.ones(1)
    s, link, _, _ = hand_fed([("w", w)], rl_mode="sweep")
    link.bcast(0, 0, 0, torch.ones(1))
    s.start()
    w.fill_(1e-20)
    s.step(tokens=1)
    link.pull(0, 0, 0)

    def syncer_merges() -> None:
        if link.jobs and s.fragments[0].version == 0 and s.fragments[0].bcast is None:
            link.bcast(0, 1, 0, torch.full((1,), 1e-19), merged=True)

    link.on_wait = syncer_merges
    assert not s.sweep()
    assert float(link.jobs[0].delta) == -1.0  # 1e-20 − 1 in float32
    assert torch.equal(w, torch.full((1,), 1e-19)) and s.stats.rebases == 1


def test_a_streaming_island_says_done_only_once_its_last_push_is_merged() -> None:
    """Pushes go on the data streams and DONE on the control stream: a DONE said at once can reach
    the syncer first, which then drops this island from the round its push is for, and the steps
    that push carried are lost (the syncer refuses it as late)."""
    w = torch.zeros(2)
    s, link, clock, _ = hand_fed([("w", w)], sync_interval=1, final_timeout_s=100)
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    w.add_(1.0)
    s.step(tokens=5)  # a boundary: the pull is answered
    assert len(link.jobs) == 1
    started = clock.now
    seen: list[str] = []  # what the syncer saw, in order

    def syncer() -> None:
        if any(isinstance(m, Done) for m in link.sent) and "done" not in seen:
            seen.append("done")
        if clock.now - started > 3 and "merged" not in seen:  # the push's round commits a while later
            seen.append("merged")
            link.bcast(0, 1, 0, torch.ones(2), merged=True)
        elif seen == ["merged", "done"] and not s.final_ready:
            link.final(0, 1, torch.ones(2))

    link.on_wait = syncer
    assert s.finish()
    assert seen == ["merged", "done"], "DONE before the last push merged"
    assert link.sent == [Done(1), Bye("final cut installed")] and torch.equal(w, torch.ones(2))


def test_learner_0_that_seeds_a_restarted_syncer_counts_its_steps_once() -> None:
    """A syncer restarted without its state is seeded with learner 0's weights as they are: every
    step learner 0 trained is in the new history's initial cut. Its own last anchor predates some
    of them, and rebasing the cut onto it would add them a second time."""
    w = torch.zeros(3)
    s, link, _, _ = hand_fed([("w", w)], sync_interval=2)
    link.bcast(0, 0, 0, torch.zeros(3))
    s.start()
    link.pull(0, 0, 0)
    for _ in range(2):
        w.add_(1.0)
        s.step(tokens=1)
    link.bcast(0, 1, 0, torch.full((3,), 2.0), merged=True)  # round 0 merged the push of 2
    w.add_(1.0)
    s.step(tokens=1)  # installed: anchor 2 at version 1, the weights 3
    link.lose()
    link.connect()
    link.ask_init(reseed=True)  # a new syncer, without --resume
    w.add_(1.0)
    s.step(tokens=1)  # the seed is read here: 4
    (seed,) = link.init_answers[-1]  # type: ignore[misc]
    assert torch.equal(seed, torch.full((3,), 4.0))
    link.bcast(0, 0, 0, seed)  # the new history's initial cut: the seed's bits, version 0
    w.add_(1.0)
    s.step(tokens=1)
    assert torch.equal(w, torch.full((3,), 5.0)), "steps before the seed were counted twice"
    link.pull(0, 0, 0)
    w.add_(1.0)
    s.step(tokens=1)  # a boundary: the push carries the two steps trained since the seed, once
    assert torch.equal(link.jobs[-1].delta, torch.full((3,), 2.0)) and link.jobs[-1].tokens == 2


def test_a_push_based_past_what_a_restarted_syncer_holds_is_not_waited_for_at_the_end() -> None:
    """A syncer back without its state (or from an older checkpoint) broadcasts a version below
    the one a push in flight was based on: that push's round is gone, so the island neither waits
    for its merge before DONE nor counts its steps as merged; they go out with its next push."""
    w = torch.zeros(2)
    s, link, clock, _ = hand_fed([("w", w)], sync_interval=1, final_timeout_s=100)
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.bcast(0, 1, 0, torch.zeros(2))
    s.step(tokens=1)  # version 1 installed
    link.pull(1, 0, 1)
    w.add_(1.0)
    s.step(tokens=3)  # the push for round 1, based on version 1
    assert len(link.jobs) == 1 and not s.sync.pushes_merged()
    link.lose()
    link.connect()
    link.bcast(0, 0, 0, torch.full((2,), 7.0))  # the restarted syncer's initial cut, version 0
    s.step(tokens=1)
    assert s.sync.pushes_merged() and torch.equal(w, torch.full((2,), 8.0))  # rebased: its step kept
    link.pull(0, 0, 0)
    s.step(tokens=1)
    assert torch.equal(link.jobs[-1].delta, torch.ones(2)) and link.jobs[-1].tokens == 6  # every step since v1

    def syncer() -> None:  # the new history merges round 0, then sends the final cut
        if not s.sync.pushes_merged():
            link.bcast(0, 1, 0, torch.full((2,), 9.0), merged=True)
        elif not s.final_ready:
            link.final(0, 1, torch.full((2,), 9.0))

    started = clock.now
    link.on_wait = syncer
    assert s.finish() and clock.now - started < 5  # the old push would hold DONE for 50 s


def test_an_overlapping_island_says_done_only_once_its_last_sweep_is_merged() -> None:
    """overlap returns from the last sweep with its pushes in flight; DONE then (no final flush)
    would let the syncer finalize without their rounds, and the last iteration would be lost."""
    w = torch.zeros(2)
    s, link, clock, _ = hand_fed([("w", w)], rl_mode="overlap", final_timeout_s=100)
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    link.pull(0, 0, 0)
    w.add_(1.0)
    s.step(tokens=5)
    s.sweep()
    started = clock.now

    def syncer() -> None:
        if clock.now - started > 3 and s.fragments[0].bcast is None and s.fragments[0].version == 0:
            assert not any(isinstance(m, Done) for m in link.sent), "DONE before the last push merged"
            link.bcast(0, 1, 0, torch.ones(2), merged=True)
        if any(isinstance(m, Done) for m in link.sent) and not s.final_ready:
            link.final(0, 1, torch.ones(2))

    link.on_wait = syncer
    assert s.finish()
    assert any(isinstance(m, Done) for m in link.sent) and torch.equal(w, torch.ones(2))


def lagging_syncer() -> tuple[LearnerSession, MemoryLink, FakeClock, tuple[torch.Tensor, torch.Tensor]]:
    """Two fragments at H = 4 (a boundary every 2 steps), 8 steps trained: this island's steps reached
    rounds 0-3, and its syncer, which started late, launched only rounds 0 and 1."""
    a, b = torch.zeros(2), torch.zeros(2)
    s, link, clock, _ = hand_fed([("a", a), ("b", b)], fragments=2, sync_interval=None, final_timeout_s=100,
                                 answer_on_arrival=False)
    link.sync_interval = 4  # the syncer paces rounds by steps
    link.bcast(0, 0, 0, torch.zeros(2))
    link.bcast(1, 0, 0, torch.zeros(2))
    s.start()
    for step in range(1, 9):
        if step == 2:
            link.pull(0, 0, 0)
        if step == 4:
            link.bcast(0, 1, 0, torch.full((2,), 2.0), merged=True)
            link.pull(1, 1, 0)
        if step == 6:
            link.bcast(1, 1, 1, torch.full((2,), 4.0), merged=True)
        a.add_(1.0)
        b.add_(1.0)
        s.step(tokens=5)
    assert [j.pull.round for j in link.jobs] == [0, 1]
    return s, link, clock, (a, b)


def test_an_island_answers_the_rounds_its_steps_reached_before_saying_done_when_its_syncer_lags() -> None:
    """A syncer that started late paces one round per H/P steps of the fleet but stays behind: an island
    saying DONE at once would lose each lagging fragment's last round of training."""
    s, link, _, _ = lagging_syncer()
    assert s.rounds_owed() == 2

    def syncer() -> None:
        rounds = [j.pull.round for j in link.jobs]
        dones = any(isinstance(m, Done) for m in link.sent)
        if rounds == [0, 1] and s.fragments[0].pull is None:
            link.pull(2, 0, 1)
        elif rounds == [0, 1, 2] and s.fragments[1].pull is None and s.fragments[0].version == 1:
            link.bcast(0, 2, 2, torch.full((2,), 9.0), merged=True)
            link.pull(3, 1, 1)
        elif rounds == [0, 1, 2, 3] and s.fragments[1].version == 1 and s.fragments[1].bcast is None:
            assert not dones, "DONE before the last round's push merged"
            link.bcast(1, 2, 3, torch.full((2,), 9.0), merged=True)
        elif dones and not s.final_ready:
            link.final(0, 2, torch.full((2,), 9.0))
            link.final(1, 2, torch.full((2,), 9.0))

    link.on_wait = syncer
    assert s.finish()
    late = link.jobs[2:]
    assert [(j.pull.round, j.steps) for j in late] == [(2, 6), (3, 4)]  # every step since each fragment's push
    assert link.sent == [Done(8), Bye("final cut installed")]


def finish_timed(s: LearnerSession, link: MemoryLink, clock: FakeClock,
                 before_done: Callable[[], None] = lambda: None) -> float:
    """finish() against a syncer that sends the final cut once DONE is in (`before_done` acts on each
    wait before that); the seconds it took on the session's clock."""
    started = clock.now

    def syncer() -> None:
        if not any(isinstance(m, Done) for m in link.sent):
            before_done()
        elif not s.final_ready:
            link.final(0, 1, torch.zeros(2))
            link.final(1, 1, torch.zeros(2))

    link.on_wait = syncer
    assert s.finish()
    return clock.now - started


def test_an_island_far_ahead_of_its_syncer_says_done_without_waiting() -> None:
    """More than a round per fragment behind is not a late start but a faster island beside a slower
    one, whose pace the syncer follows: nothing is waited for."""
    s, link, clock, _ = lagging_syncer()
    for _ in range(4):  # 16 steps: rounds 0-7 reached, 6 of them not launched
        s.step(tokens=5)
    assert s.rounds_owed() == 0
    assert finish_timed(s, link, clock) < 1.0 and len(link.jobs) == 2


def test_rounds_owed_to_a_syncer_that_died_are_not_waited_for_on_the_next_connection() -> None:
    """A restarted syncer re-pulls what it lost and paces rounds of its own: what the old one owed
    is not waited for, and DONE goes to the new one at once."""
    s, link, clock, _ = lagging_syncer()
    assert s.rounds_owed() == 2

    def restart() -> None:
        if link.generation == 1:  # the syncer dies while the island waits for its rounds, and restarts
            link.lose()
            link.connect()

    assert finish_timed(s, link, clock, restart) < 1.0 and len(link.jobs) == 2 and link.sent[0] == Done(8)


def test_an_island_owed_rounds_by_a_syncer_that_launches_none_gives_up_after_a_few_rounds_time() -> None:
    """A syncer whose quorum waits for a crashed member launches nothing: the island says DONE after
    its patience, not half the final timeout."""
    s, link, clock, _ = lagging_syncer()
    assert s.rounds_owed() == 2
    took = finish_timed(s, link, clock)
    assert OWED_ROUND_PATIENCE_S <= took < OWED_ROUND_PATIENCE_S + 1.0 and len(link.jobs) == 2


@pytest.mark.parametrize("on_arrival", [False, True])
def test_a_pull_is_answered_at_the_next_step_on_arrival_or_at_the_next_boundary(on_arrival: bool) -> None:
    """H = 8 over two fragments (a boundary every 4 steps) under a syncer that paces by steps: a PULL
    that lands after step 1 waits for step 4 at the boundaries, and goes at step 2 on arrival."""
    a, b = torch.zeros(2), torch.zeros(2)
    s, link, _, _ = hand_fed([("a", a), ("b", b)], fragments=2, sync_interval=None, answer_on_arrival=on_arrival)
    link.sync_interval = 8
    link.bcast(0, 0, 0, torch.zeros(2))
    link.bcast(1, 0, 0, torch.zeros(2))
    s.start()
    answered_at = []
    for step in range(1, 9):
        a.add_(1.0)
        s.step(tokens=1)
        if step == 1:
            link.pull(0, 0, 0)
        answered_at += [step] * (len(link.jobs) - len(answered_at))
    assert answered_at == ([2] if on_arrival else [4])
    assert link.jobs[0].steps == answered_at[0] and torch.equal(link.jobs[0].delta[:2], torch.full((2,), 2.0 if
                                                                                                  on_arrival else 4.0))


def test_lockstep_and_an_unpaced_syncer_keep_the_boundaries_even_on_arrival() -> None:
    for settings, paced in (({"lockstep": True, "lockstep_timeout_s": 1}, True), ({}, False)):
        w = torch.zeros(2)
        s, link, _, _ = hand_fed([("w", w)], fragments=1, sync_interval=None, answer_on_arrival=True, **settings)
        if paced:
            link.sync_interval = 4
        link.bcast(0, 0, 0, torch.zeros(2))
        s.start()
        s.step(tokens=1)
        link.pull(0, 0, 0)
        s.step(tokens=1)
        s.step(tokens=1)
        assert link.jobs == [], settings  # the boundary is step 4 (H = 4, or the learner's own H)

