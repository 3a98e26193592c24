"""Round decisions are pure functions of state, time and config; each returns its reason.

The clock is just a number passed in, so grace, deadlines and throttling are tested exactly.
"""

import dataclasses
import functools

import pytest
import torch

from syncer.core.rounds import (
    Answer,
    Attempt,
    Hold,
    PushFate,
    RoundState,
    SchedulerConfig,
    Verdict,
    answer_ages,
    answer_steps,
    attempt_quorum,
    decide_round,
    finished_weight,
    fragment_of_round,
    grace_window,
    judge_push,
    pipeline_depth,
    round_interval,
    should_finalize,
    should_launch,
)

pytestmark = pytest.mark.unit

CFG = SchedulerConfig(quorum=2, learners=3, grace_cap_s=5.0, grace_gamma=1.0, grace_tau=2.0)
NO_GRACE = dataclasses.replace(CFG, grace_cap_s=0.0)


def attempt(members: dict[int, int], quorum: int, answered: tuple[int, ...] = (), carried: tuple[int, ...] = (),
            deadline: float = 10.0) -> Attempt:
    a = Attempt(round=7, attempt=3, fragment=3, version=1, members=dict(members), quorum=quorum, launched_at=0.0,
                deadline=deadline)
    for lid in answered + carried:
        a.answers[lid] = Answer(lid, members.get(lid, 1), tokens=100, steps=4, delta=torch.zeros(2), base_version=1,
                                carried=lid in carried)
    return a


def decide(now: float, a: Attempt, live: dict[int, int], cfg: SchedulerConfig = NO_GRACE,
           step_s: float | None = None, sync_s: float = 0.0) -> tuple[Verdict, str]:
    """`decide_round`, with its first sight of quorum recorded on the attempt as the coordinator does."""
    before = dataclasses.replace(a)
    d = decide_round(now, a, live, cfg=cfg, step_s=step_s, sync_s=sync_s)
    assert a == before, "decide_round changed the attempt"
    if d.quorum_at is not None:
        assert a.quorum_at is None, "quorum reported as new twice"
        a.quorum_at, a.grace_s = d.quorum_at, d.grace_s
    return d.verdict, d.reason


# -- quorum and frozen rendezvous --------------------------------------------------------------
def test_commit_when_every_member_answered() -> None:
    verdict, reason = decide(1.0, attempt({0: 1, 1: 1}, 2, (0, 1)), live={0: 1, 1: 1})
    assert verdict is Verdict.COMMIT and "2 of 2" in reason


def test_commit_at_quorum_when_grace_is_off() -> None:
    verdict, reason = decide(1.0, attempt({0: 1, 1: 1, 2: 1}, 2, (0, 2)), live={0: 1, 1: 1, 2: 1})
    assert verdict is Verdict.COMMIT and "quorum 2 reached" in reason and "1 not waited for" in reason


def test_wait_below_quorum_before_the_deadline() -> None:
    verdict, reason = decide(1.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1, 1: 1})
    assert verdict is Verdict.WAIT and "1 of quorum 2" in reason


def test_retry_after_the_deadline_below_quorum() -> None:
    verdict, reason = decide(10.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1, 1: 1})
    assert verdict is Verdict.RETRY and "deadline" in reason


def test_retry_at_once_when_quorum_became_unreachable() -> None:
    verdict, reason = decide(1.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1})  # learner 1 disconnected
    assert verdict is Verdict.RETRY and "unreachable" in reason


def test_a_reconnected_member_does_not_count_for_a_frozen_attempt() -> None:
    verdict, _ = decide(1.0, attempt({0: 1, 1: 1}, 2, (0,)), live={0: 1, 1: 2})  # came back as generation 2
    assert verdict is Verdict.RETRY


def test_a_learner_that_joined_after_launch_is_not_waited_for() -> None:
    verdict, _ = decide(1.0, attempt({0: 1, 1: 1}, 2, (0, 1)), live={0: 1, 1: 1, 5: 1})
    assert verdict is Verdict.COMMIT


def test_a_disconnect_does_not_erase_an_accepted_answer() -> None:
    verdict, _ = decide(1.0, attempt({0: 1, 1: 1}, 2, (0, 1)), live={})
    assert verdict is Verdict.COMMIT


@pytest.mark.parametrize(("k", "m", "finished", "expected"), [(2, 2, 0, 2), (2, 2, 1, 1), (3, 4, 0, 3),
                                                              (3, 4, 2, 2), (2, 2, 2, 1)])
def test_quorum_lowers_only_for_finished_learners(k: int, m: int, finished: int, expected: int) -> None:
    assert attempt_quorum(k, m, finished) == expected


# -- adaptive grace ----------------------------------------------------------------------------
def test_grace_is_the_compute_slack() -> None:
    grace, why = grace_window(step_s=1.0, quorum_s=0.5, sync_s=0.25, cfg=CFG)
    assert grace == pytest.approx(1.25)  # 1.0 · (2 · 1.0 − 0.5 − 0.25)
    assert "grace 1250 ms" in why


def test_grace_is_capped_and_never_negative() -> None:
    assert grace_window(step_s=10.0, quorum_s=0.0, sync_s=0.0, cfg=CFG)[0] == 5.0
    assert grace_window(step_s=0.1, quorum_s=1.0, sync_s=0.0, cfg=CFG)[0] == 0.0
    assert grace_window(step_s=None, quorum_s=0.0, sync_s=0.0, cfg=CFG) == (0.0, "no step-time estimate yet")
    assert grace_window(step_s=1.0, quorum_s=0.0, sync_s=0.0, cfg=NO_GRACE) == (0.0, "grace disabled")


def test_grace_counts_the_boundary_wait_of_an_answer_as_on_time() -> None:
    # a = 6 steps to answer: a member at the fleet's pace answers within 6 s of the launch.
    grace, why = grace_window(step_s=1.0, quorum_s=3.0, sync_s=0.5, cfg=CFG, answer_steps=6)
    assert grace == pytest.approx(4.5)  # 1.0 · ((6 + 2) · 1.0 − 3.0 − 0.5)
    assert "((6 + 2)·1000 − 3000 − 500) ms" in why


def test_no_grace_when_every_straggler_is_far_slower_than_the_fleet() -> None:
    def window(*pending: float | None) -> float:
        return grace_window(step_s=1.0, quorum_s=4.0, sync_s=0.0, cfg=CFG, answer_steps=6, pending_step_s=pending)[0]

    assert window(4.0) == 0.0  # a quarter of the fleet's speed: it answers every few rounds, carried
    assert window(4.0, 2.5) == 0.0
    assert window(4.0, 1.5) == pytest.approx(4.0)  # one straggler near the fleet's pace is waited for
    assert window(2.0) == pytest.approx(4.0)  # τ = 2 times slower still is
    assert window(None) == pytest.approx(4.0)  # a speed not known yet is given the benefit of the doubt
    _, why = grace_window(step_s=1.0, quorum_s=1.0, sync_s=0.0, cfg=CFG, answer_steps=6, pending_step_s=[4.0])
    assert "more than 2× slower" in why


def test_decide_round_asks_each_pending_members_own_speed() -> None:
    live = {0: 1, 1: 1, 2: 1}
    slow = attempt({0: 1, 1: 1, 2: 1}, 2, (0, 1))
    d = decide_round(1.0, slow, live, cfg=CFG, step_s=1.0, sync_s=0.0, answer_steps=6,
                     member_step_s={0: 1.0, 1: 1.0, 2: 4.0})
    assert d.verdict is Verdict.COMMIT and d.grace_s == 0.0
    near = attempt({0: 1, 1: 1, 2: 1}, 2, (0, 1))
    d = decide_round(1.0, near, live, cfg=CFG, step_s=1.0, sync_s=0.0, answer_steps=6,
                     member_step_s={0: 1.0, 1: 1.0, 2: 1.2})
    assert d.verdict is Verdict.WAIT and d.grace_s == pytest.approx(5.0)  # capped


@pytest.mark.parametrize(("h", "p", "pipeline", "a"), [(24, 4, 2, 12), (96, 4, 2, 48), (24, 4, 1, 6),
                                                       (3, 4, 2, 2), (24, 1, 2, 24), (0, 4, 2, 0)])
def test_an_answer_takes_a_boundary_per_round_in_flight(h: int, p: int, pipeline: int, a: int) -> None:
    # one PULL answered per boundary (every ⌊H/P⌋ steps, at least 1), oldest first, at most
    # min(pipeline, P) rounds in flight
    assert answer_steps(h, p, pipeline) == a


def test_grace_waits_for_a_straggler_then_commits_without_it() -> None:
    a = attempt({0: 1, 1: 1, 2: 1}, 2, (0, 1))
    live = {0: 1, 1: 1, 2: 1}
    verdict, reason = decide(0.5, a, live, cfg=CFG, step_s=1.0, sync_s=0.0)  # quorum at 0.5 s
    assert verdict is Verdict.WAIT and "in grace" in reason
    assert a.quorum_at == 0.5 and a.grace_s == pytest.approx(1.5)  # 2·1.0 − 0.5 − 0
    assert decide(1.9, a, live, cfg=CFG, step_s=1.0)[0] is Verdict.WAIT
    verdict, reason = decide(2.0, a, live, cfg=CFG, step_s=1.0)
    assert verdict is Verdict.COMMIT and "grace 1500 ms spent, 1 not waited for" in reason


def test_grace_ends_early_when_the_straggler_answers() -> None:
    a = attempt({0: 1, 1: 1, 2: 1}, 2, (0, 1))
    live = {0: 1, 1: 1, 2: 1}
    assert decide(0.5, a, live, cfg=CFG, step_s=1.0)[0] is Verdict.WAIT
    a.answers[2] = Answer(2, 1, 10, 1, torch.zeros(2), base_version=1)
    assert decide(0.6, a, live, cfg=CFG, step_s=1.0)[0] is Verdict.COMMIT


# -- the age of an answer ----------------------------------------------------------------------
def test_an_answers_age_counts_the_commits_it_missed() -> None:
    a = attempt({0: 1, 1: 1, 2: 1, 3: 1}, 2, (0, 1, 2, 3))
    merged = {0: 5, 1: 4, 2: 2}  # learner 3: no answer merged yet
    aged = answer_ages(a.answers.values(), 5, merged)
    assert [(x.learner_id, x.age) for x in aged] == [(0, 0), (1, 1), (2, 3), (3, 0)]
    assert all(x.delta is y.delta for x, y in zip(aged, a.answers.values(), strict=True))  # not copied


def test_the_learners_that_finished_weigh_in_a_round_they_did_not_answer_as_their_last_answer_did() -> None:
    a = attempt({0: 1, 1: 1, 2: 1, 3: 1}, 1, (0, 2))
    merged = {0: 10.0, 1: 20.0, 2: 30.0}  # learner 3 finished before any answer of its was merged
    assert finished_weight(a.answers.values(), [1, 2, 3], merged) == 20.0  # 2 answered: not counted twice
    assert finished_weight(a.answers.values(), [], merged) == 0.0


# -- carried answers ---------------------------------------------------------------------------
def test_a_carried_answer_counts_toward_quorum_only_when_asked() -> None:
    a = attempt({0: 1, 1: 1}, 2, answered=(0,), carried=(1,))
    live = {0: 1, 1: 1}
    assert decide(1.0, a, live)[0] is Verdict.WAIT  # learner 1 may still answer fresh
    counting = dataclasses.replace(NO_GRACE, carry_counts=True)
    assert decide(1.0, a, live, cfg=counting)[0] is Verdict.COMMIT


def judge(**kw: object) -> tuple[PushFate, str]:
    base: dict[str, object] = dict(learner_id=1, generation=1, round_id=7, attempt_id=3, fragment=3, base_version=1,
                                   round_fragment=3, round_state=RoundState.OPEN,
                                   attempt=attempt({0: 1, 1: 1}, 2), version_now=1, cfg=CFG)
    base.update(kw)
    return judge_push(**base)  # type: ignore[arg-type]


def test_an_answer_of_the_open_attempt_is_accepted() -> None:
    assert judge() == (PushFate.ACCEPT, "answer")


@pytest.mark.parametrize(("kw", "needle"), [
    ({"fragment": 2}, "merges fragment 3, not 2"),
    ({"round_state": RoundState.UNLAUNCHED, "attempt": None}, "never launched"),
    ({"generation": 2}, "not a member of round 7 attempt 3"),
    ({"base_version": 2, "version_now": 1}, "ahead of the global version 1"),
    ({"attempt": attempt({0: 1, 1: 1}, 2, answered=(1,))}, "already answered round 7"),
])
def test_bad_pushes_are_refused_with_a_precise_reason(kw: dict[str, object], needle: str) -> None:
    fate, reason = judge(**kw)
    assert fate is PushFate.REFUSE and needle in reason


def test_a_late_push_within_the_lag_is_carried() -> None:
    fate, reason = judge(round_state=RoundState.COMMITTED, attempt=None, version_now=2)
    assert fate is PushFate.CARRY and "base lag 1" in reason


def test_a_push_for_a_closed_round_lags_the_version_that_round_will_commit() -> None:
    fate, _ = judge(round_state=RoundState.CLOSED, attempt=None, version_now=1)
    assert fate is PushFate.CARRY
    fate, reason = judge(round_state=RoundState.CLOSED, attempt=None, version_now=1, base_version=0)
    assert fate is PushFate.REFUSE and "by 2 > --max-base-lag 1" in reason


def test_a_push_beyond_the_lag_is_refused() -> None:
    fate, reason = judge(round_state=RoundState.COMMITTED, attempt=None, version_now=3)
    assert fate is PushFate.REFUSE and "lag fragment 3's next merge (version 3) by 2 > --max-base-lag 1" in reason
    assert judge(round_state=RoundState.COMMITTED, attempt=None, version_now=3,
                 cfg=dataclasses.replace(CFG, max_base_lag=2))[0] is PushFate.CARRY


def test_a_push_for_a_discarded_attempt_of_an_open_round_is_carried_into_it() -> None:
    fate, _ = judge(attempt_id=2)  # attempt 3 replaced attempt 2
    assert fate is PushFate.CARRY


# -- launching, pipelining, throttling ---------------------------------------------------------
def test_rounds_stagger_over_fragments() -> None:
    assert [fragment_of_round(r, 4) for r in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_pipeline_depth_never_exceeds_the_fragment_count() -> None:
    assert pipeline_depth(2, 4) == 2 and pipeline_depth(8, 4) == 4 and pipeline_depth(0, 4) == 1


def launch(now: float = 10.0, **kw: object) -> tuple[bool, str]:
    base: dict[str, object] = dict(cfg=dataclasses.replace(CFG, total_rounds=10), next_round=0, in_flight=0,
                                   depth=2, eligible=2, quorum=2, last_launch=None, interval_s=0.0)
    base.update(kw)
    check = should_launch(now, **base)  # type: ignore[arg-type]
    return check.go, check.reason


def test_a_launch_held_back_says_why_as_a_type() -> None:
    base: dict[str, object] = dict(cfg=dataclasses.replace(CFG, total_rounds=10), next_round=0, in_flight=0,
                                   depth=2, eligible=2, quorum=2, last_launch=None, interval_s=0.0)
    holds = [should_launch(10.0, **{**base, **kw}).hold  # type: ignore[arg-type]
             for kw in ({}, {"next_round": 10}, {"in_flight": 2}, {"eligible": 1},
                        {"last_launch": 9.5, "interval_s": 1.0})]
    assert holds == [None, Hold.BUDGET_SPENT, Hold.PIPELINE_FULL, Hold.TOO_FEW_LEARNERS, Hold.THROTTLED]


def test_launch_rules() -> None:
    assert launch()[0]
    assert launch(in_flight=1)[0]  # pipelining: a second round on another fragment
    go, why = launch(in_flight=2)
    assert not go and "pipeline 2" in why
    go, why = launch(eligible=1)
    assert not go and "1 connected, quorum 2" in why
    assert not launch(next_round=10)[0]
    go, why = launch(now=10.0, last_launch=9.5, interval_s=1.0)
    assert not go and why.startswith("throttled")
    assert launch(now=10.5, last_launch=9.5, interval_s=1.0)[0]


def test_throttle_paces_rounds_to_h_learner_steps() -> None:
    cfg = dataclasses.replace(CFG, sync_interval_steps=24, min_round_interval_s=0.1)
    assert round_interval(0.5, 4, cfg) == pytest.approx(3.0)  # 24 / 4 · 0.5 s
    assert round_interval(None, 4, cfg) == pytest.approx(0.1)  # no estimate yet: the floor
    assert round_interval(0.5, 4, dataclasses.replace(cfg, sync_interval_steps=0)) == pytest.approx(0.1)


def test_finalize_rules() -> None:
    assert should_finalize(next_round=10, total_rounds=10, training=2, finished=0) == (True, "completed 10 rounds")
    assert not should_finalize(next_round=3, total_rounds=10, training=1, finished=1)[0]
    done, why = should_finalize(next_round=3, total_rounds=10, training=0, finished=2)
    assert done and "finished training" in why
    assert not should_finalize(next_round=3, total_rounds=0, training=0, finished=0)[0]


def test_a_learner_that_left_while_training_is_waited_for_until_its_rejoin_window_ends() -> None:
    rule = functools.partial(should_finalize, next_round=3, total_rounds=0, training=0, finished=2,
                             away={2: 100.0}, rejoin_wait_s=60.0)
    done, why = rule(now=159.0)
    assert not done and why == ("every connected learner finished; waiting up to 60 s from its departure for "
                                "learner(s) 2, which left while training")
    done, why = rule(now=160.0)
    assert done and why == ("2 learner(s) finished training and none is still training; learner(s) 2 left while "
                            "training and did not come back within 60 s")
    assert should_finalize(next_round=3, total_rounds=0, training=0, finished=2, away={2: 100.0}, now=100.0)[0]
    assert not should_finalize(next_round=3, total_rounds=0, training=1, finished=1, away={2: 0.0}, now=1e9)[0]
    # The round budget ends the run whoever is away.
    assert should_finalize(next_round=10, total_rounds=10, training=0, finished=2, away={2: 100.0}, now=100.0,
                           rejoin_wait_s=60.0) == (True, "completed 10 rounds")


def test_a_push_whose_answer_is_already_merged_is_refused_not_carried() -> None:
    fate, why = judge_push(learner_id=1, generation=1, round_id=4, attempt_id=5, fragment=0, base_version=2,
                           round_fragment=0, round_state=RoundState.COMMITTED, attempt=None, version_now=3,
                           cfg=CFG, merged=True)
    assert fate is PushFate.REFUSE and "already merged" in why
