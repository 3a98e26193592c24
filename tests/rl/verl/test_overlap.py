"""Overlap (`YETO_DILOCO_RL_MODE=overlap`) on verl's real actor: each island sweeps every fragment at the
end of an RL iteration and trains the next at once, so its rollout always gets the island's own weights
(policy age 0) and the merges are rebased in at later sweeps. Every optimizer step's tokens reach the
syncer's merges exactly once (the final flush pushes the last ones), and both islands end on the syncer's
final checkpoint. (Exactly-once on exact integer values, and across syncer kills, is
`tests/integration/test_rl_overlap.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from islands import Finished, assert_equal_tensors, run_islands

ITERATIONS = 4
FRAGMENTS = 2


@pytest.fixture(scope="module")
def finished(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    return run_islands(tmp_path_factory.mktemp("overlap"), tiny_model_dir, iterations=ITERATIONS,
                       syncer_flags=("--pipeline", str(FRAGMENTS), "--sync-interval-steps", "0",
                                     "--round-timeout-s", "20"),
                       rl_mode="overlap", final_flush=1)


@pytest.mark.timeout(300)
def test_every_step_and_token_is_merged_exactly_once(finished: Finished) -> None:
    commits = finished.commits()
    assert commits and [c["round"] for c in commits] == sorted(c["round"] for c in commits)
    for learner, reports in finished.reports.items():
        trained = sum(rec["tokens"] for rec in reports[0]["per_iteration"])
        for fragment in range(FRAGMENTS):
            mine = [(c["steps"][c["learners"].index(learner)], c["tokens"][c["learners"].index(learner)])
                    for c in commits if c["fragment"] == fragment and learner in c["learners"]]
            assert sum(s for s, _ in mine) == ITERATIONS, (learner, fragment, mine)
            assert sum(t for _, t in mine) == trained, (learner, fragment, mine, trained)


@pytest.mark.timeout(300)
def test_rollouts_run_the_islands_own_weights_and_end_on_the_final_cut(finished: Finished) -> None:
    final = finished.checkpoint()
    for learner, reports in finished.reports.items():
        for report in reports:
            assert report["final_installed"]
            for rec in report["per_iteration"]:
                assert rec["rollout_digests"] == rec["actor_digests"], (learner, rec["iteration"])
        assert_equal_tensors(finished.saved(learner, "rollout_weights"), final, f"island {learner}'s rollout")
        assert_equal_tensors(finished.saved(learner, "actor_params"), final, f"island {learner}'s actor")
