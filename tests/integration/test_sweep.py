"""`sweep()`: a boundary for every fragment at once, for trainers whose steps come in phases (an RL
trainer's rollout, then its updates). Here the per-step boundaries never come (H is far beyond
the run), so every push the syncer merges went out through a sweep."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Island, Procs, checkpoint_params, start_syncer, syncer_exit_code

pytestmark = pytest.mark.integration

ROUNDS = 8


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True], ids=["wait-for-merges", "overlap"])
def test_phases_that_end_in_a_sweep_train_one_model_with_the_syncer(procs: Procs, key_file: Path,
                                                                     overlap: bool) -> None:
    # Rounds unpaced by steps, so the learner keeps its own H: too large for any boundary but the sweeps.
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=ROUNDS,
                          extra=["--sync-interval-steps", "0"])
    island = Island(syncer, key_file, sync_interval=1_000_000, overlap=overlap)
    session = island.session
    try:
        island.start()
        finished = False
        for _phase in range(200):
            if any(island.train_step() for _ in range(4)):
                finished = True
                break
            installs, pushes = session.stats.installs, session.stats.pushes + session.stats.push_failures
            if session.sweep():
                finished = True
                break
            if not overlap and session.stats.pushes + session.stats.push_failures > pushes:
                # It came back once its pushes were merged and installed.
                assert session.stats.installs > installs
                assert not session.pulls_to_answer()
        assert finished, "the final cut never came"
        assert session.stats.final_installed
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    commits = [r for r in syncer.tape_records() if r["event"] == "commit"]
    assert [r["round"] for r in commits] == list(range(ROUNDS))
    assert all(r["learners"] == [0] for r in commits), "a round went without the sweep's push"
    assert session.stats.steps < 1_000_000 // 2  # no per-step boundary was ever reached
    assert syncer.checkpoint is not None
    ckpt = checkpoint_params(syncer.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.equal(param.detach(), ckpt[name]), f"{name} differs from the final checkpoint"
