"""Streaming RL islands (`YETO_DILOCO_RL_MODE=stream`): a DiLoCo boundary every H/P optimizer steps inside
verl's actor updates. Two islands (one of two FSDP2 ranks) train against the real syncer until its round
budget ends the run, sharing their optimizers' first moments (DESIGN §3.9: the FSDP2 moments are DTensors
read by every rank); every rank and every rollout then holds the syncer's final checkpoint bit for bit, and
the iterations verl still runs after the final cut leave the weights as they are."""

from __future__ import annotations

from pathlib import Path

import pytest
from islands import Finished, assert_equal_tensors, run_islands

ITERATIONS = 12
ROUNDS = 4  # H = P = 2: a fragment round per optimizer step, so the budget ends the run mid-way


@pytest.fixture(scope="module")
def finished(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    return run_islands(tmp_path_factory.mktemp("stream"), tiny_model_dir, iterations=ITERATIONS,
                       syncer_flags=("--total-rounds", str(ROUNDS), "--sync-interval-steps", "0"),
                       sync_interval=2, rl_mode="stream", share_momentum=True)


@pytest.mark.timeout(300)
def test_rounds_commit_in_order_and_merge_both_islands(finished: Finished) -> None:
    commits = finished.commits()
    assert [c["round"] for c in commits] == list(range(ROUNDS))
    assert any(sorted(c["learners"]) == [0, 1] for c in commits), commits
    assert any(sorted(c.get("moments") or []) == [0, 1] for c in commits), "no round averaged both moments"
    assert any(r["event"] == "final" for r in finished.tape())


@pytest.mark.timeout(300)
def test_every_rank_and_rollout_hold_the_final_checkpoint(finished: Finished) -> None:
    final = finished.checkpoint()
    for learner, reports in finished.reports.items():
        assert all(r["final_installed"] for r in reports), f"island {learner}: {reports}"
        assert_equal_tensors(finished.saved(learner, "actor_params"), final, f"island {learner}'s actor")
        assert_equal_tensors(finished.saved(learner, "rollout_weights"), final, f"island {learner}'s rollout")
        last = [r["per_iteration"][-1] for r in reports]
        assert all(rec["actor_digests"] == last[0]["actor_digests"] for rec in last), f"island {learner}'s ranks"


@pytest.mark.timeout(300)
def test_training_stops_changing_the_weights_at_the_final_cut(finished: Finished) -> None:
    """An island that gets the cut before its last iteration keeps it through the rest; a faster one may
    have trained all its iterations first and asked for the cut at the end (`finish()`)."""
    cuts = {learner: next(i for i, rec in enumerate(reports[0]["per_iteration"]) if rec["final"])
            for learner, reports in finished.reports.items()}
    assert min(cuts.values()) < ITERATIONS - 1, f"no island got the final cut before its last iteration: {cuts}"
    for learner, reports in finished.reports.items():
        records, cut = reports[0]["per_iteration"], cuts[learner]
        for rec in records[cut:]:
            assert rec["actor_digests"] == records[cut]["actor_digests"], f"island {learner}, {rec['iteration']}"
            assert rec["rollout_digests"] == rec["actor_digests"], f"island {learner}, {rec['iteration']}"
        assert records[cut - 1]["actor_digests"] != records[cut]["actor_digests"]  # it did train before
