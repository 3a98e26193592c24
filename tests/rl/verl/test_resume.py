"""An island killed mid-run and resumed from verl's own checkpoint (`trainer.resume_mode`, verl's default `auto`)
rejoins with the syncer's current global weights, not its checkpoint's, keeps its iteration count, and still
installs the final cut on its last iteration.

One island (learner 0, quorum 1), so the global weights move only with its sweeps: it saves verl's checkpoint
after global step 1, sweeps step 2 into the run, and is killed (SIGKILL to its torchrun launcher and rank). The
checkpoint holds the global weights of step 1; the run has moved on to step 2's. Restarted with `--resume`, the
worker loads the checkpoint as verl's trainer does, after the worker is built, and then must hold step 2's weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from islands import ISLAND, assert_equal_tensors
from processes import island_env, start_syncer, stopped_at_exit, torchrun
from safetensors.torch import load_file

ITERATIONS = 4
SAVE_AT = 1  # verl's checkpoint after global step 1 (iteration 0)
KILLED_AFTER = 2  # iterations done (and swept into the run) when the island is killed


@pytest.mark.timeout(420)
def test_a_killed_island_resumed_from_verls_checkpoint_rejoins_the_present(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    syncer = start_syncer(tmp_path, "--quorum", "1", "--pipeline", "2", "--sync-interval-steps", "0", learners=1)
    before, after = tmp_path / "before", tmp_path / "after"
    env = island_env(syncer, 0, rl_mode="sweep")
    common = ["--model", str(tiny_model_dir), "--iterations", str(ITERATIONS)]
    with stopped_at_exit(syncer.run) as running:
        first = torchrun(ISLAND, 1, [*common, "--out", str(before), "--save-at", str(SAVE_AT),
                                     "--hang-after", str(KILLED_AFTER)], tmp_path / "before.log", env, name="island")
        running.append(first)
        report_path = before / "rank0.json"
        deadline = time.monotonic() + 200
        while not report_path.exists():
            assert first.process.poll() is None, first.tail()
            assert time.monotonic() < deadline, first.tail()
            time.sleep(0.2)
        first.crash()  # SIGKILL to the launcher and its rank, mid-run
        checkpoint = before / "ckpt" / f"global_step_{SAVE_AT}"
        assert (checkpoint / "actor").is_dir(), first.tail()

        second = torchrun(ISLAND, 1, [*common, "--out", str(after), "--resume", str(checkpoint)],
                          tmp_path / "after.log", env, name="resumed island")
        running.append(second)
        assert second.wait(240) == 0, second.tail() + syncer.run.tail()
        assert syncer.run.wait(60) == 0, syncer.run.tail()

    killed = json.loads(report_path.read_text())["per_iteration"]
    resumed = json.loads((after / "rank0.json").read_text())
    # The checkpoint's weights are step 1's; the island took the run's present, step 2's.
    assert resumed["resumed_digests"] == killed[KILLED_AFTER - 1]["actor_digests"]
    assert resumed["resumed_digests"] != killed[SAVE_AT - 1]["actor_digests"]
    # It counts on from the checkpoint, and its last iteration installs the final cut.
    assert resumed["resumed_iterations"] == SAVE_AT
    assert [r["iteration"] for r in resumed["per_iteration"]] == list(range(SAVE_AT, ITERATIONS))
    assert resumed["final_installed"] and resumed["per_iteration"][-1]["final"]
    final = {k.removeprefix("param/"): v for k, v in load_file(str(syncer.checkpoint)).items()
             if k.startswith("param/")}
    assert_equal_tensors(load_file(str(after / "actor_params.safetensors")), final, "the resumed island's actor")
    tape = [json.loads(line) for line in syncer.tape.read_text().splitlines() if line.strip()]
    # The killed run's join; the resumed run's, when verl built its worker; its join again after verl's load.
    assert [r["learner"] for r in tape if r["event"] == "join"] == [0, 0, 0], tape
