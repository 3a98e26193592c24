"""`StatusBoard`: the status page's figures from hand-written tape records and traffic."""

from __future__ import annotations

import json

import pytest

from syncer.web.status import RATE_WINDOW_S, RECENT_ROUNDS, StatusBoard

SHAPE = {"learners": 2, "quorum": 2, "fragments": 2, "pattern": "binpack", "pipeline": 2, "total_rounds": 0,
         "merge": "rda", "device": "cpu"}


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def commit(t: float, rnd: int, fragment: int, version: int, learners: list[int], tokens: list[int],
           bases: list[int], **extra: object) -> dict[str, object]:
    return {"event": "commit", "t": t, "round": rnd, "attempt": rnd, "fragment": fragment, "version": version,
            "learners": learners, "tokens": tokens, "base_versions": bases, "carried": [], "not_waited_for": [],
            "reason": "2 of 2 members answered", "wait_ms": 50.0, "grace_ms": 0.0, "merge_ms": 1.5, **extra}


def test_a_run_reads_as_its_records_say() -> None:
    clock = Clock()
    board = StatusBoard(SHAPE, 2, clock=clock)
    assert board.snapshot()["phase"].startswith("waiting")
    for rec in ({"event": "join", "t": 1000.0, "learner": 0, "generation": 1},
                {"event": "join", "t": 1000.5, "learner": 1, "generation": 1},
                {"event": "init", "t": 1001.0, "fragments": 2},
                commit(1002.0, 0, 0, 1, [0, 1], [64, 128], [0, 0], consensus_js=0.01),
                {"event": "carry", "t": 1002.5, "learner": 1, "round": 1, "fragment": 1},
                commit(1003.0, 1, 1, 1, [0, 1], [64, 128], [0, 0], carried=[1]),
                {"event": "retry", "t": 1003.5, "round": 2, "attempt": 3, "fragment": 0, "reason": "no quorum",
                 "answered": [0]},
                # learner 1 pushed against version 0 of fragment 0, which had moved on to 1: one version behind
                commit(1004.0, 2, 0, 2, [0, 1], [64, 128], [1, 0], not_waited_for=[]),
                {"event": "refused", "t": 1004.2, "learner": 0, "round": 3, "reason": "NaN"},
                {"event": "left", "t": 1004.5, "learner": 1, "generation": 1, "reason": "gone"},
                {"event": "done", "t": 1004.6, "learner": 0, "step": 12}):
        board.observe(rec)
    clock.t = 1010.0
    snap = json.loads(json.dumps(board.snapshot()))  # JSON-ready as it is
    assert snap["phase"] == "running" and snap["shape"] == SHAPE
    assert snap["counts"] == {"committed": 3, "retried": 1, "abandoned": 0, "carried": 1, "refused": 1}
    learners = {lr["learner"]: lr for lr in snap["learners"]}
    assert learners[0]["state"] == "done" and learners[0]["done_step"] == 12
    assert learners[1]["state"] == "gone" and learners[1]["generation"] == 1
    assert learners[0]["tokens"] == 192 and learners[1]["tokens"] == 384
    assert learners[0]["pushes"] == learners[1]["pushes"] == 3
    assert learners[0]["lag"] == 0 and learners[1]["lag"] == 1
    assert learners[0]["last_push_age_s"] == pytest.approx(6.0)
    assert learners[1]["carried"] == 1 and learners[0]["refused"] == 1
    assert [f["version"] for f in snap["fragments"]] == [2, 1]
    assert [f["last_commit_age_s"] for f in snap["fragments"]] == [pytest.approx(6.0), pytest.approx(7.0)]
    assert [(r["round"], r["decision"]) for r in snap["rounds"]] == [(2, "commit"), (2, "retry"), (1, "commit"),
                                                                    (0, "commit")]
    assert [p["consensus_js"] for p in snap["series"]] == [0.01, None, None]
    assert [p["tokens"] for p in snap["series"]] == [192, 192, 192]


def test_a_reconnect_and_the_final_show() -> None:
    board = StatusBoard(SHAPE, 2, clock=Clock())
    board.observe({"event": "join", "t": 1000.0, "learner": 0, "generation": 1})
    board.observe({"event": "join", "t": 1001.0, "learner": 0, "generation": 2})
    board.observe({"event": "left", "t": 1001.1, "learner": 0, "generation": 1, "reason": "replaced"})  # the old one
    board.observe({"event": "final", "t": 1002.0, "rounds": 7, "reason": "every learner is done"})
    snap = board.snapshot()
    (learner,) = snap["learners"]
    assert (learner["state"], learner["generation"], learner["joins"]) == ("connected", 2, 2)
    assert snap["phase"] == "finalizing" and snap["final"]["rounds"] == 7


def test_link_rates_average_the_last_minute() -> None:
    clock = Clock(0.0)
    board = StatusBoard(SHAPE, 1, clock=clock)
    board.observe({"event": "join", "t": 0.0, "learner": 0, "generation": 1})
    board.traffic("in", 0, "int4", 6000)  # at t=0
    clock.t = 30.0
    board.traffic("in", 0, "int4", 6000)
    board.traffic("out", 0, "f32", 3000)
    (view,) = board.snapshot()["learners"]
    assert view["in_bytes_per_s"] == pytest.approx(12000 / 30.0)  # 30 s since the join
    assert view["bytes_in"] == 12000 and view["bytes_out"] == 3000
    clock.t = RATE_WINDOW_S + 10.0  # the first push left the window; the span is the whole window
    (view,) = board.snapshot()["learners"]
    assert view["in_bytes_per_s"] == pytest.approx(6000 / RATE_WINDOW_S)
    assert view["bytes_in"] == 12000


def test_only_the_last_rounds_are_kept() -> None:
    board = StatusBoard(SHAPE, 1, clock=Clock())
    for r in range(RECENT_ROUNDS + 5):
        board.observe(commit(1000.0 + r, r, 0, r + 1, [0], [1], [r]))
    rounds = board.snapshot()["rounds"]
    assert len(rounds) == RECENT_ROUNDS and rounds[0]["round"] == RECENT_ROUNDS + 4
