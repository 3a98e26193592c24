"""Round decisions as pure functions of state, time and config (DESIGN §4.3–4.6).

Nothing here sends, sleeps or reads a clock: the coordinator passes `now` in and acts on the
returned decision, and every decision comes with its reason (which goes to the event tape).

A *round* merges one fragment; round r targets fragment r mod P (staggered, streaming DiLoCo).
Up to `pipeline` rounds are in flight, always on distinct fragments; they may close out of
order but commit strictly in round order.

An *attempt* of a round freezes its rendezvous at launch: the members (learner id and
connection generation) and the quorum. Learners that join or reconnect later only count for
later attempts; a member that disconnects after answering keeps its answer. When quorum is
reached the round waits an *adaptive grace window* for stragglers, sized to the learners'
compute slack: γ·((a + τ)·ξ_step − ξ_quorum − ξ_sync), a the steps a learner takes to answer
(`answer_steps`), capped by `grace_s`, and none when every straggler is more than τ× slower than
the fleet. An attempt whose quorum can no longer be reached, or whose deadline passes below quorum,
is discarded and the round is retried under a new attempt id.

A push that misses its round is *carried* (still encoded) to the fragment's next round when its
base lags the global version by at most `max_base_lag`; otherwise it is refused with a reason.
With `carry_counts`, a carried answer counts toward the quorum of the round it joins.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from syncer.merge.held import HeldDelta

EMA = 0.3  # weight of the newest sample in the ξ estimates


def smoothed(old: float | None, sample: float) -> float:
    """A ξ estimate (step time, sync time) after one more sample: an exponential moving average
    that the first sample starts."""
    return sample if old is None else (1 - EMA) * old + EMA * sample


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    quorum: int
    learners: int
    pipeline: int = 2
    round_timeout_s: float = 120.0
    grace_cap_s: float = 5.0
    grace_gamma: float = 1.0
    grace_tau: float = 2.0
    sync_interval_steps: int = 24
    min_round_interval_s: float = 0.0
    max_base_lag: int = 1
    carry_counts: bool = False
    total_rounds: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    learner_id: int
    generation: int
    tokens: int
    steps: int
    delta: torch.Tensor | HeldDelta  # d = θ − anchor, float32 on the merge device, or its payload held
    base_version: int
    carried: bool = False
    at: float = 0.0  # when it arrived (the coordinator's clock)
    age: int = 0  # commits of its fragment since this learner's last merged answer to it (set for the merge)
    origin: int = -1  # the round the push answered (a carried one: the round it was late for)
    moment: memoryview | None = None  # the learner's optimizer first moment at its push (DESIGN §3.9)
    nbytes: int = 0  # the push's payload bytes on the wire, less a shared moment's


@dataclasses.dataclass
class Attempt:
    round: int
    attempt: int
    fragment: int
    version: int
    members: dict[int, int]  # learner id -> connection generation, frozen at launch
    quorum: int
    launched_at: float
    deadline: float
    answers: dict[int, Answer] = dataclasses.field(default_factory=dict)
    quorum_at: float | None = None  # when quorum was first reached
    grace_s: float = 0.0  # the grace window chosen then
    finished_weight: float = 0.0  # raw weight of the learners that finished before it closed (`finished_weight`)

    def counted(self, carry_counts: bool) -> int:
        return sum(1 for a in self.answers.values() if carry_counts or not a.carried)


class Verdict(enum.Enum):
    WAIT = "wait"
    COMMIT = "commit"
    RETRY = "retry"


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What to do with an attempt, and why. `quorum_at`/`grace_s` are set when this decision is
    the first to see quorum: the caller records them on the attempt (its round enters GRACE)."""

    verdict: Verdict
    reason: str
    quorum_at: float | None = None
    grace_s: float = 0.0


def attempt_quorum(quorum: int, learners: int, finished: int) -> int:
    """K, lowered only for learners that finished training on purpose (never for failures)."""
    return max(1, min(quorum, learners - finished))


def fragment_of_round(round_id: int, num_fragments: int) -> int:
    return round_id % num_fragments


def last_of_fragment(round_id: int, num_fragments: int, total_rounds: int) -> bool:
    """Round `round_id` is the last that merges its fragment: the run stops after `total_rounds`
    (0: it never stops on its own)."""
    return bool(total_rounds) and round_id + num_fragments >= total_rounds


def pipeline_depth(pipeline: int, num_fragments: int) -> int:
    """Rounds in flight always target distinct fragments, so depth is at most P."""
    return max(1, min(pipeline, num_fragments))


def answer_ages(answers: Iterable[Answer], version: int, merged: Mapping[int, int]) -> tuple[Answer, ...]:
    """`answers` to a round of a fragment now at `version`, each with its age: the commits of the
    fragment since the one that merged that learner's last answer (`merged`: learner -> the version
    that commit made). An island that answers every round is 0; one that missed k rounds, its
    steps taken on bases up to k versions old and rebased forward, is k. A learner with no answer
    merged yet counts as fresh."""
    return tuple(dataclasses.replace(a, age=max(0, version - merged.get(a.learner_id, version))) for a in answers)


def finished_weight(answers: Iterable[Answer], finished: Iterable[int], merged_weights: Mapping[int, float]) -> float:
    """The raw merge weight (tokens² / steps, as `learner_weights` counts it) that the learners
    which finished training stand for in a round they did not answer: each its last merged
    answer's. A finished learner still belongs to the fleet the global model averages, with no
    more change to add; without it, the rounds after the others finished would merge whoever is
    left as the whole fleet (a straggler's own shard at full weight, a stale answer undamped)."""
    answered = {a.learner_id for a in answers}
    return math.fsum(merged_weights.get(lid, 0.0) for lid in finished if lid not in answered)


def answer_steps(sync_interval_steps: int, num_fragments: int, pipeline: int) -> int:
    """Inner steps a learner at the fleet's pace may take to answer a round: it answers one PULL
    per boundary, a boundary every b = ⌊H/P⌋ steps (the learner's own rule), oldest round first,
    and up to `pipeline` rounds are in flight, so an answer comes within depth·b steps of its
    launch. 0 when the syncer does not pace rounds (H = 0)."""
    if sync_interval_steps <= 0:
        return 0
    return pipeline_depth(pipeline, num_fragments) * max(1, sync_interval_steps // num_fragments)


def grace_window(*, step_s: float | None, quorum_s: float, sync_s: float, cfg: SchedulerConfig,
                 answer_steps: int = 0, pending_step_s: Sequence[float | None] = ()) -> tuple[float, str]:
    """γ·((a + τ)·ξ_step − ξ_quorum − ξ_sync), clamped to [0, cap]: the slack left before the round
    runs more than τ steps past the time a member at the fleet's pace needs to answer it, a =
    `answer_steps` (Decoupled DiLoCo's adaptive grace, counted from the launch: here an answer
    waits for its learner's boundary, and the quorum's own wait for boundaries is not lateness).

    `pending_step_s` holds the pending members' own step times (None: not known yet). A member more
    than τ× slower than the fleet is not expected in the window; when every pending member is such
    a one, there is no grace: the round does not wait for an island that answers every few rounds."""
    if cfg.grace_cap_s <= 0:
        return 0.0, "grace disabled"
    if step_s is None:
        return 0.0, "no step-time estimate yet"
    known = [s for s in pending_step_s if s is not None]
    if pending_step_s and len(known) == len(pending_step_s) and min(known) > cfg.grace_tau * step_s:
        return 0.0, (f"no grace: every straggler is more than {cfg.grace_tau:g}× slower than the fleet "
                     f"({min(known) * 1000:.0f} against {step_s * 1000:.0f} ms a step)")
    raw = cfg.grace_gamma * ((answer_steps + cfg.grace_tau) * step_s - quorum_s - sync_s)
    grace = min(max(raw, 0.0), cfg.grace_cap_s)
    return grace, (f"grace {grace * 1000:.0f} ms = clamp({cfg.grace_gamma:g}·(({answer_steps} + {cfg.grace_tau:g})·"
                   f"{step_s * 1000:.0f} − {quorum_s * 1000:.0f} − {sync_s * 1000:.0f}) ms, "
                   f"cap {cfg.grace_cap_s * 1000:.0f})")


def round_interval(step_s: float | None, num_fragments: int, cfg: SchedulerConfig) -> float:
    """Throttle: one round per (H/P)·ξ_step, so each fragment syncs every H learner steps."""
    paced = 0.0
    if cfg.sync_interval_steps > 0 and step_s is not None:
        paced = cfg.sync_interval_steps / num_fragments * step_s
    return max(paced, cfg.min_round_interval_s)


class Hold(enum.Enum):
    """Why no round is launched now (the launch decision's type; its reason is the text)."""

    BUDGET_SPENT = "budget spent"  # every round of --total-rounds is launched
    PIPELINE_FULL = "pipeline full"
    TOO_FEW_LEARNERS = "too few learners"
    THROTTLED = "throttled"  # paced to H learner steps per fragment: the next launch has a time


@dataclasses.dataclass(frozen=True, slots=True)
class Launch:
    """Whether to launch the next round now: `hold` is None to launch, else why not; `reason` says it."""

    hold: Hold | None
    reason: str

    @property
    def go(self) -> bool:
        return self.hold is None


def should_launch(
    now: float,
    *,
    cfg: SchedulerConfig,
    next_round: int,
    in_flight: int,
    depth: int,
    eligible: int,
    quorum: int,
    last_launch: float | None,
    interval_s: float,
) -> Launch:
    """Whether to launch round `next_round` now, and why (not)."""
    if cfg.total_rounds and next_round >= cfg.total_rounds:
        return Launch(Hold.BUDGET_SPENT, f"all {cfg.total_rounds} rounds launched")
    if in_flight >= depth:
        return Launch(Hold.PIPELINE_FULL, f"{in_flight} rounds in flight (pipeline {depth})")
    if eligible < quorum:
        return Launch(Hold.TOO_FEW_LEARNERS, f"waiting for learners: {eligible} connected, quorum {quorum}")
    if last_launch is not None and now < last_launch + interval_s:
        return Launch(Hold.THROTTLED, f"throttled: one round per {interval_s * 1000:.0f} ms")
    return Launch(None, f"{eligible} learners eligible, quorum {quorum}")


def decide_round(
    now: float, attempt: Attempt, live: dict[int, int], *, cfg: SchedulerConfig, step_s: float | None,
    sync_s: float, answer_steps: int = 0, member_step_s: Mapping[int, float] | None = None,
) -> Decision:
    """Decide an attempt, changing nothing. `live` maps learner id -> generation of learners still
    connected and still training; a member is pending only while its frozen generation is live
    and it has no fresh answer. `step_s` is the fleet's ξ_step, `member_step_s` each learner's own
    (the grace does not wait for members far slower than the fleet)."""
    counted = attempt.counted(cfg.carry_counts)
    pending = [lid for lid, gen in attempt.members.items()
               if live.get(lid) == gen and (lid not in attempt.answers or attempt.answers[lid].carried)]
    total = len(attempt.members)
    if counted >= attempt.quorum:
        if not pending:
            return Decision(Verdict.COMMIT, f"{counted} of {total} members answered (quorum {attempt.quorum})")
        quorum_at, grace_s, first = attempt.quorum_at, attempt.grace_s, attempt.quorum_at is None
        if quorum_at is None:
            quorum_at = now
            own = member_step_s or {}
            grace_s, _ = grace_window(step_s=step_s, quorum_s=now - attempt.launched_at, sync_s=sync_s, cfg=cfg,
                                      answer_steps=answer_steps, pending_step_s=[own.get(lid) for lid in pending])
        new = {"quorum_at": quorum_at, "grace_s": grace_s} if first else {}
        if now >= quorum_at + grace_s:
            return Decision(Verdict.COMMIT, f"quorum {attempt.quorum} reached with {counted} of {total} members; "
                            f"grace {grace_s * 1000:.0f} ms spent, {len(pending)} not waited for", **new)
        return Decision(Verdict.WAIT, f"in grace: {len(pending)} stragglers for {grace_s * 1000:.0f} ms", **new)
    if counted + len(pending) < attempt.quorum:
        return Decision(Verdict.RETRY, f"quorum {attempt.quorum} unreachable: {counted} answered, "
                        f"{len(pending)} of {total} members still connected")
    if now >= attempt.deadline:
        return Decision(Verdict.RETRY, f"deadline passed with {counted} of quorum {attempt.quorum} answers")
    return Decision(Verdict.WAIT, f"{counted} of quorum {attempt.quorum} answered")


class PushFate(enum.Enum):
    ACCEPT = "accept"  # an answer of the open attempt
    CARRY = "carry"  # missed its round: joins the fragment's next round, still encoded
    REFUSE = "refuse"


class RoundState(enum.Enum):
    """Where a round is in its lifecycle (`round_table.py` holds the moves between states)."""

    UNLAUNCHED = "unlaunched"
    OPEN = "open"  # an attempt collects answers, below quorum
    GRACE = "grace"  # quorum reached: waiting out the grace window for stragglers
    PARKED = "parked"  # its attempt was discarded; relaunched once a quorum of learners is live
    CLOSED = "closed"  # decided, waiting for the rounds before it to commit
    COMMITTED = "committed"
    ABANDONED = "abandoned"  # the run finalized before it committed


def judge_push(
    *,
    learner_id: int,
    generation: int,
    round_id: int,
    attempt_id: int,
    fragment: int,
    base_version: int,
    round_fragment: int,
    round_state: RoundState,
    attempt: Attempt | None,
    version_now: int,
    cfg: SchedulerConfig,
    merged: bool = False,
) -> tuple[PushFate, str]:
    """What to do with a push (DESIGN §4.3, §4.6). `attempt` is the attempt of the push's round
    (when `round_state` is OPEN or GRACE); `version_now` the fragment's current global version;
    `merged`: this learner's answer to this round is already in a commit (a push sent twice)."""
    if fragment != round_fragment:
        return PushFate.REFUSE, f"round {round_id} merges fragment {round_fragment}, not {fragment}"
    if merged:
        return PushFate.REFUSE, f"learner {learner_id}'s answer to round {round_id} is already merged"
    if round_state is RoundState.UNLAUNCHED:
        return PushFate.REFUSE, f"round {round_id} was never launched"
    if round_state is RoundState.ABANDONED:
        return PushFate.REFUSE, f"round {round_id} was abandoned: the run is finalizing"
    if base_version > version_now:
        return PushFate.REFUSE, (f"base version {base_version} of fragment {fragment} is ahead of the global "
                                 f"version {version_now}")
    collecting = round_state in (RoundState.OPEN, RoundState.GRACE)
    if collecting and attempt is not None and attempt.attempt == attempt_id:
        if attempt.members.get(learner_id) != generation:
            return PushFate.REFUSE, (f"learner {learner_id} (generation {generation}) is not a member of round "
                                     f"{round_id} attempt {attempt_id}")
        held = attempt.answers.get(learner_id)
        if held is not None and not held.carried:
            return PushFate.REFUSE, f"learner {learner_id} already answered round {round_id}"
        if base_version != attempt.version:
            return PushFate.REFUSE, (f"round {round_id} merges version {attempt.version} of fragment {fragment}; "
                                     f"the push is based on version {base_version}")
        return PushFate.ACCEPT, "answer"
    # Late: a discarded attempt of an open or parked round, or a round closed or committed. It
    # joins the fragment's next merge, whose version is one higher if this round still commits.
    target = version_now + (1 if round_state is RoundState.CLOSED else 0)
    lag = target - base_version
    if lag > cfg.max_base_lag:
        return PushFate.REFUSE, (f"late for round {round_id}: base version {base_version} would lag fragment "
                                 f"{fragment}'s next merge (version {target}) by {lag} > --max-base-lag "
                                 f"{cfg.max_base_lag}")
    return PushFate.CARRY, f"late for round {round_id} attempt {attempt_id} (base lag {lag}): carried"


def should_finalize(
    *, next_round: int, total_rounds: int, training: int, finished: int,
    away: Mapping[int, float] | None = None, now: float = 0.0, rejoin_wait_s: float = 0.0,
) -> tuple[bool, str]:
    """Finalize when the round budget is spent, or when every connected learner has finished and
    no learner that left while training (``away``: learner id → when it left) may still come back.

    Such a learner (a crash, a stall, a cut link) is waited for until ``rejoin_wait_s`` after it
    left: finalizing before it reconnects would throw away the steps it has still to train. The
    reason then says whom the run is waiting for, and later whom it gave up on.
    """
    if total_rounds and next_round >= total_rounds:
        return True, f"completed {total_rounds} rounds"
    if not finished or training:
        return False, ""
    away = away or {}
    waiting = sorted(lid for lid, left_at in away.items() if now < left_at + rejoin_wait_s)
    if waiting:
        return False, (f"every connected learner finished; waiting up to {rejoin_wait_s:g} s from its departure "
                       f"for learner(s) {', '.join(map(str, waiting))}, which left while training")
    why = f"{finished} learner(s) finished training and none is still training"
    if away:
        why += (f"; learner(s) {', '.join(map(str, sorted(away)))} left while training and did not come back "
                f"within {rejoin_wait_s:g} s")
    return True, why
