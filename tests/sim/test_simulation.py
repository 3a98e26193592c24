"""The whole run, simulated: thousands of seeded fault schedules, every invariant checked after each
(`tests/sim/invariants.py`). `YETO_SIM_SEEDS` sets how many seeds run here; `python -m tests.sim
--seeds N` runs more, and a failing seed prints the one command that replays it."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import pytest
import torch

from syncer.core.commit import Commit
from tests.sim.invariants import check
from tests.sim.runner import replay_command, run_seeds
from tests.sim.world import Run, Scenario, simulate

pytestmark = pytest.mark.unit

SEEDS = int(os.environ.get("YETO_SIM_SEEDS", "2000"))


@pytest.mark.timeout(600)  # about 120 s on two cores; a test checks invariants, a benchmark checks speed
def test_thousands_of_seeded_runs_with_faults_hold_every_invariant() -> None:
    started = time.monotonic()
    failures = run_seeds(range(SEEDS))
    took = time.monotonic() - started
    print(f"{SEEDS} simulated runs in {took:.0f} s, {len(failures)} failed")
    assert not failures, "\n".join(f"seed {seed}: {'; '.join(problems)}\n  replay: {replay_command(seed)}"
                                   for seed, problems in failures[:10])


def _fingerprint(run: Run) -> list[str]:
    """Everything a replay must reproduce: every syncer's tape and every learner's end, hashed."""
    digest = hashlib.sha256()
    for node in run.incarnations:
        for record in node.tape.records:
            digest.update(repr(sorted((k, v) for k, v in record.items() if not k.endswith("_ms"))).encode())
    for trained in run.trained:
        digest.update(repr((trained.process, trained.tokens, trained.steps, trained.final_installed)).encode())
        for values in trained.finals or []:
            digest.update(values.numpy().tobytes())
    return [digest.hexdigest(), f"{run.end_s:.9f}"]


def test_a_seed_replays_exactly() -> None:
    logging.disable(logging.CRITICAL)
    try:
        seed = next(s for s in range(100) if {f.kind for f in Scenario.draw(s).faults} >= {"syncer", "drop"})
        assert simulate(seed, _fingerprint) == simulate(seed, _fingerprint)
    finally:
        logging.disable(logging.NOTSET)


def test_the_seeds_draw_every_fault() -> None:
    kinds = {f.kind for s in range(200) for f in Scenario.draw(s).faults}
    assert kinds == {"drop", "crash", "syncer", "freeze", "intruder", "duplicate"}
    scenarios = [Scenario.draw(s) for s in range(200)]
    assert {sc.learners for sc in scenarios} == {2, 3, 4, 5} and {sc.syncer["pipeline"] for sc in scenarios} == {1, 2}
    assert {sc.learner["wire_dtype"] for sc in scenarios} == {"f32", "bf16", "int8", "int4", "e3m0"}
    assert any(sc.learner["lockstep"] for sc in scenarios) and any(
        sc.learner["downlink_dtype"] != "f32" for sc in scenarios)
    assert any(sc.mixed_downlinks for sc in scenarios)
    assert any(sc.syncer["total_rounds"] for sc in scenarios)
    assert {sc.learner["answer_on_arrival"] for sc in scenarios} == {True, False}
    assert {sc.stranger for sc in scenarios} == {True, False}


def test_a_ledger_that_counts_a_push_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The invariants have teeth: a syncer that adds a commit's tokens twice fails its seed."""
    merged = Commit.merged

    def twice(self: Commit, round_id: int, out: object) -> None:
        merged(self, round_id, out)  # type: ignore[arg-type]
        state = self.shared.state
        if state is not None and round_id == 1:
            for key in state.ledger:
                state.ledger[key] *= 2

    monkeypatch.setattr(Commit, "merged", twice)
    logging.disable(logging.CRITICAL)
    try:
        problems = simulate(next(s for s in range(100) if not Scenario.draw(s).faults), check)
    finally:
        logging.disable(logging.NOTSET)
    assert any("token ledger" in p for p in problems), problems


def test_a_final_cut_that_differs_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sim import learner_node

    receive = learner_node.SimLink._receive

    def corrupted(self: learner_node.SimLink, msg: object, payload: bytes | None) -> None:
        if type(msg).__name__ == "Final" and self.me.learner_id == 1 and payload:
            values = torch.frombuffer(bytearray(payload), dtype=torch.float32).clone()
            values[0] += 1.0
            payload = values.numpy().tobytes()
        receive(self, msg, payload)  # type: ignore[arg-type]

    monkeypatch.setattr(learner_node.SimLink, "_receive", corrupted)
    logging.disable(logging.CRITICAL)
    try:
        problems = simulate(next(s for s in range(100) if not Scenario.draw(s).faults), check)
    finally:
        logging.disable(logging.NOTSET)
    assert any("learner 1" in p and "final cut that differs" in p for p in problems), problems


def test_a_finale_that_waits_for_a_learner_of_another_model_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner refused when the model is pinned never trained: a syncer that kept its life (so
    finalized waiting for it, out to --final-timeout-s) fails its seed."""
    from syncer.core.lifecycle import Lives

    left = Lives.left

    def remembers(self: Lives, learner_id: int, now: float, *, trained: bool) -> None:
        if trained:
            left(self, learner_id, now, trained=trained)

    seed = next(s for s in range(500) if Scenario.draw(s).stranger and not Scenario.draw(s).faults)
    logging.disable(logging.CRITICAL)
    try:
        assert simulate(seed, check) == []
        monkeypatch.setattr(Lives, "left", remembers)
        problems = simulate(seed, check)
    finally:
        logging.disable(logging.NOTSET)
    assert any("of another model, which never trained" in p for p in problems), problems
