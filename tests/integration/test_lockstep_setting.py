"""`YETO_DILOCO_LOCKSTEP`: the product's own step-pinned schedule, and the final flush.

Unlike the test-side driver of `lockstep.py`, nothing here reaches into a session: the islands are
stepped round-robin in one plain loop and the sessions themselves wait for the PULL each boundary
answers and for the merge of their last push, one step later. Two runs of the same seeds must
then end bit for bit alike, with every round answered at its own boundary.

`YETO_DILOCO_FINAL_FLUSH`: at the end every fragment's last steps are pushed and merged, so the
token ledger holds every trained token once per fragment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Procs, checkpoint_params, commits, start_syncer, syncer_exit_code
from lockstep import SeededIsland, round_robin

from syncer.durability.checkpoint import load_checkpoint, tokens_by_learner

pytestmark = pytest.mark.integration

STEPS = 31  # not a multiple of the boundary: a step is trained after the last one
H = 8  # with 4 fragments, a boundary every 2 steps


def run(procs: Procs, key_file: Path, tag: str, trips: list[float] | None = None,
        **settings: Any) -> tuple[dict[str, torch.Tensor], Any, list]:
    """One lockstep run; `trips` gets each island's mean round trip in steps."""
    syncer = start_syncer(procs, key_file=key_file, tape_name=f"{tag}.jsonl", checkpoint_name=f"{tag}.safetensors",
                          extra=["--sync-interval-steps", "0", "--pipeline", "2"])
    islands = [SeededIsland(syncer, key_file, i, lockstep=True, sync_interval=H, lockstep_timeout_s=30,
                            **settings) for i in range(2)]
    try:
        round_robin(islands, STEPS, syncer)
        if trips is not None:
            trips.extend(i.session.stats.round_trip_steps / i.session.stats.round_trips for i in islands)
    finally:
        for island in islands:
            island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    return checkpoint_params(syncer.checkpoint), load_checkpoint(syncer.checkpoint), commits(syncer.tape_records())


@pytest.mark.timeout(180)
def test_lockstep_runs_end_bit_for_bit_alike(procs: Procs, key_file: Path) -> None:
    trips: list[float] = []
    first, _, tape = run(procs, key_file, "first", trips)
    assert trips == [1.0, 1.0]  # every merge installed at the step after its push
    second, _, tape2 = run(procs, key_file, "second")
    assert first.keys() == second.keys()
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between two lockstep runs"
    # Round k is answered at boundary k: the first P rounds carry 2, 4, 6, 8 steps, every later one H.
    boundaries = STEPS // (H // 4)
    assert [c["round"] for c in tape] == list(range(boundaries))
    assert [c["steps"] for c in tape] == [[2 * (k + 1)] * 2 if k < 4 else [H, H] for k in range(boundaries)]
    assert [(c["round"], c["weights"], c["steps"]) for c in tape] == [
        (c["round"], c["weights"], c["steps"]) for c in tape2]


@pytest.mark.timeout(180)
def test_final_flush_merges_every_trained_step(procs: Procs, key_file: Path) -> None:
    _, state, tape = run(procs, key_file, "flush", final_flush=True)
    tokens = tokens_by_learner(state.ledger)
    # Every token (16 per step) reached every fragment once: the last steps were pushed at the end.
    assert tokens == {0: 4 * STEPS * 16, 1: 4 * STEPS * 16}, tokens
    assert len(tape) == STEPS // 2 + 4, [c["round"] for c in tape]

    _, state, _ = run(procs, key_file, "no-flush", final_flush=False)
    unflushed = tokens_by_learner(state.ledger)
    assert all(unflushed[i] < tokens[i] for i in (0, 1)), unflushed


@pytest.mark.timeout(180)
def test_a_longer_lockstep_round_trip_is_reproduced_step_for_step(procs: Procs, key_file: Path) -> None:
    """`lockstep_round_trip`: every merge goes in that many steps after its push (capped at H/P = 2
    here), as an unpaced run's would, and the run stays a function of steps."""
    trips: list[float] = []
    first, _, tape = run(procs, key_file, "trip-a", trips, lockstep_round_trip=5)
    second, _, tape2 = run(procs, key_file, "trip-b", lockstep_round_trip=5)
    assert trips == [2.0, 2.0]
    for name, value in first.items():
        assert torch.equal(value, second[name]), f"{name} differs between two runs of the same round trip"
    assert [(c["round"], c["weights"], c["steps"]) for c in tape] == [
        (c["round"], c["weights"], c["steps"]) for c in tape2]
    prompt, _, _ = run(procs, key_file, "trip-1")
    assert any(not torch.equal(value, prompt[name]) for name, value in first.items())  # the staleness shows
