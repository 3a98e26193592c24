"""Round decisions as pure functions of state and time (SPEC §3.2).

Nothing here sends, sleeps or reads a clock: the coordinator passes `now` in and acts on the
returned decision, and every decision comes with its reason (which goes to the event tape).

A *round* merges one fragment; round r targets fragment r mod P (staggered, streaming DiLoCo).
An *attempt* of a round freezes its rendezvous at launch: the members (learner id and
connection generation) and the quorum. Learners that join or reconnect later only count for
later attempts; a member that disconnects after answering keeps its answer. An attempt whose
quorum can no longer be reached, or whose deadline passes below quorum, is discarded and the
round is retried under a new attempt id.
"""

from __future__ import annotations

import dataclasses
import enum

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    learner_id: int
    generation: int
    tokens: int
    steps: int
    delta: torch.Tensor  # d = θ − anchor, float32, on the merge device


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


class Verdict(enum.Enum):
    WAIT = "wait"
    COMMIT = "commit"
    RETRY = "retry"


def attempt_quorum(quorum: int, learners: int, finished: int) -> int:
    """K, lowered only for learners that finished training on purpose (never for failures)."""
    return max(1, min(quorum, learners - finished))


def fragment_of_round(round_id: int, num_fragments: int) -> int:
    return round_id % num_fragments


def should_launch(
    *, eligible: int, quorum: int, next_round: int, total_rounds: int, in_flight: bool
) -> tuple[bool, str]:
    """Whether to launch an attempt now, and why (not)."""
    if in_flight:
        return False, "a round is in flight"
    if total_rounds and next_round >= total_rounds:
        return False, f"all {total_rounds} rounds committed"
    if eligible < quorum:
        return False, f"waiting for learners: {eligible} connected, quorum {quorum}"
    return True, f"{eligible} learners eligible, quorum {quorum}"


def decide_round(now: float, attempt: Attempt, live: dict[int, int]) -> tuple[Verdict, str]:
    """Decide an attempt. `live` maps learner id -> generation of learners still connected and
    still training; a member counts as pending only while its frozen generation is live."""
    answered = len(attempt.answers)
    pending = [lid for lid, gen in attempt.members.items() if lid not in attempt.answers and live.get(lid) == gen]
    total = len(attempt.members)
    if answered >= attempt.quorum and not pending:
        return Verdict.COMMIT, f"{answered} of {total} members answered (quorum {attempt.quorum})"
    if answered >= attempt.quorum:
        return Verdict.COMMIT, f"quorum {attempt.quorum} reached with {answered} of {total} members"
    if answered + len(pending) < attempt.quorum:
        return Verdict.RETRY, (f"quorum {attempt.quorum} unreachable: {answered} answered, "
                               f"{len(pending)} of {total} members still connected")
    if now >= attempt.deadline:
        return Verdict.RETRY, f"deadline passed with {answered} of quorum {attempt.quorum} answers"
    return Verdict.WAIT, f"{answered} of quorum {attempt.quorum} answered"


def should_finalize(*, next_round: int, total_rounds: int, training: int, finished: int) -> tuple[bool, str]:
    """Finalize when the round budget is spent, or when every connected learner has finished."""
    if total_rounds and next_round >= total_rounds:
        return True, f"completed {total_rounds} rounds"
    if finished and not training:
        return True, f"{finished} learner(s) finished training and none is still training"
    return False, ""
