"""Elastic membership (DESIGN §4.2): a learner that joins a running job receives the current global
state, contributes from the next round on, and ends with the same final model as the others."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import Island, Procs, checkpoint_params, commits, read_tape, start_syncer, syncer_exit_code, wait_until

pytestmark = pytest.mark.integration

ROUNDS = 40


def run(island: Island, deadline: float, errors: list[BaseException]) -> None:
    try:
        island.start()
        while not island.finished and time.monotonic() < deadline:
            island.train_step()
            time.sleep(0.004)  # the islands share two cores with the syncer
    except BaseException as exc:  # surfaced by the test thread
        errors.append(exc)


@pytest.mark.timeout(150)
def test_a_learner_joining_mid_run_ends_with_the_same_model(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=3, quorum=2, fragments=4, total_rounds=ROUNDS,
                          extra=["--grace-s", "0.1"])
    assert syncer.checkpoint is not None and syncer.tape is not None
    islands = [Island(syncer, key_file, i) for i in range(4)]
    errors: list[BaseException] = []
    deadline = time.monotonic() + 110
    threads = [threading.Thread(target=run, args=(islands[i], deadline, errors), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        tape = syncer.tape
        wait_until(lambda: len(commits(read_tape(tape))) >= 8, 60, "8 commits before the late joiner")
        joined_at = len(commits(read_tape(tape)))
        late = threading.Thread(target=run, args=(islands[3], deadline, errors), daemon=True)
        late.start()
        threads.append(late)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not errors, errors
        assert all(i.finished for i in islands), [i.finished for i in islands]
    finally:
        for island in islands:
            island.close()
    assert syncer_exit_code(syncer) == 0
    done = commits(read_tape(syncer.tape))
    assert [c["round"] for c in done] == list(range(ROUNDS))
    assert all(3 not in c["learners"] for c in done[:joined_at])
    assert any(3 in c["learners"] for c in done[joined_at:]), "the late learner never contributed"
    reference = checkpoint_params(syncer.checkpoint)
    for island in islands:
        for name, param in island.model.named_parameters():
            assert torch.equal(param.detach(), reference[name]), (island.session.settings.learner_id, name)
