"""`YETO_DILOCO_SHARE_MOMENTUM` end to end (DESIGN §3.9): the real syncer and two islands whose
AdamW first moments ride on their pushes and come back averaged on the broadcasts.

The islands step round-robin under the product's lockstep schedule, so a run is a function of
its seeds: two runs with shared moments end bit for bit alike, and differ from a run without
them (the moments reach the optimizers). Every island still ends holding the checkpoint's
parameters exactly: the moments are advice to the optimizers and never touch the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    Procs,
    assert_bit_identical,
    checkpoint_params,
    commits,
    model_dir,
    model_tensors,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
)
from lockstep import SeededIsland, round_robin

pytestmark = pytest.mark.integration

STEPS = 31
H = 8  # with 4 fragments, a boundary every 2 steps


def run(procs: Procs, key_file: Path, tag: str, *,
        share: tuple[bool, bool]) -> tuple[dict[str, torch.Tensor], list, list[int]]:
    syncer = start_syncer(procs, key_file=key_file, tape_name=f"{tag}.jsonl", checkpoint_name=f"{tag}.safetensors",
                          extra=["--sync-interval-steps", "0", "--pipeline", "2"])
    settings: dict[str, Any] = {"lockstep": True, "sync_interval": H, "lockstep_timeout_s": 30}
    islands = [SeededIsland(syncer, key_file, i, share_momentum=share[i], **settings) for i in range(2)]
    for island, shares in zip(islands, share, strict=True):  # AdamW, as a Trainer builds it
        island.opt = torch.optim.AdamW(island.model.parameters(), lr=0.01)
        if shares:
            island.session.share_momentum(island.opt)
    try:
        round_robin(islands, STEPS, syncer)
        shared = [i.session.stats.moments_shared for i in islands]
        finals = [dict(i.model.named_parameters()) for i in islands]
        for name, value in finals[0].items():
            assert torch.equal(value, finals[1][name]), f"{name} differs between the islands"
    finally:
        for island in islands:
            island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    params = checkpoint_params(syncer.checkpoint)
    for name, value in finals[0].items():
        assert torch.equal(value.detach(), params[name]), f"{name}: the islands do not hold the final cut"
    return params, commits(syncer.tape_records()), shared


@pytest.mark.timeout(240)
def test_shared_moments_reach_the_optimizers_and_the_run_stays_reproducible(procs: Procs, key_file: Path) -> None:
    first, tape, shared = run(procs, key_file, "share-a", share=(True, True))
    rounds = len(tape)
    # Every push follows an optimizer step, so each carries a moment, and under lockstep each
    # round's broadcast is installed at the step after its push: every round brings the average back.
    assert shared == [rounds, rounds], (shared, rounds)
    assert all(c["moments"] == [0, 1] for c in tape), [c.get("moments") for c in tape]  # the tape says so
    second, tape2, _ = run(procs, key_file, "share-b", share=(True, True))
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between two runs with shared moments"
    assert [(c["round"], c["weights"]) for c in tape] == [(c["round"], c["weights"]) for c in tape2]
    alone, _, none = run(procs, key_file, "own", share=(False, False))
    assert none == [0, 0]
    assert any(not torch.equal(value, alone[name]) for name, value in first.items())


@pytest.mark.timeout(120)
def test_an_island_that_does_not_share_gets_no_moment_and_the_other_still_does(procs: Procs, key_file: Path) -> None:
    _, tape, shared = run(procs, key_file, "mixed", share=(True, False))
    assert shared == [len(tape), 0], shared
    assert all(c["moments"] == [0] for c in tape), [c.get("moments") for c in tape]


@pytest.mark.timeout(240)
def test_two_hf_trainer_islands_share_their_adam_moments(procs: Procs, key_file: Path) -> None:
    """The HF callback hands the Trainer's own optimizer over: its pushes carry the moment, and
    the Trainer's log says how many installs took the fleet's."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=12)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=3000, share_momentum=True) for i in range(2)]
    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    final = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        assert_bit_identical(model_tensors(model_dir(lp)), final, f"{lp.name} vs the syncer's final checkpoint")
        shared = [e["moments_shared"] for e in lp.events("train") if e.get("moments_shared") is not None]
        assert shared and shared[-1] > 0, lp.tail()
