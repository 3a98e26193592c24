"""The policy sweep (`YETO_DILOCO_RL_MODE=sweep`): at the end of every RL iteration each island pushes every
fragment at once, the syncer (`--pipeline P`, rounds unpaced) merges them in order, and the island installs
every merge before verl hands the rollout its weights. So after each `update_actor` + `update_weights` both
islands' rollouts hold the same global policy, every push of a sweep is based on the same global version, and
the tape shows P rounds per iteration, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
from islands import Finished, assert_equal_tensors, run_islands

ITERATIONS = 3
FRAGMENTS = 2


@pytest.fixture(scope="module")
def finished(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    return run_islands(tmp_path_factory.mktemp("sweep"), tiny_model_dir, iterations=ITERATIONS,
                       syncer_flags=("--total-rounds", str(ITERATIONS * FRAGMENTS), "--pipeline", str(FRAGMENTS),
                                     "--sync-interval-steps", "0"),
                       rl_mode="sweep")


@pytest.mark.timeout(300)
def test_each_iteration_is_one_sweep_of_every_fragment_on_one_base(finished: Finished) -> None:
    commits = finished.commits()
    assert [c["round"] for c in commits] == list(range(ITERATIONS * FRAGMENTS))
    for iteration in range(ITERATIONS):
        sweep = commits[iteration * FRAGMENTS : (iteration + 1) * FRAGMENTS]
        assert [c["fragment"] for c in sweep] == list(range(FRAGMENTS)), sweep
        for commit in sweep:
            assert sorted(commit["learners"]) == [0, 1], commit
            assert commit["base_versions"] == [iteration, iteration], commit  # one base for the whole sweep
            assert commit["version"] == iteration + 1


@pytest.mark.timeout(300)
def test_every_rollout_gets_the_global_policy_of_its_iteration(finished: Finished) -> None:
    first, second = (finished.reports[learner] for learner in (0, 1))
    for iteration in range(ITERATIONS):
        held = [report["per_iteration"][iteration] for report in (*first, *second)]
        assert all(rec["rollout_digests"] == held[0]["rollout_digests"] for rec in held), f"iteration {iteration}"
        assert all(rec["actor_digests"] == rec["rollout_digests"] for rec in held), f"iteration {iteration}"
    final = finished.checkpoint()
    for learner in (0, 1):
        assert_equal_tensors(finished.saved(learner, "rollout_weights"), final, f"island {learner}'s rollout")
        assert all(report["final_installed"] for report in finished.reports[learner])
